"""Every private torch name the library uses, and the torch versions it was checked on.

The library supports exactly the torch releases it is tested on:
``TORCH_RANGE`` (the pin in pyproject.toml), tested at its lowest and highest release
(``TESTED``; ``make test`` runs the suite on both). What torch does not promise to keep,
underscore names, lives here and nowhere else (tests/test_torch_compat.py resolves every
entry of ``PRIVATE_NAMES`` on the installed torch and scans the other modules for private
torch names), so moving to a new torch means reading this one file: check each name's
meaning on the new release, add the release to its entry, widen the range.

Every difference between releases in the range is a branch here, on what the installed
torch has (never on its version string), and ``SINCE`` names the first release of each
public name that older releases lack: the flat collectives (``all_gather_single`` /
``reduce_scatter_single`` from 2.13; before, ``all_gather_into_tensor`` /
``reduce_scatter_tensor``, the same semantics, deprecated from 2.13) and
``DataParallelMeshDims`` (2.12; on 2.11 ``fully_shard(dp_mesh_dims=...)`` raises naming
2.12). The collectives are looked up on ``torch.distributed`` at each call, so a test
that wraps torch's function counts ours. The private names mean the same, as used here,
on every release in ``CHECKED``: between them torch changed type hints, moved
``DeviceMesh._flatten``'s default name and 1-D shortcut out of a helper, let
``_StridedShard``'s ``split_factor`` be symbolic (we read ``dim`` and ``int(split_factor)``),
and from 2.15 documents ``torch._foreach_*`` as kept beside a new public ``torch.foreach``.

Not listed: aten operator names in strings (``"_foreach_"``, ``"_fused_adam_"``, matched
by ``_sharded_dispatch`` as the dispatcher spells them) and torch's public API.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
import torch.optim.optimizer as torch_optimizer
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.autograd import Variable
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.filesystem import _StorageInfo as StorageInfo
from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING as MEM_FORMAT_ENCODING
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp._common_utils import _is_fsdp_flattened as is_fsdp_flattened
from torch.distributed.fsdp._flat_param import FlatParameter
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard
from torch.optim.optimizer import _device_dtype_check_for_fused as device_dtype_check_for_fused
from torch.optim.optimizer import _to_scalar as to_scalar
from torch.serialization import _get_layout as get_layout
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

__all__ = [
    "TORCH_RANGE", "TESTED", "CHECKED", "PRIVATE_NAMES", "OVERRIDES",
    "flatten_state_dict", "set_element", "StorageInfo", "MEM_FORMAT_ENCODING", "get_layout",
    "StridedShard", "dtensor_local", "dtensor_spec", "mesh_flatten", "mesh_concatenate",
    "device_dtype_check_for_fused", "to_scalar",
    "tree_flatten", "tree_map", "tree_unflatten", "FakeTensor",
    "make_wrapper_subclass", "op_schema", "tensordot", "ATEN_TO_COPY", "ATEN_FOREACH_NORM",
    "foreach_copy_",
    "foreach_lerp_", "foreach_add_", "foreach_add", "foreach_neg", "foreach_mul_",
    "foreach_addcmul_",
    "foreach_maximum_", "foreach_sqrt", "foreach_div_", "foreach_addcdiv_",
    "storage_id", "storage_use_count", "tensor_version", "view_base",
    "unsafe_preserve_version_counter",
    "unsafe_set_version_counter", "queue_autograd_callback",
    "module_parameters", "module_buffers", "module_apply",
    "SINCE", "ALL_GATHER_NAME", "REDUCE_SCATTER_NAME", "all_gather_single", "reduce_scatter_single",
    "DataParallelMeshDims",
    "require_data_parallel_mesh_dims", "capturable_devices", "is_fsdp_flattened",
    "fsdp1_flat_param",
    "host_scratch", "all_to_all_autograd",
]

TORCH_RANGE = ">=2.11,<2.16"  # pyproject.toml's pin
TESTED = ("2.11.0", "2.15.0")  # the lowest and highest release of the range: make test
# Every release each private name was checked on (its source read, the suite run)
CHECKED = ("2.11.0", "2.13.0", "2.14.1", "2.15.0")

# Public torch names the library uses that the lowest releases of the range lack -> the
# first release that has them (checked in the installed sources of 2.11.0, 2.13.0 and
# 2.15.0, and the 2.12.0 wheel's)
SINCE: dict[str, str] = {
    "torch.distributed.all_gather_single": "2.13.0",
    "torch.distributed.reduce_scatter_single": "2.13.0",
    "torch.distributed.fsdp.DataParallelMeshDims": "2.12.0",
}

# torch's dotted name -> the releases it was checked on (meaning and signature as used here)
PRIVATE_NAMES: dict[str, tuple[str, ...]] = {
    # checkpoints: DCP internals (_checkpoint/_save_load.py, _checkpoint/_safe_load.py)
    "torch.distributed.checkpoint._nested_dict.flatten_state_dict": CHECKED,
    "torch.distributed.checkpoint._traverse.set_element": CHECKED,
    "torch.distributed.checkpoint.filesystem._StorageInfo": CHECKED,
    "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING": CHECKED,
    "torch.serialization._get_layout": CHECKED,
    # DTensor and DeviceMesh (comm._views, _fsdp._fully_shard)
    "torch.distributed.tensor.placement_types._StridedShard": CHECKED,
    "torch.distributed.tensor.DTensor._local_tensor": CHECKED,
    # the step plan's identity of a DTensor (_step_plan, ``identity`` in vefsdp_optim/_step_plan.py)
    "torch.distributed.tensor.DTensor._spec": CHECKED,
    "torch.distributed.device_mesh.DeviceMesh._flatten": CHECKED,
    "torch.distributed.device_mesh.DeviceMesh._concatenate": CHECKED,
    # torch.optim's argument checks (_adamw: AdamW's signature and errors)
    "torch.optim.optimizer._device_dtype_check_for_fused": CHECKED,
    "torch.optim.optimizer._to_scalar": CHECKED,
    # capturable=True: the device types torch.optim accepts for it (_block_optimizer)
    "torch.optim.optimizer._get_capturable_supported_devices": CHECKED,
    # the sharded tensor subclass and its dispatch (_fsdp._sharded_tensor, _sharded_dispatch)
    "torch.utils._pytree.tree_flatten": CHECKED,
    "torch.utils._pytree.tree_map": CHECKED,
    "torch.utils._pytree.tree_unflatten": CHECKED,
    "torch.Tensor._make_wrapper_subclass": CHECKED,
    "torch._ops.OpOverload._schema": CHECKED,
    "torch.ops.aten._to_copy.default": CHECKED,
    "torch.ops.aten._foreach_norm.Scalar": CHECKED,
    # fully_shard's buffers, version counters and hooks (_fsdp._store, _group, _state)
    "torch._foreach_copy_": CHECKED,
    "torch._C._storage_Use_Count": CHECKED,
    "torch.UntypedStorage._cdata": CHECKED,
    "torch.Tensor._version": CHECKED,
    # the tensor a view was taken of (_math._muon: the exchange's joined outputs)
    "torch.Tensor._base": CHECKED,
    "torch.autograd._unsafe_preserve_version_counter": CHECKED,
    "torch._C._autograd._unsafe_set_version_counter": CHECKED,
    "torch.autograd.Variable._execution_engine": CHECKED,
    # nn.Module's registries (_fsdp._param, _module, _fully_shard)
    "torch.nn.Module._parameters": CHECKED,
    "torch.nn.Module._buffers": CHECKED,
    "torch.nn.Module._apply": CHECKED,
    # SOAP's rotations (_math._soap): torch.tensordot without its Python wrapper
    "torch._VF.tensordot": CHECKED,
    # NorMuon's batched second moments (_math._normuon): one lerp_ per moment tensor
    "torch._foreach_lerp_": CHECKED,
    # 8-bit Adam's step counts (_adam8bit): one add for a bucket's tensors, as torch.optim's
    "torch._foreach_add_": CHECKED,
    # torch.optim's multi-tensor Adam, op for op, with the step counts read once
    # (_math._adam, ``_multi_tensor_adam_host_steps_`` in vefsdp_optim/_math/_adam.py)
    "torch._foreach_add": CHECKED,
    "torch._foreach_neg": CHECKED,
    "torch._foreach_mul_": CHECKED,
    "torch._foreach_addcmul_": CHECKED,
    "torch._foreach_maximum_": CHECKED,
    "torch._foreach_sqrt": CHECKED,
    "torch._foreach_div_": CHECKED,
    "torch._foreach_addcdiv_": CHECKED,
    # a fake plain tensor (FakeTensorMode) is viewed as a plain one (comm._views, _soap):
    # the step then runs under FakeTensorMode, as torch.optim's does
    "torch._subclasses.fake_tensor.FakeTensor": ("2.11.0", "2.13.0", "2.15.0"),
    # constants the library computes on the host (8-bit Adam's quantizer tables) are
    # computed on real tensors under FakeTensorMode too, then given to the mode as fakes
    # (_math._quant8, ``TableQuantizer`` in vefsdp_optim/_math/_quant8.py)
    "torch._subclasses.fake_tensor.unset_fake_temporarily": CHECKED,
    "torch._C._get_dispatch_mode": CHECKED,
    "torch._C._TorchDispatchModeKey.FAKE": CHECKED,
    # the owner choice's host tensors, hidden from every dispatch mode (comm._owners,
    # host_scratch): torch's memory trackers would count them
    "torch.utils._python_dispatch._disable_current_modes": CHECKED,
    # the memory estimate (estimate/_estimate.py): fake tensors, the fake process group,
    # activation checkpointing as torchtitan wraps blocks, and torch's MemTracker keeping
    # the global peak only (global_peak_memory_tracker, which also reads the instance's
    # _curr_mem_snap, _peak_mem and _peak_mem_snap): its per-module peaks cost O(modules)
    # per allocation
    "torch._subclasses.fake_tensor.FakeTensorMode": CHECKED,
    "torch.testing._internal.distributed.fake_pg.FakeStore": CHECKED,
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper.checkpoint_wrapper": CHECKED,
    "torch.distributed._tools.mem_tracker.MemTracker": CHECKED,
    "torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker": CHECKED,
    "torch.distributed._tools.mem_tracker.MemTracker._update_peak_stats": CHECKED,
    # the estimate's expert-parallel dispatch (estimate/_layers.py): an all-to-all with a
    # backward (torch.distributed.nn's refuses fake tensors' unequal splits less clearly)
    "torch.distributed._functional_collectives.all_to_all_single_autograd": CHECKED,
    # FSDP1's flattened parameters, refused by the block optimizers (_flattened.py,
    # vefsdp_optim/_flattened.py): the mark FSDP1 sets on what it flattened, its
    # FlatParameter and what that records of the parameters it holds (instance
    # attributes, declared on the class)
    "torch.distributed.fsdp._common_utils._is_fsdp_flattened": CHECKED,
    "torch.distributed.fsdp._flat_param.FlatParameter": CHECKED,
    "torch.distributed.fsdp._flat_param.FlatParameter._shapes": CHECKED,
    "torch.distributed.fsdp._flat_param.FlatParameter._fqns": CHECKED,
    "torch.distributed.fsdp._flat_param.FlatParameter._unpadded_unsharded_size": CHECKED,
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
foreach_add = torch._foreach_add
foreach_neg = torch._foreach_neg
foreach_mul_ = torch._foreach_mul_
foreach_addcmul_ = torch._foreach_addcmul_
foreach_maximum_ = torch._foreach_maximum_
foreach_sqrt = torch._foreach_sqrt
foreach_div_ = torch._foreach_div_
foreach_addcdiv_ = torch._foreach_addcdiv_


def host_constants() -> Any:
    """A context in which factories make real host tensors even under FakeTensorMode
    (see ``TableQuantizer`` in vefsdp_optim/_math/_quant8.py)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


