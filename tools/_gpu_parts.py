"""One part of ``make gpu-check``, run by tools/gpu_check.py in a process of its own:

    python -m tools._gpu_parts --part NAME --world W --device cuda|cpu --dir DIR [--size gpu|tiny]

Parts: ``plain`` (no process group), ``fsdp2`` and ``fully_shard`` (correctness at world
size W: tools/_gpu_correct.py), ``fsdp1`` (FSDP1's flattened parameters refused:
tools/_gpu_fsdp1.py), ``capture`` (capturable steps in a CUDA graph at W = 1:
tools/_gpu_capture.py), ``profiler`` (tools/_gpu_profile.py), ``bench_adam8bit``,
``bench_muon``, ``bench_fully_shard`` (tools/_gpu_bench.py). ``--device cuda`` runs NCCL
ranks, one GPU each; ``cpu`` is the dry run: gloo ranks on CPU tensors.

[Note: part results survive the part]
Each rank appends one JSON line per finished case to ``DIR/rank<r>.jsonl`` as it goes
(and a ``{"start": case}`` line before it), and the part writes ``DIR/result.json`` at
the end. A part that hangs (a rank stuck in a collective after another raised: NCCL
waits without end) or crashes (a CUDA error, an abort in a backend) is killed by the
driver at its time limit, with every rank it spawned (they share its process group of
the operating system); the driver then reads the lines, reports the finished cases and
the one that was running, and goes on with the next part. So one bad case costs at most
the cases after it in its own part, never another part's results, and a rank writes
nothing the driver must wait for: a line is complete when it is read.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import tools._checkout  # noqa: F401 - before vefsdp_optim: [Note: checkout imports]

__all__ = ["PARTS", "progress", "run_part"]

_PROGRESS: Path | None = None  # this rank's DIR/rank<r>.jsonl


def progress(record: dict[str, Any]) -> None:
    """Append one JSON line to this rank's progress file ([Note: part results survive
    the part])."""
    if _PROGRESS is not None:
        with open(_PROGRESS, "a") as f:
            f.write(json.dumps(record, default=str) + "\n")


def _init_rank(rank: int, world: int, device: str, part_dir: Path) -> None:
    global _PROGRESS
    _PROGRESS = part_dir / f"rank{rank}.jsonl"
    torch.set_num_threads(max(1, min(4, (os.cpu_count() or 1) // max(world, 1))))
    if world == 0:  # no process group
        return
    kw: dict[str, Any] = {}
    if device == "cuda":
        torch.cuda.set_device(rank)
        kw["device_id"] = torch.device("cuda", rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{part_dir / 'pg'}",
                            rank=rank, world_size=world, **kw)


def _rank_entry(rank: int, fn: Callable[..., Any], world: int, device: str, part_dir: str,
                args: tuple[Any, ...]) -> None:
    """A spawned rank: its process group, ``fn(*args)`` into ``rank<r>.json``, then out
    without interpreter finalization ([Note: gloo teardown])."""
    import vefsdp_optim

    d = Path(part_dir)
    _init_rank(rank, world, device, d)
    try:
        out = fn(*args)
    except BaseException:  # noqa: BLE001 - written for the driver, then a nonzero exit
        (d / f"rank{rank}.error").write_text(traceback.format_exc())
        sys.stderr.flush()
        os._exit(1)  # no barrier: the other ranks may be stuck where this one failed
    (d / f"rank{rank}.json").write_text(json.dumps(out, default=str))
    vefsdp_optim.exit_rank(0)


def run_on_ranks(fn: Callable[..., Any], world: int, device: str, part_dir: Path,
                 *args: Any) -> list[Any]:
    """``fn(*args)`` on ``world`` ranks; per-rank results. ``world`` 0: in this process,
    no process group; 1: in this process, a process group of one; more: spawned ranks
    (module-level ``fn``). A rank that fails raises here with its traceback."""
    if world <= 1:
        _init_rank(0, world, device, part_dir)
        return [fn(*args)]
    import torch.multiprocessing as mp

    ctx = mp.start_processes(_rank_entry, args=(fn, world, device, str(part_dir), args), nprocs=world,
                             join=False, start_method="spawn")
    try:
        while not ctx.join(timeout=2):
            pass
    except Exception as e:  # noqa: BLE001 - the rank's own traceback says more
        errors = [p.read_text() for p in sorted(part_dir.glob("rank*.error"))]
        raise RuntimeError(f"a rank failed: {e}\n" + "\n".join(errors)) from None
    return [json.loads((part_dir / f"rank{r}.json").read_text()) for r in range(world)]


PARTS: dict[str, tuple[str, str]] = {  # name: (module, function) of fn(world, device, size, part_dir)
    "plain": ("tools._gpu_correct", "correctness_part"),
    "fsdp2": ("tools._gpu_correct", "correctness_part"),
    "fully_shard": ("tools._gpu_correct", "correctness_part"),
    "fsdp1": ("tools._gpu_fsdp1", "fsdp1_part"),
    "capture": ("tools._gpu_capture", "capture_part"),
    "profiler": ("tools._gpu_profile", "profiler_part"),
    "bench_adam8bit": ("tools._gpu_bench", "adam8bit_part"),
    "bench_muon": ("tools._gpu_bench", "muon_part"),
    "bench_fully_shard": ("tools._gpu_bench", "fully_shard_part"),
    "estimate": ("tools._gpu_estimate", "estimate_part"),
}


def run_part(part: str, world: int, device: str, size: str, part_dir: Path,
             optimizers: list[str] | None = None) -> dict[str, Any]:
    """Run one part (the correctness parts: only ``optimizers`` where given); its result
    dict (also written to ``part_dir/result.json``)."""
    import importlib

    if part not in PARTS:
        raise ValueError(f"unknown part {part!r}; accepted: {', '.join(PARTS)}")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    if size not in ("gpu", "tiny"):
        raise ValueError(f"size must be 'gpu' or 'tiny', got {size!r}")
    part_dir.mkdir(parents=True, exist_ok=True)
    mod, name = PARTS[part]
    fn = getattr(importlib.import_module(mod), name)
    t0 = time.monotonic()
    res = fn(part, world, device, size, part_dir, **({"optimizers": optimizers} if optimizers else {}))
    res.setdefault("part", part)
    res.setdefault("world", world)
    res["wall_s"] = round(time.monotonic() - t0, 1)
    (part_dir / "result.json").write_text(json.dumps(res, indent=1, default=str))
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", required=True, choices=sorted(PARTS))
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--size", default=None, choices=("gpu", "tiny"), help="default: gpu on cuda, tiny on cpu")
    ap.add_argument("--dir", required=True, type=Path)
    ap.add_argument("--optimizers", default=None, help="comma-separated subset (correctness parts)")
    a = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_part(a.part, a.world, a.device, a.size or ("gpu" if a.device == "cuda" else "tiny"), a.dir,
             a.optimizers.split(",") if a.optimizers else None)
    sys.stdout.flush()
    sys.stderr.flush()
    if dist.is_initialized():  # a process group of one, made in this process
        import vefsdp_optim

        vefsdp_optim.exit_rank(0)


if __name__ == "__main__":
    main()
