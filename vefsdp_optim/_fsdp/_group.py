"""A shard group: the parameters one fully_shard call manages, which communicate together.

Per original dtype the shard group has one :class:`DtypeStore` (a *store*): one plan
and one master DistributedBuffer (the sharded parameters' storage), plus, under mixed
precision, a compute buffer in ``param_dtype`` (same plan; one cast of the local shard
per all-gather) and a reduce buffer in ``reduce_dtype``. The hooks that fully_shard
installs call into :class:`ShardGroup`: unshard before forward and backward, reshard
after, one reduce-scatter when the shard group's gradients are complete. Where the
shard group is in its step is two explicit states (``GatherState``, ``GradState`` in
_lifecycle.py), which only the shard group changes; its stores hold no reference to it
(see ``StoreSettings`` in vefsdp_optim/_fsdp/_settings.py). The optimizers see each store through a
:class:`StoreBinding` (the ``FlatStore`` of [Note: flat store contract]). See
``ManagedParam`` in vefsdp_optim/_fsdp/_param.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy

from vefsdp_optim._flat_store import StoreReplan
from vefsdp_optim._torch_compat import tensor_version
from vefsdp_optim.comm import same_on_all_ranks

from ._grads import PendingReduce
from ._lifecycle import GatherState, GradState, advance
from ._param import ManagedParam
from ._replan import move_store, plan_replan
from ._settings import GradSettings, StoreSettings
from ._store import DtypeStore, PendingGather
from ._streams import NO_STREAMS, CommContext

__all__ = ["ShardGroup", "StoreBinding", "DtypeStore", "check_shard_group_consistent"]

def check_shard_group_consistent(signature: list, shard_process_group: dist.ProcessGroup,
                                 replicate_process_group: dist.ProcessGroup | None,
                                 device: torch.device) -> None:
    """Raise ValueError on every rank unless all ranks hold the same shard group signature.

    One ``same_on_all_ranks`` per process group before the first collective on the
    shard group's buffers (two int64 per rank: ``same_on_all_ranks`` in comm/_collectives.py), on
    ``device``: dtypes, plans and frozen flags that differ (or a module with parameters
    on some ranks only) raise instead of hanging or mixing buffers; only then are the
    signatures gathered, to name the ranks.
    """
    for process_group in (shard_process_group, replicate_process_group):
        if process_group is None or process_group.size() == 1:
            continue
        if same_on_all_ranks(repr(signature), process_group, device):
            continue
        gathered: list[Any] = [None] * process_group.size()
        dist.all_gather_object(gathered, signature, group=process_group)
        bad = [r for r, sig in enumerate(gathered) if sig != gathered[0]]
        if bad:
            raise ValueError(
                f"fully_shard: ranks {bad} of a process group of {process_group.size()} "
                "hold parameters different from rank 0's (dtype, plan fingerprint, requires_grad "
                f"per store): {gathered[bad[0]]} vs {gathered[0]}; every rank must shard the same "
                "module structure")


class StoreBinding:
    """The ``FlatStore`` ([Note: flat store contract]) a sharded parameter is bound to: one
    store of a shard group. The data questions go to the store; a re-plan goes to the shard
    group, which owns the lifecycle transition it needs (see ``StoreSettings`` in
    vefsdp_optim/_fsdp/_settings.py)."""

    __slots__ = ("shard_group", "store", "__weakref__")  # optimizers cache per store, weakly

    def __init__(self, shard_group: ShardGroup, store: DtypeStore) -> None:
        self.shard_group = shard_group
        self.store = store

    def members(self) -> Sequence[torch.Tensor]:
        return self.store.members()

    def flat_param(self) -> torch.Tensor:
        return self.store.flat_param()

    def flat_grad(self) -> torch.Tensor:
        return self.store.flat_grad()

    def segment(self, p: torch.Tensor) -> tuple[int, int]:
        return self.store.segment(p)

    def grads_in_place(self) -> bool:
        return self.store.grads_in_place()

    def add_state_holder(self, holder: torch.optim.Optimizer) -> None:
        self.store.add_state_holder(holder)

    def replan(self, units: Mapping[torch.Tensor, int]) -> StoreReplan | None:
        return self.shard_group.replan(self.store, units)


class ShardGroup:
    """The parameters one ``fully_shard(module)`` call manages, by dtype in DtypeStores."""

    def __init__(self, params: list[ManagedParam], *, shard_process_group: dist.ProcessGroup,
                 replicate_process_group: dist.ProcessGroup | None, device: torch.device,
                 mp_policy: MixedPrecisionPolicy, data: dict[str, torch.Tensor],
                 offload: bool = False, pin_memory: bool = False) -> None:
        replicate = (replicate_process_group if replicate_process_group is not None
                     and replicate_process_group.size() > 1 else None)
        #: fixed at construction, and given to every store (see ``StoreSettings`` in
        #: vefsdp_optim/_fsdp/_settings.py)
        self.settings = StoreSettings(
            shard_process_group, shard_process_group.size(), shard_process_group.rank(), replicate,
            replicate.size() if replicate is not None else 1, device, mp_policy, offload,
            offload and pin_memory)
        self.params = params
        by_dtype: dict[torch.dtype, list[ManagedParam]] = {}
        for p in params:
            by_dtype.setdefault(data[p.fqn].dtype, []).append(p)
        self.stores = [DtypeStore(ps, {}, self.settings, dt, data, validate=False)
                       for dt, ps in by_dtype.items()]
        for store in self.stores:
            binding = StoreBinding(self, store)
            for p in store.params:
                p.sharded.bind_store(binding)
        check_shard_group_consistent(self.signature(), shard_process_group, replicate, device)
        self.requires_gradient_sync = True
        # FSDP2's knobs (FSDPModule.set_*): by default the gradients are averaged over
        # every data-parallel rank (the backend's AVG where it has one, else SUM and one
        # division). With a gradient_divide_factor f, or with force_sum_reduction, every
        # collective is a SUM and the result is divided once by f (default: the number of
        # data-parallel ranks), before HSDP's all-reduce: f = 1 gives summed gradients, as
        # frameworks that normalize the loss themselves expect. requires_all_reduce=False
        # (HSDP) skips the replicate all-reduce; the partial result is kept and joins the
        # next all-reduce. all_reduce_hook(t) runs on the reduced shard before it becomes
        # the sharded .grad.
        self.gradient_divide_factor: float | None = None
        self.force_sum_reduction = False
        self.requires_all_reduce = True
        self.all_reduce_hook: Callable[[torch.Tensor], None] | None = None
        self.all_reduce_hook_stream: Any = None  # set_all_reduce_hook(stream=); not under HSDP
        #: [Note: lazy gradient buffer]: True (default) copies autograd's gradients into the
        #: buffer at the end of backward (FSDP2's memory); False adds into it in place
        self.grad_copy_in = True
        #: ``StoreGrads`` in vefsdp_optim/_fsdp/_grads.py:
        #: FSDPModule.set_reduce_scatter_unused_params
        self.reduce_scatter_unused_params = False
        self.gather_state = GatherState.SHARDED
        self.grad_state = GradState.IDLE
        self._gathers: list[PendingGather] = []  # GATHERING: one per store
        # [Note: fully_shard streams]: the root's, given at its lazy init (before it: none)
        self.comm = CommContext(NO_STREAMS)
        self._side_alloc = False  # the gathered buffers were allocated on the copy-in stream
        # the last all-gather on the side streams (it read compute.local)
        self._gather_event: Any = None
        self._reductions: list[tuple[DtypeStore, PendingReduce]] = []  # REDUCING: launched
        self._gathered_versions: tuple[int, ...] | None = None  # master versions at the last gather
        # called before a store allocates its gradient buffer: finishes completed reductions
        # of earlier shard groups (set by the root's FSDPState; [Note: lazy gradient buffer])
        self.before_grad_alloc: Callable[[], None] = lambda: None

    def grad_settings(self) -> GradSettings:
        """The gradient knobs as they are now, for the stores (see ``StoreSettings`` in
        vefsdp_optim/_fsdp/_settings.py)."""
        return GradSettings(self.grad_copy_in, self.gradient_divide_factor,
                            self.force_sum_reduction,
                            self.requires_all_reduce, self.all_reduce_hook, self.before_grad_alloc,
                            self.reduce_scatter_unused_params)

    def signature(self) -> list[tuple[str, str, tuple[bool, ...]]]:
        """Per store: (dtype, plan fingerprint, requires_grad per parameter); equal on every
        rank."""
        return [(str(store.dtype), store.plan.fingerprint()[:16],
                 tuple(p.requires_grad for p in store.params))
                for store in self.stores]

    def _versions(self) -> tuple[int, ...]:
        return tuple(tensor_version(store.master.local) for store in self.stores)

    def _set_gather(self, new: GatherState) -> None:
        self.gather_state = advance(self.gather_state, new, "ShardGroup.gather_state")

    def _set_grad(self, new: GradState) -> None:
        self.grad_state = advance(self.grad_state, new, "ShardGroup.grad_state")

    @property
    def fresh(self) -> bool:
        """Gathered, and no master shard was written since (in-place ops bump versions)."""
        return self.gathered and self._gathered_versions == self._versions()

    # -- gather state ------------------------------------------------------------------

    def unshard(self, async_op: bool = False, *, overlap: bool = False) -> None:
        """All-gather every store; no-op while a gather is pending or still fresh.

        ``overlap``: from a hook or a prefetch, so on an accelerator the all-gather runs on
        the side streams, as FSDP2's implicit prefetch ([Note: fully_shard streams]); the
        user's ``FSDPModule.unshard`` runs on the current stream, as FSDP2's.
        """
        self.wait_reduce()  # normally done by the final callback; no-op then
        if self.gather_state is GatherState.GATHERING:
            if not async_op:
                self.wait_unshard()
            return
        if self.fresh:
            return
        self._gathered_versions = self._versions()
        comm = self.comm
        if comm.active:
            pending = comm.take_pending(self)  # gathered again into its still-allocated buffer
            if overlap:
                self._gather_on_streams(async_op, pending)
                return
        if not self._live():
            self._side_alloc = False  # allocated now, on the current stream
        works = [store.unshard(async_op) for store in self.stores]
        self._gathers = [w for w in works if w is not None] if async_op else []
        self._set_gather(GatherState.GATHERING if self._gathers else GatherState.GATHERED)

    def _live(self) -> bool:
        return any(store.gathered for store in self.stores)

    def _gather_on_streams(self, async_op: bool, pending: Any) -> None:
        """[Note: fully_shard streams]: cast and allocate on the copy-in stream, gather on
        the all-gather stream; the current stream waits in ``wait_unshard``."""
        comm = self.comm
        s = comm.streams
        comm.release(keep=1)  # at most two gathered buffers in flight
        if pending is not None:  # its readers finished at its reshard's event
            comm.gather_streams_wait(pending)
        elif self._live():  # gathered and stale: its readers are on the current stream
            comm.gather_streams_wait(None)
        else:
            self._side_alloc = True
        s.wait_event(s.copy_in, self._gather_event)  # our last all-gather read compute.local
        self._gathers = [store.unshard(False, s, s.copy_in, s.all_gather) for store in self.stores]
        self._gather_event = self._gathers[-1].event if self._gathers else None
        self._set_gather(GatherState.GATHERING if self._gathers else GatherState.GATHERED)
        if not async_op:
            self.wait_unshard()

    @property
    def unsharding(self) -> bool:
        """An async all-gather was launched and not waited for."""
        return self.gather_state is GatherState.GATHERING

    def wait_unshard(self) -> None:
        if self.gather_state is GatherState.GATHERING:
            for gather in self._gathers:
                gather.wait(self.comm.streams)
            self._gathers = []
            self._set_gather(GatherState.GATHERED)

    def free(self, deferred: bool = False) -> None:
        """Free the global (unsharded) buffers; waits for a pending gather first.

        ``deferred`` (a hook's reshard): a buffer gathered on the side streams is freed at
        the all-gather after next ([Note: fully_shard streams]).
        """
        self.wait_unshard()
        comm = self.comm
        if comm.active and self._side_alloc and self._live():
            comm.take_pending(self)  # a second reshard: its newer event replaces the first
            if deferred:
                comm.free(self)
            else:
                comm.take_pending(self)
                comm.gather_streams_wait(None)
                self.release_buffers()
        else:
            self.release_buffers()
        self._set_gather(GatherState.SHARDED)

    def release_buffers(self) -> None:
        """Give back the global buffers' bytes (the streams that allocated them have
        waited for their readers: [Note: fully_shard streams])."""
        for store in self.stores:
            store.free()
        self._side_alloc = False

    def reshard(self) -> None:
        self.wait_reduce()
        self.free()
        self.register(sharded=True)

    def register(self, sharded: bool) -> None:
        for store in self.stores:
            for p in store.params:
                p.register(sharded)

    @property
    def gathered(self) -> bool:
        return self.gather_state is GatherState.GATHERED

    # -- grad state ---------------------------------------------------------------------

    def release_grads(self) -> None:
        """Give back the shard gradients' bytes where no ``.grad`` refers to them any more
        (see ``StoreGrads.release_grads`` in vefsdp_optim/_fsdp/_grads.py); the root calls
        it before each forward."""
        if self.grad_state is GradState.IDLE:
            for store in self.stores:
                store.release_grads()

    def attach_grads(self) -> None:
        self.wait_reduce()  # the gradient buffer is the pending collective's input
        grad_settings = self.grad_settings()
        for store in self.stores:
            store.attach_grads(fresh=self.grad_state is GradState.IDLE, grad_settings=grad_settings)
        self._set_grad(GradState.ACCUMULATING)

    def add_grad(self, p: ManagedParam, grad: torch.Tensor) -> None:
        """Add ``grad`` (``p``'s global shape) to ``p``'s unsharded gradient, between
        ``attach_grads`` and ``reduce_grads`` ([Note: use outside forward] in _state.py)."""
        for store in self.stores:
            if any(q is p for q in store.params):
                store.add_grad(p, grad)
                return
        raise AssertionError(f"{p.fqn} is not a parameter of this shard group")

    def reduce_grads(self) -> None:
        """End of this shard group's backward: launch the reduction unless accumulating without
        sync.

        The reduce-scatters run asynchronously (see ``StoreGrads.launch_reduce`` in
        vefsdp_optim/_fsdp/_grads.py); ``wait_reduce`` completes them (the next shard group's
        post-backward, the root's final callback, or anything here that touches the
        gradients, whichever comes first).
        """
        if not self.requires_gradient_sync:
            grad_settings = self.grad_settings()
            for store in self.stores:
                store.complete_grads(grad_settings)
            return
        self.wait_reduce()
        if self.grad_state is GradState.IDLE:
            return  # nothing accumulated since the last reduction
        grad_settings = self.grad_settings()
        pending = [(store,
                    store.launch_reduce(grad_settings, self.comm.streams,
                                        self.all_reduce_hook_stream))
                   for store in self.stores]
        self._reductions = [(store, pr) for store, pr in pending if pr is not None]
        self._set_grad(GradState.REDUCING if self._reductions else GradState.IDLE)

    def reset(self) -> None:
        """Wait for in-flight collectives, discard unreduced gradients, reshard."""
        streams = self.comm.streams
        for gather in self._gathers:
            gather.wait(streams)
        self._gathers = []
        for _, pr in self._reductions:
            if pr.work is not None:
                pr.work.wait()
            streams.wait_event(None, pr.post_event)
        self._reductions = []
        if self.comm.active and self._side_alloc:
            self.comm.take_pending(self)
            self.comm.gather_streams_wait(None)
        self.release_buffers()
        for store in self.stores:
            if self.settings.world_size > 1:
                store.reduce.free_grad_global()
                store.compute.free_grad_global()
        self.gather_state, self.grad_state = GatherState.SHARDED, GradState.IDLE
        self.register(sharded=True)

    @property
    def reducing(self) -> bool:
        """A launched reduction has not been waited for yet."""
        return self.grad_state is GradState.REDUCING

    @property
    def reduce_done(self) -> bool:
        """Every launched collective of this shard group has completed (asked without waiting; a
        handle that cannot tell counts as not completed)."""
        return all(pr.done(self.comm.streams) for _, pr in self._reductions)

    def wait_reduce(self) -> None:
        """Complete the launched reductions: after this the sharded ``.grad`` are final."""
        if self.grad_state is not GradState.REDUCING:
            return
        pending, self._reductions = self._reductions, []
        grad_settings = self.grad_settings()
        for store, pr in pending:
            store.finish_reduce(pr, grad_settings, self.comm)
        self._set_grad(GradState.IDLE)

    # -- re-plan -------------------------------------------------------------------------

    def replan(self, store: DtypeStore, units: Mapping[torch.Tensor, int]) -> StoreReplan | None:
        """``FlatStore.replan`` of one of this shard group's stores: the new plan (pure),
        then the lifecycle transition a move needs, then the move (a collective over the
        store's process group)."""
        decision = plan_replan(store, units, store.state_holders())
        if decision.plan is None:
            return decision.report
        if (self.settings.offload and self.settings.device.type != "cpu"
                and self.settings.world_size > 1):
            raise NotImplementedError(
                f"fully_shard: CPUOffloadPolicy on a {self.settings.device.type} mesh with an "
                "optimizer that re-plans the shards (whole blocks or matrices on one rank: 8-bit "
                "Adam, Shampoo, SOAP, Muon, NorMuon) is not supported (the move would send host "
                "shards through the mesh's backend); use AdamW, or no offload")
        if self.grad_state is GradState.ACCUMULATING:
            raise RuntimeError(
                "re-plan during a gradient accumulation without sync (unreduced gradients in the "
                "buffer); build the optimizer before that backward, or after a synced one")
        if self.gathered:  # the unsharded views of the old buffers would go stale
            self.free()
            self.register(sharded=True)
        move_store(store, decision.units, decision.plan)
        return decision.report