@contextlib.contextmanager
def host_scratch() -> Any:
    """A context for the library's own host bookkeeping in tensors (the owner choice's
    per-rank loads): real tensors under FakeTensorMode, and seen by no dispatch mode, so
    torch's memory trackers count only the training's tensors (an estimate equals the real
    run's peak to the byte)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with host_constants(), _disable_current_modes():
        yield


def fake_tensor_mode(allow_non_fake_inputs: bool = False) -> Any:
    """torch's FakeTensorMode."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=allow_non_fake_inputs)


def fake_store() -> Any:
    """The store of torch's fake process group (backend "fake": one process plays one rank)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def checkpoint_wrapper(module: Any) -> Any:
    """``module`` under activation checkpointing, as torchtitan wraps each block."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        checkpoint_wrapper as wrap,
    )

    return wrap(module, preserve_rng_state=False)


def global_peak_memory_tracker(fsdp2_root: Any = None, optimizer: Any = None) -> Any:
    """torch's ``MemTracker`` (its ``FSDPMemTracker`` for a torch FSDP2 root, which tells
    sharded from unsharded parameters and gradients and the all-gather and reduce-scatter
    buffers), keeping the global peak by category only: the per-module peaks walk every
    tracked module at each allocation (O(modules) each: LLaMA-3-70B's 80 layers took 6
    minutes per rank, 31 s without them), and the estimate reports none."""
    from copy import deepcopy

    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    base = FSDPMemTracker if fsdp2_root is not None else MemTracker
    replaced = base._update_peak_stats  # what this tracker replaces

    class GlobalPeakTracker(base):  # type: ignore[valid-type, misc]
        def _update_peak_stats(self, peak_state: Any) -> None:
            """``replaced`` without its per-module part."""
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap["Total"]:
                    self._peak_mem[dev] = snap["Total"]
                    self._peak_mem_snap[dev] = deepcopy(snap)

    GlobalPeakTracker._update_peak_stats.__wrapped__ = replaced  # type: ignore[attr-defined]
    return (GlobalPeakTracker(fsdp2_root, optimizer) if fsdp2_root is not None
            else GlobalPeakTracker())


