"""Muon's param-group keys and per-parameter plans: the defaults and checks of the
constructor's arguments, and how a parameter splits into separately orthogonalized
blocks ([Note: Muon blocks] in _math/_muon_blocks.py) with what that asks of the planner.
Shared by :class:`Muon` and :class:`NorMuon`."""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vefsdp_optim._math import (
    NsCoefficients,
    check_adam_hparams,
    check_ns_coefficients,
    muon_batch_view,
    muon_block_unit,
    muon_blocks,
    muon_blocks_cost,
)
from vefsdp_optim.sharding import FlatBlocks, RaggedShard, Requirement, RowBlocks, WholeTensor

from ._step_loop import StepItem

__all__ = [
    "block_runs",
    "MuonPlan",
    "check_heads",
    "check_momentum_dtype",
    "muon_defaults",
    "muon_group_plan",
    "ns_args",
    "whole_blocks",
]


@dataclass(frozen=True)
class MuonPlan:
    """How one Muon parameter splits into separately orthogonalized blocks
    ([Note: Muon blocks] in _math/_muon_blocks.py) and what it asks of the planner."""

    requirement: Requirement
    offsets: tuple[int, ...]  # flat offset of each block
    blocks: tuple[tuple[int, int], ...]  # (rows, cols) of each block
    simple: bool  # one block: the whole (dim 0, rest) matrix (today's path)
    uniform: bool  # every block has the same (rows, cols): one lr adjustment
    cost: float  # Newton-Schulz cost of all the blocks (muon_blocks_cost), for owner balancing

    def span(self, start: int, length: int) -> range:
        """Indices of the blocks that intersect flat ``[start, start + length)``."""
        lo = bisect.bisect_right(self.offsets, start) - 1
        hi = bisect.bisect_left(self.offsets, start + length)
        return range(max(lo, 0), hi)


def _muon_plan(shape: tuple[int, ...], flatten: bool,
               split_sizes: tuple[int, ...] | None) -> MuonPlan:
    blocks = muon_blocks(shape, flatten, split_sizes)
    unit = muon_block_unit(shape, flatten, split_sizes)
    numel = math.prod(shape)
    if unit >= numel:
        req: Requirement = WholeTensor()
    elif not flatten and len(shape) == 3 and unit == shape[1] * shape[2]:
        req = RowBlocks(1)  # whole experts: FSDP2's Shard(0) already satisfies it
    else:
        req = FlatBlocks(unit)
    return MuonPlan(req, tuple(b[0] for b in blocks), tuple((r, c) for _, r, c in blocks),
                     simple=len(blocks) == 1, uniform=len({(r, c) for _, r, c in blocks}) == 1,
                     cost=muon_blocks_cost(shape, flatten, split_sizes))


# The one cache of Muon plans: (shape, flatten, split_sizes, num_heads) of a param group
# -> its MuonPlan (muon_group_plan). A step asks for the plan of every matrix several
# times (requirement, cost, compute, apply); _make_plan validates the group's keys
# and builds the plan, uncached.
_PLANS: dict[tuple, MuonPlan] = {}


