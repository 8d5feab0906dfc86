"""The gradient side of a DtypeStore: attachment, the lazy gradient buffer, the
reduce-scatter and its epilogue, and the debug check that ranks used members alike.

:class:`StoreGrads` holds these methods of :class:`DtypeStore` (_store.py), which derives
from it; they read the store's buffers and settings and know nothing of its shard group
(see ``StoreSettings`` in vefsdp_optim/_fsdp/_settings.py). The knobs a user may change
between steps arrive with every call that reads them, as :class:`GradSettings`
(_settings.py).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from vefsdp_optim._debug import check_every_step
from vefsdp_optim._torch_compat import foreach_copy_, storage_use_count
from vefsdp_optim.comm import DistributedBuffer, FlatWork, all_reduce_avg

from ._param import ManagedParam
from ._settings import GradSettings, StoreSettings
from ._streams import NO_STREAMS, CommContext, Streams

__all__ = ["PendingReduce", "StoreGrads"]


# [Note: lazy gradient buffer]
# At W > 1 the W*m gradient buffer gets its bytes late, zero-filled, not at
# pre-backward. The first backward after a reduction leaves each unsharded ``.grad``
# None. What follows depends on the shard group's policy, set by
# ``FSDPModule.set_gradient_copy_in``.
#   - Copy-in, the default. Autograd makes each parameter's gradient as usual. The shard
#     group's end of backward allocates the buffer and copies them in, one copy of the
#     shard group's gradients, as FSDP2's copy-in does. A module's gradients then take
#     memory one parameter at a time, as FSDP2's do, and the peak is FSDP2's. The
#     measurement is in docs/decisions.md.
#   - In place, with ``set_gradient_copy_in(False)``. A hook on the gradients of the
#     unsharded parameters runs before AccumulateGrad. It allocates the buffer at the
#     store's first gradient and points every ``.grad`` at its view. Autograd then adds
#     into it as the comment above ``ManagedParam`` in vefsdp_optim/_fsdp/_param.py
#     says. There is no copy, and one store's buffer more is live.
# Later backwards of an accumulation without sync add into the buffer in place either
# way. Under activation checkpointing the recomputation runs first. So the buffer and the
# recomputed activations no longer overlap with an earlier shard group's reduce-scatter
# input. Just before allocating, completed reduce-scatters of earlier shard groups are
# finished, which frees their inputs (see ``StoreGrads.launch_reduce``). A backward in
# which no gradient reached the store still reduces zeros.


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _ensure_storage(t: torch.Tensor) -> None:
    """Give a released base tensor its bytes back (contents undefined)."""
    st = t.untyped_storage()
    if st.nbytes() < _nbytes(t):
        st.resize_(_nbytes(t))


def _release_storage(t: torch.Tensor) -> None:
    st = t.untyped_storage()
    if st.nbytes():
        st.resize_(0)


def _uses(t: torch.Tensor) -> int:
    """Tensors (and the storage object) sharing ``t``'s storage."""
    return storage_use_count(t)


