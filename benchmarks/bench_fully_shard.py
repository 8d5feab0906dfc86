"""fully_shard + vefsdp_optim.AdamW against FSDP2 + torch.optim.AdamW on a toy GPT.

    python -m benchmarks.bench_fully_shard [--quick|--full] [--out benchmarks/out/bench_fully_shard.json]

A toy GPT (4 blocks, d = 256, 4 heads, vocab 509, seq 128, batch 4: about 3.5 M fp32
parameters) on W = 2 and 4 ranks (gloo on the CPU unless there is one CUDA device per
rank). Both systems start from the same weights and see the same batches; each block
and then the root are sharded, as FSDP2 scripts do. Per W:

- *timing* (one spawn, both systems in every rank): a step is forward + backward +
  optimizer step + zero_grad; the systems alternate every step after a warm-up
  (``interleave``: barrier before each call, the slowest rank's time). The ratio column
  is the median (quartiles) of the per-step ratios ours / FSDP2. The first losses of
  the two systems are compared (same model, same data: they must agree).
- *copies*: bytes written by copying kernels (copy_, cat, clone, _to_copy, FSDP2's
  all_gather_copy_in / split_with_sizes_copy / chunk_cat) in one step, counted with a
  TorchDispatchMode, excluding kernels run inside a collective call (gloo's own).
- *communication*: collective calls and their payload per step, from the c10d ops the
  same dispatch mode sees (all-gather: output bytes, reduce-scatter: input bytes,
  all-reduce: tensor bytes); both systems are counted the same way.
- *memory* (one fresh spawn per system, so ru_maxrss is not shared): the peak of live
  tensor bytes from the build on (``_memtrack.LiveBytes``, [Note: live-bytes tracker];
  the memory benchmark ``bench_memory`` breaks it down), and the RSS high-water mark of
  each rank minus its RSS just before the model is built (torch, the process group and
  the data already loaded), which also counts allocator slack; max over ranks. On
  CUDA: max_memory_allocated instead of RSS.

The machine is shared with other jobs: read the ratios, not the absolute times.
"""

from __future__ import annotations

import copy
import resource
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

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

VOCAB, D, HEADS, LAYERS, SEQ, BATCH = 509, 256, 4, 4, 128, 4
WORLDS = (2, 4)


# -- model ------------------------------------------------------------------------------

def ToyGPT() -> nn.Module:  # noqa: N802
    """The toy runs' GPT (vefsdp_optim.toy) at benchmark size: 3.45 M parameters."""
    from vefsdp_optim.toy._models import TinyGPT

    return TinyGPT(VOCAB, SEQ, d=D, n_layers=LAYERS, heads=HEADS)


def _num_params() -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in ToyGPT().parameters())


# -- counting ---------------------------------------------------------------------------

_COPY_PREFIXES = ("aten.copy_", "aten._foreach_copy_", "aten.cat", "aten.clone", "aten._to_copy",
                  "aten.chunk_cat", "aten.split_with_sizes_copy", "fsdp.split_with_sizes_copy",
                  "fsdp.chunk_cat")


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, list | tuple):
        return [t for y in x for t in _tensors(y)]
    return []


