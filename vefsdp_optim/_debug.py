"""The debug switch: whether every step checks that the ranks agree ([Note: consistent
steps] in _step_loop.py).

At the bottom of the library (it imports only torch), so both of its readers, the step
loop and fully_shard's reduce-scatter (_fsdp/_grads.py), import it one way.
"""

from __future__ import annotations

import os

import torch.distributed as dist

__all__ = ["DEBUG", "check_every_step"]

#: check every step ([Note: consistent steps]); from VEFSDP_OPTIM_DEBUG=1 at import,
#: read at each step, so a test may set it
DEBUG: bool = os.environ.get("VEFSDP_OPTIM_DEBUG", "") == "1"


def check_every_step() -> bool:
    """Whether each step checks its consistency: ``DEBUG`` or TORCH_DISTRIBUTED_DEBUG=DETAIL."""
    return DEBUG or (dist.is_available() and dist.get_debug_level() == dist.DebugLevel.DETAIL)
