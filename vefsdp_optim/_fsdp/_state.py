"""The hooks of one fully_shard'd module (FSDPState) and the per-root iteration state.

Hooks: forward pre-hook (unshard, register unsharded params, post-backward hook on
the inputs), forward hook (register sharded params, reshard, pre-backward hooks on the
outputs), and, for the root, a final callback on the autograd engine that finishes
every shard group whose post-backward did not run (inputs without grad). Where a module is
in its step is explicit (``Role``, ``TrainingState`` in _lifecycle.py).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from vefsdp_optim._torch_compat import (
    queue_autograd_callback,
    tree_flatten,
    tree_map,
    tree_unflatten,
)

from ._group import ShardGroup
from ._lifecycle import Role, TrainingState, advance
from ._param import ManagedParam
from ._streams import CommContext, streams_for

__all__ = ["FSDPState", "ParamOutsideUse", "ctx_final_callback", "finish_completed_reductions",
           "wait_reductions"]


def _state_of(m: nn.Module) -> FSDPState | None:
    """The FSDPState fully_shard gave ``m`` (``FSDPModule._vefsdp_state``), else None."""
    return m.__dict__.get("_vefsdp_state")


class _RootContext:
    """Per-root iteration state shared by every FSDPState under one root."""

    def __init__(self, states: list[FSDPState], comm: CommContext) -> None:
        self.states = states
        self.comm = comm  # streams, buffers to free, events ([Note: fully_shard streams])
        self.callback_queued = False
        # shard groups in the order their forward ran with grad enabled (with repeats); the
        # backward of entry i prefetches entry i - 1 unless told otherwise (as FSDP2)
        self.fwd_order: list[FSDPState] = []
        # shard groups whose reduce-scatter was launched and not yet waited for; the next
        # post-backward waits for them before launching its own (at most one shard group's
        # gradient buffer in flight), the final callback for the last
        self.reducing: list[ShardGroup] = []

    def reset(self) -> None:
        """Forget the iteration in flight (FSDPModule.reset_iter_state)."""
        self.reducing.clear()
        self.fwd_order.clear()
        self.callback_queued = False
        self.comm.reset()


class FSDPState:
    """Hooks and flags of one fully_shard'd module."""

    def __init__(self, modules: list[nn.Module], shard_groups: list[ShardGroup], reshard_after_forward: bool,
                 mp_policy: MixedPrecisionPolicy) -> None:
        self.modules = modules  # one, or FSDP2's list of modules sharing its shard groups
        self.module = modules[0]
        self.module_class = type(self.module).__name__  # the user's class: fully_shard swaps it
        # one per mesh of this call's parameters, in the order of their first parameter
        # (see ``_by_mesh`` in vefsdp_optim/_fsdp/_fully_shard.py); none without parameters
        self.shard_groups = shard_groups
        self._not_run: set[int] = set()  # ids of this forward's modules (a list) yet to finish
        self.reshard_after_forward = reshard_after_forward
        self.mp_policy = mp_policy
        self.ctx: _RootContext | None = None
        self.role = Role.UNSET
        self.fwd_prefetch: list[FSDPState] = []
        self.bwd_prefetch: list[FSDPState] = []
        self.training_state = TrainingState.IDLE
        self.reshard_after_backward = True  # FSDPModule.set_reshard_after_backward
        self.unshard_in_backward = True  # FSDPModule.set_unshard_in_backward
        # Forward calls (grad enabled) since the last backward whose inputs carry a
        # post-backward hook; the shard group is reduced when the last of them has run
        # backward, or by the root's final callback when some call had no hook.
        self.uses = 0
        self.untracked = False  # a forward call with grad whose inputs need no grad
        # id -> original Parameter this shard group replaced (weak: tensors compare elementwise)
        self.originals: weakref.WeakValueDictionary[int, nn.Parameter] = weakref.WeakValueDictionary()
        self.post_optim_event: Any = None  # set_post_optim_event before the root's lazy init

    @property
    def shard_group(self) -> ShardGroup | None:
        """The one shard group of a call whose parameters share one mesh (None: no
        parameters); a call with several meshes has several: use ``shard_groups``."""
        if len(self.shard_groups) > 1:
            raise AssertionError(
                f"this fully_shard'd module has {len(self.shard_groups)} shard groups (one per mesh of "
                "its parameters); iterate over FSDPState.shard_groups")
        return self.shard_groups[0] if self.shard_groups else None

    def group_of(self, mp: ManagedParam) -> ShardGroup:
        """The shard group that manages ``mp``."""
        for g in self.shard_groups:
            if any(q is mp for q in g.params):
                return g
        raise AssertionError(f"{mp.fqn}: a managed parameter without a shard group")

    @property
    def is_root(self) -> bool:
        return self.role is Role.ROOT

    @property
    def in_backward(self) -> bool:
        return self.training_state is TrainingState.BACKWARD

    def reset(self) -> None:
        """Drop this module's iteration state after a failed forward or backward
        (FSDPModule.reset_iter_state): in-flight collectives are waited for and their
        results discarded, parameters resharded."""
        self.training_state = TrainingState.IDLE
        self.uses, self.untracked = 0, False
        for g in self.shard_groups:
            g.reset()

    def _set_training(self, new: TrainingState) -> None:
        self.training_state = advance(self.training_state, new, "FSDPState.training_state")

    # -- lazy root init ----------------------------------------------------------------

    def _lazy_init(self) -> None:
        if self.role is not Role.UNSET:
            return
        states = list({id(st): st for st in (_state_of(m) for m in self.module.modules())
                       if st is not None}.values())
        for s in states:
            if s is not self and s.is_root:
                raise ValueError("a fully_shard'd module ran forward as root before its parent; "
                                 "run the outermost fully_shard'd module first")
        self.role = advance(self.role, Role.ROOT, "FSDPState.role")
        devices = [g.settings.device for s in states for g in s.shard_groups]
        ctx = _RootContext(states, CommContext(streams_for(devices[0] if devices else torch.device("cpu"))))
        for s in states:
            if s.post_optim_event is not None:
                ctx.comm.post_optim_event, s.post_optim_event = s.post_optim_event, None
        for s in states:
            if s is not self and s.role is Role.UNSET:
                s.role = advance(s.role, Role.NON_ROOT, "FSDPState.role")
            s.ctx = ctx
            for g in s.shard_groups:
                g.before_grad_alloc = lambda: finish_completed_reductions(ctx)
                g.comm = ctx.comm

    # -- forward -----------------------------------------------------------------------

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self._lazy_init()
        if self.is_root:
            self.ctx.callback_queued = False
            if torch.is_grad_enabled():
                self.ctx.fwd_order.clear()
            self.ctx.comm.begin_forward()  # [Note: fully_shard streams]
            for s in self.ctx.states:  # here, not in each shard group's hook: modules get compiled
                for g in s.shard_groups:
                    g.release_grads()
        if self.mp_policy.param_dtype is not None and self.mp_policy.cast_forward_inputs:
            dt = self.mp_policy.param_dtype
            args, kwargs = tree_map(
                lambda t: t.to(dt) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
                (args, kwargs))
        if not self.shard_groups:
            return args, kwargs
        if not self._not_run:  # a new forward: every module of the shard groups is to run
            self._not_run = {id(m) for m in self.modules}
        for g in self.shard_groups:  # all launched, then waited for
            g.unshard(overlap=True)
        for g in self.shard_groups:
            g.wait_unshard()
        for s in self.fwd_prefetch:
            for g in s.shard_groups:
                g.unshard(async_op=True, overlap=True)
        for g in self.shard_groups:
            g.register(sharded=False)
        if torch.is_grad_enabled():
            args, kwargs, hooked = self._register_post_backward(args, kwargs)
            if hooked:
                self.uses += 1
            else:
                self.untracked = True
        return args, kwargs

    def post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if self.shard_groups and torch.is_grad_enabled():
            self.ctx.fwd_order.append(self)
        if self.shard_groups:
            self._not_run.discard(id(module))
        for g in self.shard_groups:
            g.register(sharded=True)
            # as FSDP2: root keeps its params for backward; a list of modules reshards once all ran
            if self.reshard_after_forward and not self.is_root and not self._not_run:
                g.free(deferred=True)
        if self.is_root:  # as FSDP2: no gathered buffer waits for its free past the forward
            self.ctx.comm.release()
        if self.mp_policy.output_dtype is not None:
            dt = self.mp_policy.output_dtype
            output = tree_map(
                lambda t: t.to(dt) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, output)
        if torch.is_grad_enabled():
            flat, _ = tree_flatten(output)
            for t in flat:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._pre_backward)
        return output

    def _register_post_backward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict, bool]:
        flat, spec = tree_flatten((args, kwargs))
        idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not idx:
            return args, kwargs, False
        outs = _PostBackward.apply(self, *[flat[i] for i in idx])
        for i, o in zip(idx, outs, strict=True):
            flat[i] = o
        args, kwargs = tree_unflatten(flat, spec)
        return args, kwargs, True

    # -- backward ----------------------------------------------------------------------

    def _pre_backward(self, grad: torch.Tensor) -> torch.Tensor:
        ctx = self.ctx
        if ctx is not None and not ctx.callback_queued:
            ctx.callback_queued = True
            queue_autograd_callback(ctx_final_callback(ctx))
        if self.in_backward:
            return grad
        self._set_training(TrainingState.BACKWARD)
        for g in self.shard_groups:
            if not g.unsharding and not g.gathered and self.unshard_in_backward:
                g.unshard(overlap=True)
        for g in self.shard_groups:
            if g.unsharding:
                g.wait_unshard()
            if g.gathered:  # as FSDP2: activation checkpointing recomputes with these
                g.register(sharded=False)
            g.attach_grads()
        for s in self.bwd_prefetch or self._implicit_bwd_prefetch():
            for g in s.shard_groups:
                if not g.gathered:
                    g.unshard(async_op=True, overlap=True)
        return grad

    def _implicit_bwd_prefetch(self) -> list[FSDPState]:
        """The shard group whose forward ran just before this one's last: next in backward."""
        order = self.ctx.fwd_order if self.ctx is not None else []
        for i in range(len(order) - 1, 0, -1):
            if order[i] is self:
                prev = order[i - 1]
                return [] if prev is self or prev.in_backward else [prev]
        return []

    def outside_grad(self, mp: ManagedParam, grad: torch.Tensor) -> None:
        """The gradient of ``mp.sharded.full_tensor()`` ([Note: use outside forward]): the
        shard group enters its backward as for a use in forward, and ``grad`` is added
        where autograd puts the unsharded parameter's."""
        shard_group = self.group_of(mp)
        if mp.tp is not None:
            raise NotImplementedError(
                f"fully_shard: {self.param_name(mp)} is tensor parallel; a gradient through its "
                "full_tensor() is not supported: use it in the forward of its module")
        if mp.unsharded is None:  # never gathered: make the unsharded face
            shard_group.unshard()
        self.enter_backward(grad)
        shard_group.add_grad(mp, grad)

    def enter_backward(self, grad: torch.Tensor) -> None:
        """Start this shard group's backward for a gradient that came around its module's
        outputs ([Note: use outside forward]), as its pre-backward hook would."""
        alone = self.ctx is None and not self.in_backward  # no root forward ran yet
        self._pre_backward(grad)
        if alone:
            queue_autograd_callback(self._finish_alone)

    def _finish_alone(self) -> None:
        """The final callback of a backward before any root forward (no root context)."""
        self.post_backward(final=True)
        self.uses, self.untracked = 0, False

    def param_name(self, mp: ManagedParam) -> str:
        """``mp``'s name under the root module, for errors (before the first forward: its
        name in this shard group, and the module's class)."""
        root = next((s for s in self.ctx.states if s.is_root), None) if self.ctx is not None else None
        if root is not None:
            faces = (mp.sharded, mp.unsharded)
            for n, p in root.module.named_parameters(remove_duplicate=False):
                if any(p is f for f in faces):
                    return n  # the first of tied names
        return f"{self.module_class}.{mp.fqn}"

    def post_backward(self, final: bool = False) -> None:
        """End of this module's backward: free, reduce-scatter (see ``FSDPState.uses``).

        From a use's post-backward hook (``final=False``) only the last outstanding use
        finishes the shard group; the root's final callback (``final=True``) finishes it always.
        """
        if not final:
            self.uses -= 1
            if self.uses > 0 or self.untracked:
                return
        if not self.in_backward:
            return
        self._set_training(TrainingState.IDLE)
        if not self.shard_groups:
            return
        for g in self.shard_groups:
            if self.reshard_after_backward:
                g.free(deferred=True)
            else:
                g.wait_unshard()
            g.register(sharded=True)
        ctx = self.ctx
        if ctx is not None:
            wait_reductions(ctx)
        for g in self.shard_groups:  # this module's groups reduce together
            g.reduce_grads()  # async (``StoreGrads.launch_reduce`` in _grads.py)
            if g.reducing:
                if ctx is not None:
                    ctx.reducing.append(g)
                else:
                    g.wait_reduce()


