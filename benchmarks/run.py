"""Run the benchmark suite and write ``results.json`` and ``benchmarks/REPORT.md``.

    python -m benchmarks.run [--quick|--full] [--only NAME,...] [--out benchmarks/out]
                             [--report benchmarks/REPORT.md] [--render-only]

Each benchmark runs as ``python -m benchmarks.bench_NAME`` in its own process (which
spawns its own ranks), one after the other; a benchmark that fails or is missing is
reported as such and the others still run. ``--render-only`` re-renders the report
from an existing ``results.json``. The report's marked sections (``KEPT_SECTIONS``: the
GPU check's, the figures the README links to) are carried over from the earlier report.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ._common import machine_info, markdown_table, write_json

__all__ = ["BENCHMARKS", "KEPT_SECTIONS", "kept_sections", "main", "render_report", "run_suite"]

# name -> module (under benchmarks/), in run order
BENCHMARKS: dict[str, str] = {
    "planner": "bench_planner",
    "buffer": "bench_buffer",
    "fully_shard": "bench_fully_shard",
    "fully_shard_sweep": "bench_fully_shard_sweep",
    "memory": "bench_memory",
    "redistribute": "bench_redistribute",
    "optim": "bench_optim",
    "muon_dion": "bench_muon_dion",
    "muon_sweep": "bench_muon_sweep",
    "normuon_dion": "bench_normuon_dion",
    "muon_moe": "bench_muon_moe",
    "adam8bit": "bench_adam8bit",
    "many_tensors": "bench_many_tensors",
    "shampoo": "bench_shampoo",
    "soap": "bench_soap",
    "nd_mesh": "bench_nd_mesh",
    "profile": "bench_profile",
    "scale": "bench_scale",
}
TITLES = {
    "planner": "Planner: padding and planning time",
    "buffer": "DistributedBuffer vs FSDP2: all-gather + reduce-scatter",
    "fully_shard": "fully_shard vs FSDP2",
    "fully_shard_sweep": "fully_shard vs FSDP2 over the Muon sweep's dense shapes",
    "memory": "Peak memory and framework-style step time vs FSDP2 (AC off / on)",
    "redistribute": "Optimizer-side redistribution vs all-gather",
    "optim": "Muon and AdamW on FSDP2 vs torch.optim",
    "muon_dion": "Muon vs Dion's Muon (dense and MoE; VEFSDP_DION_SRC)",
    "muon_sweep": "Muon vs Dion's Muon over a shape sweep (quintic and Polar Express; VEFSDP_DION_SRC)",
    "normuon_dion": "NorMuon and Polar Express vs Dion's (a shape sweep; VEFSDP_DION_SRC)",
    "muon_moe": "Muon on an MoE model vs Dion's Muon and torch.optim.Muon per expert (VEFSDP_DION_SRC)",
    "adam8bit": "AdamW8bit vs torch AdamW and torchao AdamW8bit",
    "many_tensors": "The step's cost per parameter: many small parameters vs torch AdamW",
    "shampoo": "Shampoo overhead",
    "soap": "SOAP vs the reference SOAP's step, one device (VEFSDP_SOAP_REF)",
    "nd_mesh": "Optimizer steps on FSDP2 x tensor parallel (dp 2 x tp 2)",
    "profile": "Profile-guided optimization",
    "scale": "One rank of a W-rank job under torch's fake process group (W = 64 to 10,000; VEFSDP_DION_SRC)",
}
TIMEOUT_S = {True: 900, False: 3600}
# the scale sweep runs one process per (configuration, W, rank): 66 in quick mode
TIMEOUT_S_OF = {"scale": {True: 3600, False: 14400}}
_SKIP_TABLES = {"rows", "notes", "headline", "groups_detail", "per_rank"}


def _module_exists(module: str) -> bool:
    return importlib.util.find_spec(f"benchmarks.{module}") is not None


def _run_one(name: str, module: str, quick: bool, out_dir: Path) -> dict[str, Any]:
    if not _module_exists(module):
        return {"name": name, "rows": [], "notes": [],
                "status": f"not available: benchmarks/{module}.py does not exist in this checkout"}
    out = out_dir / f"{name}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", f"benchmarks.{module}", "--quick" if quick else "--full",
           "--out", str(out)]
    limit = TIMEOUT_S_OF.get(name, TIMEOUT_S)[quick]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
        rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-1500:]
    except subprocess.TimeoutExpired:
        rc, tail = -1, f"timed out after {limit} s"
    wall = time.perf_counter() - t0
    if rc != 0 or not out.exists():
        return {"name": name, "rows": [], "notes": [], "wall_s": wall,
                "status": f"failed (exit {rc})", "error_tail": tail}
    res = json.loads(out.read_text())
    res["wall_s_process"] = wall
    return res


def run_suite(quick: bool, only: list[str] | None, out_dir: Path) -> dict[str, Any]:
    names = only or list(BENCHMARKS)
    bad = [n for n in names if n not in BENCHMARKS]
    if bad:
        raise ValueError(f"unknown benchmark(s) {bad}; choose from {list(BENCHMARKS)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    results = {}
    for n in names:
        print(f"[benchmarks] {n} ...", flush=True)
        results[n] = _run_one(n, BENCHMARKS[n], quick, out_dir)
        w = results[n].get("wall_s_process", results[n].get("wall_s", 0.0))
        print(f"[benchmarks] {n}: {results[n].get('status', 'ok')} in {w:.1f} s", flush=True)
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"mode": "quick" if quick else "full", "machine": machine_info(),
            "wall_s": time.perf_counter() - t0, "cpu_s": ru.ru_utime + ru.ru_stime,
            "load_avg_1m_at_end": os.getloadavg()[0], "results": results}


# -- report ---------------------------------------------------------------------------

_INTRO = """\
How to read this: every comparison is a ratio **this library / peer** measured in the
same run, the two stepping in alternating order, so that load from other processes falls
on both alike. A time ratio below 1 means this library is faster. Timed cells read
`median (p25–p75)` over the timed steps; a ratio cell is the median (quartiles) of the
per-step ratios. The machine is shared with other users' jobs, so absolute times mean
little; read the ratios. Distributed CPU rows use gloo; rows that need CUDA / NCCL say
so where the machine has none."""


def _section(name: str, res: dict[str, Any]) -> list[str]:
    lines = [f"## {TITLES.get(name, name)} (`{name}`)", ""]
    wall = res.get("wall_s_process", res.get("wall_s"))
    if res.get("status"):
        lines += [f"**{res['status']}**", ""]
        if res.get("error_tail"):
            lines += ["```", res["error_tail"].strip(), "```", ""]
        if not res.get("rows"):
            return lines
    if wall is not None:
        lines += [f"Wall time: {wall:.1f} s.", ""]
    if res.get("rows"):
        lines += [markdown_table(res["rows"]), ""]
    for key, val in res.items():
        if key in _SKIP_TABLES or not isinstance(val, list) or not val:
            continue
        if all(isinstance(r, dict) for r in val):
            lines += [f"**{key}**", "", markdown_table(val), ""]
    if res.get("notes"):
        lines += [f"- {n}" for n in res["notes"]] + [""]
    return lines


def _headlines(results: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for name, res in results.items():
        for h in res.get("headline", []):  # {"comparison", "ratio"}; {"metric", "value"} too
            what = h.get("comparison", h.get("metric", h.get("what", "")))
            out.append({"benchmark": name, "comparison": what, "ratio": h.get("ratio", h.get("value"))})
    return out


def render_report(suite: dict[str, Any]) -> str:
    """Markdown of a ``run_suite`` result: machine, headline ratios, one section per
    benchmark (tables, notes, and what did not run)."""
    m = suite["machine"]
    cuda = ", ".join(m.get("cuda_devices") or []) or "none (CPU only: CUDA/NCCL rows not run)"
    lines = [
        "# Benchmark report",
        "",
        f"Generated by `python -m benchmarks.run --{suite['mode']}` on {m['date_utc']}; "
        f"the suite took {suite['wall_s']:.0f} s wall"
        + (f" and {suite['cpu_s']:.0f} s of CPU (user + system, all benchmark processes; "
           f"1-minute load average {suite['load_avg_1m_at_end']:.1f} on {m['cores']} cores at the end: "
           "on a busy shared machine the wall time stretches, the CPU time does not)"
           if "cpu_s" in suite else "") + "."
        + (f" Assembled: {suite['assembled']}." if suite.get("assembled") else ""),
        "",
        markdown_table([{"CPU": m["cpu"], "cores": m["cores"], "RAM GiB": m["ram_gib"],
                         "torch": m["torch"], "python": m["python"], "CUDA": cuda}]),
        "",
        _INTRO,
        "",
    ]
    heads = _headlines(suite["results"])
    if heads:
        lines += ["## Headline ratios", "", markdown_table(heads), ""]
    for name, res in suite["results"].items():
        lines += _section(name, res)
    return "\n".join(lines).rstrip() + "\n"


# Sections of REPORT.md that a render keeps, each between its markers: the GPU
# check's (written by tools/gpu_check.py) and the figures the README links to (written
# by hand from docs/performance.md's measurements).
KEPT_SECTIONS = ("figures", "gpu-check")


def kept_sections(old: str) -> str:
    """The marked sections of an earlier report (``<!-- NAME: begin -->`` to
    ``<!-- NAME: end -->`` for each of ``KEPT_SECTIONS``), in that order, or ""."""
    parts = []
    for name in KEPT_SECTIONS:
        begin, end = f"<!-- {name}: begin -->", f"<!-- {name}: end -->"
        if begin in old and end in old[old.index(begin):]:
            i = old.index(begin)
            parts.append(old[i: old.index(end, i) + len(end)])
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="quick", action="store_true", default=True)
    mode.add_argument("--full", dest="quick", action="store_false")
    ap.add_argument("--only", default="", help=f"comma-separated subset of {','.join(BENCHMARKS)}")
    ap.add_argument("--out", default="benchmarks/out")
    ap.add_argument("--report", default="benchmarks/REPORT.md")
    ap.add_argument("--render-only", action="store_true")
    a = ap.parse_args(argv)
    out_dir = Path(a.out)
    results_path = out_dir / "results.json"
    if a.render_only:
        suite = json.loads(results_path.read_text())
    else:
        only = [s.strip() for s in a.only.split(",") if s.strip()] or None
        suite = run_suite(a.quick, only, out_dir)
        if only and results_path.exists():  # keep the other benchmarks' last results
            old = json.loads(results_path.read_text())
            suite["results"] = {**old.get("results", {}), **suite["results"]}
            suite["results"] = {n: suite["results"][n] for n in BENCHMARKS if n in suite["results"]}
            # assembled from several runs: the wall time is the benchmarks' own, CPU unknown
            suite["wall_s"] = sum(r.get("wall_s_process", r.get("wall_s", 0.0))
                                  for r in suite["results"].values())
            suite.pop("cpu_s", None)
            suite["assembled"] = f"--only {','.join(only)} merged into an earlier results.json"
        write_json(results_path, suite)
    report = Path(a.report)
    kept = kept_sections(report.read_text()) if report.exists() else ""
    report.write_text(render_report(suite) + (f"\n{kept}\n" if kept else ""))
    print(f"wrote {results_path} and {a.report} ({suite['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
