"""One parameter's lifecycle under fully_shard: sharded <-> unsharded registration.

A managed parameter has two faces. The *sharded* one (a ShardedParameter wrapped in
nn.Parameter, the object the optimizer holds) is registered on the module outside
forward/backward; its local data is ``master.local_view(fqn)``. The *unsharded* one is
a plain leaf nn.Parameter aliasing ``compute.full_view(fqn)``, registered during
forward; its ``.grad`` is pre-set to ``grad_full_view(fqn)`` so that autograd
accumulates straight into the gradient buffer ([Note: grads into the buffer]).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed import ProcessGroup

from vefsdp_optim.sharding import RaggedShard

from ._sharded_tensor import ShardedParameter

if TYPE_CHECKING:
    from vefsdp_optim._flat_store import FlatStore

__all__ = ["ManagedParam"]

# [Note: grads into the buffer]
# AccumulateGrad adds into an existing ``.grad`` in place when grad mode is off (the
# normal backward), so a leaf whose .grad is a view of the W*m gradient buffer gets its
# gradient summed there: no per-parameter gradient tensor, no copy into a flat
# reduce-scatter input. The unsharded parameter object is made once and survives
# free/alloc of the global buffer (its storage is resized, not replaced).


class ManagedParam:
    """Bookkeeping for one parameter object (possibly registered under several names)."""

    fqn: str  # unique name within the group (first name it was found under)
    slots: list[tuple[nn.Module, str]]  # every (module, attribute) that holds it
    shape: torch.Size  # global shape
    requires_grad: bool
    sharded: nn.Parameter  # ShardedParameter; local data: master.local_view(fqn)
    unsharded: nn.Parameter | None  # 0-d params are planned as (1,) and viewed back

    def __init__(self, fqn: str, slots: list[tuple[nn.Module, str]], shape: torch.Size,
                 requires_grad: bool) -> None:
        self.fqn = fqn
        self.slots = slots
        self.shape = shape
        self.requires_grad = requires_grad
        self.unsharded = None

    def make_sharded(self, local: torch.Tensor, layout: RaggedShard, group: ProcessGroup | None,
                     rank: int, store: FlatStore) -> None:
        t = ShardedParameter(local, layout, group, self.shape, rank)
        self.sharded = nn.Parameter(t, requires_grad=self.requires_grad)
        self.sharded.bind_store(store)

    def repoint(self, local: torch.Tensor, layout: RaggedShard, group: ProcessGroup | None,
                rank: int) -> None:
        """Point the same sharded Parameter object at new local data and layout."""
        self.sharded.rebind_(local, layout, group, rank)
        self.sharded.grad = None

    def make_unsharded(self, full: torch.Tensor) -> None:
        """Create the unsharded leaf aliasing ``full`` (a view of the global buffer)."""
        self.unsharded = nn.Parameter(full.view(self.shape), requires_grad=self.requires_grad)

    def register(self, sharded: bool) -> None:
        p = self.sharded if sharded else self.unsharded
        if p is None:
            raise AssertionError(f"{self.fqn}: unsharded parameter used before the first unshard")
        for module, attr in self.slots:
            module._parameters[attr] = p  # bypass __setattr__ checks, as FSDP2 does
