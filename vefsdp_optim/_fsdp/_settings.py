"""The settings a shard group gives its stores: :class:`StoreSettings`, fixed at
construction, and :class:`GradSettings`, the gradient knobs read at each call.

The bottom of ``_fsdp``: it imports no other module of the package, so the stores
(_store.py, _grads.py) and their shard group (_group.py) all import it, one way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy

__all__ = ["GradSettings", "StoreSettings"]

# As FSDP2's ``FSDPParam`` knows nothing of its ``FSDPParamGroup``, a DtypeStore holds no
# reference to its shard group. What it needs arrives as values: the fixed settings
# (process groups, device, mixed precision) once, at construction (:class:`StoreSettings`),
# and the gradient knobs a user may change between steps (``ShardGroup``'s in _group.py,
# ``set_gradient_copy_in``) with every call that reads them (:class:`GradSettings`). The
# shard group owns every lifecycle transition (``GatherState``, ``GradState``): the store
# only moves data when told to, and a re-plan reaches the store through the shard group
# (``StoreBinding`` in _group.py), which first checks and changes the gather and gradient
# states.


@dataclass(frozen=True, slots=True)
class StoreSettings:
    """A shard group's fixed settings, given to each of its stores at construction."""

    process_group: dist.ProcessGroup  # the shard process group (W ranks)
    world_size: int  # W
    rank: int  # this rank's index in process_group
    replicate_process_group: dist.ProcessGroup | None  # HSDP's; None without one (or of size 1)
    replicate_world_size: int  # 1 without a replicate process group
    device: torch.device
    mp_policy: MixedPrecisionPolicy
    # CPUOffloadPolicy (see ``DtypeStore`` in vefsdp_optim/_fsdp/_store.py): the
    # master buffer (the sharded parameters, their gradients, the optimizer's data) on
    # the CPU, pinned when ``device`` is an accelerator and the policy asks for it
    offload: bool = False
    pin_memory: bool = False

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"StoreSettings: rank {self.rank} of world size {self.world_size}")
        if (self.replicate_process_group is None) != (self.replicate_world_size == 1):
            raise ValueError("StoreSettings: replicate world size "
                             f"{self.replicate_world_size} with replicate process group "
                             f"{self.replicate_process_group}")
        if self.pin_memory and not self.offload:
            raise ValueError("StoreSettings: pin_memory=True needs offload=True")

    @property
    def host(self) -> torch.device:
        """Where the master buffer lives: the CPU under offload, else ``device``."""
        return torch.device("cpu") if self.offload else self.device

    @property
    def pinned(self) -> bool:
        """The master buffer is page-locked host memory (offload from an accelerator)."""
        return self.offload and self.pin_memory and self.device.type != "cpu"


@dataclass(frozen=True, slots=True)
class GradSettings:
    """A shard group's gradient knobs at one call (see ``ShardGroup`` in
    vefsdp_optim/_fsdp/_group.py, [Note: lazy gradient buffer]); the FSDPModule
    ``set_*`` methods change them."""

    copy_in: bool  # copy autograd's gradients into the buffer at the end of backward
    gradient_divide_factor: float | None
    force_sum_reduction: bool
    requires_all_reduce: bool
    all_reduce_hook: Callable[[torch.Tensor], None] | None
    # called before a store allocates its gradient buffer: finishes completed reductions
    # of earlier shard groups
    before_grad_alloc: Callable[[], None]
    # ``StoreGrads`` in vefsdp_optim/_fsdp/_grads.py: True gives a parameter unused
    # since the last reduction its reduced (zero where no rank used it) gradient, as
    # FSDP2's option of that name
    reduce_scatter_unused_params: bool = False

    @property
    def native_average(self) -> bool:
        """Reduce with the default average (see ``ShardGroup`` in vefsdp_optim/_fsdp/_group.py)."""
        return self.gradient_divide_factor is None and not self.force_sum_reduction
