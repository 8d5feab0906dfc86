"""Building a BlockOptimizer's step plan, and every cache it is built from.

:class:`StepPlanner` holds the plan of the next step ([Note: step plan] in
_step_plan.py) and what it pins across steps: compute layouts, the owners of whole
tensors ([Note: owners stay]), the spread layouts of requirements with fewer blocks than
ranks ([Note: spread compute blocks]) and the structure last checked ([Note: consistent
steps]). It reads the optimizer only through its declarations (``requirement``,
``cost``, ``state_layout``, ``claim_params`` and the class attributes that size and
shape the plan); the step itself runs in _block_optimizer.py.
"""

from __future__ import annotations

from typing import Any

import torch

from vefsdp_optim.comm import ShardedView, sharded_view
from vefsdp_optim.comm._views import step_grad_view
from vefsdp_optim.sharding import BoxShard, RaggedShard, Requirement

from ._capturable import check_capturable
from ._compute_layouts import balanced_compute, snapped_compute, spread_compute, spreads
from ._debug import check_every_step
from ._fsdp import replaced_by_fully_shard
from ._step_loop import StepEntry, StepItem, check_consistent, make_buckets, pin_owners
from ._step_plan import GroupPlan, StepPlan, group_values, param_key, view_key

__all__ = ["StepPlanner", "check_not_replaced"]


