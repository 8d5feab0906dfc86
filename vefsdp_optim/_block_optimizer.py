"""One step loop for block-structured optimizers (see [Note: one step loop])."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import Optimizer

from vefsdp_optim.comm import ShardedView, sharded_view
from vefsdp_optim.comm._views import step_grad_view
from vefsdp_optim.sharding import BoxShard, RaggedShard, Requirement

from ._checkpoint import export_state, load_state, validate_state
from ._debug import check_every_step
from ._flat_store import ReplanReport, apply_requirements, flat_store
from ._flattened import check_not_flattened
from ._fsdp import replaced_by_fully_shard
from ._step_loop import (
    BlockContext,
    PendingExchange,
    StepEntry,
    StepItem,
    aligned,
    balanced_compute,
    check_consistent,
    exchange,
    gc_paused,
    make_buckets,
    pin_owners,
    snapped_compute,
    spread_compute,
    spreads,
)
from ._step_plan import GroupPlan, StepPlan, group_values, param_key, view_key
from ._torch_compat import capturable_devices, tree_flatten

__all__ = ["BlockOptimizer", "BlockContext"]

# [Note: one step loop]
# Every parameter is reduced to a ShardedView: this rank's 1-D slice of the flat
# parameter, its RaggedShard layout and the shard process group. Plain tensors, FSDP2
# DTensors and the library's own sharded parameters all look the same from here.
# Each optimizer declares a Requirement per parameter. The compute layout is
#   - the storage layout itself when it already satisfies the requirement (no comm);
#   - the storage layout with each boundary snapped to the nearest legal cut
#     (only pieces at boundaries move) for block and band requirements;
#   - "whole on an owner" for WholeTensor, owners balanced by cost (LPT).
# A step walks exchange buckets of parameters (same param group, process group, dtype,
# device; so every override sees one param group per bucket; whole tensors in balanced
# owner rounds, [Note: owner rounds] in _step_loop.py): it gathers the inputs of every
# moving parameter of the bucket in ONE all_to_all (launched before the previous
# bucket's compute, so they overlap), computes on whole blocks, and sends the results
# back in one more (waited for after the next bucket's compute). The loop is written
# once, here; a subclass supplies only what differs, through the override points in
# BlockOptimizer's table: always requirement, init_state and update_block (the state
# lives with the blocks: the default data flow moves (param, grad), runs update_block
# on each whole block and copies the param back); optionally the three data-flow
# overrides gather_inputs / compute_bucket / apply_results, where the data that move
# are not (param, grad): Muon keeps its momentum sharded and moves one tensor.


class BlockOptimizer(Optimizer):
    """Base class of the library's optimizers: a ``torch.optim.Optimizer`` whose step
    works on whole blocks of sharded parameters (plain, FSDP2 or fully_shard).

    The result is the same at every world size as on a single device, because each
    update only ever sees whole blocks ([Note: one step loop]). Register the class with
    :func:`vefsdp_optim.register_optimizer` to name it by string. Override points (a
    subclass writes the first three; the others have defaults that fit most):

    ============================================  ==========================================
    every optimizer
    ``requirement(shape, group) -> Requirement``  the blocks the update needs whole
    ``init_state(p, ctx, group) -> dict``         state tensors of a compute slice
    ``update_block(p, g, state, ctx, group)``     update the 1-D slice ``p`` in place from
                                                  ``g``: whole units from flat offset
                                                  ``ctx.start``
    planning
    ``cost(shape, group) -> float``               weight of a whole tensor, to balance
                                                  owners (default: numel)
    ``plan_keys``                                 group keys requirement() / cost() read
    ``claim_params(group) -> list``               update some params outside the loop
                                                  (AdamW's fused stores); return the rest
    ``bucket_numel``, ``min_round_numel``         exchange bucket and owner round sizes
    data flow (default: (param, grad) in, param back)
    ``gather_inputs(item) -> list``               the local tensors the compute needs
    ``compute_bucket(items, inputs) -> list``     results of a bucket (fused across params)
    ``apply_results(item, outputs)``              results -> parameter (and state)
    ``state_layout(view, group)``                 where the state lives (default: with the
                                                  compute slices)
    checkpoints ([Note: world-size-free optimizer state])
    ``checkpoint_spec(shape, group) -> dict``     each state key's kind
    ``structural_keys``                           group keys a checkpoint must agree on
    ``extra_state_prefixes``,                     state outside checkpoint_spec (Shampoo's
    ``export_extra_state``,                       preconditioners, NorMuon's variances),
    ``import_extra_state``                        saved world-size free
    ============================================  ==========================================
    """

    #: elements per bucket of parameters exchanged together
    bucket_numel: int = 1 << 26
    #: fewest elements per round of whole tensors sent to owners ([Note: owner rounds]);
    #: 0 keeps them in the buckets above
    min_round_numel: int = 1 << 20
    #: ``capturable=True`` on a device CUDA graphs cannot capture: our ValueError when the
    #: step is planned; False leaves the error to torch at the first step (AdamW, as
    #: torch.optim.AdamW raises it)
    checks_capturable: bool = True
    #: True where the optimizer keeps no state on the compute layout of a block
    #: requirement its storage cuts (where state_layout() is the storage), so that its
    #: cuts may differ between plans: they then balance the ranks' shares ([Note: balanced
    #: compute cuts]); False keeps the nearest cuts, a function of the parameter alone
    balance_compute_cuts: bool = False

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any]) -> None:
        super().__init__(params, defaults)
        self._owner_cache: dict[tuple, tuple[int, ...]] = {}
        self._validated: set[int] = set()  # ids of parameters whose state validate_state passed
        # (requirement, storage layout, shape) -> compute layout, None for "whole on an owner"
        self._compute_cache: dict[tuple, RaggedShard | None] = {}
        # id(param) -> (storage layout, owner rank) of its whole-tensor compute ([Note: owners stay])
        self._pinned_owners: dict[int, tuple[RaggedShard | BoxShard, int]] = {}
        # id(param) -> (storage layout, requirement, compute layout, (rank, elements) per
        # block) of a requirement with fewer blocks than ranks ([Note: spread compute blocks])
        self._pinned_spread: dict[int, tuple[RaggedShard | BoxShard, Requirement, RaggedShard, tuple]] = {}
        # the step structure last checked; None: check at the next step ([Note: consistent steps])
        self._checked_structure: list[tuple] | None = None
        self._step_plan: StepPlan | None = None  # None: build at the next step ([Note: step plan])
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                _check_not_replaced(p, type(self).__name__)
                try:  # raises for unsupported kinds and placements, before any collective
                    view = sharded_view(p)
                except ValueError as e:
                    names = group.get("param_names")
                    who = repr(names[pi]) if names else f"{pi} (shape {tuple(p.shape)})"
                    raise ValueError(f"{type(self).__name__}: param group {gi} parameter {who}: {e}") from None
                self.requirement(view.shape, group)  # validates the shape too
        #: what the re-plan at construction changed ([Note: requirements flow in])
        self.replan_report: ReplanReport = self.replan()

    def replan(self) -> ReplanReport:
        """Re-plan the fully_shard groups of this optimizer's parameters so that the blocks
        each parameter's requirement names are whole on single ranks.

        [Note: requirements flow in] The constructor calls it once; call it again after
        ``add_param_group``. What the padding rule refuses stays exact, through the
        exchange of the step loop (the report's ``kept``). Collective over the process
        group of every re-planned store ([Note: flat store contract]); FSDP2 and plain
        parameters need none and are left alone. Raises ValueError, before any
        communication, if a parameter that would move already has optimizer state
        (in this or another optimizer): build the optimizers before the first step.
        """
        wanted = {p: self.requirement(sharded_view(p).shape, group)
                  for group in self.param_groups for p in group["params"] if flat_store(p) is not None}
        self._drop_plan()  # [Note: step plan], [Note: consistent steps]
        return apply_requirements(wanted, holder=self) if wanted else ReplanReport()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        try:  # before any state or collective ([Note: flattened parameters])
            check_not_flattened(self, self.param_groups[-1], len(self.param_groups) - 1)
        except ValueError:
            self.param_groups.pop()
            raise
        self._drop_plan()  # [Note: step plan], [Note: consistent steps]

    # -- subclass API ---------------------------------------------------------------

    def requirement(self, shape: torch.Size, group: dict[str, Any]) -> Requirement:
        raise NotImplementedError(f"{type(self).__name__} must define requirement(shape, group)")

    def init_state(self, p: torch.Tensor, ctx: BlockContext, group: dict[str, Any]) -> dict[str, Any]:
        return {}

    def update_block(
        self, p: torch.Tensor, g: torch.Tensor, state: dict[str, Any], ctx: BlockContext,
        group: dict[str, Any],
    ) -> None:
        raise NotImplementedError(f"{type(self).__name__} must define update_block(...)")

    def updates_elementwise(self, group: dict[str, Any]) -> bool:
        """Whether ``group``'s update is element by element whatever a parameter's shape,
        so that a 1-D slice of a flattened parameter (FSDP1's) gets one device's update:
        only then are such parameters accepted ([Note: flattened parameters])."""
        return False

    def cost(self, shape: torch.Size, group: dict[str, Any]) -> float:
        """Relative compute cost of a whole-tensor update in param group ``group``, for
        owner balancing ([Note: owner assignment] in comm/_owners.py)."""
        return float(math.prod(shape))

    # -- checkpoint API (see [Note: world-size-free optimizer state]) ------------------

    #: param-group keys that shape the state; a checkpoint must agree on them to load
    structural_keys: tuple[str, ...] = ()
    #: further param-group keys that requirement() or cost() reads: a change of one (or of
    #: a structural key) rebuilds the step plan ([Note: step plan])
    plan_keys: tuple[str, ...] = ()
    #: prefixes of state keys handled by export/import_extra_state
    extra_state_prefixes: tuple[str, ...] = ()
    #: state keys of 0-d step counts: after a load each goes where its group's (loaded)
    #: flags keep it (``step_counts_on_device``): the parameter's device or the host, as
    #: torch.optim's load_state_dict places ``step`` ([Note: capturable steps])
    step_count_keys: tuple[str, ...] = ()

    def step_counts_on_device(self, group: dict[str, Any]) -> bool:
        """Whether ``group``'s step counts live on its parameters' device (``capturable``)
        or on the host."""
        return bool(group.get("capturable", False))

    def checkpoint_spec(self, shape: torch.Size, group: dict[str, Any]) -> dict[str, str | int] | None:
        """The declaration of a parameter's state: ``{key: kind}`` for every state entry of
        a parameter of global ``shape``, kinds ``REPLICATED`` (the same on every rank:
        step counts), ``ELEMENTWISE`` (one value per element), an int ``k`` (one value
        per block of ``k`` elements), ``WHOLE`` (any shape; the state of a whole-tensor
        requirement, kept by its owner) or ``LOCAL`` (not saved). Save, load and
        resharding across world sizes follow from it, and the first step checks the
        live state against it. None (the default) is for optimizers whose state is only
        scalars: torch's own state_dict format."""
        return None

    def state_layout(self, view: ShardedView, group: dict[str, Any]) -> RaggedShard | None:
        """The layout of a parameter's state: its compute layout ([Note: one step loop]),
        or None for the state of a whole-tensor requirement, which lives whole on the
        rank that computes the tensor ([Note: world-size-free optimizer state]).
        Optimizers that keep such state sharded instead (Muon's momentum) override this."""
        req = self.requirement(view.shape, group)
        if view.layout.satisfies(req, view.shape):
            return view.layout
        if req.needs_whole:
            return None
        return snapped_compute(view.layout, req, view.shape)

    def export_extra_state(self, state: dict[str, Any], view: ShardedView, layout: RaggedShard,
                           group: dict[str, Any]) -> dict[str, Any]:
        """State entries not in checkpoint_spec, keyed world-size free (default: none)."""
        return {}

    def import_extra_state(self, state: dict[str, Any], saved: dict[str, Any], view: ShardedView,
                           layout: RaggedShard, group: dict[str, Any], name: object) -> None:
        """Fill the live entries not in checkpoint_spec from ``saved`` (default: none)."""

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state dict, with world-size-free state (see
        [Note: world-size-free optimizer state]); savable with DCP at any world size and
        with ``torch.save`` at W = 1."""
        sd = super().state_dict()
        if type(self).checkpoint_spec is BlockOptimizer.checkpoint_spec:
            return sd
        return export_state(self, sd)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict` written at any world size (after
        ``dcp.load``), from ``torch.load`` of one, or with plain full tensors. Existing
        state tensors are written in place. Raises ValueError naming what differs."""
        if type(self).checkpoint_spec is BlockOptimizer.checkpoint_spec:
            super().load_state_dict(state_dict)
        else:
            load_state(self, state_dict)
            self._place_step_counts()
        self._drop_plan()  # [Note: step plan], [Note: consistent steps]

    # -- what the checkpoint format asks (its CheckpointedOptimizer) ----------------------

    def materialize_state(self, params: Iterable[torch.Tensor]) -> None:
        """Create the state of ``params``: one step with lr 0 and zero gradients for them
        (as DCP's _init_optim_state), none for the others, every parameter and gradient
        restored after ([Note: state created alike on every rank])."""
        create = {id(p) for p in params}
        saved = []  # (param, its gradient, and for the stepped ones their local data and a copy)
        for g in self.param_groups:
            for p in g["params"]:
                if id(p) in create:
                    local = sharded_view(p).local
                    saved.append((p, p.grad, local, local.clone()))
                    p.grad = torch.zeros_like(p)
                else:  # not stepped: only its gradient is set aside
                    saved.append((p, p.grad, None, None))
                    p.grad = None
        lrs = [g["lr"] for g in self.param_groups]
        for g in self.param_groups:
            # (a Tensor lr keeps its device: a capturable group needs it on the parameters')
            g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
        try:
            self.step()
        finally:
            for g, lr in zip(self.param_groups, lrs, strict=True):
                g["lr"] = lr
            for p, grad, local, copy in saved:
                if local is not None:
                    local.copy_(copy)
                p.grad = grad

    def forget_state(self, p: torch.Tensor) -> None:
        """Empty ``p``'s state; its next step validates the new one."""
        self.state[p] = {}
        self._validated.discard(id(p))

    def pin_owner(self, p: torch.Tensor, layout: RaggedShard | BoxShard, rank: int) -> None:
        """``rank`` computes ``p``'s whole tensor while its storage layout is ``layout``
        ([Note: owners stay])."""
        self._pinned_owners[id(p)] = (layout, rank)

    def _place_step_counts(self) -> None:
        """Each ``step_count_keys`` entry where its group's flags keep it: the load made it
        in the form of the flags before the saved groups' keys were loaded (torch.optim's
        load uses the saved ones). Unlike torch's, a step count loaded into a group that
        keeps it on the host goes there (torch leaves a saved device count on the device,
        and every step then reads it back)."""
        if not self.step_count_keys:
            return
        host = torch.device("cpu")
        for group in self.param_groups:
            on_device = self.step_counts_on_device(group)
            for p in group["params"]:
                state = self.state.get(p)
                if not state:
                    continue
                device = sharded_view(p).local.device if on_device else host
                for key in self.step_count_keys:
                    v = state.get(key)
                    if isinstance(v, torch.Tensor) and v.device != device:
                        state[key] = v.to(device)

    # -- data flow (defaults: state lives with the blocks) ----------------------------

    def gather_inputs(self, item: StepItem) -> list[torch.Tensor]:
        return [item.view.local, item.grad]

    def _compute_block(self, item: StepItem, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        p, g = inputs
        if p.numel():
            g = aligned(g)  # [Note: aligned gradients]
            ctx = item.ctx(item.compute)
            state = self._block_state(item, p, ctx)
            self.update_block(p, g, state, ctx, item.group)
        return [p]

    def apply_results(self, item: StepItem, outputs: list[torch.Tensor]) -> None:
        (p,) = outputs
        if p is not item.view.local and p.numel():
            item.view.local.copy_(p)

    def compute_bucket(self, items: list[StepItem], inputs: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """The results of a bucket (one param group): by default update_block on each
        parameter's whole blocks; override to fuse across parameters (AdamW) or to move
        other data than (param, grad) (Muon)."""
        return [self._compute_block(it, ins) for it, ins in zip(items, inputs, strict=True)]

    def _block_state(self, item: StepItem, p: torch.Tensor, ctx: BlockContext) -> dict[str, Any]:
        state = self.state[item.param]
        if not state:
            state.update(self.init_state(p, ctx, item.group))
        return state

    # -- the step loop ----------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with gc_paused():  # [Note: no collection during a step]
            self._step()
        return loss

    def _step(self) -> None:
        plan = self._current_plan()
        try:
            self._step_plan_run(plan)
        finally:  # the plan keeps no gradient alive between steps ([Note: step plan])
            for it in plan.items:
                it.grad = None

    def _step_plan_run(self, plan: StepPlan) -> None:
        items = plan.items
        state = self.state
        if not plan.validated:
            for it in items:  # an entry on every rank, even for empty slices (DCP's _init_optim_state)
                state[it.param]
        buckets, moving, routes = plan.buckets, plan.moving, plan.routes
        # pipeline ([Note: owner rounds]): bucket k+1's inputs and bucket k-1's results
        # are in flight while bucket k computes
        pending = self._launch(buckets[0], moving[0], routes[0]) if buckets else None
        returning: tuple[list[StepItem], PendingExchange] | None = None
        for k, bucket in enumerate(buckets):
            current = pending
            pending = self._launch(buckets[k + 1], moving[k + 1], routes[k + 1]) if k + 1 < len(buckets) else None
            outputs = self.compute_bucket(bucket, current.wait())
            back = exchange(bucket, outputs, forward=False, moving=moving[k], routes=routes[k])
            if returning is not None:
                self._apply(*returning)
            returning = (bucket, back)
        if returning is not None:
            self._apply(*returning)
        if not plan.validated:
            validated = self._validated
            for it in items:  # once per parameter, after the step that made its state
                if id(it.param) not in validated and state.get(it.param):
                    validate_state(self, it.param, it.group)
                    validated.add(id(it.param))
            plan.validated = all(id(it.param) in validated for it in items)

    def _current_plan(self) -> StepPlan:
        """This step's plan ([Note: step plan]), each group's items holding this step's
        gradients: the last one where nothing it was built from changed, else rebuilt."""
        plan = self._step_plan
        groups = self.param_groups
        old = plan.groups if plan is not None else []
        keys = self.structural_keys + self.plan_keys
        fresh: list[GroupPlan] = []
        rebuilt = plan is None or len(old) != len(groups)
        for gi, group in enumerate(groups):
            claimed = self.claim_params(group)
            values = group_values(group, keys)
            gp = old[gi] if gi < len(old) else None
            if gp is None or not gp.refresh(group, claimed, values):
                gp = self._plan_group(group, gi, claimed, values)
                rebuilt = True
            fresh.append(gp)
        sizes = (self.bucket_numel, self.min_round_numel)
        if not rebuilt and sizes == plan.sizes:
            if check_every_step():  # [Note: consistent steps]
                check_consistent([e for gp in fresh for e in gp.entries])
            return plan
        items = [it for gp in fresh for it in gp.items]
        structure = [s for gp in fresh for s in gp.structure]
        if structure != self._checked_structure or check_every_step():  # [Note: consistent steps]
            check_consistent([e for gp in fresh for e in gp.entries])
            self._checked_structure = structure
        buckets = make_buckets(items, *sizes)
        moving = [[i for i, it in enumerate(b) if it.moves] for b in buckets]
        self._step_plan = StepPlan(fresh, items, buckets, moving, sizes)
        return self._step_plan

    def _drop_plan(self) -> None:
        """Rebuild the step plan, and check consistency, at the next step
        ([Note: step plan], [Note: consistent steps])."""
        self._step_plan = None
        self._checked_structure = None

    def claim_params(self, group: dict[str, Any]) -> list[Any]:
        """Hook: the parameters of ``group`` left to the step loop. A subclass may first
        update, itself, parameters that need no exchange (AdamW's fused fully_shard
        stores, [Note: fused stores]) and leave out those it updated."""
        return group["params"]

    def _plan_group(self, group: dict[str, Any], gi: int, claimed: list[Any], values: tuple) -> GroupPlan:
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
                _check_not_replaced(p, type(self).__name__)
                view = sharded_view(p)
                req = self.requirement(view.shape, group)
                compute = self._spread_or(p, view, req, group, self._compute_layout(req, view), loads)
                entries.append(StepEntry(pos, tuple(view.shape), view.layout, None,
                                         compute is None or compute != view.layout, view.process_group,
                                         view.local.device))
                if view.process_group is not None:
                    structure.append((pos, id(p), id(view.process_group), view.layout, compute))
                rows.append((p, key, None if key is not None else view_key(view), None))
                continue
            if p.is_meta:
                raise NotImplementedError(
                    f"{type(self).__name__} cannot step parameters on the meta device (shape "
                    f"{tuple(p.shape)}); materialize them first (module.to_empty(device=...) and "
                    "initialization), then step")
            if p.grad.is_sparse:
                raise NotImplementedError(f"{type(self).__name__} does not support sparse gradients")
            if p.is_complex():
                raise NotImplementedError(f"{type(self).__name__} does not support complex parameters")
            view = sharded_view(p)
            gview = step_grad_view(p.grad)
            if gview.layout != view.layout:
                raise ValueError(
                    f"gradient layout {gview.layout} differs from parameter layout "
                    f"{view.layout} for a parameter of shape {tuple(view.shape)}")
            if group.get("capturable") and self.checks_capturable:
                check_capturable(type(self).__name__, group, view.local.device)
            req = self.requirement(view.shape, group)
            compute = self._spread_or(p, view, req, group, self._compute_layout(req, view), loads)
            if (self.balance_compute_cuts and compute is not None and compute != view.layout
                    and isinstance(view.layout, RaggedShard)
                    and self.state_layout(view, group) == view.layout):  # [Note: balanced compute cuts]
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
            pin_owners([items[i] for i in whole], self.cost, self._owner_cache, self._pinned_owners)
        return GroupPlan(group, values, rows, items, entries, structure)

    def _spread_or(self, p: Any, view: ShardedView, req: Requirement, group: dict[str, Any],
                   compute: RaggedShard | None, loads: dict[Any, list[int]]) -> RaggedShard | None:
        """``compute``, or where ``req`` has fewer blocks than ranks and the state lives
        on the compute layout, the spread layout, pinned ([Note: spread compute blocks]);
        ``loads`` (per process group) counts every such parameter's blocks, in order."""
        layout = view.layout
        if (compute is None or compute is layout or not spreads(layout, req, view.shape)
                or (self.balance_compute_cuts and self.state_layout(view, group) == layout)):
            return compute
        load = loads.setdefault(("spread", id(view.process_group)), [0] * layout.world_size)
        kept = self._pinned_spread.get(id(p))
        if kept is not None and kept[0] == layout and kept[1] == req:
            for o, size in kept[3]:
                load[o] += size
            return kept[2]
        # a tensor-parallel box layout: over its even split, as the nearest cuts are
        base = layout.even_split() if isinstance(layout, BoxShard) else layout
        spread, owners = spread_compute(base, req, view.shape, load)
        self._pinned_spread[id(p)] = (layout, req, spread, owners)
        return spread

    def checkpoint_layout(self, p: Any, view: ShardedView, group: dict[str, Any]) -> RaggedShard | BoxShard | None:
        """Where ``p``'s state lives (``CheckpointedOptimizer``): :meth:`state_layout`,
        with the spread compute layout where that is the compute layout of a requirement
        with fewer blocks than ranks ([Note: spread compute blocks])."""
        layout = self.state_layout(view, group)
        if layout is None or layout == view.layout:
            return layout
        req = self.requirement(view.shape, group)
        if not spreads(view.layout, req, view.shape):
            return layout
        kept = self._pinned_spread.get(id(p))
        if kept is None or kept[0] != view.layout or kept[1] != req:
            self._pin_spreads()
            kept = self._pinned_spread.get(id(p))
        if kept is None:
            raise AssertionError(f"no compute layout pinned for a parameter of shape {tuple(view.shape)}")
        return kept[2]

    def _pin_spreads(self) -> None:
        """Pin the spread layouts of every parameter as a step plan would, in order (a
        checkpoint asks before this optimizer has planned a step). Every parameter of a
        group is walked: ``claim_params`` may update some (it runs in a step only), and
        those it claims need no exchange, so no block requirement they could spread."""
        for group in self.param_groups:
            loads: dict[Any, list[int]] = {}
            for p in group["params"]:
                view = sharded_view(p)
                req = self.requirement(view.shape, group)
                self._spread_or(p, view, req, group, self._compute_layout(req, view), loads)

    def _compute_layout(self, req: Requirement, view: ShardedView) -> RaggedShard | None:
        """The compute layout for ``req`` ([Note: one step loop]); None: whole on an owner."""
        key = (req, view.layout, view.shape)
        if key in self._compute_cache:
            return self._compute_cache[key]
        if view.layout.satisfies(req, view.shape):
            compute = view.layout
        elif req.needs_whole:
            compute = None
        else:
            compute = snapped_compute(view.layout, req, view.shape)
        if len(self._compute_cache) > 4096:
            self._compute_cache.clear()
        self._compute_cache[key] = compute
        return compute

    def _apply(self, bucket: list[StepItem], back: PendingExchange) -> None:
        self._apply_bucket(bucket, back.wait())

    def _apply_bucket(self, bucket: list[StepItem], outputs: list[list[torch.Tensor]]) -> None:
        """apply_results over a bucket (one param group); the library's optimizers may
        batch it across parameters (Muon's foreach ops, [Note: Muon's bucket ops])."""
        if type(self).apply_results is BlockOptimizer.apply_results:  # the default, inlined
            for it, (p,) in zip(bucket, outputs, strict=True):
                if p is not it.view.local and p.numel():
                    it.view.local.copy_(p)
            return
        for it, outs in zip(bucket, outputs, strict=True):
            self.apply_results(it, outs)

    def _gather_bucket(self, bucket: list[StepItem]) -> list[list[torch.Tensor]]:
        """gather_inputs over a bucket (one param group); may batch, as _apply_bucket."""
        if type(self).gather_inputs is BlockOptimizer.gather_inputs:  # the default, inlined
            return [[it.view.local, it.grad] for it in bucket]
        return [self.gather_inputs(it) for it in bucket]

    def _launch(self, bucket: list[StepItem], moving: list[int], routes: dict[tuple, list]) -> PendingExchange:
        return exchange(bucket, self._gather_bucket(bucket), forward=True, moving=moving, routes=routes)


# [Note: capturable steps]
# capturable=True (torch.optim's flag, a param group key) makes a step a fixed sequence of
# device work that a CUDA graph can capture and replay:
#   - step counts are float32 0-d tensors on the parameters' device, incremented there,
#     and every coefficient read from them or from a Tensor lr (bias corrections, step
#     sizes) is computed there: a replay advances them and reads the lr tensor a
#     scheduler changed in place;
#   - nothing in the step reads a device value on the host (no .item(), no branch on a
#     tensor), and no host tensor enters a device op (its value would be the one read at
#     capture): Tensor hyperparameters must live on the parameters' device;
#   - the host work a step does once (its plan, the batching probes, code tables) is done
#     by the eager steps before a capture, which torch requires anyway (warm-up).
# The results are the same at every world size as on one device with capturable=True,
# and differ from capturable=False in the last bits, as torch's capturable Adam does
# (coefficients rounded on the device). torch refuses capturable=True on the CPU, which
# has no graphs; so do we, here (AdamW leaves it to torch's own error).
# A graph replays the kind of step it captured. SOAP and Shampoo decide on the host when to
# refresh their preconditioners, from their count of step() calls: the steps in between are
# capturable; the refreshes (and SOAP's first step) call eigh (which reads its error code back
# to the host on CUDA) or QR and run eagerly, as step() calls; count_replays(n) counts replays.
def check_capturable(name: str, group: dict[str, Any], device: torch.device) -> None:
    """The checks of ``capturable=True`` ([Note: capturable steps]): the parameter's
    device is one torch.optim accepts for it, and every Tensor hyperparameter lives there
    (a host value would be read once, when the step is captured)."""
    devices = capturable_devices()
    if device.type not in devices:
        raise ValueError(
            f"{name}(capturable=True) needs its parameters on a device whose steps CUDA graphs "
            f"can capture ({', '.join(devices)}), got a parameter on {device}; use capturable=False "
            f"on {device.type}")
    for key, value in group.items():
        if key == "params":
            continue
        for t in tree_flatten(value)[0]:
            if isinstance(t, torch.Tensor) and t.device != device:
                raise ValueError(
                    f"{name}(capturable=True) needs Tensor hyperparameters on the parameters' device "
                    f"{device}, got {key!r} on {t.device}: a captured step would keep the value it "
                    f"read when captured; pass {key} as a float or as a tensor on {device}")


def _check_not_replaced(p: torch.Tensor, name: str) -> None:
    if replaced_by_fully_shard(p):
        raise ValueError(
            f"{name} holds a parameter of shape {tuple(p.shape)} that fully_shard has replaced "
            "with a sharded one, so it would never train; build the optimizer after fully_shard, "
            "from model.parameters()")
