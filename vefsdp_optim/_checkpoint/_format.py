"""The world-size-free checkpoint format of BlockOptimizer state.

``BlockOptimizer.state_dict`` / ``load_state_dict`` delegate here. Each optimizer
declares, per parameter, how each state entry is laid out (``checkpoint_spec``: the
kinds below); this module turns the live, rank-local state into tensors whose global
shape does not depend on the world size, and back.
"""

from __future__ import annotations

import bisect
import itertools
import operator
from typing import Any

import torch

from vefsdp_optim.comm import ShardedView, sharded_view
from vefsdp_optim.sharding import BoxShard, RaggedShard

from ._protocol import CheckpointedOptimizer

__all__ = ["REPLICATED", "ELEMENTWISE", "WHOLE", "LOCAL", "CLASS_KEY", "export_state", "load_state",
           "validate_state"]

#: checkpoint kinds of a state entry (see [Note: world-size-free optimizer state]); an
#: int k is the fourth kind: one value per block of k consecutive parameter elements
REPLICATED = "replicated"  # the same value on every rank that steps the parameter (step counts)
# one value per parameter element, sliced like the parameter's state layout
ELEMENTWISE = "elementwise"
WHOLE = "whole"  # any shape, of a whole-tensor requirement: kept and saved by the rank that owns it
LOCAL = "local"  # rank-local bookkeeping, not saved by the declaration (rebuilt by init_state)
KINDS = (REPLICATED, ELEMENTWISE, WHOLE, LOCAL)
CLASS_KEY = "optimizer"  # added to each saved param group: the optimizer's class name

# [Note: world-size-free optimizer state]
# state_dict() gives every state tensor a form that does not depend on the world size
# that wrote it, so DCP (torch.distributed.checkpoint) can reshard it on load.
#   - ELEMENTWISE state, such as Adam moments, Muon momentum and 8-bit codes: a
#     ShardedParameter of the parameter's global shape holding this rank's slice. At
#     W = 1 it is a plain tensor.
#   - Per-block state with an int k, such as 8-bit absmax: a 1-D ShardedParameter of
#     ceil(numel / k) values, indexed by global block.
#   - REPLICATED state, such as step counters: as is, saved by the ranks whose slice is
#     not empty. All of them hold the same value, and an empty slice may never have
#     stepped.
#   - The state of a whole-tensor requirement lives on its owner. The rank that holds an
#     entry saves it whole, each entry in its own form, and the owner at the new world
#     size loads it whole.
#   - LOCAL entries are not saved. Anything else, such as Shampoo's tiles, is saved by
#     the subclass hooks, keyed by global index.
# Every saved key is a key of the live state, since framework flows rebuild entries from
# the live keys (_saved_entry; vefsdp_optim/_shampoo.py). A parameter without state when
# saved has none after loading (see ``load_state``). validate_state() checks the live
# state against this declaration after the step that creates it, so a mismatch fails
# there, not at a load at another world size. The local data handed out are the live state
# tensors themselves, so ``dcp.load`` into ``state_dict()`` writes in place.
# load_state_dict() copies into the state whatever is not already in place, as plain full
# tensors from torch.load or a full export.


def export_state(opt: CheckpointedOptimizer, sd: dict[str, Any]) -> dict[str, Any]:
    """``sd`` (torch's ``Optimizer.state_dict()`` of ``opt``) with world-size-free state."""
    state: dict[int, dict[str, Any]] = {}
    for idx, (p, group) in enumerate(_params_in_order(opt)):
        state[idx] = _export_param_state(opt, p, group)
    sd["state"] = state
    for g in sd["param_groups"]:
        g[CLASS_KEY] = type(opt).__name__
    return sd


