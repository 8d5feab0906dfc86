"""Reading a checkpoint that someone else wrote: no code runs, nothing outside is read.

Two pieces, used by :func:`vefsdp_optim.load`:

- :func:`read_dcp_metadata`: the ``.metadata`` file of a DCP checkpoint, unpickled with
  an allowlist of the classes DCP metadata is made of (see ``_Unpickler``),
  then type-checked, then confined (see ``_confine``).
- :class:`SafeReader`: torch's ``FileSystemReader`` reading its metadata that way.

Every other unpickling on the load path goes through ``torch.load(weights_only=True)``,
torch's own restricted unpickler (an explicit ``weights_only=True`` is not overridden by
``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``); its errors are re-raised naming the checkpoint.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import math
import operator
import os
import pathlib
import pickle
import stat
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as _md

from vefsdp_optim._torch_compat import MEM_FORMAT_ENCODING, StorageInfo, get_layout

from ._commit import sha256

__all__ = ["read_dcp_metadata", "SafeReader", "MetadataRefused"]

# DCP's FileSystemReader reads ``.metadata`` with a plain ``pickle.load``: a crafted file
# runs any code at load time (torch treats DCP as trusted-environment only). We unpickle
# it as torch/_weights_only_unpickler.py does a weights file: ``find_class`` answers only
# the globals below, every other one raises before any REDUCE/BUILD runs, and
# ``persistent_load`` is refused. The allowlist is what torch's writers put there: the
# metadata dataclasses, torch.Size, dtypes, layouts, memory formats, devices, pathlib
# paths (older writers record ``checkpoint_id`` as a PosixPath) and plain containers.
# Calling an allowed class only builds data. After unpickling, the result is
# type-checked field by field, so a well-formed pickle of the wrong shape is refused
# with a ValueError too, never a late AttributeError.

_DCP_MD = "torch.distributed.checkpoint.metadata"
_ALLOWED: dict[tuple[str, str], Any] = {
    (_DCP_MD, n): getattr(_md, n)
    for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
              "TensorProperties", "MetadataIndex", "StorageMeta")
    if hasattr(_md, n)
}
# torch's private classes, under the names pickle records them by
for _c in (MEM_FORMAT_ENCODING, StorageInfo, get_layout):  # get_layout: name -> layout
    _ALLOWED[(_c.__module__, _c.__qualname__)] = _c
_ALLOWED[("torch", "Size")] = torch.Size
_ALLOWED[("torch", "device")] = torch.device
for _n in dir(torch):
    _v = getattr(torch, _n, None)
    if isinstance(_v, (torch.dtype, torch.layout, torch.memory_format)):
        _ALLOWED[("torch", _n)] = _v
for _n in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path", "PurePath"):
    _ALLOWED[("pathlib", _n)] = getattr(pathlib, _n)
_ALLOWED[("collections", "OrderedDict")] = OrderedDict
for _n in ("set", "frozenset", "complex", "slice"):
    _ALLOWED[("builtins", _n)] = getattr(__import__("builtins"), _n)
_ALLOWED[("__builtin__", "set")] = set


class MetadataRefused(ValueError):
    """A checkpoint's metadata is not plain DCP metadata (or lies about its files)."""


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BufferedIOBase, where: str) -> None:
        super().__init__(file)
        self._where = where

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise MetadataRefused(
                f"checkpoint {self._where!r} metadata references {module}.{name}, which is "
                "not allowed; vefsdp_optim.load only reads DCP metadata (see "
                "README, Trust)") from None

    def persistent_load(self, pid: Any) -> Any:
        raise MetadataRefused(f"checkpoint {self._where!r} metadata holds a persistent id {pid!r}, "
                              "which is not allowed; vefsdp_optim.load only reads DCP metadata")


def _bad(where: str, what: str) -> MetadataRefused:
    return MetadataRefused(f"checkpoint {where!r} metadata is malformed: {what}")


def _check_size(v: object, where: str, what: str) -> None:
    if not isinstance(v, torch.Size) or any(type(d) is not int or d < 0 for d in v):
        raise _bad(where, f"{what} is {v!r}, expected a torch.Size of non-negative ints")