# [Note: use outside forward]
# A shard group's backward starts at its module's outputs, in pre-backward hooks, and
# ends at its inputs or at the root's final callback. A gradient is reduced only if it
# reaches the unsharded face in that window. Three ways go around the module's forward.
#  - An op on the sharded face, such as ``x @ child.weight.T`` in a parent's forward.
#    The sharded face is this rank's slice, so the gradient goes to the sharded leaf,
#    unreduced. It is this rank's full gradient, or, for ops the slices compute locally
#    ([Note: sharded dispatch]), its slice of one, which no reduction can average.
#    FSDP2 refuses that mix of DTensor and plain tensor. We raise at the first such
#    gradient, naming the parameter, from a hook on each sharded face. A parameter used
#    nowhere gets no gradient, hence no error, as under FSDP2.
#  - ``p.full_tensor()``, FSDP2's DTensor way. It is differentiable for a parameter that
#    requires grad, under grad mode. It gives a gathered copy in new storage, which no
#    reshard frees. Its backward starts the shard group's backward and adds the gradient,
#    in param_dtype, where autograd puts the unsharded face's. It counts as a forward
#    without a post-backward hook (see ``FSDPState.uses``): one reduction, by the
#    final callback, averaged over the ranks. FSDP2 leaves each shard its own rank's one.
#  - ``module.unshard()``, then the unsharded face, FSDP2's other way. A hook on that
#    face starts the shard group's backward at its first gradient, before
#    AccumulateGrad, as the module's pre-backward would. So the gradient is attached and
#    reduced, not dropped.
# Before any forward of the root, with no root context, a backward queues its own final callback.


