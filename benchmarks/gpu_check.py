"""``make gpu-check``: the CUDA check of this library, one command on a machine with a GPU.

    python3 benchmarks/gpu_check.py [--skip-tests] [--skip-bench] [--steps N]

1. Looks for a CUDA device with ``nvidia-smi -L`` (no torch needed). None: prints that
   there is no CUDA device and exits 0 at once.
2. Picks a python with a CUDA build of torch: ``$GPU_PYTHON`` if set, else the venv
   ``.venv-gpu`` (made on first use: ``torch==2.13.0`` from the package index, which is
   the CUDA build on Linux, and this package with the dev, triton and bench extras). It
   exits 1 if that torch cannot see the GPU.
3. Runs the whole test suite with ``VEFSDP_TEST_DEVICE=cuda``: the tests that take the
   ``device`` fixture (the Triton 8-bit kernel against the C++ kernel and the eager ops,
   bit for bit) run on the GPU, every other test as on the CPU (distributed ones on gloo
   CPU ranks). The skipped tests and their reasons are printed and reported.
4. Benchmarks on the GPU: AdamW8bit on ~101 M parameters (8 matrices of 4096 x 3072 and
   8 vectors) against torch's fused AdamW, bitsandbytes' and torchao's AdamW8bit (where
   installed; ``.[bench]``): step time (CUDA events) and ``max_memory_allocated`` /
   ``max_memory_reserved``; then the suite's device-aware benchmarks as they are
   (``bench_adam8bit``, ``bench_memory``, ``bench_fully_shard``; ``bench_muon_dion`` where
   ``VEFSDP_DION_SRC`` names Dion's source). Those spawn NCCL ranks, one per GPU, where
   enough GPUs are visible, else gloo ranks on the CPU, and say which in their rows.
5. Writes the GPU section of ``benchmarks/REPORT.md`` (between the gpu-check markers,
   the device named) and the raw results under ``benchmarks/out/gpu/``.

The goals to read off it (issue 29): AdamW8bit <= 1.0x torch's fused AdamW and <= 0.8x
bitsandbytes' step time.
"""

from __future__ import annotations

# stdlib only at module level: the outer run (step 1) must work without torch
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out" / "gpu"
REPORT = ROOT / "benchmarks" / "REPORT.md"
VENV = ROOT / ".venv-gpu"
TORCH_PIN = os.environ.get("TORCH_PIN", "torch==2.13.0")
BEGIN, END = "<!-- gpu-check: begin -->", "<!-- gpu-check: end -->"
SUITE_BENCHES = ("bench_adam8bit", "bench_memory", "bench_fully_shard", "bench_muon_dion")


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


def _gpu_python() -> str:
    """``$GPU_PYTHON``, else ``.venv-gpu``'s python (made and installed on first use)."""
    if os.environ.get("GPU_PYTHON"):
        return os.environ["GPU_PYTHON"]
    py = VENV / "bin" / "python"
    stamp = VENV / ".deps-stamp"
    if not stamp.exists():
        if not py.exists():
            subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        pip = [str(py), "-m", "pip", "install", "-q"]
        # a local CPU wheel (torch 2.13.0+cpu) must not win over the index's CUDA build
        env = {**os.environ, "PIP_FIND_LINKS": ""}
        subprocess.run([*pip, "--upgrade", "pip>=23", "setuptools>=70", "wheel"], check=True, env=env)
        subprocess.run([*pip, TORCH_PIN, "-e", f"{ROOT}[dev,triton,bench]"], check=True, env=env)
        stamp.touch()
    return str(py)


def outer(argv: list[str]) -> int:
    t0 = time.monotonic()
    devices = cuda_devices()
    if not devices:
        print("gpu-check: no CUDA device on this machine (nvidia-smi lists none): nothing to "
              f"check, exit 0 ({time.monotonic() - t0:.1f} s)")
        return 0
    print("gpu-check: CUDA devices:", *devices, sep="\n  ")
    py = _gpu_python()
    probe = subprocess.run([py, "-c", "import torch; print(torch.__version__, torch.version.cuda, "
                            "torch.cuda.is_available())"], capture_output=True, text=True)
    if probe.returncode != 0 or not probe.stdout.strip().endswith("True"):
        print(f"gpu-check: {py}'s torch cannot use the GPU ({probe.stdout.strip()} "
              f"{probe.stderr.strip()[-300:]}); set GPU_PYTHON to a python with a CUDA build "
              "of torch", file=sys.stderr)
        return 1
    return subprocess.run([py, "-m", "benchmarks.gpu_check", "--inside", *argv], cwd=ROOT).returncode