class StepPlanner:
    """The step plan of one optimizer and the caches it is built from."""

    def __init__(self) -> None:
        self.plan: StepPlan | None = None  # None: build at the next step ([Note: step plan])
        self.owner_cache: dict[tuple, tuple[int, ...]] = {}
        # (requirement, storage layout, shape) -> compute layout, None for "whole on an owner"
        self.compute_cache: dict[tuple, RaggedShard | None] = {}
        # id(param) -> (storage layout, owner rank) of its whole-tensor compute ([Note: owners
        # stay])
        self.pinned_owners: dict[int, tuple[RaggedShard | BoxShard, int]] = {}
        # id(param) -> (storage layout, requirement, compute layout, (rank, elements) per
        # block) of a requirement with fewer blocks than ranks ([Note: spread compute blocks])
        self.pinned_spread: dict[int,
                                 tuple[RaggedShard | BoxShard, Requirement, RaggedShard,
                                       tuple]] = {}
        # the step structure last checked; None: check at the next step ([Note: consistent steps])
        self.checked_structure: list[tuple] | None = None

    def drop(self) -> None:
        """Rebuild the step plan, and check consistency, at the next step
        ([Note: step plan], [Note: consistent steps])."""
        self.plan = None
        self.checked_structure = None

    def current(self, opt: Any) -> StepPlan:
        """This step's plan ([Note: step plan]), each group's items holding this step's
        gradients: the last one where nothing it was built from changed, else rebuilt."""
        plan = self.plan
        groups = opt.param_groups
        old = plan.groups if plan is not None else []
        keys = opt.structural_keys + opt.plan_keys
        fresh: list[GroupPlan] = []
        rebuilt = plan is None or len(old) != len(groups)
        for gi, group in enumerate(groups):
            claimed = opt.claim_params(group)
            values = group_values(group, keys)
            gp = old[gi] if gi < len(old) else None
            if gp is None or not gp.refresh(group, claimed, values):
                gp = self.plan_group(opt, group, gi, claimed, values)
                rebuilt = True
            fresh.append(gp)
        sizes = (opt.bucket_numel, opt.min_round_numel)
        if not rebuilt and sizes == plan.sizes:
            if check_every_step():  # [Note: consistent steps]
                check_consistent([e for gp in fresh for e in gp.entries])
            return plan
        items = [it for gp in fresh for it in gp.items]
        structure = [s for gp in fresh for s in gp.structure]
        if structure != self.checked_structure or check_every_step():  # [Note: consistent steps]
            check_consistent([e for gp in fresh for e in gp.entries])
            self.checked_structure = structure
        buckets = make_buckets(items, *sizes)
        moving = [[i for i, it in enumerate(b) if it.moves] for b in buckets]
        self.plan = StepPlan(fresh, items, buckets, moving, sizes)
        return self.plan

    def plan_group(self, opt: Any, group: dict[str, Any], gi: int, claimed: list[Any],
                   values: tuple) -> GroupPlan:
        """The plan of param group ``gi`` ([Note: step plan]): a step item per parameter
        with a gradient; an entry per parameter without a gradient and per sharded
        parameter with one ([Note: consistent steps] compares the sharded ones); and
        what every sharded parameter's exchange depends on except its gradient."""
        items: list[StepItem] = []
        entries: list[StepEntry] = []
        structure: list[tuple] = []
        rows: list[tuple[Any, tuple | None, tuple | None, StepItem | None]] = []
        whole: list[int] = []
        loads: dict[int, list[int]] = {}  # per process group: elements computed per rank
        position = ({id(p): i for i, p in enumerate(group["params"])}
                    if claimed is not group["params"] else None)
        for pi, p in enumerate(claimed):
            pos = (gi, pi if position is None else position[id(p)])
            key = param_key(p)
            if p.grad is None:
                check_not_replaced(p, type(opt).__name__)
                view = sharded_view(p)
                req = opt.requirement(view.shape, group)
                compute = self.spread_or(opt, p, view, req, group, self.compute_layout(req, view),
                                         loads)
                entries.append(StepEntry(pos, tuple(view.shape), view.layout, None,
                                         compute is None or compute != view.layout,
                                         view.process_group, view.local.device))
                if view.process_group is not None:
                    structure.append((pos, id(p), id(view.process_group), view.layout, compute))
                rows.append((p, key, None if key is not None else view_key(view), None))
                continue
            if p.is_meta:
                raise NotImplementedError(
                    f"{type(opt).__name__} cannot step parameters on the meta device (shape "
                    f"{tuple(p.shape)}); materialize them first (module.to_empty(device=...) and "
                    "initialization), then step")
            if p.grad.is_sparse:
                raise NotImplementedError(f"{type(opt).__name__} does not support sparse gradients")
            if p.is_complex():
                raise NotImplementedError(f"{type(opt).__name__} does not support "
                                          "complex parameters")
            view = sharded_view(p)
            gview = step_grad_view(p.grad)
            if gview.layout != view.layout:
                raise ValueError(
                    f"gradient layout {gview.layout} differs from parameter layout "
                    f"{view.layout} for a parameter of shape {tuple(view.shape)}")
            if group.get("capturable") and opt.checks_capturable:
                check_capturable(type(opt).__name__, group, view.local.device)
            req = opt.requirement(view.shape, group)
            compute = self.spread_or(opt, p, view, req, group, self.compute_layout(req, view),
                                     loads)
            if (opt.balance_compute_cuts and compute is not None and compute != view.layout
                    and isinstance(view.layout, RaggedShard)
                    and opt.state_layout(view, group) == view.layout):  # see ``balanced_compute``
                w = view.layout.world_size
                compute = balanced_compute(view.layout, req, view.shape,
                                           loads.setdefault(id(view.process_group), [0] * w))
            may_move = compute is None or compute != view.layout
            if view.process_group is not None:
                structure.append((pos, id(p), id(view.process_group), view.layout, compute))
            if compute is None:
                compute = view.layout  # replaced by the owner layout below
                whole.append(len(items))
            item = StepItem(p, view, gview.local, req, compute, group)
            items.append(item)
            rows.append((p, key, None if key is not None else view_key(view), item))
            if view.process_group is not None:  # check_consistent skips the others
                entries.append(StepEntry(pos, tuple(view.shape), view.layout, compute, may_move,
                                         view.process_group, view.local.device))
        if whole:
            pin_owners([items[i] for i in whole], opt.cost, self.owner_cache, self.pinned_owners)
        return GroupPlan(group, values, rows, items, entries, structure)

    def spread_or(self, opt: Any, p: Any, view: ShardedView, req: Requirement,
                  group: dict[str, Any],
                   compute: RaggedShard | None, loads: dict[Any, list[int]]) -> RaggedShard | None:
        """``compute``, or where ``req`` has fewer blocks than ranks and the state lives
        on the compute layout, the spread layout, pinned ([Note: spread compute blocks]);
        ``loads`` (per process group) counts every such parameter's blocks, in order."""
        layout = view.layout
        if (compute is None or compute is layout or not spreads(layout, req, view.shape)
                or (opt.balance_compute_cuts and opt.state_layout(view, group) == layout)):
            return compute
        load = loads.setdefault(("spread", id(view.process_group)), [0] * layout.world_size)
        kept = self.pinned_spread.get(id(p))
        if kept is not None and kept[0] == layout and kept[1] == req:
            for o, size in kept[3]:
                load[o] += size
            return kept[2]
        # a tensor-parallel box layout: over its even split, as the nearest cuts are
        base = layout.even_split() if isinstance(layout, BoxShard) else layout
        spread, owners = spread_compute(base, req, view.shape, load)
        self.pinned_spread[id(p)] = (layout, req, spread, owners)
        return spread

    def pinned_state_layout(self, opt: Any, p: Any, view: ShardedView,
                            group: dict[str, Any]) -> RaggedShard | BoxShard | None:
        """Where ``p``'s state lives: ``opt.state_layout``,
        with the spread compute layout where that is the compute layout of a requirement
        with fewer blocks than ranks ([Note: spread compute blocks])."""
        layout = opt.state_layout(view, group)
        if layout is None or layout == view.layout:
            return layout
        req = opt.requirement(view.shape, group)
        if not spreads(view.layout, req, view.shape):
            return layout
        kept = self.pinned_spread.get(id(p))
        if kept is None or kept[0] != view.layout or kept[1] != req:
            self.pin_spreads(opt)
            kept = self.pinned_spread.get(id(p))
        if kept is None:
            raise AssertionError("no compute layout pinned for a parameter of shape "
                                 f"{tuple(view.shape)}")
        return kept[2]

    def pin_spreads(self, opt: Any) -> None:
        """Pin the spread layouts of every parameter as a step plan would, in order (a
        checkpoint asks before this optimizer has planned a step). Every parameter of a
        group is walked: ``claim_params`` may update some (it runs in a step only), and
        those it claims need no exchange, so no block requirement they could spread."""
        for group in opt.param_groups:
            loads: dict[Any, list[int]] = {}
            for p in group["params"]:
                view = sharded_view(p)
                req = opt.requirement(view.shape, group)
                self.spread_or(opt, p, view, req, group, self.compute_layout(req, view), loads)

    def compute_layout(self, req: Requirement, view: ShardedView) -> RaggedShard | None:
        """The compute layout for ``req`` ([Note: one step loop]); None: whole on an owner."""
        key = (req, view.layout, view.shape)
        if key in self.compute_cache:
            return self.compute_cache[key]
        if view.layout.satisfies(req, view.shape):
            compute = view.layout
        elif req.needs_whole:
            compute = None
        else:
            compute = snapped_compute(view.layout, req, view.shape)
        if len(self.compute_cache) > 4096:
            self.compute_cache.clear()
        self.compute_cache[key] = compute
        return compute


def check_not_replaced(p: torch.Tensor, name: str) -> None:
    if replaced_by_fully_shard(p):
        raise ValueError(
            f"{name} holds a parameter of shape {tuple(p.shape)} that fully_shard has replaced "
            "with a sharded one, so it would never train; build the optimizer after fully_shard, "
            "from model.parameters()")
