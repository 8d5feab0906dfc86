"""fully_shard: FSDP2's entry point and FSDPModule methods, on RaggedShard buffers.

Applied bottom-up (each block, then the root). Each call manages the module's own
parameters not already managed by a fully_shard'd descendant, as one ParamGroup.
Hooks: forward pre-hook (unshard, register unsharded params, post-backward hook on
the inputs), forward hook (register sharded params, reshard, pre-backward hooks on the
outputs), and, for the root, a final callback on the autograd engine that finishes
every group whose post-backward did not run (inputs without grad).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ._group import ParamGroup, check_group_consistent
from ._param import ManagedParam
from ._sharded_tensor import ShardedParameter

__all__ = ["fully_shard", "FSDPModule", "FSDPState", "UnshardHandle"]

_CLS_CACHE: dict[type, type] = {}


class _RootContext:
    """Per-root iteration state shared by every FSDPState under one root."""

    def __init__(self, states: list[FSDPState]) -> None:
        self.states = states
        self.callback_queued = False
        # groups in the order their forward ran with grad enabled (with repeats); the
        # backward of entry i prefetches entry i - 1 unless told otherwise (as FSDP2)
        self.fwd_order: list[FSDPState] = []
        # groups whose reduce-scatter was launched and not yet waited for; the next
        # post-backward waits for them before launching its own (at most one group's
        # gradient buffer in flight), the final callback for the last
        self.reducing: list[ParamGroup] = []


class FSDPState:
    """Hooks and flags of one fully_shard'd module."""

    def __init__(self, module: nn.Module, group: ParamGroup | None, reshard_after_forward: bool,
                 mp_policy: MixedPrecisionPolicy) -> None:
        self.module = module
        self.group = group
        self.reshard_after_forward = reshard_after_forward
        self.mp_policy = mp_policy
        self.ctx: _RootContext | None = None
        self.is_root: bool | None = None
        self.fwd_prefetch: list[FSDPState] = []
        self.bwd_prefetch: list[FSDPState] = []
        self._in_backward = False  # pre-backward ran, post-backward not yet
        # [Note: repeated use] forward calls (grad enabled) since the last backward whose
        # inputs carry a post-backward hook; the group is reduced when the last of them
        # has run backward, or by the root's final callback when some call had no hook.
        self._uses = 0
        self._untracked = False  # a forward call with grad whose inputs need no grad

    # -- lazy root init ----------------------------------------------------------------

    def _lazy_init(self) -> None:
        if self.is_root is not None:
            return
        self.is_root = True
        states = [m._vefsdp_state for m in self.module.modules() if isinstance(m, FSDPModule)]
        ctx = _RootContext(states)
        for s in states:
            if s is not self:
                if s.is_root:
                    raise ValueError("a fully_shard'd module ran forward as root before its parent; "
                                     "run the outermost fully_shard'd module first")
                s.is_root = False
            s.ctx = ctx

    # -- forward -----------------------------------------------------------------------

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self._lazy_init()
        if self.is_root:
            self.ctx.callback_queued = False
            if torch.is_grad_enabled():
                self.ctx.fwd_order.clear()
        if self.mp_policy.param_dtype is not None and self.mp_policy.cast_forward_inputs:
            dt = self.mp_policy.param_dtype
            args, kwargs = tree_map(
                lambda t: t.to(dt) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
                (args, kwargs))
        g = self.group
        if g is None:
            return args, kwargs
        g.unshard()
        g.wait_unshard()
        for s in self.fwd_prefetch:
            if s.group is not None:
                s.group.unshard(async_op=True)
        g.register(sharded=False)
        if torch.is_grad_enabled():
            args, kwargs, hooked = self._register_post_backward(args, kwargs)
            if hooked:
                self._uses += 1
            else:
                self._untracked = True
        return args, kwargs

    def post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        g = self.group
        if g is not None and torch.is_grad_enabled():
            self.ctx.fwd_order.append(self)
        if g is not None:
            g.register(sharded=True)
            if self.reshard_after_forward and not self.is_root:  # as FSDP2: root keeps its params for backward
                g.wait_unshard()
                for b in g.buckets:
                    b.free()
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
            Variable._execution_engine.queue_callback(ctx_final_callback(ctx))
        if self._in_backward:
            return grad
        self._in_backward = True
        g = self.group
        if g is not None:
            if g._pending is not None:
                g.wait_unshard()
            elif not g.gathered:
                g.unshard()
            g.attach_grads()
        for s in self.bwd_prefetch or self._implicit_bwd_prefetch():
            if s.group is not None and not s.group.gathered:
                s.group.unshard(async_op=True)
        return grad

    def _implicit_bwd_prefetch(self) -> list[FSDPState]:
        """The group whose forward ran just before this one's last forward: next in backward."""
        order = self.ctx.fwd_order if self.ctx is not None else []
        for i in range(len(order) - 1, 0, -1):
            if order[i] is self:
                prev = order[i - 1]
                return [] if prev is self or prev._in_backward else [prev]
        return []

    def post_backward(self, final: bool = False) -> None:
        """End of this module's backward: free, reduce-scatter ([Note: repeated use]).

        From a use's post-backward hook (``final=False``) only the last outstanding use
        finishes the group; the root's final callback (``final=True``) finishes it always.
        """
        if not final:
            self._uses -= 1
            if self._uses > 0 or self._untracked:
                return
        if not self._in_backward:
            return
        self._in_backward = False
        g = self.group
        if g is None:
            return
        g.wait_unshard()
        for b in g.buckets:
            b.free()
        ctx = self.ctx
        if ctx is not None:
            wait_reductions(ctx)
        g.reduce_grads()  # async ([Note: async reduce-scatter] in _group.py)
        if g.reducing:
            if ctx is not None:
                ctx.reducing.append(g)
            else:
                g.wait_reduce()