# -- inside: a python with a CUDA torch -----------------------------------------------


def run_tests() -> dict[str, Any]:
    """The whole suite with VEFSDP_TEST_DEVICE=cuda; counts, skip reasons, the failures."""
    OUT.mkdir(parents=True, exist_ok=True)
    log = OUT / "tests.log"
    env = {**os.environ, "VEFSDP_TEST_DEVICE": "cuda"}
    t0 = time.monotonic()
    with open(log, "w") as f:
        rc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfEs", "tests"], cwd=ROOT,
                            env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    text = log.read_text()
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed)",
                                                 text.splitlines()[-1] if text else "")}
    skips = sorted(set(re.findall(r"^SKIPPED \[\d+\] (.*)$", text, re.M)))
    failures = re.findall(r"^(?:FAILED|ERROR) (.*)$", text, re.M)
    print(text[-4000:])
    return dict(returncode=rc, wall_s=time.monotonic() - t0, counts=counts, skipped=skips,
                failures=failures, log=str(log.relative_to(ROOT)))


def bench_large(steps: int, warmup: int = 3) -> dict[str, Any]:
    """AdamW8bit on ~101 M parameters against torch's fused AdamW and the peers', one
    optimizer at a time on fresh parameters (the same values and gradients for each)."""
    import torch

    import vefsdp_optim
    from vefsdp_optim._math._quant8_backend import select_backend

    shapes = [(4096, 3072)] * 8 + [(4096,)] * 8
    numel = sum(torch.Size(s).numel() for s in shapes)
    makers: dict[str, Any] = {
        "torch.optim.AdamW (fused)": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
        "vefsdp_optim.AdamW8bit": lambda ps: vefsdp_optim.AdamW8bit(ps, lr=1e-3),
        "vefsdp_optim.AdamW8bit (eager)": lambda ps: vefsdp_optim.AdamW8bit(ps, lr=1e-3, fused=False),
    }
    rows, notes = [], []
    try:
        import bitsandbytes as bnb

        makers[f"bitsandbytes.AdamW8bit ({bnb.__version__})"] = lambda ps: bnb.optim.AdamW8bit(ps, lr=1e-3)
    except Exception as e:  # noqa: BLE001 - reported
        notes.append(f"bitsandbytes not run: {type(e).__name__}: {e}")
    try:
        import torchao
        from torchao.optim import AdamW8bit as AoAdamW8bit

        makers[f"torchao.AdamW8bit ({torchao.__version__})"] = lambda ps: AoAdamW8bit(ps, lr=1e-3)
    except Exception as e:  # noqa: BLE001 - reported
        notes.append(f"torchao not run: {type(e).__name__}: {e}")
    dev = torch.device("cuda")
    times: dict[str, list[float]] = {}
    for name, make in makers.items():
        torch.cuda.empty_cache()
        gen = torch.Generator(device=dev).manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(s, device=dev, generator=gen) * 0.02) for s in shapes]
        for p in ps:
            p.grad = torch.randn(p.shape, device=dev, generator=gen) * 1e-3
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        try:
            opt = make(ps)
            ts = []
            for i in range(warmup + steps):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                opt.step()
                b.record()
                torch.cuda.synchronize()
                if i >= warmup:
                    ts.append(a.elapsed_time(b))
        except Exception as e:  # noqa: BLE001 - a peer's failure is a row, not the end
            rows.append(dict(optimizer=name, error=f"{type(e).__name__}: {e}"[:300]))
            continue
        times[name] = ts
        rows.append(dict(optimizer=name, step_ms=statistics.median(ts), step_ms_p25=statistics.quantiles(ts, n=4)[0],
                         step_ms_p75=statistics.quantiles(ts, n=4)[2],
                         max_allocated_over_params_grads_MiB=(torch.cuda.max_memory_allocated() - base) / 2**20,
                         max_reserved_MiB=torch.cuda.max_memory_reserved() / 2**20))
        del opt, ps
    ours = "vefsdp_optim.AdamW8bit"
    ratios = {}
    if ours in times:
        for name, ts in times.items():
            if name != ours:
                ratios[f"{ours} / {name}"] = statistics.median(times[ours]) / statistics.median(ts)
    return dict(numel=numel, steps=steps, warmup=warmup, rows=rows, ratios=ratios, notes=notes,
                backend=select_backend("cuda", 256))


