"""fully_shard: FSDP2's entry point and FSDPModule methods, on RaggedShard buffers.

Applied bottom-up (each block, then the root). Each call manages the module's own
parameters not already managed by a fully_shard'd descendant, as one ShardGroup, and
installs the hooks of an FSDPState (_state.py); the module's class then also derives
from FSDPModule (_module.py).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor, Shard

from vefsdp_optim._torch_compat import module_buffers, module_parameters

from ._group import ShardGroup, check_shard_group_consistent
from ._module import FSDPModule, state_of
from ._param import ManagedParam, mesh_key
from ._placement import (
    _check_placement,
    _default_device,
    _dp_submesh,
    _init_mesh,
    _process_groups,
    _tensor_parallel,
)
from ._sharded_tensor import ShardedParameter
from ._state import FSDPState, ParamOutsideUse

if TYPE_CHECKING:  # torch >= 2.12 (see vefsdp_optim/_torch_compat.py)
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

    ``module`` may be a list of modules (FSDP2's form): their parameters form one shard group that
    communicates together; it is gathered at the first of them to run forward and resharded when
    all have. ``mesh``: a 1-D DeviceMesh (shard over it) or a 2-D (replicate, shard) HSDP mesh;
    default: every rank of the default process group on the current device type.
    ``shard_placement_fn``: FSDP2's per-parameter placement; ``None``, ``Shard(0)`` and
    ``Shard(d)`` for a dim d of the parameter (torchtitan's ``Shard(1)`` experts) are all stored
    as this library's layout (a RaggedShard of the flattened parameter, cut where the optimizers'
    blocks allow; ``_check_placement`` in vefsdp_optim/_fsdp/_placement.py); a
    ``ShardPlacementResult`` shards its parameter over its own mesh (1-D, or HSDP's (replicate,
    shard)): the call then has one shard group per mesh (see ``_by_mesh``); any other placement
    raises NotImplementedError. Expert parallelism: experts as DTensors on an ``ep`` mesh and
    either torchtitan's one call per block (a ``ShardPlacementResult`` on ``edp_mesh`` for the
    experts) or two calls, ``fully_shard(experts, mesh=edp_mesh)``, then the block over ``dp``.
    ``offload_policy``: ``OffloadPolicy()`` (none) or ``CPUOffloadPolicy`` (the sharded
    parameters, gradients and optimizer step on the CPU: ``DtypeStore`` in
    vefsdp_optim/_fsdp/_store.py). ``ignored_params``: left out of the shard group, as FSDP2.
    ``dp_mesh_dims``: FSDP2's names of the data-parallel dims of a larger SPMD ``mesh``
    (``shard=`` and optionally ``replicate=``); the shard group shards over that submesh (torch >=
    2.12, which has ``DataParallelMeshDims``; on 2.11 NotImplementedError). Parameters are plain
    tensors or DTensors of tensor parallelism on a 1-D tp mesh (``parallelize_module`` first):
    each is sharded by its TP-local tensor over ``mesh``, model code sees DTensors on the tp mesh,
    the optimizers see the global tensor (see ``TensorParallel`` in vefsdp_optim/_fsdp/_param.py).
    Returns ``module``, each of whose classes now also derives from :class:`FSDPModule` (an
    instance of torch's ``FSDPModule``).
    """
    modules = _check_modules(module)
    reshard_after_forward = _check_reshard(reshard_after_forward)
    mp_policy = MixedPrecisionPolicy() if mp_policy is None else mp_policy
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}")
    mesh = _check_mesh(mesh, dp_mesh_dims, modules)
    shard_process_group, replicate_process_group = _process_groups(mesh)
    device = _default_device(mesh)
    offload, pin_memory = _check_offload(offload_policy)
    collected = _collect(modules, set(map(id, ignored_params or ())))
    shard_groups = []
    # one shard group per mesh (see _by_mesh below)
    for group_mesh, group in _by_mesh(collected, shard_placement_fn, mesh):
        data = _shard_data(group, group_mesh, device)
        shard, replicate = _process_groups(group_mesh)
        shard_groups.append(ShardGroup(
            [c.mp for c in group], shard_process_group=shard, replicate_process_group=replicate,
            device=device, mp_policy=mp_policy, data=data, offload=offload, pin_memory=pin_memory))
        shard_groups[-1].register(sharded=True)
    if not collected:  # ranks that do hold parameters here check their signature against this one
        check_shard_group_consistent(
            [], shard_process_group, replicate_process_group if replicate_process_group is not None
            and replicate_process_group.size() > 1 else None, device)
    for m in modules:
        _move_buffers(m, device)
    state = FSDPState(modules, shard_groups, reshard_after_forward, mp_policy)
    _bind_outside_use(state, collected)
    _record_replaced(state, collected)
    for m in modules:
        _install(m, state)
    return module


@dataclass(frozen=True, slots=True)
class _Collected:
    """One parameter a fully_shard call manages, as ``_collect`` found it, until its
    shard group is built and the Parameter it replaces is recorded."""

    mp: ManagedParam
    original: nn.Parameter  # the Parameter the modules held, replaced by ``mp.sharded``


