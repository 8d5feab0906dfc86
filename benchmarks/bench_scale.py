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

The peers run in the same sweep: FSDP2 (and HSDP) + ``torch.optim.AdamW``, and Dion's Muon on
FSDP2 (``dion.Muon``, from the checkout ``VEFSDP_DION_SRC`` names; "failed: peer not
installed" without it; its collectives are not counted, since its ``torch.compile``
refuses the counting dispatch mode). SOAP preconditions sides up to 1,024
(``max_precond_dim``), so that no 8,192 x 8,192 eigendecomposition, compute a GPU does in
a tenth of a second, hides the host work.

Per run: construction (sharding and the optimizer), the first step (re-plan included),
the median steady step, peak RSS, the library's own host allocations (tracemalloc over
the steady steps, ``--tracemalloc``), and the collective calls of one steady step with
the longest split list any of them passed. Ratios against the smallest W of the same
configuration are the goals of the scale issue: steady step at the largest W <= 1.1x
the W = 1,024 figure, construction and first step <= 1.5x, host memory <= 1.2x W = 64.

Beside the runs: the load over all W ranks from the plans alone (``plan_load``: Shampoo's
and SOAP's tiles, Muon's owners, and Dion's megabatch assignment), the checkpoint load's
metadata paths on synthetic DCP metadata with W chunks per tensor
(``checkpoint_metadata``), and a plot of step time and peak RSS against W
(``scale.png`` beside ``--out``, with matplotlib: the ``plot`` extra).
"""

from __future__ import annotations

import argparse
import contextlib
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
    "fsdp2 + SOAP": ("fsdp2", "soap"),
    "fsdp2 + NorMuon": ("fsdp2", "normuon"),
    "fsdp2 + dion.Muon (peer)": ("fsdp2", "dion_muon"),
    "hsdp + torch.optim.AdamW (peer)": ("hsdp", "torch_adamw"),
    "hsdp + AdamW": ("hsdp", "adamw"),
    "hsdp + Muon": ("hsdp", "muon"),
    "hsdp + Shampoo": ("hsdp", "shampoo"),
    "fsdp2 x tp + Muon": ("fsdp2_tp", "muon"),
    "fsdp2 x tp + Shampoo": ("fsdp2_tp", "shampoo"),
    "ours + AdamW": ("ours", "adamw"),
    "ours + AdamW8bit": ("ours", "adamw8bit"),
    "ours + Muon": ("ours", "muon"),
    "ours + NorMuon": ("ours", "normuon"),
    "ours + Shampoo": ("ours", "shampoo"),
    "ours + SOAP": ("ours", "soap"),
    "ours x tp + Muon": ("ours_tp", "muon"),
    "ours x tp + Shampoo": ("ours_tp", "shampoo"),
}
SOAP_MAX_PRECOND = 1024
# HSDP: replicas of SHARD ranks each (LLaMA-3-70B's 16 x 64 at W = 1,024; where W is no
# multiple of it, of its largest divisor below SHARD)
SHARD = 64
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


def _optimizer(name: str, model: Any, mesh: Any) -> Any:
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
    if name == "soap":  # sides up to 1,024 preconditioned: no 8,192^2 eigendecomposition at each
        # first step (real compute, a GPU's tenth of a second, that would hide the host work)
        return vefsdp_optim.SOAP(params, lr=1e-3, max_precond_dim=SOAP_MAX_PRECOND)
    mats = [p for p in params if p.ndim == 2]
    rest = [p for p in params if p.ndim != 2]
    if name in ("muon", "normuon"):
        cls = vefsdp_optim.Muon if name == "muon" else vefsdp_optim.NorMuon
        return cls([{"params": mats}, {"params": rest, "use_muon": False}], lr=1e-3)
    if name == "dion_muon":  # the peer: Dion's Muon on FSDP2 (its source from VEFSDP_DION_SRC)
        from ._common import DION_NOT_INSTALLED, dion_src, import_dion

        src = dion_src()
        if src is None:
            raise RuntimeError(DION_NOT_INSTALLED)
        dion = import_dion(src)
        return dion.Muon([{"params": mats}, {"params": rest, "algorithm": "adamw"}], distributed_mesh=mesh,
                         lr=1e-3, mu=0.95, nesterov=True, flatten=False, use_polar_express=False)
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
    elif sharding == "hsdp":
        from torch.distributed.device_mesh import init_device_mesh

        shard = max(d for d in range(1, SHARD + 1) if world % d == 0)  # 50 at W = 10,000
        dp_mesh = init_device_mesh("cpu", (world // shard, shard), mesh_dim_names=("replicate", "shard"))
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
    opt = _optimizer(opt_name, model, dp_mesh)
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
    # Dion's torch.compile refuses a dispatch mode (fullgraph): its collectives are not counted
    counted = opt_name != "dion_muon"
    with counter.mode if counted else contextlib.nullcontext():
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
            "fake_group_s": counter.seconds if counted else None, "optimizer_step_s": statistics.median(opt_times),
            # the optimizer's own host work: its step less the fake group's time in it
            "optimizer_host_s": max(0.0, statistics.median(opt_times) - counter.optimizer_seconds) if counted else None,
            "host_step_s": max(0.0, statistics.median(times) - counter.seconds) if counted else None,
            # the first step's own host work: it runs the steady step's collectives (not counted
            # there, the counting mode would slow every op of it)
            "first_host_s": max(0.0, first - counter.seconds) if counted else None,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "traced_peak_mb": None if lib_peak is None else lib_peak / 2**20,
            "local_elements": local, "collectives_per_step": sum(calls.values()) if counted else None,
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

    from vefsdp_optim._compute_layouts import snapped_compute, spread_compute, spreads
    from vefsdp_optim._math import muon_blocks_cost
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
    # Dion's Muon (megabatch_base.megabatch_orthogonalize_async): all N matrices of one shape
    # are padded to a multiple of W and rank r orthogonalizes matrices r * N' / W ... of them,
    # so each of the first ceil(N / W)-sized slices falls to the lowest ranks, shape by shape
    dion = [0.0] * world
    for shape in LLAMA70B_SHAPES.values():
        per_rank = -(-layers // world)
        for r in range(min(world, -(-layers // per_rank))):
            dion[r] += min(per_rank, layers - r * per_rank) * muon_blocks_cost(shape)
    rows = []
    for what, load, unit in (("Shampoo / SOAP tile elements", tiles, biggest_tile),
                             ("Muon Newton-Schulz cost", ns, max(costs)),
                             ("Dion's Muon Newton-Schulz cost (peer)", dion, max(costs))):
        mean = sum(load) / world
        rows.append({"plan": what, "world": world, "busiest / even share": max(load) / mean,
                     "busiest - even share, in largest units": (max(load) - mean) / unit,
                     "goal: busiest <= 1.25 x even + one unit": max(load) <= 1.25 * mean + unit,
                     "ranks with work": sum(1 for x in load if x) / world, "busiest": max(load)})
    return rows


def checkpoint_metadata(world: int, tensors: int = 32, rows_per_rank: int = 4) -> dict[str, Any]:
    """The metadata paths of a checkpoint saved by ``world`` ranks, on synthetic DCP
    metadata with one chunk per rank of each tensor (the row shards FSDP2 saves), one data
    file per rank (sparse files of the right size): the load's type and storage check
    (what ``read_dcp_metadata`` adds to the unpickling that DCP's own reader does), per
    tensor, and the coordinator's assignment of each file to
    one reader who hashes it (``SafeReader.prepare_global_plan``, W read plans)."""
    import pickle
    import tempfile

    import torch
    from torch.distributed.checkpoint import metadata as md
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    from vefsdp_optim._checkpoint._safe_load import (
        SafeReader,
        _check_types,
        _confine,
        read_dcp_metadata,
    )

    cols, item = 16, 4
    state, storage = {}, {}
    with tempfile.TemporaryDirectory() as root:
        for r in range(world):
            with open(os.path.join(root, f"__{r}_0.distcp"), "wb") as f:
                f.truncate(tensors * (rows_per_rank * cols * item + 2048))
        for t in range(tensors):
            fqn = f"layers.{t}.weight"
            chunks = [md.ChunkStorageMetadata(torch.Size([r * rows_per_rank, 0]), torch.Size([rows_per_rank, cols]))
                      for r in range(world)]
            state[fqn] = md.TensorStorageMetadata(md.TensorProperties(dtype=torch.float32),
                                                  torch.Size([world * rows_per_rank, cols]), chunks)
            for r, c in enumerate(chunks):
                storage[md.MetadataIndex(fqn, c.offsets, r)] = _StorageInfo(
                    f"__{r}_0.distcp", t * (rows_per_rank * cols * item + 2048), rows_per_rank * cols * item + 1024)
        with open(os.path.join(root, ".metadata"), "wb") as f:
            pickle.dump(md.Metadata(state_dict_metadata=state, storage_data=storage), f)
        t0 = time.perf_counter()
        with open(os.path.join(root, ".metadata"), "rb") as f:
            raw = pickle.load(f)  # what DCP's own reader does with it
        unpickle = time.perf_counter() - t0
        t0 = time.perf_counter()
        _check_types(raw, root)  # what read_dcp_metadata adds to it
        _confine(raw, root, root)
        check = time.perf_counter() - t0
        meta = read_dcp_metadata(root)
        files = {f"__{r}_0.distcp": {"size": os.path.getsize(os.path.join(root, f"__{r}_0.distcp")), "sha256": ""}
                 for r in range(world)}
        reader = SafeReader(root, files=files, checked=[".metadata"])
        reader.read_metadata()
        reader.set_up_storage_reader(meta, is_coordinator=True)
        plans = [LoadPlan([ReadItem(LoadItemType.TENSOR, md.MetadataIndex(fqn, c.offsets, r), c.offsets,
                                    md.MetadataIndex(fqn, c.offsets, r), c.offsets, c.sizes)
                           for fqn, e in state.items() for c in e.chunks[r:r + 1]]) for r in range(world)]
        t0 = time.perf_counter()
        reader.prepare_global_plan(plans)
        assign = time.perf_counter() - t0
    return {"checkpoint": "load metadata", "world": world, "chunks per tensor": world,
            "unpickle (DCP's own) ms / tensor": unpickle * 1e3 / tensors,
            "type and storage check ms / tensor": check * 1e3 / tensors, "goal: <= 5 ms at 1,024 chunks": (
                check * 1e3 / tensors <= 5.0) if world == 1024 else None,
            "hash assignment ms (W plans)": assign * 1e3}


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
                    for k in ("construct_s", "first_step_s", "first_host_s", "steady_step_s", "host_step_s",
                              "optimizer_step_s",
                              "optimizer_host_s", "peak_rss_mb"):
                        row[k.removesuffix("_s").removesuffix("_mb") + f" / W={base['world']}"] = (
                            row[k] / base[k] if base[k] and row[k] is not None else None)
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "calls"}), flush=True)
    for w in worlds:
        rows.extend(plan_load(w))
    for w in worlds:
        rows.append(checkpoint_metadata(w))
    notes = [f"one process per (configuration, W, rank) under torch's fake process group; {layers} layers of "
             f"LLaMA-3-70B's row counts ({ROWS}), columns {COLS} ({WIDE} for {ROW_PARALLEL}), tp {TP}",
             "steady step: the median of the steps after the first; ratios against the smallest W that ran"]
    return {"name": "scale", "rows": rows, "notes": notes, "machine": machine_info()}


def plot(rows: list[dict[str, Any]], path: str) -> str:
    """Three panels, one line per configuration against W (log): the rank's steady step,
    its optimizer step alone and its peak RSS. Returns
    ``path``, or a one-line note when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"{path} skipped: matplotlib is not installed (pip install 'vefsdp-optim[plot]')"
    runs = [r for r in rows if "config" in r and "status" not in r and r.get("rank") == 0]
    panels = (("steady_step_s", "steady step, s"), ("optimizer_step_s", "optimizer step alone, s"),
              ("peak_rss_mb", "peak RSS, MB"))
    fig, axes = plt.subplots(1, len(panels), figsize=(18, 5.5))
    styles = ("-", "--", ":", "-.")
    for i, config in enumerate(dict.fromkeys(r["config"] for r in runs)):
        mine = sorted((r for r in runs if r["config"] == config), key=lambda r: r["world"])
        for ax, (key, _) in zip(axes, panels, strict=True):
            ax.plot([r["world"] for r in mine], [r[key] for r in mine], marker="o", ms=3, lw=1.1,
                    ls=styles[i // 10 % len(styles)], label=config)
    for ax, (_, what) in zip(axes, panels, strict=True):
        ax.set_xscale("log")
        ax.set_xlabel("W (ranks; this process plays rank 0)")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3, which="both")
    axes[1].set_yscale("log")
    axes[-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


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
    res_rows = [r for r in res["rows"] if "config" in r]
    cols = ["config", "world", "rank", "construct_s", "first_step_s", "first_host_s", "steady_step_s", "fake_group_s",
            "host_step_s", "optimizer_step_s", "optimizer_host_s", "peak_rss_mb",
            "local_elements", "collectives_per_step", "longest_split", "status"]
    print(markdown_table(res_rows, [c for c in cols if any(c in r for r in res_rows)]))
    print(markdown_table([r for r in res["rows"] if "checkpoint" in r]))
    if a.out:
        write_json(a.out, res)
        print(plot(res["rows"], os.path.splitext(a.out)[0] + ".png"))


if __name__ == "__main__":
    main()
