"""fully_shard's stream protocol ([Note: fully_shard streams]), checked on the CPU.

CUDA streams cannot run here: the ranks run with ``RecordingStreams``
(tests/stream_recorder.py) injected as the roots' streams, which takes the accelerator
code path (side streams, events, deferred frees) while every op runs on the CPU at
once and is recorded on the stream current in a vector-clock model. Checked: no
consumer reads before its producer's event, no buffer is written while another stream
may still use it, no buffer is freed before the stream that allocated it has seen its
last use (the race detector's ``violations``); the next module's all-gather does not
wait for this module's forward compute, and at most two all-gathers are in flight; the
post-optim event replaces the current stream; the all-reduce hook runs on its stream;
HSDP's all-reduce runs on its own stream. The parameters after the steps equal those of
the CPU run without streams, bit for bit. A deliberately broken protocol is caught. Each
at W = 2 and 3, on layers whose flat slices are uneven at both (WIDTH).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from stream_recorder import RecordingStreams, install, key, track_shard_groups
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from vefsdp_optim import AdamW, fully_shard

N_LAYERS = 4
WIDTH = 9  # 90 elements a layer: flat slices of 48/42 at W = 2, 32/32/26 at W = 3


def _model(mp: MixedPrecisionPolicy | None = None, hsdp: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(N_LAYERS)])
    mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("rep", "shard")) if hsdp else None
    for layer in model:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def _train(model: nn.Module, steps: int, rec: RecordingStreams | None = None,
           between=None) -> list[torch.Tensor]:  # noqa: ANN001
    opt = AdamW(model.parameters(), lr=0.1)
    x = torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(1))
    for step in range(steps):
        if rec is not None:
            rec.phase = f"fwd{step}"
        loss = model(x).square().sum()
        if rec is not None:
            rec.phase = f"bwd{step}"
        loss.backward()
        if rec is not None:
            rec.phase = f"opt{step}"
        opt.step()
        opt.zero_grad()
        if between is not None:
            between(model, step)
    return [p.detach().to_local().clone() if hasattr(p, "to_local") else p.detach().clone()
            for p in model.parameters()]


def _recorded(steps: int, mp: MixedPrecisionPolicy | None = None, hsdp: bool = False,
              between=None, setup=None) -> tuple[RecordingStreams, list[torch.Tensor], nn.Module]:  # noqa: ANN001
    rec = RecordingStreams()
    with install(rec):
        model = _model(mp, hsdp)
        track_shard_groups(rec, model)
        if setup is not None:
            setup(model, rec)
        with rec.recording():
            params = _train(model, steps, rec, between)
    return rec, params, model


def _bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _global_key(model: nn.Sequential, i: int) -> int:
    store = model[i]._vefsdp_state.shard_group.stores[0]
    return key(store.compute._global)


def _protocol() -> dict[str, object]:
    out: dict[str, object] = {}
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for name, policy in (("fp32", None), ("bf16", mp)):
        rec, params, model = _recorded(2, policy)
        out[f"{name}_violations"] = rec.violations[:5]
        out[f"{name}_bitwise"] = _bitwise(params, _train(_model(policy), 2))
        gathers = [op for op in rec.ops if op.label == "all_gather" and op.phase[:3] in ("fwd", "bwd")]
        out[f"{name}_gather_streams"] = sorted({op.stream for op in gathers})
        out[f"{name}_rs_streams"] = sorted({op.stream for op in rec.ops if op.label == "reduce_scatter"})
        casts = [op for op in rec.ops if op.phase.startswith("fwd") and op.label == "copy_" and op.stream == "copy_in"]
        out[f"{name}_casts_on_copy_in"] = len(casts)
        # implicit forward prefetch, steady state (second step): module k's all-gather does
        # not wait for module k-1's compute, and waits for module k-2's (two in flight)
        overlap, limited = [], []
        for k in range(1, N_LAYERS):
            buf = _global_key(model, k)
            ag = next(op for op in rec.ops if op.phase == "fwd1" and op.label == "all_gather" and buf in op.writes)
            prev = [op for op in rec.ops if op.phase == "fwd1" and op.stream == "default"
                    and _global_key(model, k - 1) in op.reads]
            overlap.append(bool(prev) and not rec.hb(prev[0], ag))
            if k >= 2:
                older = [op for op in rec.ops if op.phase == "fwd1" and op.stream == "default"
                         and _global_key(model, k - 2) in op.reads]
                limited.append(bool(older) and rec.hb(older[-1], ag))
        out[f"{name}_overlap"] = overlap
        out[f"{name}_at_most_two"] = limited
        frees = [e for e in rec.log if e[0] == "free" and e[1].endswith("._global")]
        out[f"{name}_gathered_frees"] = len(frees)
    return out


def _hook_stream() -> dict[str, object]:
    out: dict[str, object] = {}
    seen: list[str] = []
    holder: dict[str, RecordingStreams] = {}

    def hook(t: torch.Tensor) -> None:
        seen.append(holder["rec"].current().name)
        t.mul_(0.5)

    def setup(model: nn.Module, rec: RecordingStreams) -> None:
        holder["rec"] = rec
        for m in model.modules():
            if hasattr(m, "set_all_reduce_hook"):
                m.set_all_reduce_hook(hook, stream=rec.stream("hook"))

    rec, params, _ = _recorded(2, setup=setup)
    out["violations"] = rec.violations[:5]
    out["hook_streams"] = sorted(set(seen))
    ref_seen: list[str] = []
    base = _model()
    for m in base.modules():
        if hasattr(m, "set_all_reduce_hook"):
            m.set_all_reduce_hook(lambda t: (ref_seen.append("cpu"), t.mul_(0.5)))
    out["bitwise"] = _bitwise(params, _train(base, 2))
    out["calls"] = (len(seen), len(ref_seen))
    return out


def _post_optim_event() -> dict[str, object]:
    out: dict[str, object] = {}
    marks: dict[str, object] = {}

    def between(use_event: bool):  # noqa: ANN202
        def fn(model: nn.Module, step: int) -> None:
            rec = marks["rec"]
            ev = rec.event()
            ev.record()  # after the optimizer step, on the current stream
            marks[f"unrelated{step}"] = rec.access("unrelated", [], [])  # work the gathers need not wait for
            if use_event:
                model.set_post_optim_event(ev)
        return fn

    def setup(model: nn.Module, rec: RecordingStreams) -> None:
        marks["rec"] = rec

    for use_event in (True, False):
        rec, params, model = _recorded(2, between=between(use_event), setup=setup)
        first = next(op for op in rec.ops if op.phase == "fwd1" and op.label == "all_gather")
        last_opt = [op for op in rec.ops if op.phase == "opt0" and op.writes]
        out[f"{use_event}_violations"] = rec.violations[:5]
        out[f"{use_event}_after_optimizer"] = bool(last_opt) and rec.hb(last_opt[-1], first)
        out[f"{use_event}_after_unrelated"] = rec.hb(marks["unrelated0"], first)
    return out


def _hsdp() -> dict[str, object]:
    rec, params, _ = _recorded(2, hsdp=True)
    out: dict[str, object] = {"violations": rec.violations[:5]}
    out["all_reduce_streams"] = sorted({op.stream for op in rec.ops if op.label == "all_reduce"})
    out["bitwise"] = _bitwise(params, _train(_model(hsdp=True), 2))
    model = _model(hsdp=True)
    try:
        model[0].set_all_reduce_hook(lambda t: None, stream=RecordingStreams().stream("hook"))
        out["stream_refused"] = False
    except ValueError:
        out["stream_refused"] = True
    return out


def _broken() -> dict[str, object]:
    """The protocol without the all-gather streams' waits: the recorder must see it."""
    from vefsdp_optim._fsdp._streams import CommContext

    saved = CommContext.gather_streams_wait
    CommContext.gather_streams_wait = lambda self, event: None
    try:
        rec, _, _ = _recorded(2)
    finally:
        CommContext.gather_streams_wait = saved
    return {"violations": len(rec.violations)}