def _check_modules(module: nn.Module | list[nn.Module]) -> list[nn.Module]:
    """``module`` as a non-empty list of modules not yet fully_shard'd, or raise."""
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules:
        raise ValueError("fully_shard needs a module or a non-empty list of modules, got "
                         "an empty list")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError("fully_shard expects an nn.Module or a list of them, got "
                            f"{type(m).__name__}")
        if isinstance(m, FSDPModule):
            raise ValueError(f"fully_shard was already applied to this {type(m).__name__}")
    return modules


def _check_mesh(mesh: object, dp_mesh_dims: object, modules: list[nn.Module]) -> DeviceMesh:
    """The mesh this call shards over: ``mesh`` (default: every rank of the default process
    group), or its data-parallel submesh when ``dp_mesh_dims`` names one."""
    mesh = _init_mesh() if mesh is None else mesh
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a DeviceMesh, got {type(mesh).__name__}")
    return mesh if dp_mesh_dims is None else _dp_submesh(mesh, dp_mesh_dims, modules)


def _check_reshard(reshard_after_forward: object) -> bool:
    if reshard_after_forward is None:  # FSDP2's default: True, except at the root
        return True
    if not isinstance(reshard_after_forward, bool):
        raise NotImplementedError(
            f"reshard_after_forward must be a bool, got {reshard_after_forward!r}; "
            "resharding to a smaller world (int) is not supported")
    return reshard_after_forward


def _shard_data(group: list[_Collected], mesh: DeviceMesh,
                device: torch.device) -> dict[str, torch.Tensor]:
    """fqn -> the local data a shard group over ``mesh`` starts from, on ``device``: a
    DTensor's TP-local tensor, whose ManagedParam takes its TensorParallel spec and local
    shape (see ``TensorParallel`` in vefsdp_optim/_fsdp/_param.py)."""
    data = {}
    for c in group:
        # meta parameters (large models built under torch.device("meta")) give their
        # shape and dtype only: the local shard is allocated, uninitialized
        p = c.original
        src = p.detach() if p.is_meta else p.detach().to(device)
        if isinstance(src, DTensor):
            c.mp.tp = _tensor_parallel(c.mp, src, mesh)
            c.mp.shape = src.to_local().shape
            src = src.to_local()
        data[c.mp.fqn] = src
    return data


def _bind_outside_use(state: FSDPState, collected: list[_Collected]) -> None:
    """Each sharded parameter's guard against use outside forward ([Note: use outside forward])."""
    for c in collected:
        use = ParamOutsideUse(state, c.mp)
        c.mp.sharded.bind_outside_use(use)
        if c.mp.requires_grad:
            c.mp.sharded.register_hook(use.guard)
            c.mp.on_unsharded_grad = use.unsharded_grad


def _record_replaced(state: FSDPState, collected: list[_Collected]) -> None:
    """The replaced Parameters, by id, for ``replaced_by_fully_shard``, the nested-tie check
    of an enclosing call and ``_tie_error``."""
    state.originals.update({id(c.original): c.original for c in collected})
    _REPLACED.update({id(c.original): c.original for c in collected})
    for c in collected:
        _REPLACED_IN[id(c.original)] = [(weakref.ref(m), attr) for m, attr in c.mp.slots]
        weakref.finalize(c.original, _REPLACED_IN.pop, id(c.original), None)


def _install(m: nn.Module, state: FSDPState) -> None:
    """``state``'s forward hooks on ``m``, whose class then also derives from FSDPModule."""
    m.register_forward_pre_hook(state.pre_forward, prepend=True, with_kwargs=True)
    m.register_forward_hook(state.post_forward, prepend=False, with_kwargs=True)
    cls = type(m)
    new_cls = _CLS_CACHE.get(cls)
    if new_cls is None:
        new_cls = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
        _CLS_CACHE[cls] = new_cls
    m.__class__ = new_cls
    m._vefsdp_state = state


# A shard group communicates over one (shard, replicate) pair of process groups, so one
# fully_shard call whose shard_placement_fn puts parameters on several meshes (FSDP2's
# ``ShardPlacementResult``: torchtitan's MoE block, experts over ``efsdp`` and the rest
# over ``dp``, in one call) gets one ShardGroup per distinct mesh, as FSDP2 gets one
# FSDPParamGroup per process group. Meshes are told apart by value (``mesh_key`` in
# _param.py): equal meshes built twice share a group. The groups are ordered by their
# first parameter in the module's parameter order, the same on every rank, and every
# hook walks them in that order (each launches its all-gathers, then waits for each), so
# the collectives of each process group are issued in the same order on all of its
# ranks. They share the call's module hooks, reshard policy and mixed precision and
# enter and leave forward and backward together; each keeps its own stores, plan,
# gradient buffer and reduction. Two calls, ``fully_shard(experts, mesh=edp_mesh)`` then
# the block over ``dp``, shard the same way with one group each.


