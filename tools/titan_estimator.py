"""Our memory estimate against torchtitan's memory estimator, on the same model and mesh.

torchtitan's estimator (``scripts/estimate/estimation.py``) was removed with its TOML
configs (commit 76d5c72e2); point ``VEFSDP_TORCHTITAN_SRC`` at a checkout of the commit
before it (``git archive 76d5c72e2^ torchtitan scripts``). Nothing of it is copied here: this
file runs its ``estimate_memory`` as its own script would, with four changes that let it run
on a machine without a GPU, none of which changes what it tracks:

- torch's answer to "which device" is ``cpu`` (torchtitan falls back to ``cuda`` without a
  GPU) and ``torch.cuda.set_device`` does nothing, so its meshes and fake tensors are CPU
  ones (a fake tensor's bytes do not depend on its device);
- ``to_empty(device="cuda")`` and ``torch.randint(..., device="cuda")`` go to the CPU;
- its tracker records each peak it displays (``FSDPMemTracker.display_snapshot``), and the
  run stops at its module-wise table, after its two iterations (what follows reads the
  CUDA allocator).

    VEFSDP_TORCHTITAN_SRC=... python -m tools.titan_estimator --ranks 1024 \\
        -- --job.config_file torchtitan/models/llama3/train_configs/llama3_70b.toml ...

prints one JSON line, ``{"titan": [peak of iteration 0, peak of iteration 1]}``, each the
tracker's global peak by category.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

TITAN_ENV = "VEFSDP_TORCHTITAN_SRC"


def titan_src() -> str | None:
    """The checkout ``VEFSDP_TORCHTITAN_SRC`` names, or None when unset or without the
    estimator."""
    src = os.environ.get(TITAN_ENV)
    if not src or not os.path.isfile(os.path.join(src, "scripts", "estimate", "estimation.py")):
        return None
    return src


class _Done(Exception):
    pass


def _run_in_this_process(src: str, argv: list[str]) -> list[dict[str, Any]]:
    sys.path.insert(0, src)
    import torch
    import torch._utils
    from torch import nn

    torch._utils._get_available_device_type = lambda: "cpu"
    torch.cuda.set_device = lambda *a, **k: None
    to_empty = nn.Module.to_empty

    def to_cpu(device: Any) -> Any:
        return "cpu" if device is not None and str(device).startswith("cuda") else device

    nn.Module.to_empty = lambda self, *, device, recurse=True: to_empty(self, device=to_cpu(device),
                                                                        recurse=recurse)
    randint = torch.randint
    torch.randint = lambda *a, device=None, **k: randint(*a, device=to_cpu(device), **k)
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    peaks: list[dict[str, Any]] = []

    class Tracker(FSDPMemTracker):
        def display_snapshot(self, *args: Any, **kwargs: Any) -> None:
            snap = self.get_tracker_snapshot("peak")
            peaks.append({str(d): {getattr(c, "value", str(c)): int(v) for c, v in s.items()}
                          for d, s in snap.items()})

        def display_modulewise_snapshots(self, *args: Any, **kwargs: Any) -> None:
            raise _Done

    import importlib

    estimation = importlib.import_module("scripts.estimate.estimation")
    estimation.FSDPMemTracker = Tracker
    from torchtitan.config import ConfigManager

    try:
        estimation.estimate_memory(ConfigManager().parse_args(argv))
    except _Done:
        pass
    return peaks


def run_titan(src: str, world: int, argv: list[str], timeout: float = 3600) -> list[dict[str, Any]]:
    """torchtitan's estimator as rank 0 of ``world``, in its own process (its working
    directory the checkout, as its script expects)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this repository's
    env = dict(os.environ, WORLD_SIZE=str(world), LOCAL_RANK="0", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-m", "tools.titan_estimator", "--one", "--", *argv],
                          cwd=src, env=env, capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('{"titan"')]
    if proc.returncode or not lines:
        raise RuntimeError(f"torchtitan's estimator failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1])["titan"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=8, help="the job's world size")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("titan_args", nargs="*", help="torchtitan's own flags, after --")
    args = p.parse_args(argv)
    src = titan_src()
    if src is None:
        raise SystemExit(f"set {TITAN_ENV} to a torchtitan checkout holding scripts/estimate/estimation.py "
                         "(the commit before 76d5c72e2)")
    if args.one:
        print(json.dumps({"titan": _run_in_this_process(src, args.titan_args)}))
        return
    print(json.dumps({"titan": run_titan(src, args.ranks, args.titan_args)}))


if __name__ == "__main__":
    main()