@pytest.mark.parametrize("world_size", [2, 3])
def test_stream_protocol(world_size: int) -> None:
    for res in run_distributed(_protocol, world_size):
        for name in ("fp32", "bf16"):
            assert res[f"{name}_violations"] == [], res
            assert res[f"{name}_bitwise"], res
            assert res[f"{name}_gather_streams"] == ["all_gather"], res
            assert res[f"{name}_rs_streams"] == ["reduce_scatter"], res
            assert all(res[f"{name}_overlap"]) and len(res[f"{name}_overlap"]) == N_LAYERS - 1, res
            assert all(res[f"{name}_at_most_two"]) and len(res[f"{name}_at_most_two"]) == N_LAYERS - 2, res
            assert res[f"{name}_gathered_frees"] > 0, res
        assert res["bf16_casts_on_copy_in"] > 0, res


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_reduce_hook_runs_on_its_stream(world_size: int) -> None:
    for res in run_distributed(_hook_stream, world_size):
        assert res["violations"] == [], res
        assert res["hook_streams"] == ["hook"], res
        assert res["bitwise"], res
        assert res["calls"][0] == res["calls"][1] > 0, res


@pytest.mark.parametrize("world_size", [2, 3])
def test_post_optim_event_replaces_the_current_stream(world_size: int) -> None:
    for res in run_distributed(_post_optim_event, world_size):
        assert res["True_violations"] == [] and res["False_violations"] == [], res
        assert res["True_after_optimizer"] and res["False_after_optimizer"], res
        assert not res["True_after_unrelated"], res  # waits on the event only
        assert res["False_after_unrelated"], res  # waits on the whole current stream


@pytest.mark.parametrize("world_size", [2, 3])
def test_hsdp_all_reduce_on_its_stream(world_size: int) -> None:
    for res in run_distributed(_hsdp, world_size):
        assert res["violations"] == [], res
        assert res["all_reduce_streams"] == ["all_reduce"], res
        assert res["bitwise"], res
        assert res["stream_refused"], res


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_recorder_catches_a_missing_wait(world_size: int) -> None:
    for res in run_distributed(_broken, world_size):
        assert res["violations"] > 0, res


@pytest.mark.parametrize("bad", [object(), 3])
def test_post_optim_event_and_hook_stream_are_checked(bad: object) -> None:
    from vefsdp_optim._fsdp._streams import check_event, check_stream

    with pytest.raises(TypeError, match="event must be"):
        check_event(bad)
    with pytest.raises(TypeError, match="stream must be"):
        check_stream(bad)
