"""Communication: DistributedBuffer, redistribution between layouts, parameter views."""

from ._owners import OwnerAssignment, assign_owners, muon_cost
from ._redistribute import RedistributeHandle, check_same_on_all_ranks, redistribute, transfer_sizes
from ._views import ShardedView, sharded_view

__all__ = [
    "OwnerAssignment",
    "RedistributeHandle",
    "ShardedView",
    "assign_owners",
    "check_same_on_all_ranks",
    "muon_cost",
    "redistribute",
    "sharded_view",
    "transfer_sizes",
]
