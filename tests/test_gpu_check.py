"""``make gpu-check`` (benchmarks/gpu_check.py) where there is no CUDA device: it says so
and exits 0 within seconds; and its GPU section of the report replaces the previous one."""

import importlib.util
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)  # stdlib only at import: no package needed


def _run(env):
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py")], cwd=ROOT,
                       env={**os.environ, **env}, capture_output=True, text=True, timeout=60)
    return r, time.monotonic() - t0


def test_no_cuda_device_exits_0_within_seconds(tmp_path):
    fake = tmp_path / "nvidia-smi"  # a driver tool that finds no GPU
    fake.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    for env in ({"PATH": f"{tmp_path}:{os.environ.get('PATH', '')}"}, {"CUDA_VISIBLE_DEVICES": ""}):
        r, wall = _run(env)
        assert r.returncode == 0, r.stderr
        assert "no CUDA device" in r.stdout and wall < 20, (r.stdout, wall)


def test_gpu_section_replaces_the_previous_one(tmp_path, monkeypatch):
    report = tmp_path / "REPORT.md"
    report.write_text("# Benchmarks\n\nCPU tables\n")
    monkeypatch.setattr(gpu_check, "REPORT", report)
    info = dict(device="NVIDIA H100 80GB HBM3", count=1, torch="2.13.0", cuda="12.8",
                triton="3.9.0", date="today")
    tests = dict(wall_s=1.0, counts={"passed": 3, "skipped": 1}, failures=[],
                 skipped=["tests/x.py:1: needs 2 GPUs"], log="benchmarks/out/gpu/tests.log")
    large = dict(numel=101e6, steps=2, warmup=1, backend="triton", notes=["torchao not run"],
                 rows=[dict(optimizer="vefsdp_optim.AdamW8bit", step_ms=1.0)],
                 ratios={"vefsdp_optim.AdamW8bit / torch.optim.AdamW (fused)": 0.9})
    suite = [dict(bench="bench_muon_dion", skipped="VEFSDP_DION_SRC is not set"),
             dict(bench="bench_memory", ok=False, error="boom")]
    for _ in range(2):
        gpu_check.write_report(gpu_check.render(info, tests, large, suite))
    text = report.read_text()
    assert text.startswith("# Benchmarks\n\nCPU tables\n")
    assert text.count(gpu_check.BEGIN) == 1 and text.count(gpu_check.END) == 1
    assert "**NVIDIA H100 80GB HBM3**" in text and "0.900" in text and "needs 2 GPUs" in text


def test_math_only_mode_imports_the_math_layer_without_the_package(tmp_path):
    """On a torch where the FSDP layer cannot import, benchmarks/_math_only.py still gives
    the math layer (the 8-bit kernels), and nothing beyond it loads."""
    code = ("import sys; import benchmarks._math_only; "
            "from vefsdp_optim._math import adam8bit_block_step_; "
            "import vefsdp_optim; assert not hasattr(vefsdp_optim, 'AdamW8bit'); "
            "assert 'vefsdp_optim._fsdp' not in sys.modules, sorted(sys.modules); print('ok')")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_math_only_note_and_test_arguments_in_the_section(tmp_path, monkeypatch):
    report = tmp_path / "REPORT.md"
    monkeypatch.setattr(gpu_check, "REPORT", report)
    info = dict(device="NVIDIA H200", count=1, torch="2.11.0+cu130", cuda="13.0", triton="3.6.0",
                date="today", torch_note="**Math-only mode**: vefsdp_optim does not import")
    tests = dict(wall_s=1.0, counts={"passed": 8}, failures=[], skipped=[],
                 log="benchmarks/out/gpu/tests.log", args=[*gpu_check.MATH_ONLY_TESTS])
    gpu_check.write_report(gpu_check.render(info, tests, None, []))
    text = report.read_text()
    assert "**Math-only mode**" in text
    assert "-p benchmarks._math_only tests/test_adam8bit_triton.py -k 'triton_equals" in text
    assert gpu_check._declared_range() == ">=2.11,<2.16"
