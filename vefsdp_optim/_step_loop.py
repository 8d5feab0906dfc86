"""The pieces of the step loop: items, exchange buckets, the batched exchange.

``BlockOptimizer.step`` ([Note: one step loop] in _block_optimizer.py) turns each
parameter with a gradient into a :class:`StepItem`, groups items into exchange buckets
(:func:`make_buckets`), and moves the inputs of items whose compute layout differs from
their storage layout with :func:`exchange`, one ``all_to_all`` per bucket and dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from vefsdp_optim.comm import ShardedView, check_same_on_all_ranks, redistribute
from vefsdp_optim.sharding import RaggedShard, Requirement

__all__ = ["BlockContext", "StepItem", "PendingExchange", "make_buckets", "check_consistent", "exchange"]


@dataclass(frozen=True, slots=True)
class BlockContext:
    """Where a 1-D slice handed to an update lies in its parameter."""

    shape: torch.Size  # global shape of the parameter
    start: int  # flat offset, in the parameter, of the slice's first element
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
    grad: torch.Tensor  # 1-D local gradient slice, same length as view.local
    requirement: Requirement
    compute: RaggedShard  # compute layout
    group: dict[str, Any]  # the param group

    @property
    def moves(self) -> bool:
        return self.compute != self.view.layout

    def ctx(self, layout: RaggedShard) -> BlockContext:
        start, length = layout.local(self.view.rank)
        return BlockContext(self.view.shape, start, length, self.view.rank, layout.world_size)


def make_buckets(items: list[StepItem], bucket_numel: int) -> list[list[StepItem]]:
    """Exchange buckets: items of one param group, process group, dtype and device, at
    most ``bucket_numel`` elements each (one oversized item gets a bucket alone)."""
    buckets: list[list[StepItem]] = []
    open_: dict[tuple, list[StepItem]] = {}
    sizes: dict[tuple, int] = {}
    for it in items:
        key = (id(it.group), id(it.view.group), it.view.local.dtype, it.view.local.device)
        b = open_.get(key)
        n = it.view.layout.numel
        if b is None or sizes[key] + n > bucket_numel:
            b = open_[key] = []
            buckets.append(b)
            sizes[key] = 0
        b.append(it)
        sizes[key] += n
    return buckets


def check_consistent(items: list[StepItem], checked: set[int]) -> None:
    """Once per process group, before its first exchange: every rank must hold the
    same parameters, layouts and compute layouts, or the exchange would hang."""
    by_group: dict[int, list[StepItem]] = {}
    for it in items:
        if it.moves and id(it.view.group) not in checked:
            by_group.setdefault(id(it.view.group), [])
    for it in items:
        if id(it.view.group) in by_group:
            by_group[id(it.view.group)].append(it)
    for key, its in by_group.items():
        fingerprint = repr([(tuple(it.view.shape), it.view.layout.extents, it.compute.extents)
                            for it in its])
        check_same_on_all_ranks(fingerprint, its[0].view.group)
        checked.add(key)


def exchange(bucket: list[StepItem], tensors: list[list[torch.Tensor]], *, forward: bool) -> PendingExchange:
    """Send each moving item's ``tensors`` from its storage layout to its compute layout
    (``forward``) or back, in one ``all_to_all`` per dtype; returns at once."""
    out = [list(ts) for ts in tensors]
    sends, src, dst, where = [], [], [], []
    for i, it in enumerate(bucket):
        if not it.moves:
            continue
        a, b = (it.view.layout, it.compute) if forward else (it.compute, it.view.layout)
        for j, t in enumerate(tensors[i]):
            sends.append(t)
            src.append(a)
            dst.append(b)
            where.append((i, j))
    pending = PendingExchange(out)
    if not sends:
        return pending
    group = bucket[0].view.group
    by_dtype: dict[torch.dtype, list[int]] = {}
    for k, t in enumerate(sends):
        by_dtype.setdefault(t.dtype, []).append(k)
    for ks in by_dtype.values():  # one all_to_all per dtype (usually one)
        handle = redistribute([sends[k] for k in ks], [src[k] for k in ks],
                              [dst[k] for k in ks], group, async_op=True)
        pending.handles.append((handle, [where[k] for k in ks]))
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
