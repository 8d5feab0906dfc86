"""The step plan: what a step derives from its parameters' layouts, built once and reused
([Note: step plan])."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from vefsdp_optim._torch_compat import address, dtensor_local, dtensor_spec, storage_id
from vefsdp_optim.comm import ShardedView, sharded_view
from vefsdp_optim.comm._views import step_grad_view

from ._fsdp import ShardedParameter, replaced_by_fully_shard
from ._step_loop import StepEntry, StepItem

__all__ = ["GroupPlan", "StepPlan", "group_values", "identity", "param_key", "same_identity",
           "view_key"]

_TENSOR = torch.Tensor

# [Note: step plan]
# A step derives from each parameter its view, requirement and compute layout. From the
# parameters with gradients it derives its step items, owners ([Note: owners stay]),
# consistency entries ([Note: consistent steps]), exchange buckets and the items each
# bucket moves (``make_buckets`` in _step_loop.py). All of it is a function of host
# facts that a steady-state training loop does not change. So it is built at the first
# step and reused. A step then reads, per parameter, only its key and its gradient.
# A GroupPlan is rebuilt when any of its inputs differs from what it was built from:
#   - the param group, by identity, or a value of its plan keys. These are
#     structural_keys and plan_keys, what requirement() and cost() read.
#   - the parameters claim_params() leaves to the loop, by identity and order;
#   - per parameter, which of them have a gradient;
#   - per plain tensor, its data_ptr, shape and contiguity. A `.data` swap or a new
#     storage changes them. The plan's view keeps the old storage alive, so a new one
#     cannot reuse its address.
#   - per other kind, DTensor or fully_shard, its view's storage, offset, layout,
#     process group and shape, from a fresh view each step. ``identity`` skips that
#     fresh view where the parameter's objects are unchanged.
# replan(), add_param_group() and load_state_dict() drop the plan whole. A gradient is
# read afresh every step and must match its parameter's layout, or the rebuild raises
# the same error as a first step. The items let go of their gradients when the step
# ends, so the plan keeps no gradient alive between steps. After zero_grad() the last
# step's gradients are freed, as with torch.optim. No key reads a device value, so a
# step stays free of host syncs.


_DT, _SP = 0, 1  # identity kinds


def identity(t: Any) -> tuple | None:
    """The identity of a DTensor or a ShardedParameter; None for other kinds (subclasses
    included: they may view themselves otherwise).

    A DTensor's or a ShardedParameter's view is a pure function of a few objects: its
    local tensor (with that tensor's address, shape and dtype) and its DTensorSpec (mesh,
    placements, shape) or its layout, process group and rank. The plan keeps those objects
    (the objects, not their ids: an id is never reused while the plan holds it) and a step
    compares them by identity, much cheaper than a fresh view and its key (figures in
    docs/decisions.md; two per parameter: the parameter's and its gradient's). Where any
    differs, the step takes the fresh view and its key as before and, where the key still
    matches, keeps the new identity. A gradient likewise skips its fresh view when it is a
    DTensor on the spec object of the last gradient accepted for its parameter (FSDP2
    builds all gradients of a parameter on one spec object) with its parameter's local
    shape, contiguous and outside autograd, or a ShardedParameter on its parameter's
    layout, process group and rank (fully_shard's gradients): exactly the cases where the
    fresh view would give the same layout and a local tensor of the same elements."""
    kind = type(t)
    if kind is ShardedParameter:
        local = t._local
        return (_SP, local, address(local), local.shape, local.dtype, t._layout, t._process_group,
                t._rank)
    if kind is DTensor:
        local = dtensor_local(t)
        return (_DT, local, address(local), local.shape, local.dtype, dtensor_spec(t))
    return None


def same_identity(t: Any, ident: tuple) -> bool:
    """Whether ``t`` (the object ``ident`` was taken from) still has identity ``ident``."""
    local = ident[1]
    if ident[0] == _SP:
        if (t._local is not local or t._layout is not ident[5] or t._process_group is not ident[6]
                or t._rank != ident[7]):
            return False
    elif dtensor_local(t) is not local or dtensor_spec(t) is not ident[5]:
        return False
    return (address(local) == ident[2] and local.shape == ident[3] and local.dtype is ident[4]
            and local.is_contiguous())


def param_key(p: Any) -> tuple | None:
    """A plain tensor's plan key ([Note: step plan]); None for other kinds (and for a
    tensor without a data pointer: empty, fake or meta), which are keyed by their view."""
    kind = type(p)
    if kind is nn.Parameter or kind is torch.Tensor:
        ptr = p.data_ptr()
        if ptr:
            return ptr, p.shape
    return None


def view_key(view: ShardedView) -> tuple:
    """The plan key of a view: its storage, offset, layout, process group and shape."""
    local = view.local
    return (storage_id(local), local.storage_offset(), local.dtype, view.layout,
            id(view.process_group), view.shape)


def group_values(group: dict[str, Any], keys: tuple[str, ...]) -> tuple:
    """The values of ``group``'s plan keys (lists as tuples, so an edit in place shows)."""
    return tuple(tuple(v) if isinstance(v, list) else v for v in map(group.get, keys))


