"""One parameter's lifecycle under fully_shard: sharded <-> unsharded registration.

A managed parameter has two faces. The *sharded* one (a ShardedParameter wrapped in
nn.Parameter, the object the optimizer holds) is registered on the module outside
forward/backward; its local data is ``master.local_view(fqn)``. The *unsharded* one is
a plain leaf nn.Parameter aliasing ``compute.full_view(fqn)``, registered during
forward; its ``.grad`` is pre-set to ``grad_full_view(fqn)`` so that autograd
accumulates straight into the gradient buffer (see ``ManagedParam``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from vefsdp_optim._torch_compat import host_constants, module_parameters
from vefsdp_optim.sharding import BoxShard, RaggedShard

from ._sharded_tensor import ShardedParameter

__all__ = ["ManagedParam", "TensorParallel", "mesh_key"]


# A parameter that tensor parallelism made a DTensor on a 1-D ``tp`` mesh is managed by
# its TP-local tensor: the plan, the buffers and the collectives over dp see that local
# tensor only (its shape is ``ManagedParam.shape``), so the all-gather and the
# reduce-scatter stay zero-copy and run over dp alone. The two faces change:
#   - the unsharded parameter (forward, backward) is a DTensor on the tp mesh whose
#     local tensor is the view of the gathered buffer, and its pre-set ``.grad`` a DTensor
#     over the gradient buffer's view (AccumulateGrad adds into a DTensor .grad in place);
#   - the sharded parameter (optimizer, state dict) is a ShardedParameter of the global
#     shape whose layout is a BoxShard over dp x tp flattened: rank (i, j) holds the run
#     of TP box j that dp rank i holds in tp coordinate j's plan ([Note: boxes in flat
#     order]). Every rank plans every tp coordinate's store (pure), so it knows every
#     run. Parameters replicated over tp are sharded over dp alone, as plain ones.
# A store with tensor-parallel parameters keeps its first plan (an optimizer's
# requirements are met by the step loop's exchange instead): a re-plan would depend on
# local shapes that differ between tp coordinates.


@dataclass(frozen=True)
class TensorParallel:
    """How a managed parameter is tensor-parallel: its DTensor placement on ``mesh``."""

    mesh: Any  # 1-D DeviceMesh (tp)
    placements: tuple[Any, ...]
    shape: torch.Size  # global shape
    stride: tuple[int, ...]  # global (contiguous) stride
    boxes: BoxShard | None  # the TP boxes over the tp ranks; None: replicated over tp
    # dp-shard x tp, flattened (rank = dp_rank * tp + tp_rank)
    flat_process_group: ProcessGroup | None
    tp_rank: int

    def dtensor(self, local: torch.Tensor) -> torch.Tensor:
        """A DTensor of this placement over ``local`` (no copy)."""
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local, self.mesh, self.placements, run_check=False,
                                  shape=self.shape, stride=self.stride)

    def local(self, grad: torch.Tensor) -> torch.Tensor:
        """The local tensor of a gradient DTensor in this placement: a gradient that autograd
        left in another one (a sequence-parallel norm's ``Partial`` sum over tp) is
        redistributed first, as AccumulateGrad does into a pre-set ``.grad``."""
        if tuple(grad.placements) != self.placements:
            grad = grad.redistribute(self.mesh, self.placements)
        return grad.to_local()

    def sharded_layout(self, runs: list[RaggedShard]) -> BoxShard:
        """The BoxShard over dp x tp: ``runs[j]`` is tp coordinate j's dp layout of its box."""
        if self.boxes is None:
            raise AssertionError("a parameter replicated over tp has no boxes")
        return _dp_tp_layout(self.boxes, tuple(runs))


@functools.lru_cache(maxsize=64)
def _dp_tp_layout(tp_boxes: BoxShard, runs: tuple[RaggedShard, ...]) -> BoxShard:
    """The BoxShard over dp x tp of :meth:`TensorParallel.sharded_layout`, one object for
    every parameter with the same tp boxes and dp layouts (a model's layers share a few
    shapes): it holds dp x tp boxes, so building it per parameter made ``fully_shard`` x
    TP's construction grow with P x W. Built from the checked tp boxes and dp runs
    (``BoxShard.runs_in_boxes``), without the constructor's overlap sweep (~90 ms at
    W = 8,192)."""
    return BoxShard.runs_in_boxes(tp_boxes, runs)


def mesh_key(mesh: Any) -> tuple[str, tuple[int, ...], tuple[int, ...], tuple[str, ...] | None]:
    """A DeviceMesh by value: device type, shape, ranks (row-major) and dim names.

    Two DeviceMesh objects are the same mesh when they have the same device type, the same
    ranks in the same arrangement and the same dim names: torchtitan and users distribute
    each expert weight with its own ``mesh["ep"]`` slice, a new object every time, and
    those must be one tp mesh to a shard group. So the library compares meshes by this
    key, never by ``id`` nor by ``DeviceMesh.__eq__`` (why not: docs/decisions.md). What the
    library derives from a mesh depends only on the key: each rank's coordinate (hence its
    DTensor box) and, through the names, the dp x tp process group, which torch caches per
    flattened name on the root mesh (equal slices of one root share it)."""
    with host_constants():  # the mesh's rank tensor is a real host tensor, under FakeTensorMode too
        ranks = mesh.mesh
        flat = tuple(ranks.reshape(-1).tolist())
    return (mesh.device_type, tuple(ranks.shape), flat,
            tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names is not None else None)


# AccumulateGrad adds into an existing ``.grad`` in place when grad mode is off (the
# normal backward), so a leaf whose .grad is a view of the W*m gradient buffer gets its
# gradient summed there: no per-parameter gradient tensor, no copy into a flat
# reduce-scatter input. The unsharded parameter object is made once and survives
# free/alloc of the global buffer (its storage is resized, not replaced).
class ManagedParam:
    """Bookkeeping for one parameter object (possibly registered under several names)."""

    fqn: str  # unique name within the shard group (first name it was found under)
    slots: list[tuple[nn.Module, str]]  # every (module, attribute) that holds it
    shape: torch.Size  # global shape
    requires_grad: bool
    sharded: nn.Parameter  # ShardedParameter; local data: master.local_view(fqn)
    unsharded: nn.Parameter | None  # 0-d params are planned as (1,) and viewed back
    tp: TensorParallel | None  # ``TensorParallel``; shape is then TP-local
    # hook on the unsharded face's gradient, before AccumulateGrad ([Note: use outside forward])
    on_unsharded_grad: Callable[[torch.Tensor], None] | None

    def __init__(self, fqn: str, slots: list[tuple[nn.Module, str]], shape: torch.Size,
                 requires_grad: bool) -> None:
        self.fqn = fqn
        self.slots = slots
        self.shape = shape
        self.requires_grad = requires_grad
        self.unsharded = None
        self.tp = None
        self.on_unsharded_grad = None

    def _sharded_args(self, layout: RaggedShard, process_group: ProcessGroup | None, rank: int,
                      runs: list[RaggedShard] | None) -> tuple:
        """(layout, process group, rank, global shape) of the sharded face."""
        tp = self.tp
        if tp is None or tp.boxes is None:
            return layout, process_group, rank, (tp.shape if tp is not None else self.shape)
        if runs is None:
            raise AssertionError(f"{self.fqn}: a tensor-parallel parameter needs every tp "
                                 "coordinate's layout")
        return (tp.sharded_layout(runs), tp.flat_process_group,
                rank * tp.boxes.world_size + tp.tp_rank, tp.shape)

    def make_sharded(self, local: torch.Tensor, layout: RaggedShard,
                     process_group: ProcessGroup | None,
                     rank: int, runs: list[RaggedShard] | None = None) -> None:
        """Create the sharded Parameter over ``local``; its shard group binds it to its
        store's ``FlatStore`` (``StoreBinding``)."""
        layout, process_group, rank, shape = self._sharded_args(layout, process_group, rank, runs)
        t = ShardedParameter(local, layout, process_group, shape, rank)
        self.sharded = nn.Parameter(t, requires_grad=self.requires_grad)

    def repoint(self, local: torch.Tensor, layout: RaggedShard, process_group: ProcessGroup | None,
                rank: int, runs: list[RaggedShard] | None = None) -> None:
        """Point the same sharded Parameter object at new local data and layout."""
        layout, process_group, rank, _ = self._sharded_args(layout, process_group, rank, runs)
        self.sharded.rebind_(local, layout, process_group, rank)
        self.sharded.grad = None

    def unsharded_face(self, full: torch.Tensor) -> torch.Tensor:
        """``full`` (a view of a global buffer) as the unsharded parameter or gradient sees
        it: the local shape, a DTensor on the tp mesh for tensor-parallel parameters."""
        t = full.view(self.shape)
        return t if self.tp is None else self.tp.dtensor(t)

    def make_unsharded(self, full: torch.Tensor) -> None:
        """Create the unsharded leaf aliasing ``full`` (a view of the global buffer)."""
        self.unsharded = nn.Parameter(self.unsharded_face(full), requires_grad=self.requires_grad)
        if self.requires_grad and self.on_unsharded_grad is not None:
            self.unsharded.register_hook(self.on_unsharded_grad)

    def register(self, sharded: bool) -> None:
        p = self.sharded if sharded else self.unsharded
        if p is None:
            raise AssertionError(f"{self.fqn}: unsharded parameter used before the first unshard")
        for module, attr in self.slots:
            module_parameters(module)[attr] = p  # bypass __setattr__ checks, as FSDP2 does