class ParamOutsideUse:
    """The ``OutsideUse`` of one managed parameter ([Note: use outside forward]), and its
    hooks on both faces. Weak references: the faces that hold it are reachable from both."""

    __slots__ = ("_state", "_param")

    def __init__(self, state: FSDPState, mp: ManagedParam) -> None:
        self._state = weakref.ref(state)
        self._param = weakref.ref(mp)

    def _both(self) -> tuple[FSDPState, ManagedParam]:
        state, mp = self._state(), self._param()
        if state is None or mp is None:
            raise AssertionError("a fully_shard parameter outlived its shard group")
        return state, mp

    def forward(self) -> None:
        state, _ = self._both()
        state.untracked = True  # reduced by the final callback (see ``FSDPState.uses``)

    def backward(self, grad: torch.Tensor) -> None:
        state, mp = self._both()
        state.outside_grad(mp, grad)

    def unsharded_grad(self, grad: torch.Tensor) -> None:
        """Hook on the unsharded face, before AccumulateGrad: a gradient that reaches it
        while the shard group is not in its backward (a module gathered by ``unshard()``
        and its parameters used outside its forward) starts that backward, so that the
        gradient is attached and reduced, not dropped."""
        state, _ = self._both()
        if not state.in_backward:
            state.enter_backward(grad)

    def guard(self, grad: torch.Tensor | None) -> None:
        """Tensor hook on the sharded face: any gradient there bypasses the reduction."""
        if grad is None:  # full_tensor()'s backward sends none
            return
        state, mp = self._both()
        name = state.param_name(mp)
        module = name.rpartition(".")[0] or "the module"
        raise RuntimeError(
            f"fully_shard: parameter {name} got a gradient through its sharded face: it was used "
            "outside the forward of the fully_shard'd module that holds it (e.g. in a parent's "
            "forward), where it is only this rank's slice, so its gradient would bypass the shard "
            "group's reduction and it would silently not train. Call the module, so that fully_shard "
            f"gathers its parameters for its forward; or call {module}.unshard() before the use, as "
            f"FSDP2 asks; or use {name}.full_tensor(), differentiable as FSDP2's DTensor.full_tensor() "
            "([Note: use outside forward])")