def _chunks_inside(entry: _md.TensorStorageMetadata) -> bool:
    """Whether every chunk of ``entry`` (whose size is checked) is a ChunkStorageMetadata
    of torch.Size offsets and sizes of non-negative ints, of the tensor's rank, lying inside
    it. One pass per field over all chunks, in C (``map``, ``zip``, ``min``, ``max``):
    checking chunk by chunk in Python cost 10-15 ms per tensor at 1,024 chunks, most of a
    load's metadata check at W = 1,024. False sends the caller to the chunk-by-chunk loop
    that names the first bad one."""
    chunks, ndim = entry.chunks, len(entry.size)
    if not chunks:
        return True
    if set(map(type, chunks)) != {_md.ChunkStorageMetadata}:
        return False
    for field in (list(map(_OFFSETS, chunks)), list(map(_SIZES, chunks))):
        if set(map(type, field)) != {torch.Size} or set(map(len, field)) != {ndim}:
            return False
        if ndim and set(map(type, itertools.chain.from_iterable(field))) != {int}:
            return False
    for dim, o, s in zip(entry.size, zip(*map(_OFFSETS, chunks), strict=True),
                         zip(*map(_SIZES, chunks), strict=True), strict=True):
        if min(o) < 0 or min(s) < 0 or max(map(operator.add, o, s)) > dim:
            return False
    return True


_OFFSETS, _SIZES = operator.attrgetter("offsets"), operator.attrgetter("sizes")


def _storage_typed(sdata: dict) -> bool:
    """Whether every storage entry is a MetadataIndex with a str fqn naming a StorageInfo
    with a str path, int offset and length >= 0 and no transforms other than a list or
    tuple of strs: one pass per field in C, as :func:`_chunks_inside`."""
    if not sdata:
        return True
    keys, infos = list(sdata), list(sdata.values())
    if set(map(type, keys)) != {_md.MetadataIndex} or set(map(type, map(_FQN, keys))) != {str}:
        return False
    if set(map(type, infos)) != {StorageInfo} or set(map(type, map(_PATH, infos))) != {str}:
        return False
    for field in (list(map(_OFFSET, infos)), list(map(_LENGTH, infos))):
        if set(map(type, field)) != {int} or min(field) < 0:
            return False
    for td in {id(t): t
               for t in (getattr(i, "transform_descriptors", None) for i in infos)}.values():
        if td is not None and not (isinstance(td, (list, tuple))
                                   and all(isinstance(t, str) for t in td)):
            return False
    return True


_FQN, _PATH = operator.attrgetter("fqn"), operator.attrgetter("relative_path")
_OFFSET, _LENGTH = operator.attrgetter("offset"), operator.attrgetter("length")


def _check_each_chunk(fqn: str, entry: _md.TensorStorageMetadata, where: str) -> None:
    """:func:`_chunks_inside`'s definition, chunk by chunk: raises naming the first bad one."""
    for c in entry.chunks:
        if not isinstance(c, _md.ChunkStorageMetadata):
            raise _bad(where, f"{fqn} has a chunk of type {type(c).__name__}")
        _check_size(c.offsets, where, f"{fqn} chunk offsets")
        _check_size(c.sizes, where, f"{fqn} chunk sizes")
        if len(c.offsets) != len(entry.size) or len(c.sizes) != len(entry.size) or any(
                o + s > d for o, s, d in zip(c.offsets, c.sizes, entry.size, strict=True)):
            raise _bad(where, f"{fqn} chunk at {tuple(c.offsets)} of {tuple(c.sizes)} lies outside "
                              f"the tensor's {tuple(entry.size)}")


def _check_each_storage_entry(sdata: dict, where: str) -> None:
    """:func:`_storage_typed`'s definition, entry by entry: raises naming the first bad one."""
    for idx, info in sdata.items():
        if not isinstance(idx, _md.MetadataIndex) or not isinstance(idx.fqn, str):
            raise _bad(where, f"storage key {idx!r} is not a MetadataIndex")
        if not isinstance(info, StorageInfo) or not isinstance(info.relative_path, str) or any(
                type(x) is not int or x < 0 for x in (info.offset, info.length)):
            raise _bad(where, f"storage entry of {idx.fqn} is {info!r}, expected a relative path, "
                              "offset >= 0 and length >= 0")
        td = getattr(info, "transform_descriptors", None)
        if td is not None and not (isinstance(td, (list, tuple))
                                   and all(isinstance(t, str) for t in td)):
            raise _bad(where, f"storage entry of {idx.fqn} has transforms {td!r}")


