"""Every optimizer on plain parameters, FSDP2 and our ``fully_shard``, bit for bit against
an unsharded reference, with a DCP round trip and the sync check (``make gpu-check``).

The optimizers, their hyperparameters and their references are the differential fuzz
test's (tests/test_fuzz_sequences.py: ``NAMES``, ``KWARGS``, ``TORCH_ORACLE``, ``_groups``): AdamW and Muon
against torch.optim.AdamW / torch.optim.Muon, the others against the same class on one
device; four parameters in three param groups with different learning rates.

[Note: the reference sees the reduced gradient]
After each backward the sharded run's full gradient (what the reduce-scatter gave) is
gathered and fed to the reference, so the comparison of parameters is of the
optimizers alone, bit for bit, whatever order or formula the backend averages with
(NCCL's average of W ranks may multiply by 1/W first). Every rank feeds the same
gradient g, so the reduced gradient is checked on its own against ``average_like_ranks(g,
W)`` (the sum of W copies over W): bit for bit where W is a power of two, where every
formula gives g exactly; at other W the largest difference is reported, not judged.
"""

from __future__ import annotations

import os
import shutil
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import tools._checkout  # noqa: F401 - before vefsdp_optim: [Note: checkout imports]
from tools._checkout import ROOT
from tools._gpu_parts import progress, run_on_ranks
from tools._gpu_sync import SyncWatch, strict_step

if str(ROOT / "tests") not in sys.path:  # the suite's helpers import each other by plain name
    sys.path.insert(0, str(ROOT / "tests"))

from dist_utils import average_like_ranks  # noqa: E402
from test_fuzz_sequences import KWARGS, NAMES, SHAPES, TORCH_ORACLE, _groups  # noqa: E402

import vefsdp_optim  # noqa: E402

__all__ = ["SIZES", "check_case", "correctness_part"]

# "tiny": the fuzz test's shapes and hyperparameters; "gpu": larger uneven matrices, and
# AdamW8bit at its default block size 256 and 8-bit threshold (two 8-bit tensors, two fp32)
SIZES: dict[str, tuple[list[tuple[int, ...]], dict[str, dict[str, Any]]]] = {
    "tiny": (list(SHAPES), KWARGS),
    "gpu": ([(67, 45), (130, 72), (48, 96), (33, 64)],
            {**KWARGS, "AdamW8bit": dict(lr=1e-2, weight_decay=0.1)}),
}
# around the DCP round trip; under SyncWatch all but the first step of each optimizer (the
# one that loaded the checkpoint too), where a layout check may read its collective's result
STEPS_BEFORE, STEPS_AFTER = 3, 2


class Bag(nn.Module):
    """Parameters whose gradient is the given tensor exactly: forward is sum(p * g)."""

    def __init__(self, shapes: list[tuple[int, ...]]) -> None:
        super().__init__()
        self.n = len(shapes)
        for i, s in enumerate(shapes):
            setattr(self, f"p{i}", nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(7 + i))))

    def params(self) -> list[nn.Parameter]:
        return [getattr(self, f"p{i}") for i in range(self.n)]

    def forward(self, gs: list[torch.Tensor]) -> torch.Tensor:
        return sum((p * g).sum() for p, g in zip(self.params(), gs, strict=True))


def _grads(k: int, shapes: list[tuple[int, ...]], device: str) -> list[torch.Tensor]:
    return [torch.randn(s, generator=torch.Generator().manual_seed(1000 * k + i)).to(device)
            for i, s in enumerate(shapes)]


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a plain, FSDP2 or fully_shard parameter (or gradient), read
    outside autograd (a differentiable full_tensor() would join the next backward)."""
    with torch.no_grad():
        return t.full_tensor().detach() if hasattr(t, "full_tensor") else t.detach().clone()


def _build(kind: str, shapes: list[tuple[int, ...]], device: str, name: str,
           kwargs: dict[str, dict[str, Any]]) -> tuple[nn.Module, list[nn.Parameter], torch.optim.Optimizer]:
    model = Bag(shapes).to(device)
    if kind != "plain":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(torch.device(device).type, (dist.get_world_size(),))
        if kind == "fsdp2":
            from torch.distributed.fsdp import fully_shard
        else:
            from vefsdp_optim import fully_shard
        fully_shard(model, mesh=mesh)
    params = model.params()
    return model, params, _make(name, False, params, kwargs)


def _make(name: str, oracle: bool, params: list[nn.Parameter],
          kwargs: dict[str, dict[str, Any]]) -> torch.optim.Optimizer:
    """tests/test_fuzz_sequences.py's ``_make`` with its three param groups, ``kwargs``
    for its hyperparameters: torch.optim's class for an oracle where torch has it."""
    cls = getattr(torch.optim, name) if oracle and name in TORCH_ORACLE else getattr(vefsdp_optim, name)
    return cls(_groups(params, 1), **kwargs[name])


