"""Reduce any supported parameter to one view: local flat data + layout + process group.

The optimizers accept three kinds of parameter (plain tensors, FSDP2 DTensors, this
library's own sharded parameters) and see each through a :class:`ShardedView`, so the
step loop never branches on the parameter's kind. ``local`` always aliases the
parameter's storage (see the comment above ``ShardedView``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from vefsdp_optim._torch_compat import FakeTensor, StridedShard, dtensor_local, mesh_flatten
from vefsdp_optim.sharding import BoxShard, RaggedShard

__all__ = ["ShardedView", "dtensor_boxes", "sharded_view"]

# ``ShardedView.local`` is always a view of the parameter's own storage, never a copy, so
# an optimizer that writes its update into ``local`` updates the parameter. For FSDP2 the
# DTensor's local tensor is a narrow of a padded per-rank buffer
# (``FSDPParam._sharded_param_data``). The narrow starts at offset 0 and is contiguous,
# so ``_local_tensor.view(-1)`` aliases exactly this rank's rows and not the padding.

_SUPPORTED = (
    "plain tensors and nn.Parameter (single device or DDP; FakeTensorMode's fakes of them), "
    "DTensors on any mesh whose placements are Shard, _StridedShard and Replicate (FSDP2, HSDP, "
    "tensor and expert parallel, with unpadded local tensors), and objects with a "
    "__sharded_view__() method"
)


@dataclass(frozen=True, slots=True)
class ShardedView:
    """One tensor reduced to what an optimizer needs.

    ``local`` is a 1-D view (no copy) of this rank's part of the tensor under ``layout``:
    its slice ``layout.local(rank)`` of the row-major flat storage for a RaggedShard, its
    box (or run of one) in the box's row-major order for a BoxShard ([Note: boxes in flat
    order]); writing into it writes the tensor. ``process_group`` is the shard process
    group (``layout.world_size`` ranks: the mesh axes that shard, flattened) or None when
    the tensor is not sharded.
    """

    local: torch.Tensor  # 1-D, layout.local_numel(rank) elems; may be empty
    layout: RaggedShard | BoxShard  # over the shard process group
    process_group: dist.ProcessGroup | None  # None iff layout.world_size == 1
    shape: torch.Size  # the global shape
    rank: int  # this rank's index in `process_group` (0 when it is None)

    def __post_init__(self) -> None:
        if not isinstance(self.local, torch.Tensor):
            raise TypeError("ShardedView.local must be a torch.Tensor, got "
                            f"{type(self.local).__name__}")
        if self.local.dim() != 1:
            raise ValueError(f"ShardedView.local must be 1-D, got shape {tuple(self.local.shape)}")
        if not isinstance(self.layout, (RaggedShard, BoxShard)):
            raise TypeError("ShardedView.layout must be a RaggedShard or a BoxShard, got "
                            f"{type(self.layout).__name__}")
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
        if self.process_group is None:
            if w != 1:
                raise ValueError(f"ShardedView over {w} ranks needs a process group, got None")
        elif self.process_group.size() != w:
            raise ValueError(
                f"ShardedView layout has {w} ranks but its process group has "
                f"{self.process_group.size()}"
            )
        n = self.layout.local_numel(self.rank)
        if self.local.numel() != n:
            raise ValueError(
                f"ShardedView.local has {self.local.numel()} elements; the layout gives rank "
                f"{self.rank} {n}: {self.layout}"
            )


def sharded_view(t: object) -> ShardedView:
    """The :class:`ShardedView` of a parameter (or of its ``.grad``).

    Accepts plain tensors / nn.Parameter, DTensors on any mesh placed with ``Shard``,
    ``_StridedShard`` and ``Replicate`` (see ``_dtensor_meta``), and any object with a
    ``__sharded_view__()`` method returning a ShardedView. Other placements (Partial)
    raise ValueError naming them; other tensor subclasses, padded DTensor local tensors
    and non-contiguous tensors raise NotImplementedError; non-tensors without the
    protocol raise TypeError.
    """
    kind = type(t)
    # first: the common case; a FakeTensor (FakeTensorMode's plain tensor) is one too
    if kind is torch.Tensor or kind is nn.Parameter or kind is nn.Buffer or kind is FakeTensor:
        if not t.is_contiguous():
            raise NotImplementedError(
                f"non-contiguous tensor (shape {tuple(t.shape)}, stride {t.stride()}) is not "
                f"supported: its flat storage is not row-major; pass a contiguous tensor"
            )
        return _plain_view(t, _flat(t))
    hook = getattr(kind, "__sharded_view__", None)
    if hook is not None:
        view = hook(t)
        if not isinstance(view, ShardedView):
            raise TypeError(
                f"{type(t).__name__}.__sharded_view__() must return a ShardedView, "
                f"got {type(view).__name__}"
            )
        return view
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"sharded_view expects a tensor or a parameter, got {type(t).__name__}; "
                        f"supported: {_SUPPORTED}")
    if isinstance(t, _dtensor_type()):
        return _dtensor_view(t)
    raise NotImplementedError(f"tensor subclass {kind.__name__} is not supported; supported: "
                              f"{_SUPPORTED}")


@functools.cache
def _dtensor_type() -> type:
    from torch.distributed.tensor import DTensor

    return DTensor


def _dtensor_view(dt: torch.Tensor) -> ShardedView:
    # layout, process group and rank depend only on (mesh, placements, shape): computed once
    mesh = dt.device_mesh
    key = (tuple(dt.placements), tuple(dt.shape))
    # cached on the mesh object itself: meshes built again after a process group is
    # re-initialized compare equal to the old ones but hold new process groups
    cache = mesh.__dict__.setdefault("_vefsdp_view_meta", {})
    meta = cache.get(key)
    checked = meta is not None
    if meta is None:
        if len(cache) > 4096:
            cache.clear()
        layout, process_group, rank = _dtensor_meta(mesh, *key)
        meta = cache[key] = (layout, process_group, rank,
                             layout.local_shape(rank) if isinstance(layout, BoxShard)
                             else None, layout.local_numel(rank), torch.Size(key[1]))
    layout, process_group, rank, want, n, shape = meta
    local = dtensor_local(dt)
    if local.numel() != n or (want is not None and tuple(local.shape) != want):
        raise NotImplementedError(
            f"DTensor with placements {key[0]} and global shape {key[1]} has a local tensor of "
            f"shape {tuple(local.shape)} on shard rank {rank}; torch.chunk semantics give "
            f"{want if want is not None else n} elements; padded local tensors are not supported")
    if not local.is_contiguous():
        raise NotImplementedError(
            f"DTensor local tensor is not contiguous (shape {tuple(local.shape)}, stride "
            f"{local.stride()}); supported: contiguous local tensors, as FSDP2 and tensor "
            "parallelism store them")
    if not checked:  # the first view of this placement: every check of ShardedView
        return ShardedView(local=_flat(local), layout=layout, process_group=process_group,
                           shape=shape, rank=rank)
    # the fields were checked when the meta was built
    return _trusted_view(_flat(local), layout, process_group, shape, rank)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A detached 1-D view of contiguous ``t`` (a 1-D tensor needs only ``detach``: each
    view is an op of ~2-4 us on a CPU, which a step over many small tensors notices)."""
    return t.detach() if t.dim() == 1 else t.detach().view(-1)


