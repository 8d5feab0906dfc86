"""Shared pieces of the benchmark modules: device choice, spawned ranks, interleaved
timing, medians with spread, machine facts (CPU flags, our kernels), the one loader of
the peer Dion, the result dict and its markdown table.

Every ``benchmarks/bench_X.py`` exposes ``run(quick: bool = True) -> dict`` returning
``result(name, rows, notes)`` (JSON-able) and a ``main()`` built with ``cli``.

[Note: timing statistics]
A timed quantity is a ``stats(samples)`` dict ``{"median", "p25", "p75", "n"}``. Peers
and this library step in alternating order (``interleave``), so load from other
processes on a shared machine falls on both alike; a ratio is ``paired_ratio``: the
median (and quartiles) of the per-step ratios of two interleaved series.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pickle
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import vefsdp_optim

__all__ = [
    "DION_ENV",
    "DION_NOT_INSTALLED",
    "NOT_RUN_NO_CUDA",
    "cli",
    "cpu_flags",
    "current_device",
    "device_for_world",
    "dion_src",
    "import_dion",
    "interleave",
    "interleave_cpu",
    "machine_info",
    "markdown_table",
    "not_run_row",
    "ns_kernels",
    "paired_ratio",
    "result",
    "spawn",
    "stats",
    "synchronize",
    "write_json",
]

NOT_RUN_NO_CUDA = "not run: no CUDA device"
SPAWN_TIMEOUT_S = float(os.environ.get("VEFSDP_BENCH_TIMEOUT", "900"))

# -- device ---------------------------------------------------------------------------


def device_for_world(world: int) -> tuple[str, str]:
    """``("cuda", "nccl")`` when there are at least ``world`` CUDA devices (one per rank,
    as NCCL needs), else ``("cpu", "gloo")``."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= world:
        return "cuda", "nccl"
    return "cpu", "gloo"


def not_run_row(world: int, **fields: Any) -> dict[str, Any] | None:
    """The row that says a CUDA/NCCL case did not run here, or None when it did."""
    if device_for_world(world)[0] == "cuda":
        return None
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    why = NOT_RUN_NO_CUDA if n == 0 else f"not run: needs {world} CUDA devices, have {n}"
    return {"device": "cuda", "world": world, **fields, "status": why}


_DEVICE = "cpu"


def current_device() -> str:
    """Inside a ``spawn``ed rank: ``"cuda:<local rank>"`` or ``"cpu"``; else the default
    device of a single-process benchmark (``"cuda"`` when available)."""
    if dist.is_initialized():
        return _DEVICE
    return "cuda" if torch.cuda.is_available() else "cpu"


