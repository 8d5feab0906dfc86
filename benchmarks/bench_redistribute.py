"""Optimizer-side redistribution from FSDP2 row shards, CPU gloo.

    python -m benchmarks.bench_redistribute [--quick|--full] [--out benchmarks/out/redistribute.json]

Matrices of a small transformer block (uneven rows) start sharded like FSDP2's
``Shard(0)`` on W = 2 and 4 spawned ranks (gloo on the CPU, NCCL with one CUDA device
per rank). Three ways
to give an optimizer what it needs, one exchange each:

- aligned: ``redistribute`` to the layouts snapped to 128-row bands (Shampoo tiles,
  row-block quantization): only the pieces at rank boundaries move;
- owners: ``redistribute`` to whole-tensor-on-owner layouts (Muon), owners from
  ``assign_owners`` with ``muon_cost``;
- all-gather: ``all_gather_single`` (``all_gather_into_tensor``) of each (padded) tensor to every rank, what a
  replicate-the-optimizer approach would do.

Bytes moved = elements that cross ranks, summed over ranks, times the element size (the
padding FSDP2's equal chunks add is counted for all-gather). Times: per iteration the
slowest rank's time, the three methods interleaved; medians with quartiles. One direction only; the update goes back
the same way at the same cost.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from vefsdp_optim._math import muon_cost
from vefsdp_optim.comm import assign_owners, redistribute, transfer_sizes
from vefsdp_optim.sharding import RaggedShard, RowBlocks

from ._common import (
    cli,
    current_device,
    device_for_world,
    interleave,
    not_run_row,
    paired_ratio,
    result,
    spawn,
    stats,
)

D = 512
SHAPES = {
    "qkv": (3 * D + 5, D),
    "proj": (D, D),
    "fc1": (4 * D + 3, D),
    "fc2": (D, 4 * D + 3),
    "head": (1001, D),
}
WORLDS = (2, 4)
BAND = 128


def _moved(src: list[RaggedShard], dst: list[RaggedShard], w: int) -> int:
    return sum(sum(transfer_sizes(src, dst, r)[1]) for r in range(w))


def _worker(w: int, iters: int) -> dict:
    device = current_device()
    rank = dist.get_rank()
    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(0)
    fulls = [torch.randn(s, generator=gen).to(device) for s in SHAPES.values()]
    shapes = list(SHAPES.values())
    src = [RaggedShard.shard0(s, w) for s in shapes]
    locals_ = [f.reshape(-1)[a : a + n].clone() for f, (a, n) in zip(fulls, (s.local(rank) for s in src), strict=True)]
    elem = locals_[0].element_size()

    aligned = [s.snapped(RowBlocks(BAND), shape) for s, shape in zip(src, shapes, strict=True)]
    owners = assign_owners(src, [muon_cost(s) for s in shapes])
    whole = [RaggedShard.whole(s.numel, w, o) for s, o in zip(src, owners.owners, strict=True)]

    # all-gather baseline: FSDP2-style padded equal chunks, one collective per tensor
    chunks = [-(-s[0] // w) * (s[1] if len(s) > 1 else 1) for s in shapes]
    padded = []
    for t, c in zip(locals_, chunks, strict=True):
        p = t.new_zeros(c)
        p[: t.numel()] = t
        padded.append(p)
    gathered = [p.new_empty(c * w) for p, c in zip(padded, chunks, strict=True)]

    # all_gather_single is the newer name of all_gather_into_tensor (deprecated in 2.13)
    gather_one = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def all_gather() -> None:
        for out, inp in zip(gathered, padded, strict=True):
            gather_one(out, inp, group=group)

    # correctness spot check against the full tensors (rank-independent reference)
    res = redistribute(locals_, src, aligned, group)
    for r, f, d in zip(res, fulls, aligned, strict=True):
        a, n = d.local(rank)
        if not torch.equal(r, f.reshape(-1)[a : a + n]):
            raise AssertionError("aligned redistribution does not match the full tensor")

    runners = {
        "aligned_128_rows": lambda: redistribute(locals_, src, aligned, group),
        "owners": lambda: redistribute(locals_, src, whole, group),
        "all_gather": all_gather,
    }
    moved = {
        "aligned_128_rows": _moved(src, aligned, w) * elem,
        "owners": _moved(src, whole, w) * elem,
        "all_gather": sum(c * w * (w - 1) for c in chunks) * elem,
    }
    times = interleave(runners, iters, warmup=1, group=group, device=device)
    return {"world_size": w, "param_bytes": sum(f.numel() for f in fulls) * elem,
            "owner_max_over_mean": owners.max_over_mean, "owners": list(owners.owners),
            "moved": moved, "times": times}


def run(quick: bool = True) -> dict:
    """The three exchanges at W = 2 and 4 (quick: 6 timed iterations; full: 20)."""
    t0 = time.perf_counter()
    iters = 6 if quick else 20
    rows, notes = [], []
    for w in WORLDS:
        r = spawn(_worker, w, w, iters)[0]  # the series are max over ranks: equal everywhere
        ag = r["times"]["all_gather"]
        for method, t in r["times"].items():
            rows.append({"device": device_for_world(w)[0], "world": w, "method": method,
                         "MB_moved": r["moved"][method] / 1e6,
                         "moved_over_param_bytes": r["moved"][method] / r["param_bytes"],
                         "ms": stats(t, 1e3), "ratio_vs_all_gather": paired_ratio(t, ag)})
        notes.append(f"W={w}: owner load max/mean {r['owner_max_over_mean']:.3f}, owners {r['owners']}")
        if (nr := not_run_row(w)) is not None:
            rows.append(nr)
    by = {(r["world"], r["method"]): r for r in rows if "method" in r}
    headline = [{"comparison": f"Muon owner exchange / all-gather, bytes, W={w}",
                 "ratio": by[w, "owners"]["MB_moved"] / by[w, "all_gather"]["MB_moved"]}
                for w in WORLDS]
    headline += [{"comparison": f"Muon owner exchange / all-gather, time, W={w}",
                  "ratio": by[w, "owners"]["ratio_vs_all_gather"]} for w in WORLDS]
    notes.insert(0, f"{sum(f[0] * f[1] for f in SHAPES.values()) * 4 / 1e6:.1f} MB of fp32 matrices, "
                    "one direction; the update returns the same way at the same cost")
    return result("redistribute", rows, notes, headline=headline, shapes=SHAPES,
                  wall_s=time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> dict:
    return cli(run, "redistribute", argv)


if __name__ == "__main__":
    main()
