"""Muon step over a shape sweep: vefsdp_optim.Muon vs Microsoft Dion's Muon, per shape.

A lead on one shape is not a lead: this sweep is the grid Muon's performance work is
measured on; every shape is timed the same way and reported, with the geometric mean
and the worst case over the grid.

Dion is not in the package index: point ``VEFSDP_DION_SRC`` at a checkout of
github.com/microsoft/dion (the folder holding ``dion/``); without it every row says
"peer not installed". Dion's code is imported from there at run time, never copied.

Grid (``--full``, 142 cases), each on W = 2 and 4 gloo CPU ranks:

* dense: ``count`` equal matrices (layers) of one shape: square ``d x d``, tall 4:1
  ``4d x d`` and wide 1:4 ``d x 4d``, d in 64, 128, 256, 512, 1024, count 2, 4, 16;
* fused QKV, ``split_sizes`` (each block orthogonalized alone): MHA ``3d x d`` split
  ``(d, d, d)`` and GQA ``1.5d x d`` split ``(d, d/4, d/4)``, d in 64 .. 1024, 2 and 16
  layers;
* experts (``flatten=False``): ``[E, 2d, d]`` and ``[E, d, 2d]``, small (d = 128) and
  large (d = 512), E in 4, 8, 16.

Quick (the suite's default) times a fixed subset of the same grid (``QUICK``: every
family, small to large, W = 2 and 4) with a shorter timing budget. ``--cases PATTERNS``
times the full grid's cases that match (fnmatch on ``family:d:count:W``).

Runners, all stepping in alternating order on the same gradients (``interleave``; a
step's time is the slowest rank's): ours on vefsdp_optim.fully_shard parameters (one
group) and ours on FSDP2 parameters, each with the quintic Newton-Schulz and with
``ns_coefficients="polar_express"``; dion.Muon on the same FSDP2 parameters with
``use_polar_express=False`` (its quintic) and ``True``. Equal settings: bfloat16
Newton-Schulz, 5 iterations of 3 matmuls, Nesterov momentum 0.95, weight decay 0.1,
lr 0.02 scaled by ``0.2 sqrt(max(m, n))`` (ours ``match_rms_adamw``, Dion ``rms_norm``).
A ratio is the median (quartiles) of the per-step ratios ours / peer; "fastest peer" is
the case's faster Dion (by median step). Dion compiles its Newton-Schulz with torch.compile
(``dynamic=False``: once per shape); its dynamo caches are reset before every case, as
in a fresh process, and the untimed warm-up steps include the compilation (cold, it
dominates the wall time: ~10-25 s a case on 2 cores; inductor's on-disk cache makes a
second run faster). torchtitan's FlexShard DistMuon is built and stepped unpatched on
W = 2; its row says what it raised where it does not run (it requires CUDA).

    VEFSDP_DION_SRC=/path/to/dion python -m benchmarks.bench_muon_sweep [--quick|--full]
    VEFSDP_DION_SRC=... python -m benchmarks.bench_muon_sweep --cases 'square:64:*:*'
    VEFSDP_DION_SRC=... python -m benchmarks.bench_muon_sweep --profile square:64:16:2

``--profile FAMILY:D:COUNT:W`` prints cProfile's top functions (rank 0) of a few steps
of each runner on one case, to see where the per-matrix overhead goes. ``--ns-batch``
times instead, in one process on one thread, batched Newton-Schulz and NorMuon's batched
normalization against their per-matrix loops on each case's same-shape blocks (no peer).
"""

from __future__ import annotations

import argparse
import cProfile
import fnmatch
import io
import math
import os
import pstats
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ._common import (
    DION_ENV,
    DION_NOT_INSTALLED,
    GradProbe,
    cli,
    cpu_flags,
    current_device,
    dion_src,
    fsdp2_params,
    import_dion,
    interleave,
    interleave_cpu,
    not_run_row,
    ns_kernels,
    paired_ratio,
    result,
    spawn,
    stats,
)