def synchronize(device: str | torch.device) -> None:
    """Wait for queued kernels before reading a clock (no-op on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# -- spawned ranks --------------------------------------------------------------------


def _entry(rank: int, fn: Callable[..., Any], world: int, init_file: str, out_dir: str,
           args: tuple[Any, ...]) -> None:
    global _DEVICE
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    device, backend = device_for_world(world)
    if device == "cuda":
        torch.cuda.set_device(rank)
        _DEVICE = f"cuda:{rank}"
    else:
        _DEVICE = "cpu"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        torch.manual_seed(0)
        out = fn(*args)
        with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
            pickle.dump(out, f)
    except BaseException:
        dist.destroy_process_group()
        raise
    vefsdp_optim.exit_rank()  # [Note: gloo teardown]


def spawn(fn: Callable[..., Any], world: int, *args: Any, timeout: float = SPAWN_TIMEOUT_S) -> list[Any]:
    """Run module-level ``fn(*args)`` on ``world`` fresh ranks, return per-rank results.

    Each rank gets a default process group (NCCL with one CUDA device per rank where
    there are enough devices, else gloo on the CPU; see ``current_device``), one
    intra-op thread and ``torch.manual_seed(0)``. A rank that raises fails the call; a
    run longer than ``timeout`` seconds is killed and raises ``TimeoutError``.
    """
    with tempfile.TemporaryDirectory(prefix="vefsdp_bench_") as tmp:
        init_file = os.path.join(tmp, "pg")
        ctx = mp.start_processes(_entry, args=(fn, world, init_file, tmp, args), nprocs=world,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=5):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{fn.__name__} on {world} ranks ran over {timeout:.0f} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        out = []
        for r in range(world):
            with open(os.path.join(tmp, f"{r}.pkl"), "rb") as f:
                out.append(pickle.load(f))
        return out


# -- timing ---------------------------------------------------------------------------


def _max_over_ranks(dt: float, group: dist.ProcessGroup | None, device: str) -> float:
    t = torch.tensor([dt], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def interleave(
    runners: dict[str, Callable[[], object]],
    steps: int,
    warmup: int = 1,
    *,
    group: dist.ProcessGroup | None = None,
    device: str = "cpu",
) -> dict[str, list[float]]:
    """Time ``steps`` calls of each runner (seconds), after ``warmup`` untimed ones.

    The order alternates every step (A B, B A, ...). With ``group`` the ranks meet at a
    barrier before each call and a sample is the slowest rank's time (one all-reduce
    after the clock stops), so every rank returns the same series.
    """
    names = list(runners)
    times: dict[str, list[float]] = {n: [] for n in names}
    for step in range(warmup + steps):
        for name in names if step % 2 == 0 else names[::-1]:
            if group is not None:
                dist.barrier(group=group)
            synchronize(device)
            t0 = time.perf_counter()
            runners[name]()
            synchronize(device)
            dt = time.perf_counter() - t0
            if group is not None:
                dt = _max_over_ranks(dt, group, device)
            if step >= warmup:
                times[name].append(dt)
    return times


def interleave_cpu(runners: dict[str, Callable[[], object]], steps: int, device: str) -> dict[str, list[float]]:
    """``interleave``'s alternating order and barrier over the default group, also
    recording each step's CPU time of this (the only intra-op) thread: compute and
    Python overhead without the waits, which a loaded machine stretches. Keys ``name``
    (wall) and ``name:cpu``, each the slowest rank's."""
    names = list(runners)
    out: dict[str, list[float]] = {k: [] for n in names for k in (n, f"{n}:cpu")}
    for step in range(steps):
        for name in names if step % 2 == 0 else names[::-1]:
            dist.barrier()
            synchronize(device)
            c0, t0 = time.thread_time(), time.perf_counter()
            runners[name]()
            synchronize(device)
            t = torch.tensor([time.perf_counter() - t0, time.thread_time() - c0], dtype=torch.float64,
                             device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            wall, cpu = t.tolist()
            out[name].append(wall)
            out[f"{name}:cpu"].append(cpu)
    return out


def _quantile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def stats(samples: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """Median and quartiles of ``samples`` times ``scale`` (see [Note: timing statistics])."""
    if not samples:
        raise ValueError("stats needs at least one sample, got none")
    xs = [x * scale for x in samples]
    return {"median": statistics.median(xs), "p25": _quantile(xs, 0.25),
            "p75": _quantile(xs, 0.75), "n": len(xs)}


def paired_ratio(ours: Sequence[float], peer: Sequence[float]) -> dict[str, float]:
    """Stats of the per-step ratios ``ours[i] / peer[i]`` of two interleaved series."""
    if len(ours) != len(peer) or not ours:
        raise ValueError(f"paired_ratio needs two equal, non-empty series, got {len(ours)} and {len(peer)}")
    return stats([a / b for a, b in zip(ours, peer, strict=True)])


# -- results --------------------------------------------------------------------------


def result(name: str, rows: list[dict[str, Any]], notes: list[str], **extra: Any) -> dict[str, Any]:
    """The dict every ``run`` returns: ``{"name", "rows", "notes", **extra}``."""
    return {"name": name, "rows": rows, "notes": list(notes), **extra}


def machine_info() -> dict[str, Any]:
    """CPU model, cores, RAM, torch version, CUDA devices and the date (UTC)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    ram_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                ram_gib = round(int(line.split()[1]) / 2**20, 1)
                break
    except OSError:
        pass
    cuda = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] \
        if torch.cuda.is_available() else []
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "ram_gib": ram_gib,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda_devices": cuda,
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


def cpu_flags() -> dict[str, bool]:
    """The CPU features that set bfloat16 matmul speed, which dominates Newton-Schulz on
    the CPU: AVX-512 BF16 (``vdpbf16ps``) and AMX tiles (oneDNN). Without them torch runs
    bfloat16 products in its own loops (1-10 GFLOP/s): the peers' Newton-Schulz does, ours
    takes kernels with those loops' bits ([Note: fast bfloat16 addmm]; ``ns_kernels()``
    says whether they ran)."""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    return {k: k in flags for k in ("avx512f", "avx512_bf16", "amx_bf16", "amx_tile")}


def ns_kernels() -> str:
    """Whether our Newton-Schulz ran on this library's bfloat16 matmul kernels (a note for
    the reports: they change our speed on CPUs without bfloat16 units, never the bits)."""
    from vefsdp_optim._kernels import fast_addmm_available, fast_mm_nt_available

    parts = []
    for name, (ok, why) in (("addmm", fast_addmm_available()), ("X X^T", fast_mm_nt_available())):
        parts.append(f"{name} on" if ok else f"{name} off ({why})")
    return ("ours: Newton-Schulz's bfloat16 products through the library's kernels with torch's bits "
            f"([Note: fast bfloat16 addmm]): {', '.join(parts)}; the peers run torch's own")


# -- peers ----------------------------------------------------------------------------

DION_ENV = "VEFSDP_DION_SRC"
DION_NOT_INSTALLED = (f"peer not installed: set {DION_ENV} to a checkout of github.com/microsoft/dion "
                      "(the folder holding dion/); nothing was timed")


def dion_src(*modules: str) -> str | None:
    """The Dion checkout ``VEFSDP_DION_SRC`` names, or None when it is unset or lacks
    ``dion/<m>.py`` for one of ``modules`` (default: ``muon``). Dion is not in the package
    index; its code is imported from that checkout at run time, never copied."""
    src = os.environ.get(DION_ENV)
    if not src:
        return None
    wanted = modules or ("muon",)
    return src if all(os.path.isfile(os.path.join(src, "dion", f"{m}.py")) for m in wanted) else None


def import_dion(src: str) -> Any:
    """The ``dion`` package of the checkout ``src`` (``dion_src()``, read in the parent and
    passed to the spawned ranks, whose environment may differ)."""
    if not os.path.isfile(os.path.join(src, "dion", "__init__.py")):
        raise ValueError(f"{DION_ENV}={src!r} does not hold dion/__init__.py: expected a checkout of "
                         "github.com/microsoft/dion (the folder holding dion/)")
    if src not in sys.path:
        sys.path.insert(0, src)
    import dion

    return dion


def write_json(path: str | Path, obj: Any) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(obj, indent=1, default=str))


def _fmt(v: Any) -> str:
    if isinstance(v, dict) and "median" in v:
        return f"{_fmt(v['median'])} ({_fmt(v['p25'])}–{_fmt(v['p75'])})"
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, int):
        return f"{v:,}" if abs(v) >= 10_000 else str(v)
    if isinstance(v, float):
        if v == 0:
            return "0"
        a = abs(v)
        if a >= 1e5:
            return f"{v:.3g}"
        if a >= 100:
            return f"{v:.0f}"
        if a >= 1:
            return f"{v:.3f}".rstrip("0").rstrip(".") if a < 10 else f"{v:.2f}"
        return f"{v:.3g}"
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    if isinstance(v, dict):
        return ", ".join(f"{k}={_fmt(x)}" for k, x in v.items())
    return str(v).replace("|", "\\|")


def markdown_table(rows: list[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """A markdown table of ``rows`` (columns: the union of keys in first-seen order);
    a stats dict renders as ``median (p25–p75)``, a missing cell as blank."""
    if not rows:
        return "(no rows)"
    cols = list(columns) if columns else list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r[c]) if c in r else "" for c in cols) + " |")
    return "\n".join(lines)


def cli(run: Callable[[bool], dict[str, Any]], name: str, argv: list[str] | None = None) -> dict[str, Any]:
    """``main()`` of a bench module: ``--quick`` (default) or ``--full``, ``--out``."""
    ap = argparse.ArgumentParser(description=f"benchmark {name}")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="quick", action="store_true", default=True)
    mode.add_argument("--full", dest="quick", action="store_false")
    ap.add_argument("--out", default=f"benchmarks/out/{name}.json")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    res = run(a.quick)
    res.setdefault("wall_s", time.perf_counter() - t0)
    print(markdown_table(res["rows"]))
    for n in res["notes"]:
        print("-", n)
    if a.out:
        write_json(a.out, res)
        print(f"wrote {a.out}")
    return res


class GradProbe(nn.Module):
    """sum_i <p_i, g_i>: its backward leaves exactly g_i in every p_i.grad."""

    def __init__(self, init: list[torch.Tensor]) -> None:
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(t.clone()) for t in init])

    def forward(self, grads: list[torch.Tensor]) -> torch.Tensor:
        return sum((p * g).sum() for p, g in zip(self.ps, grads, strict=True))


def fsdp2_params(init: list[torch.Tensor], grads: list[torch.Tensor], mesh: Any) -> list[nn.Parameter]:
    """FSDP2-sharded copies of ``init`` (one ParameterList on ``mesh``), each with its
    shard of the matching full gradient in ``grads`` as ``.grad``."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    m = nn.ParameterList([nn.Parameter(t.clone()) for t in init])
    fully_shard(m, mesh=mesh)
    ps = list(m)
    for p, gr in zip(ps, grads, strict=True):
        p.grad = distribute_tensor(gr, mesh, p.placements)
    return ps
