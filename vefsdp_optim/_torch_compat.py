"""Every private torch name the library uses, and the torch versions it was checked on.

[Note: torch range] The library supports exactly the torch releases it is tested on:
``TORCH_RANGE`` (the pin in pyproject.toml), tested at its lowest and highest release
(``TESTED``; ``make test`` runs the suite on both). What torch does not promise to keep,
underscore names, lives here and nowhere else (tests/test_torch_compat.py resolves every
entry of ``PRIVATE_NAMES`` on the installed torch and scans the other modules for private
torch names), so moving to a new torch means reading this one file: check each name's
meaning on the new release, add the release to its entry, widen the range.

The modules outside this one import the public spellings below. Checked: the source of
each name compared between the releases listed, and the suite passing on them. They have
the same signature and meaning on every release in the range (2.14 changed type hints and
messages of ``DeviceMesh._concatenate`` and ``_to_scalar``, and added a padding helper to
``_StridedShard``), so nothing here branches on the version yet; a name that changes
gets its branch here.

Not listed: aten operator names in strings (``"_foreach_"``, ``"_fused_adam_"``, matched
by ``_sharded_dispatch`` as the dispatcher spells them) and torch's public API.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.autograd import Variable
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.filesystem import _StorageInfo as StorageInfo
from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING as MEM_FORMAT_ENCODING
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard
from torch.optim.optimizer import _device_dtype_check_for_fused as device_dtype_check_for_fused
from torch.optim.optimizer import _to_scalar as to_scalar
from torch.serialization import _get_layout as get_layout
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

__all__ = [
    "TORCH_RANGE", "TESTED", "PRIVATE_NAMES", "OVERRIDES",
    "flatten_state_dict", "set_element", "StorageInfo", "MEM_FORMAT_ENCODING", "get_layout",
    "StridedShard", "dtensor_local", "mesh_flatten", "mesh_concatenate",
    "device_dtype_check_for_fused", "to_scalar",
    "tree_flatten", "tree_map", "tree_unflatten",
    "make_wrapper_subclass", "op_schema", "tensordot", "ATEN_TO_COPY", "ATEN_FOREACH_NORM", "foreach_copy_",
    "foreach_lerp_", "foreach_add_",
    "storage_use_count", "tensor_version", "unsafe_preserve_version_counter",
    "unsafe_set_version_counter", "queue_autograd_callback",
    "module_parameters", "module_buffers", "module_apply",
]

TORCH_RANGE = ">=2.13,<2.15"  # pyproject.toml's pin
TESTED = ("2.13.0", "2.14.1")  # the lowest and highest release of the range: make test

# torch's dotted name -> the releases it was checked on (meaning and signature as used here)
PRIVATE_NAMES: dict[str, tuple[str, ...]] = {
    # checkpoints: DCP internals (_checkpoint, _safe_load)
    "torch.distributed.checkpoint._nested_dict.flatten_state_dict": TESTED,
    "torch.distributed.checkpoint._traverse.set_element": TESTED,
    "torch.distributed.checkpoint.filesystem._StorageInfo": TESTED,
    "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING": TESTED,
    "torch.serialization._get_layout": TESTED,
    # DTensor and DeviceMesh (comm._views, _fsdp._fully_shard)
    "torch.distributed.tensor.placement_types._StridedShard": TESTED,
    "torch.distributed.tensor.DTensor._local_tensor": TESTED,
    "torch.distributed.device_mesh.DeviceMesh._flatten": TESTED,
    "torch.distributed.device_mesh.DeviceMesh._concatenate": TESTED,
    # torch.optim's argument checks (_adamw: AdamW's signature and errors)
    "torch.optim.optimizer._device_dtype_check_for_fused": TESTED,
    "torch.optim.optimizer._to_scalar": TESTED,
    # the sharded tensor subclass and its dispatch (_fsdp._sharded_tensor, _sharded_dispatch)
    "torch.utils._pytree.tree_flatten": TESTED,
    "torch.utils._pytree.tree_map": TESTED,
    "torch.utils._pytree.tree_unflatten": TESTED,
    "torch.Tensor._make_wrapper_subclass": TESTED,
    "torch._ops.OpOverload._schema": TESTED,
    "torch.ops.aten._to_copy.default": TESTED,
    "torch.ops.aten._foreach_norm.Scalar": TESTED,
    # fully_shard's buffers, version counters and hooks (_fsdp._store, _group, _state)
    "torch._foreach_copy_": TESTED,
    "torch._C._storage_Use_Count": TESTED,
    "torch.UntypedStorage._cdata": TESTED,
    "torch.Tensor._version": TESTED,
    "torch.autograd._unsafe_preserve_version_counter": TESTED,
    "torch._C._autograd._unsafe_set_version_counter": TESTED,
    "torch.autograd.Variable._execution_engine": TESTED,
    # nn.Module's registries (_fsdp._param, _module, _fully_shard)
    "torch.nn.Module._parameters": TESTED,
    "torch.nn.Module._buffers": TESTED,
    "torch.nn.Module._apply": TESTED,
    # SOAP's rotations (_math._soap): torch.tensordot without its Python wrapper
    "torch._VF.tensordot": TESTED,
    # NorMuon's batched second moments (_math._normuon): one lerp_ per moment tensor
    "torch._foreach_lerp_": TESTED,
    # 8-bit Adam's step counts (_adam8bit): one add for a bucket's tensors, as torch.optim's
    "torch._foreach_add_": TESTED,
}

# Private names the library *defines*, on its subclass of torch's FSDPModule
# (_fsdp._module.FSDPModule), because torch reads or calls them: library attribute ->
# the torch attribute it overrides (each also in PRIVATE_NAMES' checks by the test).
OVERRIDES: dict[str, str] = {
    # torch's FSDPModule.__new__ builds cls.__mro__[cls._orig_cls_mro_index] (indexing
    # into a container of sharded modules)
    "FSDPModule._orig_cls_mro_index": "torch.distributed.fsdp.FSDPModule._orig_cls_mro_index",
    # module.to() / to_empty(): torch's FSDPModule._apply is FSDP2's; ours keeps the flat
    # buffers (module_apply below runs nn.Module's)
    "FSDPModule._apply": "torch.distributed.fsdp.FSDPModule._apply",
    # torch's FSDPModule methods call it; ours raises naming the library
    "FSDPModule._get_fsdp_state": "torch.distributed.fsdp.FSDPModule._get_fsdp_state",
}

make_wrapper_subclass = torch.Tensor._make_wrapper_subclass
ATEN_TO_COPY = torch.ops.aten._to_copy.default
ATEN_FOREACH_NORM = torch.ops.aten._foreach_norm.Scalar
foreach_copy_ = torch._foreach_copy_
unsafe_preserve_version_counter = torch.autograd._unsafe_preserve_version_counter
# torch.tensordot(a, b, dims=(dims_a, dims_b)) is a Python wrapper (argument parsing, then
# this call): the same aten op, so the same bits, with a fraction of the Python time of a
# small tensor's call (SOAP rotates every gradient through several per step)
tensordot = torch._VF.tensordot
foreach_lerp_ = torch._foreach_lerp_
foreach_add_ = torch._foreach_add_


def dtensor_local(dt: Any) -> torch.Tensor:
    """A DTensor's local tensor, without to_local()'s autograd node."""
    return dt._local_tensor


def mesh_flatten(mesh: DeviceMesh, name: str | None = None) -> DeviceMesh:
    """The 1-D mesh over all of ``mesh``'s dims (row-major), named ``name``."""
    return mesh._flatten(name)


