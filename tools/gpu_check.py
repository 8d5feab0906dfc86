"""``make gpu-check``: this library on a GPU, with the GPU machine's own torch, in one command.

    python3 tools/gpu_check.py [--parts A,B] [--worlds 1,2] [--optimizers A,B] [--budget S] [--out DIR]
    python3 tools/gpu_check.py --cpu-dry-run [...]      # the same parts: gloo, CPU tensors
    python3 tools/gpu_check.py --apply-section FILE     # a run's GPU section into REPORT.md

Without a CUDA device (``nvidia-smi -L`` lists none) it says so and exits 0 at once.
Else it picks the python whose torch sees the GPU (``$GPU_PYTHON`` if set; nothing is
installed or built: the checkout is imported from where it lies, [Note: checkout
imports]), names any missing dependency (einops, scipy, pytest, hypothesis; triton),
and runs each part in a process of its own, with its own time limit and within the whole
run's budget (``--budget``, 450 s: the run stays under 8 minutes):

- ``plain``, ``fully_shard``, ``fsdp2``: every optimizer on plain CUDA parameters and on
  our and torch's fully_shard, NCCL at world size 1 and at 2, 3 and all GPUs where there
  are that many, bit for bit against torch.optim or one device, with a DCP save, load
  and resumed steps, and every step after each optimizer's first watched for host syncs
  (``set_sync_debug_mode``; one step under its "error" at W = 1): tools/_gpu_correct.py;
- ``capture``: every optimizer with ``capturable=True`` on plain CUDA parameters and on our
  and torch's fully_shard at W = 1, one ``opt.step()`` captured in a CUDA graph and
  replayed, bit for bit against eager steps, and the replay's time against an eager
  step's: tools/_gpu_capture.py;
- ``profiler``: are our fully_shard's all-gathers and reduce-scatters off the default
  stream (FSDP2 as the control): tools/_gpu_profile.py;
- ``kernels``: the suite's GPU tests (``VEFSDP_TEST_DEVICE=cuda``: the Triton 8-bit
  kernel against the C++ kernel and the eager ops, bit for bit);
- ``bench_adam8bit``, ``bench_muon``, ``bench_fully_shard``: tools/_gpu_bench.py;
- ``estimate``: the memory estimate (``python -m vefsdp_optim.estimate``, fake tensors)
  against ``torch.cuda.max_memory_allocated`` of the same rank on real tensors, within
  5%: tools/_gpu_estimate.py.

A part that fails, crashes or runs out of time is reported and the others still run
([Note: part results survive the part] in tools/_gpu_parts.py). It writes
``report.md``, ``results.json`` and ``gpu_section.md`` under ``benchmarks/out/gpu/`` and
the GPU section of ``benchmarks/REPORT.md`` (between its markers, the device, torch and
triton named). The exit status is 1 if a correctness part (or the sync check) did not
pass, else 0. ``--cpu-dry-run`` runs the same parts with gloo on CPU tensors at tiny
sizes (W = 1 and 2), writes under ``benchmarks/out/gpu-dry-run/`` and leaves REPORT.md
alone; there the sync check reports without judging (tests/test_no_host_sync.py judges).
Standard library only at module level: it runs under a python without torch.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out" / "gpu"
DRY_OUT = ROOT / "benchmarks" / "out" / "gpu-dry-run"
REPORT = ROOT / "benchmarks" / "REPORT.md"
BEGIN, END = "<!-- gpu-check: begin -->", "<!-- gpu-check: end -->"
DEPS = ("einops", "scipy", "pytest", "hypothesis")
OPTIONAL = ("triton",)
BUDGET_S = 450.0
# seconds each part may take on a GPU (on the CPU dry run: CPU_CAP_S each)
CAPS_S = {"plain": 45, "fully_shard": 60, "fsdp2": 60, "fsdp1": 45, "capture": 60, "profiler": 40, "kernels": 70,
          "bench_adam8bit": 40, "bench_muon": 50, "bench_fully_shard": 70, "estimate": 60}
CPU_CAP_S = 300
CORRECTNESS = ("plain", "fully_shard", "fsdp2", "fsdp1", "capture", "kernels")
KERNEL_TESTS = ["tests/test_adam8bit_triton.py", "tests/test_adam8bit_capturable_triton.py", "-k",
                "triton_equals or bf16_param or compiles_for_cuda or default_on_cuda or one_launch or device_table"]

# -- the machine and its python -----------------------------------------------------------------


def cuda_devices() -> list[str]:
    """The GPUs ``nvidia-smi -L`` lists (none where it is missing or fails, or where
    ``CUDA_VISIBLE_DEVICES`` hides every device)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", "x").strip() in ("", "-1"):
        return []
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        r = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [ln.strip() for ln in r.stdout.splitlines() if ln.startswith("GPU ")] if r.returncode == 0 else []


