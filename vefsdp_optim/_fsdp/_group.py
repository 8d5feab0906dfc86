"""A shard group: the parameters one fully_shard call manages, which communicate together.

Per original dtype the group has one :class:`DtypeStore`: one plan and one master
DistributedBuffer (the sharded parameters' storage; the ``FlatStore`` of
[Note: flat store contract]), plus, under mixed precision, a compute buffer in
``param_dtype`` (same plan; one cast of the local shard per all-gather) and a reduce
buffer in ``reduce_dtype``. The hooks that fully_shard installs call into
:class:`ShardGroup`: unshard before forward and backward, reshard after, one
reduce-scatter when the group's gradients are complete. Where the group is in its step
is two explicit states (``GatherState``, ``GradState`` in _lifecycle.py). See
[Note: grads into the buffer] in _param.py.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy

from vefsdp_optim._flat_store import StoreReplan, dense_offset
from vefsdp_optim.comm import DistributedBuffer, FlatWork, all_reduce_avg
from vefsdp_optim.sharding import GroupPlan, TensorSpec, plan_group

from ._lifecycle import GatherState, GradState, advance
from ._param import ManagedParam
from ._replan import replan_store

__all__ = ["ShardGroup", "DtypeStore", "check_group_consistent"]

ALIGN = 16


class DtypeStore:
    """One dtype's parameters of a shard group: plan, master / compute / reduce buffers.

    Implements the ``FlatStore`` protocol ([Note: flat store contract]) over the master
    buffer: members' local data are its segments, their reduced grads the same
    segments of ``master.local_grad``.
    """

    plan: GroupPlan
    params: list[ManagedParam]
    master: DistributedBuffer  # original dtype; sharded params view master.local
    compute: DistributedBuffer  # param_dtype (is master without mixed precision)
    reduce: DistributedBuffer  # reduce_dtype (is master or compute when dtypes agree)

    def __init__(self, params: list[ManagedParam], units: dict[str, int], group: ShardGroup,
                 dtype: torch.dtype, data: dict[str, torch.Tensor], validate: bool = True) -> None:
        self.params = params
        self.dtype = dtype
        self.group = group
        self.units: dict[str, int] = dict(units)  # fqn -> unit; absent: 1
        # optimizers whose state of the members a re-plan must not invalidate
        self._holders: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self.build(units, data, validate=validate)

    def specs(self, units: dict[str, int]) -> list[TensorSpec]:
        return [TensorSpec(p.fqn, tuple(p.shape) or (1,), units.get(p.fqn, 1)) for p in self.params]

    def build(self, units: dict[str, int], data: dict[str, torch.Tensor], validate: bool,
              plan: GroupPlan | None = None) -> None:
        """(Re)create the buffers for ``units`` and fill the local shard from ``data``.

        ``data[fqn]`` is the whole tensor (any shape, flattened here). The same
        sharded Parameter objects are re-pointed when they already exist.
        """
        g = self.group
        w = g.shard_world
        self.units = dict(units)
        self.plan = plan if plan is not None else plan_group(self.specs(units), w, align=ALIGN)
        pg = g.shard_pg if w > 1 else None
        self.master = DistributedBuffer(self.plan, pg, dtype=self.dtype, device=g.device,
                                        rank=g.shard_rank if pg is None else None, validate=validate)
        mp = g.mp_policy
        pdt = mp.param_dtype or self.dtype
        rdt = mp.reduce_dtype or pdt
        self.compute = self.master if pdt == self.dtype else DistributedBuffer(
            self.plan, pg, dtype=pdt, device=g.device, validate=False)
        if rdt == self.dtype:
            self.reduce = self.master
        elif rdt == pdt:
            self.reduce = self.compute
        else:
            self.reduce = DistributedBuffer(self.plan, pg, dtype=rdt, device=g.device, validate=False)
        for p in self.params:
            a, n = self.master.local_extent(p.fqn)
            local = self.master.local_view(p.fqn)
            with torch.no_grad():
                local.copy_(data[p.fqn].reshape(-1)[a:a + n])
            layout = self.plan.layout(p.fqn)
            if hasattr(p, "sharded"):
                p.repoint(local, layout, pg, g.shard_rank if pg is not None else 0)
            else:
                p.make_sharded(local, layout, pg, g.shard_rank if pg is not None else 0, store=self)
            p.unsharded = None
        self._segments = {id(p.sharded): self._segment_of(p) for p in self.params}

    def _segment_of(self, p: ManagedParam) -> tuple[int, int]:
        view = self.master.local_view(p.fqn)
        return view.storage_offset() - self.master.local.storage_offset(), view.numel()

    # -- the FlatStore protocol ([Note: flat store contract]) ---------------------------

    def members(self) -> Sequence[torch.Tensor]:
        return [p.sharded for p in self.params]

    def flat_param(self) -> torch.Tensor:
        return self.master.local

    def flat_grad(self) -> torch.Tensor:
        return self.master.local_grad

    def segment(self, p: torch.Tensor) -> tuple[int, int]:
        seg = self._segments.get(id(p))
        if seg is None:
            raise ValueError(f"a tensor of shape {tuple(p.shape)} is not stored in this DtypeStore")
        return seg

    def grads_in_place(self) -> bool:
        flat, grad = self.master.local, self.master.local_grad
        if flat.is_complex() or flat.is_sparse:
            return False
        for p in self.params:
            sp = p.sharded
            off, n = self._segments[id(sp)]
            g = sp.grad
            gl = g.to_local() if g is not None and hasattr(g, "to_local") else None
            if gl is None or gl.numel() != n:
                return False
            if n and (dense_offset(gl, grad) != off or dense_offset(sp.to_local(), flat) != off):
                return False
        return True

    def add_state_holder(self, holder: torch.optim.Optimizer) -> None:
        self._holders.add(holder)

    def replan(self, units: Mapping[torch.Tensor, int]) -> StoreReplan | None:
        return replan_store(self, units, list(self._holders))

    # -- all-gather / free -------------------------------------------------------------

    def unshard(self, async_op: bool) -> Any:
        c = self.compute
        if c is not self.master:
            with torch.no_grad():
                c.local.copy_(self.master.local)  # the one cast per all-gather
        c.alloc_global()
        # [Note: version counter] the unsharded params (saved for backward) alias the
        # global buffer; re-gathering the same values must not bump their version, and
        # gloo's async work writes the output from its own thread, so the version is
        # restored after wait() too, as FSDP2 does around its all-gather copy-out.
        out = c.global_buffer
        with torch.autograd._unsafe_preserve_version_counter(out):
            version = out._version
            work = c.all_gather(async_op=async_op)
        for p in self.params:
            if p.unsharded is None:
                p.make_unsharded(c.full_view(p.fqn))
        return None if work is None else (work, out, version)

    def free(self) -> None:
        self.compute.free_global()

    @property
    def gathered(self) -> bool:
        return self.compute.global_allocated

    # -- gradients ---------------------------------------------------------------------

    @property
    def direct(self) -> bool:
        """W == 1 without mixed precision: autograd accumulates into master.local_grad."""
        return self.group.shard_world == 1 and self.compute is self.master and self.reduce is self.master

    def attach_grads(self, fresh: bool) -> None:
        """Point each unsharded param's .grad at the compute gradient buffer.

        ``fresh``: first backward since the last reduction, so the buffer starts at zero
        (for ``direct`` buckets: except where a kept sharded .grad is accumulated).
        """
        c = self.compute
        c.alloc_grad_global()
        if fresh and self.group.shard_world == 1:
            with torch.no_grad():
                if self.direct:
                    for p in self.params:
                        if p.requires_grad and p.sharded.grad is None:
                            self.master.local_grad_view(p.fqn).zero_()
                else:
                    c.grad_global.zero_()
        for p in self.params:
            if p.requires_grad and p.unsharded is not None:
                p.unsharded.grad = c.grad_full_view(p.fqn).view(p.shape)

    def launch_reduce(self) -> _PendingReduce | None:
        """Start the reduce-scatter (avg) of the accumulated gradients; ``finish_reduce`` ends it.

        [Note: async reduce-scatter] The collective is launched with ``async_op=True`` so
        that it runs while autograd computes the previous group's gradients; everything
        that reads its output (the division of gloo's SUM-as-AVG, HSDP's replicate
        all-reduce, the cast into the master's dtype, kept-gradient accumulation, the
        sharded ``.grad`` views) happens in ``finish_reduce``, after ``wait()``. The
        gradient buffer (the collective's input) stays allocated until then.
        """
        g, c, r, m = self.group, self.compute, self.reduce, self.master
        if not any(p.requires_grad for p in self.params) or not c.grad_global_allocated:
            return None
        accumulate = [] if self.direct else [
            p for p in self.params if p.requires_grad and p.sharded.grad is not None]
        prev = None
        if accumulate:  # the user kept last step's grads: add the new ones to them
            prev = torch.zeros_like(m.local_grad)
            for p in accumulate:
                v = m.local_grad_view(p.fqn)
                a = v.storage_offset() - m.local_grad.storage_offset()
                prev[a:a + v.numel()] = v
        if r is not c:
            r.alloc_grad_global()
            with torch.no_grad():
                r.grad_global.copy_(c.grad_global)
            c.free_grad_global()
        work = r.reduce_scatter(op="avg", async_op=True) if g.shard_world > 1 else None
        return _PendingReduce(work, prev)

    def finish_reduce(self, pending: _PendingReduce) -> None:
        """Wait for ``launch_reduce``'s collective, then the in-order epilogue (see its Note)."""
        g, c, r, m = self.group, self.compute, self.reduce, self.master
        if pending.work is not None:
            pending.work.wait()
        if g.replicate_pg is not None:
            all_reduce_avg(r.local_grad, g.replicate_pg)
        with torch.no_grad():
            if r is not m:
                m.local_grad.copy_(r.local_grad)
            if pending.prev is not None:
                m.local_grad.add_(pending.prev)
        if g.shard_world > 1:
            r.free_grad_global()
            c.free_grad_global()
        for p in self.params:
            if p.requires_grad:
                if p.sharded.grad is None:
                    p.sharded.grad = p.sharded.with_local(m.local_grad_view(p.fqn))
                if p.unsharded is not None:
                    p.unsharded.grad = None


class _PendingReduce(NamedTuple):
    """A bucket's launched reduce-scatter: its handle (None: no collective) and kept grads."""

    work: FlatWork | None
    prev: torch.Tensor | None  # 1-D, m elements: the kept local grad to add back; None: none kept


def check_group_consistent(signature: list, shard_pg: dist.ProcessGroup,
                           replicate_pg: dist.ProcessGroup | None) -> None:
    """Raise ValueError on every rank unless all ranks hold the same group signature.

    One ``all_gather_object`` per process group before the first collective on the
    group's buffers: dtypes, plans and frozen flags that differ (or a module with
    parameters on some ranks only) raise instead of hanging or mixing buffers.
    """
    for pg in (shard_pg, replicate_pg):
        if pg is None or pg.size() == 1:
            continue
        gathered: list[Any] = [None] * pg.size()
        dist.all_gather_object(gathered, signature, group=pg)
        bad = [r for r, g in enumerate(gathered) if g != gathered[0]]
        if bad:
            raise ValueError(
                f"fully_shard: ranks {bad} of a group of {pg.size()} hold parameters different from "
                f"rank 0's (dtype, plan fingerprint, requires_grad per bucket): {gathered[bad[0]]} vs "
                f"{gathered[0]}; every rank must shard the same module structure")


class ShardGroup:
    """The parameters one ``fully_shard(module)`` call manages, by dtype in DtypeStores."""

    def __init__(self, params: list[ManagedParam], *, shard_pg: dist.ProcessGroup,
                 replicate_pg: dist.ProcessGroup | None, device: torch.device,
                 mp_policy: MixedPrecisionPolicy, data: dict[str, torch.Tensor]) -> None:
        self.shard_pg = shard_pg
        self.shard_world = shard_pg.size()
        self.shard_rank = shard_pg.rank()
        self.replicate_pg = replicate_pg if replicate_pg is not None and replicate_pg.size() > 1 else None
        self.device = device
        self.mp_policy = mp_policy
        self.params = params
        by_dtype: dict[torch.dtype, list[ManagedParam]] = {}
        for p in params:
            by_dtype.setdefault(data[p.fqn].dtype, []).append(p)
        self.stores = [DtypeStore(ps, {}, self, dt, data, validate=False) for dt, ps in by_dtype.items()]
        check_group_consistent(self.signature(), shard_pg, self.replicate_pg)
        self.requires_gradient_sync = True
        self.gather_state = GatherState.SHARDED
        self.grad_state = GradState.IDLE
        self._gathers: list[Any] = []  # GATHERING: (work, output, version) per store
        self._reductions: list[tuple[DtypeStore, _PendingReduce]] = []  # REDUCING: launched
        self._gathered_versions: tuple[int, ...] | None = None  # master versions at the last gather

    def signature(self) -> list[tuple[str, str, tuple[bool, ...]]]:
        """Per store: (dtype, plan fingerprint, requires_grad per parameter); equal on every rank."""
        return [(str(b.dtype), b.plan.fingerprint()[:16], tuple(p.requires_grad for p in b.params))
                for b in self.stores]

    def _versions(self) -> tuple[int, ...]:
        return tuple(b.master.local._version for b in self.stores)

    def _set_gather(self, new: GatherState) -> None:
        self.gather_state = advance(self.gather_state, new, "ShardGroup.gather_state")

    def _set_grad(self, new: GradState) -> None:
        self.grad_state = advance(self.grad_state, new, "ShardGroup.grad_state")

    @property
    def fresh(self) -> bool:
        """Gathered, and no master shard was written since (in-place ops bump versions)."""
        return self.gathered and self._gathered_versions == self._versions()

    # -- gather state ------------------------------------------------------------------

    def unshard(self, async_op: bool = False) -> None:
        """All-gather every store; no-op while a gather is pending or still fresh."""
        self.wait_reduce()  # normally done by the final callback; no-op then
        if self.gather_state is GatherState.GATHERING:
            if not async_op:
                self.wait_unshard()
            return
        if self.fresh:
            return
        self._gathered_versions = self._versions()
        works = [b.unshard(async_op) for b in self.stores]
        self._gathers = [w for w in works if w is not None] if async_op else []
        self._set_gather(GatherState.GATHERING if self._gathers else GatherState.GATHERED)

    @property
    def unsharding(self) -> bool:
        """An async all-gather was launched and not waited for."""
        return self.gather_state is GatherState.GATHERING

    def wait_unshard(self) -> None:
        if self.gather_state is GatherState.GATHERING:
            for work, out, version in self._gathers:
                work.wait()
                torch._C._autograd._unsafe_set_version_counter((out,), (version,))
            self._gathers = []
            self._set_gather(GatherState.GATHERED)

    def free(self) -> None:
        """Free the global (unsharded) buffers; waits for a pending gather first."""
        self.wait_unshard()
        for b in self.stores:
            b.free()
        self._set_gather(GatherState.SHARDED)

    def reshard(self) -> None:
        self.wait_reduce()
        self.free()
        self.register(sharded=True)

    def register(self, sharded: bool) -> None:
        for b in self.stores:
            for p in b.params:
                p.register(sharded)

    @property
    def gathered(self) -> bool:
        return self.gather_state is GatherState.GATHERED

    # -- grad state ---------------------------------------------------------------------

    def attach_grads(self) -> None:
        self.wait_reduce()  # the gradient buffer is the pending collective's input
        for b in self.stores:
            b.attach_grads(fresh=self.grad_state is GradState.IDLE)
        self._set_grad(GradState.ACCUMULATING)

    def reduce_grads(self) -> None:
        """End of this group's backward: launch the reduction unless accumulating without sync.

        The reduce-scatters run asynchronously ([Note: async reduce-scatter]);
        ``wait_reduce`` completes them (the next group's post-backward, the root's final
        callback, or anything here that touches the gradients, whichever comes first).
        """
        if not self.requires_gradient_sync:
            return
        self.wait_reduce()
        if self.grad_state is GradState.IDLE:
            return  # nothing accumulated since the last reduction
        pending = [(b, b.launch_reduce()) for b in self.stores]
        self._reductions = [(b, pr) for b, pr in pending if pr is not None]
        self._set_grad(GradState.REDUCING if self._reductions else GradState.IDLE)

    @property
    def reducing(self) -> bool:
        """A launched reduction has not been waited for yet."""
        return self.grad_state is GradState.REDUCING

    def wait_reduce(self) -> None:
        """Complete the launched reductions: after this the sharded ``.grad`` are final."""
        if self.grad_state is not GradState.REDUCING:
            return
        pending, self._reductions = self._reductions, []
        for b, pr in pending:
            b.finish_reduce(pr)
        self._set_grad(GradState.IDLE)