def to_device(t: torch.Tensor, device: torch.device, non_blocking: bool = False) -> torch.Tensor:
    """``t.to(device)``; under FakeTensorMode a real ``t`` goes in as the mode's fake of it
    (a mode that refuses real inputs would raise), so only its metadata moves."""
    mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
    if mode is not None and not isinstance(t, FakeTensor):
        t = mode.from_tensor(t)
    return t.to(device, non_blocking=non_blocking)


def capturable_devices() -> list[str]:
    """The device types torch.optim accepts with ``capturable=True`` (looked up at each
    call, so our optimizers and torch's agree where a test widens torch's list)."""
    return torch_optimizer._get_capturable_supported_devices()


def dtensor_local(dt: Any) -> torch.Tensor:
    """A DTensor's local tensor, without to_local()'s autograd node."""
    return dt._local_tensor


def dtensor_spec(dt: Any) -> Any:
    """A DTensor's ``DTensorSpec`` (mesh, placements, global shape and dtype), the object
    itself: FSDP2 builds each gradient of a parameter on one spec object (one per dtype)."""
    return dt._spec


def mesh_flatten(mesh: DeviceMesh, name: str | None = None) -> DeviceMesh:
    """The 1-D mesh over all of ``mesh``'s dims (row-major), named ``name`` (its rank
    tensor a real host tensor under FakeTensorMode too, as DeviceMesh needs)."""
    with host_constants():
        return mesh._flatten(name)