def ctx_final_callback(ctx: _RootContext):  # noqa: ANN201
    def callback() -> None:
        for s in ctx.states:
            s.post_backward(final=True)
            s._uses, s._untracked = 0, False
            if s.group is not None:
                s.group.wait_unshard()
                if s.reshard_after_forward and not s.is_root and s.group.gathered:
                    for b in s.group.buckets:  # prefetched, but its backward did not run
                        b.free()
        wait_reductions(ctx)  # the optimizer reads the sharded .grad next
        ctx.fwd_order.clear()
        ctx.callback_queued = False

    return callback


def wait_reductions(ctx: _RootContext) -> None:
    """Complete every launched reduce-scatter under this root, in launch order."""
    pending, ctx.reducing = ctx.reducing, []
    for g in pending:
        g.wait_reduce()


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


class UnshardHandle:
    """A pending :meth:`FSDPModule.unshard` (FSDP2's ``UnshardHandle``).

    ``wait()`` completes the all-gather and registers the unsharded parameters on the
    module; calling it again does nothing. Forward waits by itself when not called.
    """

    def __init__(self, group: ParamGroup | None) -> None:
        self._group = group

    def wait(self) -> None:
        g, self._group = self._group, None
        if g is not None:
            g.wait_unshard()
            g.register(sharded=False)


