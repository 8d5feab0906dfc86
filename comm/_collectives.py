"""Stateless flat collectives for one store's buffer, and the plan consistency check.

Every function takes its process group explicitly (never the implicit global group),
so a mesh axis of a 2-D DeviceMesh works the same as a plain process group.
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

import torch
import torch.distributed as dist

from vefsdp_optim.sharding import BufferPlan

__all__ = [
    "FlatWork",
    "all_gather_flat",
    "all_reduce_avg",
    "check_plan_consistent",
    "reduce_scatter_flat",
    "supports_native_avg",
]

_REDUCE_OPS = ("sum", "avg")
# Backends whose reduce-scatter takes ReduceOp.AVG (NCCL >= 2.10). Elsewhere (gloo):
# SUM, then one in-place division of the m-element result; see [Note: avg fallback].
_NATIVE_AVG_BACKENDS = frozenset({"nccl"})


class FlatWork(NamedTuple):
    """An in-flight flat collective: ``wait()`` completes it and applies the in-place
    epilogue (the division of an averaged reduce-scatter on backends without AVG)."""

    work: dist.Work
    divide_by: int  # 1: nothing after the collective; W: output.div_(W) after wait
    output: torch.Tensor  # 1-D, the collective's output

    def wait(self) -> bool:
        self.work.wait()
        if self.divide_by != 1:
            self.output.div_(self.divide_by)
        return True


def supports_native_avg(group: dist.ProcessGroup) -> bool:
    """Whether reduce-scatter on ``group`` takes ``ReduceOp.AVG`` directly."""
    return dist.get_backend(group) in _NATIVE_AVG_BACKENDS


def all_reduce_avg(t: torch.Tensor, group: dist.ProcessGroup) -> None:
    """In-place average of ``t`` over ``group`` (AVG where the backend has it, else SUM
    and one division, as [Note: avg fallback])."""
    if supports_native_avg(group):
        dist.all_reduce(t, op=dist.ReduceOp.AVG, group=group)
    else:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        t.div_(group.size())


def _check_flat(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous 1-D tensor, got shape {tuple(t.shape)}")
    return t


def _check_sizes(big: torch.Tensor, small: torch.Tensor, world_size: int, what: str) -> None:
    if big.numel() != world_size * small.numel():
        raise ValueError(
            f"{what}: the flat buffer has {big.numel()} elements, expected W * m = "
            f"{world_size} * {small.numel()} = {world_size * small.numel()}")
    if big.dtype != small.dtype:
        raise ValueError(f"{what}: dtypes differ ({big.dtype} vs {small.dtype}); one buffer per dtype")


def all_gather_flat(
    output: torch.Tensor,  # 1-D, W * m elements
    input: torch.Tensor,  # 1-D, m elements (may be output[rank*m:(rank+1)*m])
    group: dist.ProcessGroup,
    *,
    async_op: bool = False,
) -> FlatWork | None:
    """One ``all_gather_single(output, input, group)``; nothing is copied around it."""
    _check_flat("output", output)
    _check_flat("input", input)
    _check_sizes(output, input, group.size(), "all_gather_flat")
    work = dist.all_gather_single(output, input, group=group, async_op=async_op)
    return FlatWork(work, 1, output) if async_op else None


def reduce_scatter_flat(
    output: torch.Tensor,  # 1-D, m elements
    input: torch.Tensor,  # 1-D, W * m elements
    group: dist.ProcessGroup,
    *,
    op: str = "avg",
    async_op: bool = False,
) -> FlatWork | None:
    """One ``reduce_scatter_single(output, input, group)`` with op ``"sum"`` or ``"avg"``.

    On backends without ``ReduceOp.AVG`` an average is a SUM followed by one in-place
    ``output.div_(W)`` (on ``wait()`` when ``async_op``), which rounds exactly as
    ``sum / W`` does ([Note: avg fallback]).
    """
    if op not in _REDUCE_OPS:
        raise ValueError(f"reduce op must be one of {_REDUCE_OPS}, got {op!r}")
    _check_flat("output", output)
    _check_flat("input", input)
    w = group.size()
    _check_sizes(input, output, w, "reduce_scatter_flat")
    divide_by = 1
    if op == "sum":
        rop = dist.ReduceOp.SUM
    elif supports_native_avg(group):
        rop = dist.ReduceOp.AVG
    else:
        if not output.is_floating_point() and not output.is_complex():
            raise NotImplementedError(
                f"op='avg' is supported for floating and complex dtypes, got {output.dtype}; use op='sum'")
        rop, divide_by = dist.ReduceOp.SUM, w
    work = dist.reduce_scatter_single(output, input, op=rop, group=group, async_op=async_op)
    if async_op:
        return FlatWork(work, divide_by, output)
    if divide_by != 1:
        output.div_(divide_by)
    return None


# [Note: avg fallback]
# gloo in torch 2.13 accepts ReduceOp.AVG for reduce_scatter_single, but its rounding
# is the backend's business; SUM then one in-place division gives exactly the
# reference's sum / W, costs one pass over m elements and allocates nothing.


def check_plan_consistent(plan: BufferPlan, process_group: dist.ProcessGroup | None) -> None:
    """Raise ValueError on every rank if the ranks of ``process_group`` hold different plans.

    Gathers each rank's ``(plan fingerprint, plan.world_size)`` with one
    ``all_gather_object`` and compares on every rank, so that a mismatch raises
    everywhere instead of hanging the first collective on a wrongly sized buffer.
    ``process_group=None`` or a single-rank process group: only the plan's world size is checked.
    """
    if not isinstance(plan, BufferPlan):
        raise TypeError(f"plan must be a BufferPlan, got {type(plan).__name__}")
    w = 1 if process_group is None else process_group.size()
    if w == 1:
        if plan.world_size != 1:
            raise ValueError(f"plan is for {plan.world_size} ranks but the process group has 1 rank")
        return
    mine = (plan.fingerprint()[:16], plan.world_size)
    gathered: list[tuple[str, int] | None] = [None] * w
    dist.all_gather_object(gathered, mine, group=process_group)
    if any(g is None for g in gathered):  # pragma: no cover - all_gather_object fills all
        raise AssertionError(f"all_gather_object left holes: {gathered}")
    by_fp = Counter(gathered)
    if len(by_fp) > 1:
        # the most common plan is the reference; ties go to the lowest rank's plan
        ref = max(by_fp, key=lambda g: (by_fp[g], -gathered.index(g)))
        bad = [r for r, g in enumerate(gathered) if g != ref]
        detail = ", ".join(f"rank {r}: {gathered[r][0]} (W={gathered[r][1]})" for r in bad)
        raise ValueError(
            f"BufferPlan differs across the {w} ranks of the process_group: ranks {bad} hold a plan other "
            f"than the one of ranks {[r for r in range(w) if r not in bad]} "
            f"({ref[0]}, W={ref[1]}); {detail}")
    if plan.world_size != w:
        raise ValueError(f"plan is for {plan.world_size} ranks but the process group has {w} ranks")