_PROBE = r"""
import importlib.metadata as md, importlib.util, json, sys
out = {"python": sys.executable, "python_version": sys.version.split()[0], "deps": {}}
for name in %(deps)r:
    try:
        out["deps"][name] = md.version(name) if importlib.util.find_spec(name) else None
    except Exception:
        out["deps"][name] = "?"
try:
    import torch
    out.update(torch=torch.__version__, cuda=torch.version.cuda, cuda_ok=torch.cuda.is_available())
    if out["cuda_ok"]:
        out.update(count=torch.cuda.device_count(), device=torch.cuda.get_device_name(0))
except Exception as e:
    out["torch_error"] = f"{type(e).__name__}: {e}"
if "torch" in out:
    try:
        import tools._checkout, vefsdp_optim
        out["import"] = "ok"
    except Exception as e:
        out["import"] = f"{type(e).__name__}: {e}"
print("GPUCHECK" + json.dumps(out))
"""


def _env(**extra: str) -> dict[str, str]:
    """The parts' environment: the checkout first on ``PYTHONPATH``."""
    path = os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH", "")) if x)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **extra}


def probe(py: str) -> dict[str, Any]:
    """What ``py`` has: its torch (and whether it sees CUDA), the dependencies, and
    whether ``vefsdp_optim`` imports from the checkout."""
    try:
        r = subprocess.run([py, "-c", _PROBE % {"deps": DEPS + OPTIONAL}], cwd=ROOT, env=_env(),
                           capture_output=True, text=True, timeout=180)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"python": py, "error": f"{type(e).__name__}: {e}"}
    for line in r.stdout.splitlines():
        if line.startswith("GPUCHECK"):
            return json.loads(line[len("GPUCHECK"):])
    return {"python": py, "error": (r.stderr.strip() or r.stdout.strip())[-300:]}


def candidates() -> list[str]:
    """``$GPU_PYTHON`` alone if set; else this python, ``python3`` and ``python`` on the
    PATH, and the checkout's venvs."""
    if os.environ.get("GPU_PYTHON"):
        return [os.environ["GPU_PYTHON"]]
    found = [sys.executable, shutil.which("python3"), shutil.which("python")]
    found += [str(ROOT / v / "bin" / "python") for v in (".venv", ".venv-torch-lo", ".venv-torch-hi", ".venv-gpu")]
    out: list[str] = []
    for p in found:
        if p and os.path.exists(p) and p not in out:
            out.append(p)
    return out


def pick_python(cuda: bool) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """The first candidate whose torch sees CUDA (the dry run: has a torch); all probes."""
    probes = []
    for py in candidates():
        p = probe(py)
        probes.append(p)
        if "torch" in p and (p.get("cuda_ok") or not cuda):
            return p, probes
    return None, probes


# -- the parts --------------------------------------------------------------------------------------


def plan(n_gpus: int, dry: bool, parts: list[str] | None, worlds: list[int] | None) -> list[tuple[str, int]]:
    """(part, world size) in run order: correctness first, at W = 1 then larger W; then the
    stream check, the kernel tests and the benchmarks."""
    if worlds is None:
        worlds = [1, 2] if dry else sorted({w for w in (1, 2, 3, n_gpus) if 1 <= w <= max(n_gpus, 1)})
    big = [w for w in worlds if w > 1]
    steps: list[tuple[str, int]] = [("plain", 1)]
    steps += [(k, w) for w in worlds for k in ("fully_shard", "fsdp2")]
    steps.append(("fsdp1", max(worlds)))  # FSDP1 flattens only where it shards (W > 1)
    if 1 in worlds:
        steps.append(("capture", 1))
    steps.append(("profiler", min(big) if big else 1))
    if not dry:
        steps.append(("kernels", 1))
    steps += [("bench_adam8bit", 1), ("bench_muon", 1), ("bench_fully_shard", 1), ("estimate", 1)]
    if big and not dry:
        steps.append(("bench_fully_shard", max(big)))
    if parts is not None:
        unknown = sorted(set(parts) - set(CAPS_S))
        if unknown:
            raise ValueError(f"--parts: unknown {unknown}; accepted: {', '.join(CAPS_S)}")
        steps = [s for s in steps if s[0] in parts]
        if "kernels" in parts and ("kernels", 1) not in steps:
            steps.append(("kernels", 1))
    return steps


