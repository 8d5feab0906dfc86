"""One rank of a W-rank job: what it pays as W grows, with torch's fake process group.

    python -m benchmarks.bench_scale [--quick|--full] [--only CONFIG,...] [--worlds 64,1024]

torch's fake process group (``torch.testing._internal.distributed.fake_pg.FakeStore``,
backend "fake") lets one process play rank r of a W-rank job: every collective returns
at once and moves nothing, so what is left is that rank's host work, compute and
memory. Each (configuration, W, rank) runs in a fresh process (``--one``), so peak RSS
is that run's alone. A configuration is a sharding (FSDP2, HSDP, FSDP2 x TP over a 2-D
mesh with tp 8, our ``fully_shard``, ours x TP) and an optimizer (ours, or the peer
``torch.optim.AdamW``) on a LLaMA-shaped model with LLaMA-3-70B's row counts and narrow
columns (the costs that grow with W depend on the row counts and the number of
parameters, not on the columns).

Per run: construction (sharding and the optimizer), the first step (re-plan included),
the median steady step, peak RSS, the library's own host allocations (tracemalloc over
the steady steps, ``--tracemalloc``), and the collective calls of one steady step with
the longest split list any of them passed. Ratios against the smallest W of the same
configuration are the goals of the scale issue: steady step at the largest W <= 1.1x
the W = 1,024 figure, construction and first step <= 1.5x, host memory <= 1.2x W = 64.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import tracemalloc
from typing import Any

from ._common import machine_info, markdown_table, write_json

__all__ = ["CONFIGS", "main", "run", "run_one", "sweep"]

# LLaMA-3-70B's rows (hidden 8192, kv 1024, mlp 28672); columns narrowed to COLS, and to
# WIDE for the row-parallel matrices (their columns are what tensor parallel cuts)
ROWS = {"q": 8192, "k": 1024, "v": 1024, "o": 8192, "gate": 28672, "up": 28672, "down": 8192}
COLS, WIDE, TP = 16, 64, 8
ROW_PARALLEL = ("o", "down")

# name -> (sharding, optimizer)
CONFIGS: dict[str, tuple[str, str]] = {
    "fsdp2 + torch.optim.AdamW": ("fsdp2", "torch_adamw"),
    "fsdp2 + AdamW": ("fsdp2", "adamw"),
    "fsdp2 + AdamW8bit": ("fsdp2", "adamw8bit"),
    "fsdp2 + Muon": ("fsdp2", "muon"),
    "fsdp2 + Shampoo": ("fsdp2", "shampoo"),
    "fsdp2 x tp + Muon": ("fsdp2_tp", "muon"),
    "fsdp2 x tp + Shampoo": ("fsdp2_tp", "shampoo"),
    "ours + AdamW": ("ours", "adamw"),
    "ours + Muon": ("ours", "muon"),
    "ours x tp + Muon": ("ours_tp", "muon"),
}
QUICK_WORLDS = (64, 1024, 8192)
FULL_WORLDS = (64, 1024, 4096, 8192, 10000)


def _model(layers: int) -> Any:
    import torch
    from torch import nn

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            for name, rows in ROWS.items():
                setattr(self, name, nn.Linear(WIDE if name in ROW_PARALLEL else COLS, rows, bias=False))
            self.norm = nn.RMSNorm(COLS)

        def forward(self, x: torch.Tensor, xw: torch.Tensor) -> torch.Tensor:
            x = self.norm(x)
            return sum(getattr(self, n)(xw if n in ROW_PARALLEL else x).float().sum() for n in ROWS)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Layer() for _ in range(layers))

        def forward(self, x: torch.Tensor, xw: torch.Tensor) -> torch.Tensor:
            return sum(layer(x, xw) for layer in self.layers)

    return Model()


def _optimizer(name: str, model: Any) -> Any:
    import torch

    import vefsdp_optim

    params = list(model.parameters())
    if name == "torch_adamw":
        return torch.optim.AdamW(params, lr=1e-3)
    if name == "adamw":
        return vefsdp_optim.AdamW(params, lr=1e-3)
    if name == "adamw8bit":
        return vefsdp_optim.AdamW8bit(params, lr=1e-3)
    if name == "shampoo":
        return vefsdp_optim.Shampoo(params, lr=1e-3)
    if name == "muon":
        mats = [p for p in params if p.ndim == 2]
        rest = [p for p in params if p.ndim != 2]
        return vefsdp_optim.Muon([{"params": mats}, {"params": rest, "use_muon": False}], lr=1e-3)
    raise ValueError(f"unknown optimizer {name!r}")


class _Collectives:
    """The c10d collectives one step calls, as torch's own ``CommDebugMode`` sees them (a
    dispatch mode: every ``c10d`` op, whichever Python entry point or torch release called
    it), with the longest split list any of them passed and the time spent inside them.

    That time is the fake group's own emulation, not the rank's work: torch's fake backend
    copies the input into each of the W chunks of an all-gather's output (``chunk(W)``, one
    ``copy_`` per chunk; a reduce-scatter likewise), so its cost grows with W (7 ms per
    all-gather at W = 8,192 on this machine, 1 ms at 1,024). NCCL's host cost to launch a
    collective does not depend on W. The step's host work is the steady step less this.
    The mode is only on for the counted step: it would slow every other op of the step."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self
        self.calls: dict[str, int] = {}
        self.longest_split = 0
        self.seconds = 0.0
        self.optimizer_seconds = 0.0  # of ``seconds``, inside the optimizer's step

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
                kwargs = kwargs or {}
                if func.namespace != "c10d":
                    return func(*args, **kwargs)
                name = func.overloadpacket.__name__
                outer.calls[name] = outer.calls.get(name, 0) + 1
                for v in (*args, *kwargs.values()):
                    if isinstance(v, (list, tuple)) and v and all(isinstance(x, int) for x in v):
                        outer.longest_split = max(outer.longest_split, len(v))
                t = time.perf_counter()
                out = func(*args, **kwargs)
                outer.seconds += time.perf_counter() - t
                return out

        self.mode = Mode()