def _nbytes(ts: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


class _Count(TorchDispatchMode):
    """Bytes written by copying kernels, and c10d collectives with their payload."""

    def __init__(self) -> None:
        super().__init__()
        self.copy_bytes = 0
        self.copy_ops: dict[str, int] = {}
        self.comm_calls: dict[str, int] = {}
        self.comm_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        kwargs = kwargs or {}
        name = str(func)
        if func.namespace == "c10d":
            op = func.overloadpacket.__name__
            if op.startswith(("_allgather_base", "allgather")):
                n = _nbytes(_tensors(args[0]))  # output
            elif op.startswith("_reduce_scatter_base"):
                n = _nbytes(_tensors(args[1]))  # input
            elif op.startswith("reduce_scatter"):
                n = _nbytes(_tensors(args[1]))
            else:
                n = _nbytes(_tensors(args[0]))
            if not op.startswith(("barrier", "monitored_barrier")):
                self.comm_calls[op] = self.comm_calls.get(op, 0) + 1
                self.comm_bytes += n
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if name.startswith(_COPY_PREFIXES):
            if name.startswith("fsdp.all_gather_copy_in"):
                n = _nbytes(_tensors(args[0]))
            elif "out" in kwargs:
                n = _nbytes(_tensors(kwargs["out"]))
            elif name.startswith(("aten.copy_", "aten._foreach_copy_")):
                n = _nbytes(_tensors(args[0]))
            else:
                n = _nbytes(_tensors(out))
            if n:
                self.copy_bytes += n
                self.copy_ops[name] = self.copy_ops.get(name, 0) + n
        elif name.startswith("fsdp.all_gather_copy_in"):
            n = _nbytes(_tensors(args[0]))
            self.copy_bytes += n
            self.copy_ops[name] = self.copy_ops.get(name, 0) + n
        return out


# -- the two systems --------------------------------------------------------------------

def _build(system: str, base: nn.Module, device: str,
           ac: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A deep copy of ``base`` sharded block by block, then at the root, by ``system``
    ("ours" or "fsdp2") with its AdamW; ``ac``: every block wrapped by checkpoint_wrapper
    first (activation checkpointing, non-reentrant)."""
    model = copy.deepcopy(base).to(device)
    if ac:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, b in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(b)
    if system == "ours":
        import vefsdp_optim
        from vefsdp_optim import fully_shard

        for b in model.layers:
            fully_shard(b)
        fully_shard(model)
        opt = vefsdp_optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    else:
        from torch.distributed.fsdp import fully_shard

        for b in model.layers:
            fully_shard(b)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=True)
    return model, opt


def _step(model: nn.Module, opt: torch.optim.Optimizer, tok: torch.Tensor) -> float:
    logits = model(tok[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), tok[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def _data(steps: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (steps, BATCH, SEQ + 1), generator=g).to(device)


def _timing_rank(steps: int, warmup: int) -> dict[str, Any]:
    device = current_device()
    torch.manual_seed(0)
    base = ToyGPT()
    data = _data(steps + warmup + 2, device)
    systems = {s: _build(s, base, device) for s in ("ours", "fsdp2")}
    first = {s: _step(*systems[s], data[0]) for s in systems}  # same weights, same batch
    counts = {}
    for s in systems:
        with _Count() as c:
            _step(*systems[s], data[1])
        counts[s] = c
    it = {s: iter(range(2, data.shape[0])) for s in systems}
    runners = {s: (lambda s=s: _step(*systems[s], data[next(it[s])])) for s in systems}
    times = interleave(runners, steps, warmup, group=dist.group.WORLD, device=device)
    return {
        "times": times,
        "first_loss": first,
        "copy_bytes": {s: c.copy_bytes for s, c in counts.items()},
        "copy_ops": {s: c.copy_ops for s, c in counts.items()},
        "comm_calls": {s: c.comm_calls for s, c in counts.items()},
        "comm_bytes": {s: c.comm_bytes for s, c in counts.items()},
    }


def _memory_rank(system: str, steps: int) -> dict[str, float]:
    device = current_device()
    torch.manual_seed(0)
    data = _data(steps, device)
    base = ToyGPT()
    synchronize(device)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    else:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with LiveBytes() as live:
        model, opt = _build(system, base, device)
        del base
        for k in range(steps):
            _step(model, opt, data[k])
        synchronize(device)
    if device.startswith("cuda"):
        peak = torch.cuda.max_memory_allocated(device)
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"delta_bytes": float(peak - before), "peak_bytes": float(peak), "live_peak": float(live.peak)}


# -- run ----------------------------------------------------------------------------------

def run(quick: bool = True) -> dict[str, Any]:
    steps, warmup, mem_steps = (8, 2, 3) if quick else (30, 3, 5)
    n = _num_params()
    rows, notes = [], []
    for w in WORLDS:
        per_rank = spawn(_timing_rank, w, steps, warmup)
        r0 = per_rank[0]
        mem = {s: spawn(_memory_rank, w, s, mem_steps) for s in ("ours", "fsdp2")}
        t = r0["times"]
        loss_gap = abs(r0["first_loss"]["ours"] - r0["first_loss"]["fsdp2"])
        if not loss_gap <= 1e-4 * abs(r0["first_loss"]["fsdp2"]):
            raise AssertionError(f"W={w}: first losses differ: {r0['first_loss']}")
        mib = 2**20
        mem_delta = {s: max(r["delta_bytes"] for r in v) for s, v in mem.items()}
        live = {s: max(r["live_peak"] for r in v) for s, v in mem.items()}
        rows.append({
            "W": w,
            "step_ms_ours": stats(t["ours"], 1e3),
            "step_ms_fsdp2": stats(t["fsdp2"], 1e3),
            "time_ratio": paired_ratio(t["ours"], t["fsdp2"]),
            "copy_MiB_ours": r0["copy_bytes"]["ours"] / mib,
            "copy_MiB_fsdp2": r0["copy_bytes"]["fsdp2"] / mib,
            "comm_MiB_ours": r0["comm_bytes"]["ours"] / mib,
            "comm_MiB_fsdp2": r0["comm_bytes"]["fsdp2"] / mib,
            "comm_ratio": r0["comm_bytes"]["ours"] / r0["comm_bytes"]["fsdp2"],
            "colls_ours": sum(r0["comm_calls"]["ours"].values()),
            "colls_fsdp2": sum(r0["comm_calls"]["fsdp2"].values()),
            "peak_live_MiB_ours": live["ours"] / mib,
            "peak_live_MiB_fsdp2": live["fsdp2"] / mib,
            "mem_ratio": live["ours"] / live["fsdp2"],
            "peak_rss_delta_MiB_ours": mem_delta["ours"] / mib,
            "peak_rss_delta_MiB_fsdp2": mem_delta["fsdp2"] / mib,
            "rss_ratio": mem_delta["ours"] / mem_delta["fsdp2"],
        })
        notes.append(f"W={w} collectives per step: ours {r0['comm_calls']['ours']}, "
                     f"fsdp2 {r0['comm_calls']['fsdp2']}")
        notes.append(f"W={w} copy bytes by op (rank 0): ours {r0['copy_ops']['ours']}, "
                     f"fsdp2 {r0['copy_ops']['fsdp2']}")
        notes.append(f"W={w} first loss ours {r0['first_loss']['ours']:.6f} vs fsdp2 "
                     f"{r0['first_loss']['fsdp2']:.6f}")
    notes.insert(0, f"toy GPT: {n / 1e6:.2f} M fp32 params ({LAYERS} blocks, d={D}, vocab={VOCAB}, "
                    f"seq={SEQ}, batch={BATCH}); {steps} timed steps after {warmup} warm-up, "
                    f"interleaved; step = fwd + bwd + AdamW + zero_grad; device "
                    f"{'cuda' if torch.cuda.is_available() else 'cpu (gloo)'}")
    notes.insert(1, "memory: peak live tensor bytes from the build on (mem_ratio; allocator level, "
                    "benchmarks/_memtrack.py) and RSS high-water mark minus RSS before building the "
                    f"model (rss_ratio), in a fresh process per system ({mem_steps} steps), max over ranks")
    notes.insert(2, "the machine is shared: absolute times are noisy, read the ratios")
    headline = [{"metric": f"W={r['W']} step time ours/FSDP2", "value": r["time_ratio"]} for r in rows]
    return result("bench_fully_shard", rows, notes, headline=headline, params=n,
                  goal="time ratio <= 0.85, copies ~0, memory and comm <= FSDP2")


def main() -> None:
    cli(run, "bench_fully_shard")


if __name__ == "__main__":
    main()
