"""Communication: DistributedBuffer, redistribution between layouts, parameter views."""

from ._buffer import DistributedBuffer
from ._collectives import (
    FlatWork,
    all_gather_flat,
    all_reduce_avg,
    check_plan_consistent,
    reduce_scatter_flat,
    same_on_all_ranks,
)
from ._owners import OwnerAssignment, assign_owners
from ._redistribute import (
    RedistributeHandle,
    Route,
    check_same_on_all_ranks,
    redistribute,
    transfer_sizes,
)
from ._views import ShardedView, dtensor_boxes, sharded_view

__all__ = [
    "DistributedBuffer",
    "FlatWork",
    "OwnerAssignment",
    "RedistributeHandle",
    "Route",
    "ShardedView",
    "all_gather_flat",
    "all_reduce_avg",
    "assign_owners",
    "check_plan_consistent",
    "check_same_on_all_ranks",
    "dtensor_boxes",
    "redistribute",
    "reduce_scatter_flat",
    "same_on_all_ranks",
    "sharded_view",
    "transfer_sizes",
]
