"""Host-device syncs inside an optimizer's step, found where they happen (issue 42, item 3).

[Note: sync watch]
On CUDA, ``torch.cuda.set_sync_debug_mode`` makes torch report each synchronizing call
(``.item()``, ``nonzero``, ``torch.equal``, ``bool()`` of a device tensor, a blocking
device-to-host copy). ``SyncWatch`` uses its "warn" mode with the warnings recorded: the
step runs to the end, so it can still be compared bit for bit, and each warning carries
the Python line that made the call (torch raises it in the frame that called the op).
``strict_step`` runs one step under "error" mode, as a user with that mode set would,
and reports the first sync and its line. On the CPU (the dry run) nothing synchronizes;
there a dispatch mode records the ops that would on a GPU (``SYNC_OPS``), with the same
reports, so the driver's logic is tested without a GPU. On the CPU that also counts a
read of a CPU scalar, which on CUDA would not sync.
"""

from __future__ import annotations

import sys
import traceback
import warnings
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tools._checkout import ROOT

__all__ = ["SYNC_OPS", "SyncWatch", "strict_step"]

SYNC_OPS = ("aten._local_scalar_dense", "aten.nonzero", "aten.equal", "aten.is_nonzero")
_LIBRARY = tuple(str(ROOT / d) + "/" for d in ("vefsdp_optim", "comm", "sharding"))


def _where(filename: str, lineno: int) -> str:
    return f"{filename[len(str(ROOT)) + 1:] if filename.startswith(str(ROOT) + '/') else filename}:{lineno}"


def _library_frame(frames: list[tuple[str, int]]) -> str:
    """The innermost frame in the library, else the innermost outside torch (frames
    innermost first)."""
    for fn, ln in frames:
        if fn.startswith(_LIBRARY):
            return _where(fn, ln)
    for fn, ln in frames:
        if "/torch/" not in fn and not fn.startswith(str(ROOT / "tools")):
            return _where(fn, ln)
    return _where(*frames[0]) if frames else "?"


def _stack() -> list[tuple[str, int]]:
    f, out = sys._getframe(2), []
    while f is not None:
        out.append((f.f_code.co_filename, f.f_lineno))
        f = f.f_back
    return out


class _RecordSyncs(TorchDispatchMode):
    """The CPU stand-in of the sync debug mode: ``SYNC_OPS`` recorded (or raised)."""

    def __init__(self, events: list[str], strict: bool) -> None:
        super().__init__()
        self.events, self.strict = events, strict

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        name = str(func.overloadpacket)
        if name in SYNC_OPS:
            where = _library_frame(_stack())
            if self.strict:
                raise RuntimeError(f"{name} would synchronize with the host")
            self.events.append(f"{where} {name}")
        return func(*args, **(kwargs or {}))


class SyncWatch:
    """Records the syncs made inside the ``with`` block ([Note: sync watch]): ``events``,
    one ``"path:line"`` (CUDA) or ``"path:line op"`` (CPU) per sync."""

    def __init__(self, device: str) -> None:
        self.device = torch.device(device).type
        self.events: list[str] = []

    def __enter__(self) -> SyncWatch:
        if self.device == "cuda":
            self._prev = torch.cuda.get_sync_debug_mode()
            self._catch = warnings.catch_warnings(record=True)
            self._log = self._catch.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        else:
            self._mode = _RecordSyncs(self.events, strict=False)
            self._mode.__enter__()
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        if self.device == "cuda":
            torch.cuda.set_sync_debug_mode(self._prev)
            self._catch.__exit__(et, e, tb)
            for w in self._log:
                if "synchroniz" in str(w.message):
                    self.events.append(_where(w.filename, w.lineno))
                else:  # not ours to swallow
                    warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        else:
            self._mode.__exit__(et, e, tb)


def strict_step(device: str, step: Callable[[], Any]) -> str:
    """``step()`` under ``torch.cuda.set_sync_debug_mode("error")`` (on the CPU, the
    dispatch mode that raises): ``"ok"``, or the error and the line that synced."""
    cuda = torch.device(device).type == "cuda"
    prev = torch.cuda.get_sync_debug_mode() if cuda else 0
    mode = None
    try:
        if cuda:
            torch.cuda.set_sync_debug_mode("error")
        else:
            mode = _RecordSyncs([], strict=True)
            mode.__enter__()
        step()
        return "ok"
    except RuntimeError as e:
        frames = [(f.filename, f.lineno or 0) for f in reversed(traceback.extract_tb(e.__traceback__))]
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200]} (at {_library_frame(frames)})"
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode(prev)
        elif mode is not None:
            mode.__exit__(None, None, None)
