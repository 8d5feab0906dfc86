"""One step loop for block-structured optimizers (see [Note: one step loop])."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import Optimizer

from vefsdp_optim.comm import ShardedView, sharded_view
from vefsdp_optim.sharding import BoxShard, RaggedShard, Requirement

from ._checkpoint import export_state, load_state, validate_state
from ._compute_layouts import snapped_compute
from ._flat_store import ReplanReport, apply_requirements, flat_store
from ._flattened import check_not_flattened
from ._planner import StepPlanner, check_not_replaced
from ._step_loop import (
    BlockContext,
    PendingExchange,
    StepItem,
    aligned,
    exchange,
    gc_paused,
)
from ._step_plan import StepPlan

__all__ = ["BlockOptimizer", "BlockContext"]

# [Note: one step loop]
# Every parameter is reduced to a ShardedView: this rank's 1-D slice of the flat
# parameter, its RaggedShard layout and the shard process group. Plain tensors, FSDP2
# DTensors and the library's own sharded parameters all look the same from here.
# Each optimizer declares a Requirement per parameter. The compute layout is one of:
#   - the storage layout itself, when it already satisfies the requirement (no comm);
#   - for block and band requirements, the storage layout with each boundary snapped
#     to the nearest legal cut, so only pieces at boundaries move;
#   - for WholeTensor, "whole on an owner", owners balanced by cost (LPT).
# A step walks exchange buckets of parameters. A bucket shares param group, process
# group, dtype and device, so every override sees one param group per bucket. Whole
# tensors go in balanced owner rounds (see ``make_buckets`` in _step_loop.py). For each
# bucket the step gathers the inputs of every moving parameter in ONE all_to_all,
# launched before the previous bucket's compute so that the two overlap. It computes on
# whole blocks and sends the results back in one more all_to_all, waited for after the
# next bucket's compute. The loop is written once, here. A subclass supplies only what
# differs, through the override points in BlockOptimizer's table. It always supplies
# requirement, init_state and update_block. The state lives with the blocks: the default
# data flow moves (param, grad), runs update_block on each whole block and copies the
# param back. The three data-flow overrides gather_inputs, compute_bucket and
# apply_results are optional, for optimizers whose moving data are not (param, grad).
# Muon keeps its momentum sharded and moves one tensor.


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
    #: fewest elements per round of whole tensors sent to owners (see ``make_buckets`` in
    #: vefsdp_optim/_step_loop.py); 0 keeps them in the buckets above
    min_round_numel: int = 1 << 20
    #: ``capturable=True`` on a device CUDA graphs cannot capture: our ValueError when the
    #: step is planned; False leaves the error to torch at the first step (AdamW, as
    #: torch.optim.AdamW raises it)
    checks_capturable: bool = True
    #: True where the optimizer keeps no state on the compute layout of a block
    #: requirement its storage cuts (where state_layout() is the storage), so that its
    #: cuts may differ between plans: they then balance the ranks' shares (see
    #: ``balanced_compute`` in vefsdp_optim/_compute_layouts.py); False keeps the
    #: nearest cuts, a function of the parameter alone
    balance_compute_cuts: bool = False

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any]) -> None:
        # the step plan and its caches ([Note: step plan]); first: add_param_group drops the plan
        self._planner = StepPlanner()
        super().__init__(params, defaults)
        self._validated: set[int] = set()  # ids of parameters whose state validate_state passed
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                check_not_replaced(p, type(self).__name__)
                try:  # raises for unsupported kinds and placements, before any collective
                    view = sharded_view(p)
                except ValueError as e:
                    names = group.get("param_names")
                    who = repr(names[pi]) if names else f"{pi} (shape {tuple(p.shape)})"
                    raise ValueError(f"{type(self).__name__}: param group {gi} "
                                     f"parameter {who}: {e}") from None
                self.requirement(view.shape, group)  # validates the shape too
        #: what the re-plan at construction changed (see ``BlockOptimizer.replan``)
        self.replan_report: ReplanReport = self.replan()

    def replan(self) -> ReplanReport:
        """Re-plan the fully_shard groups of this optimizer's parameters so that the blocks
        each parameter's requirement names are whole on single ranks.

        The constructor calls it once; call it again after ``add_param_group``. What the
        padding rule refuses stays exact, through the exchange of the step loop (the
        report's ``kept``). Collective over the process group of every re-planned store
        ([Note: flat store contract]); FSDP2 and plain parameters need none and are left
        alone. Raises ValueError, before any communication, if a parameter that would move
        already has optimizer state (in this or another optimizer): build the optimizers
        before the first step.
        """
        wanted = {p: self.requirement(sharded_view(p).shape, group)
                  for group in self.param_groups for p in group["params"]
                  if flat_store(p) is not None}
        self._drop_plan()  # [Note: step plan], [Note: consistent steps]
        return apply_requirements(wanted, holder=self) if wanted else ReplanReport()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        try:  # before any state or collective (see vefsdp_optim/_flattened.py)
            check_not_flattened(self, self.param_groups[-1], len(self.param_groups) - 1)
        except ValueError:
            self.param_groups.pop()
            raise
        self._drop_plan()  # [Note: step plan], [Note: consistent steps]

    # -- subclass API ---------------------------------------------------------------

    def requirement(self, shape: torch.Size, group: dict[str, Any]) -> Requirement:
        raise NotImplementedError(f"{type(self).__name__} must define requirement(shape, group)")

    def init_state(self, p: torch.Tensor, ctx: BlockContext,
                   group: dict[str, Any]) -> dict[str, Any]:
        return {}

    def update_block(
        self, p: torch.Tensor, g: torch.Tensor, state: dict[str, Any], ctx: BlockContext,
        group: dict[str, Any],
    ) -> None:
        raise NotImplementedError(f"{type(self).__name__} must define update_block(...)")

    def updates_elementwise(self, group: dict[str, Any]) -> bool:
        """Whether ``group``'s update is element by element whatever a parameter's shape,
        so that a 1-D slice of a flattened parameter (FSDP1's) gets one device's update:
        only then are such parameters accepted (see vefsdp_optim/_flattened.py)."""
        return False

    def cost(self, shape: torch.Size, group: dict[str, Any]) -> float:
        """Relative compute cost of a whole-tensor update in param group ``group``, for
        owner balancing (see ``assign_owners`` in comm/_owners.py)."""
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

    def checkpoint_spec(self, shape: torch.Size,
                        group: dict[str, Any]) -> dict[str, str | int] | None:
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
        restored after (see ``_to_create`` in vefsdp_optim/_checkpoint/_format.py)."""
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
        self._planner.pinned_owners[id(p)] = (layout, rank)

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
            g = aligned(g)  # ``aligned`` in vefsdp_optim/_step_loop.py
            ctx = item.ctx(item.compute)
            state = self._block_state(item, p, ctx)
            self.update_block(p, g, state, ctx, item.group)
        return [p]

    def apply_results(self, item: StepItem, outputs: list[torch.Tensor]) -> None:
        (p,) = outputs
        if p is not item.view.local and p.numel():
            item.view.local.copy_(p)

    def compute_bucket(self, items: list[StepItem],
                       inputs: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
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
    def step(self,  # type: ignore[override]
             closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with gc_paused():  # [Note: no collection during a step]
            self._step()
        return loss

    def _step(self) -> None:
        plan = self._planner.current(self)
        try:
            self._step_plan_run(plan)
        finally:  # the plan keeps no gradient alive between steps ([Note: step plan])
            for it in plan.items:
                it.grad = None

    def _step_plan_run(self, plan: StepPlan) -> None:
        items = plan.items
        state = self.state
        if not plan.validated:
            # an entry on every rank, even for empty slices (DCP's _init_optim_state)
            for it in items:
                state[it.param]
        buckets, moving, routes = plan.buckets, plan.moving, plan.routes
        # pipeline (see ``make_buckets`` in vefsdp_optim/_step_loop.py): bucket k+1's inputs and
        # bucket k-1's results are in flight while bucket k computes
        pending = self._launch(buckets[0], moving[0], routes[0]) if buckets else None
        returning: tuple[list[StepItem], PendingExchange] | None = None
        for k, bucket in enumerate(buckets):
            current = pending
            pending = (self._launch(buckets[k + 1], moving[k + 1], routes[k + 1])
                       if k + 1 < len(buckets) else None)
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

    def _drop_plan(self) -> None:
        """Rebuild the step plan, and check consistency, at the next step
        ([Note: step plan], [Note: consistent steps])."""
        self._planner.drop()

    def claim_params(self, group: dict[str, Any]) -> list[Any]:
        """Hook: the parameters of ``group`` left to the step loop. A subclass may first
        update, itself, parameters that need no exchange (AdamW's fused fully_shard
        stores, ``_FlatState`` in vefsdp_optim/_adamw.py) and leave out those it updated."""
        return group["params"]

    def checkpoint_layout(self, p: Any, view: ShardedView,
                          group: dict[str, Any]) -> RaggedShard | BoxShard | None:
        """Where ``p``'s state lives (``CheckpointedOptimizer``): :meth:`state_layout`,
        with the spread compute layout where that is the compute layout of a requirement
        with fewer blocks than ranks ([Note: spread compute blocks])."""
        return self._planner.pinned_state_layout(self, p, view, group)

    def _apply(self, bucket: list[StepItem], back: PendingExchange) -> None:
        self._apply_bucket(bucket, back.wait())

    def _apply_bucket(self, bucket: list[StepItem], outputs: list[list[torch.Tensor]]) -> None:
        """apply_results over a bucket (one param group); the library's optimizers may
        batch it across parameters (Muon's foreach ops, ``Muon._gather_bucket`` in
        vefsdp_optim/_muon.py)."""
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

    def _launch(self, bucket: list[StepItem], moving: list[int],
                routes: dict[tuple, list]) -> PendingExchange:
        return exchange(bucket, self._gather_bucket(bucket), forward=True, moving=moving,
                        routes=routes)
