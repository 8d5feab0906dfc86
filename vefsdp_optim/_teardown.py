"""Ending a rank without the gloo teardown race.

[Note: gloo teardown]
torch's gloo worker threads release finished collectives on their own thread. They may
take the GIL while the interpreter finalizes. CPython then ends that thread with
pthread_exit and the process aborts ("terminate called without an active exception").
destroy_process_group() cannot join them while FSDP2's DeviceMesh or DTensor's caches
still hold the group. So a rank that is done waits for every collective, destroys its
process group and leaves without interpreter finalization. The investigation, with the
backtrace, thread counts and a pure-torch reproduction, is tools/STRESS.md.
tests/test_gloo_teardown.py checks the trigger. ``exit_rank`` below does this: a barrier,
``destroy_process_group()``, a flush of stdout and stderr, then ``os._exit``.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

import torch.distributed as dist

__all__ = ["exit_rank"]


def exit_rank(code: int = 0) -> NoReturn:
    """Barrier, ``destroy_process_group()``, flush stdout/stderr, then ``os._exit(code)``
    ([Note: gloo teardown]). Call it last in a rank that has finished its work."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