def _check_types(md: object, where: str) -> _md.Metadata:
    """Field by field: what DCP's reader and planner will touch is what it claims to be."""
    if not isinstance(md, _md.Metadata):
        raise _bad(where, f"the file holds a {type(md).__name__}, not DCP Metadata")
    sdm = getattr(md, "state_dict_metadata", None)
    if not isinstance(sdm, dict):
        raise _bad(where, "state_dict_metadata is not a dict")
    for fqn, entry in sdm.items():
        if not isinstance(fqn, str):
            raise _bad(where, f"key {fqn!r} is not a str")
        if isinstance(entry, _md.TensorStorageMetadata):
            _check_size(entry.size, where, f"{fqn}.size")
            props = entry.properties
            if not isinstance(props, _md.TensorProperties) or not isinstance(props.dtype,
                                                                             torch.dtype):
                raise _bad(where, f"{fqn} has no tensor properties with a dtype")
            if not isinstance(entry.chunks, list):
                raise _bad(where, f"{fqn}.chunks is not a list")
            if not _chunks_inside(entry):
                _check_each_chunk(fqn, entry, where)
        elif not isinstance(entry, _md.BytesStorageMetadata):
            raise _bad(where, f"{fqn} is a {type(entry).__name__}")
    if not isinstance(getattr(md, "storage_meta", None), (_md.StorageMeta, type(None))):
        raise _bad(where, f"storage_meta is a {type(md.storage_meta).__name__}")
    if not isinstance(getattr(md, "planner_data", None), (dict, type(None))):
        raise _bad(where, f"planner_data is a {type(md.planner_data).__name__}")
    sdata = getattr(md, "storage_data", None)
    if not isinstance(sdata, dict):
        raise _bad(where, "storage_data is not a dict")
    if not _storage_typed(sdata):
        _check_each_storage_entry(sdata, where)
    return md


_FRAMING = 64 << 10  # torch.save's zip framing of one tensor: ~1.5 KiB, alignment included


def _chunk_bounds(entry: _md.TensorStorageMetadata) -> tuple[dict[tuple[int, ...], int], int]:
    """The most bytes a storage entry of each chunk (by its offsets) of ``entry`` may
    claim, and of an entry that names no chunk (the largest chunk's bound)."""
    itemsize = entry.properties.dtype.itemsize
    offsets = list(map(tuple, map(_OFFSETS, entry.chunks)))
    if len(set(offsets)) == len(offsets):  # one chunk per offset, as DCP writes them
        sizes = map(math.prod, map(_SIZES, entry.chunks))
        by_offset = dict(zip(offsets, (_FRAMING + n * itemsize for n in sizes), strict=True))
        return by_offset, max(by_offset.values(), default=_FRAMING)
    by_offset: dict[tuple[int, ...], int] = {}
    for c in entry.chunks:
        key = tuple(c.offsets)
        by_offset[key] = max(by_offset.get(key, _FRAMING), _FRAMING + math.prod(c.sizes) * itemsize)
    return by_offset, max(by_offset.values(), default=_FRAMING)


def _confined(md: _md.Metadata, root: str, where: str) -> bool:
    """:func:`_confine`'s checks, one pass per field over all storage entries in C (a
    Python loop over the entries cost 7-10 ms per tensor at 1,024 chunks): each file is
    checked once; False (an entry past its file's end or its chunk's bound) sends the caller
    to the entry-by-entry loop that names it."""
    infos = list(md.storage_data.values())
    paths = list(map(_PATH, infos))
    sizes = {rel: _file_size(rel, os.path.realpath(root), where) for rel in set(paths)}
    if not all(map(operator.le, map(operator.add, map(_OFFSET, infos), map(_LENGTH, infos)),
                   map(sizes.__getitem__, paths))):
        return False
    bound: dict[tuple[str, Any], int] = {}  # (fqn, chunk offsets or None) -> the most bytes
    default: dict[str, int] = {}  # a tensor's fqn -> the bound of an offset that names no chunk
    for fqn, entry in md.state_dict_metadata.items():
        if isinstance(entry, _md.TensorStorageMetadata):
            by_offset, largest = _chunk_bounds(entry)
            bound.update(zip(zip(itertools.repeat(fqn), by_offset, strict=False), by_offset.values(), strict=True))
            bound[(fqn, None)] = largest
            default[fqn] = _FRAMING
    keys = list(md.storage_data)
    fqns = list(map(_FQN, keys))
    # an entry of a bytes value (no tensor of its fqn) has no bound; a compressed one is smaller
    claims = map(bound.get, zip(fqns, map(_INDEX_OFFSET, keys), strict=True),
                 map(default.get, fqns, itertools.repeat(_NO_BOUND)))
    return all(map(operator.le, map(_LENGTH, infos), claims))


_NO_BOUND = float("inf")
_INDEX_OFFSET = operator.attrgetter("offset")


