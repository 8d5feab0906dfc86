"""Optimizer step benchmarks on FSDP2 parameters (CPU gloo, W = 2 and 4).

Muon: vefsdp_optim.Muon vs torch.optim.Muon on the same FSDP2 model (DTensor
dispatch) vs an all-gather-then-every-rank-computes Muon. AdamW: vefsdp_optim.AdamW
vs torch.optim.AdamW (foreach) on the same FSDP2 parameters. Interleaved, medians;
collectives per step and bytes moved counted by wrapping torch.distributed.

    python -m benchmarks.bench_optim [--quick] [--out benchmarks/out/optim.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

SHAPES = [(384, 256), (256, 384), (1024, 256), (256, 1024), (130, 257), (257,)]


def _count_collectives():
    """Wrap the c10d Python entry points; returns (counter, restore)."""
    names = ["all_to_all_single", "all_gather_into_tensor", "all_gather", "reduce_scatter_tensor",
             "all_reduce", "all_gather_object", "broadcast", "all_gather_single",
             "reduce_scatter_single"]
    counter = {"calls": 0, "bytes": 0}
    saved = {}
    for n in names:
        f = getattr(dist, n, None)
        if f is None:
            continue
        saved[n] = f

        def wrap(*a, _f=f, **k):
            counter["calls"] += 1
            for t in a[:2]:
                if isinstance(t, torch.Tensor):
                    counter["bytes"] += t.numel() * t.element_size()
                    break
            return _f(*a, **k)

        setattr(dist, n, wrap)

    def restore():
        for n, f in saved.items():
            setattr(dist, n, f)

    return counter, restore


class _FuncolCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts functional collectives (DTensor's redistributions go through these)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "c10d" in str(func.namespace) and "wait" not in str(func):
            self.calls += 1
        return func(*args, **(kwargs or {}))


@torch.no_grad()
def _allgather_muon_step(params, bufs, mesh, lr=1e-3, wd=0.1, momentum=0.95):
    """Every rank gathers every full update and runs Newton-Schulz on it (the naive way)."""
    from torch.distributed.tensor import DTensor

    from vefsdp_optim._math import muon_adjust_lr, zeropower_via_newtonschulz

    for p, buf in zip(params, bufs, strict=True):
        g = p.grad._local_tensor
        buf.lerp_(g, 1 - momentum)
        upd = g.lerp(buf, momentum)
        full = DTensor.from_local(upd, mesh, p.placements, shape=p.shape, stride=p.stride()).full_tensor()
        ortho = zeropower_via_newtonschulz(full.view(p.shape[0], -1))
        local = p._local_tensor
        rows = local.shape[0]
        start = dist.get_rank() * -(-p.shape[0] // dist.get_world_size())
        local.mul_(1 - lr * wd)
        local.add_(ortho[start:start + rows].reshape(local.shape), alpha=-muon_adjust_lr(lr, None, p.shape))


def _worker(rank, world, init_file, steps, out_q):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    import vefsdp_optim

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=g) * 0.02 for s in SHAPES]
    grads = [torch.randn(s, generator=g) for s in SHAPES]

    def model():
        m = nn.ParameterList([nn.Parameter(t.clone()) for t in init])
        fully_shard(m, mesh=mesh)
        ps = list(m)
        for p, gr in zip(ps, grads, strict=True):
            p.grad = distribute_tensor(gr, mesh, p.placements)
        return ps

    mats = lambda ps: [p for p in ps if p.ndim == 2]  # noqa: E731
    ps_ours, ps_torch, ps_ag, ps_aw, ps_taw = model(), model(), model(), model(), model()
    bufs = [torch.zeros_like(p.to_local()) for p in mats(ps_ag)]
    runners = {
        "muon_ours": (vefsdp_optim.Muon(mats(ps_ours)).step),
        "muon_torch": (torch.optim.Muon(mats(ps_torch)).step),
        "muon_allgather": (lambda: _allgather_muon_step(mats(ps_ag), bufs, mesh)),
        "adamw_ours": (vefsdp_optim.AdamW(ps_aw).step),
        "adamw_torch": (torch.optim.AdamW(ps_taw, foreach=True).step),
    }
    times = {k: [] for k in runners}
    comm = {}
    for k, fn in runners.items():  # warm-up + one counted step each
        fn()
        counter, restore = _count_collectives()
        mode = _FuncolCounter()
        try:
            with mode:
                fn()
        finally:
            restore()
        # the Python wrappers and the dispatcher both see c10d calls made through
        # torch.distributed; DTensor's own collectives are invisible to both here
        comm[k] = {"collectives": max(counter["calls"], mode.calls), "bytes_c10d": counter["bytes"]}
    for _ in range(steps):
        for k, fn in runners.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            times[k].append(time.perf_counter() - t0)
    # owner balance of our Muon
    from vefsdp_optim.comm import assign_owners, sharded_view

    views = [sharded_view(p) for p in mats(ps_ours)]
    own = assign_owners([v.layout for v in views], [float(s[0] * s[1] * min(s)) for s in SHAPES if len(s) == 2])
    if rank == 0:
        out_q.put({"world_size": world, "times": times, "comm": comm,
                   "owner_max_over_mean": own.max_over_mean})
    dist.destroy_process_group()


def run(world: int, steps: int) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    fd, init_file = tempfile.mkstemp()
    os.close(fd)
    os.unlink(init_file)
    procs = [ctx.Process(target=_worker, args=(r, world, init_file, steps, q)) for r in range(world)]
    for p in procs:
        p.start()
    import queue

    while True:
        try:
            res = q.get(timeout=5)
            break
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                raise RuntimeError(f"a benchmark rank failed at W={world}") from None
    for p in procs:
        p.join()
    med = {k: statistics.median(v) for k, v in res["times"].items()}
    return {
        "world_size": world,
        "median_s": med,
        "spread_s": {k: [min(v), max(v)] for k, v in res["times"].items()},
        "comm_per_step": res["comm"],
        "owner_max_over_mean": res["owner_max_over_mean"],
        "ratio_muon_vs_torch_muon": med["muon_ours"] / med["muon_torch"],
        "ratio_muon_vs_allgather_muon": med["muon_ours"] / med["muon_allgather"],
        "ratio_adamw_vs_torch_adamw": med["adamw_ours"] / med["adamw_torch"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="benchmarks/out/optim.json")
    args = ap.parse_args()
    steps = 5 if args.quick else 20
    rows = [run(w, steps) for w in (2, 4)]
    print("| W | Muon ours (ms) | torch.optim.Muon (ms) | all-gather Muon (ms) | ratio vs torch | ratio vs all-gather "
          "| collectives ours / torch / all-gather | AdamW ours / torch (ms) | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        m, c = r["median_s"], r["comm_per_step"]
        print(f"| {r['world_size']} | {m['muon_ours'] * 1e3:.1f} | {m['muon_torch'] * 1e3:.1f} | "
              f"{m['muon_allgather'] * 1e3:.1f} | {r['ratio_muon_vs_torch_muon']:.3f} | "
              f"{r['ratio_muon_vs_allgather_muon']:.3f} | {c['muon_ours']['collectives']} / "
              f"{c['muon_torch']['collectives']} / {c['muon_allgather']['collectives']} | "
              f"{m['adamw_ours'] * 1e3:.2f} / {m['adamw_torch'] * 1e3:.2f} | "
              f"{r['ratio_adamw_vs_torch_adamw']:.3f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
