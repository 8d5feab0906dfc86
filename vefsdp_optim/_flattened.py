"""Parameters that another sharding has flattened into 1-D shards, refused by name.

FSDP1 (``FullyShardedDataParallel``) and DeepSpeed's ZeRO-3 hand the optimizer 1-D tensors
cut at arbitrary elements: a ``FlatParameter`` (FSDP1, ``use_orig_params=False``)
concatenates several parameters and holds one rank's slice of them; with
``use_orig_params=True`` each original parameter becomes a 1-D view of that slice (empty on
ranks that hold none of it); ZeRO-3 leaves an empty 1-D tensor and records the shape in
``ds_shape``. An optimizer whose update depends on a parameter's shape or on blocks of its
storage (Muon's matrix, Shampoo's and SOAP's tiles, 8-bit Adam's quantization blocks) would
update such a slice as if it were the whole tensor: Muon and Shampoo take a 1-D tensor to
their element-wise path, and every rank's blocks start wherever its slice does. The results
then differ from one device's without a word. So the constructor (and ``add_param_group``)
raises ValueError for a flattened parameter unless its group's update is element by element
whatever the shape (``BlockOptimizer.updates_elementwise``: AdamW, Muon's
``use_muon=False`` groups), or every original shape the flattening records gets an
``Elementwise`` requirement (:func:`check_not_flattened`). The decision depends only on
what every rank sees alike (the class, the flags, the recorded shapes, the group), so
either all ranks raise or none. What cannot be told apart from a genuine vector (ZeRO-1/2's
flat fp32 groups carry no mark) is not detected.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from vefsdp_optim.sharding import Elementwise, Requirement

from ._torch_compat import fsdp1_flat_param, is_fsdp_flattened

__all__ = ["check_not_flattened", "flattened_by"]


def flattened_by(p: torch.Tensor) -> tuple[str, tuple[torch.Size, ...] | None, tuple[str,
                                                                                     ...]] | None:
    """How ``p`` was flattened, the original shapes it records (None: not recorded) and the
    names of the parameters it holds, or None for a parameter no known sharding has
    flattened."""
    flat = fsdp1_flat_param(p)
    if flat is not None:
        return "an FSDP1 FlatParameter (FullyShardedDataParallel, use_orig_params=False)", *flat
    if is_fsdp_flattened(p) and p.dim() <= 1:
        return ("a 1-D view of an FSDP1 flat shard (FullyShardedDataParallel, "
                "use_orig_params=True), whose original shape FSDP1 does not record on it"), None, ()
    ds_shape = getattr(p, "ds_shape", None)
    if (ds_shape is not None and getattr(p, "ds_id", None) is not None
            and tuple(ds_shape) != tuple(p.shape)):
        return "a DeepSpeed ZeRO-3 partition", (torch.Size(ds_shape),), ()
    return None


class _Declares(Protocol):
    """What the check reads of an optimizer (a BlockOptimizer)."""

    def updates_elementwise(self, group: dict[str, Any]) -> bool: ...

    def requirement(self, shape: torch.Size, group: dict[str, Any]) -> Requirement: ...


def check_not_flattened(opt: _Declares, group: dict[str, Any], gi: int) -> None:
    """Raise ValueError for the first parameter of ``group`` (param group ``gi`` of
    ``opt``) that a sharding flattened and ``opt`` cannot update as one device would
    (see the module docstring)."""
    if opt.updates_elementwise(group):
        return
    for pi, p in enumerate(group["params"]):
        found = flattened_by(p)
        if found is None:
            continue
        how, shapes, fqns = found
        if shapes is not None:
            blocky = [tuple(s) for s in shapes
                      if not isinstance(opt.requirement(s, group), Elementwise)]
            if not blocky:
                continue
            why = f"its original shapes {blocky} need blocks of the whole tensor"
        else:
            why = "it may be a flattened matrix, which needs the whole matrix or blocks of it"
        names = group.get("param_names")
        who = repr(names[pi]) if names else f"{pi} (shape {tuple(p.shape)})"
        held = f", holding {list(fqns)}" if fqns else ""
        name = type(opt).__name__
        raise ValueError(
            f"{name}: param group {gi} parameter {who} is {how}{held}; {why}, and {name} "
            "would update this rank's 1-D slice as a whole tensor, so its results would differ "
            "from one device's. Shard with FSDP2's torch.distributed.fsdp.fully_shard or "
            "vefsdp_optim.fully_shard, which keep each parameter's shape; element-wise optimizers "
            f"(AdamW, or a Muon group with use_muon=False) accept flattened parameters")
