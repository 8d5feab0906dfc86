"""Live tensor bytes at the allocator level, on any device, with a breakdown at the peak.

[Note: live-bytes tracker]
``LiveBytes`` is a ``TorchDispatchMode``. Every op's output tensors are mapped to their
untyped storages (wrapper subclasses such as DTensor or ShardedParameter through their
local tensor); a storage that first appears as the output of an op none of whose inputs
share it is *new*: its ``nbytes`` is counted once, and subtracted by a weakref callback
when the storage dies (a storage's Python object lives as long as its StorageImpl), so
views, in-place ops and ``out=`` never count twice. ``UntypedStorage.resize_`` is not
an op (FSDP2 and this library free and re-allocate their unsharded buffers with it),
so it is wrapped while the mode is active, as torch's own ``MemTracker`` does; ops
whose output is a tracked storage (``aten.resize_``, ``set_``) re-read its size.
Storages created before the mode was entered are never counted, even when an op returns
a view of them. What is *not* seen: buffers a kernel allocates and frees inside one op
(e.g. a collective's staging buffers), and memory that is not a tensor storage.

The peak is the maximum of the running sum after every event. ``watch(at, label)``
takes a breakdown the first time the live bytes reach ``at`` (typically the previous
step's peak, so a steady-state step is broken down at its own peak) and again whenever
they exceed the last snapshot: ``label()`` returns ``{category: tensors}``, evaluated
at that moment, and each live storage goes to the first category that holds it, the
rest to ``other``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping
from functools import wraps
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["LiveBytes", "storages_of", "OTHER"]

OTHER = "other"


def storages_of(t: Any) -> list[torch.UntypedStorage]:
    """The untyped storages that hold ``t``'s data (through wrapper subclasses)."""
    if not isinstance(t, torch.Tensor):
        return []
    flatten = getattr(t, "__tensor_flatten__", None)  # DTensor and other traceable wrappers
    if flatten is not None:
        names, _ = flatten()
        return [s for n in names for s in storages_of(getattr(t, n))]
    local = getattr(t, "to_local", None)  # ShardedParameter
    if local is not None:
        return storages_of(local())
    if t.is_meta or t.layout is not torch.strided:
        return []
    try:
        return [t.untyped_storage()]
    except (RuntimeError, NotImplementedError):  # a wrapper without a storage
        return []


def _key(st: torch.UntypedStorage) -> int:
    return st._cdata


class LiveBytes(TorchDispatchMode):
    """Live bytes of the tensor storages created while active ([Note: live-bytes tracker])."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0  # bytes now
        self.peak = 0  # max of ``live`` since the start or the last reset_peak()
        self._st: dict[int, list[Any]] = {}  # key -> [weakref to storage, nbytes counted, op name]
        self._foreign: weakref.WeakValueDictionary[int, torch.UntypedStorage] = (
            weakref.WeakValueDictionary())  # storages seen first as views of older ones
        self._watch_at: int | None = None
        self._label: Callable[[], Mapping[str, Iterable[Any]]] | None = None
        self.breakdown: dict[str, int] | None = None  # at the last snapshot
        self.other_by_op: dict[str, int] = {}  # OTHER's bytes by the op that made them
        self._orig_resize = None

    # -- accounting -----------------------------------------------------------------

    def _changed(self, delta: int) -> None:
        self.live += delta
        if self.live > self.peak:
            self.peak = self.live
        at = self._watch_at
        if at is not None and delta > 0 and self.live >= at:
            self._snapshot()
            self._watch_at = self.live + 1

    def _dead(self, key: int, ref: weakref.ref) -> None:
        entry = self._st.get(key)
        if entry is not None and entry[0] is ref:
            del self._st[key]
            self._changed(-entry[1])

    def _add(self, st: torch.UntypedStorage, origin: str) -> None:
        key = _key(st)
        ref = weakref.ref(st, lambda r, key=key: self._dead(key, r))
        n = st.nbytes()
        self._st[key] = [ref, n, origin]
        self._changed(n)

    def _resized(self, st: torch.UntypedStorage) -> None:
        entry = self._st.get(_key(st))
        if entry is not None:
            n = st.nbytes()
            delta, entry[1] = n - entry[1], n
            if delta:
                self._changed(delta)

    def tracked(self, t: Any) -> bool:
        """Whether the storage of tensor ``t`` is counted."""
        return any(_key(s) in self._st for s in storages_of(t))

    # -- the mode -------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        out = func(*args, **(kwargs or {}))
        outs = [s for t in tree_flatten(out)[0] for s in storages_of(t)]
        if not outs:
            return out
        ins = {_key(s) for t in tree_flatten((args, kwargs))[0] for s in storages_of(t)}
        for st in outs:
            key = _key(st)
            if key in self._st:
                self._resized(st)
            elif key in ins or key in self._foreign:
                self._foreign[key] = st  # older than the mode: never counted
            else:
                self._add(st, func.__name__)
        return out

    def __enter__(self) -> LiveBytes:
        self._orig_resize = orig = torch.UntypedStorage.resize_
        tracker = self

        @wraps(orig)
        def resize_(st: torch.UntypedStorage, size: int) -> Any:
            r = orig(st, size)
            tracker._resized(st)
            return r

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.UntypedStorage.resize_ = self._orig_resize  # type: ignore[method-assign]
        super().__exit__(*exc)

    # -- peaks and breakdowns -------------------------------------------------------

    def reset_peak(self) -> None:
        self.peak = self.live

    def watch(self, at: int, label: Callable[[], Mapping[str, Iterable[Any]]]) -> None:
        """Snapshot a breakdown when the live bytes first reach ``at``, then at each new high."""
        if at < 0:
            raise ValueError(f"watch(at=...) must be >= 0 bytes, got {at}")
        self._watch_at, self._label, self.breakdown = at, label, None

    def unwatch(self) -> None:
        self._watch_at = None

    def _snapshot(self) -> None:
        owner: dict[int, str] = {}
        for cat, tensors in (self._label() if self._label is not None else {}).items():
            for t in tensors:
                for s in storages_of(t):
                    owner.setdefault(_key(s), cat)
        out: dict[str, int] = {}
        origins: dict[str, int] = {}
        for key, (_, n, op) in self._st.items():
            cat = owner.get(key, OTHER)
            out[cat] = out.get(cat, 0) + n
            if cat == OTHER:
                origins[op] = origins.get(op, 0) + n
        out["total"] = self.live
        self.breakdown = out
        self.other_by_op = dict(sorted(origins.items(), key=lambda kv: -kv[1]))