def run_suite_benches(timeout: int) -> list[dict[str, Any]]:
    out = []
    for mod in SUITE_BENCHES:
        if mod == "bench_muon_dion" and not os.environ.get("VEFSDP_DION_SRC"):
            out.append(dict(bench=mod, skipped="VEFSDP_DION_SRC (Dion's source) is not set"))
            continue
        path = OUT / f"{mod}.json"
        t0 = time.monotonic()
        try:
            r = subprocess.run([sys.executable, "-m", f"benchmarks.{mod}", "--quick", "--out", str(path)],
                               cwd=ROOT, capture_output=True, text=True, timeout=timeout)
            ok, err = r.returncode == 0, r.stderr.strip()[-500:]
        except subprocess.TimeoutExpired:
            ok, err = False, f"timed out after {timeout} s"
        entry: dict[str, Any] = dict(bench=mod, ok=ok, wall_s=time.monotonic() - t0)
        if ok and path.exists():
            res = json.loads(path.read_text())
            entry["rows"], entry["notes"] = res.get("rows", []), res.get("notes", [])
        else:
            entry["error"] = err
        out.append(entry)
    return out


def _table(rows: list[dict[str, Any]]) -> str:
    sys.path.insert(0, str(ROOT))
    from benchmarks._common import markdown_table

    return markdown_table(rows)


def render(info: dict[str, Any], tests: dict[str, Any] | None, large: dict[str, Any] | None,
           suite: list[dict[str, Any]]) -> str:
    lines = [BEGIN, "## GPU (make gpu-check)", "",
             f"Device: **{info['device']}** x {info['count']}, torch {info['torch']} (CUDA "
             f"{info['cuda']}), triton {info['triton']}, {info['date']}.", ""]
    if tests is None:
        lines += ["Tests: not run (--skip-tests).", ""]
    else:
        c = tests["counts"]
        lines += [f"Tests (`VEFSDP_TEST_DEVICE=cuda pytest tests`, {tests['wall_s']:.0f} s): "
                  + ", ".join(f"{v} {k}" for k, v in c.items()) + f"; log: `{tests['log']}`.", ""]
        lines += [f"- failed: {f}" for f in tests["failures"]]
        lines += [f"- skipped: {s}" for s in tests["skipped"]] + [""]
    if large is not None:
        lines += [f"AdamW8bit on {large['numel'] / 1e6:.1f} M parameters ({large['steps']} steps after "
                  f"{large['warmup']} warm-up steps; our backend: {large['backend']}):", "",
                  _table(large["rows"]), ""]
        lines += [f"- {k}: **{v:.3f}**" for k, v in large["ratios"].items()]
        lines += [f"- {n}" for n in large["notes"]] + [""]
    for b in suite:
        lines.append(f"### {b['bench']}")
        if "skipped" in b:
            lines += [f"not run: {b['skipped']}", ""]
        elif not b["ok"]:
            lines += [f"failed: `{b.get('error', '?')}`", ""]
        else:
            lines += ["", _table(b["rows"]), ""] + [f"- {n}" for n in b.get("notes", [])] + [""]
    lines.append(END)
    return "\n".join(lines) + "\n"


def write_report(section: str) -> None:
    text = REPORT.read_text() if REPORT.exists() else ""
    if BEGIN in text and END in text:
        text = text[:text.index(BEGIN)] + section + text[text.index(END) + len(END):].lstrip("\n")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    REPORT.write_text(text)


def inside(a: argparse.Namespace) -> int:
    import torch

    try:
        import triton

        tv = triton.__version__
    except Exception:  # noqa: BLE001
        tv = "not installed"
    info = dict(device=torch.cuda.get_device_name(0), count=torch.cuda.device_count(),
                torch=torch.__version__, cuda=torch.version.cuda, triton=tv,
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    OUT.mkdir(parents=True, exist_ok=True)
    tests = None if a.skip_tests else run_tests()
    large = suite = None
    if not a.skip_bench:
        large = bench_large(a.steps)
        suite = run_suite_benches(a.bench_timeout)
    section = render(info, tests, large, suite or [])
    (OUT / "gpu_section.md").write_text(section)
    (OUT / "results.json").write_text(json.dumps(dict(info=info, tests=tests, large=large, suite=suite),
                                                 indent=1, default=str))
    write_report(section)
    print(section)
    print(f"gpu-check: wrote the GPU section of {REPORT.relative_to(ROOT)} and {OUT.relative_to(ROOT)}/")
    return 0 if tests is None or tests["returncode"] == 0 else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--steps", type=int, default=20, help="timed steps of the 101 M bench")
    ap.add_argument("--bench-timeout", type=int, default=1800, help="seconds per suite benchmark")
    a = ap.parse_args(argv)
    if not a.inside:
        return outer([x for x in argv if x != "--inside"])
    return inside(a)


if __name__ == "__main__":
    sys.exit(main())