def _kind(part: str) -> str:
    """How a part counts: "correctness" (in the exit status), "check" (reported), "bench"."""
    return "correctness" if part in CORRECTNESS else "check" if part == "profiler" else "bench"


def _tail(path: Path, n: int = 3000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else ""


def _recover(d: Path, part: str, world: int, why: str) -> dict[str, Any]:
    """A part that ended without its result: what its ranks wrote as they went."""
    res: dict[str, Any] = dict(part=part, world=world, status=why, kind=_kind(part))
    log = d / "rank0.jsonl"
    lines = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    done = [x for x in lines if "start" not in x]
    started = [x["start"] for x in lines if "start" in x]
    if part in ("plain", "fully_shard", "fsdp2"):
        res["cases"] = [x for x in done if "optimizer" in x]
    elif part == "capture":
        res["captures"] = [x for x in done if "optimizer" in x]
    else:
        res["partial"] = done
    if len(started) > len(done):
        res["running"] = started[-1]
    errors = "".join(p.read_text()[-2000:] for p in sorted(d.glob("rank*.error")))
    res["log_tail"] = (errors + "\n" + _tail(d / "log.txt")).strip()[-4000:]
    return res


def run_part(py: str, part: str, world: int, device: str, out: Path, timeout: float,
             optimizers: str | None = None) -> dict[str, Any]:
    d = out / "parts" / f"{part}-w{world}"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    if part == "kernels":
        return run_kernel_tests(py, device, d, timeout)
    cmd = [py, "-m", "tools._gpu_parts", "--part", part, "--world", str(world), "--device", device,
           "--dir", str(d), *(["--optimizers", optimizers] if optimizers and part in CORRECTNESS else [])]
    t0 = time.monotonic()
    with open(d / "log.txt", "w") as log:
        p = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # the part and the ranks it spawned
            p.wait()
            rc = None
    if rc == 0 and (d / "result.json").exists():
        res = json.loads((d / "result.json").read_text())
    else:
        why = f"timed out after {timeout:.0f} s" if rc is None else f"exited with status {rc}"
        res = _recover(d, part, world, "timeout" if rc is None else "error")
        res["why"] = why
    res["wall_s"] = round(time.monotonic() - t0, 1)
    return res


def run_kernel_tests(py: str, device: str, d: Path, timeout: float) -> dict[str, Any]:
    """The suite's GPU tests of the 8-bit kernels, with ``VEFSDP_TEST_DEVICE``."""

    args = [py, "-m", "pytest", "-p", "tools._checkout", "-q", "-rfEs", "-p", "no:cacheprovider", *KERNEL_TESTS]
    t0 = time.monotonic()
    with open(d / "log.txt", "w") as log:
        p = subprocess.Popen(args, cwd=ROOT, env=_env(VEFSDP_TEST_DEVICE=device), stdout=log,
                             stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc: int | None = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            rc = None
    text = _tail(d / "log.txt", 200_000)
    last = [ln for ln in text.splitlines() if ln.strip()][-1:] or [""]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|deselected)", last[0])}
    return dict(part="kernels", world=1, kind="correctness",
                status="timeout" if rc is None else "pass" if rc == 0 else "fail",
                wall_s=round(time.monotonic() - t0, 1), counts=counts,
                command=" ".join(["pytest", *args[3:]]),
                failures=re.findall(r"^(?:FAILED|ERROR) (.*)$", text, re.M),
                skipped=sorted(set(re.findall(r"^SKIPPED \[\d+\] (.*)$", text, re.M))),
                log_tail=text[-3000:] if rc != 0 else "")


# -- verdicts ---------------------------------------------------------------------------------------


# syncs that torch makes inside one of its own ops, whatever the caller does: the line
# that calls the op, as the source says it -> why (listed in the report, not judged)
INSIDE_TORCH = {"torch.linalg.eigh(": "torch.linalg.eigh reads its error code back to the host on CUDA"}


def inside_torch(loc: str) -> str | None:
    """Why the sync reported at ``loc`` ("path:line", or a message ending in "(at
    path:line)") is torch's own, or None."""
    m = re.search(r"([\w./-]+\.py):(\d+)\)?$", loc)
    if m is None:
        return None
    try:
        line = (ROOT / m.group(1)).read_text().splitlines()[int(m.group(2)) - 1]
    except (OSError, IndexError):
        return None
    return next((why for call, why in INSIDE_TORCH.items() if call in line), None)


def sync_verdict(results: list[dict[str, Any]]) -> tuple[str, list[str]]:
    """"pass" / "fail" / "not run" over every correctness case's sync watch, and the
    lines found (with the cases). A sync inside one of torch's own ops (``INSIDE_TORCH``)
    is listed, marked as such, and does not fail the check."""
    found: list[str] = []
    known: list[str] = []
    seen = False
    for r in results:
        for c in r.get("cases", []):
            seen = True
            where = f"{c['optimizer']} on {c['kind']} W={c['world']}"
            for loc, n in c["sync"]["events"].items():
                at = c["sync"].get("steps", {}).get(loc)
                found.append(f"{where}: {loc} (x{n}" + (f", steps {', '.join(map(str, at))})" if at else ")"))
            if c["sync"]["strict"] not in (None, "ok"):
                found.append(f"{where}: under \"error\": {c['sync']['strict']}")
            for r_, o in (c.get("other_ranks") or {}).items():
                for loc, n in o["sync"]["events"].items():
                    found.append(f"{where} rank {r_}: {loc} (x{n})")
    for f in list(found):
        why = inside_torch(f.rsplit(" (x", 1)[0])
        if why is not None:
            found.remove(f)
            known.append(f"{f} [inside torch: {why}]")
    return ("not run" if not seen else "fail" if found else "pass"), found + known


def exit_status(results: list[dict[str, Any]], dry: bool) -> int:
    if any(r["kind"] == "correctness" and r["status"] != "pass" for r in results):
        return 1
    return 1 if not dry and sync_verdict(results)[0] == "fail" else 0


# -- the report --------------------------------------------------------------------------------------


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v).replace("|", "\\|").replace("\n", " ")


