"""Peak memory (live bytes and RSS) and step time of the framework-style step: fully_shard vs FSDP2.

    python -m benchmarks.bench_memory [--quick|--full] [--out benchmarks/out/bench_memory.json]

Two models of ``bench_fully_shard``'s toy GPT family (vocab 509), each block and then
the root sharded, at W = 2 and 4, trained the way frameworks do: loss, backward,
``clip_grad_norm_``, AdamW, an LR scheduler, ``zero_grad``; with activation
checkpointing off, and on every block (``checkpoint_wrapper``, non-reentrant):

- ``gpt``: the benchmark GPT (4 blocks, d = 256, 4 heads, 3.45 M fp32 parameters),
  batch 4 x 128 tokens: activations are half of FSDP2's peak;
- ``gpt768``: parameter-dominated (4 blocks, d = 768, 12 heads, 29.2 M fp32
  parameters, 111 MiB), batch 1 x 64 tokens: activations are a few percent of the peak.

Ours is vefsdp_optim's ``fully_shard`` + ``vefsdp_optim.AdamW``; the peer is FSDP2 +
``torch.optim.AdamW(foreach=True)``; same weights, same batches. Each system runs in
its own fresh ranks (one spawn per system and case), so nothing of the other system
is in the process while it is measured:

- *live*: live tensor bytes at the allocator level ([Note: live-bytes tracker] in
  ``_memtrack.py``): every storage created from the model's deep copy on, counted once
  while it lives, the data and the initial weights excluded. The peak is the highest
  step peak over the measured steps (the build is not a step), max over ranks; on CUDA
  the row also has ``torch.cuda.max_memory_allocated`` minus the bytes allocated
  before the build.
- *RSS*: the process's RSS high-water mark (``ru_maxrss``) at the end of those steps
  minus its RSS (``/proc/self/statm``) just before the model is built (torch, the
  process group, the data and the initial weights already there), max over ranks. It
  also counts what glibc's allocator keeps of freed memory, Python objects, and the
  buffers a collective allocates inside gloo, which the live bytes do not see
  ([Note: RSS and the allocator]).
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
- *timing* (``gpt`` in quick mode, both models in full mode): in the ranks that
  measured ours, after its memory, both systems alternate every step after a warm-up
  (``interleave``: barrier before each call, the slowest rank's time); the ratio is the
  median (quartiles) of the per-step ratios ours / FSDP2.
"""

from __future__ import annotations

import gc
import os
import resource
import weakref
from collections.abc import Iterable
from contextlib import nullcontext
from dataclasses import dataclass
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
from benchmarks.bench_fully_shard import VOCAB
from benchmarks.bench_fully_shard import _build as build_sharded

WORLDS = (2, 4)
CATEGORIES = ("params", "grads", "opt", "unsharded", "act", "other")
MiB = 2**20


# -- the models ---------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A toy GPT of ``bench_fully_shard``'s family and its batch (``batch`` x ``seq`` tokens)."""

    name: str
    d: int
    layers: int
    heads: int
    batch: int
    seq: int

    def __post_init__(self) -> None:
        for k in ("d", "layers", "heads", "batch", "seq"):
            if getattr(self, k) < 1:
                raise ValueError(f"ModelSpec.{k} must be >= 1, got {getattr(self, k)}")
        if self.d % self.heads:
            raise ValueError(f"ModelSpec: d={self.d} is not a multiple of heads={self.heads}")

    def build(self) -> nn.Module:
        from vefsdp_optim.toy._models import TinyGPT

        return TinyGPT(VOCAB, self.seq, d=self.d, n_layers=self.layers, heads=self.heads)

    def data(self, steps: int, device: str) -> torch.Tensor:
        g = torch.Generator().manual_seed(1)
        return torch.randint(0, VOCAB, (steps, self.batch, self.seq + 1), generator=g).to(device)

    def num_params(self) -> int:
        with torch.device("meta"):
            return sum(p.numel() for p in self.build().parameters())

    def block_bytes(self) -> int:
        """Bytes of the largest block's unsharded parameters (fp32)."""
        with torch.device("meta"):
            m = self.build()
        return max(sum(p.numel() * p.element_size() for p in b.parameters()) for b in m.layers)


