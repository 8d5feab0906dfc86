"""The wheel installs vefsdp_optim.{sharding,comm} and nothing else at top level."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_top_level_is_only_vefsdp_optim(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "-q", "-w", str(tmp_path), str(ROOT)],
        capture_output=True, text=True, cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    (wheel,) = tmp_path.glob("vefsdp_optim-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert top == {"vefsdp_optim", next(t for t in top if t.endswith(".dist-info"))}, top
    for pkg in ("vefsdp_optim/sharding/__init__.py", "vefsdp_optim/comm/__init__.py",
                "vefsdp_optim/py.typed", "vefsdp_optim/_kernels/csrc/quant8_adam.cpp",
                "vefsdp_optim/_kernels/csrc/quant8_adam_op.cpp",
                "vefsdp_optim/_kernels/csrc/quant8_adam.h",
                "vefsdp_optim/_kernels/csrc/bf16_matmul.cpp"):
        assert pkg in names, (pkg, sorted(names))
    assert not any(n.startswith(("comm/", "sharding/", "tests/")) for n in names)
    # every source module of the three folders is in the wheel
    for folder, pkg in (("vefsdp_optim", "vefsdp_optim"), ("sharding", "vefsdp_optim/sharding"),
                        ("comm", "vefsdp_optim/comm")):
        for src in (ROOT / folder).rglob("*.py"):
            rel = src.relative_to(ROOT / folder).as_posix()
            assert f"{pkg}/{rel}" in names, f"{folder}/{rel} is missing from the wheel"


def test_subpackages_import_under_the_library_name():
    import vefsdp_optim.comm as comm
    import vefsdp_optim.sharding as sharding

    assert Path(sharding.__file__).resolve().parent == ROOT / "sharding"
    assert Path(comm.__file__).resolve().parent == ROOT / "comm"
    assert "comm" not in sys.modules or not hasattr(sys.modules["comm"], "DistributedBuffer")