def _reference(name: str, shapes: list[tuple[int, ...]], device: str,
               kwargs: dict[str, dict[str, Any]]) -> tuple[list[nn.Parameter], torch.optim.Optimizer]:
    params = Bag(shapes).to(device).params()
    return params, _make(name, True, params, kwargs)


def _diff(a: torch.Tensor, b: torch.Tensor) -> dict[str, Any]:
    d = (a.double() - b.double()).abs()
    return {"max_abs": float(d.max()), "n_diff": int((a != b).sum()), "numel": a.numel()}


def _tb(e: BaseException) -> str:
    return "".join(traceback.format_exception(type(e), e, e.__traceback__)[-6:])[-2500:]


def check_case(kind: str, name: str, size: str, device: str, ckpt_dir: str | None) -> dict[str, Any]:
    """One optimizer on ``kind`` parameters ("plain", "fsdp2", "fully_shard"): steps
    against the reference, the reduced gradients, a DCP round trip (sharded kinds, when
    ``ckpt_dir``), the syncs of every step after each optimizer's first, and at W = 1 one step under
    the sync debug mode's "error" (at W > 1 a rank alone in an error would hang the others)."""
    shapes, kwargs = SIZES[size]
    world = dist.get_world_size() if kind != "plain" else 1
    exact_grads = world & (world - 1) == 0
    rec: dict[str, Any] = dict(kind=kind, optimizer=name, world=world, ok=False, error=None, steps=0,
                               mismatch=None, grads=dict(equal=True, exact_expected=exact_grads, max_abs=0.0),
                               dcp=None, sync=dict(events={}, strict=None))
    events: list[tuple[int, str]] = []  # (step, where)
    warmups = {0}  # and the first step after a load: not watched
    stage = "build"
    try:
        model, params, opt = _build(kind, shapes, device, name, kwargs)
        ref_params, ref = _reference(name, shapes, device, kwargs)

        def step(k: int, model: nn.Module, params: list[nn.Parameter], opt: torch.optim.Optimizer) -> None:
            gs = _grads(k, shapes, device)
            model(gs).backward()
            for i, (p, rp, g) in enumerate(zip(params, ref_params, gs, strict=True)):
                full = _full(p.grad)  # [Note: the reference sees the reduced gradient]
                want = average_like_ranks(g, world)
                if not torch.equal(full, want):
                    rec["grads"]["equal"] = False
                    rec["grads"]["max_abs"] = max(rec["grads"]["max_abs"], _diff(full, want)["max_abs"])
                    rec["grads"].setdefault("first", dict(step=k, param=i))
                rp.grad = full
            # the first step of each optimizer checks its layouts ([Note: consistent steps]), which may sync
            if k in warmups:
                opt.step()
            else:
                with SyncWatch(device, opt) as watch:
                    opt.step()
                events.extend((k, ev) for ev in watch.events)
            ref.step()
            opt.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
            rec["steps"] = k + 1
            if rec["mismatch"] is None:
                for i, (p, rp) in enumerate(zip(params, ref_params, strict=True)):
                    got = _full(p)
                    if not torch.equal(got, rp.detach()):
                        rec["mismatch"] = dict(step=k, param=i, shape=list(rp.shape), **_diff(got, rp.detach()))
                        break

        stage = "steps"
        for k in range(STEPS_BEFORE):
            step(k, model, params, opt)
        if kind != "plain" and ckpt_dir is not None:
            stage = "dcp"
            rec["dcp"] = dict(ok=False, loaded_equal=None, resumed_equal=None, error=None)
            model, params, opt = _dcp_round_trip(kind, name, size, device, kwargs, model, params, opt,
                                                 ckpt_dir, rec["dcp"])
            stage = "steps after the round trip"
            warmups.add(STEPS_BEFORE)
            before = rec["mismatch"]
            for k in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER):
                step(k, model, params, opt)
            # not judged (None) where the steps before the round trip already differed
            rec["dcp"]["resumed_equal"] = None if before is not None else rec["mismatch"] is None
            rec["dcp"]["ok"] = bool(rec["dcp"]["loaded_equal"]) and rec["dcp"]["resumed_equal"] is not False
        else:
            for k in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER):
                step(k, model, params, opt)
        if world == 1:
            stage = "strict sync step"
            model(_grads(99, shapes, device)).backward()
            rec["sync"]["strict"] = strict_step(device, opt)
    except Exception as e:  # noqa: BLE001 - reported per case
        rec["error"] = f"in {stage}: {_tb(e)}"
        if rec["dcp"] is not None and stage == "dcp":
            rec["dcp"]["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    counts: dict[str, int] = {}
    steps: dict[str, list[int]] = {}
    for k, ev in events:
        counts[ev] = counts.get(ev, 0) + 1
        if k not in steps.setdefault(ev, []):
            steps[ev].append(k)
    rec["sync"]["events"], rec["sync"]["steps"] = counts, steps
    rec["ok"] = (rec["error"] is None and rec["mismatch"] is None
                 and (rec["grads"]["equal"] or not exact_grads)
                 and (rec["dcp"] is None or rec["dcp"]["ok"]))
    rec["sync_ok"] = not counts and rec["sync"]["strict"] in (None, "ok") and rec["error"] is None
    return rec


def _dcp_round_trip(kind: str, name: str, size: str, device: str, kwargs: dict[str, dict[str, Any]],
                    model: nn.Module, params: list[nn.Parameter], opt: torch.optim.Optimizer,
                    ckpt_dir: str, out: dict[str, Any]) -> tuple[nn.Module, list[nn.Parameter], torch.optim.Optimizer]:
    """vefsdp_optim.save of the model and optimizer state, load into a fresh model and
    optimizer (as tests/test_fuzz_sequences.py's phases do); the fresh ones."""
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    shapes = SIZES[size][0]
    before = [_full(p) for p in params]
    opt.zero_grad(set_to_none=True)  # DCP's _init_optim_state steps only where no gradient is set
    vefsdp_optim.save({"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}, ckpt_dir)
    model2, params2, opt2 = _build(kind, shapes, device, name, kwargs)
    sd = {"model": model2.state_dict(), "optim": get_optimizer_state_dict(model2, opt2)}
    vefsdp_optim.load(sd, ckpt_dir)
    set_model_state_dict(model2, sd["model"])
    set_optimizer_state_dict(model2, opt2, sd["optim"])
    out["loaded_equal"] = all(torch.equal(_full(p), b) for p, b in zip(params2, before, strict=True))
    return model2, params2, opt2


def _rank_cases(kind: str, size: str, device: str, ckpt_root: str, names: list[str]) -> list[dict[str, Any]]:
    out = []
    for name in names:
        progress({"start": f"{kind} {name}"})
        where = None if kind == "plain" else os.path.join(ckpt_root, name)
        if where is not None:
            os.makedirs(ckpt_root, exist_ok=True)
        rec = check_case(kind, name, size, device, where)
        progress(rec)
        out.append(rec)
    return out


def correctness_part(part: str, world: int, device: str, size: str, part_dir: Path,
                     optimizers: list[str] | None = None) -> dict[str, Any]:
    """Every optimizer (or ``optimizers``) on ``part`` parameters at ``world`` ranks: the
    cases of rank 0, with another rank's differing verdict or error added to it."""
    names = list(NAMES) if optimizers is None else optimizers
    unknown = sorted(set(names) - set(NAMES))
    if unknown:
        raise ValueError(f"optimizers: unknown {unknown}; accepted: {', '.join(NAMES)}")
    ckpt_root = part_dir / "ckpt"
    shutil.rmtree(ckpt_root, ignore_errors=True)
    per_rank = run_on_ranks(_rank_cases, 0 if part == "plain" else world, device, part_dir, part, size,
                            device, str(ckpt_root), names)
    cases = per_rank[0]
    for r, other in enumerate(per_rank[1:], start=1):
        for c, o in zip(cases, other, strict=True):
            if o["ok"] != c["ok"] or o["error"] or o["sync"]["events"] != c["sync"]["events"]:
                c.setdefault("other_ranks", {})[str(r)] = {k: o[k] for k in ("ok", "error", "mismatch", "sync")}
                c["ok"] = c["ok"] and o["ok"]
                c["sync_ok"] = c["sync_ok"] and o["sync_ok"]
    shutil.rmtree(ckpt_root, ignore_errors=True)
    return dict(kind="correctness", world=1 if part == "plain" else world, cases=cases,
                status="pass" if all(c["ok"] for c in cases) else "fail")
