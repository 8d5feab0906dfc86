"""The memory estimate against the allocator (a part of tools/gpu_check.py).

The estimate of ``python -m vefsdp_optim.estimate`` (fake tensors, torch's fake process
group, torch's memory trackers) for one rank of a W = 2 job of a small LLaMA-3-shaped
model, against the same rank run on real tensors: on a GPU the allocator's peak over the
two steps (``torch.cuda.max_memory_allocated``), within 5%; on the CPU dry run the
tracker's peak on real tensors, which must be equal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["estimate_part"]

CASES = [("AdamW", "fsdp2"), ("AdamW8bit", "ours"), ("Muon", "fsdp2"), ("Shampoo", "ours")]
TOLERANCE = 0.05


def _pair(args: list[str], part_dir: Path, tag: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The estimate (fake tensors) and the run on real tensors, each in its own process, at
    once: they share nothing (the fake one touches no device memory)."""
    runs = {f"{tag}-fake": args, f"{tag}-real": [*args, "--real"]}
    procs = {name: subprocess.Popen([sys.executable, "-m", "vefsdp_optim.estimate", *a], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env=os.environ.copy())
             for name, a in runs.items()}
    out = []
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=600)
        (part_dir / f"{name}.log").write_text(stdout + stderr)
        if proc.returncode:
            raise RuntimeError(f"estimate {' '.join(runs[name])} failed:\n{stderr[-3000:]}")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out[0], out[1]


def estimate_part(part: str, world: int, device: str, size: str, part_dir: Path) -> dict[str, Any]:
    seq = "512" if size == "gpu" else "64"
    rows = []
    for optimizer, sharding in CASES:
        args = ["--model", "debug", "--seq", seq, "--dp", "2", "--sharding", sharding, "--optimizer", optimizer,
                "--device", device, "--one", "0"]
        tag = f"{optimizer}-{sharding}"
        fake, real = _pair(args, part_dir, tag)
        measured = real["cuda_max_allocated"] if device == "cuda" else real["peak"]["Total"]
        ratio = fake["peak"]["Total"] / measured
        rows.append({"optimizer": optimizer, "sharding": sharding, "estimate MiB": fake["peak"]["Total"] / 2**20,
                     "measured MiB": measured / 2**20, "estimate / measured": ratio,
                     "state equal": fake["state"] == real["state"],
                     "ok": abs(ratio - 1) <= TOLERANCE and fake["state"] == real["state"]})
    return {"kind": "bench", "world": 1, "status": "pass" if all(r["ok"] for r in rows) else "fail", "rows": rows,
            "measured": "torch.cuda.max_memory_allocated" if device == "cuda" else "MemTracker on real CPU tensors"}
