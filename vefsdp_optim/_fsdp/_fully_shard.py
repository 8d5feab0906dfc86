"""fully_shard: FSDP2's entry point and FSDPModule methods, on RaggedShard buffers.

Applied bottom-up (each block, then the root). Each call manages the module's own
parameters not already managed by a fully_shard'd descendant, as one ShardGroup, and
installs the hooks of an FSDPState (_state.py); the module's class then also derives
from FSDPModule (_module.py).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor, Shard

from vefsdp_optim._torch_compat import (
    mesh_concatenate,
    mesh_flatten,
    module_buffers,
    module_parameters,
    require_data_parallel_mesh_dims,
)
from vefsdp_optim.comm import dtensor_boxes

from ._group import ShardGroup, check_shard_group_consistent
from ._module import FSDPModule, state_of
from ._param import ManagedParam, TensorParallel, mesh_key
from ._sharded_tensor import ShardedParameter
from ._state import FSDPState, ParamOutsideUse

if TYPE_CHECKING:  # torch >= 2.12 ([Note: torch range])
    from torch.distributed.fsdp import DataParallelMeshDims

__all__ = ["fully_shard", "FSDPModule", "FSDPState", "replaced_by_fully_shard"]

_CLS_CACHE: dict[type, type] = {}
# every Parameter object fully_shard replaced by a sharded one (weak: id -> object)
_REPLACED: weakref.WeakValueDictionary[int, nn.Parameter] = weakref.WeakValueDictionary()
# id of a replaced Parameter -> the (module, attribute) slots it was registered in, for
# the error on a tie across shard groups (dropped when the Parameter dies)
_REPLACED_IN: dict[int, list[tuple[weakref.ref[nn.Module], str]]] = {}


def replaced_by_fully_shard(t: object) -> bool:
    """Whether ``t`` is a Parameter that fully_shard replaced (the module now holds a
    sharded one; ``t`` gets no gradient any more)."""
    return _REPLACED.get(id(t)) is t


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
            raise ValueError(f"dp_mesh_dims names mesh dim {n!r}, not in mesh.mesh_dim_names {names}")
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


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
) -> nn.Module | list[nn.Module]:
    """Shard ``module``'s own parameters (not those of fully_shard'd descendants).

    ``module`` may be a list of modules (FSDP2's form): their parameters form one shard group
    that communicates together; it is gathered at the first of them to run forward and
    resharded when all have. ``mesh``: a 1-D DeviceMesh (shard over it) or a 2-D
    (replicate, shard) HSDP mesh; default: every rank of the default process group on the current
    device type. ``shard_placement_fn``: FSDP2's per-parameter placement; ``None``,
    ``Shard(0)`` and ``Shard(d)`` for a dim d of the parameter (torchtitan's ``Shard(1)``
    experts) are all stored as this library's layout (a RaggedShard of the flattened
    parameter, cut where the optimizers' blocks allow; [Note: shard placements]); a
    ``ShardPlacementResult`` shards its parameter over its own mesh (1-D, or HSDP's
    (replicate, shard)): the call then has one shard group per mesh ([Note: shard groups of
    one call]); any other placement raises NotImplementedError. Expert parallelism:
    experts as DTensors on an ``ep`` mesh and either torchtitan's one call per block (a
    ``ShardPlacementResult`` on ``edp_mesh`` for the experts) or two calls,
    ``fully_shard(experts, mesh=edp_mesh)``, then the block over ``dp``.
    ``offload_policy``: ``OffloadPolicy()`` (none) or ``CPUOffloadPolicy`` (the sharded
    parameters, gradients and optimizer step on the CPU: [Note: CPU offload] in
    _store.py). ``ignored_params``: left out of the shard group, as FSDP2.
    ``dp_mesh_dims``: FSDP2's names of the data-parallel dims of a larger SPMD ``mesh``
    (``shard=`` and optionally ``replicate=``); the shard group shards over that submesh
    (torch >= 2.12, which has ``DataParallelMeshDims``; on 2.11 NotImplementedError).
    Parameters are plain tensors or DTensors of tensor parallelism on a 1-D tp mesh
    (``parallelize_module`` first): each is sharded by its TP-local tensor over ``mesh``,
    model code sees DTensors on the tp mesh, the optimizers see the global tensor
    ([Note: fully_shard over tensor parallel]).
    Returns ``module``, each of whose classes now also derives from :class:`FSDPModule`
    (an instance of torch's ``FSDPModule``).
    """
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules:
        raise ValueError("fully_shard needs a module or a non-empty list of modules, got an empty list")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"fully_shard expects an nn.Module or a list of them, got {type(m).__name__}")
        if isinstance(m, FSDPModule):
            raise ValueError(f"fully_shard was already applied to this {type(m).__name__}")
    if reshard_after_forward is None:  # FSDP2's default: True, except at the root
        reshard_after_forward = True
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
    if dp_mesh_dims is not None:
        mesh = _dp_submesh(mesh, dp_mesh_dims, modules)
    shard_process_group, replicate_process_group = _process_groups(mesh)
    device = _default_device(mesh)
    offload, pin_memory = _check_offload(offload_policy)
    params = _collect(modules, device, set(map(id, ignored_params or ())))
    shard_groups = []
    for group_mesh, group_params in _by_mesh(params, shard_placement_fn, mesh):  # [Note: shard groups of one call]
        data = {}
        for mp in group_params:
            src = mp.sharded_src  # type: ignore[attr-defined]
            if isinstance(src, DTensor):  # [Note: fully_shard over tensor parallel]
                mp.tp = _tensor_parallel(mp, src, group_mesh)
                mp.shape = src.to_local().shape
                src = src.to_local()
            data[mp.fqn] = src
            del mp.sharded_src  # type: ignore[attr-defined]
        shard, replicate = _process_groups(group_mesh)
        shard_group = ShardGroup(group_params, shard_process_group=shard, replicate_process_group=replicate,
                                 device=device, mp_policy=mp_policy, data=data, offload=offload,
                                 pin_memory=pin_memory)
        shard_group.register(sharded=True)
        shard_groups.append(shard_group)
    if not params:  # ranks that do hold parameters here check their signature against this one
        check_shard_group_consistent(
            [], shard_process_group, replicate_process_group if replicate_process_group is not None
            and replicate_process_group.size() > 1 else None)
    for m in modules:
        _move_buffers(m, device)
    state = FSDPState(modules, shard_groups, reshard_after_forward, mp_policy)
    for mp in params:  # [Note: use outside forward]
        use = ParamOutsideUse(state, mp)
        mp.sharded.bind_outside_use(use)
        if mp.requires_grad:
            mp.sharded.register_hook(use.guard)
            mp.on_unsharded_grad = use.unsharded_grad
    state.originals.update({id(mp.original): mp.original for mp in params})
    _REPLACED.update({id(mp.original): mp.original for mp in params})
    for mp in params:
        _REPLACED_IN[id(mp.original)] = [(weakref.ref(m), attr) for m, attr in mp.slots]
        weakref.finalize(mp.original, _REPLACED_IN.pop, id(mp.original), None)
    for mp in params:
        del mp.original
    for m in modules:
        m.register_forward_pre_hook(state.pre_forward, prepend=True, with_kwargs=True)
        m.register_forward_hook(state.post_forward, prepend=False, with_kwargs=True)
        cls = type(m)
        new_cls = _CLS_CACHE.get(cls)
        if new_cls is None:
            new_cls = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
            _CLS_CACHE[cls] = new_cls
        m.__class__ = new_cls
        m._vefsdp_state = state
    return module


# [Note: shard placements]
# FSDP2's ``shard_placement_fn`` picks the dim its even chunks cut (``Shard(0)``, or
# ``Shard(1)``, which torchtitan gives experts fewer than edp x ep ranks so that dim 0 is
# not padded). This library stores every parameter as a RaggedShard of its flattened
# (TP-local) tensor, cut where the optimizers' blocks allow, so no placement changes the
# storage: ``Shard(d)`` for any dim d of the parameter is accepted and means "sharded
# over this call's mesh", as ``Shard(0)`` and ``None`` do. What FSDP2's dim-1 chunks buy
# (no padding of a short dim 0) the ragged cut already has. A rank's slice is then not
# FSDP2's chunk, for Shard(0) as for Shard(1); what a user sees through the public faces
# is the same: the global shape, ``full_tensor()``, the state dict and the DCP boxes of
# the global tensor, so a checkpoint moves between FSDP2's Shard(1) and this layout
# (tests/test_expert_parallel.py). FSDP2's per-parameter ``ShardPlacementResult`` also
# names a mesh: the parameter is sharded over that one (torchtitan's experts on
# ``efsdp``, the rest of the block on ``dp``), [Note: shard groups of one call]. Any other
# placement (Replicate, _StridedShard) raises NotImplementedError naming it.

# [Note: shard groups of one call]
# A shard group communicates over one (shard, replicate) pair of process groups, so one
# fully_shard call whose shard_placement_fn puts parameters on several meshes (FSDP2's
# ``ShardPlacementResult``: torchtitan's MoE block, experts over ``efsdp`` and the rest
# over ``dp``, in one call) gets one ShardGroup per distinct mesh, as FSDP2 gets one
# FSDPParamGroup per process group. Meshes are told apart by value ([Note: meshes by
# value]): equal meshes built twice share a group. The groups are ordered by their first
# parameter in the module's parameter order, the same on every rank, and every hook
# walks them in that order (each launches its all-gathers, then waits for each), so
# the collectives of each process group are issued in the same order on all of its
# ranks. They share the call's module hooks, reshard policy and mixed precision and
# enter and leave forward and backward together; each keeps its own stores, plan,
# gradient buffer and reduction. Two calls, ``fully_shard(experts, mesh=edp_mesh)`` then
# the block over ``dp``, shard the same way with one group each.


def _process_groups(mesh: DeviceMesh) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
    """(shard, replicate) process groups of a 1-D (shard) or 2-D (replicate, shard) mesh."""
    if mesh.ndim == 1:
        return mesh.get_group(0), None
    if mesh.ndim == 2:
        return mesh.get_group(1), mesh.get_group(0)
    raise ValueError(f"mesh must be 1-D (shard) or 2-D (replicate, shard), got {mesh.ndim}-D {mesh}")


def _by_mesh(params: list[ManagedParam], fn: Callable[[nn.Parameter], object] | None,
             mesh: DeviceMesh) -> list[tuple[DeviceMesh, list[ManagedParam]]]:
    """The parameters grouped by the mesh ``fn`` gives each (this call's mesh by default),
    in order of first parameter ([Note: shard groups of one call])."""
    groups: dict[tuple, tuple[DeviceMesh, list[ManagedParam]]] = {}
    for mp in params:
        own = mesh if fn is None else _check_placement(fn(mp.original), mp, mesh)  # type: ignore[attr-defined]
        groups.setdefault(mesh_key(own), (own, []))[1].append(mp)
    return list(groups.values())


def _result_mesh(result: object, name: str, mesh: DeviceMesh) -> DeviceMesh:
    """The mesh of FSDP2's ``ShardPlacementResult`` (its ``mesh_info``): 1-D with shard dim
    0, or 2-D with (replicate, shard) dims (0, 1), on the call's device type."""
    info = result.mesh_info  # type: ignore[attr-defined]
    other = getattr(info, "mesh", None)
    if not isinstance(other, DeviceMesh):
        raise TypeError(f"{name}: its mesh_info must carry a DeviceMesh (FSDP2's FSDPMeshInfo), got {info!r}")
    if getattr(info, "dp_mesh_dims", None) is not None:
        raise NotImplementedError(
            f"{name}: mesh_info with dp_mesh_dims (a full SPMD mesh) is not supported per parameter; "
            "give the data-parallel submesh itself (FSDPMeshInfo(mesh=edp_mesh, shard_mesh_dim=0))")
    dims = (getattr(info, "replicate_mesh_dim", None), getattr(info, "shard_mesh_dim", None))
    if dims not in ((None, 0), (0, 1)) or other.ndim != (1 if dims[0] is None else 2):
        raise NotImplementedError(
            f"{name}: (replicate, shard) mesh dims {dims} of a {other.ndim}-D mesh {other}; accepted: a 1-D "
            "mesh with shard_mesh_dim=0, or a 2-D HSDP mesh with replicate_mesh_dim=0, shard_mesh_dim=1")
    if other.device_type != mesh.device_type:
        raise ValueError(f"{name}: its mesh is on {other.device_type!r}, this call's mesh {mesh} on "
                         f"{mesh.device_type!r}; every mesh of one call must be on one device type")
    return other


def _check_placement(placement: object, mp: ManagedParam, mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ``mp`` is sharded over, for ``placement`` from shard_placement_fn, or raise
    ([Note: shard placements])."""
    name = f"shard_placement_fn gave {placement!r} for parameter {mp.fqn}"
    if placement is not None and hasattr(placement, "mesh_info") and hasattr(placement, "placement"):
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
        raise ValueError(f"{name}: dim {placement.dim} is out of range for its shape {tuple(mp.shape)} "
                         f"(expected -{ndim} <= dim < {ndim})")
    return mesh


def _tensor_parallel(mp: ManagedParam, p: DTensor, mesh: DeviceMesh) -> TensorParallel:
    """The TensorParallel spec of a DTensor parameter that fully_shard shards over the
    data-parallel ``mesh`` ([Note: fully_shard over tensor parallel])."""
    tp_mesh = p.device_mesh
    if tp_mesh.ndim != 1:
        raise NotImplementedError(
            f"parameter {mp.fqn} is a DTensor on a {tp_mesh.ndim}-D mesh {tp_mesh}; vefsdp_optim's "
            "fully_shard composes with tensor parallelism on a 1-D tp mesh (parallelize_module(..., "
            "mesh['tp'])); shard DTensors of other meshes with torch's fully_shard")
    shard_mesh = mesh if mesh.ndim == 1 else _shard_dim(mesh, mp.fqn)
    if tp_mesh.mesh_dim_names and shard_mesh.mesh_dim_names and \
            tp_mesh.mesh_dim_names[0] == shard_mesh.mesh_dim_names[0]:
        raise ValueError(f"parameter {mp.fqn} is a DTensor on the mesh dim {tp_mesh.mesh_dim_names[0]!r} "
                         "that fully_shard shards over; pass the data-parallel mesh (mesh['dp'])")
    boxes, axes = dtensor_boxes(tp_mesh, tuple(p.placements), tuple(p.shape))
    if not axes:  # replicated over tp: sharded over dp alone, like a plain parameter
        return TensorParallel(tp_mesh, tuple(p.placements), p.shape, p.stride(), None, None, 0)
    tp_rank = tp_mesh.get_local_rank(0)
    if shard_mesh.size() == 1:
        flat = tp_mesh.get_group(0)
    else:
        if not (tp_mesh.mesh_dim_names and shard_mesh.mesh_dim_names):
            raise ValueError(f"parameter {mp.fqn}: fully_shard over tensor parallel needs named meshes "
                             "(init_device_mesh(..., mesh_dim_names=('dp', 'tp'))) to form the dp x tp process group")
        flat = mesh_flatten(mesh_concatenate([shard_mesh, tp_mesh])).get_group(0)
    want = shard_mesh.get_local_rank(0) * tp_mesh.size() + tp_rank
    if dist.get_rank(flat) != want:
        raise AssertionError(f"rank {dist.get_rank(flat)} in the dp x tp process group, expected {want}")
    return TensorParallel(tp_mesh, tuple(p.placements), p.shape, p.stride(), boxes, flat, tp_rank)


def _shard_dim(mesh: DeviceMesh, fqn: str) -> DeviceMesh:
    """The shard dim of an HSDP (replicate, shard) mesh, as a 1-D mesh."""
    names = mesh.mesh_dim_names
    if not names:
        raise ValueError(f"parameter {fqn}: HSDP over tensor parallel needs a named mesh "
                         "(init_device_mesh(..., mesh_dim_names=...))")
    return mesh[names[1]]


def _check_offload(policy: object) -> tuple[bool, bool]:
    """(offload, pin_memory) of an ``offload_policy`` ([Note: CPU offload] in _store.py)."""
    if policy is None or type(policy) is OffloadPolicy:
        return False, False
    if isinstance(policy, CPUOffloadPolicy):
        return True, bool(policy.pin_memory)
    raise TypeError(f"offload_policy must be an OffloadPolicy or a CPUOffloadPolicy, got {type(policy).__name__}")


def _move_buffers(module: nn.Module, device: torch.device) -> None:
    """Buffers stay replicated (as in FSDP2); only their device follows the mesh."""
    for sub in module.modules():
        for name, b in list(module_buffers(sub).items()):
            if b is not None and b.device != device and not b.is_meta:  # meta: to_empty moves it
                module_buffers(sub)[name] = b.to(device)


# [Note: tied parameters across shard groups]
# A Parameter held by two modules that two sibling fully_shard calls shard (an embedding
# tied to the output head in another group) would become two sharded parameters, each
# trained on its own half of the gradient: FSDP2 does this silently (3 parameters become
# 4). The second call finds the module still holding the original Parameter that the
# first call replaced, and raises before any collective, naming both modules and the fix
# (one shard group for both). Every rank sees the same module structure, so all raise alike.


def _tie_error(mname: str, sub: nn.Module, attr: str, p: nn.Parameter,
               named: list[tuple[str, nn.Module]]) -> ValueError:
    """The error for ``sub.attr`` (at ``mname`` in this call), a Parameter an earlier call
    replaced: both modules by their paths in this call's module ``m`` where it holds both
    (the root call), else by class ([Note: tied parameters across shard groups])."""
    def where(path: str, m: nn.Module, a: str) -> str:
        cls = type(m)
        if issubclass(cls, FSDPModule) and cls.__bases__[0] is FSDPModule:  # the user's class
            cls = cls.__bases__[1]
        return f"{path}.{a} ({cls.__name__}.{a})" if path else f"{cls.__name__}.{a}"

    paths = {id(m): n.rstrip(".") for n, m in reversed(named)}  # the first path of each module
    others = [(m, a) for m, a in ((ref(), a) for ref, a in _REPLACED_IN.get(id(p), [])) if m is not None]
    there = " and ".join(where(paths.get(id(m), ""), m, a) for m, a in others) or "a parameter"
    known = [paths[id(m)] for m, _ in others if paths.get(id(m))]
    pair = f"; here fully_shard([m.{known[0]}, m.{mname}]), then fully_shard(m)" if mname and known else ""
    return ValueError(
        f"fully_shard: parameter {where(mname, sub, attr)} is the same Parameter as {there}, which "
        "another fully_shard call has already sharded: the tied weight (e.g. an embedding and its "
        "output head) would be untied, each copy trained apart. Shard both modules in one shard group, "
        f"one call with a list (fully_shard([embed_module, head_module]){pair}), or apply "
        "fully_shard to their lowest common ancestor only")


def _collect(modules: list[nn.Module], device: torch.device,
             ignored: set[int] = frozenset()) -> list[ManagedParam]:  # type: ignore[assignment]
    """The modules' parameters not managed by a fully_shard'd descendant (names prefixed
    by the module's index when there are several)."""
    managed: dict[int, ManagedParam] = {}
    order: list[ManagedParam] = []
    inner_ids: set[int] = set()
    for module in modules:
        for sub in module.modules():
            if sub is not module and isinstance(sub, FSDPModule):
                inner_ids.update(id(m) for m in sub.modules())
    named = [(f"{i}.{n}" if len(modules) > 1 else n, sub) for i, module in enumerate(modules)
             for n, sub in module.named_modules(remove_duplicate=False)]
    for mname, sub in named:
        mname = mname.rstrip(".")
        if id(sub) in inner_ids:
            continue
        for attr, p in list(module_parameters(sub).items()):
            if p is None or id(p) in ignored:
                continue
            if replaced_by_fully_shard(p):  # [Note: tied parameters across shard groups]
                raise _tie_error(mname, sub, attr, p, named)
            if isinstance(p, ShardedParameter):
                raise ValueError(
                    f"parameter {mname + '.' if mname else ''}{attr} is shared with a module already "
                    "managed by a nested fully_shard; tied parameters must be managed by one shard group: "
                    "apply fully_shard to their lowest common ancestor only")
            fqn = f"{mname}.{attr}" if mname else attr
            mp = managed.get(id(p))
            if mp is None:
                mp = ManagedParam(fqn, [], p.shape, p.requires_grad)
                # meta parameters (large models built under torch.device("meta")) give
                # their shape and dtype only: the local shard is allocated, uninitialised
                mp.sharded_src = p.detach() if p.is_meta else p.detach().to(device)  # type: ignore[attr-defined]
                mp.original = p  # type: ignore[attr-defined]
                managed[id(p)] = mp
                order.append(mp)
            if (sub, attr) not in mp.slots:
                mp.slots.append((sub, attr))
    # a parameter of this module also held by a managed child (whose slot now holds a copy)
    inner_originals = [state_of(sub).originals for module in modules for sub in module.modules()
                       if sub is not module and isinstance(sub, FSDPModule)]
    for mp in order:
        for orig in inner_originals:
            if orig.get(id(mp.original)) is mp.original:
                raise ValueError(
                    f"parameter {mp.fqn} is shared with a nested fully_shard'd module; tied "
                    "parameters must be managed by one shard group: apply fully_shard to their lowest "
                    "common ancestor only")
    return order