def load_state(opt: CheckpointedOptimizer, state_dict: dict[str, Any]) -> None:
    """Load ``state_dict`` (from :func:`export_state`, at any world size) into ``opt``.

    No state saved, none loaded. torch.optim.Optimizer.load_state_dict replaces the whole
    state: a parameter whose entry is missing or empty has no state afterwards, and its
    next step is its first (Adam's bias correction counts from 1, SOAP and Shampoo start
    their factors). This load first creates every parameter's state with a zero step (the
    optimizer's ``materialize_state``) so that the saved tensors can be copied into the
    live ones in place. The state of a parameter without a saved entry on this rank is
    then emptied again, as torch would have it. The entry is per rank: a rank whose slice
    of a parameter is empty saves and loads none. The emptied entry stays a key of
    ``opt.state``, as the step keeps one on every rank: torch's DCP helpers step an
    optimizer whose ``state`` has no keys at all, a decision each rank takes alone, and a
    collective step on some ranks only would hang. Through DCP at another world size the
    fresh optimizer's template asks for state the checkpoint never had;
    vefsdp_optim.load empties such entries (``_empty_stateless_entries`` in
    _save_load.py) so that they arrive here empty."""
    if (not isinstance(state_dict, dict) or "state" not in state_dict
            or "param_groups" not in state_dict):
        raise ValueError("an optimizer state dict must have 'state' and 'param_groups', got "
                         f"{sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__}")
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(opt.param_groups):
        raise ValueError(f"checkpoint has {len(saved_groups)} param groups, "
                         f"{type(opt).__name__} has {len(opt.param_groups)}")
    ids: list[object] = []
    for i, (g, sg) in enumerate(zip(opt.param_groups, saved_groups, strict=True)):
        if len(sg["params"]) != len(g["params"]):
            raise ValueError(f"param group {i}: checkpoint has {len(sg['params'])} parameters, "
                             f"the optimizer has {len(g['params'])}")
        cls = sg.get(CLASS_KEY)
        if cls is not None and cls != type(opt).__name__:
            raise ValueError(f"checkpoint was written by {cls}, this optimizer is "
                             f"{type(opt).__name__}")
        for k in opt.structural_keys:
            if k in sg and sg[k] != g[k]:
                raise ValueError(f"param group {i}: checkpoint has {k}={sg[k]!r}, the "
                                 f"optimizer has {k}={g[k]!r}; the state layout depends on it")
        ids.extend(sg["params"])
    saved_state = {sid: _saved_entry(v) for sid, v in state_dict["state"].items()}
    pairs = list(zip(_params_in_order(opt), ids, strict=True))
    checked = [_check_param_state(opt, p, group, saved_state.get(sid) or {}, sid)
               for (p, group), sid in pairs]
    create = _to_create(opt, [(p, group, saved_state.get(sid) or {}) for (p, group), sid in pairs])
    if create:
        opt.materialize_state(p for p, _ in _params_in_order(opt) if id(p) in create)
    for ((p, group), sid), ok in zip(pairs, checked, strict=True):
        if ok:  # (every rank holds every entry in a full import: the owner takes it)
            _import_param_state(opt, p, group, saved_state.get(sid) or {}, sid)
        elif opt.state.get(p):  # no state saved, none loaded (the docstring)
            opt.forget_state(p)
    for g, sg in zip(opt.param_groups, saved_groups, strict=True):
        for k, v in sg.items():
            if k not in ("params", CLASS_KEY):
                g[k] = v


def _saved_entry(saved: Any) -> Any:
    """One parameter's saved entry without the empty dicts that stand for keys it does not
    have: torch's flattened flow (set_optimizer_state_dict with
    flatten_optimizer_state_dict=True) rebuilds an entry from the LIVE state's keys and
    hands back ``{}`` for a live key that was not saved (LOCAL bookkeeping, the step count
    of a rank whose slice is empty)."""
    if not isinstance(saved, dict):
        return saved
    return {k: v for k, v in saved.items() if not (isinstance(v, dict) and not v)}


def _params_in_order(opt: CheckpointedOptimizer) -> list[tuple[torch.Tensor, dict[str, Any]]]:
    return [(p, g) for g in opt.param_groups for p in g["params"]]


# Loading copies saved tensors into live state, so a parameter with a saved entry but no
# live state first gets its state from a step with zero gradients and lr 0 (the
# optimizer's ``materialize_state``). That step is collective over each parameter's shard
# process group, and whether a rank needs it is rank-local: a rank holding no state of a
# parameter (an empty slice, or not the owner of a whole-tensor requirement) saved an
# empty entry. So each rank's wish is OR-ed over the parameter's shard process group (one
# small all_reduce per process group, on its device), and every rank steps the same
# parameters, the others' gradients set aside for the step. A rank deciding alone would
# hang or abort the collective. The same all_reduce names the rank that saved a whole
# tensor's owner-held state. Where one rank alone did (not a full import, which gives
# every rank everything), that rank stays its owner ([Note: owners stay]), so the state
# is created, loaded and used where it was saved. A rank whose state the step also
# touched gets it overwritten by the import, or deleted where it saved none (see
# ``load_state``).