def mesh_concatenate(meshes: Sequence[DeviceMesh]) -> DeviceMesh:
    """Sub-meshes of one root mesh as one mesh, their dims in order (under FakeTensorMode
    too, as :func:`mesh_flatten`)."""
    with host_constants():
        return DeviceMesh._concatenate(list(meshes))


def op_schema(func: Any) -> Any:
    """An OpOverload's schema (its arguments' alias annotations)."""
    return func._schema


def address(t: torch.Tensor) -> int | tuple[int, int]:
    """Where ``t``'s data starts: ``data_ptr()``; for a fake tensor (FakeTensorMode), which
    has no memory, its storage's identity and byte offset, so that equal addresses still
    mean the same memory."""
    if isinstance(t, FakeTensor):
        return storage_id(t), t.storage_offset() * t.element_size()
    return t.data_ptr()


def storage_id(t: torch.Tensor) -> int:
    """An identity of ``t``'s storage (its StorageImpl), alive while the storage is; also
    for fake and meta tensors, which have no data pointer."""
    return t.untyped_storage()._cdata


def storage_use_count(t: torch.Tensor) -> int:
    """References to ``t``'s storage (tensors sharing it, and the storage object)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``t`` is a view of (None for a tensor that is no view): metadata, so a
    fake tensor has it too."""
    return t._base


