"""Reduce any supported parameter to one view: local flat data + layout + shard group.

The optimizers accept three kinds of parameter (plain tensors, FSDP2 DTensors, this
library's own sharded parameters) and see each through a :class:`ShardedView`, so the
step loop never branches on the parameter's kind. See [Note: views alias storage].
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from vefsdp_optim.sharding import RaggedShard

__all__ = ["ShardedView", "sharded_view"]

# [Note: views alias storage]
# ``ShardedView.local`` is always a view of the parameter's own storage, never a copy:
# an optimizer that writes its update into ``local`` updates the parameter. For FSDP2
# the DTensor's local tensor is a narrow of a padded per-rank buffer
# (``FSDPParam._sharded_param_data``); the narrow starts at offset 0 and is contiguous,
# so ``_local_tensor.view(-1)`` aliases exactly this rank's rows and not the padding.

_SUPPORTED = (
    "plain tensors and nn.Parameter (single device or DDP), FSDP2 DTensors with placements "
    "(Shard(dim=0),) on a 1-D mesh or (Replicate(), Shard(dim=0)) on a 2-D HSDP mesh, "
    "and objects with a __sharded_view__() method"
)


@dataclass(frozen=True, slots=True)
class ShardedView:
    """One tensor reduced to what an optimizer needs.

    ``local`` is a 1-D view (no copy) of this rank's slice ``layout.local(rank)`` of the
    tensor's row-major flat storage; writing into it writes the tensor. ``group`` is the
    shard group (``layout.world_size`` ranks) or None when the tensor is not sharded.
    """

    local: torch.Tensor  # 1-D, layout.local(rank)[1] elems; may be empty
    layout: RaggedShard  # over the shard group
    group: dist.ProcessGroup | None  # None iff layout.world_size == 1
    shape: torch.Size  # the global shape
    rank: int  # this rank's index in `group` (0 when group is None)

    def __post_init__(self) -> None:
        if not isinstance(self.local, torch.Tensor):
            raise TypeError(f"ShardedView.local must be a torch.Tensor, got {type(self.local).__name__}")
        if self.local.dim() != 1:
            raise ValueError(f"ShardedView.local must be 1-D, got shape {tuple(self.local.shape)}")
        if not isinstance(self.layout, RaggedShard):
            raise TypeError(f"ShardedView.layout must be a RaggedShard, got {type(self.layout).__name__}")
        shape = torch.Size(self.shape)
        object.__setattr__(self, "shape", shape)
        if math.prod(shape) != self.layout.numel:
            raise ValueError(
                f"ShardedView shape {tuple(shape)} has {math.prod(shape)} elements, "
                f"layout has {self.layout.numel}"
            )
        w = self.layout.world_size
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < w:
            raise ValueError(f"ShardedView.rank must be an int in [0, {w}), got {self.rank!r}")
        if self.group is None:
            if w != 1:
                raise ValueError(f"ShardedView over {w} ranks needs a process group, got None")
        elif self.group.size() != w:
            raise ValueError(
                f"ShardedView layout has {w} ranks but its group has {self.group.size()}"
            )
        n = self.layout.local(self.rank)[1]
        if self.local.numel() != n:
            raise ValueError(
                f"ShardedView.local has {self.local.numel()} elements; the layout gives rank "
                f"{self.rank} {n}: {self.layout.extents}"
            )


def sharded_view(t: object) -> ShardedView:
    """The :class:`ShardedView` of a parameter (or of its ``.grad``).

    Accepts plain tensors / nn.Parameter, FSDP2 DTensors placed ``(Shard(0),)`` on a 1-D
    mesh or ``(Replicate(), Shard(0))`` on a 2-D HSDP mesh (the shard group is mesh
    axis 1; the replicate axis does not shard), and any object with a
    ``__sharded_view__()`` method returning a ShardedView. Other placements, meshes,
    tensor subclasses and non-contiguous tensors raise NotImplementedError; non-tensors
    without the protocol raise TypeError.
    """
    hook = getattr(type(t), "__sharded_view__", None)
    if hook is not None:
        view = hook(t)
        if not isinstance(view, ShardedView):
            raise TypeError(
                f"{type(t).__name__}.__sharded_view__() must return a ShardedView, "
                f"got {type(view).__name__}"
            )
        return view
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"sharded_view expects a tensor or a parameter, got {type(t).__name__}; supported: {_SUPPORTED}")
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return _dtensor_view(t)
    if type(t) not in (torch.Tensor, nn.Parameter, nn.Buffer):
        raise NotImplementedError(
            f"tensor subclass {type(t).__name__} is not supported; supported: {_SUPPORTED}"
        )
    if not t.is_contiguous():
        raise NotImplementedError(
            f"non-contiguous tensor (shape {tuple(t.shape)}, stride {t.stride()}) is not "
            f"supported: its flat storage is not row-major; pass a contiguous tensor"
        )
    return ShardedView(
        local=t.detach().view(-1),
        layout=RaggedShard.whole(t.numel(), 1, 0),
        group=None,
        shape=t.shape,
        rank=0,
    )


def _dtensor_view(dt: torch.Tensor) -> ShardedView:
    if dt.dim() == 0:
        raise NotImplementedError("a 0-d DTensor cannot be Shard(0); supported: " + _SUPPORTED)
    # layout, group and rank depend only on (mesh, placements, shape): computed once
    mesh = dt.device_mesh
    key = (tuple(dt.placements), tuple(dt.shape))
    # cached on the mesh object itself: meshes built again after a process group is
    # re-initialised compare equal to the old ones but hold new groups
    cache = mesh.__dict__.setdefault("_vefsdp_view_meta", {})
    meta = cache.get(key)
    if meta is None:
        if len(cache) > 4096:
            cache.clear()
        meta = cache[key] = _dtensor_meta(mesh, *key)
    layout, group, rank = meta
    w = layout.world_size
    local = dt._local_tensor
    n = layout.local(rank)[1]
    if local.numel() != n:
        raise NotImplementedError(
            f"DTensor local tensor on shard rank {rank} has {local.numel()} elements "
            f"(shape {tuple(local.shape)}); Shard(0) with torch.chunk semantics gives {n} "
            f"for global shape {tuple(dt.shape)} over {w} ranks; padded local tensors are not supported"
        )
    if not local.is_contiguous():
        raise NotImplementedError(
            f"DTensor local tensor is not contiguous (shape {tuple(local.shape)}, stride "
            f"{local.stride()}); supported: contiguous row shards as FSDP2 stores them"
        )
    return ShardedView(
        local=local.detach().view(-1),
        layout=layout,
        group=group,
        shape=dt.shape,
        rank=rank,
    )


def _dtensor_meta(mesh: object, placements: tuple, shape: tuple[int, ...]) -> tuple[
        RaggedShard, dist.ProcessGroup | None, int]:
    """(layout, shard group or None, rank in it) of a DTensor's placement on ``mesh``."""
    from torch.distributed.tensor import Replicate, Shard

    def is_shard0(p: object) -> bool:
        # exact type: _StridedShard (FSDP2 + TP) is not a plain row shard
        return type(p) is Shard and p.dim == 0

    if mesh.ndim == 1 and len(placements) == 1 and is_shard0(placements[0]):
        axis = 0
    elif (
        mesh.ndim == 2
        and len(placements) == 2
        and type(placements[0]) is Replicate
        and is_shard0(placements[1])
    ):
        axis = 1
    else:
        raise NotImplementedError(
            f"DTensor with placements {placements} on a {mesh.ndim}-D mesh {tuple(mesh.shape)} "
            f"is not supported; supported: {_SUPPORTED}"
        )
    w = mesh.size(axis)
    rank = mesh.get_local_rank(axis)
    layout = RaggedShard.shard0(shape, w)
    return layout, (mesh.get_group(axis) if w > 1 else None), (rank if w > 1 else 0)
