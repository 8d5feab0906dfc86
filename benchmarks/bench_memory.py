"""Peak memory and step time of the framework-style step: fully_shard vs FSDP2.

    python -m benchmarks.bench_memory [--quick|--full] [--out benchmarks/out/bench_memory.json]

The toy GPT of ``bench_fully_shard`` (4 blocks, d = 256, 3.45 M fp32 parameters) at
W = 2 and 4, each block and then the root sharded, trained the way frameworks do:
loss, backward, ``clip_grad_norm_``, AdamW, an LR scheduler, ``zero_grad``; with
activation checkpointing off, and on every block (``checkpoint_wrapper``, non-reentrant).
Ours is vefsdp_optim's ``fully_shard`` + ``vefsdp_optim.AdamW``; the peer is FSDP2 +
``torch.optim.AdamW(foreach=True)``; same weights, same batches.

- *memory*: live tensor bytes at the allocator level ([Note: live-bytes tracker] in
  ``_memtrack.py``): every storage created from the model's deep copy on, counted once
  while it lives, the data and the initial weights excluded. The peak is the highest
  step peak over the measured steps (the build is not a step); on CUDA the row also has
  ``torch.cuda.max_memory_allocated`` minus the bytes allocated before the build. Each
  system is measured alone (the other one does not exist yet or any more).
- *breakdown* at a steady-state step's peak, by what holds each live storage at that
  moment: ``params`` (sharded parameters), ``grads`` (sharded gradients, ours also
  while a reduce-scatter is writing them), ``opt``
  (optimizer state), ``unsharded`` (all-gathered parameters, unsharded gradients and
  the collectives' buffers: our global buffers; FSDP2's unsharded parameters, their
  grads, all-gather outputs and reduce-scatter inputs), ``act`` (tensors autograd saved
  for backward), ``other`` (everything else: AC's stashed inputs and recomputation,
  gradients in flight between ops, logits, temporaries).
- *floor*: the lowest peak ratio any FSDP can reach on this model and optimizer
  ([Note: memory floor]).
- *timing*: both systems in the same ranks, alternating every step after a warm-up
  (``interleave``: barrier before each call, the slowest rank's time); the ratio is the
  median (quartiles) of the per-step ratios ours / FSDP2.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterable
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from benchmarks._common import (
    cli,
    current_device,
    interleave,
    paired_ratio,
    result,
    spawn,
    stats,
    synchronize,
)
from benchmarks._memtrack import LiveBytes
from benchmarks.bench_fully_shard import BATCH, VOCAB, ToyGPT, _data, _num_params
from benchmarks.bench_fully_shard import _build as build_sharded

WORLDS = (2, 4)
CATEGORIES = ("params", "grads", "opt", "unsharded", "act", "other")
MiB = 2**20


# -- the framework-style step -------------------------------------------------------------

def _build(system: str, base: nn.Module, device: str, ac: bool) -> tuple[nn.Module, Any, Any]:
    model, opt = build_sharded(system, base, device, ac)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.01 * s))
    return model, opt, sched


def _step(model: nn.Module, opt: torch.optim.Optimizer, sched: Any, tok: torch.Tensor,
          saved: list | None = None) -> float:
    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(weakref.ref(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if saved is not None else nullcontext():
        logits = model(tok[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tok[:, 1:].reshape(-1))
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


# -- what holds the bytes -------------------------------------------------------------------

def _tensors(x: Any) -> Iterable[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)
    elif isinstance(x, list | tuple):
        for v in x:
            yield from _tensors(v)


def _unsharded_ours(model: nn.Module) -> list[torch.Tensor]:
    from vefsdp_optim._fsdp._module import FSDPModule, state_of

    out = []
    for m in model.modules():
        if isinstance(m, FSDPModule) and state_of(m).shard_group is not None:
            for store in state_of(m).shard_group.stores:
                buffers = (store.master, store.compute, store.reduce)
                for buffer in {id(buffer): buffer for buffer in buffers}.values():
                    out += [buffer._global, buffer._grad_global]
                out += [t for t in (store._kept,) if t is not None]
    return out


def _unsharded_fsdp2(model: nn.Module) -> list[torch.Tensor]:
    from torch.distributed.fsdp import FSDPModule, fully_shard

    out: list[torch.Tensor] = []
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        fsdp_param_group = fully_shard.state(m)._fsdp_param_group
        if fsdp_param_group is None:
            continue
        for fp in fsdp_param_group.fsdp_params:
            u = getattr(fp, "_unsharded_param", None)
            if u is not None:
                out.append(u)
                if u.grad is not None:
                    out.append(u.grad)
            out += list(getattr(fp, "all_gather_outputs", []))
            out += list(_tensors(getattr(fp, "_unsharded_inner_tensors", [])))
        agr = fsdp_param_group._all_gather_result
        if agr is not None:
            out.append(agr.all_gather_output)
        for rs_state in getattr(fsdp_param_group.comm_ctx, "reduce_scatter_states", []) or []:
            out.append(rs_state.reduce_scatter_input)
        ags = getattr(fsdp_param_group.comm_ctx, "all_gather_state", None)
        if ags is not None:
            out += list(_tensors(getattr(ags, "all_gather_result", None) and
                                 ags.all_gather_result.all_gather_output))
        out += [t for t in (getattr(fsdp_param_group, "_partial_reduce_output", None),) if t is not None]
    return out


def _shard_grads_ours(model: nn.Module) -> list[torch.Tensor]:
    """Our shard gradients, also while a reduce-scatter writes them (no .grad yet)."""
    from vefsdp_optim._fsdp._module import FSDPModule, state_of

    return [store.master.local_grad for m in model.modules()
            if isinstance(m, FSDPModule) and state_of(m).shard_group is not None
            for store in state_of(m).shard_group.stores]


def _labeler(system: str, model: nn.Module, opt: torch.optim.Optimizer, saved: list):  # noqa: ANN202
    unsharded = _unsharded_ours if system == "ours" else _unsharded_fsdp2
    shard_grads = _shard_grads_ours if system == "ours" else (lambda m: [])

    def label() -> dict[str, list[torch.Tensor]]:
        ps = [p for g in opt.param_groups for p in g["params"]]  # sharded, even while registered unsharded
        return {  # first match wins: the root's unsharded params are registered on the model
            "unsharded": unsharded(model),
            "params": ps,
            "grads": [p.grad for p in ps if p.grad is not None] + shard_grads(model),
            "opt": list(_tensors(list(opt.state.values()))),
            "act": [t for t in (r() for r in saved) if t is not None],
        }

    return label


# -- ranks ------------------------------------------------------------------------------------

def _measure(system: str, base: nn.Module, data: torch.Tensor, device: str, ac: bool,
             steps: int) -> dict[str, Any]:
    cuda = device.startswith("cuda")
    gc.collect()
    synchronize(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    saved: list = []
    with LiveBytes() as m:
        model, opt, sched = _build(system, base, device, ac)
        label = _labeler(system, model, opt, saved)
        built = m.live
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        peaks, k = [], 0
        while k < steps or (m.breakdown is None and k < steps + 3):
            if k == steps - 1 or k >= steps:
                m.watch(peaks[-1] if peaks else 0, label)
            m.reset_peak()
            saved.clear()
            _step(model, opt, sched, data[k], saved)
            peaks.append(m.peak)
            k += 1
        m.unwatch()
        synchronize(device)
        row = {"built": built, "peak": max(peaks), "step_peaks": peaks, "end": m.live,
               "breakdown": m.breakdown or {}, "other_by_op": m.other_by_op}
        if cuda:
            row["cuda_max_allocated"] = torch.cuda.max_memory_allocated(device) - before
    del model, opt, sched, label
    gc.collect()
    return row


def _rank(ac: bool, steps: int, warmup: int, mem_steps: int) -> dict[str, Any]:
    device = current_device()
    torch.manual_seed(0)
    base = ToyGPT().to(device)
    data = _data(max(steps + warmup, mem_steps) + 4, device)
    mem = {s: _measure(s, base, data, device, ac, mem_steps) for s in ("fsdp2", "ours")}
    systems = {s: _build(s, base, device, ac) for s in ("ours", "fsdp2")}
    first = {s: _step(*systems[s], data[0]) for s in systems}  # same weights, same batch
    it = {s: iter(range(1, data.shape[0])) for s in systems}
    runners = {s: (lambda s=s: _step(*systems[s], data[next(it[s])])) for s in systems}
    times = interleave(runners, steps, warmup, group=dist.group.WORLD, device=device)
    return {"mem": mem, "times": times, "first_loss": first, "device": device}


# -- run ----------------------------------------------------------------------------------------

def _row(w: int, ac: bool, per_rank: list[dict[str, Any]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    r0 = per_rank[0]
    t = r0["times"]
    gap = abs(r0["first_loss"]["ours"] - r0["first_loss"]["fsdp2"])
    if not gap <= 1e-4 * abs(r0["first_loss"]["fsdp2"]):
        raise AssertionError(f"W={w} ac={ac}: first losses differ: {r0['first_loss']}")
    peak = {s: max(r["mem"][s]["peak"] for r in per_rank) for s in ("ours", "fsdp2")}
    row = {
        "W": w, "AC": "on" if ac else "off",
        "step_ms_ours": stats(t["ours"], 1e3), "step_ms_fsdp2": stats(t["fsdp2"], 1e3),
        "time_ratio": paired_ratio(t["ours"], t["fsdp2"]),
        "peak_MiB_ours": peak["ours"] / MiB, "peak_MiB_fsdp2": peak["fsdp2"] / MiB,
        "peak_ratio": peak["ours"] / peak["fsdp2"],
    }
    if "cuda_max_allocated" in r0["mem"]["ours"]:
        cm = {s: max(r["mem"][s]["cuda_max_allocated"] for r in per_rank) for s in ("ours", "fsdp2")}
        row.update({"cuda_max_MiB_ours": cm["ours"] / MiB, "cuda_max_MiB_fsdp2": cm["fsdp2"] / MiB,
                    "cuda_max_ratio": cm["ours"] / cm["fsdp2"]})
    breakdown = []
    for s in ("ours", "fsdp2"):
        b = r0["mem"][s]["breakdown"]
        breakdown.append({"W": w, "AC": row["AC"], "system": s, "peak_MiB": b.get("total", 0) / MiB,
                          **{f"{c}_MiB": b.get(c, 0) / MiB for c in CATEGORIES},
                          "persistent_MiB": r0["mem"][s]["built"] / MiB})
    ours, peer = breakdown
    breakdown.append({"W": w, "AC": row["AC"], "system": "ours - fsdp2",
                      **{k: ours[k] - peer[k] for k in ours if k.endswith("_MiB")}})
    # [Note: memory floor]
    fb = r0["mem"]["fsdp2"]["breakdown"]
    if fb.get("total"):
        floor = fb["total"] - fb.get("unsharded", 0)
        row["floor_ratio"] = floor / fb["total"]
        row["floor_block_ratio"] = (floor + _block_bytes()) / fb["total"]
    return row, breakdown


# [Note: memory floor]
# At FSDP2's peak, the bytes that are not FSDP buffers (activations, temporaries,
# optimizer state, sharded parameters and gradients) are what any FSDP running the same
# model and optimizer holds at that moment of the step. So ``floor_ratio`` = (FSDP2's
# peak - its unsharded bytes) / its peak is the lowest peak ratio that sharding alone
# can reach here, and ``floor_block_ratio`` adds the largest block's unsharded
# parameters, which must exist while that block computes. A goal below the floor needs
# fewer activations or less optimizer state, not a better FSDP.


def _block_bytes() -> int:
    """Bytes of the largest block's unsharded parameters (fp32)."""
    with torch.device("meta"):
        m = ToyGPT()
    return max(sum(p.numel() * p.element_size() for p in b.parameters()) for b in m.layers)