def mesh_concatenate(meshes: Sequence[DeviceMesh]) -> DeviceMesh:
    """Sub-meshes of one root mesh as one mesh, their dims in order."""
    return DeviceMesh._concatenate(list(meshes))


def op_schema(func: Any) -> Any:
    """An OpOverload's schema (its arguments' alias annotations)."""
    return func._schema


def storage_use_count(t: torch.Tensor) -> int:
    """References to ``t``'s storage (tensors sharing it, and the storage object)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def tensor_version(t: torch.Tensor) -> int:
    """``t``'s version counter (bumped by every in-place write)."""
    return t._version


def unsafe_set_version_counter(tensors: tuple[torch.Tensor, ...], versions: tuple[int, ...]) -> None:
    torch._C._autograd._unsafe_set_version_counter(tensors, versions)


def queue_autograd_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the current backward pass ends."""
    Variable._execution_engine.queue_callback(callback)


def module_parameters(m: nn.Module) -> dict[str, nn.Parameter | None]:
    """``m``'s own parameter registry (the live dict: writes bypass __setattr__)."""
    return m._parameters


def module_buffers(m: nn.Module) -> dict[str, torch.Tensor | None]:
    """``m``'s own buffer registry (the live dict)."""
    return m._buffers


def module_apply(cls: type, m: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The ``_apply`` that follows ``cls`` in ``type(m)``'s MRO (``super(cls, m)._apply``)."""
    return super(cls, m)._apply(*args, **kwargs)
