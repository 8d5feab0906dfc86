"""The meshes and placements of a fully_shard call: its default mesh and device, the
data-parallel submesh that ``dp_mesh_dims`` names, each mesh's (shard, replicate) process
groups, the mesh each parameter's ``shard_placement_fn`` result names, and the
TensorParallel spec of a DTensor parameter. Checks only: nothing here communicates
except to build process groups.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from vefsdp_optim._torch_compat import (
    mesh_concatenate,
    mesh_flatten,
    require_data_parallel_mesh_dims,
)
from vefsdp_optim.comm import dtensor_boxes

from ._param import ManagedParam, TensorParallel


def _default_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    acc = getattr(torch, mesh.device_type)
    return torch.device(mesh.device_type, acc.current_device())


def _init_mesh() -> DeviceMesh:
    if not dist.is_initialized():
        raise ValueError("fully_shard needs torch.distributed initialized or an explicit mesh")
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    dt = acc.type if acc is not None else "cpu"
    return init_device_mesh(dt, (dist.get_world_size(),))


def _dp_submesh(mesh: DeviceMesh, dims: object, modules: list[nn.Module]) -> DeviceMesh:
    """The 1-D (shard) or 2-D (replicate, shard) data-parallel mesh that ``dims`` names in
    the full SPMD ``mesh``, as FSDP2 takes it out (several names: flattened into one dim)."""
    if not isinstance(dims, require_data_parallel_mesh_dims("fully_shard(dp_mesh_dims=...)")):
        raise TypeError(f"dp_mesh_dims must be a DataParallelMeshDims, got {type(dims).__name__}")
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError("mesh must have mesh_dim_names when dp_mesh_dims is given")
    for n in (*dims.shard_names, *dims.replicate_names):
        if n not in names:
            raise ValueError(f"dp_mesh_dims names mesh dim {n!r}, not in "
                             f"mesh.mesh_dim_names {names}")
    if not dims.shard_names:
        raise NotImplementedError(
            f"dp_mesh_dims={dims} replicates without sharding (DDP); vefsdp_optim's fully_shard "
            "needs a shard dim (shard=...), with or without replicate=...")

    def sub(group: tuple[str, ...]) -> DeviceMesh:
        return mesh[group[0]] if len(group) == 1 else mesh_flatten(mesh[group], "_".join(group))

    shard = sub(dims.shard_names)
    if not dims.replicate_names:
        return shard
    return mesh_concatenate([sub(dims.replicate_names), shard])


def _process_groups(mesh: DeviceMesh) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
    """(shard, replicate) process groups of a 1-D (shard) or 2-D (replicate, shard) mesh."""
    if mesh.ndim == 1:
        return mesh.get_group(0), None
    if mesh.ndim == 2:
        return mesh.get_group(1), mesh.get_group(0)
    raise ValueError("mesh must be 1-D (shard) or 2-D (replicate, shard), got "
                     f"{mesh.ndim}-D {mesh}")


def _result_mesh(result: object, name: str, mesh: DeviceMesh) -> DeviceMesh:
    """The mesh of FSDP2's ``ShardPlacementResult`` (its ``mesh_info``): 1-D with shard dim
    0, or 2-D with (replicate, shard) dims (0, 1), on the call's device type."""
    info = result.mesh_info  # type: ignore[attr-defined]
    other = getattr(info, "mesh", None)
    if not isinstance(other, DeviceMesh):
        raise TypeError(f"{name}: its mesh_info must carry a DeviceMesh (FSDP2's FSDPMeshInfo), "
                        f"got {info!r}")
    if getattr(info, "dp_mesh_dims", None) is not None:
        raise NotImplementedError(
            f"{name}: mesh_info with dp_mesh_dims (a full SPMD mesh) is not supported "
            "per parameter; give the data-parallel submesh itself (FSDPMeshInfo(mesh=edp_mesh, "
            "shard_mesh_dim=0))")
    dims = (getattr(info, "replicate_mesh_dim", None), getattr(info, "shard_mesh_dim", None))
    if dims not in ((None, 0), (0, 1)) or other.ndim != (1 if dims[0] is None else 2):
        raise NotImplementedError(
            f"{name}: (replicate, shard) mesh dims {dims} of a {other.ndim}-D mesh {other}; "
            "accepted: a 1-D mesh with shard_mesh_dim=0, or a 2-D HSDP mesh with "
            "replicate_mesh_dim=0, shard_mesh_dim=1")
    if other.device_type != mesh.device_type:
        raise ValueError(f"{name}: its mesh is on {other.device_type!r}, this call's "
                         f"mesh {mesh} on {mesh.device_type!r}; every mesh of one call must be on "
                         "one device type")
    return other