def _to_create(opt: CheckpointedOptimizer,
               wanted: list[tuple[torch.Tensor, dict[str, Any], dict[str, Any]]]) -> set[int]:
    """ids of the parameters whose state the load must create: saved here without live
    state on some rank of their shard process group. The owner of a whole tensor's saved
    state computes it from now on (see the comment above)."""
    import torch.distributed as dist

    out: set[int] = set()
    by_group: dict[Any, list[tuple[torch.Tensor, bool, int, Any]]] = {}
    for p, group, saved in wanted:
        has_saved = bool(saved)
        need = has_saved and not opt.state.get(p)
        view = sharded_view(p)
        if view.process_group is None:
            if need:
                out.add(id(p))
            continue
        # the state of a whole tensor that only its owner keeps: all of it (state_layout
        # None), or its extra entries (NorMuon's row second moments)
        owner_held = opt.checkpoint_layout(p, view, group) is None or (
            bool(opt.extra_state_prefixes) and opt.requirement(view.shape, group).needs_whole
            and any(isinstance(k, str) and k.startswith(opt.extra_state_prefixes) for k in saved))
        holder = view.rank if has_saved and owner_held else -1
        by_group.setdefault(view.process_group, []).append((p, need, holder, view.layout))
    for process_group, items in by_group.items():
        device = sharded_view(items[0][0]).local.device
        none = -(1 << 30)
        flags = torch.tensor([int(need) for _, need, _, _ in items] + [h for _, _, h, _ in items]
                             + [-h if h >= 0 else none for _, _, h, _ in items], dtype=torch.int32,
                             device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=process_group)
        values = flags.tolist()
        n = len(items)
        for (p, _, _, layout), need, high, low in zip(items, values[:n], values[n:2 * n],
                                                      values[2 * n:], strict=True):
            if need:
                out.add(id(p))
            if high >= 0 and high == -low:  # one rank saved it (not a full import on every rank);
                opt.pin_owner(p, layout, high)  # the same on every rank: [Note: owners stay]
    return out


def _export_param_state(opt: CheckpointedOptimizer, p: torch.Tensor,
                        group: dict[str, Any]) -> dict[str, Any]:
    state = opt.state.get(p)
    if not state:
        return {}
    view = sharded_view(p)
    layout = opt.checkpoint_layout(p, view, group)
    spec = opt.checkpoint_spec(view.shape, group)
    out: dict[str, Any] = {}
    if layout is None:  # owner-held: this rank computes the whole tensor, it writes it all
        for key, kind in spec.items():
            if key in state and kind != LOCAL:
                v = state[key]
                out[key] = v.view(view.shape) if kind == ELEMENTWISE else v
        out.update(opt.export_extra_state(state, view, layout, group))
        return out
    length = layout.local_numel(view.rank)
    for key, kind in spec.items():
        if key not in state or kind == LOCAL:
            continue
        v = state[key]
        if kind == REPLICATED:
            if length > 0 or (layout.numel == 0 and view.rank == 0):
                out[key] = v
        elif kind == WHOLE:  # only the rank that computes the whole tensor has it
            out[key] = v
        else:
            shape, lay = _entry_geometry(kind, view, layout)
            out[key] = _sharded_entry(v, lay, view, shape)
    out.update(opt.export_extra_state(state, view, layout, group))
    return out


def _entry_geometry(kind: str | int, view: ShardedView, layout: RaggedShard | BoxShard) -> tuple[
        torch.Size, RaggedShard | BoxShard]:
    if kind == ELEMENTWISE:
        return view.shape, layout
    if isinstance(kind, bool) or not isinstance(kind, int) or kind < 1:
        raise ValueError(f"checkpoint kind {kind!r}: expected one of {KINDS} or a block size "
                         f"(int >= 1); {WHOLE!r} only for the state of a whole-tensor requirement")
    if isinstance(layout, BoxShard):
        raise ValueError(f"state kept in blocks of {kind} cannot follow a tensor-parallel "
                         "box layout (it cuts blocks); state_layout must return the compute layout "
                         "of the requirement")
    n, bounds = layout.numel, layout.boundaries
    # every boundary but those at the end is a multiple of kind (in C: O(W) per parameter)
    if set(map(operator.mod, bounds[:bisect.bisect_left(bounds, n)], itertools.repeat(kind))) - {0}:
        raise AssertionError(f"state layout {layout.extents} cuts blocks of {kind}")
    # each boundary in blocks, rounded up: -(-b // kind)
    blocks = RaggedShard.from_boundaries(
        list(map(operator.neg,
                 map(operator.floordiv, map(operator.neg, bounds), itertools.repeat(kind)))))
    return torch.Size((blocks.numel,)), blocks


