"""A recording implementation of fully_shard's ``Streams`` for tests on the CPU.

CUDA streams cannot run here, so the stream protocol of [Note: fully_shard streams] is
checked on a model of it: ``RecordingStreams`` names five streams (default, copy_in,
all_gather, reduce_scatter, all_reduce, plus any made with ``stream()``) and keeps a
vector clock per stream; events carry a clock; ``wait_event`` / ``wait_stream`` join
clocks. Every op runs on the CPU at once, as before, and is *recorded* on the stream
that is current in the model: aten ops through a dispatch mode (reads and writes from
the op's schema), the store's collectives and allocations through wrappers that
``install`` puts around the library's functions. Op A happens before op B when B's
stream clock has seen A.

For each tracked storage (the stores' buffers) it checks, as a race detector would:
a read sees its last write (read after write), a write sees the earlier reads and
writes, and a buffer's bytes are given back only when the stream that allocated it has
seen every use of them (the caching allocator hands the block to that stream's next
work). Every breach is a line in ``violations``.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vefsdp_optim._fsdp._streams import Streams

_SKIP = {"resize_", "set_", "detach", "alias", "lift_fresh", "_has_same_storage_numel",
         "_local_scalar_dense", "is_same_size", "empty_like", "_version"}


def key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class FakeStream:
    def __init__(self, rec: RecordingStreams, name: str) -> None:
        self.rec, self.name = rec, name

    def wait_event(self, event: FakeEvent) -> None:
        self.rec.wait_event(self, event)

    def wait_stream(self, other: FakeStream) -> None:
        self.rec.wait_stream(self, other)

    def record_event(self) -> FakeEvent:
        return self.rec.record(self)

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"


class FakeEvent:
    _ids = itertools.count()

    def __init__(self, rec: RecordingStreams, stream: str | None = None, clock: dict[str, int] | None = None) -> None:
        self.rec, self.stream, self.clock = rec, stream, dict(clock or {})
        self.id = next(FakeEvent._ids)

    def record(self, stream: FakeStream | None = None) -> None:
        s = stream or self.rec.current()
        self.stream, self.clock = s.name, dict(self.rec.clocks[s.name])
        self.rec.log.append(("record", s.name, self.id))

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


@dataclass
class Op:
    seq: int
    phase: str
    label: str
    stream: str
    t: int
    clock: dict[str, int]
    reads: list[int] = field(default_factory=list)
    writes: list[int] = field(default_factory=list)


@dataclass
class Track:
    name: str
    alloc_stream: str = "default"
    uses: list[Op] = field(default_factory=list)  # in this allocation
    last_write: Op | None = None
    reads: list[Op] = field(default_factory=list)  # since the last write


class _Mode(TorchDispatchMode):
    def __init__(self, rec: RecordingStreams) -> None:
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        rec = self.rec
        if not rec.paused and not func.is_view and func._schema.name.split("::")[-1] not in _SKIP:
            reads, writes = [], []
            schema_args = func._schema.arguments
            values = list(args) + [kwargs.get(a.name) for a in schema_args[len(args):]]
            for a, v in zip(schema_args, values, strict=False):
                ts = v if isinstance(v, (list, tuple)) else [v]
                for t in ts:
                    if isinstance(t, torch.Tensor) and key(t) in rec.tracked:
                        (writes if a.alias_info is not None and a.alias_info.is_write else reads).append(t)
            if reads or writes:
                rec.access(str(func.overloadpacket.__name__), reads, writes)
        return func(*args, **kwargs)


class RecordingStreams(Streams):
    active = True

    def __init__(self) -> None:
        self.clocks: dict[str, dict[str, int]] = {}
        self.default = self.stream("default")
        self.copy_in = self.stream("copy_in")
        self.all_gather = self.stream("all_gather")
        self.reduce_scatter = self.stream("reduce_scatter")
        self.all_reduce = self.stream("all_reduce")
        self._stack = [self.default]
        self.log: list[tuple] = []  # ("use" | "record" | "wait_event" | "wait_stream" | "alloc" | "free", ...)
        self.ops: list[Op] = []
        self.tracked: dict[int, Track] = {}
        self.violations: list[str] = []
        self.phase = ""
        self.paused = False
        self._seq = itertools.count()

    # -- the Streams interface ---------------------------------------------------------

    def stream(self, name: str) -> FakeStream:
        self.clocks[name] = {name: 0}
        return FakeStream(self, name)

    def current(self) -> FakeStream:
        return self._stack[-1]

    @contextlib.contextmanager
    def use(self, stream: FakeStream | None) -> Iterator[None]:
        if stream is None:
            yield
            return
        self._stack.append(stream)
        self.log.append(("use", stream.name))
        try:
            yield
        finally:
            self._stack.pop()

    def record(self, stream: FakeStream | None) -> FakeEvent:
        ev = FakeEvent(self)
        ev.record(stream)
        return ev

    def event(self) -> FakeEvent:
        """An unrecorded event (``torch.cuda.Event()``)."""
        return FakeEvent(self)

    def wait_event(self, stream: FakeStream | None, event: FakeEvent | None) -> None:
        if event is None:
            return
        s = stream or self.current()
        self.log.append(("wait_event", s.name, event.id))
        _join(self.clocks[s.name], event.clock)

    def wait_stream(self, consumer: FakeStream | None, producer: FakeStream | None) -> None:
        c, p = consumer or self.current(), producer or self.current()
        if c is p:
            return
        self.log.append(("wait_stream", c.name, p.name))
        _join(self.clocks[c.name], self.clocks[p.name])

    def query(self, event: Any) -> bool:
        return True

    def synchronize(self) -> None:
        self.log.append(("synchronize", self.current().name))

    def synchronize_event(self, event: FakeEvent | None) -> None:
        if event is not None:
            self.log.append(("synchronize", event.stream))

    # -- the model -----------------------------------------------------------------

    def track(self, t: torch.Tensor, name: str) -> None:
        self.tracked.setdefault(key(t), Track(name))

    def hb(self, a: Op, b: Op | dict[str, int]) -> bool:
        """Op ``a`` happens before ``b`` (an op, or a stream's clock now)."""
        clock = b.clock if isinstance(b, Op) else b
        return clock.get(a.stream, 0) >= a.t

    def access(self, label: str, reads: list[torch.Tensor], writes: list[torch.Tensor]) -> Op:
        s = self.current().name
        clock = self.clocks[s]
        clock[s] += 1
        op = Op(next(self._seq), self.phase, label, s, clock[s], dict(clock),
                [key(t) for t in reads], [key(t) for t in writes])
        self.ops.append(op)
        for k in dict.fromkeys(op.reads):
            tr = self.tracked[k]
            if tr.last_write is not None and not self.hb(tr.last_write, op):
                self._violate(f"{label} on {s} reads {tr.name} written by {tr.last_write.label} on "
                              f"{tr.last_write.stream} without waiting for it")
            tr.reads.append(op)
            tr.uses.append(op)
        for k in dict.fromkeys(op.writes):
            tr = self.tracked[k]
            for prev in ([tr.last_write] if tr.last_write is not None else []) + tr.reads:
                if prev is not op and not self.hb(prev, op):
                    self._violate(f"{label} on {s} writes {tr.name} while {prev.label} on {prev.stream} may "
                                  "still use it")
            tr.last_write, tr.reads = op, []
            tr.uses.append(op)
        return op

    def alloc(self, t: torch.Tensor) -> None:
        tr = self.tracked.get(key(t))
        if tr is None:
            return
        s = self.current().name
        self.log.append(("alloc", tr.name, s))
        tr.alloc_stream, tr.uses, tr.last_write, tr.reads = s, [], None, []

    def free(self, t: torch.Tensor) -> None:
        tr = self.tracked.get(key(t))
        if tr is None:
            return
        self.log.append(("free", tr.name, self.current().name))
        clock = self.clocks[tr.alloc_stream]
        for op in tr.uses:
            if not self.hb(op, clock):
                self._violate(f"{tr.name} freed (allocated on {tr.alloc_stream}) before {tr.alloc_stream} "
                              f"waited for {op.label} on {op.stream}")
                break
        tr.uses, tr.last_write, tr.reads = [], None, []

    def _violate(self, msg: str) -> None:
        self.violations.append(f"[{self.phase}] {msg}")

    # -- wiring ----------------------------------------------------------------------

    @contextlib.contextmanager
    def paused_mode(self) -> Iterator[None]:
        old, self.paused = self.paused, True
        try:
            yield
        finally:
            self.paused = old

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        with _Mode(self):
            yield


def _join(into: dict[str, int], other: dict[str, int]) -> None:
    for k, v in other.items():
        if into.get(k, 0) < v:
            into[k] = v


def track_shard_groups(rec: RecordingStreams, model: torch.nn.Module) -> dict[int, str]:
    """Track every store buffer of ``model``'s shard groups; returns storage key -> name."""
    from vefsdp_optim._fsdp._module import FSDPModule

    names: dict[int, str] = {}
    seen = set()
    for mod_name, m in model.named_modules():
        if not isinstance(m, FSDPModule) or m._vefsdp_state.shard_group is None:
            continue
        g = m._vefsdp_state.shard_group
        if id(g) in seen:
            continue
        seen.add(id(g))
        for i, store in enumerate(g.stores):
            for role in ("master", "compute", "reduce"):
                buf = getattr(store, role)
                for attr in ("local", "local_grad", "_global", "_grad_global"):
                    t = getattr(buf, attr)
                    name = f"{mod_name or 'root'}[{i}].{role}.{attr}"
                    if key(t) not in names:
                        names[key(t)] = name
                        rec.track(t, name)
    return names


@contextlib.contextmanager
def install(rec: RecordingStreams) -> Iterator[None]:
    """Route roots' streams to ``rec`` and record the stores' collectives, allocations
    and frees on its current stream (the library's functions wrapped for the block)."""
    from vefsdp_optim._fsdp import _grads, _store
    from vefsdp_optim._fsdp._streams import streams_factory
    from vefsdp_optim.comm import _buffer
    from vefsdp_optim.comm._buffer import DistributedBuffer

    saved = {
        (_buffer, "all_gather_flat"): _buffer.all_gather_flat,
        (_buffer, "reduce_scatter_flat"): _buffer.reduce_scatter_flat,
        (_grads, "all_reduce_avg"): _grads.all_reduce_avg,
        (_grads, "_ensure_storage"): _grads._ensure_storage,
        (_grads, "_release_storage"): _grads._release_storage,
        (_store, "_release_storage"): _store._release_storage,
        (DistributedBuffer, "_alloc"): DistributedBuffer.__dict__["_alloc"],
        (DistributedBuffer, "_free"): DistributedBuffer.__dict__["_free"],
    }

    def collective(name: str, fn, out_first: bool):  # noqa: ANN001, ANN202
        def wrapped(output, input, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202, A002
            rec.access(name, [input], [output])
            with rec.paused_mode():
                return fn(output, input, *a, **k)
        return wrapped

    def all_reduce_avg(t, group):  # noqa: ANN001, ANN202
        rec.access("all_reduce", [t], [t])
        with rec.paused_mode():
            return saved[(_grads, "all_reduce_avg")](t, group)

    def ensure(t):  # noqa: ANN001, ANN202
        if t.untyped_storage().nbytes() < t.numel() * t.element_size():
            rec.alloc(t)
        return saved[(_grads, "_ensure_storage")](t)

    def release(t):  # noqa: ANN001, ANN202
        if t.untyped_storage().nbytes():
            rec.free(t)
        return saved[(_grads, "_release_storage")](t)

    orig_alloc = saved[(DistributedBuffer, "_alloc")]
    orig_free = saved[(DistributedBuffer, "_free")].__func__

    def alloc(self, flat, zero):  # noqa: ANN001, ANN202
        n = self.plan.global_size
        if not (flat.numel() == n and flat.untyped_storage().nbytes() == n * flat.element_size()):
            rec.alloc(flat)
        return orig_alloc(self, flat, zero)

    def free(flat):  # noqa: ANN001, ANN202
        if flat.untyped_storage().nbytes():
            rec.free(flat)
        return orig_free(flat)

    _buffer.all_gather_flat = collective("all_gather", saved[(_buffer, "all_gather_flat")], True)
    _buffer.reduce_scatter_flat = collective("reduce_scatter", saved[(_buffer, "reduce_scatter_flat")], True)
    _grads.all_reduce_avg = all_reduce_avg
    _grads._ensure_storage = ensure
    _grads._release_storage = release
    _store._release_storage = release
    DistributedBuffer._alloc = alloc
    DistributedBuffer._free = staticmethod(free)
    try:
        with streams_factory(lambda device: rec):
            yield
    finally:
        for (owner, name), value in saved.items():
            setattr(owner, name, value)
