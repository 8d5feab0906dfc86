"""Checkpoints: DCP save/load, written aside then renamed.

The sharded state itself needs nothing from here: fully_shard parameters and the
optimizers' state_dict() speak DCP's protocol (see ``flat_range_boxes`` in sharding/_box.py
and [Note: world-size-free optimizer state]), so ``torch.distributed.checkpoint`` and
its ``state_dict`` helpers save and reshard them at any world size. These helpers add
the safety of writing aside, then renaming (see ``save``; with the commit protocol of
``_commit.py``) and a load that is safe on untrusted files (``_safe_load.py``); the
unsharded export is ``_full_export.py``.
"""

from __future__ import annotations

import os
import uuid
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from vefsdp_optim._torch_compat import flatten_state_dict, set_element

from . import _commit
from ._safe_load import MetadataRefused, SafeReader, load_bytes_safely

__all__ = ["save", "load"]


# Fault injection for tests: called with the phase name on every rank.
_fault_hook: Callable[[str], None] | None = None


def _fault(phase: str) -> None:
    if _fault_hook is not None:
        _fault_hook(phase)


def _rank(process_group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(process_group) if dist.is_available() and dist.is_initialized() else 0


def _barrier(process_group: dist.ProcessGroup | None) -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier(group=process_group)


def _broadcast_str(value: str, process_group: dist.ProcessGroup | None) -> str:
    if not (dist.is_available() and dist.is_initialized()):
        return value
    box = [value]
    src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
    dist.broadcast_object_list(box, src=src, group=process_group)
    return box[0]


def _check_path(path: object) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    return os.fspath(path)


def save(state_dict: dict[str, Any], path: str | os.PathLike, *,
         process_group: dist.ProcessGroup | None = None, overwrite: bool = True) -> None:
    """``dcp.save(state_dict)`` to the directory ``path``, atomically: an interrupted
    save leaves the newest complete checkpoint loadable (see below). Writes only its own
    files: ``path`` must be new, an empty directory or a checkpoint this function wrote
    (replaced when ``overwrite``, the default; refused otherwise); an existing file or a
    directory holding anything else raises ValueError naming it. Collective over
    ``process_group`` (the default process group when None).

    Write aside, then rename: save() writes the checkpoint into ``path + ".tmp-<tag>"``
    (one tag, chosen by rank 0), waits for every rank, records checksums and a generation
    in the copy's marker, and only then rank 0 moves the previous checkpoint aside
    (``path + ".old-<tag>"``), renames the new one to ``path`` and removes the old one. A
    save stopped at any point leaves a complete copy that load() finds (the newest, by
    generation), and the next successful save removes what it left. The docstring of
    _commit.py says which files are ours and are ever deleted."""
    import torch.distributed.checkpoint as dcp

    path = _check_path(path).rstrip(os.sep)
    if not path:
        raise ValueError("save: path is empty; give the checkpoint directory")
    rank = _rank(process_group)
    plan = ""
    if rank == 0:
        try:
            plan = _begin(path, overwrite)
        except (ValueError, OSError) as e:
            plan = f"!{type(e).__name__}:{e}"
    plan = _broadcast_str(plan, process_group)
    if plan.startswith("!"):
        kind, _, msg = plan[1:].partition(":")
        raise (ValueError if kind == "ValueError" else OSError)(msg)
    tag, gen = plan.split(":")
    tmp = f"{path}.tmp-{tag}"
    writer = _writer(tmp)
    try:
        _fault("write")
        dcp.save(state_dict, storage_writer=writer, process_group=process_group)
    except BaseException:
        if rank == 0:
            _commit.remove_ours(tmp)
        raise
    written = _gather_written(writer.written, process_group)  # also waits for every rank
    old = f"{path}.old-{tag}"
    steps = (
        ("complete", lambda: _commit.write_marker(
            tmp, {"generation": int(gen), "state": "complete",
                  "files": _commit.describe_files(tmp, known=written)})),
        ("move_old", lambda: os.path.isdir(path) and os.rename(path, old)),
        ("move_new", lambda: os.rename(tmp, path)),
        ("clean",
         lambda: [_commit.remove_ours(d) for d in [old, *_commit.leftovers(path, keep=path)]
                            if os.path.isdir(d)]),
    )
    failed = ""
    for phase, step in steps:
        _fault(phase)
        if rank == 0 and not failed:
            try:
                step()
            except OSError as e:  # a full disk, a permission: every rank must hear of it
                failed = f"{phase}: {type(e).__name__}: {e}"
    failed = _broadcast_str(failed, process_group)
    if failed:
        raise OSError(f"save to {path!r} failed while committing ({failed}); the newest "
                      "complete copy is still loadable and the next save removes what "
                      "this one left")


def _begin(path: str, overwrite: bool) -> str:
    """Rank 0: refuse a path that is not ours, create the new copy with its "writing"
    marker; returns "<tag>:<generation>"."""
    if os.path.lexists(path) and not os.path.isdir(path):
        raise ValueError(f"save: {path!r} is an existing file, not a checkpoint directory; "
                         "vefsdp_optim.save never replaces a file it did not write: remove it or "
                         "save to another path")
    if os.path.isdir(path):
        mine = _commit.read_marker(path)
        if mine is None and os.listdir(path):
            raise ValueError(f"save: {path!r} is a non-empty directory that is not a "
                             f"vefsdp_optim checkpoint (no {_commit.MARKER}); save into a new or "
                             "empty directory (overwrite=True only replaces a vefsdp_optim "
                             "checkpoint, never other files)")
        if mine is not None and not overwrite:
            raise ValueError(f"save: {path!r} already holds a checkpoint (generation "
                             f"{mine['generation']}); pass overwrite=True to replace it")
    found = _commit.copies(path)
    gen = (found[0][0] if found else 0) + 1
    tag = uuid.uuid4().hex
    tmp = f"{path}.tmp-{tag}"
    os.makedirs(tmp)
    _commit.write_marker(tmp, {"generation": gen, "state": "writing"})
    return f"{tag}:{gen}"


def _writer(path: str) -> Any:
    """torch's FileSystemWriter, recording no path of this machine in the metadata
    (``storage_meta.checkpoint_id`` would hold the absolute temporary directory), and
    describing the files this rank wrote in ``written``.

    A checkpoint's marker records every file's size and sha256. Each rank hashes the data
    files it wrote itself, right after DCP wrote them (from the page cache), and rank 0
    gathers these descriptions (one small object per rank, to rank 0 only) and hashes only
    what it wrote and the metadata: the hashing is spread as the writing is, and no rank
    waits on another's beyond the save's own end. On load, the coordinator gives each file
    that the read plans touch to exactly one of its readers (the least loaded by bytes),
    and only that reader hashes it (SafeReader.prepare_global_plan); rank 0 alone hashes
    the metadata, before the other ranks read it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _Writer(dcp.FileSystemWriter):
        written: dict[str, dict[str, Any]] = {}

        def storage_meta(self) -> StorageMeta | None:
            return StorageMeta(checkpoint_id=None, save_id=self.save_id)

        def write_data(self, plan: Any, planner: Any) -> Any:
            done = super().write_data(plan, planner)
            names = {r.storage_data.relative_path for r in done.wait()}
            self.written = _commit.describe(path, names)
            return done

    return _Writer(path)


def _gather_written(written: dict[str, dict[str, Any]],
                    process_group: dist.ProcessGroup | None) -> dict[str, dict[str, Any]]:
    """Rank 0 of ``process_group``: every rank's descriptions of the files it wrote,
    merged (see ``_writer``); the other ranks: their own."""
    if not (dist.is_available() and dist.is_initialized()):
        return written
    dst = dist.get_global_rank(process_group, 0) if process_group is not None else 0
    if dist.get_rank() != dst:
        dist.gather_object(written, None, dst=dst, group=process_group)
        return written
    found: list[Any] = [None] * dist.get_world_size(process_group)
    dist.gather_object(written, found, dst=dst, group=process_group)
    merged: dict[str, dict[str, Any]] = {}
    for part in found:
        merged.update(part)
    return merged


def _resolve(path: str) -> tuple[str, str]:
    """The directory to load for the checkpoint ``path`` and, when that is not ``path``
    itself, the warning to give (see vefsdp_optim/_checkpoint/_commit.py)."""
    found = _commit.copies(path)
    if found:
        gen, where = found[0]
        if where == path:
            return path, ""
        here = _commit.read_marker(path) if os.path.isdir(path) else None
        state = "missing" if here is None else f"at generation {here['generation']}"
        return where, (f"checkpoint {path!r}: loading generation {gen} from {where!r}, left "
                       f"complete by an interrupted save; {path!r} is {state}")
    if os.path.isdir(path):
        return path, ""  # a DCP checkpoint not written by save(): no marker, no checksums
    raise FileNotFoundError(f"no checkpoint at {path!r}")


def load(state_dict: dict[str, Any], path: str | os.PathLike, *,
         process_group: dist.ProcessGroup | None = None, verify: bool = True) -> None:
    """``dcp.load`` of the checkpoint at ``path`` into ``state_dict`` (in place), after
    checking that the checkpoint has every key of ``state_dict`` with the same shape;
    raises ValueError listing what differs. Safe on a checkpoint you did not write (see
    the README's Trust section): the metadata is unpickled with an allowlist (see
    ``_Unpickler`` in vefsdp_optim/_checkpoint/_safe_load.py), every data file must lie
    inside ``path`` and hold what the metadata claims (see ``_confine`` in
    vefsdp_optim/_checkpoint/_safe_load.py), non-tensor entries are unpickled with
    ``torch.load(weights_only=True)``; a refusal is a ValueError naming the checkpoint,
    raised before any data is read. Loads the newest complete copy (warning when it is
    one an interrupted save left) and, unless ``verify=False``, checks every file it
    reads against the checksum save() recorded (ValueError naming the file). Then call
    ``set_model_state_dict`` / ``set_optimizer_state_dict`` (or ``load_state_dict``) as
    usual."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = _check_path(path).rstrip(os.sep)
    choice, reader = "", None
    if _rank(process_group) == 0:  # rank 0 alone picks the copy and checks its metadata file
        try:
            where, warning = _resolve(path)
            marker = _commit.read_marker(where)
            reader = SafeReader(where, files=marker.get("files") if marker else None, verify=verify)
            reader.read_metadata()  # kept: this load's reader on rank 0
            choice = f"{where}\0{warning}"
        except FileNotFoundError as e:
            choice = f"!F{e}"
        except ValueError as e:  # MetadataRefused: every rank raises it
            choice = f"!V{e}"
    choice = _broadcast_str(choice, process_group)
    if choice.startswith("!"):
        raise (FileNotFoundError if choice[1] == "F" else MetadataRefused)(choice[2:])
    path, warning = choice.split("\0")
    if warning:
        warnings.warn(warning, stacklevel=2)
    if reader is None:  # rank 0 checked the metadata file (see ``_writer``)
        marker = _commit.read_marker(path)
        reader = SafeReader(path, files=marker.get("files") if marker else None, verify=verify,
                            checked=(".metadata",))
    saved = reader.read_metadata().state_dict_metadata
    flat, mapping = flatten_state_dict(state_dict)
    if _empty_stateless_entries(state_dict, flat, mapping, saved):
        flat, _ = flatten_state_dict(state_dict)
    missing = sorted(k for k in flat if k not in saved)
    shapes = []
    for k, v in flat.items():
        md = saved.get(k)
        if (isinstance(v, torch.Tensor) and isinstance(md, TensorStorageMetadata)
                and md.size != v.shape):
            shapes.append(f"{k}: checkpoint {tuple(md.size)}, here {tuple(v.shape)}")
    if missing or shapes:
        extra = sorted(k for k in saved if k not in flat)
        lines = []
        if missing:
            lines.append(f"missing from the checkpoint: {_few(missing)}")
            if extra:
                lines.append(f"in the checkpoint but not asked for: {_few(extra)}")
        if shapes:
            lines.append(f"shapes differ: {_few(shapes)}")
        raise ValueError(f"checkpoint {path!r} does not match the state dict; " + "; ".join(lines))
    try:
        dcp.load(state_dict, storage_reader=reader, planner=_weights_only_planner(path),
                 process_group=process_group)
    except dcp.api.CheckpointException as e:  # a BaseException: surface our ValueError
        refused = [exc for exc, _ in e.failures.values() if isinstance(exc, ValueError)]
        if refused:
            raise refused[0] from None
        raise


def _empty_stateless_entries(state_dict: dict[str, Any], flat: dict[str, Any],
                             mapping: dict[str, Any], saved: Mapping[str, Any]) -> bool:
    """Empty the optimizer state entries of ``state_dict`` that the checkpoint lacks wholly;
    True when any was emptied.

    A parameter that had no optimizer state when the checkpoint was written (never
    stepped yet) has no entry in it, while the fresh optimizer's state dict asks for one:
    get_optimizer_state_dict first steps with zero gradients (DCP's _init_optim_state),
    which gives every parameter state. Plain dcp.load then fails with "Missing key", for
    torch.optim as for ours. load() instead empties such an entry, in place, when the
    checkpoint holds the same optimizer's param groups (so it was saved, and only this
    parameter's state is absent) and lacks every key of the entry; a partly missing entry
    is still an error. The optimizer's load_state_dict then leaves that parameter without
    state (``load_state`` in _format.py). Both of torch's optimizer state dict forms are
    recognized: nested ({"state": {fqn: {key: value}}, "param_groups": [...]}) and
    flattened ({"state.<fqn>.<key>": value, "param_groups.<fqn>.<key>": value})."""
    entries: dict[tuple, list[str]] = {}  # (container path, entry key) -> flat keys
    names: dict[int, set[str]] = {}  # id(flattened optimizer dict) -> its parameter names
    for key in flat:
        path = mapping[key]
        for i, part in enumerate(path):
            if part == "state" and i + 1 < len(path) and _is_optim_dict(_get(state_dict, path[:i])):
                entries.setdefault((tuple(path[:i]), "state", path[i + 1]), []).append(key)
                break
            fqn = _flat_fqn(_get(state_dict,
                                 path[:i]), part, names) if isinstance(part, str) else None
            if fqn is not None:  # flattened form: "state.<fqn>.<state key>"
                entries.setdefault((tuple(path[:i]), f"state.{fqn}"), []).append(key)
                break
    emptied = False
    for where, keys in entries.items():
        if any(k in saved for k in keys):
            continue
        container = _get(state_dict, where[0])
        prefix = ".".join(str(x) for x in where[0])
        prefix = prefix + "." if prefix else ""
        if len(where) == 3:  # nested form: the checkpoint must hold this optimizer's param groups
            if not any(k.startswith(prefix + "param_groups") for k in saved):
                continue
            container["state"][where[2]] = {}
        else:  # flattened form: and this parameter's own param group entries
            fqn = where[1][len("state."):]
            if not any(k.startswith(f"{prefix}param_groups.{fqn}.") for k in saved):
                continue
            for k in keys:
                container.pop(mapping[k][len(where[0])], None)
        emptied = True
    return emptied


def _flat_fqn(container: Any, part: str, names: dict[int, set[str]]) -> str | None:
    """The parameter name in the flattened optimizer state key ``part``
    ("state.<fqn>.<state key>", both may hold dots), found among the names of the
    container's "param_groups.<fqn>.<group key>" entries (group keys hold none)."""
    if not part.startswith("state.") or not isinstance(container, Mapping):
        return None
    known = names.get(id(container))
    if known is None:
        known = names[id(container)] = {
            k[len("param_groups."):].rpartition(".")[0] for k in container
            if isinstance(k, str) and k.startswith("param_groups.")}
    rest = part[len("state."):]
    cut = [i for i, c in enumerate(rest) if c == "."]
    for i in reversed(cut):  # the longest known name followed by a dot
        if rest[:i] in known:
            return rest[:i]
    return None


def _get(root: Any, path: tuple) -> Any:
    for part in path:
        root = root[part]
    return root


def _is_optim_dict(d: Any) -> bool:
    return isinstance(d, Mapping) and isinstance(d.get("state"), Mapping) and "param_groups" in d


def _weights_only_planner(where: str) -> Any:
    """DCP's default load planner, unpickling non-tensor entries with weights_only=True."""
    import io

    from torch.distributed.checkpoint import DefaultLoadPlanner

    class _Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            obj = load_bytes_safely(value, where, read_item.dest_index.fqn)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return _Planner()


def _few(items: list[str], n: int = 8) -> str:
    return ", ".join(items[:n]) + (f", ... ({len(items) - n} more)" if len(items) > n else "")
