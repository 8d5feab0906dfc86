"""``make gpu-check``: the CUDA check of this library, one command on a machine with a GPU.

    python3 benchmarks/gpu_check.py [--skip-tests] [--skip-bench] [--steps N]

1. Looks for a CUDA device with ``nvidia-smi -L`` (no torch needed). None: prints that
   there is no CUDA device and exits 0 at once.
2. Picks a python with a CUDA build of torch: ``$GPU_PYTHON`` if set, else the python
   running this script where its torch sees the GPU (a machine whose image has a CUDA
   torch and no package index), else the venv ``.venv-gpu`` (made on first use:
   ``torch==2.13.0`` from the package index, which is the CUDA build on Linux, and this
   package with the dev, triton and bench extras). It exits 1 if that torch cannot see
   the GPU. The checkout is put first on ``PYTHONPATH``, so an uninstalled checkout
   runs; a torch outside the declared range is named in the report.
3. Runs the test suite with ``VEFSDP_TEST_DEVICE=cuda`` (``--pytest-args`` adds
   arguments, e.g. ``"-m 'not slow'"``): the tests that take the
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
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
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


def _sees_cuda(py: str) -> bool:
    r = subprocess.run([py, "-c", "import torch; print(torch.cuda.is_available())"],
                       capture_output=True, text=True)
    return r.returncode == 0 and r.stdout.strip().endswith("True")


def _gpu_python() -> str:
    """``$GPU_PYTHON``, else this python where its torch sees the GPU, else
    ``.venv-gpu``'s python (made and installed on first use)."""
    if os.environ.get("GPU_PYTHON"):
        return os.environ["GPU_PYTHON"]
    if _sees_cuda(sys.executable):
        return sys.executable
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
    _install_checkout(py)
    probe = subprocess.run([py, "-c", "import torch; print(torch.__version__, torch.version.cuda, "
                            "torch.cuda.is_available())"], capture_output=True, text=True)
    if probe.returncode != 0 or not probe.stdout.strip().endswith("True"):
        print(f"gpu-check: {py}'s torch cannot use the GPU ({probe.stdout.strip()} "
              f"{probe.stderr.strip()[-300:]}); set GPU_PYTHON to a python with a CUDA build "
              "of torch", file=sys.stderr)
        return 1
    return subprocess.run([py, "-m", "benchmarks.gpu_check", "--inside", *argv], cwd=ROOT,
                          env=_env()).returncode


def _install_checkout(py: str) -> None:
    """``pip install --no-deps -e`` this checkout into ``py``'s environment where it is
    not installed there (the top-level ``sharding/`` and ``comm/`` folders become
    ``vefsdp_optim.sharding`` and ``vefsdp_optim.comm`` only through the install)."""
    probe = subprocess.run([py, "-c", "import importlib.metadata as m; m.distribution('vefsdp-optim')"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "-e", str(ROOT)], check=True)


def _env(**extra: str) -> dict[str, str]:
    """The environment of the inner runs: the checkout first on ``PYTHONPATH``."""
    path = os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH", "")) if x)
    return {**os.environ, "PYTHONPATH": path, **extra}


# -- inside: a python with a CUDA torch -----------------------------------------------


# The tests that need nothing beyond vefsdp_optim._math (math-only mode, see
# benchmarks/_math_only.py): the Triton kernel against the C++ kernel and the eager ops.
MATH_ONLY_TESTS = ["-p", "benchmarks._math_only", "tests/test_adam8bit_triton.py", "-k",
                   "triton_equals or bf16_param or compiles_for_cuda"]


def run_tests(extra_args: list[str], math_only: bool = False) -> dict[str, Any]:
    """The suite (or, ``math_only``, the math layer's GPU tests) with
    VEFSDP_TEST_DEVICE=cuda; counts, skip reasons, the failures."""
    OUT.mkdir(parents=True, exist_ok=True)
    log = OUT / "tests.log"
    env = _env(VEFSDP_TEST_DEVICE="cuda")
    what = MATH_ONLY_TESTS if math_only else ["tests"]
    t0 = time.monotonic()
    with open(log, "w") as f:
        rc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfEs", *extra_args, *what],
                            cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    text = log.read_text()
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed)",
                                                 text.splitlines()[-1] if text else "")}
    skips = sorted(set(re.findall(r"^SKIPPED \[\d+\] (.*)$", text, re.M)))
    failures = re.findall(r"^(?:FAILED|ERROR) (.*)$", text, re.M)
    print(text[-4000:])
    return dict(returncode=rc, wall_s=time.monotonic() - t0, counts=counts, skipped=skips,
                failures=failures, log=str(log.relative_to(ROOT)), args=[*extra_args, *what])


class _MathAdamW8bit:
    """AdamW8bit's defaults stepped through ``adam8bit_block_step_`` itself, one call per
    tensor (math-only mode: the optimizer class cannot import on this torch)."""

    def __init__(self, params: list[Any], lr: float, fused: bool | None = None,
                 block_size: int = 256) -> None:
        from vefsdp_optim._math import dynamic_code_map, quantize_blockwise
        from vefsdp_optim._math._quant8 import TableQuantizer

        self.params, self.lr, self.fused, self.bs, self.t = params, lr, fused, block_size, 0
        dev = params[0].device
        self.codes = dynamic_code_map(True).to(dev), dynamic_code_map(False).to(dev)
        self.quantizers = TableQuantizer(self.codes[0]), TableQuantizer(self.codes[1])
        self.state = []
        for p in params:
            zero = p.detach().new_zeros(p.numel())
            m, v = quantize_blockwise(zero, self.codes[0], block_size), quantize_blockwise(
                zero, self.codes[1], block_size)
            self.state.append((*m, *v))

    def step(self) -> None:
        from vefsdp_optim._math import adam8bit_block_step_

        self.t += 1
        for p, s in zip(self.params, self.state, strict=True):
            adam8bit_block_step_(p.data.view(-1), p.grad.view(-1), *s, step=self.t, lr=self.lr,
                                 beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2,
                                 decoupled=True, block_size=self.bs, signed_code=self.codes[0],
                                 unsigned_code=self.codes[1], quantizers=self.quantizers,
                                 fused=self.fused)