def run(quick: bool = True) -> dict[str, Any]:
    steps, warmup, mem_steps = (6, 2, 3) if quick else (30, 3, 5)
    rows, breakdown, notes = [], [], []
    for w in WORLDS:
        for ac in (False, True):
            per_rank = spawn(_rank, w, ac, steps, warmup, mem_steps)
            row, b = _row(w, ac, per_rank)
            rows.append(row)
            breakdown += b
            notes.append(f"W={w} AC={row['AC']}: step peaks (rank 0, MiB) ours "
                         f"{[round(p / MiB, 2) for p in per_rank[0]['mem']['ours']['step_peaks']]}, fsdp2 "
                         f"{[round(p / MiB, 2) for p in per_rank[0]['mem']['fsdp2']['step_peaks']]}")
    device = "cuda" if torch.cuda.is_available() else "cpu (gloo)"
    notes.insert(0, f"toy GPT: {_num_params() / 1e6:.2f} M fp32 params, batch {BATCH}; step = fwd + bwd + "
                    f"clip_grad_norm_ + AdamW + LambdaLR + zero_grad(set_to_none); device {device}; "
                    f"{steps} timed steps after {warmup} warm-up, interleaved; memory over {mem_steps} steps")
    notes.insert(1, "peak: live tensor bytes (allocator level, _memtrack.LiveBytes), max over ranks; "
                    "breakdown (rank 0) at a steady-state step's peak; persistent = live after the build")
    notes.insert(2, "the machine is shared: absolute times are noisy, read the ratios")
    headline = []
    for r in rows:
        headline.append({"comparison": f"W={r['W']} AC {r['AC']}: peak live bytes ours/FSDP2",
                         "ratio": r["peak_ratio"]})
        if "floor_ratio" in r:
            headline.append({"comparison": f"W={r['W']} AC {r['AC']}: peak floor (no FSDP buffers) / FSDP2's peak",
                             "ratio": r["floor_ratio"]})
        headline.append({"comparison": f"W={r['W']} AC {r['AC']}: framework step time ours/FSDP2",
                         "ratio": r["time_ratio"]["median"]})
    return result("bench_memory", rows, notes, breakdown=breakdown, headline=headline,
                  goal="peak <= 0.85x FSDP2 (AC off), <= 0.9x (AC on), at W = 2 and 4")


def main() -> None:
    cli(run, "bench_memory")


if __name__ == "__main__":
    main()
