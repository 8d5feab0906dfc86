"""The streams of fully_shard's collectives, and when a buffer may be freed across them.

``Streams`` is the small per-device interface the shard groups use: the current
(compute) stream, four side streams (FSDP2's all-gather copy-in, all-gather,
reduce-scatter and all-reduce streams), events, and waits. Its CPU form
(``NO_STREAMS``) has no streams: every call is a no-op, so the CPU code path is the
same code, with the same collectives and the same bits. ``DeviceStreams`` is the
accelerator form (``torch.get_device_module(device)``). ``CommContext`` is the state a
root's shard groups share: the streams, the all-gather buffers waiting to be freed,
the events the final callback waits on, and the post-optimizer event.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

__all__ = ["Streams", "DeviceStreams", "NO_STREAMS", "CommContext", "streams_for",
           "set_streams_factory",
           "check_event", "check_stream", "streams_factory"]


class _Releasable(Protocol):
    """What a pending free holds: a shard group (_group.py), which frees its gathered
    buffers on ``release_buffers``."""

    def release_buffers(self) -> None: ...


# [Note: fully_shard streams]
# On an accelerator the module's compute runs on the current stream, as in FSDP2. Each
# collective of a shard group runs on its own stream. The all-gather casts into
# param_dtype and allocates its W*m buffer on the copy-in stream, then runs on the
# all-gather stream. The reduce-scatter runs with the division, the cast into the
# master's dtype and the kept-gradient sum. HSDP's all-reduce and the all-reduce hook
# each have a stream too. Two rules keep this correct.
#  - Producer and consumer. A tensor written on one stream is read on another only after
#    the reader's stream waits on an event recorded after the write. The pairs are: the
#    cast, then the all-gather (wait_stream); the gathered buffer, then compute
#    (wait_unshard); the gradients, then the reduce-scatter (wait_stream); its output,
#    then the all-reduce or hook stream, then compute. That last wait is the post-reduce
#    event, waited on in the root's final callback before the optimizer reads .grad.
#    The optimizer's writes come before the first all-gathers of the next forward, by
#    the post-optim event or else the stream, in the root's pre-forward.
#  - Freeing. A buffer is allocated on one stream: a gathered buffer on the copy-in
#    stream, gradient buffers on the current stream. The caching allocator hands its
#    block to later work of that stream only. So its storage is resized to 0 only after
#    that stream has waited on an event recorded after its last use on any other stream,
#    with no record_stream. A gathered buffer resharded by a hook stays allocated, with
#    the event of its reshard, until the all-gather after next (``CommContext.free``).
#    Module i + 1's all-gather overlaps module i's compute, and at most two gathered
#    buffers are in flight. A reduce-scatter's input is freed when the current stream has
#    waited on its collective, at the next shard group's post-backward.
# On the CPU there are no streams, and every buffer is freed when resharded.


class Streams:
    """No streams: the CPU form, every call a no-op (``NO_STREAMS``). The interface of
    [Note: fully_shard streams]; a stream argument of None means the current stream."""

    active = False
    copy_in: Any = None
    all_gather: Any = None
    reduce_scatter: Any = None
    all_reduce: Any = None

    def current(self) -> Any:
        return None

    def use(self, stream: Any) -> contextlib.AbstractContextManager[None]:
        """Make ``stream`` current inside the block (None: leave the current stream)."""
        return contextlib.nullcontext()

    def record(self, stream: Any) -> Any:
        """An event recorded on ``stream`` now (None when there are no streams)."""
        return None

    def wait_event(self, stream: Any, event: Any) -> None:
        """Work issued on ``stream`` from now on runs after ``event``."""

    def wait_stream(self, consumer: Any, producer: Any) -> None:
        """Work issued on ``consumer`` from now on runs after the work issued so far on
        ``producer``."""

    def query(self, event: Any) -> bool:
        """Whether ``event`` has completed, asked without waiting (no event: True)."""
        return True

    def synchronize(self) -> None:
        """The host waits for the work issued so far on the current stream."""

    def synchronize_event(self, event: Any) -> None:
        """The host waits for ``event`` (None: nothing to wait for)."""


NO_STREAMS = Streams()


class DeviceStreams(Streams):
    """The streams of one accelerator (``torch.get_device_module(device)``)."""

    active = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._module = torch.get_device_module(device)
        high = -1  # as FSDP2: copies around the collectives are not delayed behind compute
        self.copy_in = self._stream(high)
        self.all_gather = self._stream(high)
        self.reduce_scatter = self._stream(high)
        self.all_reduce = self._stream(0)

    def _stream(self, priority: int) -> Any:
        try:
            return self._module.Stream(device=self.device, priority=priority)
        except TypeError:  # a backend whose Stream takes no priority
            return self._module.Stream(device=self.device)

    def current(self) -> Any:
        return self._module.current_stream(self.device)

    def use(self, stream: Any) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext() if stream is None else self._module.stream(stream)

    def record(self, stream: Any) -> Any:
        return (self.current() if stream is None else stream).record_event()

    def wait_event(self, stream: Any, event: Any) -> None:
        if event is not None:
            (self.current() if stream is None else stream).wait_event(event)

    def wait_stream(self, consumer: Any, producer: Any) -> None:
        consumer = self.current() if consumer is None else consumer
        producer = self.current() if producer is None else producer
        if consumer != producer:
            consumer.wait_stream(producer)

    def query(self, event: Any) -> bool:
        return event is None or bool(event.query())

    def synchronize(self) -> None:
        self.current().synchronize()

    def synchronize_event(self, event: Any) -> None:
        if event is not None:
            event.synchronize()


def _default_factory(device: torch.device) -> Streams:
    return NO_STREAMS if device.type in ("cpu", "meta") else DeviceStreams(device)


_factory: Callable[[torch.device], Streams] = _default_factory


def streams_for(device: torch.device) -> Streams:
    """The streams of a root whose shard groups live on ``device`` (CPU: none)."""
    return _factory(device)


def set_streams_factory(
        factory: Callable[[torch.device], Streams] | None) -> Callable[[torch.device], Streams]:
    """Replace how roots get their streams (None: the default); returns the previous
    factory. For tests, which inject a recording implementation on the CPU."""
    global _factory
    previous, _factory = _factory, (factory or _default_factory)
    return previous


def check_event(event: object) -> None:
    if not all(hasattr(event, a) for a in ("query", "synchronize", "record")):
        raise TypeError("event must be a torch.Event (e.g. torch.cuda.Event, recorded after "
                        f"the optimizer step), got {event!r}")


def check_stream(stream: object) -> None:
    if not all(hasattr(stream, a) for a in ("wait_event", "wait_stream", "record_event")):
        raise TypeError("stream must be a torch.Stream (e.g. torch.cuda.Stream) or None, "
                        f"got {stream!r}")


class CommContext:
    """What a root's shard groups share for [Note: fully_shard streams]."""

    def __init__(self, streams: Streams) -> None:
        self.streams = streams
        # gathered buffers resharded by a hook and not yet freed: (shard group, event of
        # the reshard on the current stream), oldest first
        self.pending_free: list[tuple[_Releasable, Any]] = []
        # (post-reduce event, what to release once the current stream waited on it)
        # True where the host must wait for it too: an offloaded store's device-to-host
        # copy (see ``DtypeStore`` in vefsdp_optim/_fsdp/_store.py)
        self.post_reduce: list[tuple[Any, Callable[[], None], bool]] = []
        self.post_optim_event: Any = None  # FSDPModule.set_post_optim_event

    @property
    def active(self) -> bool:
        return self.streams.active

    def begin_forward(self) -> None:
        """The root's pre-forward: the all-gather streams wait for the optimizer step
        (the post-optim event if one was set, else the current stream), as FSDP2."""
        s, event = self.streams, self.post_optim_event
        self.post_optim_event = None
        for stream in (s.copy_in, s.all_gather):
            if event is not None:
                s.wait_event(stream, event)
            else:
                s.wait_stream(stream, None)

    def gather_streams_wait(self, event: Any) -> None:
        """The copy-in and all-gather streams wait on ``event`` (None: on the current stream)."""
        s = self.streams
        for stream in (s.copy_in, s.all_gather):
            if event is None:
                s.wait_stream(stream, None)
            else:
                s.wait_event(stream, event)

    def free(self, shard_group: _Releasable) -> None:
        """A hook's reshard of a buffer gathered on the side streams: freed later, at the
        all-gather after next ([Note: fully_shard streams])."""
        self.pending_free.append((shard_group, self.streams.record(None)))

    def take_pending(self, shard_group: _Releasable) -> Any:
        """Remove ``shard_group``'s pending free (it is gathered again into the same
        buffer); returns its event, or None when it had none."""
        for i, (g, event) in enumerate(self.pending_free):
            if g is shard_group:
                del self.pending_free[i]
                return event
        return None

    def release(self, keep: int = 0) -> None:
        """Free the pending buffers but the ``keep`` newest, after the streams that
        allocated them wait on their reshard events."""
        while len(self.pending_free) > keep:
            shard_group, event = self.pending_free.pop(0)
            self.gather_streams_wait(event)
            shard_group.release_buffers()

    def add_post_reduce(self, event: Any, release: Callable[[], None], host: bool = False) -> None:
        self.post_reduce.append((event, release, host))

    def finish_backward(self) -> None:
        """The root's final callback: the current stream waits on every reduction's last
        event (the optimizer reads .grad next); their staging buffers are then released.
        The host waits only on the events of offloaded reductions, as FSDP2 on its offload
        events: the optimizer reads those gradients on the host next; a backward without
        a reduction (no sync) waits for nothing."""
        pending, self.post_reduce = self.post_reduce, []
        for event, release, host in pending:
            self.streams.wait_event(None, event)
            if host:
                self.streams.synchronize_event(event)
            release()

    def reset(self) -> None:
        """FSDPModule.reset_iter_state: wait for and release everything in flight."""
        self.finish_backward()
        self.release()


@contextlib.contextmanager
def streams_factory(factory: Callable[[torch.device], Streams]) -> Iterator[None]:
    """``set_streams_factory`` for a block."""
    previous = set_streams_factory(factory)
    try:
        yield
    finally:
        set_streams_factory(previous)
