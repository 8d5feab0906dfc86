"""The compute layouts a block requirement gives a storage layout that cuts its blocks:
snapped (each boundary at its nearest legal cut), balanced between ranks where the
optimizer keeps no state on them, and spread where there are fewer blocks than ranks.
Pure functions of layouts: the step planner (_planner.py) pins what they return."""

from __future__ import annotations

import bisect
import itertools
import operator

import torch

from vefsdp_optim.sharding import BoxShard, RaggedShard, Requirement

__all__ = ["balanced_compute", "snapped_compute", "spread_compute", "spreads"]


# A block requirement that the storage layout cuts (Muon's row blocks of a fused QKV on
# FSDP2's row shards) computes on the snapped layout: each boundary at its nearest legal
# cut, ties down. Where every parameter ties alike (MHA's 3 blocks over 2 ranks: rank 0
# one block, rank 1 two), one rank computes twice the other's blocks in every layer. So
# where the optimizer keeps no state on the compute layout, each boundary instead takes
# whichever of its two nearest legal cuts brings the rank before it closer to an even
# share of the elements the param group's moving parameters computed so far, ties to the
# nearer cut, then down. That holds under BlockOptimizer's balance_compute_cuts with
# state_layout() the storage: Muon's float momentum, not its 8-bit one nor NorMuon's row
# moments. The cuts may then differ between plans, since a gradient fewer moves the later
# ones. Every rank derives the same cuts from the same items in the same order. The bits
# do not change: each block is computed whole, wherever.
def balanced_compute(layout: RaggedShard, req: Requirement, shape: torch.Size,
                     load: list[int]) -> RaggedShard:
    """The snapped compute layout of ``layout`` under ``req``, balanced against ``load``
    (elements computed so far per rank, updated); see the comment above."""
    unit, n, w = req.unit(shape), layout.numel, layout.world_size
    target = (sum(load) + n) / w
    out, prev = [0], 0
    bounds = layout.boundaries  # W + 1 points, built per call: read once, O(W) in all
    for k in range(1, w):
        b = bounds[k]
        if b % unit:
            lo = (b // unit) * unit
            options = (max(lo, prev), max(min(lo + unit, n), prev))
            c = min(options, key=lambda c: (abs(load[k - 1] + c - prev - target), abs(c - b), c))
        else:
            c = max(b, prev)
        load[k - 1] += c - prev
        out.append(c)
        prev = c
    load[w - 1] += n - prev
    out.append(n)
    return RaggedShard.from_boundaries(out)


# [Note: spread compute blocks]
# A parameter may have fewer blocks than ranks, as Shampoo's and SOAP's tiles of a large
# matrix on FSDP2's row shards at a large world size. The snapped layout would give each
# block to the rank at its nearest cut, and every matrix of one shape to the same ranks.
# A few ranks would then compute every tile and hold the preconditioners. So instead
# each block goes to the least loaded of the ranks that hold a part of it, the lowest on
# a tie. The load is the elements that the param group's earlier parameters, in their
# order, put on each rank, with or without a gradient. It depends on neither gradients
# nor later parameters. A block still moves only between the ranks that hold it.
# The optimizer's state lives on this layout. So BlockOptimizer pins it per parameter
# while the storage layout and the requirement stay, as [Note: owners stay] pins owners.
# Every rank derives the same layout from the same parameters. The ranks that may hold
# block t all precede those of block t + 1, or share one rank with them. So ranks in
# increasing order hold blocks in increasing order, and the result is a RaggedShard.
# The bits do not change, because each block is computed whole, wherever it goes. With
# as many blocks as ranks or more, the snapped layout stays, and each rank gets its
# share, give or take a block. A tensor-parallel box layout spreads over its even split,
# as its nearest cuts snap that. Its exchange moves the pieces of each block wherever
# the block goes. The figures that led here are in docs/decisions.md.


def spreads(layout: RaggedShard | BoxShard, req: Requirement, shape: torch.Size) -> bool:
    """Whether ``req`` on ``layout`` has fewer blocks than ranks ([Note: spread compute blocks])."""
    return -(-layout.numel // req.unit(shape)) < layout.world_size


def spread_compute(layout: RaggedShard, req: Requirement, shape: torch.Size,
                   load: list[int]) -> tuple[RaggedShard, tuple[tuple[int, int], ...]]:
    """The compute layout of ``req`` on ``layout`` where it :func:`spreads`, each block on
    the least loaded rank that holds a part of it, with ``load`` (elements per rank)
    updated, and the ``(rank, elements)`` of each block ([Note: spread compute blocks])."""
    unit, n, w = req.unit(shape), layout.numel, layout.world_size
    b = layout.boundaries  # W + 1 points, built once for every block's holders
    # every block's holders (holders_between's bisections, in C over all blocks at once)
    starts = range(0, n, unit)
    first = map(bisect.bisect_right, itertools.repeat(b), starts)
    last = map(bisect.bisect_left, itertools.repeat(b),
               itertools.chain(starts[1:], (n,) if n else ()))
    owners, prev, get = [], 0, load.__getitem__
    for t, (c0, c1) in enumerate(zip(first, last, strict=True)):
        size = min(unit, n - t * unit)
        lo, hi = max(c0 - 1, 0, prev), min(c1 - 1, w - 1) + 1
        o = lo if hi - lo == 1 else min(range(lo, hi), key=get)
        load[o] += size
        owners.append((o, size))
        prev = o
    bounds, prev = [], 0  # bounds[r]: where rank r's blocks start
    for t, (o, _) in enumerate(owners):
        bounds += [t * unit] * (o + 1 - prev)
        prev = o + 1
    bounds += [n] * (w + 1 - prev)
    # valid by construction (nondecreasing ints from 0 to n): without from_boundaries' O(W) checks
    extents = tuple(zip(bounds, map(operator.sub, bounds[1:], bounds), strict=False))
    return RaggedShard._trusted(extents), tuple(owners)


def snapped_compute(layout: RaggedShard | BoxShard, req: Requirement,
                    shape: torch.Size) -> RaggedShard:
    """The compute layout of a block requirement that ``layout`` cuts: its boundaries
    snapped to legal cuts; for a BoxShard (tensor parallel, [Note: boxes in flat
    order]), equal element counts per rank, snapped."""
    base = layout.even_split() if isinstance(layout, BoxShard) else layout
    return base.snapped(req, shape)