def _file_size(rel: str, real_root: str, where: str) -> int:
    """The size of the data file ``rel``, after checking that it is a plain relative path
    to a regular file inside the checkpoint (see ``_confine``)."""
    parts = rel.replace("\\", "/").split("/")
    if (not rel or "\0" in rel or os.path.isabs(rel) or rel.startswith(("/", "\\"))
            or any(p in ("", ".", "..") for p in parts)):
        raise MetadataRefused(f"checkpoint {where!r} metadata names the file {rel!r}, which is not a "
                              "plain relative path inside the checkpoint; refused before reading")
    real = os.path.realpath(os.path.join(real_root, rel))
    if os.path.commonpath([real, real_root]) != real_root:
        raise MetadataRefused(f"checkpoint {where!r} metadata names the file {rel!r}, which resolves "
                              f"outside the checkpoint (a symlink?); refused before reading")
    try:
        st = os.stat(real)
    except OSError as e:
        raise MetadataRefused(f"checkpoint {where!r} lacks the data file {rel!r} ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise MetadataRefused(f"checkpoint {where!r}: {rel!r} is not a regular file")
    return st.st_size


def _confine(md: _md.Metadata, root: str, where: str) -> None:
    """Refuse a storage entry outside the checkpoint or past its bounds.

    Every storage entry names a file by ``relative_path``. Before the first byte of data
    is read (read_metadata runs before DCP plans any read), each one must be a plain
    relative path with no ``..`` component that, with every symlink resolved, lies inside
    the checkpoint directory, and be a regular file (no FIFO, no device). Its ``offset +
    length`` must fit in the file. A tensor entry's length must also fit the chunk it
    claims to hold (elements x element size, plus torch.save's few-KiB framing), and every
    chunk lies inside its tensor, whose size load() has already compared with the target
    state dict. So a crafted file can make load read and allocate no more than that target
    needs."""
    if not _confined(md, root, where):
        _confine_each_entry(md, root, where)


def _confine_each_entry(md: _md.Metadata, root: str, where: str) -> None:
    """:func:`_confined`'s definition, entry by entry: raises naming the first bad one."""
    real_root = os.path.realpath(root)
    sizes: dict[str, int] = {}
    # fqn -> its chunks' byte bounds, built once per tensor: O(chunks), not O(chunks^2)
    bounds: dict[str, tuple[dict[tuple[int, ...], int], int]] = {}
    for idx, info in md.storage_data.items():
        rel = info.relative_path
        if rel not in sizes:
            sizes[rel] = _file_size(rel, real_root, where)
        if info.offset + info.length > sizes[rel]:
            raise MetadataRefused(
                f"checkpoint {where!r}: the entry of {idx.fqn} claims bytes {info.offset}..{info.offset + info.length}"
                f" of {rel!r}, which has {sizes[rel]} bytes (truncated or lying metadata)")
        entry = md.state_dict_metadata.get(idx.fqn)
        if isinstance(entry, _md.TensorStorageMetadata):  # a compressed entry is smaller still
            if idx.fqn not in bounds:
                bounds[idx.fqn] = _chunk_bounds(entry)
            by_offset, largest = bounds[idx.fqn]
            bound = largest if idx.offset is None else by_offset.get(tuple(idx.offset), _FRAMING)
            if info.length > bound:
                raise MetadataRefused(
                    f"checkpoint {where!r}: the entry of {idx.fqn} claims {info.length} bytes, "
                    f"more than its chunk needs ({bound} at most)")


def read_dcp_metadata(root: str, filename: str = ".metadata") -> _md.Metadata:
    """Read, type-check and confine the DCP metadata of the checkpoint directory ``root``.
    Raises :class:`MetadataRefused` (a ValueError) naming the checkpoint."""
    path = os.path.join(root, filename)
    try:
        with open(path, "rb") as f:
            md = _Unpickler(f, root).load()
    except MetadataRefused:
        raise
    except FileNotFoundError:
        raise FileNotFoundError(f"no checkpoint at {root!r} (no {filename})") from None
    except Exception as e:  # noqa: BLE001 - truncated or garbled pickles raise anything
        raise MetadataRefused(f"checkpoint {root!r} metadata {filename} cannot be read "
                              f"(truncated or corrupt): {type(e).__name__}: {e}") from None
    md = _check_types(md, root)
    _confine(md, root, root)
    if getattr(md, "storage_meta", None) is None:
        md.storage_meta = _md.StorageMeta()
    return md


@dataclasses.dataclass(frozen=True)
class _HashAssignment:
    """The files one reader hashes, as the coordinator's global plan assigns them."""

    files: tuple[str, ...]


class SafeReader(FileSystemReader):
    """``FileSystemReader`` whose metadata is read by :func:`read_dcp_metadata` (and kept:
    load() and dcp.load() both ask for it). With ``files`` (name -> {"size", "sha256"},
    from save()'s marker), each file is checked before its first read: its size always,
    its checksum when ``verify``, by one reader only: the one the coordinator's global
    plan gives it to (see ``_writer`` in vefsdp_optim/_checkpoint/_save_load.py). The names in
    ``checked`` (the metadata, which rank 0 checked for every rank) are not hashed again."""

    def __init__(self, path: str | os.PathLike, *, files: dict[str, Any] | None = None,
                 verify: bool = True, checked: Iterable[str] = ()) -> None:
        super().__init__(path)
        self._cached: dict[Any, _md.Metadata] = {}
        self._files = files
        self._verify = verify
        self._checked: set[str] = set(checked)
        self._sized: set[str] = set(checked)

    def _check_file(self, rel: str, hash_it: bool = True) -> None:
        if self._files is None or rel in self._checked or (not hash_it and rel in self._sized):
            return
        root = os.fspath(self.path)
        want = self._files.get(rel)
        if not isinstance(want, dict):
            raise MetadataRefused(f"checkpoint {root!r}: {rel!r} is not among the files its save recorded")
        p = os.path.join(root, rel)
        size = os.path.getsize(p) if os.path.isfile(p) else -1
        if size != want.get("size"):
            raise MetadataRefused(f"checkpoint {root!r}: {rel!r} has {size} bytes, its save wrote "
                                  f"{want.get('size')} (truncated or replaced)")
        self._sized.add(rel)
        if not hash_it:
            return
        if self._verify and sha256(p) != want.get("sha256"):
            raise MetadataRefused(f"checkpoint {root!r}: {rel!r} does not match the checksum its save "
                                  "recorded (corrupt); load(..., verify=False) skips this check")
        self._checked.add(rel)

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        """The coordinator: each file that the plans read goes to one of its readers, the
        least loaded by bytes so far (larger files first), who alone hashes it; the
        assignment rides in each plan's ``storage_data``."""
        plans = super().prepare_global_plan(plans)
        if self._files is None or not self._verify:
            return plans
        readers: dict[str, list[int]] = {}
        for i, plan in enumerate(plans):
            for rel in {self.storage_data[item.storage_index].relative_path for item in plan.items}:
                readers.setdefault(rel, []).append(i)
        size = {rel: (self._files.get(rel) or {}).get("size", 0) for rel in readers}
        load = [0] * len(plans)
        mine: list[list[str]] = [[] for _ in plans]
        for rel in sorted(readers, key=lambda r: (-size[r], r)):
            who = min(readers[rel], key=lambda i: (load[i], i))
            load[who] += size[rel]
            mine[who].append(rel)
        return [dataclasses.replace(plan, storage_data=_HashAssignment(tuple(sorted(m))))
                for plan, m in zip(plans, mine, strict=True)]

    def read_data(self, plan: Any, planner: Any) -> Any:
        assigned = plan.storage_data
        for rel in sorted({self.storage_data[item.storage_index].relative_path for item in plan.items}):
            # without the coordinator's assignment (a plan not through prepare_global_plan),
            # this reader hashes what it reads
            self._check_file(rel, hash_it=not isinstance(assigned, _HashAssignment) or rel in assigned.files)
        return super().read_data(plan, planner)

    def read_metadata(self, *args: Any, **kwargs: Any) -> _md.Metadata:
        rank = kwargs.get("rank")
        if rank not in self._cached:
            name = ".metadata" if rank is None else f"__{rank}.metadata"
            self._check_file(name)
            self._cached[rank] = read_dcp_metadata(os.fspath(self.path), name)
        md = self._cached[rank]
        md.storage_meta.load_id = self.load_id
        return md


def load_bytes_safely(value: io.BytesIO, where: str, fqn: str) -> Any:
    """A BYTE_IO entry through torch's weights-only unpickler; its refusal names the checkpoint."""
    try:
        return torch.load(value, weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(f"checkpoint {where!r} entry {fqn!r} is not plain data, refused by "
                         f"torch.load(weights_only=True): {e}") from None
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"checkpoint {where!r} entry {fqn!r} cannot be read (truncated "
                         f"or corrupt): {type(e).__name__}: {e}") from None
