"""FSDP1's flattened parameters refused by name on the GPU (a part of tools/gpu_check.py).

``FullyShardedDataParallel`` with ``use_orig_params`` False and True on NCCL: every
optimizer with a block requirement raises its ValueError naming the parameter, and AdamW
trains the flattened parameters bit for bit as torch.optim.AdamW does (the suite's
tests/test_flattened.py, ``on_fsdp1``, on CUDA tensors). With one GPU it runs at W = 1,
where FSDP1 keeps ``use_orig_params=True`` parameters whole (NO_SHARD) and only its
FlatParameter is flattened.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import tools._checkout  # noqa: F401 - before vefsdp_optim: [Note: checkout imports]
from tools._checkout import ROOT
from tools._gpu_parts import run_on_ranks

if str(ROOT / "tests") not in sys.path:  # the suite's helpers import each other by plain name
    sys.path.insert(0, str(ROOT / "tests"))

from test_flattened import fsdp1_findings, on_fsdp1  # noqa: E402

__all__ = ["fsdp1_part"]


def fsdp1_part(part: str, world: int, device: str, size: str, part_dir: Path,
               optimizers: list[str] | None = None) -> dict[str, Any]:
    """Every block optimizer, whatever ``optimizers`` names: the check is their refusal."""
    ranks = run_on_ranks(on_fsdp1, world, device, part_dir, device)
    bad = [f"rank {r}: {f}" for r, res in enumerate(ranks) for f in fsdp1_findings(res)]
    flat = "both settings" if world > 1 else "use_orig_params=False (W = 1: NO_SHARD keeps the others whole)"
    why = "; ".join(bad)[:1500] if bad else (f"every block optimizer refused FSDP1's flattened parameters ({flat}) "
                                             "by name; AdamW equal to torch.optim.AdamW")
    return {"kind": "correctness", "world": world, "status": "fail" if bad else "pass", "why": why}
