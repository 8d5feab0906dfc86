"""One rank of ``accelerate launch --multi_gpu --num_processes W tests/hf_launch_job.py KIND
OUT``, as a user starts a Trainer script (on CPUs Accelerate's multi-process launcher is
``--multi_gpu``; the ranks pick gloo): the resume case of tests/test_hf_trainer.py (a
checkpoint at step 2, a fresh Trainer resumes from it), rank 0 writes the parameters and
the losses to OUT/result.pt for the test to compare with one device."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import test_hf_trainer  # noqa: E402


def main() -> None:
    kind, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR from the launcher
    try:
        params, losses, _ = test_hf_trainer._sharded(kind, "Muon", os.path.join(out, "run"), True)
        if dist.get_rank() == 0:
            torch.save({"params": params, "losses": losses}, os.path.join(out, "result.pt"))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
