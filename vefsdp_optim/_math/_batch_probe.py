"""Whether a batched kernel gives the per-matrix bits: a probe's answer, read without a
host sync on an accelerator.

Batched Newton-Schulz and NorMuon's batched normalization are taken only where a probe on
random data of the shape has shown them bit-identical to the per-matrix path (see
``newtonschulz_batch_exact`` in vefsdp_optim/_math/_newton_schulz.py,
``normuon_normalize_batched_`` in vefsdp_optim/_math/_normuon.py). On the CPU the probe
is host work, run once per key by the step that first meets it. On an accelerator,
reading the probe's verdict back at once would stall the host behind the device's queue
inside a step, so the answer is asynchronous: the first step that meets a key queues the
probe on the current stream, copies its 0-d verdict into pinned host memory without
blocking, and records an event; every call answers False (the per-matrix path) until a
later call finds the event complete (``query``: no wait) and reads the flag from host
memory. Both paths give the same bits where the answer is True, so the step's bits do not
depend on when the answer arrives, nor on which rank learned it first. Nothing is queued
under FakeTensorMode (fake tensors hold no values) or while a CUDA graph is being
captured (the probe would enter the graph); those calls answer from what is already
known. A probe that cannot be queued (an accelerator without events or pinned memory)
answers False for good. Why not a rule from host facts: docs/decisions.md (2026-11-28).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import Tensor

from .._torch_compat import FakeTensor

__all__ = ["batch_probe", "stream_capturing"]

_lock = threading.Lock()
_answers: dict[Hashable, bool] = {}  # key -> the probe's verdict
_pending: dict[Hashable, tuple[Any, Tensor]] = {}  # key -> (its event, the pinned 0-d bool flag)


def batch_probe(key: Hashable, device: torch.device, run: Callable[[], Tensor]) -> bool:
    """The verdict of ``run()`` (a 0-d bool tensor on ``device``: whether the batched
    kernel gave the per-matrix bits) for ``key``, run once per key: at once on the CPU;
    on another device False until the queued probe has finished (see the module docstring)."""
    ans = _answers.get(key)
    if ans is not None:
        return ans
    if device.type == "cpu":
        if _fake(device):  # fake tensors have no values to compare: unbatched, nothing learned
            return False
        ans = _answers[key] = bool(run())
        return ans
    with _lock:
        pend = _pending.get(key)
        if pend is not None:
            event, flag = pend
            if stream_capturing(device) or not event.query():
                return False
            del _pending[key]
            ans = _answers[key] = bool(flag)  # host memory the device has written
            return ans
        if _fake(device) or stream_capturing(device):
            return False
        try:
            verdict = run()
            flag = _host_flag()
            flag.copy_(verdict, non_blocking=True)
            event = _event(device)
            event.record()
        except Exception:  # noqa: BLE001 - no events or pinned memory here: never batch
            _answers[key] = False
            return False
        _pending[key] = (event, flag)
        return False


def _fake(device: torch.device) -> bool:
    """Whether FakeTensorMode is active (its factories make fake tensors)."""
    return isinstance(torch.empty(0, device=device), FakeTensor)


def stream_capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device`` is being captured into a CUDA graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _host_flag() -> Tensor:
    return torch.empty((), dtype=torch.bool, pin_memory=True)


def _event(device: torch.device) -> Any:
    return torch.Event(device=device)
