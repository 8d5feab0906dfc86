"""The pieces of the step loop: items, exchange buckets, the batched exchange.

``BlockOptimizer.step`` ([Note: one step loop] in _block_optimizer.py) turns each
parameter with a gradient into a :class:`StepItem`, puts items into exchange buckets
(:func:`make_buckets`), and moves the inputs of items whose compute layout differs from
their storage layout with :func:`exchange`, one ``all_to_all`` per bucket and dtype
(asynchronous: see ``make_buckets``).
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from vefsdp_optim.comm import Route, ShardedView, assign_owners, same_on_all_ranks
from vefsdp_optim.comm._collectives import first_difference
from vefsdp_optim.sharding import BoxShard, RaggedShard, Requirement

__all__ = [
    "BlockContext", "StepItem", "StepEntry", "PendingExchange", "make_buckets", "check_consistent",
    "exchange",
    "gc_paused", "aligned", "pin_owners",
]


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block, as it was after.

    [Note: no collection during a step]
    A step holds about 15 short-lived Python objects per parameter until its end: views,
    items, entries, argument lists. Reference counting frees them all then. With the
    collector on, every 700 of them start a young-generation collection. Its survivors
    are the step's still-live objects, and they are promoted. So every few steps a full
    collection walks every object of the process. That takes ~0.3 s with torch imported
    and 1,000 parameters. torch's foreach step frees its temporaries as it goes and does
    not pay this. So the step runs with the collector off, as
    torch.distributed.checkpoint's state-dict functions do. The objects it frees by
    reference counting never reach a collection. BlockOptimizer.step runs inside this
    context. Measured in docs/performance.md.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@dataclass(frozen=True, slots=True)
class BlockContext:
    """Where a 1-D slice handed to an update lies in its parameter."""

    shape: torch.Size  # global shape of the parameter
    # flat offset, in the parameter, of the slice's first element; for an elementwise
    # requirement on a tensor-parallel box ([Note: boxes in flat order]) the slice is the
    # rank's box, whose elements are not consecutive, and this is its first one's
    start: int
    length: int  # elements in the slice (whole units, or the whole tensor)
    rank: int
    world_size: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_whole(self) -> bool:
        return self.start == 0 and self.length == self.numel


@dataclass(slots=True)
class StepItem:
    """One parameter in one step: its storage view, gradient, requirement, compute layout."""

    param: torch.Tensor  # the user's parameter object (state key)
    view: ShardedView  # storage layout
    grad: torch.Tensor  # 1-D local gradient slice, same length as view.local (None between steps)
    requirement: Requirement
    compute: RaggedShard | BoxShard  # compute layout (a BoxShard only when it is the storage)
    group: dict[str, Any]  # the param group
    cost: float = 0.0  # relative compute cost of a whole-tensor update (owner items only)

    @property
    def moves(self) -> bool:
        return self.compute != self.view.layout

    def ctx(self, layout: RaggedShard | BoxShard) -> BlockContext:
        rank = self.view.rank
        if isinstance(layout, BoxShard):
            length = layout.local_numel(rank)
            start = int(layout.flat_indices(rank, 0, 1)[0]) if length else 0
        else:
            start, length = layout.local(rank)
        return BlockContext(self.view.shape, start, length, rank, layout.world_size)


def _owner(it: StepItem) -> int | None:
    """The rank that computes ``it`` whole, or None when it is not an owner item."""
    if not it.moves or not it.requirement.needs_whole:
        return None
    # ends nondecreasing: the first rank ending past 0 holds the first element
    ext = it.compute.extents
    r = bisect.bisect_right(ext, 0, key=_end)
    return r if r < len(ext) else None


def _end(extent: tuple[int, int]) -> int:
    return extent[0] + extent[1]


def make_buckets(items: list[StepItem], bucket_numel: int,
                 min_round_numel: int = 0) -> list[list[StepItem]]:
    """Exchange buckets: items of one param group, process group, dtype and device, at
    most ``bucket_numel`` elements each (one oversized item gets a bucket alone); owner
    items in balanced rounds after the rest.

    Items computed whole on an owner rank (Muon's matrices on FSDP2 row shards) are not
    exchanged in one bucket: the step loop would then wait for every input before the
    first Newton-Schulz and send every result back after the last. Instead they form
    rounds: each owner's items in decreasing cost (the order LPT gave them), and round j
    holds the j-th item of every owner, so every rank has about the same work in every
    round. Rounds below ``min_round_numel`` elements are merged with the next (a
    collective costs a fixed latency). The step loop launches round k+1's inputs before it
    computes round k and waits for round k's results only after computing round k+1, so
    both exchanges run under Newton-Schulz; only the first send and the last return are
    exposed. The bucket sequence is a pure function of the items, owners and costs, which
    every rank shares ([Note: consistent steps]), so the collectives match."""
    buckets: list[list[StepItem]] = []
    open_: dict[tuple, list[StepItem]] = {}
    sizes: dict[tuple, int] = {}
    owned: dict[tuple, dict[int, list[StepItem]]] = {}
    for it in items:
        key = (id(it.group), id(it.view.process_group), it.view.local.dtype, it.view.local.device)
        owner = _owner(it)
        if owner is not None and min_round_numel > 0:
            owned.setdefault(key, {}).setdefault(owner, []).append(it)
            continue
        b = open_.get(key)
        n = it.view.layout.numel
        if b is None or sizes[key] + n > bucket_numel:
            b = open_[key] = []
            buckets.append(b)
            sizes[key] = 0
        b.append(it)
        sizes[key] += n
    for per_owner in owned.values():
        queues = [sorted(its, key=lambda it: -it.cost) for _, its in sorted(per_owner.items())]
        rounds = [[q[j] for q in queues if j < len(q)] for j in range(max(map(len, queues)))]
        merged: list[StepItem] = []
        for rnd in rounds:
            merged += rnd
            if sum(it.view.layout.numel for it in merged) >= min_round_numel:
                buckets.append(merged)
                merged = []
        if merged:
            buckets.append(merged)
    return buckets


# [Note: consistent steps] An exchange needs every rank of its process group to step the
# same parameters with the same layouts. A rank that skips a parameter, because its .grad
# is None there only, would leave the all_to_all waiting forever. A check costs a
# collective and a host sync to read it, so a steady-state step checks nothing. The check
# runs on the first step after something changed what a step exchanges that every rank
# does alike and sees in its own copy. That is construction, replan(), load_state_dict(),
# add_param_group(), or a change of the step's structure. The structure is, per
# parameter, its position, identity, process group, storage and compute layouts. A
# re-plan by another optimizer, an edited structural key or an edited param list changes
# it. A change of which parameters have gradients is not a trigger. A rank sees only its
# own gradients, so a check it entered alone would be the hang it guards against.
# Gradients that differ between ranks are then a user error that may hang, as a torch
# collective called differently on two ranks does. TORCH_DISTRIBUTED_DEBUG=DETAIL or
# VEFSDP_OPTIM_DEBUG=1 (``_debug.DEBUG``) checks every step. In the check, each process
# group that exchanges anything compares one fingerprint per rank, on the parameters'
# device, of each parameter's position, whether it has a gradient, shape, storage and
# compute layouts. That takes one all-reduce of two int64 (see ``same_on_all_ranks`` in
# comm/_collectives.py). Only on a mismatch do four more collectives of O(P + W) int64,
# comm's first_difference, name the first parameter and the ranks that differ. Which
# process groups check depends only on the layouts, never on gradients. So on a step
# every rank checks, and the check cannot hang. BlockOptimizer keeps the structure it
# last checked and compares it only when it rebuilds its step plan ([Note: step plan]).
# Every such change causes that rebuild.

@dataclass(frozen=True, slots=True)
class StepEntry:
    """What one rank steps of one parameter, for [Note: consistent steps]."""

    position: tuple[int, int]  # (param group index, index in the group)
    shape: tuple[int, ...]
    layout: RaggedShard | BoxShard  # storage layout
    compute: RaggedShard | BoxShard | None  # compute layout; None: no gradient on this rank
    may_move: bool  # the requirement is not met by the storage layout
    process_group: Any  # the shard process group (None at W = 1)
    device: torch.device  # the parameter's: a check's tensor lives there


def check_consistent(entries: list[StepEntry]) -> None:
    """Raise ValueError, the same on every rank, unless every rank of each exchanging
    process group steps the same parameters alike ([Note: consistent steps])."""
    by_process_group: dict[int, list[StepEntry]] = {}
    moving: set[int] = set()
    for e in entries:
        if e.process_group is None:
            continue
        by_process_group.setdefault(id(e.process_group), []).append(e)
        if e.may_move:
            moving.add(id(e.process_group))
    for key in moving:
        es = by_process_group[key]
        process_group = es[0].process_group
        # ints only: hash(None) and str hashes differ between processes
        keys = [hash((e.position, e.shape, _layout_key(e.layout),
                      _layout_key(e.compute) if e.compute is not None else ())) for e in es]
        if same_on_all_ranks(hash(tuple(keys)), process_group, es[0].device):
            continue
        # the first parameter and the ranks that differ, in O(P + W) int64 per rank: a
        # gather of every rank's layouts would be O(P x W) objects of W extents each
        at, differ, with_grad = first_difference(keys, [e.compute is not None for e in es],
                                                 process_group, es[0].device)
        if at < 0:
            diff = (f"ranks {differ} step another number of parameters in this process "
                    "group than rank 0")
        else:
            e = es[at]
            without = [r for r in range(process_group.size()) if r not in set(with_grad)]
            what = f"param group {e.position[0]} parameter {e.position[1]} (shape {e.shape})"
            diff = (f"{what}: a gradient on ranks {with_grad}, none on ranks {without}"
                    if with_grad and without
                    else f"{what}: layouts differ between ranks: ranks {differ} differ from rank 0")
        raise ValueError(
            "ranks disagree on what this optimizer step updates, so its exchange would hang: "
            f"{diff} (the first difference). Every rank must step the same parameters: set .grad "
            "to None (or zero it) on every rank alike")


def _layout_key(layout: RaggedShard | BoxShard) -> tuple[int, int]:
    """Ints only (hashes of None and of strings differ between processes): the layout's
    kind and its hash, which both layouts compute once from ints and tuples of ints (the
    same in every process), so the check costs O(1) per parameter, not O(W)."""
    return (0 if isinstance(layout, RaggedShard) else 1), hash(layout)


def exchange(bucket: list[StepItem], tensors: list[list[torch.Tensor]], *, forward: bool,
             moving: list[int] | None = None,
             routes: dict[tuple, list] | None = None) -> PendingExchange:
    """Send each moving item's ``tensors`` from its storage layout to its compute layout
    (``forward``) or back, in one ``all_to_all`` per dtype; returns at once. ``moving``:
    the indices of the items that move, where the caller knows them; ``routes``: a cache
    of the bucket's routes, kept by the caller for as long as the items' layouts stay
    ([Note: step plan])."""
    if moving is None:
        moving = [i for i, it in enumerate(bucket) if it.moves]
    if not moving:
        return PendingExchange(tensors)
    out = [list(ts) for ts in tensors]
    pending = PendingExchange(out)
    sends = [t for i in moving for t in tensors[i]]
    if not sends:
        return pending
    key = (forward, tuple(len(tensors[i]) for i in moving), tuple(t.dtype for t in sends))
    groups = routes.get(key) if routes is not None else None
    if groups is None:
        src, dst, where = [], [], []
        for i in moving:
            it = bucket[i]
            a, b = (it.view.layout, it.compute) if forward else (it.compute, it.view.layout)
            for j in range(len(tensors[i])):
                src.append(a)
                dst.append(b)
                where.append((i, j))
        by_dtype: dict[torch.dtype, list[int]] = {}
        for k, t in enumerate(sends):
            by_dtype.setdefault(t.dtype, []).append(k)
        process_group = bucket[0].view.process_group
        groups = [(Route([src[k] for k in ks], [dst[k] for k in ks], process_group), ks,
                   [where[k] for k in ks])
                  for ks in by_dtype.values()]  # one all_to_all per dtype (usually one)
        if routes is not None:
            routes[key] = groups
    for route, ks, where in groups:
        handle = route.launch(sends if len(ks) == len(sends) else [sends[k] for k in ks],
                              async_op=True)
        pending.handles.append((handle, where))
    return pending


class PendingExchange:
    """Exchanges in flight for one bucket; wait() fills the per-item tensor lists."""

    def __init__(self, out: list[list[torch.Tensor]]) -> None:
        self.out = out
        self.handles: list[tuple[Any, list[tuple[int, int]]]] = []

    def wait(self) -> list[list[torch.Tensor]]:
        for handle, where in self.handles:
            for (i, j), r in zip(where, handle.wait(), strict=True):
                self.out[i][j] = r
        self.handles = []
        return self.out


# [Note: owners stay]
# The rank that computes a whole tensor is its owner. Owners are chosen by balancing the
# whole tensors that step together (see ``assign_owners`` in comm/_owners.py). So an
# owner would move when that set changes, as when a parameter of the param group has no
# gradient or one is added later. State kept by the owner, such as SOAP's factors and
# eigenbases ([Note: SOAP state]), would then be missing where the tensor is computed. So
# a parameter keeps the owner of its first step for as long as its storage layout stays
# the same. A re-plan, or a load at another world size, chooses again. Only parameters
# new to the step are balanced. Every rank pins the same owners, because they follow from
# the same layouts and costs in the same order. ``pin_owners`` keeps them in ``pinned``,
# by parameter, with the storage layout they were chosen for.
def pin_owners(items: list[StepItem], cost: Callable[[torch.Size, dict[str, Any]], float],
               owner_cache: dict[tuple, tuple[int, ...]],
               pinned: dict[int, tuple[RaggedShard | BoxShard, int]]) -> None:
    """Set the compute layout of whole-tensor ``items`` to their owners' ([Note: owners
    stay]): balanced by ``cost`` (cached in ``owner_cache``), the owners in ``pinned``
    (id(param) -> (storage layout, owner)) kept while the layout stays."""
    by_process_group: dict[int, list[StepItem]] = {}
    for it in items:
        by_process_group.setdefault(id(it.view.process_group), []).append(it)
    for its in by_process_group.values():
        layouts = [it.view.layout for it in its]
        for it in its:
            it.cost = cost(it.view.shape, it.group)
        key = tuple((id(it.param), it.view.layout, it.cost) for it in its)
        owners = owner_cache.get(key)
        if owners is None:
            owners = assign_owners(layouts, [it.cost for it in its]).owners
            if len(owner_cache) > 64:
                owner_cache.clear()
            owner_cache[key] = owners
        for it, owner in zip(its, owners, strict=True):
            key = id(it.param)
            kept = pinned.get(key)
            if kept is not None and kept[0] == it.view.layout:  # [Note: owners stay]
                owner = kept[1]
            else:
                pinned[key] = (it.view.layout, owner)
            it.compute = RaggedShard.whole(it.view.layout.numel, it.view.layout.world_size, owner)


# CPU BLAS and vectorized reductions pick their kernels by the address of their operands:
# the same matrix product or norm of a gradient that starts 4 bytes past a 64-byte
# boundary rounds differently from one in a fresh allocation (figures in
# docs/decisions.md). fully_shard's gradients are views into one flat buffer at any
# offset, and an exchange delivers slices of a receive buffer, while one device's
# gradient is a tensor of its own, 64-byte aligned by torch's allocators. So the update
# of a block sees its gradient at an aligned address, copied there when it is not (a copy
# of the gradient per step and parameter where the store put it off the boundary; never
# on a fresh tensor), and every layout gives the bits of one device.
# The check reads the view's offset into its storage, not its address: storages start
# aligned, and metadata is all a fake tensor (FakeTensorMode, torch.compile) has.
_ALIGN = 64  # bytes: torch's CPU allocator alignment (CUDA's caching allocator: 512)


def aligned(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a contiguous copy of it when it starts off a 64-byte boundary of its storage."""
    if (t.storage_offset() * t.element_size()) % _ALIGN == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)
