"""Choose one owner rank per whole-tensor computation (Muon), balancing compute.

Pure and deterministic: every rank computes the same assignment from the same layouts
and costs without talking. See ``assign_owners``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from vefsdp_optim._torch_compat import host_scratch
from vefsdp_optim.sharding import BoxShard, RaggedShard

__all__ = ["OwnerAssignment", "assign_owners"]


class OwnerAssignment(NamedTuple):
    owners: tuple[int, ...]  # one rank per tensor
    loads: tuple[float, ...]  # per-rank total cost
    max_over_mean: float  # max load / mean load (1.0 when all costs are 0)
    elements_moved: int  # sum over tensors of numel - elements the owner already holds


@functools.lru_cache(maxsize=64)
def _held(layout: RaggedShard | BoxShard) -> torch.Tensor:
    """Each rank's elements of ``layout`` (int64, W long), once per layout: parameters of
    one shape share theirs. Called under ``host_scratch`` (by ``assign_owners``)."""
    return torch.tensor([layout.local_numel(r) for r in range(layout.world_size)],
                        dtype=torch.int64, device="cpu")


def assign_owners(
    layouts: Sequence[RaggedShard | BoxShard],
    costs: Sequence[float],
    *,
    tolerance: float = 1e-6,
) -> OwnerAssignment:
    """Assign each tensor (layout i, cost i) to one rank, balancing the summed cost.

    Longest processing time first (Graham's LPT): tensors by cost descending, ties by
    index, each to the least-loaded rank. Among ranks whose load is within ``tolerance``
    (a fraction of the mean load per rank) of the minimum, the rank that already holds
    most of the tensor wins, then the lower load, then the lower rank. This preference
    matters at the start, when all loads are 0, and for equal costs. It keeps a tensor off
    ranks with empty shards and cuts the elements that must move. The makespan stays within
    Graham's list-scheduling bound, max load <= total / W + (1 - 1/W) * max cost, plus the
    tolerance."""
    layouts = list(layouts)
    costs = [float(c) for c in costs]
    if len(layouts) != len(costs):
        raise ValueError(f"got {len(layouts)} layouts and {len(costs)} costs")
    if not layouts:
        raise ValueError("assign_owners needs at least one tensor")
    for i, lay in enumerate(layouts):
        if not isinstance(lay, (RaggedShard, BoxShard)):
            raise TypeError(f"layouts[{i}] must be a RaggedShard or a BoxShard, got "
                            f"{type(lay).__name__}")
    w = layouts[0].world_size
    bad = [i for i, lay in enumerate(layouts) if lay.world_size != w]
    if bad:
        raise ValueError(
            f"all layouts must have one world size; layout 0 has {w}, layouts {bad} have "
            f"{[layouts[i].world_size for i in bad]}"
        )
    bad_cost = [(i, c) for i, c in enumerate(costs) if not math.isfinite(c) or c < 0]
    if bad_cost:
        raise ValueError(f"costs must be finite and >= 0, got (index, cost) {bad_cost}")
    if not math.isfinite(tolerance) or tolerance < 0:
        raise ValueError(f"tolerance must be finite and >= 0, got {tolerance}")

    total = math.fsum(costs)
    slack = tolerance * total / w
    owners = [0] * len(layouts)
    # the per-rank scans run as tensor ops over W float64 loads on the host (real tensors
    # under FakeTensorMode too, seen by no dispatch mode): the same IEEE sums and
    # comparisons as Python floats, so the same owners (see the docstring)
    with host_scratch():
        load = torch.zeros(w, dtype=torch.float64, device="cpu")
        inf = torch.tensor(math.inf, dtype=torch.float64, device="cpu")
        for i in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
            low = float(load.min())
            # the candidates' held elements
            top = torch.where(load <= low + slack, _held(layouts[i]), -1)
            pick = top == top.max()  # the most held among the candidates, then the lowest load
            pick &= load == torch.where(pick, load, inf).min()
            best = int(pick.byte().argmax())  # then the lowest rank: argmax gives the first
            owners[i] = best
            load[best] += costs[i]
        loads = load.tolist()
    mean = total / w
    ratio = max(loads) / mean if mean > 0 else 1.0
    moved = sum(lay.numel - lay.local_numel(o) for lay, o in zip(layouts, owners, strict=True))
    return OwnerAssignment(tuple(owners), tuple(loads), ratio, moved)
