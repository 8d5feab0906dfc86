"""The full export: one unsharded file of a model (and its optimizer), written on rank
0 with ``torch.save`` and read back into any sharding."""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from vefsdp_optim.comm import sharded_view

from ._save_load import _barrier, _check_path, _few, _rank

__all__ = ["export_full", "import_full"]


def _is_sharded(t: object) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor) or hasattr(type(t), "__sharded_view__")


def _pieces(value: Any, rank: int) -> Any:
    """What this rank contributes of one value: ("s", shape, dtype, start, local) for a
    sharded tensor, ("t", tensor) for a plain one (rank 0's copy wins), else the value."""
    if isinstance(value, torch.Tensor) and _is_sharded(value):
        view = sharded_view(value)
        return ("s", tuple(view.shape), view.local.dtype, view.layout.local_index(view.rank),
                view.local.detach().cpu().clone())
    if isinstance(value, torch.Tensor):
        return ("t", value.detach().cpu().clone())
    return ("v", value)


def _assemble(parts: list[Any]) -> Any:
    kind = parts[0][0]
    if kind == "s":
        _, shape, dtype, _, _ = parts[0]
        n = 1
        for d in shape:
            n *= d
        flat = torch.empty(n, dtype=dtype)
        filled = torch.zeros(n, dtype=torch.bool)
        for _, _, _, where, local in parts:
            flat[where] = local
            filled[where] = True
        if not bool(filled.all()):
            raise AssertionError(f"the ranks' slices do not cover a tensor of shape {shape}")
        return flat.view(shape)
    return parts[0][1]


def _gather_to_rank0(entries: dict[tuple, Any],
                     process_group: dist.ProcessGroup | None) -> dict[tuple, Any] | None:
    """Assemble {key: full value} on rank 0 from every rank's pieces (None elsewhere)."""
    rank = _rank(process_group)
    mine = {k: _pieces(v, rank) for k, v in entries.items()}
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(process_group) > 1:
        everyone: list[Any] = [None] * dist.get_world_size(process_group) if rank == 0 else None
        dst = dist.get_global_rank(process_group, 0) if process_group is not None else 0
        dist.gather_object(mine, everyone, dst=dst, group=process_group)
    else:
        everyone = [mine]
    if rank != 0:
        return None
    keys: dict[tuple, list[Any]] = {}
    for r_entries in everyone:
        for k, piece in r_entries.items():
            keys.setdefault(k, []).append(piece)
    return {k: _assemble(parts) for k, parts in keys.items()}


def _param_names(model: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def export_full(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                path: str | os.PathLike, process_group: dist.ProcessGroup | None = None) -> None:
    """Write the whole, unsharded ``model`` (and ``optimizer``) state to one file with
    ``torch.save``, on rank 0: ``{"model": {name: tensor}, "optim": {"state": {name:
    {key: tensor}}, "param_groups": [...]}}``, plain tensors only, readable with
    ``torch.load(weights_only=True)``. Collective over ``process_group``."""
    path = _check_path(path)
    entries: dict[tuple, Any] = {}
    for k, v in model.state_dict().items():
        entries[("model", k)] = v
    groups = None
    if optimizer is not None:
        names = _param_names(model)
        osd = optimizer.state_dict()
        ids = [pid for g in osd["param_groups"] for pid in g["params"]]
        params = [p for g in optimizer.param_groups for p in g["params"]]
        fqn = {pid: names.get(id(p), str(pid)) for pid, p in zip(ids, params, strict=True)}
        for pid, st in osd["state"].items():
            for key, v in st.items():
                entries[("optim", fqn[pid], key)] = v
        groups = [{**g, "params": [fqn[pid] for pid in g["params"]]} for g in osd["param_groups"]]
    full = _gather_to_rank0(entries, process_group)
    if full is None:
        _barrier(process_group)
        return
    out: dict[str, Any] = {"model": {}}
    if groups is not None:
        out["optim"] = {"state": {name: {} for g in groups for name in g["params"]},
                        "param_groups": groups}
    for key, v in full.items():
        if key[0] == "model":
            out["model"][key[1]] = v
        else:
            out["optim"]["state"][key[1]][key[2]] = v
    if groups is not None:  # drop empty entries (parameters without state)
        out["optim"]["state"] = {k: v for k, v in out["optim"]["state"].items() if v}
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    torch.save(out, tmp)
    os.replace(tmp, path)
    _barrier(process_group)


def import_full(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                path: str | os.PathLike) -> None:
    """Load a file from :func:`export_full` into ``model`` (and ``optimizer``), whatever
    their sharding (single device, FSDP2, fully_shard, any world size): each rank reads
    the file (``torch.load(weights_only=True)``) and copies its own slices. Missing or
    unexpected model keys and shape mismatches raise ValueError."""
    where = _check_path(path)
    try:  # torch's restricted unpickler: tensors and plain containers only
        data = torch.load(where, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as e:  # noqa: BLE001 - a refused global, a truncated zip, ...
        raise ValueError(f"{where!r} cannot be imported: torch.load(weights_only=True) refused it "
                         f"({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''})") from None
    if not isinstance(data, Mapping) or not isinstance(data.get("model"), Mapping):
        raise ValueError(f"{where!r} is not a full export (no 'model' entry)")
    saved = data["model"]
    live = model.state_dict()
    missing = sorted(set(live) - set(saved))
    unexpected = sorted(set(saved) - set(live))
    bad = sorted(k for k in live if k in saved and not isinstance(saved[k], torch.Tensor))
    shapes = [f"{k}: file {tuple(saved[k].shape)}, model {tuple(live[k].shape)}"
              for k in live if k in saved and k not in bad and saved[k].shape != live[k].shape]
    if missing or unexpected or shapes or bad:
        parts = [f"{what} {_few(items)}" for what, items in
                 (("missing", missing), ("unexpected", unexpected), ("shapes differ:", shapes),
                  ("not tensors:", bad)) if items]
        raise ValueError(f"{where!r} does not match the model: " + "; ".join(parts))
    if optimizer is not None:
        # The optimizer's load_state_dict checks class, groups and every state entry
        # before it changes anything; it runs before the model's weights are written, so a
        # refused import leaves both untouched.
        if not isinstance(data.get("optim"), Mapping):
            raise ValueError(f"{where!r} has no optimizer state ('optim' entry)")
        optimizer.load_state_dict(data["optim"])
    with torch.no_grad():
        for k, v in live.items():
            src = saved[k]
            if isinstance(v, torch.Tensor) and _is_sharded(v):
                view = sharded_view(v)
                view.local.copy_(src.reshape(-1)[view.layout.local_index(view.rank)])
            else:
                v.copy_(src)