def muon_defaults(
    *, lr: float, weight_decay: float, momentum: float, nesterov: bool, ns_coefficients: object,
    eps: float, ns_steps: int, adjust_lr_fn: str | None, betas: tuple[float, float],
    adamw_eps: float,
    flatten: bool | None, split_sizes: Sequence[int] | None, adjust_lr_fns: tuple[str | None, ...],
    num_heads: int | None = None, momentum_dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """Muon's param-group defaults from its constructor arguments, validated (ValueError
    naming the bad value, with torch.optim.Muon's messages where it has one)."""
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not 0.0 <= lr:
        raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
    if not 0.0 <= momentum:
        raise ValueError(f"momentum should be >= 0 but is: {momentum}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"weight decay should be >= 0 but is: {weight_decay}")
    if adjust_lr_fn not in adjust_lr_fns:
        raise ValueError(
            f"Adjust learning rate function {adjust_lr_fn} is not supported; "
            f"use one of {', '.join(map(repr, adjust_lr_fns))}")
    if not (isinstance(ns_steps, int) and 0 < ns_steps < 100):
        raise ValueError(f"ns_steps must be an int in [1, 100), got {ns_steps!r}")
    check_adam_hparams(lr, betas, adamw_eps, weight_decay)
    return dict(
        lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
        ns_coefficients=check_ns_coefficients(ns_coefficients), eps=eps, ns_steps=ns_steps,
        adjust_lr_fn=adjust_lr_fn, use_muon=True, betas=tuple(betas), adamw_eps=adamw_eps,
        flatten=flatten, split_sizes=split_sizes, num_heads=check_heads(num_heads),
        momentum_dtype=check_momentum_dtype(momentum_dtype),
    )


def check_momentum_dtype(dtype: object) -> torch.dtype | None:
    if dtype is None or dtype == torch.int8:
        return dtype
    raise ValueError(f"momentum_dtype must be None (the parameter's dtype, as torch.optim.Muon) or "
                     f"torch.int8 (8-bit block-wise momentum), got {dtype!r}")


def check_heads(num_heads: object) -> int | None:
    if num_heads is None:
        return None
    if isinstance(num_heads, bool) or not isinstance(num_heads, int):
        raise TypeError(f"num_heads must be a positive int or None, got {num_heads!r}")
    if num_heads < 1:
        raise ValueError(f"num_heads must be >= 1, got {num_heads}")
    return num_heads


_FLATTEN_HELP = (
    "set the group key flatten=True to orthogonalize it as one (dim 0, rest) matrix (the "
    "convolution convention), or flatten=False to orthogonalize each [..., m, n] slice over the "
    "leading dims alone, as a separate 2-D parameter (MoE expert weights [experts, out, in])")


def ns_args(group: dict[str, Any]) -> tuple[NsCoefficients, int, float]:
    """(coefficients, steps, eps) of a param group's Newton-Schulz, hashable."""
    coeffs = group["ns_coefficients"]
    return coeffs if isinstance(coeffs, str) else tuple(coeffs), group["ns_steps"], group["eps"]


def whole_blocks(it: StepItem, plan: MuonPlan, start: int,
                 length: int) -> list[tuple[int, int, int]]:
    """(offset in the slice, rows, cols) of each block of the compute slice ``[start,
    start + length)`` of item ``it``, which must hold whole blocks only."""
    found, done = [], 0
    for b in plan.span(start, length):
        (rows, cols), a = plan.blocks[b], plan.offsets[b] - start
        if a < 0 or a + rows * cols > length:
            raise RuntimeError(f"Muon block at flat offset {plan.offsets[b]} of a "
                               f"parameter of shape {tuple(it.view.shape)} is split by the compute "
                               f"layout {it.compute}")
        found.append((a, rows, cols))
        done += rows * cols
    if done != length:
        raise RuntimeError(f"Muon compute slice [{start}, {start + length}) of a "
                           f"parameter of shape {tuple(it.view.shape)} does not hold whole blocks")
    return found


def muon_group_plan(shape: Sequence[int], group: dict[str, Any]) -> MuonPlan:
    split = group.get("split_sizes")
    flatten = group.get("flatten")
    key = (tuple(shape), flatten is None, flatten is not False,
           tuple(split) if isinstance(split, list) else split, group.get("num_heads"))
    try:
        plan = _PLANS.get(key)
    except TypeError:  # an unhashable value: _make_plan names what is wrong with it
        return _make_plan(shape, group)
    if plan is None:
        plan = _make_plan(shape, group)
        if len(_PLANS) > 4096:
            _PLANS.clear()
        _PLANS[key] = plan
    return plan


def _make_plan(shape: Sequence[int], group: dict[str, Any]) -> MuonPlan:
    shape = tuple(int(d) for d in shape)
    flatten = group.get("flatten")
    if flatten is None and len(shape) >= 3:
        raise ValueError(
            f"Muon got a parameter of shape {shape} in a group without the key 'flatten': "
            + _FLATTEN_HELP)
    split = _split_sizes(shape, group)
    try:
        return _muon_plan(shape, flatten is not False, split)
    except ValueError as e:
        if split is None:
            raise
        batch, rows, cols = muon_batch_view(shape, flatten is not False)
        raise ValueError(f"bad split_sizes for a Muon parameter of shape {shape} (matrices of "
                         f"{rows} x {cols}): {e}") from None


def _split_sizes(shape: tuple[int, ...], group: dict[str, Any]) -> tuple[int, ...] | None:
    """The group's row blocks of each matrix: ``split_sizes``, or ``num_heads`` equal ones."""
    split = group.get("split_sizes")
    heads = group.get("num_heads")
    if heads is None:
        return None if split is None else tuple(split)
    if split is not None:
        raise ValueError(f"a Muon group sets both num_heads={heads} and "
                         f"split_sizes={tuple(split)}; set one (num_heads: equal row blocks; "
                         "split_sizes: any row blocks)")
    _, rows, cols = muon_batch_view(shape, group.get("flatten") is not False)
    if rows % heads:
        raise ValueError(f"num_heads={heads} does not divide the {rows} rows of the "
                         f"{rows} x {cols} matrices of a Muon parameter of shape {shape}")
    return (rows // heads,) * heads


def block_runs(item: StepItem, plan: MuonPlan) -> list[tuple[int, int, tuple[int, int]]]:
    """The runs ``(lo, hi, block shape)`` of this rank's slice of ``item``'s parameter,
    consecutive blocks of one shape merged (an lr adjustment is a function of the shape)."""
    layout, rank = item.view.layout, item.view.rank
    if isinstance(layout, RaggedShard):
        span = plan.span(*layout.local(rank))
    else:  # a tensor-parallel box: each block's elements are one run of it
        span = range(len(plan.blocks))
    runs: list[tuple[int, int, tuple[int, int]]] = []
    for b in span:
        rows, cols = plan.blocks[b]
        lo = layout.count_below(rank, plan.offsets[b])
        hi = layout.count_below(rank, plan.offsets[b] + rows * cols)
        if lo == hi:
            continue
        if runs and runs[-1][2] == plan.blocks[b] and lo == runs[-1][1]:
            runs[-1] = (runs[-1][0], hi, plan.blocks[b])
        else:
            runs.append((lo, hi, plan.blocks[b]))
    return runs
