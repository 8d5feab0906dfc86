"""Optimizer-side redistribution from FSDP2 row shards, CPU gloo.

    python -m benchmarks.bench_redistribute [--out benchmarks/out/redistribute.json] [--iters 15]

Matrices of a small transformer block (uneven rows) start sharded like FSDP2's
``Shard(0)`` on W = 2 and 4 gloo ranks (spawned with torch.multiprocessing). Three ways
to give an optimizer what it needs, one exchange each:

- aligned: ``redistribute`` to the layouts snapped to 128-row bands (Shampoo tiles,
  row-block quantization): only the pieces at rank boundaries move;
- owners: ``redistribute`` to whole-tensor-on-owner layouts (Muon), owners from
  ``assign_owners`` with ``muon_cost``;
- all-gather: ``all_gather_single`` (``all_gather_into_tensor``) of each (padded) tensor to every rank, what a
  replicate-the-optimizer approach would do.

Bytes moved = elements that cross ranks, summed over ranks, times the element size (the
padding FSDP2's equal chunks add is counted for all-gather). Times: per iteration the
slowest rank's time, median over iterations. One direction only; the update goes back
the same way at the same cost.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vefsdp_optim.comm import assign_owners, muon_cost, redistribute, transfer_sizes
from vefsdp_optim.sharding import RaggedShard, RowBlocks

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


def _timed(fn, iters: int) -> float:
    times = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        times.append(dt.item())
    return statistics.median(times)


def _moved(src: list[RaggedShard], dst: list[RaggedShard], w: int) -> int:
    return sum(sum(transfer_sizes(src, dst, r)[1]) for r in range(w))


def _worker(rank: int, w: int, init_file: str, iters: int, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=w)
    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(0)
    fulls = [torch.randn(s, generator=gen) for s in SHAPES.values()]
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

    rows = {
        "aligned_128_rows": (
            _moved(src, aligned, w) * elem,
            _timed(lambda: redistribute(locals_, src, aligned, group), iters),
        ),
        "owners": (
            _moved(src, whole, w) * elem,
            _timed(lambda: redistribute(locals_, src, whole, group), iters),
        ),
        "all_gather": (
            sum(c * w * (w - 1) for c in chunks) * elem,
            _timed(all_gather, iters),
        ),
    }
    if rank == 0:
        total = sum(f.numel() for f in fulls) * elem
        result = {
            "world_size": w,
            "param_bytes": total,
            "owner_max_over_mean": owners.max_over_mean,
            "owners": list(owners.owners),
            "rows": {k: {"bytes_moved": b, "median_s": t} for k, (b, t) in rows.items()},
        }
        with open(out_path, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/out/redistribute.json")
    ap.add_argument("--iters", type=int, default=15)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    report = {"shapes": {k: list(v) for k, v in SHAPES.items()}, "dtype": "float32", "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        for w in WORLDS:
            init_file = os.path.join(tmp, f"pg{w}")
            out_path = os.path.join(tmp, f"res{w}.json")
            mp.spawn(_worker, args=(w, init_file, args.iters, out_path), nprocs=w, join=True)
            with open(out_path) as f:
                report["runs"].append(json.load(f))

    print(f"{'W':>2} {'method':<18} {'MB moved':>9} {'x params':>9} {'median ms':>10} {'vs all-gather':>14}")
    for run in report["runs"]:
        ag = run["rows"]["all_gather"]["median_s"]
        for name, row in run["rows"].items():
            print(
                f"{run['world_size']:>2} {name:<18} {row['bytes_moved'] / 1e6:>9.2f} "
                f"{row['bytes_moved'] / run['param_bytes']:>9.3f} {row['median_s'] * 1e3:>10.2f} "
                f"{row['median_s'] / ag:>14.3f}"
            )
        print(f"   owner load max/mean = {run['owner_max_over_mean']:.3f}, owners {run['owners']}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
