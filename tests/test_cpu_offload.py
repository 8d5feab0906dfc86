"""CPUOffloadPolicy (see ``DtypeStore`` in vefsdp_optim/_fsdp/_store.py), on the CPU.

A mesh on the CPU takes the offload layout too: the master buffer (sharded parameters,
gradients, the optimizer's data) apart from the compute and reduce buffers, the
all-gather's copy-in a copy of the shard, the reduce-scatter's output copied back into
the master's gradient. Its parameters after AdamW steps (with kept gradients, mixed
precision, HSDP) equal those of the run without offload, bit for bit. With the
recording streams of tests/stream_recorder.py (the accelerator code path) the copies run
on the copy-in and reduce-scatter streams, the race detector finds nothing, and the
root's final callback synchronizes the host before the optimizer runs on it. At W = 2 and
3 (the slow tier), on layers whose flat slices are uneven at both (WIDTH). What needs
a GPU (pinned memory, asynchronous copies, NCCL) has not run.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from stream_recorder import RecordingStreams, install, key, track_shard_groups
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

from vefsdp_optim import AdamW, fully_shard

WIDTH = 9  # 90 elements a layer: flat slices of 48/42 at W = 2, 32/32/26 at W = 3


def _model(offload: bool, mp: MixedPrecisionPolicy | None = None, hsdp: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(3)])
    mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("rep", "shard")) if hsdp else None
    policy = CPUOffloadPolicy() if offload else None
    for layer in model:
        fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=policy)
    return model


def _train(model: nn.Module, steps: int = 2, accumulate: int = 2) -> list[torch.Tensor]:
    opt = AdamW(model.parameters(), lr=0.1)
    x = torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        for i in range(accumulate):  # kept gradients: the second backward adds to the first
            model(x + i).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().to_local().clone() for p in model.parameters()]


def _bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _offload() -> dict[str, object]:
    out: dict[str, object] = {}
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    # hsdp_bf16: one rank per shard, where the cast writes the gathered buffer itself
    for name, mp, hsdp in (("fp32", None, False), ("bf16", bf16, False), ("hsdp", None, True),
                           ("hsdp_bf16", bf16, True)):
        model = _model(True, mp, hsdp)
        store = model[0]._vefsdp_state.shard_group.stores[0]
        out[f"{name}_apart"] = store.compute is not store.master and store.reduce is not store.master
        base = _train(_model(False, mp, hsdp))
        out[f"{name}_bitwise"] = _bitwise(_train(model), base)
        rec = RecordingStreams()
        with install(rec):
            model = _model(True, mp, hsdp)
            track_shard_groups(rec, model)
            with rec.recording():
                params = _train(model)
        out[f"{name}_streams_bitwise"] = _bitwise(params, base)
        out[f"{name}_violations"] = rec.violations[:5]
        store = model[0]._vefsdp_state.shard_group.stores[0]
        master, compute, reduce = (key(t) for t in (store.master.local, store.compute.local,
                                                   store.master.local_grad))
        h2d = {op.stream for op in rec.ops if master in op.reads and compute in op.writes}
        d2h = {op.stream for op in rec.ops if op.writes == [reduce] and key(store.reduce.local_grad) in op.reads}
        out[f"{name}_h2d"] = sorted(h2d)
        out[f"{name}_d2h"] = sorted(d2h)
        out[f"{name}_host_syncs"] = sum(1 for e in rec.log if e[0] == "synchronize")
        # a backward without a reduction (no sync) leaves the host free, as FSDP2's
        rec = RecordingStreams()
        with install(rec):
            model = _model(True, mp, hsdp)
            track_shard_groups(rec, model)
            with rec.recording():
                model.set_requires_gradient_sync(False)
                model(torch.ones(3, WIDTH)).sum().backward()
        out[f"{name}_no_sync_host_syncs"] = sum(1 for e in rec.log if e[0] == "synchronize")
    return out


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])  # W = 3: 1-2 s
def test_cpu_offload_matches_no_offload(world_size: int) -> None:
    for res in run_distributed(_offload, world_size):
        for name in ("fp32", "bf16", "hsdp", "hsdp_bf16"):
            assert res[f"{name}_apart"], res
            assert res[f"{name}_bitwise"] and res[f"{name}_streams_bitwise"], res
            assert res[f"{name}_violations"] == [], res
            assert res[f"{name}_h2d"] == ["copy_in"], res
            assert res[f"{name}_d2h"] == (["all_reduce"] if "hsdp" in name else ["reduce_scatter"]), res
            assert res[f"{name}_host_syncs"] >= 4, res  # one per offloaded reduction
            assert res[f"{name}_no_sync_host_syncs"] == 0, res
