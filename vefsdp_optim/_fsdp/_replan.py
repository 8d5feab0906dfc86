"""The re-plan of one DtypeStore for the optimizers' block units.

A re-plan (the ``FlatStore`` protocol's ``replan``, [Note: flat store contract]) reaches
the store's shard group (``StoreBinding`` in _group.py), which calls two functions of
this file around the lifecycle transition it owns (see ``StoreSettings`` in
vefsdp_optim/_fsdp/_settings.py): :func:`plan_replan` redoes the plan with the new units
when the padding stays acceptable (pure: every rank takes the same decision), and
:func:`move_store` moves the data into the new layout with one all-gather of the old
buffer and re-points the same Parameter objects.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, NamedTuple

import torch

from vefsdp_optim._flat_store import StoreReplan, state_holders_with
from vefsdp_optim.comm import all_gather_flat, same_on_all_ranks
from vefsdp_optim.sharding import BufferPlan, plan_buffer

from ._sharded_tensor import ShardedParameter

if TYPE_CHECKING:
    from ._store import DtypeStore

__all__ = ["ReplanDecision", "plan_replan", "move_store"]


def _acceptable(new: BufferPlan, old: BufferPlan) -> bool:
    """Padding rule: new <= max(1% of the store's numel, old padding + W * align)."""
    return new.padding <= max(new.total_numel // 100, old.padding + old.world_size * old.align)


def _plan_for(store: DtypeStore,
              wanted: dict[str, int]) -> tuple[BufferPlan, dict[str, int], list[tuple[str, int]]]:
    """The plan with as many wanted units as the padding rule allows (largest dropped first)."""
    old = store.plan
    w = store.settings.world_size
    units = {**store.units, **wanted}
    refused: list[tuple[str, int]] = []
    order = sorted(wanted, key=lambda n: (-wanted[n], n))  # deterministic on every rank
    while True:
        plan = plan_buffer(store.specs(units), w, align=old.align)
        if _acceptable(plan, old) or not order:
            if not _acceptable(plan, old):
                raise AssertionError(f"the old units gave an unacceptable plan: {plan.padding} vs "
                                     f"{old.padding}")
            return plan, units, refused
        name = order.pop(0)
        refused.append((name, wanted[name]))
        units[name] = store.units.get(name, 1)


class ReplanDecision(NamedTuple):
    """What :func:`plan_replan` decided: the report, and the plan (with its units) to move
    the store into, None when nothing moves."""

    report: StoreReplan | None
    plan: BufferPlan | None
    units: dict[str, int]


def plan_replan(store: DtypeStore, units: Mapping[torch.Tensor, int],
                holders: Iterable[torch.optim.Optimizer]) -> ReplanDecision:
    """The plan with as many of the wanted ``units`` (by member) as the padding rule
    allows. Pure, so every rank takes the same decision; raises ValueError, before any
    communication, when a member the new plan moves has state in one of ``holders``."""
    names = {id(p.sharded): p.fqn for p in store.params}
    wanted = {}
    for t, u in units.items():
        name = names.get(id(t))
        if name is None:
            raise AssertionError(f"a tensor of shape {tuple(t.shape)} is not a member "
                                 "of this store")
        if u != store.units.get(name, 1):
            wanted[name] = u
    if not wanted:
        return ReplanDecision(None, None, {})
    old = store.plan
    # ``TensorParallel`` in vefsdp_optim/_fsdp/_param.py: the exchange keeps them
    if store.tensor_parallel:
        return ReplanDecision(StoreReplan((), tuple(sorted(wanted.items())), old.padding,
                                          old.padding, replanned=False), None, {})
    plan, new_units, refused = _plan_for(store, wanted)
    if plan.fingerprint() == old.fingerprint():
        report = (StoreReplan((), tuple(refused), old.padding, old.padding, replanned=False)
                  if refused else None)
        return ReplanDecision(report, None, {})
    moved = [p for p in store.params if plan.layout(p.fqn) != old.layout(p.fqn)
             or plan.offsets[p.fqn] != old.offsets[p.fqn]]
    busy = state_holders_with(holders, [p.sharded for p in moved])
    if busy:
        raise ValueError(
            f"re-planning would move parameters {[p.fqn for p in moved][:8]} whose optimizer state "
            f"already exists in {busy}; that state would no longer match. Build every optimizer "
            "of a fully_shard model before the first step (each re-plans once, at construction)")
    return ReplanDecision(StoreReplan(tuple(p.fqn for p in moved), tuple(refused), old.padding,
                                      plan.padding),
                          plan, new_units)


def move_store(store: DtypeStore, units: dict[str, int], plan: BufferPlan) -> None:
    """Gather the old master buffer (and gradients) once; rebuild the store's buffers on
    ``plan``. Collective over the store's process group; the store must be resharded,
    with no unreduced gradients (its shard group sees to it)."""
    old = store.master
    w = store.settings.world_size
    has_grad = [p.sharded.grad is not None for p in store.params]
    if w > 1:
        old.all_gather()
        _check_same_grads(has_grad, store.settings.process_group, old.device)
    data = {p.fqn: old.full_view(p.fqn) for p in store.params}
    grads = _gather_grads(store, has_grad) if any(has_grad) else {}
    store.build(units, data, validate=True, plan=plan)
    if w > 1:
        old.free_global()
    new = store.master
    if grads:
        # its storage (see ``StoreGrads.release_grads`` in vefsdp_optim/_fsdp/_grads.py)
        store.grad_shard()
    for p in store.params:
        full = grads.get(p.fqn)
        if full is None:
            continue
        a, n = new.local_extent(p.fqn)
        view = new.local_grad_view(p.fqn)
        with torch.no_grad():
            view.copy_(full[a:a + n])
        p.sharded.grad = p.sharded.with_local(view)


def _check_same_grads(has_grad: list[bool], process_group: torch.distributed.ProcessGroup,
                      device: torch.device) -> None:
    """Raise ValueError on every rank unless all ranks hold the same gradients: one
    ``same_on_all_ranks`` on the store's device (a CPU tensor has no backend on NCCL),
    ``same_on_all_ranks`` in comm/_collectives.py; the flags are gathered only to say
    who differs."""
    key = "".join("1" if h else "0" for h in has_grad)
    if same_on_all_ranks(key, process_group, device):
        return
    mine = torch.tensor(has_grad, dtype=torch.uint8, device=device)
    every = mine.new_empty(process_group.size() * mine.numel())
    all_gather_flat(every, mine, process_group)
    rows = every.view(process_group.size(), -1).tolist()
    bad = [r for r, row in enumerate(rows) if row != rows[0]]
    raise ValueError(
        f"request_requirements: ranks disagree on which parameters have a .grad: rank 0 has "
        f"{rows[0]}, " + ", ".join(f"rank {r} {rows[r]}" for r in bad[:8])
        + (f" and {len(bad) - 8} more ranks differ" if len(bad) > 8 else "")
        + "; zero (or keep) gradients on every rank alike")


def _gather_grads(store: DtypeStore, has_grad: list[bool]) -> dict[str, torch.Tensor]:
    """The whole (reduced) gradient of each parameter that has one, flat, by name."""
    old = store.master
    flat = torch.zeros_like(old.local_grad)  # 1-D, m: the old layout, grads not in the buffer too
    for p, h in zip(store.params, has_grad, strict=True):
        if h:
            view = old.local_grad_view(p.fqn)
            local = (p.sharded.grad.to_local() if isinstance(p.sharded.grad, ShardedParameter)
                     else None)
            if local is None or local.numel() != view.numel():
                raise AssertionError(f"{p.fqn}: .grad is not a ShardedParameter of the "
                                     "parameter's layout")
            a = view.storage_offset() - old.local_grad.storage_offset()
            flat[a:a + view.numel()] = local
    w = store.settings.world_size
    if w > 1:
        full = flat.new_empty(w * flat.numel())  # 1-D, W * m
        all_gather_flat(full, flat, store.settings.process_group)
    else:
        full = flat
    return {p.fqn: full[old.plan.offsets[p.fqn]:old.plan.offsets[p.fqn] + math.prod(p.shape)]
            for p, h in zip(store.params, has_grad, strict=True) if h}
