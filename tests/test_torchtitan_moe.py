"""examples/torchtitan_moe.py: torchtitan's DeepSeek-V3 debug model (MoE) at ep 2 on gloo
CPU ranks, its own ``parallelize_deepseekv3`` (one fully_shard per block, the experts on
the "efsdp" mesh through FSDP2's ``ShardPlacementResult``), Muon (flatten=False) on the
experts and AdamW on the rest.

Checked inside the example, printed and read here: vefsdp_optim's optimizers on FSDP2
give torch.optim.Muon-per-expert + torch.optim.AdamW's losses bit for bit, and our
fully_shard (two shard groups per MoE block) gives FSDP2's, bit for bit at W = 2 and
within 1e-4 at W = 4 (a dense reduce-scatter of 4 ranks adds in another order).

Skipped where torchtitan (the ``torchtitan`` extra) is not installed or its deepseek_v3
model does not import. Slow: three trainings per case, about a minute at W = 4.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "torchtitan_moe.py")

pytestmark = pytest.mark.slow


@functools.cache
def _unavailable() -> str | None:
    """Why the example cannot run here, or None."""
    if importlib.util.find_spec("torchtitan") is None:
        return 'torchtitan is not installed (pip install "torch==2.13.0" -e ".[torchtitan]")'
    r = subprocess.run([sys.executable, "-c", "import torchtitan.models.deepseek_v3"],
                       capture_output=True, text=True, timeout=300)
    if r.returncode:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        return f"torchtitan's deepseek_v3 does not import: {last}"
    r = subprocess.run([sys.executable, "-c", "from torch.distributed.fsdp._fully_shard._fsdp_common "
                        "import ShardPlacementResult"], capture_output=True, text=True, timeout=300)
    if r.returncode:
        return "torchtitan's MoE parallelize needs FSDP2's ShardPlacementResult (torch >= 2.13)"
    return None


def _run(world_size: int) -> tuple[str, float, float]:
    """The example's output (``--fsdp both``, ep 2) and its first run's first and last loss."""
    reason = _unavailable()
    if reason:
        pytest.skip(reason)
    r = subprocess.run([sys.executable, EXAMPLE, "--world-size", str(world_size), "--ep", "2",
                        "--fsdp", "both", "--steps", "4"],
                       capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    m = re.search(r"^loss (\S+) -> (\S+)$", r.stdout, re.M)
    assert m, r.stdout[-3000:]
    return r.stdout, float(m.group(1)), float(m.group(2))


def _common(out: str, world_size: int, first: float, last: float) -> None:
    mesh = f"ep 2, dp {world_size}: "
    assert (f"{mesh}losses of vefsdp_optim's Muon + AdamW on FSDP2 == torch.optim.Muon per expert "
            "+ AdamW's, bit for bit") in out, out[-3000:]
    # one fully_shard per MoE block, two shard groups: the dense weights over W, the experts over W / 2
    assert f"[vefsdp+ours] shard groups of each MoE block over [{world_size}, {world_size // 2}] ranks" \
        in out, out[-3000:]
    assert "[vefsdp+ours] 6 expert weights under Muon (flatten=False)" in out, out[-3000:]
    assert last < first - 2.0, out[-3000:]


def test_torchtitan_moe_ep2_at_w2_bitwise() -> None:
    out, first, last = _run(2)
    _common(out, 2, first, last)
    assert "ep 2, dp 2: losses of vefsdp_optim's fully_shard == FSDP2's, bit for bit" in out, out[-3000:]


def test_torchtitan_moe_ep2_at_w4() -> None:
    out, first, last = _run(4)
    _common(out, 4, first, last)
    assert "ep 2, dp 4: losses of vefsdp_optim's fully_shard == FSDP2's, within 1e-4" in out, out[-3000:]