def md_table(rows: list[dict[str, Any]]) -> str:
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def _cell(c: dict[str, Any]) -> str:
    """One case's verdict in a few words."""
    if c["error"]:
        first = [ln for ln in c["error"].splitlines() if ln.strip()]
        return f"error {first[0]} {first[-1]}"[:220] if first else "error"
    parts = []
    m = c["mismatch"]
    if m:
        parts.append(f"differs from step {m['step']} (p{m['param']}: {m['n_diff']} of {m['numel']}, "
                     f"max {m['max_abs']:.3g})")
    g = c["grads"]
    if not g["equal"]:
        parts.append(f"reduced gradient off by {g['max_abs']:.3g}" + ("" if g["exact_expected"] else " (not judged)"))
    dcp = c.get("dcp")
    if dcp and not dcp["ok"]:
        parts.append("DCP: " + (dcp["error"] or ("loaded parameters differ" if not dcp["loaded_equal"]
                                                 else "resumed steps differ")))
    return "; ".join(parts) or f"equal ({c['steps']} steps{', DCP' if dcp else ''})"


def _capture_row(c: dict[str, Any]) -> dict[str, Any]:
    """One case of the capture part, as a table row."""
    if c.get("error"):
        first = [ln for ln in c["error"].splitlines() if ln.strip()]
        verdict = f"error: {first[-1]}"[:220] if first else "error"
    elif c["mismatch"]:
        m = c["mismatch"]
        verdict = f"differs: {m['what']}" + (f" ({m['n_diff']} of {m['numel']})" if m.get("n_diff") else "")
    else:
        verdict = f"equal ({c['steps']} steps)"
    return {"optimizer": c["optimizer"], "kind": c["kind"], "verdict": verdict, "eager ms": c.get("eager_ms"),
            "replay ms": c.get("replay_ms"), "eager / replay": c.get("ratio")}


def _part_name(r: dict[str, Any]) -> str:
    name = {"plain": "plain", "fully_shard": "fully_shard", "fsdp2": "FSDP2"}.get(r["part"], r["part"])
    return name + f" W={r['world']}"