def step_grad_view(g: object) -> ShardedView:
    """:func:`sharded_view` of a gradient, for the step loop only (under
    ``torch.no_grad``; the view never reaches a user): a plain contiguous tensor outside
    autograd is not detached, and a 1-D one is its own flat view, which saves ~2-4 us a
    parameter on a CPU. Anything else goes to :func:`sharded_view`."""
    if type(g) is torch.Tensor and not g.requires_grad and g.is_contiguous():
        return _plain_view(g, g if g.dim() == 1 else g.view(-1))
    return sharded_view(g)


def _plain_view(t: torch.Tensor, local: torch.Tensor) -> ShardedView:
    """The view of unsharded ``t`` whose flat form is ``local``."""
    return _trusted_view(local, _whole_layout(t.numel()), None, t.shape, 0)


def _trusted_view(local: torch.Tensor, layout: RaggedShard | BoxShard,
                  process_group: dist.ProcessGroup | None,
                  shape: torch.Size, rank: int) -> ShardedView:
    """A ShardedView of fields that are valid by construction, without its checks (a
    step asks for two views of every parameter: ~10 us each on a CPU)."""
    view = object.__new__(ShardedView)
    _SET_LOCAL(view, local)  # the slots' own setters: frozen=True guards only __setattr__
    _SET_LAYOUT(view, layout)
    _SET_PROCESS_GROUP(view, process_group)
    _SET_SHAPE(view, shape)
    _SET_RANK(view, rank)
    return view


_SET_LOCAL, _SET_LAYOUT, _SET_PROCESS_GROUP, _SET_SHAPE, _SET_RANK = (
    getattr(ShardedView, name).__set__
    for name in ("local", "layout", "process_group", "shape", "rank"))


@functools.lru_cache(maxsize=4096)
def _whole_layout(numel: int) -> RaggedShard:
    """The layout of an unsharded tensor of ``numel`` elements."""
    return RaggedShard.whole(numel, 1, 0)


# A DTensor's placements say, per mesh axis, Shard(d), _StridedShard(d, sf) or
# Replicate(). The axes that shard form the shard process group, flattened in mesh order
# when there are several (rank = row-major coordinate over them). Replicate axes hold
# copies that compute alike, as HSDP's replicas do. Each tensor dim is split by its axes
# in nesting order, outermost first, each with torch.chunk semantics: DTensor's
# left-to-right order for Shard, except that _StridedShard(d, sf) on an axis is applied
# after the axes to its right whose sizes multiply to sf. For FSDP2 + TP that is the tp
# split first, then dp's chunk of the TP-local rows. Every rank then holds a box
# ([Note: boxes in flat order]). One contiguous flat range per rank in rank order is a
# RaggedShard (FSDP2's Shard(0), HSDP), anything else a BoxShard. Partial, a pending
# reduction, is refused: its values are not the tensor's.


