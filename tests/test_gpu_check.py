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
