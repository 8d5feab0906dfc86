"""One dtype's parameters of a shard group, in flat buffers: the FlatStore of fully_shard.

A :class:`DtypeStore` holds one plan and one master DistributedBuffer (the sharded
parameters' storage; the ``FlatStore`` of [Note: flat store contract]), plus, under
mixed precision, a compute buffer in ``param_dtype`` (same plan; one cast of the local
shard per all-gather) and a reduce buffer in ``reduce_dtype``. Its shard group
(_group.py) drives it: all-gather, gradient attachment, reduce-scatter, re-plan. The
store holds no reference to its shard group (see ``StoreSettings`` in
vefsdp_optim/_fsdp/_settings.py).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from vefsdp_optim._flat_store import dense_offset
from vefsdp_optim._torch_compat import (
    tensor_version,
    unsafe_preserve_version_counter,
    unsafe_set_version_counter,
)
from vefsdp_optim.comm import DistributedBuffer, FlatWork
from vefsdp_optim.sharding import BufferPlan, RaggedShard, TensorSpec, plan_buffer

from ._grads import StoreGrads, _nbytes, _release_storage, _uses
from ._param import ManagedParam, mesh_key
from ._settings import GradSettings, StoreSettings
from ._streams import NO_STREAMS, Streams

__all__ = ["DtypeStore", "PendingGather", "ALIGN"]

ALIGN = 16

# CPUOffloadPolicy, as FSDP2's: the sharded parameters, their gradients, and so the
# optimizer's step and state, live on the CPU (page-locked when the mesh is an
# accelerator and the policy pins); the device holds only what the collectives and the
# forward and backward need. A store under offload keeps its master buffer on the CPU
# and a compute buffer (param_dtype) and a reduce buffer (reduce_dtype) on the device,
# even where the dtypes agree: the all-gather's copy-in is the host-to-device copy (and
# cast) of the shard into ``compute.local``; the epilogue copies the reduce-scatter's
# output device-to-host into ``master.local_grad``, asynchronously from pinned memory
# unless kept gradients are added on the host right after (then blocking, as FSDP2).
# The root's final callback makes the host wait on each offloaded reduction's last event
# (as FSDP2 on its offload events), which follows that store's last gather and so its
# host-to-device copies: the optimizer then reads finished gradients and overwrites
# shards that no copy still reads. A backward that reduces nothing (no sync) leaves the
# host free. On a CPU mesh the same buffers exist and the copies are CPU copies, with
# the bits of the run without offload.


class DtypeStore(StoreGrads):
    """One dtype's parameters of a shard group: plan, master / compute / reduce buffers.

    Answers the data questions of the ``FlatStore`` protocol ([Note: flat store
    contract]) over the master buffer: members' local data are its segments, their
    reduced grads the same segments of ``master.local_grad``. Its shard group answers the
    re-plan (``StoreBinding``, ``StoreSettings`` in vefsdp_optim/_fsdp/_settings.py).
    """

    plan: BufferPlan
    params: list[ManagedParam]
    master: DistributedBuffer  # original dtype; sharded params view master.local
    compute: DistributedBuffer  # param_dtype (is master without mixed precision)
    reduce: DistributedBuffer  # reduce_dtype (is master or compute when dtypes agree)

    def __init__(self, params: list[ManagedParam], units: dict[str, int], settings: StoreSettings,
                 dtype: torch.dtype, data: dict[str, torch.Tensor], validate: bool = True) -> None:
        self.params = params
        self.dtype = dtype
        self.settings = settings
        self.units: dict[str, int] = dict(units)  # fqn -> unit; absent: 1
        # optimizers whose state of the members a re-plan must not invalidate
        self._holders: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._partial = False  # the kept .grad is reduce-scattered but not all-reduced (HSDP)
        self._kept: torch.Tensor | None = None  # 1-D, m: kept grads set aside at W = 1
        # the settings of the backward whose first gradient the lazy gradient buffer awaits
        # ([Note: lazy gradient buffer])
        self._awaited_settings: GradSettings | None = None
        # fqns of the members this rank gave a gradient since the last reduction
        # (see ``StoreGrads`` in vefsdp_optim/_fsdp/_grads.py)
        self._used: set[str] = set()
        self.build(units, data, validate=validate)

    def specs(self, units: dict[str, int]) -> list[TensorSpec]:
        return [TensorSpec(p.fqn, tuple(p.shape) or (1,), units.get(p.fqn, 1)) for p in self.params]

    def build(self, units: dict[str, int], data: dict[str, torch.Tensor], validate: bool,
              plan: BufferPlan | None = None) -> None:
        """(Re)create the buffers for ``units`` and fill the local shard from ``data``.

        ``data[fqn]`` is the whole tensor (any shape, flattened here). The same
        sharded Parameter objects are re-pointed when they already exist.
        """
        settings = self.settings
        w = settings.world_size
        self.units = dict(units)
        self.plan = plan if plan is not None else plan_buffer(self.specs(units), w, align=ALIGN)
        process_group = settings.process_group if w > 1 else None
        rank = settings.rank if process_group is not None else 0
        self.master = DistributedBuffer(self.plan, process_group, dtype=self.dtype,
                                        device=settings.host,
                                        rank=settings.rank if process_group is None else None,
                                        validate=validate, pin_memory=settings.pinned)
        param_dtype = settings.mp_policy.param_dtype or self.dtype
        reduce_dtype = settings.mp_policy.reduce_dtype or param_dtype
        # under CPU offload (the comment above ``DtypeStore``): the compute and reduce buffers
        # live on the device, apart
        self.compute = (self.master if param_dtype == self.dtype and not settings.offload
                        else DistributedBuffer(self.plan, process_group, dtype=param_dtype,
                                               device=settings.device, validate=False))
        if reduce_dtype == self.dtype and not settings.offload:
            self.reduce = self.master
        elif reduce_dtype == param_dtype:
            self.reduce = self.compute
        else:
            self.reduce = DistributedBuffer(self.plan, process_group, dtype=reduce_dtype,
                                            device=settings.device, validate=False)
        tp_runs = self._tp_runs(units)
        for p in self.params:
            a, n = self.master.local_extent(p.fqn)
            local = self.master.local_view(p.fqn)
            src = data[p.fqn]
            if not src.is_meta:  # meta: initialized later (to_empty, then init or a load)
                with torch.no_grad():
                    local.copy_(src.reshape(-1)[a:a + n])
            layout = self.plan.layout(p.fqn)
            runs = tp_runs.get(p.fqn)
            if hasattr(p, "sharded"):
                p.repoint(local, layout, process_group, rank, runs)
            else:  # bound to its FlatStore by the shard group (``StoreSettings``, _settings.py)
                p.make_sharded(local, layout, process_group, rank, runs=runs)
            p.unsharded = None
        self._segments = {id(p.sharded): self._segment_of(p) for p in self.params}
        # ``StoreGrads.release_grads`` in vefsdp_optim/_fsdp/_grads.py, [Note: lazy gradient buffer]
        self._lazy = w > 1
        self._gbuf: torch.Tensor | None = None  # compute's W*m gradient buffer, once allocated
        self._awaiting = False  # a lazy buffer whose backward's first gradient has not arrived yet
        if self._lazy:
            for buffer in (self.master, self.compute, self.reduce):
                _release_storage(buffer.local_grad)
            self._grad_uses = _uses(self.master.local_grad)

    @property
    def tensor_parallel(self) -> bool:
        """Some member is sharded by tensor parallelism (see ``TensorParallel`` in
        vefsdp_optim/_fsdp/_param.py)."""
        return any(p.tp is not None and p.tp.boxes is not None for p in self.params)

    def _tp_runs(self, units: dict[str, int]) -> dict[str, list[RaggedShard]]:
        """Per tensor-parallel member: every tp coordinate's dp layout of its box, from the
        plan that coordinate makes (see ``TensorParallel`` in vefsdp_optim/_fsdp/_param.py)."""
        tps = [p for p in self.params if p.tp is not None and p.tp.boxes is not None]
        if not tps:
            return {}
        meshes = {mesh_key(p.tp.mesh) for p in tps}  # ``mesh_key`` in vefsdp_optim/_fsdp/_param.py
        tp_world = tps[0].tp.boxes.world_size
        if len(meshes) > 1 or any(p.tp.boxes.world_size != tp_world for p in tps):
            raise NotImplementedError(
                "fully_shard: the tensor-parallel parameters of one shard group must share "
                f"one tp mesh (equal device type, ranks and dim names), got {len(meshes)}: "
                + "; ".join(f"{p.fqn} on {p.tp.mesh}" for p in tps))
        runs: dict[str, list[RaggedShard]] = {p.fqn: [] for p in tps}
        for j in range(tp_world):
            specs = [TensorSpec(p.fqn,
                                (p.tp.boxes.boxes[j].sizes
                                 if p.tp is not None and p.tp.boxes is not None
                                        else tuple(p.shape)) or (1,), units.get(p.fqn, 1))
                     for p in self.params]
            plan = plan_buffer(specs, self.settings.world_size, align=ALIGN)
            if j == tps[0].tp.tp_rank and plan.fingerprint() != self.plan.fingerprint():
                raise AssertionError("the plan of this tp coordinate differs from the store's plan")
            for p in tps:
                runs[p.fqn].append(plan.layout(p.fqn))
        return runs

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
        if grad.untyped_storage().nbytes() < _nbytes(grad):
            # released (see ``StoreGrads.release_grads`` in
            # vefsdp_optim/_fsdp/_grads.py): gradients set by hand are elsewhere,
            # and a rank that holds no element of any member would read the missing
            # bytes
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

    def state_holders(self) -> list[torch.optim.Optimizer]:
        """The registered optimizers whose state of the members a re-plan must not invalidate."""
        return list(self._holders)

    # (``replan``, the protocol's last method, is the shard group's: ``StoreBinding``)

    # -- all-gather / free -------------------------------------------------------------

    def unshard(self, async_op: bool, streams: Streams = NO_STREAMS, copy_in: Any = None,
                gather: Any = None) -> PendingGather | None:
        """Cast and allocate on ``copy_in``, all-gather on ``gather`` (None: the current
        stream; [Note: fully_shard streams]). Returns what ``PendingGather.wait`` completes,
        or None when nothing is left to wait for."""
        compute = self.compute
        with streams.use(copy_in):
            compute.alloc_global()
        # The unsharded params (saved for backward) alias the global buffer; re-gathering
        # the same values must not bump their version (nor, where one rank holds
        # everything, re-casting them: the cast writes the global buffer then), and gloo's
        # async work writes the output from its own thread, so the version is restored
        # after wait() too, as FSDP2 does around its copy-out.
        out = compute.global_buffer
        with unsafe_preserve_version_counter(out):
            version = tensor_version(out)
            with streams.use(copy_in):
                if compute is not self.master:
                    # the one cast (under offload: and host-to-device copy) per all-gather;
                    # non-blocking from pageable memory too, as FSDP2 (the driver stages it before
                    # returning), so the host never waits on the copy-in stream here
                    with torch.no_grad():
                        compute.local.copy_(self.master.local, non_blocking=streams.active)
            streams.wait_stream(gather, copy_in)
            with streams.use(gather):
                work = compute.all_gather(async_op=async_op)
                event = streams.record(gather) if gather is not None else None
        for p in self.params:
            if p.unsharded is None:
                p.make_unsharded(compute.full_view(p.fqn))
                # ``StoreGrads`` in vefsdp_optim/_fsdp/_grads.py, [Note: lazy gradient buffer]
                if p.requires_grad:
                    p.unsharded.register_hook(functools.partial(self._on_grad, p.fqn))
        return None if work is None and event is None else PendingGather(work, event, out, version)

    def free(self) -> None:
        self.compute.free_global()

    @property
    def gathered(self) -> bool:
        return self.compute.global_allocated


class PendingGather(NamedTuple):
    """A store's launched all-gather: an async handle, or (on the streams) its event."""

    work: FlatWork | None
    event: Any  # recorded on the all-gather stream after the collective; None: none
    out: torch.Tensor  # 1-D, W * m: the gathered buffer
    version: int  # its version before the collective (see ``DtypeStore.unshard``)

    def wait(self, streams: Streams) -> None:
        """The current stream waits for the gather; the buffer's version is restored."""
        if self.work is not None:
            self.work.wait()
        streams.wait_event(None, self.event)
        unsafe_set_version_counter((self.out,), (self.version,))