def _check_placement(placement: object, mp: ManagedParam, mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ``mp`` is sharded over, for ``placement`` from shard_placement_fn, or raise.

    FSDP2's ``shard_placement_fn`` picks the dim its even chunks cut (``Shard(0)``, or
    ``Shard(1)``, which torchtitan gives experts fewer than edp x ep ranks so that dim 0 is
    not padded). This library stores every parameter as a RaggedShard of its flattened
    (TP-local) tensor, cut where the optimizers' blocks allow, so no placement changes the
    storage: ``Shard(d)`` for any dim d of the parameter is accepted and means "sharded
    over this call's mesh", as ``Shard(0)`` and ``None`` do. What FSDP2's dim-1 chunks buy
    (no padding of a short dim 0) the ragged cut already has. A rank's slice is then not
    FSDP2's chunk, for Shard(0) as for Shard(1); what a user sees through the public faces
    is the same: the global shape, ``full_tensor()``, the state dict and the DCP boxes of
    the global tensor, so a checkpoint moves between FSDP2's Shard(1) and this layout
    (tests/test_expert_parallel.py). FSDP2's per-parameter ``ShardPlacementResult`` also
    names a mesh: the parameter is sharded over that one (torchtitan's experts on
    ``efsdp``, the rest of the block on ``dp``; ``_by_mesh`` in _fully_shard.py). Any
    other placement (Replicate, _StridedShard) raises NotImplementedError naming it."""
    name = f"shard_placement_fn gave {placement!r} for parameter {mp.fqn}"
    if placement is not None and hasattr(placement, "mesh_info") and hasattr(placement,
                                                                             "placement"):
        mesh = _result_mesh(placement, name, mesh)  # FSDP2's ShardPlacementResult
        placement = placement.placement
    if placement is None:
        return mesh
    if type(placement) is not Shard:
        raise NotImplementedError(
            f"{name}; vefsdp_optim's fully_shard accepts None, Shard(0) or Shard(d) for a dim d of "
            "the parameter (all stored as its RaggedShard layout of the flattened parameter); use "
            "torch's fully_shard for other placements")
    ndim = max(len(mp.shape), 1)
    if not -ndim <= placement.dim < ndim:
        raise ValueError(f"{name}: dim {placement.dim} is out of range for its shape "
                         f"{tuple(mp.shape)} (expected -{ndim} <= dim < {ndim})")
    return mesh


def _tensor_parallel(mp: ManagedParam, p: DTensor, mesh: DeviceMesh) -> TensorParallel:
    """The TensorParallel spec of a DTensor parameter that fully_shard shards over the
    data-parallel ``mesh`` (see ``TensorParallel`` in vefsdp_optim/_fsdp/_param.py)."""
    tp_mesh = p.device_mesh
    if tp_mesh.ndim != 1:
        raise NotImplementedError(
            f"parameter {mp.fqn} is a DTensor on a {tp_mesh.ndim}-D mesh {tp_mesh}; vefsdp_optim's "
            "fully_shard composes with tensor parallelism on a 1-D tp mesh "
            "(parallelize_module(..., mesh['tp'])); shard DTensors of other meshes with "
            "torch's fully_shard")
    shard_mesh = mesh if mesh.ndim == 1 else _shard_dim(mesh, mp.fqn)
    if tp_mesh.mesh_dim_names and shard_mesh.mesh_dim_names and \
            tp_mesh.mesh_dim_names[0] == shard_mesh.mesh_dim_names[0]:
        raise ValueError(f"parameter {mp.fqn} is a DTensor on the mesh dim "
                         f"{tp_mesh.mesh_dim_names[0]!r} that fully_shard shards over; pass the "
                         "data-parallel mesh (mesh['dp'])")
    boxes, axes = dtensor_boxes(tp_mesh, tuple(p.placements), tuple(p.shape))
    if not axes:  # replicated over tp: sharded over dp alone, like a plain parameter
        return TensorParallel(tp_mesh, tuple(p.placements), p.shape, p.stride(), None, None, 0)
    tp_rank = tp_mesh.get_local_rank(0)
    if shard_mesh.size() == 1:
        flat = tp_mesh.get_group(0)
    else:
        if not (tp_mesh.mesh_dim_names and shard_mesh.mesh_dim_names):
            raise ValueError(f"parameter {mp.fqn}: fully_shard over tensor parallel needs "
                             "named meshes (init_device_mesh(..., mesh_dim_names=('dp', 'tp'))) to "
                             "form the dp x tp process group")
        flat = mesh_flatten(mesh_concatenate([shard_mesh, tp_mesh])).get_group(0)
    want = shard_mesh.get_local_rank(0) * tp_mesh.size() + tp_rank
    if dist.get_rank(flat) != want:
        raise AssertionError(f"rank {dist.get_rank(flat)} in the dp x tp process group, "
                             f"expected {want}")
    return TensorParallel(tp_mesh, tuple(p.placements), p.shape, p.stride(), boxes, flat, tp_rank)


def _shard_dim(mesh: DeviceMesh, fqn: str) -> DeviceMesh:
    """The shard dim of an HSDP (replicate, shard) mesh, as a 1-D mesh."""
    names = mesh.mesh_dim_names
    if not names:
        raise ValueError(f"parameter {fqn}: HSDP over tensor parallel needs a named mesh "
                         "(init_device_mesh(..., mesh_dim_names=...))")
    return mesh[names[1]]