def render(info: dict[str, Any], results: list[dict[str, Any]], dry: bool, full: bool) -> str:
    """The report's markdown; ``full`` adds the tracebacks and logs (report.md)."""
    lines = [BEGIN, "## GPU (make gpu-check)" + (" - CPU dry run" if dry else ""), ""]
    where = ("CPU (dry run: gloo ranks, CPU tensors)" if dry else f"**{info.get('device')}** x {info.get('count')}")
    spec = info.get("torch_range", "?")
    outside = {True: "", False: ", outside it", None: ""}[in_range(str(info.get("torch")), spec)]
    lines.append(f"Device: {where}, torch {info.get('torch')}" + (f" (CUDA {info['cuda']})" if info.get("cuda") else "")
                 + f" (declared range {spec}{outside})"
                 + f", triton {info['deps'].get('triton') or 'not installed'}, "
                 f"python {info.get('python_version')} ({info.get('python')}); {info['date']}; "
                 f"checkout {info['commit']}; "
                 f"{info['wall_s']:.0f} s" + (f" of a {info['budget_s']:.0f} s budget" if info["budget_s"] else "")
                 + f"; exit status {info['exit']}.")
    missing = [k for k in DEPS if not info["deps"].get(k)]
    lines += ["", "Missing dependencies: " + (", ".join(missing) if missing else "none") +
              (f"; `import vefsdp_optim`: {info['import']}" if info.get("import") != "ok" else "") + ".", ""]
    sync, found = sync_verdict(results)
    rows = []
    for r in results:
        what = {"correctness": "bit for bit" if r["part"] != "kernels" else "GPU tests",
                "check": "off the default stream", "bench": "benchmark"}[r["kind"]]
        detail = r.get("why", "")
        if r.get("cases"):
            bad = [c for c in r["cases"] if not c["ok"]]
            detail = (f"{len(r['cases']) - len(bad)} of {len(r['cases'])} optimizers equal"
                      + (f"; {detail}" if detail else "") + (f"; running: {r['running']}" if r.get("running") else ""))
        elif r.get("captures"):
            bad = [c for c in r["captures"] if not c["ok"]]
            detail = (f"{len(r['captures']) - len(bad)} of {len(r['captures'])} cases equal"
                      + (f"; {detail}" if detail else "") + (f"; running: {r['running']}" if r.get("running") else ""))
        elif r["part"] == "kernels":
            detail = ", ".join(f"{v} {k}" for k, v in r.get("counts", {}).items()) or detail
        elif r["part"] == "profiler" and "ours" in r:
            detail = f"ours: {r['ours'].get('why')}; FSDP2: {r['fsdp2'].get('why')}"
        elif r.get("ratios"):
            detail = "; ".join(f"{k} {v:.3f}" for k, v in r["ratios"].items())
        rows.append({"part": _part_name(r), "checks": what, "status": r["status"].upper() if r["status"] != "pass"
                     else "pass", "s": r.get("wall_s"), "detail": detail[:400]})
    cases = [c for r in results for c in r.get("cases", [])]
    dcp = [c for c in cases if c.get("dcp") is not None]
    if dcp:
        bad = [c for c in dcp if not c["dcp"]["ok"]]
        rows.append({"part": "DCP", "checks": "save, load, resumed steps", "status": "FAIL" if bad else "pass",
                     "s": None, "detail": f"{len(dcp) - len(bad)} of {len(dcp)} cases equal"})
    judged = " (the CPU dry run reports, not judges: tests/test_no_host_sync.py judges)" if dry else ""
    rows.append({"part": "sync", "checks": "no host sync in a step", "status": sync.upper() if sync != "pass" else
                 "pass", "s": None, "detail": f"{len(found)} findings" + judged})
    lines += [md_table(rows), ""]
    corr = [r for r in results if r.get("cases")]
    if corr:
        names = list(dict.fromkeys(c["optimizer"] for r in corr for c in r["cases"]))
        table = []
        for n in names:
            row: dict[str, Any] = {"optimizer": n}
            for r in corr:
                hit = [c for c in r["cases"] if c["optimizer"] == n]
                row[_part_name(r)] = _cell(hit[0]) if hit else "not run"
            table.append(row)
        lines += ["### Every optimizer against torch.optim or one device", "",
                  "AdamW and Muon against torch.optim.AdamW / torch.optim.Muon, the others against the "
                  "same class on one device fed the reduced gradient (tools/_gpu_correct.py); a DCP round "
                  "trip between the third and fourth step on the sharded ones.", "", md_table(table), ""]
    for r in results:
        if r.get("captures"):
            lines += ["### Captured steps (capturable=True, one CUDA graph)", "",
                      "Per optimizer and kind of parameter: eager steps against one captured `opt.step()` "
                      "replayed, parameters and state bit for bit; the median eager step and replay in ms and "
                      "their ratio (tools/_gpu_capture.py)" + (", the replays eager steps on the CPU" if dry else "")
                      + ".", "", md_table([_capture_row(c) for c in r["captures"]]), ""]
    if found:
        lines += ["### Host syncs in a step", ""] + [f"- {f}" for f in found[:60]] + [""]
    prof = [r for r in results if r["part"] == "profiler" and "ours" in r]
    for r in prof:
        lines += [f"### Streams (profiler, W={r['world']})", ""]
        for s in ("ours", "fsdp2"):
            a = r[s]
            lines.append(f"- {'our fully_shard' if s == 'ours' else 'FSDP2 (control)'}: "
                         f"{ {True: 'pass', False: 'FAIL', None: 'not judged'}[a.get('ok')] }: {a.get('why')}")
            for k in ("all_gather", "reduce_scatter"):
                if k in a:
                    lines.append(f"  - {k.replace('_', '-')}s: {a[k]['n']} on streams {', '.join(a[k]['streams'])}"
                                 f" (default stream {a.get('default_stream')}, "
                                 f"from the {a.get('default_stream_from')}); "
                                 f"overlap with compute {a[k]['overlap_share']}")
        lines.append("")
    for r in results:
        if r["kind"] == "bench" and r.get("rows"):
            lines += [f"### {r['part']} W={r['world']}", "", md_table(r["rows"]), ""]
            lines += [f"- {k}: **{v:.3f}**" for k, v in r.get("ratios", {}).items()]
            lines += [f"- {n}" for n in r.get("notes", [])] + [""]
    if full:
        for r in results:
            tb = [c for c in r.get("cases", []) + r.get("captures", []) if c.get("error")]
            if tb or r.get("log_tail"):
                lines += [f"### {_part_name(r)}: details", ""]
                for c in tb:
                    lines += [f"{c['optimizer']}" + (f" on {c['kind']}" if "captures" in r else "") + ":", "```",
                              c["error"].strip(), "```"]
                if r.get("log_tail"):
                    lines += ["log tail:", "```", r["log_tail"].strip(), "```"]
                lines.append("")
    lines.append(END)
    return "\n".join(lines) + "\n"


