"""request_requirements: re-plan fully_shard groups for the optimizers' block units.

The optimizer base calls this once at construction with each parameter's requirement.
For every group holding one of the parameters, the plan is redone with the new units
when the padding stays acceptable, the data moves into the new layout with one
all-gather of the old buffer, and the same Parameter objects are re-pointed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vefsdp_optim.comm import all_gather_flat
from vefsdp_optim.sharding import GroupPlan, Requirement, plan_group

from ._group import ALIGN, Bucket
from ._sharded_tensor import ShardedParameter

__all__ = ["ReplanReport", "request_requirements"]


@dataclass(frozen=True, slots=True)
class ReplanReport:
    """What ``request_requirements`` changed.

    ``changed``: parameters (by name within their group) whose layout moved.
    ``kept``: ``(name, unit)`` requirements not applied because the padding rule refused
    them; their old unit stays. ``padding_before``/``padding_after``: total padding
    (elements) of the re-planned groups. ``groups``: how many buckets were re-planned.
    """

    changed: tuple[str, ...]
    kept: tuple[tuple[str, int], ...]
    padding_before: int
    padding_after: int
    groups: int

    def __post_init__(self) -> None:
        if self.padding_before < 0 or self.padding_after < 0 or self.groups < 0:
            raise ValueError(f"ReplanReport counts must be >= 0, got {self}")


def _acceptable(new: GroupPlan, old: GroupPlan) -> bool:
    """Padding rule: new <= max(1% of the group's numel, old padding + W * align)."""
    return new.padding <= max(new.total_numel // 100, old.padding + old.world_size * old.align)


def _plan_for(bucket: Bucket, wanted: dict[str, int]) -> tuple[GroupPlan, dict[str, int], list[tuple[str, int]]]:
    """The plan with as many wanted units as the padding rule allows (largest dropped first)."""
    old = bucket.plan
    w = bucket._group.shard_world
    units = {**bucket.units, **wanted}
    refused: list[tuple[str, int]] = []
    order = sorted(wanted, key=lambda n: (-wanted[n], n))  # deterministic on every rank
    while True:
        plan = plan_group(bucket.specs(units), w, align=ALIGN)
        if _acceptable(plan, old) or not order:
            if not _acceptable(plan, old):
                raise AssertionError(f"the old units gave an unacceptable plan: {plan.padding} vs {old.padding}")
            return plan, units, refused
        name = order.pop(0)
        refused.append((name, wanted[name]))
        units[name] = bucket.units.get(name, 1)


def request_requirements(mapping: dict[torch.Tensor, Requirement]) -> ReplanReport:
    """Re-plan the groups of the ShardedParameters in ``mapping`` for their requirements.

    Collective: every rank of each affected group must call it with the same mapping
    (same order). Tensors that fully_shard does not manage are ignored. Reduced
    gradients (``.grad``) move to the new layout with their parameters; calling it
    while a ``set_requires_gradient_sync(False)`` accumulation holds unreduced
    gradients raises RuntimeError. Optimizer state is not moved: call it before any exists.
    """
    if not isinstance(mapping, dict):
        raise TypeError(f"mapping must be a dict[Tensor, Requirement], got {type(mapping).__name__}")
    per_bucket: dict[int, tuple[Bucket, dict[str, int]]] = {}
    for t, req in mapping.items():
        if not isinstance(req, Requirement):
            raise TypeError(f"requirement must be a Requirement, got {type(req).__name__} for {tuple(t.shape)}")
        bucket = getattr(t, "_vefsdp_bucket", None) if isinstance(t, ShardedParameter) else None
        if bucket is None:
            continue
        name = next(p.fqn for p in bucket.params if p.sharded is t)
        per_bucket.setdefault(id(bucket), (bucket, {}))[1][name] = req.unit(tuple(t.shape) or (1,))
    changed: list[str] = []
    kept: list[tuple[str, int]] = []
    before = after = groups = 0
    for bucket, wanted in per_bucket.values():
        wanted = {n: u for n, u in wanted.items() if u != bucket.units.get(n, 1)}
        if not wanted:
            continue
        old = bucket.plan
        plan, units, refused = _plan_for(bucket, wanted)
        kept.extend(refused)
        if plan.fingerprint() == old.fingerprint():
            continue
        groups += 1
        before += old.padding
        after += plan.padding
        changed.extend(p.fqn for p in bucket.params if plan.layout(p.fqn) != old.layout(p.fqn)
                       or plan.offsets[p.fqn] != old.offsets[p.fqn])
        _move(bucket, units, plan)
    return ReplanReport(tuple(changed), tuple(kept), before, after, groups)


def _move(bucket: Bucket, units: dict[str, int], plan: GroupPlan) -> None:
    """Gather the old master buffer (and gradients) once; rebuild the buckets on ``plan``."""
    g = bucket._group
    if g._grads_live:
        raise RuntimeError(
            "request_requirements during a gradient accumulation without sync (unreduced "
            "gradients in the buffer); build the optimizer before that backward, or after "
            "a synced one")
    old = bucket.master
    w = g.shard_world
    has_grad = [p.sharded.grad is not None for p in bucket.params]
    if w > 1:
        old.all_gather()
        _check_same_grads(has_grad, g.shard_pg)
    data = {p.fqn: old.full_view(p.fqn) for p in bucket.params}
    grads = _gather_grads(bucket, has_grad) if any(has_grad) else {}
    bucket.build(units, data, validate=True, plan=plan)
    if w > 1:
        old.free_global()
    new = bucket.master
    for p in bucket.params:
        full = grads.get(p.fqn)
        if full is None:
            continue
        a, n = new.local_extent(p.fqn)
        view = new.local_grad_view(p.fqn)
        with torch.no_grad():
            view.copy_(full[a:a + n])
        sp = p.sharded
        sp.grad = ShardedParameter(view, sp._layout, sp._group, p.shape, sp._rank)


def _check_same_grads(has_grad: list[bool], pg: torch.distributed.ProcessGroup) -> None:
    mine = torch.tensor(has_grad, dtype=torch.uint8)
    allg = mine.new_empty(pg.size() * mine.numel())
    all_gather_flat(allg, mine, pg)
    rows = allg.view(pg.size(), -1)
    if not bool((rows == rows[0]).all()):
        raise ValueError(
            f"request_requirements: ranks disagree on which parameters have a .grad "
            f"({rows.tolist()}); zero (or keep) gradients on every rank alike")


def _gather_grads(bucket: Bucket, has_grad: list[bool]) -> dict[str, torch.Tensor]:
    """The whole (reduced) gradient of each parameter that has one, flat, by name."""
    old = bucket.master
    flat = torch.zeros_like(old.local_grad)  # 1-D, m: the old layout, grads not in the buffer too
    for p, h in zip(bucket.params, has_grad, strict=True):
        if h:
            view = old.local_grad_view(p.fqn)
            local = p.sharded.grad.to_local() if isinstance(p.sharded.grad, ShardedParameter) else None
            if local is None or local.numel() != view.numel():
                raise AssertionError(f"{p.fqn}: .grad is not a ShardedParameter of the parameter's layout")
            a = view.storage_offset() - old.local_grad.storage_offset()
            flat[a:a + view.numel()] = local
    w = bucket._group.shard_world
    if w > 1:
        full = flat.new_empty(w * flat.numel())  # 1-D, W * m
        all_gather_flat(full, flat, bucket._group.shard_pg)
    else:
        full = flat
    return {p.fqn: full[old.plan.offsets[p.fqn]:old.plan.offsets[p.fqn] + math.prod(p.shape)]
            for p, h in zip(bucket.params, has_grad, strict=True) if h}