MODELS = {m.name: m for m in (
    ModelSpec("gpt", d=256, layers=4, heads=4, batch=4, seq=128),  # bench_fully_shard's
    ModelSpec("gpt768", d=768, layers=4, heads=12, batch=1, seq=64),  # parameter-dominated
)}


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

# [Note: RSS and the allocator] With glibc's defaults the RSS high-water mark is 2.5-8x the
# live peak for both systems: freeing a block above the mmap threshold raises the threshold
# (up to 32 MiB), so later blocks of a few MiB come from the heap and stay resident after
# they are freed. Which freed blocks stay depends on the order of allocations, so the RSS
# ratio moves by up to 0.1 between runs of the same code. Run with
# MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=0 (the ranks inherit the environment;
# the notes list it) and every freed block of 64 KiB or more goes back to the system: the
# RSS then follows the bytes in use, the live peak plus what the live bytes do not see. One
# of those is gloo's own reduce-scatter, which runs as an all-reduce of a clone of its W*m
# input, the clone held by the Work until it is dropped: FSDP2 waits for its reduce-scatter
# at once on the CPU, fully_shard overlaps it with the next group's backward (see
# ``StoreGrads.launch_reduce`` in vefsdp_optim/_fsdp/_grads.py), so one block's clone more
# is resident during that backward. At W = 2 fully_shard's reduce-scatter is point to point
# and clones nothing ([Note: gloo flat collectives] in comm/_collectives.py). Under those
# settings (one quick run): RSS 0.98-1.00x FSDP2's on gpt and on gpt768 at W=2, 1.05x on
# gpt768 at W=4 (1.06x and 1.11x before, with gloo's collectives), live bytes 1.00x
# throughout.

def _rss_now() -> int:
    """This process's resident set size in bytes (Linux), else its high-water mark."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return _rss_hwm()


def _rss_hwm() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _measure(system: str, base: nn.Module, data: torch.Tensor, device: str, ac: bool,
             steps: int) -> dict[str, Any]:
    cuda = device.startswith("cuda")
    gc.collect()
    synchronize(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    saved: list = []
    rss0, hwm0 = _rss_now(), _rss_hwm()
    with LiveBytes() as m:
        model, opt, sched = _build(system, base, device, ac)
        label = _labeler(system, model, opt, saved)
        built, rss_built = m.live, _rss_hwm() - rss0
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
               "breakdown": m.breakdown or {}, "other_by_op": m.other_by_op,
               "rss_before": rss0, "rss_hwm_before": hwm0, "rss_end": _rss_now(),
               "rss_built": rss_built, "rss_delta": _rss_hwm() - rss0}
        if cuda:
            row["cuda_max_allocated"] = torch.cuda.max_memory_allocated(device) - before
    del model, opt, sched, label
    gc.collect()
    return row


def _rank(model: str, system: str, ac: bool, mem_steps: int,
          timing: tuple[int, int] | None) -> dict[str, Any]:
    """``system``'s memory in these fresh ranks; then, with ``timing`` = (steps,
    warm-up), both systems' interleaved step times."""
    spec = MODELS[model]
    device = current_device()
    torch.manual_seed(0)
    base = spec.build().to(device)
    steps, warmup = timing or (0, 0)
    data = spec.data(max(steps + warmup, mem_steps) + 4, device)
    out: dict[str, Any] = {"mem": _measure(system, base, data, device, ac, mem_steps), "device": device}
    if timing is not None:
        systems = {s: _build(s, base, device, ac) for s in ("ours", "fsdp2")}
        out["first_loss"] = {s: _step(*systems[s], data[0]) for s in systems}  # same weights, same batch
        it = {s: iter(range(1, data.shape[0])) for s in systems}
        runners = {s: (lambda s=s: _step(*systems[s], data[next(it[s])])) for s in systems}
        out["times"] = interleave(runners, steps, warmup, group=dist.group.WORLD, device=device)
    return out