def write_section(section: str, report: Path = REPORT) -> None:
    """Replace the GPU section of ``report`` (between the markers), or append one."""
    text = report.read_text() if report.exists() else ""
    if BEGIN in text and END in text:
        text = text[:text.index(BEGIN)] + section + text[text.index(END) + len(END):].lstrip("\n")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    report.write_text(text)


def declared_range() -> str:
    """pyproject.toml's torch requirement, e.g. ``>=2.11,<2.16`` (read as text)."""

    m = re.search(r'^\s*"torch\s*([^";]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    return m.group(1).strip() if m else "?"


def in_range(version: str, spec: str) -> bool | None:
    """Whether a torch version (``2.11.0+cu130``) meets ``spec`` (``>=2.11,<2.16``);
    None where either cannot be read."""
    import operator

    def key(v: str) -> tuple[int, ...]:
        return tuple(int(x) for x in re.findall(r"\d+", v.split("+")[0])[:3])

    ops = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt, "==": operator.eq}
    try:
        have = key(version)
        for part in spec.split(","):
            m = re.fullmatch(r"\s*(>=|<=|>|<|==)\s*([\d.]+)\s*", part)
            if m is None:
                return None
            want = key(m.group(2))
            n = max(len(have), len(want))
            if not ops[m.group(1)](have + (0,) * (n - len(have)), want + (0,) * (n - len(want))):
                return False
    except (ValueError, TypeError):
        return None
    return True


def _commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return (head or "unknown") + (" with uncommitted changes" if dirty else "")