class StoreGrads:
    """The gradient methods of :class:`DtypeStore`, which sets these attributes.

    Unused parameters: a shard group reduces its whole gradient buffer, so each member's
    reduced slice exists whether any rank used the member or not. Which members get a
    ``.grad`` follows FSDP2: a hook on each unsharded parameter (and ``add_grad``) records
    the members this rank gave a gradient since the last reduction; after the reduction
    only those get their sharded ``.grad`` (a ``.grad`` the user kept stays, with zeros
    added). A member no rank used then keeps ``.grad`` None, as on one device, so
    optimizers skip it instead of applying weight decay and momentum to a zero gradient.
    The rule is local, so it costs no collective and no host read: as under FSDP2, every
    rank must use a member in a backward or none must (FSDP2 mismatches its
    reduce-scatter otherwise; here the ranks that did not use it would leave their slice
    unstepped). Debug mode ([Note: consistent steps]) all-reduces the marks and raises on
    a partial use. For conditional use (mixture of experts, skipped branches)
    ``set_reduce_scatter_unused_params(True)``, FSDP2's option, gives every member its
    reduced gradient, zero where no rank used it: DDP's ``find_unused_parameters``
    answer, which needs no knowledge of the other ranks."""

    params: list[ManagedParam]
    settings: StoreSettings
    master: DistributedBuffer
    compute: DistributedBuffer
    reduce: DistributedBuffer
    _lazy: bool  # ``StoreGrads.release_grads``, [Note: lazy gradient buffer]
    _gbuf: torch.Tensor | None  # compute's W*m gradient buffer, once allocated
    _awaiting: bool
    _awaited_settings: GradSettings | None
    _used: set[str]
    _kept: torch.Tensor | None
    _partial: bool
    _grad_uses: int  # the gradient shard's storage use count after build

    def grad_shard(self) -> torch.Tensor:
        """``master.local_grad`` with its storage (1-D, m elements; contents undefined
        when it had been released, ``StoreGrads.release_grads``)."""
        _ensure_storage(self.master.local_grad)
        return self.master.local_grad

    def release_grads(self) -> None:
        """Give back the shard gradient's bytes if no ``.grad`` refers to them.

        At W > 1 no gradient bytes outlive their use. The m-element shard gradient
        (``master.local_grad``; the sharded ``.grad`` are views of it) gets its storage when
        a reduce-scatter writes it and gives it back once no ``.grad`` refers to it any
        more (``zero_grad(set_to_none=True)``), checked before the next forward: FSDP2
        frees its sharded gradients the same way, by dropping them. "No one refers to it"
        is the storage's use count back at its value after build (the buffer's own views),
        so a ``.grad`` (or a view of it) the user kept keeps the bytes. The mixed-precision
        staging shards (``compute`` / ``reduce`` local_grad) hold bytes only around a
        reduction. Storages are resized in place, as the global buffers
        (``DistributedBuffer`` in comm/_buffer.py), so every cached view stays valid."""
        t = self.master.local_grad
        if (self._lazy and t.untyped_storage().nbytes() and self._kept is None
                and all(p.sharded.grad is None for p in self.params)
                and _uses(t) == self._grad_uses):
            _release_storage(t)

    def direct(self, grad_settings: GradSettings) -> bool:
        """W == 1 without mixed precision nor a division: autograd accumulates into
        master.local_grad."""
        settings = self.settings
        return (settings.world_size == 1 and self.compute is self.master
                and self.reduce is self.master
                and settings.replicate_process_group is None
                and grad_settings.all_reduce_hook is None
                and (grad_settings.native_average
                     or (grad_settings.gradient_divide_factor or 1.0) == 1.0))

    def attach_grads(self, fresh: bool, grad_settings: GradSettings) -> None:
        """Point each unsharded param's .grad at the compute gradient buffer.

        ``fresh``: first backward since the last reduction, so the buffer starts at zero
        (for ``direct`` stores: except where a kept sharded .grad is accumulated).
        """
        compute = self.compute
        if self._lazy:
            if fresh:  # [Note: lazy gradient buffer]
                self._awaiting = True
                self._awaited_settings = grad_settings
                for p in self.params:
                    if p.unsharded is not None:
                        p.unsharded.grad = None
                return
            self._alloc_grad_buffer()  # holds the gradients accumulated without a sync
        compute.alloc_grad_global()
        if fresh and self.settings.world_size == 1:
            with torch.no_grad():
                if self.direct(grad_settings):
                    for p in self.params:
                        if p.requires_grad and p.sharded.grad is None:
                            self.master.local_grad_view(p.fqn).zero_()
                else:
                    if compute is self.master:  # the buffer holds the kept grads: set them aside
                        self._kept = self._kept_grads()
                    compute.grad_global.zero_()
        for p in self.params:
            if p.requires_grad and p.unsharded is not None:
                p.unsharded.grad = p.unsharded_face(compute.grad_full_view(p.fqn))

    def _alloc_grad_buffer(self) -> None:
        """Give the compute gradient buffer its bytes, zero-filled."""
        compute = self.compute
        if compute.grad_global_allocated:
            return
        if self._gbuf is None:  # first time: the buffer sizes itself and makes its views
            compute.alloc_grad_global()
            self._gbuf = compute.grad_global
            return
        _ensure_storage(self._gbuf)
        with torch.no_grad():
            self._gbuf.zero_()

    def _on_grad(self, fqn: str, grad: torch.Tensor) -> None:
        """Hook on an unsharded parameter's gradient, before AccumulateGrad: marks ``fqn``
        used (see the class docstring); the store's first gradient allocates the buffer
        ([Note: lazy gradient buffer]), under the settings of the backward that
        ``attach_grads`` began."""
        self._used.add(fqn)
        if not self._lazy or not self._awaiting or self._awaited_settings.copy_in:
            return
        self._awaiting = False
        self._awaited_settings.before_grad_alloc()
        self._alloc_grad_buffer()
        for p in self.params:
            if p.requires_grad and p.unsharded is not None:
                p.unsharded.grad = p.unsharded_face(self.compute.grad_full_view(p.fqn))

    def add_grad(self, p: ManagedParam, grad: torch.Tensor) -> None:
        """Add ``grad`` to ``p``'s unsharded ``.grad`` as AccumulateGrad would (a gradient
        from outside autograd's path to it: [Note: use outside forward] in _state.py)."""
        u = p.unsharded
        if u is None or not p.requires_grad:
            raise AssertionError(f"{p.fqn}: a gradient for a parameter without an unsharded face")
        self._on_grad(p.fqn, grad)  # [Note: lazy gradient buffer]: maybe the store's first gradient
        with torch.no_grad():
            g = grad.detach().reshape(u.shape)
            if u.grad is None:  # a copy: autograd may hand the same tensor to other nodes
                u.grad = g.to(u.dtype, memory_format=torch.contiguous_format, copy=True)
            else:
                u.grad.add_(g)

    def complete_grads(self, grad_settings: GradSettings) -> None:
        """End of a backward: a lazy buffer gets its bytes now (zero where no gradient
        came), with the gradients autograd made copied in ([Note: lazy gradient buffer])."""
        if not self._awaiting:
            return
        self._awaiting = False
        if not grad_settings.copy_in:
            self._alloc_grad_buffer()
            return
        grad_settings.before_grad_alloc()
        self._alloc_grad_buffer()
        views, grads = [], []
        for p in self.params:
            grad = p.unsharded.grad if p.unsharded is not None else None
            if grad is not None:
                view = self.compute.grad_full_view(p.fqn)
                views.append(view)
                grads.append((p.tp.local(grad) if p.tp is not None else grad).reshape(view.shape))
                p.unsharded.grad = None
        if views:
            with torch.no_grad():
                foreach_copy_(views, grads)  # one copy-in of the store's gradients

    def _kept_grads(self) -> torch.Tensor | None:
        """A copy of the kept sharded .grad (1-D, m elements), or None when none is kept."""
        master = self.master
        kept = [p for p in self.params if p.requires_grad and p.sharded.grad is not None]
        if not kept:
            return None
        out = torch.zeros_like(master.local_grad)
        for p in kept:
            v = master.local_grad_view(p.fqn)
            a = v.storage_offset() - master.local_grad.storage_offset()
            out[a:a + v.numel()] = v
        return out

    def launch_reduce(self, grad_settings: GradSettings, streams: Streams = NO_STREAMS,
                      hook_stream: Any = None) -> PendingReduce | None:
        """Start the reduce-scatter (avg) of the accumulated gradients; ``finish_reduce`` ends it.

        The collective is launched with ``async_op=True`` so that it runs while autograd
        computes the previous shard group's gradients; everything that reads its output
        (the division of gloo's SUM-as-AVG, HSDP's replicate all-reduce, the cast into the
        master's dtype, kept-gradient accumulation, the sharded ``.grad`` views) happens in
        ``finish_reduce``, after ``wait()``. The gradient buffer (the collective's input)
        stays allocated until then. On an accelerator the collective and that epilogue are
        issued here, on the side streams, and ``finish_reduce`` only frees the input
        ([Note: fully_shard streams]).
        """
        compute, reduce, master = self.compute, self.reduce, self.master
        world_size = self.settings.world_size
        if not any(p.requires_grad for p in self.params):
            return None
        self.complete_grads(grad_settings)
        if not compute.grad_global_allocated:
            return None
        if self.direct(grad_settings):
            prev = None
        elif self._kept is not None or (world_size == 1 and compute is master):
            prev, self._kept = self._kept, None  # set aside by attach_grads
        else:  # the user kept last step's grads: add the new ones to them
            prev = self._kept_grads()
        if reduce is not compute:
            reduce.alloc_grad_global()
            with torch.no_grad():
                reduce.grad_global.copy_(compute.grad_global)
            compute.free_grad_global()
        op = "avg" if grad_settings.native_average else "sum"
        if self._lazy:
            _ensure_storage(reduce.local_grad)  # the collective's output
        if not streams.active:
            work = reduce.reduce_scatter(op=op, async_op=True) if world_size > 1 else None
            return PendingReduce(work, prev)
        if reduce is not master:  # the epilogue's output: allocated on the current stream
            self.grad_shard()
        rs = streams.reduce_scatter
        streams.wait_stream(rs, None)  # the gradients were written on the current stream
        with streams.use(rs):
            if world_size > 1:
                reduce.reduce_scatter(op=op)
            rs_event = streams.record(rs)  # the input's last use
        post_event = self._reduce_epilogue(prev, grad_settings, streams, hook_stream)
        return PendingReduce(None, prev, rs_event, post_event)

    def _reduce_epilogue(self, prev: torch.Tensor | None, grad_settings: GradSettings,
                         streams: Streams, hook_stream: Any) -> Any:
        """What follows the reduce-scatter, in order (see ``StoreGrads.launch_reduce`` and
        ``ShardGroup`` in vefsdp_optim/_fsdp/_group.py): the division, the kept partial sum, HSDP's
        all-reduce (its own stream), the hook (the all-reduce stream under HSDP, else
        ``hook_stream`` or the all-reduce stream), the cast into the master's dtype and the
        kept gradients. Returns the event recorded after it (None without streams)."""
        reduce, master = self.reduce, self.master
        settings = self.settings
        replicate = settings.replicate_process_group
        last = streams.reduce_scatter
        with torch.no_grad():
            with streams.use(last):
                if not grad_settings.native_average:
                    factor = (grad_settings.gradient_divide_factor
                              or float(settings.world_size * settings.replicate_world_size))
                    if factor != 1.0:
                        reduce.local_grad.div_(factor)
                if prev is not None and self._partial:  # the kept grads were never all-reduced
                    reduce.local_grad.add_(prev.to(device=reduce.local_grad.device,
                                                   dtype=reduce.local_grad.dtype))
                    prev = None
            if replicate is not None and grad_settings.requires_all_reduce:
                streams.wait_stream(streams.all_reduce, last)
                last = streams.all_reduce
                with streams.use(last):
                    if grad_settings.native_average:
                        all_reduce_avg(reduce.local_grad, replicate)
                    else:
                        dist.all_reduce(reduce.local_grad, op=dist.ReduceOp.SUM, group=replicate)
            self._partial = replicate is not None and not grad_settings.requires_all_reduce
            if grad_settings.all_reduce_hook is not None:
                stream = (streams.all_reduce if replicate is not None or hook_stream is None
                          else hook_stream)
                streams.wait_stream(stream, last)
                last = stream
                with streams.use(last):
                    grad_settings.all_reduce_hook(reduce.local_grad)
            with streams.use(last):
                if reduce is not master:  # under offload: device to host, asynchronous unless
                    # the host adds to the result next (see ``DtypeStore`` in
                    # vefsdp_optim/_fsdp/_store.py)
                    self.grad_shard().copy_(reduce.local_grad,
                                            non_blocking=streams.active and settings.pinned
                                            and prev is None)
                if prev is not None:
                    master.local_grad.add_(prev)
                return streams.record(last) if streams.active else None

    def finish_reduce(self, pending: PendingReduce, grad_settings: GradSettings,
                      comm: CommContext | None = None) -> None:
        """Wait for ``launch_reduce``'s collective, then the in-order epilogue (see its Note
        and ``ShardGroup`` in vefsdp_optim/_fsdp/_group.py). On an accelerator the epilogue
        was issued at launch: the current stream waits on the collective, which frees its
        input; the staging buffers it read are released once the current stream has waited on
        the epilogue's event, in the root's final callback ([Note: fully_shard streams])."""
        compute, reduce, master = self.compute, self.reduce, self.master
        settings = self.settings
        streams = comm.streams if comm is not None else NO_STREAMS
        if pending.work is not None:
            pending.work.wait()
        if not streams.active:
            self._reduce_epilogue(pending.prev, grad_settings, NO_STREAMS, None)
        else:
            streams.wait_event(None, pending.rs_event)
        staging = settings.world_size > 1 and reduce is not master
        if settings.world_size > 1:
            reduce.free_grad_global()
            compute.free_grad_global()
            if staging and not streams.active:
                _release_storage(reduce.local_grad)
        if streams.active:
            def release(pending: PendingReduce = pending) -> None:  # holds prev until then
                if staging:
                    _release_storage(reduce.local_grad)

            comm.add_post_reduce(pending.post_event, release, host=settings.offload)
        used, self._used = self._used, set()
        if (settings.world_size * settings.replicate_world_size > 1
                and not grad_settings.reduce_scatter_unused_params):
            if check_every_step():
                self._check_used_alike(used)
        for p in self.params:
            if p.requires_grad:
                # unused parameters (the class docstring); a fresh alias: the use count sees who
                # holds it
                if p.sharded.grad is None and (p.fqn in used
                                               or grad_settings.reduce_scatter_unused_params):
                    p.sharded.grad = p.sharded.with_local(master.local_grad_view(p.fqn).view(-1))
                if p.unsharded is not None:
                    p.unsharded.grad = None

    def _check_used_alike(self, used: set[str]) -> None:
        """Debug check (see the class docstring): every rank of the shard group (and of
        HSDP's replicate group) used each member since the last reduction, or none did."""
        settings = self.settings
        members = [p.fqn for p in self.params if p.requires_grad]
        counts = torch.tensor([int(fqn in used) for fqn in members], dtype=torch.int32,
                              device=settings.device)
        dist.all_reduce(counts, group=settings.process_group)
        if settings.replicate_process_group is not None:
            dist.all_reduce(counts, group=settings.replicate_process_group)
        ranks = settings.world_size * settings.replicate_world_size
        partial = [f"{fqn} ({c} of {ranks} ranks)"
                   for fqn, c in zip(members, counts.tolist(), strict=True) if 0 < c < ranks]
        if partial:
            raise ValueError(
                "fully_shard: parameters got a gradient on some ranks of their shard group "
                f"only since the last reduction: {', '.join(partial)}. As under FSDP2, every rank "
                "must use a parameter in a backward or none must; for conditional use (mixture of "
                "experts, skipped branches) call set_reduce_scatter_unused_params(True) on the "
                "module, which gives every rank the reduced gradient, zero where no rank used it")


class PendingReduce(NamedTuple):
    """A store's launched reduce-scatter: its handle (None: no collective, or issued on
    the streams) and kept grads; on an accelerator, its events ([Note: fully_shard streams])."""

    work: FlatWork | None
    prev: torch.Tensor | None  # 1-D, m elements: the kept local grad to add back; None: none kept
    rs_event: Any = None  # recorded after the collective (its input's last use)
    post_event: Any = None  # recorded after the epilogue (the output's last write)

    def done(self, streams: Streams) -> bool:
        """The collective has completed (asked without waiting; a handle that cannot
        tell counts as not completed)."""
        if self.work is not None:
            return getattr(self.work.work, "is_completed", lambda: False)()
        return streams.query(self.rs_event)