# -- run ----------------------------------------------------------------------------------------

def _row(model: str, w: int, ac: bool, mem: dict[str, list[dict[str, Any]]],
         timed: dict[str, Any] | None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``mem[system]``: per-rank results of that system's spawn; ``timed``: rank 0's
    result with the interleaved times, or None."""
    row: dict[str, Any] = {"model": model, "W": w, "AC": "on" if ac else "off"}
    per = {s: [r["mem"] for r in mem[s]] for s in ("ours", "fsdp2")}
    peak = {s: max(r["peak"] for r in v) for s, v in per.items()}
    rss = {s: max(r["rss_delta"] for r in v) for s, v in per.items()}
    row.update({
        "live_MiB_ours": peak["ours"] / MiB, "live_MiB_fsdp2": peak["fsdp2"] / MiB,
        "live_ratio": peak["ours"] / peak["fsdp2"],
        "rss_MiB_ours": rss["ours"] / MiB, "rss_MiB_fsdp2": rss["fsdp2"] / MiB,
        "rss_ratio": rss["ours"] / rss["fsdp2"],
    })
    if timed is not None:
        t = timed["times"]
        gap = abs(timed["first_loss"]["ours"] - timed["first_loss"]["fsdp2"])
        if not gap <= 1e-4 * abs(timed["first_loss"]["fsdp2"]):
            raise AssertionError(f"{model} W={w} ac={ac}: first losses differ: {timed['first_loss']}")
        row.update({"step_ms_ours": stats(t["ours"], 1e3), "step_ms_fsdp2": stats(t["fsdp2"], 1e3),
                    "time_ratio": paired_ratio(t["ours"], t["fsdp2"])})
    if "cuda_max_allocated" in per["ours"][0]:
        cm = {s: max(r["cuda_max_allocated"] for r in v) for s, v in per.items()}
        row.update({"cuda_max_MiB_ours": cm["ours"] / MiB, "cuda_max_MiB_fsdp2": cm["fsdp2"] / MiB,
                    "cuda_max_ratio": cm["ours"] / cm["fsdp2"]})
    breakdown = []
    for s in ("ours", "fsdp2"):
        b = per[s][0]["breakdown"]
        breakdown.append({"model": model, "W": w, "AC": row["AC"], "system": s,
                          "peak_MiB": b.get("total", 0) / MiB,
                          **{f"{c}_MiB": b.get(c, 0) / MiB for c in CATEGORIES},
                          "persistent_MiB": per[s][0]["built"] / MiB})
    ours, peer = breakdown
    breakdown.append({"model": model, "W": w, "AC": row["AC"], "system": "ours - fsdp2",
                      **{k: ours[k] - peer[k] for k in ours if k.endswith("_MiB")}})
    # [Note: memory floor]
    fb = per["fsdp2"][0]["breakdown"]
    if fb.get("total"):
        floor = fb["total"] - fb.get("unsharded", 0)
        row["floor_ratio"] = floor / fb["total"]
        row["floor_block_ratio"] = (floor + MODELS[model].block_bytes()) / fb["total"]
    return row, breakdown


# [Note: memory floor]
# At FSDP2's peak, the bytes that are not FSDP buffers (activations, temporaries,
# optimizer state, sharded parameters and gradients) are what any FSDP running the same
# model and optimizer holds at that moment of the step. So ``floor_ratio`` = (FSDP2's
# peak - its unsharded bytes) / its peak is the lowest peak ratio that sharding alone
# can reach here, and ``floor_block_ratio`` adds the largest block's unsharded
# parameters, which must exist while that block computes. A goal below the floor needs
# fewer activations or less optimizer state, not a better FSDP.


def run(quick: bool = True) -> dict[str, Any]:
    """The suite's entry (every benchmark's ``run(quick)``): both models, W = 2 and 4."""
    return run_cases(quick)


def run_cases(quick: bool = True, models: tuple[str, ...] = tuple(MODELS),
              worlds: tuple[int, ...] = WORLDS) -> dict[str, Any]:
    """Some models and world sizes only (a subset of ``run``'s cases)."""
    steps, warmup, mem_steps = (6, 2, 3) if quick else (30, 3, 5)
    timed_models = ("gpt",) if quick else tuple(MODELS)
    rows, breakdown, notes = [], [], []
    for model in models:
        for w in worlds:
            for ac in (False, True):
                timing = (steps, warmup) if model in timed_models else None
                mem = {"fsdp2": spawn(_rank, w, model, "fsdp2", ac, mem_steps, None),
                       "ours": spawn(_rank, w, model, "ours", ac, mem_steps, timing)}
                row, b = _row(model, w, ac, mem, mem["ours"][0] if timing else None)
                rows.append(row)
                breakdown += b
                notes.append(f"{model} W={w} AC={row['AC']}: step peaks (rank 0, MiB) ours "
                             f"{[round(p / MiB, 2) for p in mem['ours'][0]['mem']['step_peaks']]}, fsdp2 "
                             f"{[round(p / MiB, 2) for p in mem['fsdp2'][0]['mem']['step_peaks']]}; "
                             f"RSS before / end (rank 0, MiB) ours "
                             f"{_mib(mem['ours'][0]['mem'], 'rss_before', 'rss_end')}, fsdp2 "
                             f"{_mib(mem['fsdp2'][0]['mem'], 'rss_before', 'rss_end')}")
    device = "cuda" if torch.cuda.is_available() else "cpu (gloo)"
    head = [f"{m}: {MODELS[m].num_params() / 1e6:.2f} M fp32 params (d={MODELS[m].d}, "
            f"{MODELS[m].layers} blocks, {MODELS[m].heads} heads), batch {MODELS[m].batch} x "
            f"{MODELS[m].seq} tokens" for m in models]
    notes[:0] = [
        "; ".join(head),
        f"step = fwd + bwd + clip_grad_norm_ + AdamW + LambdaLR + zero_grad(set_to_none); device {device}; "
        f"memory over {mem_steps} steps, each system in its own fresh ranks; timing ({', '.join(timed_models)}): "
        f"{steps} steps after {warmup} warm-up, interleaved, in the ranks that measured ours",
        "live: peak live tensor bytes (allocator level, _memtrack.LiveBytes); RSS: ru_maxrss at the end minus "
        "the RSS just before the build; both max over ranks; breakdown (rank 0) at a steady-state step's "
        "peak; persistent = live after the build",
        "the machine is shared: absolute times are noisy, read the ratios",
        "allocator environment of the ranks: " + (", ".join(
            f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith(("MALLOC_", "GLIBC_TUNABLES")))
            or "glibc defaults") + " ([Note: RSS and the allocator])",
    ]
    headline = []
    for r in rows:
        case = f"{r['model']} W={r['W']} AC {r['AC']}"
        headline.append({"comparison": f"{case}: peak live bytes ours/FSDP2", "ratio": r["live_ratio"]})
        headline.append({"comparison": f"{case}: peak RSS ours/FSDP2", "ratio": r["rss_ratio"]})
        if "floor_ratio" in r:
            headline.append({"comparison": f"{case}: peak floor (no FSDP buffers) / FSDP2's peak",
                             "ratio": r["floor_ratio"]})
        if "time_ratio" in r:
            headline.append({"comparison": f"{case}: framework step time ours/FSDP2",
                             "ratio": r["time_ratio"]["median"]})
    return result("bench_memory", rows, notes, breakdown=breakdown, headline=headline,
                  goal="peak live bytes and peak RSS <= 1.0x FSDP2's, at W = 2 and 4, AC off and on")


def _mib(r: dict[str, Any], *keys: str) -> list[float]:
    return [round(r[k] / MiB, 1) for k in keys]


def main() -> None:
    cli(run, "bench_memory")


if __name__ == "__main__":
    main()