def tensor_version(t: torch.Tensor) -> int:
    """``t``'s version counter (bumped by every in-place write)."""
    return t._version


def unsafe_set_version_counter(tensors: tuple[torch.Tensor, ...],
                               versions: tuple[int, ...]) -> None:
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


# The torch range (module docstring): torch.distributed's flat collectives, the new names
# where torch has them (the old ones warn there); tests wrap getattr(dist, ALL_GATHER_NAME)
# to count calls
ALL_GATHER_NAME = ("all_gather_single" if hasattr(dist, "all_gather_single")
                   else "all_gather_into_tensor")
REDUCE_SCATTER_NAME = ("reduce_scatter_single" if hasattr(dist, "reduce_scatter_single")
                   else "reduce_scatter_tensor")


def all_to_all_autograd(t: torch.Tensor, splits: list[int],
                        group: dist.ProcessGroup) -> torch.Tensor:
    """An all-to-all of ``t``'s rows, ``splits`` to and from each rank, with a backward."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    return all_to_all_single_autograd(t, splits, splits, group)


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup,
                      async_op: bool = False) -> dist.Work | None:
    """torch's ``all_gather_single`` (``all_gather_into_tensor`` before 2.13)."""
    return getattr(dist, ALL_GATHER_NAME)(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, op: dist.ReduceOp,
                          group: dist.ProcessGroup, async_op: bool = False) -> dist.Work | None:
    """torch's ``reduce_scatter_single`` (``reduce_scatter_tensor`` before 2.13)."""
    return getattr(dist, REDUCE_SCATTER_NAME)(output, input, op=op, group=group, async_op=async_op)


# torch's named data-parallel dims of an SPMD mesh; None on a torch that lacks them
DataParallelMeshDims: type | None = getattr(torch_fsdp, "DataParallelMeshDims", None)


def require_data_parallel_mesh_dims(what: str) -> type:
    """torch's DataParallelMeshDims, or NotImplementedError naming ``what`` and the release
    that brought it."""
    if DataParallelMeshDims is None:
        raise NotImplementedError(
            f"{what} takes torch's DataParallelMeshDims, which torch "
            f"{SINCE['torch.distributed.fsdp.DataParallelMeshDims']} added; the installed "
            f"torch {torch.__version__} has none. Pass the data-parallel submesh itself as "
            "mesh= (e.g. mesh['dp_shard'], or a flattened one), or install torch>=2.12")
    return DataParallelMeshDims


def fsdp1_flat_param(p: torch.Tensor) -> tuple[tuple[torch.Size, ...] | None, tuple[str,
                                                                                    ...]] | None:
    """For FSDP1's FlatParameter: the shapes of the parameters it holds and its whole
    (unsharded, unpadded) flat size, the same on every rank (None while FSDP1 has not
    recorded them), and their names; None for any other tensor."""
    if not isinstance(p, FlatParameter):
        return None
    shapes = None
    if hasattr(p, "_shapes") and hasattr(p, "_unpadded_unsharded_size"):
        shapes = (*(torch.Size(s) for s in p._shapes), torch.Size(p._unpadded_unsharded_size))
    return shapes, tuple(getattr(p, "_fqns", ()))