# -- main ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-dry-run", action="store_true", help="the same parts with gloo on CPU tensors, tiny sizes")
    ap.add_argument("--parts", default=None, help=f"comma-separated subset of: {', '.join(CAPS_S)}")
    ap.add_argument("--worlds", default=None, help="comma-separated world sizes (default: 1, 2, 3 and all GPUs)")
    ap.add_argument("--optimizers", default=None, help="comma-separated subset of the optimizers checked "
                    "(default all six)")
    ap.add_argument("--budget", type=float, default=None, help=f"seconds for all parts (default {BUDGET_S:.0f}; "
                    "dry run: none)")
    ap.add_argument("--out", type=Path, default=None, help="where the report files go")
    ap.add_argument("--apply-section", type=Path, default=None, metavar="FILE",
                    help="write FILE (a run's gpu_section.md) into benchmarks/REPORT.md, nothing else")
    a = ap.parse_args(argv)
    if a.apply_section is not None:
        write_section(a.apply_section.read_text())
        print(f"gpu-check: wrote {a.apply_section} into {REPORT}")
        return 0
    t0 = time.monotonic()
    dry = a.cpu_dry_run
    devices = [] if dry else cuda_devices()
    if not dry and not devices:
        print("gpu-check: no CUDA device on this machine (nvidia-smi lists none): nothing to check, exit 0 "
              f"({time.monotonic() - t0:.1f} s)")
        return 0
    out = a.out or (DRY_OUT if dry else OUT)
    out.mkdir(parents=True, exist_ok=True)
    if devices:
        print("gpu-check: CUDA devices:", *devices, sep="\n  ")
    info, probes = pick_python(cuda=not dry)
    if info is None:
        msg = ("gpu-check: no python here has a torch that " + ("imports" if dry else "sees the GPU") +
               "; set GPU_PYTHON. Probed:\n" + "\n".join(f"  {json.dumps(p)}" for p in probes))
        print(msg, file=sys.stderr)
        (out / "results.json").write_text(json.dumps(dict(error=msg, probes=probes), indent=1))
        return 1
    py = info["python"]
    missing = [k for k in DEPS if not info["deps"].get(k)]
    print(f"gpu-check: python {py}, torch {info['torch']}; missing dependencies: {', '.join(missing) or 'none'}; "
          f"import vefsdp_optim: {info.get('import')}", flush=True)
    n_gpus = 0 if dry else int(info.get("count") or len(devices))  # what torch sees (CUDA_VISIBLE_DEVICES)
    steps = plan(n_gpus, dry, a.parts.split(",") if a.parts else None,
                 [int(w) for w in a.worlds.split(",")] if a.worlds else None)
    budget = a.budget if a.budget is not None else (float("inf") if dry else BUDGET_S)
    deadline = t0 + budget
    device = "cpu" if dry else "cuda"
    results = []
    for part, world in steps:
        left = deadline - time.monotonic()
        cap = CPU_CAP_S if dry else CAPS_S[part]
        if left < min(cap, 10):
            results.append(dict(part=part, world=world, kind=_kind(part), status="not run",
                                why=f"the {budget:.0f} s budget was spent"))
            continue
        print(f"gpu-check: {part} W={world} (up to {min(cap, left):.0f} s) ...", end=" ", flush=True)
        try:
            r = run_part(py, part, world, device, out, min(cap, left), a.optimizers)
        except Exception as e:  # noqa: BLE001 - the driver's own failure on one part
            r = dict(part=part, world=world, kind=_kind(part), status="error", why=f"{type(e).__name__}: {e}")
        print(f"{r['status']} ({r.get('wall_s', 0):.0f} s)", flush=True)
        results.append(r)
    info.update(count=n_gpus, torch_range=declared_range(),
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), commit=_commit(),
                budget_s=budget if budget != float("inf") else 0.0, wall_s=time.monotonic() - t0)
    info["exit"] = exit_status(results, dry)
    (out / "results.json").write_text(json.dumps(dict(info=info, probes=probes, results=results), indent=1,
                                                 default=str))
    try:
        section = render(info, results, dry, full=False)
        full = render(info, results, dry, full=True)
    except Exception as e:  # noqa: BLE001 - the results are written; say why the tables are not
        section = full = (f"{BEGIN}\n## GPU (make gpu-check)\n\nThe report could not be rendered "
                          f"({type(e).__name__}: {e}); the results are in results.json.\n{END}\n")
    (out / "gpu_section.md").write_text(section)
    (out / "report.md").write_text(full)
    if not dry:
        write_section(section)
    print(section)
    print(f"gpu-check: wrote {out}/report.md, results.json, gpu_section.md"
          + ("" if dry else f" and the GPU section of {REPORT.relative_to(ROOT)}")
          + f"; exit status {info['exit']}")
    return info["exit"]


if __name__ == "__main__":
    sys.exit(main())