def _dtensor_meta(mesh: Any, placements: tuple, shape: tuple[int, ...]) -> tuple[
        RaggedShard | BoxShard, dist.ProcessGroup | None, int]:
    """(layout, shard process group or None, rank in it) of a DTensor's placement on ``mesh``."""
    from torch.distributed.tensor import Replicate, Shard

    if len(placements) != mesh.ndim:
        raise AssertionError(f"{len(placements)} placements on a {mesh.ndim}-D mesh")
    per_dim: list[list[tuple[int, int | None]]] = [[] for _ in shape]
    for axis, p in enumerate(placements):
        if isinstance(p, Replicate):
            continue
        if isinstance(p, (Shard, StridedShard)) and 0 <= p.dim < len(shape):
            sf = int(p.split_factor) if isinstance(p, StridedShard) else None
            per_dim[p.dim].append((axis, sf))
            continue
        raise ValueError(
            f"DTensor with placements {placements} (global shape {shape}) on a {mesh.ndim}-D mesh "
            f"{tuple(mesh.shape)}: placement {p} on mesh axis {axis} is not supported; "
            f"supported: Shard, _StridedShard and Replicate placements (reduce Partial ones first)")
    boxes, axes = dtensor_boxes(mesh, placements, shape, per_dim)
    sizes = [mesh.size(a) for a in axes]
    coord = mesh.get_coordinate()
    rank = 0
    for a, s in zip(axes, sizes, strict=True):
        rank = rank * s + coord[a]
    layout = boxes.as_ragged() or boxes
    if layout.world_size == 1:
        return RaggedShard.whole(math.prod(shape), 1, 0), None, 0
    process_group = _shard_process_group(mesh, tuple(axes), placements)
    if dist.get_rank(process_group) != rank:
        raise AssertionError(f"rank {dist.get_rank(process_group)} in the shard process "
                             f"group of mesh axes {axes}, expected the row-major coordinate {rank}")
    return layout, process_group, rank


def dtensor_boxes(mesh: Any, placements: tuple, shape: tuple[int, ...],
                  per_dim: list[list[tuple[int,
                                           int | None]]] | None = None) -> tuple[BoxShard,
                                                                                 list[int]]:
    """Every shard rank's box of a DTensor placement (see ``_dtensor_meta``) and the
    mesh axes that shard (the box ranks are their row-major coordinates)."""
    from torch.distributed.tensor import Shard

    shape = tuple(shape)
    if per_dim is None:
        per_dim = [[] for _ in shape]
        for axis, p in enumerate(placements):
            if isinstance(p, (Shard, StridedShard)):
                per_dim[p.dim].append((axis,
                                       int(p.split_factor) if isinstance(p, StridedShard)
                                       else None))
    axes = sorted(a for d in per_dim for a, _ in d)
    sizes = [mesh.size(a) for a in axes]
    try:
        splits = [[axes.index(a) for a in _nesting(d, mesh, placements, shape)] for d in per_dim]
    except ValueError as e:
        raise ValueError(f"DTensor with placements {placements} (global shape {shape}) on mesh "
                         f"{tuple(mesh.shape)}: {e}") from None
    return BoxShard.nested_chunks(shape, sizes, splits), axes


def _nesting(entries: list[tuple[int, int | None]], mesh: Any, placements: tuple,
             shape: tuple[int, ...]) -> list[int]:
    """The mesh axes that split one dim, outermost first (see ``_dtensor_meta``)."""
    if not entries:
        return []
    (axis, sf), rest = entries[0], entries[1:]
    if sf is None or sf == 1:
        return [axis, *_nesting(rest, mesh, placements, shape)]
    prod, k = 1, 0
    while k < len(rest) and prod < sf:
        prod *= mesh.size(rest[k][0])
        k += 1
    if prod != sf:
        raise ValueError(f"_StridedShard(sf={sf}) on mesh axis {axis} is not matched by "
                         "the sizes of the later axes sharding the same dim; supported: split "
                         "factors equal to the product of the sizes of the axes that follow it "
                         "(FSDP2 + TP)")
    return [*_nesting(rest[:k], mesh, placements, shape), axis,
            *_nesting(rest[k:], mesh, placements, shape)]


def _shard_process_group(mesh: Any, axes: tuple[int, ...], placements: tuple) -> dist.ProcessGroup:
    """The process group over ``axes`` of ``mesh`` (flattened, in mesh order)."""
    if len(axes) == 1:
        return mesh.get_group(axes[0])
    cache = mesh.__dict__.setdefault("_vefsdp_shard_process_groups", {})
    process_group = cache.get(axes)
    if process_group is None:
        names = mesh.mesh_dim_names
        if not names:
            raise ValueError(
                f"DTensor placements {placements} shard over mesh axes {list(axes)} of a "
                "mesh without mesh_dim_names; name the mesh dims (init_device_mesh(..., "
                "mesh_dim_names=...)) so the optimizer can flatten them into one shard "
                "process group")
        sub = mesh[tuple(names[a] for a in axes)]
        process_group = cache[axes] = mesh_flatten(sub).get_group(0)
    return process_group
