"""examples/torchtitan_llama3.py at W = 2: torchtitan's llama3 debug model trains with our
fully_shard and optimizers, and gives FSDP2's losses; at W = 4 with ``--tp 2`` (dp 2 x
tp 2, torchtitan's TP plan) our fully_shard + TP gives FSDP2 + TP's losses, and our AdamW
on FSDP2 + TP gives torch AdamW's.

Skipped where torchtitan (the ``torchtitan`` extra) is not installed or its llama3 model
does not import. The example runs as a script (it spawns its own gloo ranks), so
torchtitan's import-time setup stays out of the test process. Every case is slow (the
cheapest two take 24 s and 67 s on 2 cores: a third of make test-fast's 5 minutes where
the dev venv has torchtitan).
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
EXAMPLE = os.path.join(ROOT, "examples", "torchtitan_llama3.py")


@functools.cache
def _unavailable() -> str | None:
    """Why the example cannot run here, or None."""
    if importlib.util.find_spec("torchtitan") is None:
        return 'torchtitan is not installed (pip install "torch==2.13.0" -e ".[torchtitan]")'
    r = subprocess.run([sys.executable, "-c", "import torchtitan.models.llama3"],
                       capture_output=True, text=True, timeout=300)
    if r.returncode:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        return f"torchtitan's llama3 does not import: {last}"
    return None


def _run(*args: str, world_size: int = 2, must_pass: bool = True) -> tuple[str, list[float]]:
    """The example's output and its first run's first and last loss; ``must_pass=False``
    lets the example's own checks fail (the caller reads which did)."""
    reason = _unavailable()
    if reason:
        pytest.skip(reason)
    r = subprocess.run([sys.executable, EXAMPLE, "--world-size", str(world_size), *args],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    if must_pass or "MISMATCH" not in r.stdout:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    m = re.search(r"^loss (\S+) -> (\S+)$", r.stdout, re.M)
    assert m, r.stdout[-3000:] + r.stderr[-6000:]
    return r.stdout, [float(m.group(1)), float(m.group(2))]


@pytest.mark.slow
def test_torchtitan_llama3_trains_and_equals_fsdp2_bitwise() -> None:
    """No gradient clipped (clip_grad_norm_ still runs): the losses of every step equal
    FSDP2's bit for bit (checked inside the example), and the loss falls."""
    out, (first, last) = _run("--fsdp", "both", "--optimizer", "adamw", "--steps", "6",
                              "--max-norm", "1e9")
    assert "== FSDP2's, bit for bit" in out, out[-3000:]
    assert last < first - 4.0, out[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["muon", "adamw8bit", "shampoo"])
def test_torchtitan_llama3_each_optimizer_with_clipping(optimizer: str) -> None:
    """Gradients clipped at torchtitan's max_norm 1.0: within 1e-4 of FSDP2 (the two
    gradient norms differ in rounding) and the loss falls."""
    out, (first, last) = _run("--fsdp", "both", "--optimizer", optimizer, "--steps", "6")
    assert "== FSDP2's, within 1e-4" in out, out[-3000:]
    assert last < first - 2.0, out[-3000:]


@pytest.mark.slow
def test_torchtitan_llama3_at_an_odd_world_size() -> None:
    """W = 3 (uneven shards): within 1e-4 of FSDP2's losses (the gradient averages round
    differently across 3 ranks), and the loss falls."""
    out, (first, last) = _run("--fsdp", "both", "--optimizer", "adamw", "--steps", "6",
                              world_size=3)
    assert "== FSDP2's, within 1e-4" in out, out[-3000:]
    assert last < first - 4.0, out[-3000:]


def _fully_shard_tp_matched(out: str) -> None:
    """Our fully_shard + TP against FSDP2 + TP, as the example checked it (the sequence-
    parallel norms' gradients included: tests/test_nd_mesh.py has the small case)."""
    assert "dp 2 x tp 2: losses of vefsdp_optim's fully_shard == FSDP2's, bit for bit" in out, out[-3000:]


@pytest.mark.slow
def test_torchtitan_llama3_tp2_adamw_equals_torch_adamw_bitwise() -> None:
    """dp 2 x tp 2, torchtitan's TP plan (sequence-parallel norms, loss parallel) before
    FSDP2, no gradient clipped: our AdamW on (_StridedShard(0), Shard(0)), (Shard(0),
    Shard(1)) and (Shard(0), Replicate()) parameters gives torch AdamW's losses bit for
    bit at every step (checked inside the example), and the loss falls; then our
    fully_shard + TP against FSDP2 + TP, both with our AdamW, bit for bit."""
    out, (first, last) = _run("--tp", "2", "--fsdp", "both", "--optimizer", "adamw",
                              "--steps", "4", "--max-norm", "1e9", world_size=4,
                              must_pass=False)
    assert "dp 2 x tp 2: losses of adamw on FSDP2 + TP == torch AdamW's, bit for bit" in out, \
        out[-3000:]
    assert last < first - 4.0, out[-3000:]
    _fully_shard_tp_matched(out)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["muon", "adamw8bit", "shampoo"])
def test_torchtitan_llama3_tp2_each_optimizer(optimizer: str) -> None:
    """dp 2 x tp 2, no gradient clipped: the optimizer trains on FSDP2 + TP (the loss
    falls; torch AdamW's curve printed beside its own), and under our fully_shard + TP
    gives its FSDP2 + TP losses bit for bit (checked inside the example)."""
    out, (first, last) = _run("--tp", "2", "--fsdp", "both", "--optimizer", optimizer,
                              "--steps", "6", "--max-norm", "1e9", world_size=4,
                              must_pass=False)
    assert f"dp 2 x tp 2: final loss on FSDP2 + TP of {optimizer}" in out, out[-3000:]
    assert last < first - 2.0, out[-3000:]
    _fully_shard_tp_matched(out)