def run_one(config: str, world: int, rank: int, layers: int, steps: int, trace: bool) -> dict[str, Any]:
    """Rank ``rank`` of a ``world``-rank job of ``config``, in this process."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    sharding, opt_name = CONFIGS[config]
    from vefsdp_optim.estimate import real_tensors_on_the_fake_group

    real_tensors_on_the_fake_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    counter = _Collectives()
    torch.manual_seed(0)
    model = _model(layers)
    t0 = time.perf_counter()
    if sharding in ("fsdp2_tp", "ours_tp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )
        from torch.distributed.tensor.placement_types import Replicate

        mesh = init_device_mesh("cpu", (world // TP, TP), mesh_dim_names=("dp", "tp"))
        plan = {n: (RowwiseParallel(input_layouts=Replicate()) if n in ROW_PARALLEL else ColwiseParallel())
                for n in ROWS}
        for layer in model.layers:
            parallelize_module(layer, mesh["tp"], plan)
        dp_mesh = mesh["dp"]
    else:
        from torch.distributed.device_mesh import init_device_mesh

        dp_mesh = init_device_mesh("cpu", (world,))
    if sharding.startswith("ours"):
        from vefsdp_optim import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    for layer in model.layers:
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    opt = _optimizer(opt_name, model)
    construct = time.perf_counter() - t0
    x, xw = torch.randn(2, COLS), torch.randn(2, WIDE)

    opt_times: list[float] = []

    def step() -> float:
        t = time.perf_counter()
        model(x, xw).backward()
        t_opt, in_group = time.perf_counter(), counter.seconds
        opt.step()
        opt_times.append(time.perf_counter() - t_opt)
        counter.optimizer_seconds += counter.seconds - in_group  # the counted step's only
        opt.zero_grad()
        return time.perf_counter() - t

    first = step()
    with counter.mode:
        step()
    calls, longest = dict(counter.calls), counter.longest_split
    if trace:
        tracemalloc.start()
    opt_times.clear()
    times = [step() for _ in range(steps)]
    lib_peak = None
    if trace:
        _, lib_peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
    return {"config": config, "world": world, "rank": rank, "layers": layers,
            "construct_s": construct, "first_step_s": first, "steady_step_s": statistics.median(times),
            "fake_group_s": counter.seconds, "optimizer_step_s": statistics.median(opt_times),
            # the optimizer's own host work: its step less the fake group's time in it
            "optimizer_host_s": max(0.0, statistics.median(opt_times) - counter.optimizer_seconds),
            "host_step_s": max(0.0, statistics.median(times) - counter.seconds),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "traced_peak_mb": None if lib_peak is None else lib_peak / 2**20,
            "local_elements": local, "collectives_per_step": sum(calls.values()),
            "calls": calls, "longest_split": longest}


# LLaMA-3-70B's seven matrix shapes (80 layers each), for the load over all ranks
LLAMA70B_SHAPES = {"q": (8192, 8192), "k": (1024, 8192), "v": (1024, 8192), "o": (8192, 8192),
                   "gate": (28672, 8192), "up": (28672, 8192), "down": (8192, 28672)}
LLAMA70B_LAYERS = 80


def plan_load(world: int, band: int = 1024, layers: int = LLAMA70B_LAYERS) -> list[dict[str, Any]]:
    """The work of every rank of a ``world``-rank FSDP2 job on LLaMA-3-70B's matrices, from
    the plans alone (no process per rank): Shampoo's and SOAP's tile elements on FSDP2's
    row shards (RowBlocks(band) compute layouts, as the step loop derives them: spread
    where a matrix has fewer tiles than ranks) and Muon's
    Newton-Schulz cost per owner (assign_owners over every matrix). Per row: the busiest
    rank against the even share, the bound the scale goal sets for tiles (1.25x the even
    share plus one tile), and the fraction of ranks with no work."""
    import torch

    from vefsdp_optim._math import muon_blocks_cost
    from vefsdp_optim._step_loop import snapped_compute, spread_compute, spreads
    from vefsdp_optim.comm import assign_owners
    from vefsdp_optim.sharding import RaggedShard, RowBlocks

    req = RowBlocks(band)
    tiles = [0] * world  # the spread layouts add their blocks here ([Note: spread compute blocks])
    layouts, costs = [], []
    biggest_tile = 0
    for _ in range(layers):  # in a model's parameter order: layer by layer
        for shape in LLAMA70B_SHAPES.values():
            layout = RaggedShard.shard0(shape, world)
            size = torch.Size(shape)
            if layout.satisfies(req, size):
                compute = layout
            elif spreads(layout, req, size):
                spread_compute(layout, req, size, tiles)
                compute = None
            else:
                compute = snapped_compute(layout, req, size)
            if compute is not None:
                for r in range(world):
                    tiles[r] += compute.local(r)[1]
            biggest_tile = max(biggest_tile, min(band, shape[0]) * shape[1])
            layouts.append(layout)
            costs.append(muon_blocks_cost(shape))
    owners = assign_owners(layouts, costs).owners
    ns = [0.0] * world
    for o, c in zip(owners, costs, strict=True):
        ns[o] += c
    rows = []
    for what, load, unit in (("Shampoo / SOAP tile elements", tiles, biggest_tile),
                             ("Muon Newton-Schulz cost", ns, max(costs))):
        mean = sum(load) / world
        rows.append({"plan": what, "world": world, "busiest / even share": max(load) / mean,
                     "busiest - even share, in largest units": (max(load) - mean) / unit,
                     "goal: busiest <= 1.25 x even + one unit": max(load) <= 1.25 * mean + unit,
                     "ranks with work": sum(1 for x in load if x) / world})
    return rows


def _spawn_one(config: str, world: int, rank: int, layers: int, steps: int, trace: bool,
               timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.bench_scale", "--one", config, str(world), str(rank),
           "--layers", str(layers), "--steps", str(steps)] + (["--tracemalloc"] if trace else [])
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"config": config, "world": world, "rank": rank, "status": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"config": config, "world": world, "rank": rank, "status": f"failed: {tail[0][:200]}"}
    return json.loads(lines[-1])


def run(quick: bool = True) -> dict[str, Any]:
    """The suite's entry: every configuration at W = 64, 1,024, 8,192 (rank 0), or with
    ``quick=False`` at W up to 10,000 (ranks 0 and W - 1)."""
    return sweep(quick)


def sweep(quick: bool = True, only: list[str] | None = None, worlds: tuple[int, ...] | None = None,
          layers: int = 16, steps: int = 3, trace: bool = False, timeout: float = 600) -> dict[str, Any]:
    worlds = worlds or (QUICK_WORLDS if quick else FULL_WORLDS)
    rows = []
    for config in only or list(CONFIGS):
        base: dict[str, Any] | None = None
        for w in worlds:
            for rank in [0] if quick else sorted({0, w - 1}):
                row = _spawn_one(config, w, rank, layers, steps, trace, timeout)
                if base is None and "status" not in row:
                    base = row
                if base is not None and "status" not in row:
                    for k in ("construct_s", "first_step_s", "steady_step_s", "host_step_s", "optimizer_step_s",
                              "optimizer_host_s", "peak_rss_mb"):
                        row[k.removesuffix("_s").removesuffix("_mb") + f" / W={base['world']}"] = (
                            row[k] / base[k] if base[k] else None)
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "calls"}), flush=True)
    for w in worlds:
        rows.extend(plan_load(w))
    notes = [f"one process per (configuration, W, rank) under torch's fake process group; {layers} layers of "
             f"LLaMA-3-70B's row counts ({ROWS}), columns {COLS} ({WIDE} for {ROW_PARALLEL}), tp {TP}",
             "steady step: the median of the steps after the first; ratios against the smallest W that ran"]
    return {"name": "scale", "rows": rows, "notes": notes, "machine": machine_info()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="one rank of a W-rank job under torch's fake process group")
    ap.add_argument("--one", nargs=3, metavar=("CONFIG", "W", "RANK"))
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="quick", action="store_true", default=True)
    mode.add_argument("--full", dest="quick", action="store_false")
    ap.add_argument("--only", default="")
    ap.add_argument("--worlds", default="")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tracemalloc", action="store_true")
    ap.add_argument("--out", default="benchmarks/out/scale.json")
    ap.add_argument("--plan-only", action="store_true", help="only the load over all ranks, from the plans")
    a = ap.parse_args(argv)
    if a.one:
        config, w, r = a.one
        print(json.dumps(run_one(config, int(w), int(r), a.layers, a.steps, a.tracemalloc)), flush=True)
        os._exit(0)  # the fake group has no threads, but skip finalization as every rank does
    only = [c.strip() for c in a.only.split(",") if c.strip()] or None
    if a.plan_only:
        rows = [r for w in (tuple(int(x) for x in a.worlds.split(",") if x) or QUICK_WORLDS) for r in plan_load(w)]
        print(markdown_table(rows))
        return
    worlds = tuple(int(w) for w in a.worlds.split(",") if w) or None
    res = sweep(a.quick, only, worlds, a.layers, a.steps, a.tracemalloc)
    print(markdown_table([r for r in res["rows"] if "plan" in r]))
    res_rows = [r for r in res["rows"] if "plan" not in r]
    cols = ["config", "world", "rank", "construct_s", "first_step_s", "steady_step_s", "fake_group_s",
            "host_step_s", "optimizer_step_s", "optimizer_host_s", "peak_rss_mb",
            "local_elements", "collectives_per_step", "longest_split", "status"]
    print(markdown_table(res_rows, [c for c in cols if any(c in r for r in res_rows)]))
    if a.out:
        write_json(a.out, res)


if __name__ == "__main__":
    main()
