"""FSDPModule: the methods fully_shard adds to a module's class, and UnshardHandle."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch.distributed.fsdp import FSDPModule as _TorchFSDPModule

from vefsdp_optim._torch_compat import module_apply, module_parameters

from ._group import ShardGroup
from ._state import FSDPState
from ._streams import check_event, check_stream

__all__ = ["FSDPModule", "UnshardHandle", "state_of"]


class UnshardHandle:
    """A pending :meth:`FSDPModule.unshard` (FSDP2's ``UnshardHandle``).

    ``wait()`` completes the all-gather and registers the unsharded parameters on the
    module; calling it again does nothing. Forward waits by itself when not called.
    """

    def __init__(self, shard_groups: list[ShardGroup]) -> None:
        self._shard_groups = shard_groups

    def wait(self) -> None:
        shard_groups, self._shard_groups = self._shard_groups, []
        for shard_group in shard_groups:
            shard_group.wait_unshard()
            shard_group.register(sharded=False)


class FSDPModule(_TorchFSDPModule):
    """Added to a fully_shard'd module's class: FSDP2's ``FSDPModule`` (an instance of
    ``torch.distributed.fsdp.FSDPModule``, so frameworks' ``isinstance`` checks see it)
    with every public method implemented on this library's shard groups, with FSDP2's
    semantics; the few that have no meaning here raise NotImplementedError."""

    # [FSDPX, this class, torch's FSDPModule, the module's class, ...]: torch's __new__
    # (indexing into containers) constructs the original class from this index
    _orig_cls_mro_index: int = 3
    # _vefsdp_state, the module's FSDPState, is set by fully_shard. Not a class annotation:
    # subclasses whose __init_subclass__ evaluates the MRO's type hints (Hugging Face's
    # PreTrainedModel) would fail on a name imported only for type checking.

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters and register the unsharded ones.

        Not recursive. ``async_op=True`` returns an :class:`UnshardHandle` whose
        ``wait()`` completes it (forward also waits); otherwise returns None, done.
        """
        if not isinstance(async_op, bool):
            raise TypeError(f"async_op must be a bool, got {async_op!r}")
        handle = UnshardHandle(list(self._vefsdp_state.shard_groups))
        for shard_group in self._vefsdp_state.shard_groups:
            shard_group.unshard(async_op=async_op)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free the all-gathered parameters and register the sharded ones (not recursive)."""
        for shard_group in self._vefsdp_state.shard_groups:
            shard_group.reshard()

    def reset_iter_state(self) -> None:
        """After an exception aborted a forward or backward: wait for in-flight
        collectives, discard that iteration's gradients, reshard. Root only."""
        st = self._vefsdp_state
        if st.ctx is not None and not st.is_root:
            raise RuntimeError("reset_iter_state must be called on the root fully_shard'd module")
        for s in st.ctx.states if st.ctx is not None else self._states(True):
            s.reset()
        if st.ctx is not None:
            st.ctx.reset()

    def _states(self, recurse: bool) -> Iterable[FSDPState]:
        mods = self.modules() if recurse else [self]  # type: ignore[attr-defined]
        return [m._vefsdp_state for m in mods if isinstance(m, FSDPModule)]

    def _shard_groups(self, recurse: bool = False) -> list[ShardGroup]:
        return [g for s in self._states(recurse) for g in s.shard_groups]

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for FSDP2 compatibility: every backward completes its reductions in
        the root's final callback, last or not, so the flag changes nothing here."""
        _check_bool("is_last_backward", is_last_backward)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *,
                                   recurse: bool = True) -> None:
        """Off: backward accumulates unreduced gradients; the next synced backward reduces
        (FSDP1's ``no_sync``). Controls reduce-scatter and HSDP's all-reduce together."""
        _check_bool("requires_gradient_sync", requires_gradient_sync)
        for shard_group in self._shard_groups(recurse):
            shard_group.requires_gradient_sync = requires_gradient_sync
            shard_group.requires_all_reduce = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: off skips the replicate all-reduce (the reduce-scatter still runs); the
        partial result joins the next all-reduce (see ``ShardGroup`` in
        vefsdp_optim/_fsdp/_group.py)."""
        _check_bool("requires_all_reduce", requires_all_reduce)
        for shard_group in self._shard_groups(recurse):
            shard_group.requires_all_reduce = requires_all_reduce

    def set_gradient_copy_in(self, enabled: bool, *, recurse: bool = True) -> None:
        """True (the default): autograd makes gradients one parameter at a time and the
        shard group's end of backward copies them into its flat reduce-scatter buffer (FSDP2's
        peak memory). False: backward adds them straight into the buffer, allocated at
        store's first gradient (no copy at all; one shard group's buffer more memory).
        [Note: lazy gradient buffer]; not a FSDP2 method."""
        _check_bool("enabled", enabled)
        for shard_group in self._shard_groups(recurse):
            shard_group.grad_copy_in = enabled

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        _check_bool("reshard_after_forward", reshard_after_forward)
        for s in self._states(recurse):
            s.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *,
                                   recurse: bool = True) -> None:
        """Off: keep the unsharded parameters after backward (e.g. between microbatches)."""
        _check_bool("reshard_after_backward", reshard_after_backward)
        for s in self._states(recurse):
            s.reshard_after_backward = reshard_after_backward

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these modules' shard groups (async) at this module's forward start."""
        self._vefsdp_state.fwd_prefetch = [state_of(m) for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these modules' shard groups (async) at this module's backward start."""
        self._vefsdp_state.bwd_prefetch = [state_of(m) for m in modules]

    def set_custom_all_gather(self, comm: object) -> None:
        raise NotImplementedError(
            "set_custom_all_gather is not supported: fully_shard all-gathers each store's flat "
            "buffer with one all_gather_single into its global buffer (zero copy)")

    def set_custom_reduce_scatter(self, comm: object) -> None:
        raise NotImplementedError(
            "set_custom_reduce_scatter is not supported: fully_shard reduce-scatters each store's "
            "flat gradient buffer with one reduce_scatter_single; see set_gradient_divide_factor "
            "and set_all_reduce_hook")

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *,
                            stream: object | None = None) -> None:
        """``hook(reduce_output)`` runs on each store's reduced gradient shard (after HSDP's
        all-reduce), before it becomes the sharded ``.grad``. On an accelerator it runs on
        ``stream`` (default: the all-reduce stream), as FSDP2's; under HSDP it runs on the
        all-reduce stream, and ``stream`` raises ValueError ([Note: fully_shard streams]).
        On the CPU there are no streams and ``stream`` changes nothing."""
        if not callable(hook):
            raise TypeError(f"hook must be callable, got {hook!r}")
        if stream is not None:
            check_stream(stream)
        groups = self._shard_groups()
        if stream is not None and any(g.settings.replicate_process_group is not None
                                      for g in groups):
            raise ValueError("set_all_reduce_hook: stream cannot be set when using native HSDP "
                             "(a 2-D mesh): the hook runs on the all-reduce stream after the "
                             "all-reduce; pass stream=None")
        for shard_group in groups:
            shard_group.all_reduce_hook = hook
            shard_group.all_reduce_hook_stream = stream

    def set_post_optim_event(self, event: object) -> None:
        """As FSDP2: the root's next forward makes the all-gather streams wait on
        ``event`` (recorded after the optimizer step) instead of the current stream, and
        then drops it; call it with a new event each iteration ([Note: fully_shard
        streams]). On the CPU there are no streams: it changes nothing."""
        check_event(event)
        st = self._vefsdp_state
        if st.ctx is not None:
            st.ctx.comm.post_optim_event = event
        else:
            st.post_optim_event = event

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated in FSDP2: :meth:`set_gradient_divide_factor`."""
        self.set_gradient_divide_factor(factor)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the summed gradients by ``factor`` instead of averaging them over the
        data-parallel ranks (see ``ShardGroup`` in vefsdp_optim/_fsdp/_group.py); 1.0 gives sums."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
            raise ValueError(f"gradient divide factor must be a positive number, got {factor!r}")
        for shard_group in self._shard_groups():
            shard_group.gradient_divide_factor = float(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Only SUM collectives, with the division done separately."""
        _check_bool("enable", enable)
        for shard_group in self._shard_groups():
            shard_group.force_sum_reduction = enable

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *,
                                         recurse: bool = True) -> None:
        """False (the default, as FSDP2): a parameter this rank did not use since the last
        reduction keeps ``.grad`` None, so every rank of a shard group must use it or none
        must. True: every parameter that requires grad gets its reduced gradient, zero
        where no rank used it (conditional control flow, mixture of experts), as FSDP2's
        option and DDP's ``find_unused_parameters``. See ``StoreGrads`` in
        vefsdp_optim/_fsdp/_grads.py."""
        _check_bool("reduce_scatter_unused_params", reduce_scatter_unused_params)
        for shard_group in self._shard_groups(recurse):
            shard_group.reduce_scatter_unused_params = reduce_scatter_unused_params

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *,
                                             recurse: bool = True) -> None:
        """Accepted: fully_shard's reduce-scatter input is the store's own gradient buffer
        (no copy-in buffer), at most one shard group's in flight."""
        if (isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int)
                or max_input_buffers < 1):
            raise ValueError(f"max_input_buffers must be an int >= 1, got {max_input_buffers!r}")

    def set_separate_reduce_scatter_group(self, *args: object, **kwargs: object) -> None:
        raise NotImplementedError("set_separate_reduce_scatter_group is not supported by "
                                  "vefsdp_optim.fully_shard (one process group per mesh axis)")

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Off: backward does not all-gather this module's parameters (when its backward
        does not need them, e.g. an embedding)."""
        _check_bool("unshard_in_backward", unshard_in_backward)
        self._vefsdp_state.unshard_in_backward = unshard_in_backward

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        raise NotImplementedError("set_allocate_memory_from_process_group_for_comm: fully_shard's "
                                  "collectives use the stores' own buffers, with no staging copies")

    def set_symm_mem_for_comm(self, *args: object, **kwargs: object) -> None:
        raise NotImplementedError("set_symm_mem_for_comm is not supported by "
                                  "vefsdp_optim.fully_shard")

    def _get_fsdp_state(self) -> object:
        raise NotImplementedError(
            "this module was sharded by vefsdp_optim.fully_shard, not torch's: it has no FSDP2 "
            "state; use its FSDPModule methods")

    def _apply(self, *args: object, **kwargs: object) -> object:
        """``module.to(...)``, ``to_empty(...)``, ``cuda()``, ...: buffers and parameters
        that fully_shard does not manage follow ``fn``; the managed ones stay in the
        group's flat buffers on the mesh's device (their storage, which the collectives
        and the optimizers share), so ``to_empty(device=...)`` after a meta-device
        construction keeps them. A change of dtype raises (use MixedPrecisionPolicy)."""
        self.reshard()
        slots = [(m, a, module_parameters(m)[a]) for g in self._shard_groups(recurse=True)
                 for mp in g.params for m, a in mp.slots]
        dtypes = {id(p): p.dtype for _, _, p in slots}
        for m, a, _ in slots:
            module_parameters(m)[a] = None  # nn.Module._apply skips None entries
        try:
            out = module_apply(_TorchFSDPModule, self, *args, **kwargs)
        finally:
            for m, a, p in slots:
                module_parameters(m)[a] = p
        fn = args[0] if args else kwargs.get("fn")
        for _, _, p in slots[:1]:
            probe = fn(torch.empty(0, dtype=dtypes[id(p)],
                                   device=p.device)) if callable(fn) else None
            if isinstance(probe, torch.Tensor) and probe.dtype != dtypes[id(p)]:
                raise NotImplementedError(
                    f"changing the dtype of fully_shard'd parameters ({dtypes[id(p)]} -> "
                    f"{probe.dtype}) is not supported; shard the module in the dtype you "
                    "want, or use MixedPrecisionPolicy(param_dtype=...)")
        return out


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")


def state_of(m: object) -> FSDPState:
    if not isinstance(m, FSDPModule):
        raise ValueError(f"expected a fully_shard'd module, got {type(m).__name__}")
    return m._vefsdp_state