def ctx_final_callback(ctx: _RootContext):  # noqa: ANN201
    def callback() -> None:
        for s in ctx.states:
            s.post_backward(final=True)
            s.uses, s.untracked = 0, False
            for g in s.shard_groups:
                g.wait_unshard()
                if s.reshard_after_forward and s.reshard_after_backward and not s.is_root and g.gathered:
                    g.free()  # prefetched, but its backward did not run
        wait_reductions(ctx)  # the optimizer reads the sharded .grad next
        ctx.comm.finish_backward()  # [Note: fully_shard streams]
        ctx.comm.release()
        ctx.fwd_order.clear()
        ctx.callback_queued = False

    return callback


def finish_completed_reductions(ctx: _RootContext) -> None:
    """Finish, in launch order, the launched reductions whose collectives have completed:
    their gradient buffers are freed now rather than at the next post-backward."""
    while ctx.reducing and ctx.reducing[0].reduce_done:
        ctx.reducing.pop(0).wait_reduce()


def wait_reductions(ctx: _RootContext) -> None:
    """Complete every launched reduce-scatter under this root, in launch order."""
    pending, ctx.reducing = ctx.reducing, []
    for shard_group in pending:
        shard_group.wait_reduce()


class _PostBackward(torch.autograd.Function):
    @staticmethod
    def forward(state: FSDPState, *inputs: torch.Tensor):  # noqa: ANN205
        return tuple(t.view_as(t) for t in inputs)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:  # noqa: ANN001
        ctx.state = inputs[0]

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # noqa: ANN001, ANN205
        ctx.state.post_backward()
        return (None, *grads)