def _by_mesh(params: list[_Collected], fn: Callable[[nn.Parameter], object] | None,
             mesh: DeviceMesh) -> list[tuple[DeviceMesh, list[_Collected]]]:
    """The parameters grouped by the mesh ``fn`` gives each (this call's mesh by default),
    in order of first parameter (see the comment above)."""
    groups: dict[tuple, tuple[DeviceMesh, list[_Collected]]] = {}
    for c in params:
        own = mesh if fn is None else _check_placement(fn(c.original), c.mp, mesh)
        groups.setdefault(mesh_key(own), (own, []))[1].append(c)
    return list(groups.values())


def _check_offload(policy: object) -> tuple[bool, bool]:
    """(offload, pin_memory) of an ``offload_policy`` (see ``DtypeStore`` in
    vefsdp_optim/_fsdp/_store.py)."""
    if policy is None or type(policy) is OffloadPolicy:
        return False, False
    if isinstance(policy, CPUOffloadPolicy):
        return True, bool(policy.pin_memory)
    raise TypeError("offload_policy must be an OffloadPolicy or a CPUOffloadPolicy, got "
                    f"{type(policy).__name__}")


def _move_buffers(module: nn.Module, device: torch.device) -> None:
    """Buffers stay replicated (as in FSDP2); only their device follows the mesh."""
    for sub in module.modules():
        for name, b in list(module_buffers(sub).items()):
            if b is not None and b.device != device and not b.is_meta:  # meta: to_empty moves it
                module_buffers(sub)[name] = b.to(device)


# A Parameter held by two modules that two sibling fully_shard calls shard (an embedding
# tied to the output head in another group) would become two sharded parameters, each
# trained on its own half of the gradient: FSDP2 does this silently (3 parameters become
# 4). The second call finds the module still holding the original Parameter that the
# first call replaced, and raises before any collective, naming both modules and the fix
# (one shard group for both). Every rank sees the same module structure, so all raise
# alike.


def _tie_error(mname: str, sub: nn.Module, attr: str, p: nn.Parameter,
               named: list[tuple[str, nn.Module]]) -> ValueError:
    """The error for ``sub.attr`` (at ``mname`` in this call), a Parameter an earlier call
    replaced: both modules by their paths in this call's module ``m`` where it holds both
    (the root call), else by class (see the comment above)."""
    def where(path: str, m: nn.Module, a: str) -> str:
        cls = type(m)
        if issubclass(cls, FSDPModule) and cls.__bases__[0] is FSDPModule:  # the user's class
            cls = cls.__bases__[1]
        return f"{path}.{a} ({cls.__name__}.{a})" if path else f"{cls.__name__}.{a}"

    paths = {id(m): n.rstrip(".") for n, m in reversed(named)}  # the first path of each module
    others = [(m, a) for m, a in ((ref(), a) for ref, a in _REPLACED_IN.get(id(p), []))
              if m is not None]
    there = " and ".join(where(paths.get(id(m), ""), m, a) for m, a in others) or "a parameter"
    known = [paths[id(m)] for m, _ in others if paths.get(id(m))]
    pair = (f"; here fully_shard([m.{known[0]}, m.{mname}]), then fully_shard(m)" if mname and known
            else "")
    return ValueError(
        f"fully_shard: parameter {where(mname, sub, attr)} is the same Parameter as {there}, which "
        "another fully_shard call has already sharded: the tied weight (e.g. an embedding and its "
        "output head) would be untied, each copy trained apart. Shard both modules in one "
        "shard group, one call with a list (fully_shard([embed_module, "
        f"head_module]){pair}), or apply fully_shard to their lowest common ancestor only")


def _collect(modules: list[nn.Module],
             ignored: set[int] | frozenset[int] = frozenset()) -> list[_Collected]:
    """The modules' parameters not managed by a fully_shard'd descendant (names prefixed
    by the module's index when there are several)."""
    managed: dict[int, ManagedParam] = {}
    order: list[_Collected] = []
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
            if replaced_by_fully_shard(p):  # ``_tie_error``
                raise _tie_error(mname, sub, attr, p, named)
            if isinstance(p, ShardedParameter):
                raise ValueError(
                    f"parameter {mname + '.' if mname else ''}{attr} is shared with a "
                    "module already managed by a nested fully_shard; tied parameters must be "
                    "managed by one shard group: apply fully_shard to their lowest common "
                    "ancestor only")
            fqn = f"{mname}.{attr}" if mname else attr
            mp = managed.get(id(p))
            if mp is None:
                mp = ManagedParam(fqn, [], p.shape, p.requires_grad)
                managed[id(p)] = mp
                order.append(_Collected(mp, p))
            if (sub, attr) not in mp.slots:
                mp.slots.append((sub, attr))
    # a parameter of this module also held by a managed child (whose slot now holds a copy)
    inner_originals = [state_of(sub).originals for module in modules for sub in module.modules()
                       if sub is not module and isinstance(sub, FSDPModule)]
    for c in order:
        for orig in inner_originals:
            if orig.get(id(c.original)) is c.original:
                raise ValueError(
                    f"parameter {c.mp.fqn} is shared with a nested fully_shard'd module; tied "
                    "parameters must be managed by one shard group: apply fully_shard to "
                    "their lowest common ancestor only")
    return order