class FSDPModule:
    """Mixin added to a fully_shard'd module's class, mirroring FSDP2's FSDPModule."""

    _vefsdp_state: FSDPState

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters and register the unsharded ones.

        Not recursive. ``async_op=True`` returns an :class:`UnshardHandle` whose
        ``wait()`` completes it (forward also waits); otherwise returns None, done.
        """
        if not isinstance(async_op, bool):
            raise TypeError(f"async_op must be a bool, got {async_op!r}")
        handle = UnshardHandle(self._vefsdp_state.group)
        g = self._vefsdp_state.group
        if g is not None:
            g.unshard(async_op=async_op)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free the all-gathered parameters and register the sharded ones."""
        g = self._vefsdp_state.group
        if g is not None:
            g.reshard()

    def _states(self, recurse: bool) -> Iterable[FSDPState]:
        mods = self.modules() if recurse else [self]  # type: ignore[attr-defined]
        return [m._vefsdp_state for m in mods if isinstance(m, FSDPModule)]

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Off: backward accumulates unreduced gradients; the next synced backward reduces."""
        if not isinstance(requires_gradient_sync, bool):
            raise TypeError(f"requires_gradient_sync must be a bool, got {requires_gradient_sync!r}")
        for s in self._states(recurse):
            if s.group is not None:
                s.group.requires_gradient_sync = requires_gradient_sync

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        if not isinstance(reshard_after_forward, bool):
            raise TypeError(f"reshard_after_forward must be a bool, got {reshard_after_forward!r}")
        for s in self._states(recurse):
            s.reshard_after_forward = reshard_after_forward

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these modules' groups (async) at this module's forward start."""
        self._vefsdp_state.fwd_prefetch = [_state_of(m) for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these modules' groups (async) at this module's backward start."""
        self._vefsdp_state.bwd_prefetch = [_state_of(m) for m in modules]


def _state_of(m: object) -> FSDPState:
    if not isinstance(m, FSDPModule):
        raise ValueError(f"expected a fully_shard'd module, got {type(m).__name__}")
    return m._vefsdp_state


def _default_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    acc = getattr(torch, mesh.device_type)
    return torch.device(mesh.device_type, acc.current_device())


def _init_mesh() -> DeviceMesh:
    if not dist.is_initialized():
        raise ValueError("fully_shard needs torch.distributed initialised or an explicit mesh")
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    dt = acc.type if acc is not None else "cpu"
    return init_device_mesh(dt, (dist.get_world_size(),))


def fully_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> nn.Module:
    """Shard ``module``'s own parameters (not those of fully_shard'd descendants).

    ``mesh``: a 1-D DeviceMesh (shard over it) or a 2-D (replicate, shard) HSDP mesh;
    default: every rank of the default group on the current device type. Returns the
    same module, whose class now also derives from :class:`FSDPModule`.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard expects an nn.Module, got {type(module).__name__}")
    if isinstance(module, FSDPModule):
        raise ValueError(f"fully_shard was already applied to this {type(module).__name__}")
    if not isinstance(reshard_after_forward, bool):
        raise NotImplementedError(
            f"reshard_after_forward must be a bool, got {reshard_after_forward!r}; "
            "resharding to a smaller world (int) is not supported")
    mp_policy = MixedPrecisionPolicy() if mp_policy is None else mp_policy
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}")
    mesh = _init_mesh() if mesh is None else mesh
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim == 1:
        shard_pg, replicate_pg = mesh.get_group(0), None
    elif mesh.ndim == 2:
        shard_pg, replicate_pg = mesh.get_group(1), mesh.get_group(0)
    else:
        raise ValueError(f"mesh must be 1-D (shard) or 2-D (replicate, shard), got {mesh.ndim}-D {mesh}")
    device = _default_device(mesh)
    params = _collect(module, device)
    data = {}
    for mp in params:
        data[mp.fqn] = mp.sharded_src  # type: ignore[attr-defined]
        del mp.sharded_src  # type: ignore[attr-defined]
    group = ParamGroup(params, shard_pg=shard_pg, replicate_pg=replicate_pg, device=device,
                       mp_policy=mp_policy, data=data) if params else None
    if group is not None:
        group.register(sharded=True)
    else:  # ranks that do hold parameters here check their signature against this one
        check_group_consistent([], shard_pg, replicate_pg if replicate_pg is not None and
                               replicate_pg.size() > 1 else None)
    _move_buffers(module, device)
    state = FSDPState(module, group, reshard_after_forward, mp_policy)
    # id -> original Parameter (weak: tensors compare elementwise, so no WeakSet)
    state.originals = weakref.WeakValueDictionary({id(mp.original): mp.original for mp in params})
    for mp in params:
        del mp.original
    module.register_forward_pre_hook(state.pre_forward, prepend=True, with_kwargs=True)
    module.register_forward_hook(state.post_forward, prepend=False, with_kwargs=True)
    cls = type(module)
    new_cls = _CLS_CACHE.get(cls)
    if new_cls is None:
        new_cls = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
        _CLS_CACHE[cls] = new_cls
    module.__class__ = new_cls
    module._vefsdp_state = state
    return module


def _move_buffers(module: nn.Module, device: torch.device) -> None:
    """Buffers stay replicated (as in FSDP2); only their device follows the mesh."""
    for sub in module.modules():
        for name, b in list(sub._buffers.items()):
            if b is not None and b.device != device:
                sub._buffers[name] = b.to(device)


def _collect(module: nn.Module, device: torch.device) -> list[ManagedParam]:
    """This module's parameters not managed by a fully_shard'd descendant."""
    managed: dict[int, ManagedParam] = {}
    order: list[ManagedParam] = []
    inner_ids: set[int] = set()
    for sub in module.modules():
        if sub is not module and isinstance(sub, FSDPModule):
            inner_ids.update(id(m) for m in sub.modules())
    for mname, sub in module.named_modules(remove_duplicate=False):
        if id(sub) in inner_ids:
            continue
        for attr, p in list(sub._parameters.items()):
            if p is None:
                continue
            if isinstance(p, ShardedParameter):
                raise ValueError(
                    f"parameter {mname + '.' if mname else ''}{attr} is shared with a module already "
                    "managed by a nested fully_shard; tied parameters must be managed by one group: "
                    "apply fully_shard to their lowest common ancestor only")
            fqn = f"{mname}.{attr}" if mname else attr
            mp = managed.get(id(p))
            if mp is None:
                mp = ManagedParam(fqn, [], p.shape, p.requires_grad)
                mp.sharded_src = p.detach().to(device)  # type: ignore[attr-defined]
                mp.original = p  # type: ignore[attr-defined]
                managed[id(p)] = mp
                order.append(mp)
            if (sub, attr) not in mp.slots:
                mp.slots.append((sub, attr))
    # a parameter of this module also held by a managed child (whose slot now holds a copy)
    inner_originals = [sub._vefsdp_state.originals for sub in module.modules()
                       if sub is not module and isinstance(sub, FSDPModule)]
    for mp in order:
        for orig in inner_originals:
            if orig.get(id(mp.original)) is mp.original:
                raise ValueError(
                    f"parameter {mp.fqn} is shared with a nested fully_shard'd module; tied "
                    "parameters must be managed by one group: apply fully_shard to their lowest "
                    "common ancestor only")
    return order