NAME = "muon_sweep"
PLOT = Path(__file__).resolve().parent / "out" / f"{NAME}.png"
HP = dict(lr=0.02, weight_decay=0.1)
FAMILIES = ("square", "tall", "wide", "qkv", "gqa", "experts")
PE = "polar_express"


@dataclass(frozen=True, slots=True)
class Case:
    """One point of the sweep: ``count`` matrices (or experts) of a family at width ``d``."""

    family: str
    d: int
    count: int
    world: int

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}")
        if self.d < 16 or self.d % 16 or self.count < 1 or self.world < 1:
            raise ValueError(f"bad case {self}: d a multiple of 16, count and world >= 1")

    @classmethod
    def parse(cls, s: str) -> Case:
        fam, d, count, world = s.split(":")
        return cls(fam, int(d), int(count), int(world))

    def shapes(self) -> list[tuple[int, ...]]:
        d, n = self.d, self.count
        return {
            "square": [(d, d)] * n,
            "tall": [(4 * d, d)] * n,
            "wide": [(d, 4 * d)] * n,
            "qkv": [(3 * d, d)] * n,
            "gqa": [(d + d // 2, d)] * n,
            "experts": [(n, 2 * d, d), (n, d, 2 * d)],
        }[self.family]

    def split_sizes(self) -> tuple[int, ...] | None:
        d = self.d
        return {"qkv": (d, d, d), "gqa": (d, d // 4, d // 4)}.get(self.family)

    def blocks(self) -> list[tuple[int, int]]:
        """The matrices Newton-Schulz sees (each split block, each expert)."""
        if self.family == "experts":
            return [(2 * self.d, self.d), (self.d, 2 * self.d)] * self.count
        split = self.split_sizes()
        return [(r, s[1]) for s in self.shapes() for r in (split or (s[0],))]

    def block_elems(self) -> int:
        """Mean elements of an orthogonalized matrix: the plot's x."""
        b = self.blocks()
        return round(sum(m * n for m, n in b) / len(b))

    def spec(self) -> str:
        return f"{self.family}:{self.d}:{self.count}:{self.world}"

    def label(self) -> str:
        d = self.d
        what = {"square": f"{d}x{d}", "tall": f"{4 * d}x{d}", "wide": f"{d}x{4 * d}",
                "qkv": f"qkv {3 * d}x{d} split {d}x3", "gqa": f"gqa {d + d // 2}x{d} split {d},{d // 4},{d // 4}",
                "experts": f"experts {2 * d}x{d}+{d}x{2 * d}"}[self.family]
        return f"{what} x{self.count}"


DS = (64, 128, 256, 512, 1024)


def full_grid() -> list[Case]:
    """142 cases: every family at every width, few and many matrices, W = 2 and 4."""
    cases = []
    for w in (2, 4):
        cases += [Case(f, d, n, w) for f in ("square", "tall", "wide") for d in DS for n in (2, 4, 16)]
        cases += [Case(f, d, n, w) for f in ("qkv", "gqa") for d in DS for n in (2, 16)]
        cases += [Case("experts", d, e, w) for d in (128, 512) for e in (4, 8, 16)]
    return cases


def select(patterns: str) -> list[Case]:
    """The full grid's cases whose ``family:d:count:W`` matches one of the comma-separated
    fnmatch ``patterns`` (e.g. ``square:64:*:*,experts:*:*:4``)."""
    pats = [p.strip() for p in patterns.split(",") if p.strip()]
    cases = [c for c in full_grid() if any(fnmatch.fnmatch(c.spec(), p) for p in pats)]
    if not cases:
        raise ValueError(f"no case of the full grid matches {patterns!r} (family:d:count:W, e.g. square:64:*:2)")
    return cases


# a subset of the full grid: every family, small to large matrices, few to many
QUICK = [Case.parse(s) for s in (
    "square:64:16:2", "square:256:4:2", "square:1024:2:2", "tall:128:16:2", "wide:512:2:2", "qkv:256:2:2",
    "gqa:128:16:2", "experts:128:8:2", "experts:512:4:2", "square:128:16:4", "wide:256:4:4",
    "experts:128:16:4")]


def library_fingerprint() -> str:
    """``git`` commit (+ ``dirty`` when the library's files differ from it) and a hash of
    the library's sources (vefsdp_optim, comm, sharding) as imported: a run is one version
    of the code even where others edit the working tree meanwhile (compare start and end)."""
    import hashlib
    import subprocess

    import vefsdp_optim

    root = Path(vefsdp_optim.__file__).resolve().parents[1]
    h = hashlib.sha256()
    for pkg in ("vefsdp_optim", "comm", "sharding"):
        for f in sorted((root / pkg).rglob("*")):
            if f.suffix in (".py", ".cpp", ".h") and "__pycache__" not in f.parts:
                h.update(str(f.relative_to(root)).encode() + f.read_bytes())
    try:
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "vefsdp_optim", "comm",
                                "sharding"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        rev, dirty = "", ""
    return f"{rev or 'no git'}{' dirty' if dirty else ''}, sources {h.hexdigest()[:12]}"


# -- one case on the ranks ------------------------------------------------------------


def _ours_pe_supported() -> bool | str:
    """True when our Muon takes ``ns_coefficients="polar_express"``, else why not."""
    import vefsdp_optim

    p = torch.nn.Parameter(torch.zeros(4, 4))
    try:
        vefsdp_optim.Muon([p], ns_coefficients=PE)
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return True


def _build(case: Case, mesh: Any, device: str, dion: Any, pe: bool) -> dict[str, Any]:
    """The runners of one case, each stepping its own copy of the same parameters."""
    import vefsdp_optim

    shapes = case.shapes()
    g = torch.Generator().manual_seed(0)
    init = [(torch.randn(s, generator=g) * 0.02).to(device) for s in shapes]
    grads = [torch.randn(s, generator=g).to(device) for s in shapes]
    keys: dict[str, Any] = {"flatten": False}
    if (split := case.split_sizes()) is not None:
        keys["split_sizes"] = split

    def ours(params: list, coeffs: str | None) -> Any:
        ns = {} if coeffs is None else {"ns_coefficients": coeffs}  # None: the default quintic
        return vefsdp_optim.Muon([{"params": params, **keys}], adjust_lr_fn="match_rms_adamw", **ns, **HP)

    def ours_fs(coeffs: str | None) -> Any:
        probe = GradProbe(init)
        vefsdp_optim.fully_shard(probe, mesh=mesh)
        opt = ours(list(probe.parameters()), coeffs)
        probe(grads).backward()
        return opt.step

    def ours_fsdp2(coeffs: str | None) -> Any:
        return ours(fsdp2_params(init, grads, mesh), coeffs).step

    def peer(use_pe: bool) -> Any:
        return dion.Muon([{"params": fsdp2_params(init, grads, mesh), **keys}], distributed_mesh=mesh, mu=0.95,
                         nesterov=True, flatten=False, adjust_lr="rms_norm", use_polar_express=use_pe, **HP).step

    runners = {"ours_fs": ours_fs(None), "ours_fsdp2": ours_fsdp2(None), "dion": peer(False)}
    if pe:
        runners |= {"ours_fs_pe": ours_fs(PE), "ours_fsdp2_pe": ours_fsdp2(PE), "dion_pe": peer(True)}
    return runners


def _steps_for(runners: dict[str, Any], budget_s: float, lo: int, hi: int, device: str) -> int:
    """Timed steps that fit ``budget_s`` (from one warm round), in [lo, hi], the same on all ranks."""
    t0 = time.perf_counter()
    interleave(runners, 1, warmup=0, group=dist.group.WORLD, device=device)
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return max(lo, min(hi, int(budget_s / max(float(t.item()), 1e-6))))


def _worker(cases: list[Case], budget_s: float, lo: int, hi: int, src: str) -> list[dict]:
    from torch.distributed.device_mesh import init_device_mesh

    dion = import_dion(src)

    device = current_device()
    mesh = init_device_mesh(torch.device(device).type, (dist.get_world_size(),), mesh_dim_names=("dp",))
    pe = _ours_pe_supported() is True
    out = []
    for case in cases:
        torch._dynamo.reset()  # Dion's compiled functions start cold, as in a fresh process
        try:  # an optimizer refusing a shape refuses it on every rank, before a collective
            runners = _build(case, mesh, device, dion, pe)
            t0 = time.perf_counter()
            interleave(runners, 0, warmup=2, group=dist.group.WORLD, device=device)  # Dion compiles here
            warm_s = time.perf_counter() - t0
            steps = _steps_for(runners, budget_s, lo, hi, device)
            load = os.getloadavg()[0]
            times = interleave_cpu(runners, steps, device)
        except Exception as e:  # noqa: BLE001 - the case's row says what failed
            out.append({"case": case, "error": f"{type(e).__name__}: {e}"[:300]})
            continue
        out.append({"case": case, "times": times, "warmup_s": warm_s, "load": load})
        del runners
    return out


def _titan_attempt(world: int) -> dict[str, Any]:
    """Build torchtitan's FlexShard DistMuon unpatched on FSDP2 parameters and step it once."""
    from torch.distributed.device_mesh import init_device_mesh

    device = current_device()
    mesh = init_device_mesh(torch.device(device).type, (world,), mesh_dim_names=("dp",))
    try:
        from torchtitan.distributed.flex_shard import dist_muon
        from torchtitan.distributed.flex_shard import optimizer_reshard as rs
    except ImportError as e:
        return {"status": f"not run: torchtitan FlexShard not importable ({e})"}
    shapes = Case("square", 64, 2, world).shapes()
    params = fsdp2_params([torch.randn(s).to(device) for s in shapes], [torch.randn(s).to(device) for s in shapes],
                          mesh)
    names = [f"w{i}" for i in range(len(params))]
    try:
        opt = dist_muon.build_dist_muon(
            [{"params": params, "param_names": names}],
            compute_sharding_by_fqn={n: rs.ComputeLayout({"dp": rs.Owned()}) for n in names},
            bucket_configs=[rs.BucketConfig(("*",))], lr=0.02)
        opt.step()
    except Exception as e:  # noqa: BLE001 - the row reports whatever the peer raised
        return {"status": f"not run: unpatched DistMuon raises {type(e).__name__}: {e}"}
    return {"status": "ran"}


# -- results --------------------------------------------------------------------------

FASTEST = "fastest"
# ratio key -> (ours runner, peer runner; FASTEST: the case's faster Dion by median step);
# cpu_: the same ratio of the steps' main-thread CPU time (see _common.interleave_cpu)
RATIOS: dict[str, tuple[str, str]] = {
    "fs_vs_fastest": ("ours_fs", FASTEST),
    "fsdp2_vs_fastest": ("ours_fsdp2", FASTEST),
    "fs_vs_dion": ("ours_fs", "dion"),
    "fsdp2_vs_dion": ("ours_fsdp2", "dion"),
    "fs_pe_vs_dion_pe": ("ours_fs_pe", "dion_pe"),
    "fsdp2_pe_vs_dion_pe": ("ours_fsdp2_pe", "dion_pe"),
    "cpu_fs_vs_fastest": ("ours_fs", FASTEST),
    "cpu_fsdp2_vs_fastest": ("ours_fsdp2", FASTEST),
}
GOALS = {"fs_vs_fastest": 0.8, "fsdp2_vs_fastest": 0.9, "cpu_fs_vs_fastest": 0.8, "cpu_fsdp2_vs_fastest": 0.9}


def _row(r: dict) -> dict[str, Any]:
    case: Case = r["case"]
    if "error" in r:
        return {"family": case.family, "shape": case.label(), "W": case.world, "status": f"failed: {r['error']}"}
    t = r["times"]
    row: dict[str, Any] = {"family": case.family, "shape": case.label(), "W": case.world,
                           "block_elems": case.block_elems(), "steps": len(t["dion"]), "load": round(r["load"], 1)}
    row |= {f"{k}_ms": round(stats(v, 1e3)["median"], 2) for k, v in t.items() if ":" not in k}
    peers = [p for p in ("dion", "dion_pe") if p in t]
    row["fastest_peer"] = min(peers, key=lambda p: stats(t[p])["median"])
    for key, (ours, peer) in RATIOS.items():
        peer = row["fastest_peer"] if peer == FASTEST else peer
        cpu = key.startswith("cpu_")
        ours, peer = (f"{ours}:cpu", f"{peer}:cpu") if cpu else (ours, peer)
        if ours in t and peer in t:
            row[key] = {k: round(v, 3) if k != "n" else v for k, v in paired_ratio(t[ours], t[peer]).items()}
    return row


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def summarize(rows: list[dict], key: str) -> dict[str, Any]:
    """Geometric mean, worst (largest) and the count above 1.0 of the rows' median ``key``."""
    med = [(r[key]["median"], r) for r in rows if isinstance(r.get(key), dict)]
    if not med:
        return {}
    worst = sorted(med, key=lambda x: -x[0])
    return {"ratio": key, "shapes": len(med), "geomean": round(_geomean([m for m, _ in med]), 3),
            "worst": round(worst[0][0], 3),
            "worst_shapes": "; ".join(f"{r['shape']} W={r['W']}: {m:.3f}" for m, r in worst[:3]),
            "above_1": sum(m > 1.0 for m, _ in med), "goal": GOALS.get(key, 1.0)}


def _plot(rows: list[dict], path: Path) -> str:
    """Ratio to the fastest peer against matrix size, fully_shard and FSDP2 side by side."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install -e '.[plot]')"
    markers = dict(zip(FAMILIES, "os^vDP", strict=True))
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    for ax, (key, goal, title) in zip(axes, (("fs_vs_fastest", 0.8, "ours on fully_shard"),
                                             ("fsdp2_vs_fastest", 0.9, "ours on FSDP2")), strict=True):
        for fam in FAMILIES:
            for w, color in ((2, "tab:blue"), (4, "tab:orange")):
                pts = [(r["block_elems"], r[key]["median"]) for r in rows
                       if r.get("family") == fam and r.get("W") == w and key in r]
                if pts:
                    ax.scatter(*zip(*pts, strict=True), marker=markers[fam], color=color, alpha=0.75,
                               label=f"{fam} W={w}")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(goal, color="g", ls="--", lw=0.8, label=f"goal {goal}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("elements per orthogonalized matrix")
        ax.set_title(f"{title} / fastest Dion Muon (quintic or Polar Express)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("step time ratio (median of per-step ratios)")
    axes[1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot: {path}"


def run(quick: bool = True) -> dict:
    """The sweep at W = 2 and 4 (quick: the ``QUICK`` subset, ~2 s of timed steps per
    case; full: the whole grid, ~4 s per case)."""
    return sweep(QUICK if quick else full_grid(), quick)


def sweep(cases: list[Case], quick: bool, what: str | None = None, plot: Path = PLOT) -> dict:
    """Time ``cases`` (timed steps per case from a budget: quick 2 s, 6 to 30 steps; full
    4 s, 6 to 40) and summarize them."""
    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    lib0 = library_fingerprint()
    src = dion_src()
    flags = cpu_flags()
    pe = _ours_pe_supported()
    what = what or ("quick: a fixed subset of the full grid" if quick else "full")
    notes = [
        f"grid ({what}): {len(cases)} cases of the full grid's {len(full_grid())}: dense square d x d, "
        "tall 4d x d, wide d x 4d (d 64-1024; 2, 4, 16 matrices); fused QKV with split_sizes (MHA 3d x d "
        "split d,d,d; GQA 1.5d x d split d,d/4,d/4; 2 and 16 layers); experts [E,2d,d]+[E,d,2d] with "
        "flatten=False (small d=128, large d=512; E 4, 8, 16); W=2 and 4",
        "equal settings: fp32 parameters, bf16 Newton-Schulz, 5 iterations of 3 matmuls (ours: the fixed "
        "quintic (3.4445, -4.775, 2.0315) or Polar Express; Dion: its 5-tuple quintic schedule or its Polar "
        "Express), Nesterov 0.95, weight decay 0.1, lr 0.02 x 0.2 sqrt(max(m, n)) (ours match_rms_adamw, "
        "Dion rms_norm); the momentum conventions differ (ours lerp, Dion mu M + G), one elementwise pass "
        "either way",
        "timing: the six runners step in alternating order on the same gradients; a step's time is the "
        "slowest rank's (wall); cpu_ ratios: the same with the step's CPU time on the rank's one compute "
        "thread (Python, copies and matmuls without the waits for peers and the scheduler, which a loaded "
        "machine stretches: a diagnostic, not the goal's measure); load: 1-minute load average when the "
        "case's timing began; ratio: median (p25-p75) of per-step ratios ours / peer; fastest: the case's faster "
        "Dion (quintic or Polar Express) by median step (fastest_peer); summary: geometric mean and worst "
        "of the cases' medians; timed steps per case from a time budget after 2 warm-up steps (Dion's "
        "torch.compile runs in those; its dynamo caches are reset before each case, as in a fresh process)",
        "CPU flags that set bf16 matmul speed (Newton-Schulz is most of a large matrix's step): "
        + ", ".join(f"{k}={v}" for k, v in flags.items()),
        ns_kernels(),
    ]
    if pe is not True:
        notes.append(f"ours with Polar Express: pending (Muon(ns_coefficients='polar_express') raised {pe})")
    if src is None:
        rows = [{"family": c.family, "shape": c.label(), "W": c.world, "status": "peer not installed"}
                for c in cases]
        notes.append(DION_NOT_INSTALLED)
        return result(NAME, rows, notes, cpu_flags=flags, wall_s=time.perf_counter() - t0)
    budget, lo, hi = (2.0, 6, 30) if quick else (4.0, 6, 40)
    raw = []
    for w in sorted({c.world for c in cases}):
        mine = [c for c in cases if c.world == w]
        for i in range(0, len(mine), 12):  # a fresh process group every 12 cases
            raw += spawn(_worker, w, mine[i:i + 12], budget, lo, hi, src, timeout=3600)[0]
    rows = [_row(r) for r in raw]
    titan = spawn(_titan_attempt, 2, 2)[0]
    rows.append({"family": "torchtitan DistMuon", "W": 2, "status": titan["status"]})
    for w in (2, 4):
        if (nr := not_run_row(w)) is not None:
            rows.append(nr)
    keys = [k for k in RATIOS if any(k in r for r in rows)]
    summary = [{"W": w, **s} for w in ("all", 2, 4) for k in keys if w == "all" or "fastest" in k
               if (s := summarize([r for r in rows if w == "all" or r.get("W") == w], k))]
    notes.append(_plot([r for r in rows if "fs_vs_fastest" in r], plot))
    notes.append(f"one intra-op thread per rank; this machine has {os.cpu_count()} cores, shared with other "
                 f"jobs (1-minute load average {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end): "
                 "W=4 ranks time-share, and load blurs the small cases: read the quartiles")
    lib1 = library_fingerprint()
    notes.append(f"library: {lib0}" + ("" if lib1 == lib0 else f"; CHANGED during the run, at the end: {lib1} "
                                      "(the cases ran on different code: run again from a snapshot)"))
    notes.append("warm-up (s, Dion's compilation included) per case: "
                 + ", ".join(f"{r['case'].spec()}: {r['warmup_s']:.1f}" for r in raw if "warmup_s" in r))
    headline = [{"comparison": f"Muon on {'fully_shard' if s['ratio'].startswith('fs_') else 'FSDP2'} / "
                               f"fastest Dion Muon, geomean over {s['shapes']} shapes; worst {s['worst']} "
                               f"({s['above_1']} above 1)", "ratio": s["geomean"]}
                for s in summary if s["W"] == "all" and s["ratio"] in ("fs_vs_fastest", "fsdp2_vs_fastest")]
    headline += [{"comparison": f"Muon (Polar Express) on {'fully_shard' if s['ratio'].startswith('fs_') else 'FSDP2'}"
                                f" / Dion Muon (Polar Express), geomean over {s['shapes']} shapes; worst {s['worst']}",
                  "ratio": s["geomean"]} for s in summary if s["W"] == "all" and s["ratio"].endswith("_pe_vs_dion_pe")]
    return result(NAME, rows, notes, headline=headline, summary=summary, cpu_flags=flags,
                  ours_polar_express=pe is True, wall_s=time.perf_counter() - t0)


# -- profile --------------------------------------------------------------------------


def _profile_worker(case: Case, steps: int, src: str, top: int) -> dict[str, str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    dion = import_dion(src)

    device = current_device()
    mesh = init_device_mesh(torch.device(device).type, (dist.get_world_size(),), mesh_dim_names=("dp",))
    runners = _build(case, mesh, device, dion, _ours_pe_supported() is True)
    interleave(runners, 0, warmup=3, group=dist.group.WORLD, device=device)
    out = {}
    for name, step in runners.items():
        dist.barrier()
        c0, t0 = time.thread_time(), time.perf_counter()
        for _ in range(steps):
            step()
        wall, cpu = ((time.perf_counter() - t0) / steps * 1e3, (time.thread_time() - c0) / steps * 1e3)
        dist.barrier()
        prof = cProfile.Profile(time.thread_time)  # CPU time: immune to other jobs' preemption
        prof.enable()
        for _ in range(steps):
            step()
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
        dist.barrier()
        with torch_profile(activities=[ProfilerActivity.CPU]) as tp:
            for _ in range(steps):
                step()
        ops = tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
        out[name] = (f"== {name}: {wall:.2f} ms/step wall, {cpu:.2f} ms CPU (rank {dist.get_rank()}, "
                     f"unprofiled); cProfile (thread CPU time) over {steps} steps (divide by {steps} for "
                     f"ms/step):\n{buf.getvalue()}\ntorch.profiler (wall) over {steps} steps:\n{ops}\n")
    return out


def profile(spec: str, steps: int = 10, top: int = 25) -> None:
    """Print, for each runner on one case (rank 0): the unprofiled step time (wall and
    CPU), cProfile's top functions by own CPU time and torch.profiler's top ops."""
    src = dion_src()
    if src is None:
        raise SystemExit(f"set {DION_ENV} to a Dion checkout")
    case = Case.parse(spec)
    for text in spawn(_profile_worker, case.world, case, steps, src, top)[0].values():
        print(text)


def _ns_classes(cases: list[Case]) -> list[tuple[int, int, int]]:
    """(count, rows, cols): the same-shape blocks of each case, once each (the world size
    does not change what one rank's batch is)."""
    out: dict[tuple[int, int, int], None] = {}
    for c in cases:
        by: dict[tuple[int, int], int] = {}
        for b in c.blocks():
            by[b] = by.get(b, 0) + 1
        for (rows, cols), k in by.items():
            out[(k, rows, cols)] = None
    return list(out)


def ns_batch(cases: list[Case], quick: bool) -> dict:
    """Batched Newton-Schulz (``zeropower_via_newtonschulz_batched``) against the
    per-matrix loop, and NorMuon's batched normalization against its loop, on each case's
    same-shape blocks, one process on one thread, interleaved; medians of the per-call
    ratios, whether the bits agree, and whether the step would batch (the probe)."""
    from vefsdp_optim._math._newton_schulz import (
        NS_COEFFICIENTS,
        NS_EPS,
        NS_STEPS,
        newtonschulz_batch_exact,
        zeropower_via_newtonschulz,
        zeropower_via_newtonschulz_batched,
    )
    from vefsdp_optim._math._normuon import normuon_normalize_, normuon_normalize_batched_

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    budget = 1.5 if quick else 6.0
    rows_out = []
    try:
        for k, rows, cols in _ns_classes(cases):
            g = torch.Generator().manual_seed(rows * 31 + cols + k)
            x = torch.randn(k, rows, cols, generator=g)
            ortho = zeropower_via_newtonschulz_batched(x)
            v0 = torch.rand(k, rows, generator=g)
            t0 = time.perf_counter()
            zeropower_via_newtonschulz_batched(x)
            once = time.perf_counter() - t0
            steps = max(3, min(30, int(budget / max(once, 1e-6) / 2)))
            ns = interleave({"loop": lambda x=x: [zeropower_via_newtonschulz(m) for m in x],
                             "batched": lambda x=x: zeropower_via_newtonschulz_batched(x)}, steps)
            vs = [v.clone() for v in v0]
            norm = interleave({"loop": lambda o=ortho, vs=vs: [normuon_normalize_(a, v, 0.95)
                                                               for a, v in zip(o, vs, strict=True)],
                               "batched": lambda o=ortho, vs=vs: normuon_normalize_batched_(o, vs, 0.95)}, steps)
            loop = torch.stack([zeropower_via_newtonschulz(m) for m in x])
            rows_out.append({
                "blocks": f"{k} x {rows}x{cols}", "steps": steps,
                "ns_loop_ms": stats(ns["loop"], 1e3)["median"],
                "ns_batched_ms": stats(ns["batched"], 1e3)["median"],
                "ns_ratio": paired_ratio(ns["batched"], ns["loop"])["median"],
                "ns_bits_equal": bool(torch.equal(zeropower_via_newtonschulz_batched(x), loop)),
                "ns_probe_batches": k > 1 and newtonschulz_batch_exact(
                    k, rows, cols, torch.device("cpu"), NS_COEFFICIENTS, NS_STEPS, NS_EPS, 1),
                "norm_loop_ms": stats(norm["loop"], 1e3)["median"],
                "norm_ratio": paired_ratio(norm["batched"], norm["loop"])["median"],
            })
    finally:
        torch.set_num_threads(threads)
    ratios = [r["ns_ratio"] for r in rows_out]
    nratios = [r["norm_ratio"] for r in rows_out]
    notes = [f"one thread, {os.cpu_count()} CPUs, CPU flags {cpu_flags()}; {ns_kernels()}",
             "ratio: batched / per-matrix loop (median of the per-call ratios, interleaved; < 1: batched faster)",
             f"Newton-Schulz: geometric mean {_geomean(ratios):.3f}, worst {max(ratios):.3f}; "
             f"NorMuon normalization: geometric mean {_geomean(nratios):.3f}, worst {max(nratios):.3f}"]
    return result(f"{NAME}_ns_batch", rows_out, notes)


def main(argv: list[str] | None = None) -> dict | None:
    """``--quick`` / ``--full`` / ``--out`` as every bench module; ``--cases PATTERNS``
    times only the full grid's matching cases (quick budgets unless ``--full``);
    ``--profile FAMILY:D:COUNT:W`` prints cProfile tables of one case instead."""
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--profile", metavar="FAMILY:D:COUNT:W")
    ap.add_argument("--profile-steps", type=int, default=10)
    ap.add_argument("--cases", metavar="PATTERNS")
    ap.add_argument("--ns-batch", action="store_true",
                    help="batched Newton-Schulz and NorMuon normalization against their per-matrix loops instead")
    ap.add_argument("--out", default=f"benchmarks/out/{NAME}.json")
    a, rest = ap.parse_known_args(argv)
    if a.profile:
        profile(a.profile, a.profile_steps)
        return None
    if a.ns_batch:
        out = str(Path(a.out).with_name(f"{NAME}_ns_batch.json")) if a.out else ""
        return cli(lambda quick: ns_batch(select(a.cases) if a.cases else (QUICK if quick else full_grid()), quick),
                   f"{NAME}_ns_batch", [*rest, "--out", out])
    plot = Path(a.out).with_suffix(".png") if a.out else PLOT  # the plot beside the JSON
    cases = select(a.cases) if a.cases else None
    what = f"--cases {a.cases}" if a.cases else None
    return cli(lambda quick: sweep(cases or (QUICK if quick else full_grid()), quick, what, plot), NAME,
               [*rest, "--out", a.out])


if __name__ == "__main__":
    main()