def bench_large(steps: int, warmup: int = 3, math_only: bool = False) -> dict[str, Any]:
    """AdamW8bit on ~101 M parameters against torch's fused AdamW and the peers', one
    optimizer at a time on fresh parameters (the same values and gradients for each).
    ``math_only``: ours is ``adam8bit_block_step_`` per tensor, not the class."""
    import torch

    from vefsdp_optim._math._quant8_backend import select_backend

    shapes = [(4096, 3072)] * 8 + [(4096,)] * 8
    numel = sum(torch.Size(s).numel() for s in shapes)
    makers: dict[str, Any] = {
        "torch.optim.AdamW (fused)": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
    }
    if math_only:
        makers["vefsdp_optim.AdamW8bit"] = lambda ps: _MathAdamW8bit(ps, lr=1e-3)
        makers["vefsdp_optim.AdamW8bit (eager)"] = lambda ps: _MathAdamW8bit(ps, lr=1e-3, fused=False)
    else:
        import vefsdp_optim

        makers["vefsdp_optim.AdamW8bit"] = lambda ps: vefsdp_optim.AdamW8bit(ps, lr=1e-3)
        makers["vefsdp_optim.AdamW8bit (eager)"] = lambda ps: vefsdp_optim.AdamW8bit(
            ps, lr=1e-3, fused=False)
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
    if math_only:
        notes.append("math-only mode: ours is adam8bit_block_step_ called per tensor with "
                     "AdamW8bit's defaults (the optimizer class cannot import on this torch)")
    return dict(numel=numel, steps=steps, warmup=warmup, rows=rows, ratios=ratios, notes=notes,
                backend=select_backend("cuda", 256))


def run_suite_benches(timeout: int, benches: Sequence[str]) -> list[dict[str, Any]]:
    out = []
    for mod in benches:
        if mod == "bench_muon_dion" and not os.environ.get("VEFSDP_DION_SRC"):
            out.append(dict(bench=mod, skipped="VEFSDP_DION_SRC (Dion's source) is not set"))
            continue
        path = OUT / f"{mod}.json"
        t0 = time.monotonic()
        try:
            r = subprocess.run([sys.executable, "-m", f"benchmarks.{mod}", "--quick", "--out", str(path)],
                               cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
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
    if info.get("torch_note"):
        lines += [info["torch_note"], ""]
    if tests is None:
        lines += ["Tests: not run (--skip-tests).", ""]
    else:
        c = tests["counts"]
        args = " ".join(shlex.quote(x) for x in tests.get("args", ["tests"]))
        lines += [f"Tests (`VEFSDP_TEST_DEVICE=cuda pytest {args}`, "
                  f"{tests['wall_s']:.0f} s): "
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


def _declared_range() -> str:
    """pyproject.toml's torch pin (read as text: the package may not import)."""
    m = re.search(r'"torch\s*([^"]+)"', (ROOT / "pyproject.toml").read_text())
    return m.group(1) if m else "?"


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
    math_only = False
    try:
        import vefsdp_optim  # noqa: F401
    except ImportError as e:
        # e.g. torch 2.11 (a machine's own CUDA build, no package index to install one):
        # torch.distributed.fsdp lacks names the FSDP layer imports; the math layer runs
        math_only = True
        info["torch_note"] = (
            f"**Math-only mode**: vefsdp_optim does not import on torch {torch.__version__} "
            f"(`{type(e).__name__}: {e}`; the declared range is "
            f"{_declared_range()}), and this machine had no other CUDA torch. Checked: the "
            "math layer's GPU tests (the Triton 8-bit kernel against the C++ kernel and "
            "the eager ops) and the step of `adam8bit_block_step_` per tensor; not checked: "
            "the optimizer classes, FSDP and the rest of the suite on the GPU.")
        sys.modules.pop("vefsdp_optim", None)
        import benchmarks._math_only  # noqa: F401
    OUT.mkdir(parents=True, exist_ok=True)
    tests = None if a.skip_tests else run_tests(shlex.split(a.pytest_args), math_only)
    large = suite = None
    if not a.skip_bench:
        large = bench_large(a.steps, math_only=math_only)
        benches = [b for b in a.benches.split(",") if b]
        unknown = sorted(set(benches) - set(SUITE_BENCHES))
        if unknown:
            raise ValueError(f"--benches: unknown {unknown}; accepted: {', '.join(SUITE_BENCHES)}")
        suite = [] if math_only else run_suite_benches(a.bench_timeout, benches)
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
    ap.add_argument("--pytest-args", default="", help="more pytest arguments, one shell string")
    ap.add_argument("--benches", default=",".join(SUITE_BENCHES),
                    help=f"comma-separated suite benchmarks (default all: {','.join(SUITE_BENCHES)})")
    a = ap.parse_args(argv)
    if not a.inside:
        return outer([x for x in argv if x != "--inside"])
    return inside(a)


if __name__ == "__main__":
    sys.exit(main())