def _check_param_state(opt: CheckpointedOptimizer, p: torch.Tensor, group: dict[str, Any],
                       saved: dict[str, Any], name: object) -> bool:
    """Validate one parameter's saved entry; False when there is nothing to load."""
    if not isinstance(saved, dict):
        raise ValueError(f"optimizer state of parameter {name!r} must be a dict, got "
                         f"{type(saved).__name__}")
    view = sharded_view(p)
    spec = opt.checkpoint_spec(view.shape, group)
    unexpected = sorted(k for k in saved
                        if k not in spec and not k.startswith(opt.extra_state_prefixes))
    if unexpected:
        raise ValueError(f"optimizer state of parameter {name!r} (shape "
                         f"{tuple(view.shape)}) has keys {unexpected} that {type(opt).__name__} "
                         f"does not keep; it keeps {sorted(spec)}")
    layout = opt.checkpoint_layout(p, view, group)
    for key, kind in spec.items():
        if key not in saved or kind in (REPLICATED, LOCAL, WHOLE):
            continue
        if layout is None:
            shape = (view.shape if kind == ELEMENTWISE
                     else torch.Size((-(-view.layout.numel // kind),)))
        else:
            shape, _ = _entry_geometry(kind, view, layout)
        v = saved[key]
        if not isinstance(v, torch.Tensor):
            raise ValueError(f"optimizer state {name!r}.{key} must be a tensor, got "
                             f"{type(v).__name__}")
        if v.shape != shape:
            raise ValueError(f"optimizer state {name!r}.{key} has shape {tuple(v.shape)}, expected "
                             f"{tuple(shape)} for a parameter of shape {tuple(view.shape)}")
    return bool(saved)


def _import_param_state(opt: CheckpointedOptimizer, p: torch.Tensor, group: dict[str, Any],
                        saved: dict[str, Any], name: object) -> None:
    state = opt.state.get(p)
    if not state:
        return
    view = sharded_view(p)
    layout = opt.checkpoint_layout(p, view, group)
    spec = opt.checkpoint_spec(view.shape, group)
    held = layout is None or layout.local_numel(view.rank) > 0
    missing = [k for k, kind in spec.items()
               if k in state and k not in saved and held and kind != LOCAL]
    if missing:
        raise ValueError(f"optimizer state of parameter {name!r} (shape {tuple(view.shape)}): the "
                         f"checkpoint lacks {sorted(missing)}; it has {sorted(saved)}")
    for key, kind in spec.items():
        if key not in state or key not in saved or kind == LOCAL:
            continue
        live, v = state[key], saved[key]
        if kind == REPLICATED:
            if isinstance(live, torch.Tensor):
                if isinstance(v, torch.Tensor) and v.numel() != live.numel():
                    raise ValueError(f"optimizer state {name!r}.{key} has {v.numel()} elements, "
                                     f"expected {live.numel()}")
                if not (isinstance(v, torch.Tensor) and v.data_ptr() == live.data_ptr()):
                    live.copy_(v if isinstance(v, torch.Tensor) else torch.tensor(v))
            else:
                state[key] = v
            continue
        if layout is None or kind == WHOLE:  # owner-held: the whole saved tensor
            _copy_whole(live, v, f"{name}.{key}")
            continue
        _, lay = _entry_geometry(kind, view, layout)
        _copy_slice(live, v, lay, view.rank, f"{name}.{key}")
    opt.import_extra_state(state, saved, view, layout, group, name)


def _copy_whole(live: torch.Tensor, v: Any, name: str) -> None:
    if not isinstance(v, torch.Tensor) or hasattr(v, "full_tensor"):
        raise TypeError(f"optimizer state {name} must be a plain tensor (saved whole by "
                        f"its owner), got {type(v).__name__}")
    if v.numel() != live.numel():
        raise ValueError(f"optimizer state {name} has {v.numel()} elements, the live state "
                         f"{live.numel()}")
    if live.numel() and v.data_ptr() == live.data_ptr():
        return  # already loaded in place by DCP
    live.copy_(v.reshape(live.shape))


def _sharded_entry(local: torch.Tensor, layout: RaggedShard | BoxShard, view: ShardedView,
                   shape: torch.Size) -> torch.Tensor:
    """A state tensor of global ``shape`` whose local data is ``local`` (no copy)."""
    n = layout.local_numel(view.rank)
    if local.dim() != 1 or local.numel() != n:
        raise AssertionError(f"state tensor of shape {tuple(local.shape)} is not rank "
                             f"{view.rank}'s slice of {n} elements of layout {layout}")
    if layout.world_size == 1:
        return local.view(shape)
    from vefsdp_optim._fsdp import ShardedParameter

    return ShardedParameter(local, layout, view.process_group, shape, view.rank)


def _copy_slice(live: torch.Tensor, v: Any, layout: RaggedShard | BoxShard, rank: int,
                name: str) -> None:
    """Copy rank's slice of the saved global tensor ``v`` into the 1-D ``live`` in place."""
    from torch.distributed.tensor import DTensor

    from vefsdp_optim._fsdp import ShardedParameter

    if isinstance(v, ShardedParameter):
        if v.ragged_layout != layout:
            raise ValueError(f"optimizer state {name} holds layout {v.ragged_layout}, this rank "
                             f"needs {layout}; load checkpoints of another world size or "
                             "mesh with DCP")
        src = v.to_local()
    elif isinstance(v, DTensor):
        raise TypeError(f"optimizer state {name} is a DTensor; expected the optimizer's own "
                        "state_dict() format (loaded with DCP) or plain full tensors")
    elif isinstance(v, torch.Tensor):
        src = v.reshape(-1)[layout.local_index(rank, v.device)]
    else:
        raise TypeError(f"optimizer state {name} must be a tensor, got {type(v).__name__}")
    if src.numel() != live.numel():
        raise AssertionError(f"optimizer state {name}: {src.numel()} saved elements for "
                             f"{live.numel()} live ones")
    if src.numel() and src.data_ptr() == live.data_ptr():
        return  # already loaded in place by DCP
    live.copy_(src)


_KINDS_DOC = ("REPLICATED, ELEMENTWISE, WHOLE or LOCAL (from vefsdp_optim), or an int block "
              "size (one value per block of that many elements)")


def validate_state(opt: CheckpointedOptimizer, p: torch.Tensor, group: dict[str, Any]) -> None:
    """After the step that created ``p``'s state: it matches ``checkpoint_spec`` (see
    [Note: world-size-free optimizer state]), or a ValueError says which entry does not."""
    state = opt.state.get(p)
    if not state:
        return
    view = sharded_view(p)
    spec = opt.checkpoint_spec(view.shape, group)
    cls, shape = type(opt).__name__, tuple(view.shape)
    if spec is None:
        big = sorted(k for k, v in state.items() if isinstance(v, torch.Tensor) and v.numel() > 1)
        if big:
            raise ValueError(
                f"{cls} keeps state {big} for a parameter of shape {shape} but declares no "
                "checkpoint_spec(shape, group), so its checkpoints would depend on the "
                f"world size; return {{key: kind}} with kinds {_KINDS_DOC}")
        return
    unknown = sorted(str(k) for k in state if k not in spec
                     and not (isinstance(k, str) and k.startswith(opt.extra_state_prefixes)))
    if unknown:
        raise ValueError(
            f"{cls}.checkpoint_spec does not declare state keys {unknown} of a parameter of shape "
            f"{shape} (it declares {sorted(spec)}); give each a kind: {_KINDS_DOC}")
    layout = opt.checkpoint_layout(p, view, group)
    for key, kind in spec.items():
        if key not in state or kind in (REPLICATED, LOCAL):
            continue
        v = state[key]
        if kind == WHOLE:
            if not opt.requirement(view.shape, group).needs_whole:
                raise ValueError(
                    f"{cls}: state {key!r} of a parameter of shape {shape} is declared "
                    "WHOLE, which is the state of a whole-tensor requirement; this parameter's "
                    "requirement cuts it, so its state is sliced (ELEMENTWISE or block kinds)")
            continue
        if kind not in KINDS and (isinstance(kind, bool) or not isinstance(kind, int) or kind < 1):
            raise ValueError(f"{cls}: state {key!r} has kind {kind!r}; expected {_KINDS_DOC}")
        if not isinstance(v, torch.Tensor):
            raise ValueError(f"{cls}: state {key!r} is declared {kind!r} but is a "
                             f"{type(v).__name__}")
        if layout is None:
            n = view.layout.numel
            want = n if kind == ELEMENTWISE else -(-n // kind)
        else:
            want = _entry_geometry(kind, view, layout)[1].local_numel(view.rank)
        if v.numel() != want:
            raise ValueError(
                f"{cls}: state {key!r} of a parameter of shape {shape} is declared "
                f"{kind!r} but has {v.numel()} elements; that declaration needs {want} on rank "
                f"{view.rank} "
                f"({'the whole tensor, on its owner' if layout is None else 'this rank slice'})")