@dataclass(slots=True)
class GroupPlan:
    """The step plan of one param group ([Note: step plan])."""

    group: dict[str, Any]
    values: tuple  # group_values() at build
    # per claimed parameter, in order: (the parameter, its param_key() or None, its
    # view_key() where that is None, its item or None without a gradient)
    rows: list[tuple[Any, tuple | None, tuple | None, StepItem | None]]
    items: list[StepItem]  # the items, in parameter order
    entries: list[StepEntry]  # [Note: consistent steps]
    structure: list[tuple]  # [Note: consistent steps]
    # per row: identity() of a DTensor or ShardedParameter, else None; and the spec of the
    # last DTensor gradient accepted (see ``identity``)
    idents: list[tuple | None] = field(init=False)
    grad_specs: list[Any] = field(init=False)

    def __post_init__(self) -> None:
        self.idents = [identity(p) if key is None else None for p, key, _, _ in self.rows]
        self.grad_specs = [None] * len(self.rows)

    def refresh(self, group: dict[str, Any], claimed: list[Any], values: tuple) -> bool:
        """Give each item this step's gradient; False (items unusable) where any input of
        the plan changed."""
        if group is not self.group or values != self.values or len(claimed) != len(self.rows):
            return False
        idents, grad_specs = self.idents, self.grad_specs
        for i, (p, (q, key, vkey, item)) in enumerate(zip(claimed, self.rows, strict=True)):
            if p is not q:
                return False
            g = p.grad
            if key is not None:  # a plain tensor: the common case first
                ptr, shape = key
                if p.data_ptr() != ptr or p.shape != shape or not p.is_contiguous():
                    return False
                if (item is not None and type(g) is _TENSOR and g.shape == shape
                        and g.is_contiguous()):
                    # a view: contiguous (sparse is not)
                    item.grad = g if len(shape) == 1 else g.ravel()
                    continue
            elif (ident := idents[i]) is not None and same_identity(p, ident):
                if item is not None and g is not None:  # ``identity``
                    if ident[0] == _SP:
                        if (type(g) is ShardedParameter and g._layout is ident[5]
                                and g._process_group is ident[6] and g._rank == ident[7]):
                            gl = g._local
                            item.grad = gl.detach() if gl.requires_grad else gl
                            continue
                    elif type(g) is DTensor and dtensor_spec(g) is grad_specs[i]:
                        gl = dtensor_local(g)
                        if gl.shape == ident[3] and not gl.requires_grad and gl.is_contiguous():
                            item.grad = gl if gl.dim() == 1 else gl.view(-1)
                            continue
            elif view_key(sharded_view(p)) != vkey:
                return False
            else:
                idents[i] = identity(p)
            if item is None:
                if g is not None:
                    return False
                if replaced_by_fully_shard(p):
                    return False  # the rebuild raises
                continue
            if g is None or g.is_sparse:
                return False  # the rebuild raises on a sparse gradient
            gview = step_grad_view(g)
            if gview.layout is not item.view.layout and gview.layout != item.view.layout:
                return False  # the rebuild raises
            item.grad = gview.local
            if type(g) is DTensor:
                grad_specs[i] = dtensor_spec(g)
        return True


@dataclass(slots=True)
class StepPlan:
    """The step plan of the whole optimizer: its group plans and buckets."""

    groups: list[GroupPlan]
    items: list[StepItem]  # every group's, in order
    buckets: list[list[StepItem]]
    moving: list[list[int]]  # per bucket: the indices of its items that move
    sizes: tuple[int, int]  # (bucket_numel, min_round_numel) at build
    validated: bool = False  # every item's state has been validated
    # per bucket: its exchanges' routes, by direction and tensors (exchange()'s cache)
    routes: list[dict[tuple, list]] = field(init=False)

    def __post_init__(self) -> None:
        self.routes = [{} for _ in self.buckets]
