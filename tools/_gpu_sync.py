"""Host-device syncs inside an optimizer's step, found where they happen.

[Note: sync watch]
On CUDA, ``torch.cuda.set_sync_debug_mode`` makes torch report each synchronizing call
(``.item()``, ``nonzero``, ``torch.equal``, ``bool()`` of a device tensor, a blocking
device-to-host copy). ``SyncWatch`` uses its "warn" mode with the warnings recorded: the
step runs to the end, so it can still be compared bit for bit, and each warning carries
the Python line that made the call (torch raises it in the frame that called the op).
``strict_step`` runs one step under "error" mode, as a user with that mode set would,
and reports the first sync and its line. On the CPU (the dry run) nothing synchronizes;
there the suite's ``SyncRecorder`` (tests/test_no_host_sync.py) records the ops that
would on a GPU, every tensor counting as a device tensor except the optimizer's host
scalars (its step counters), with the same reports, so the driver's logic is tested without a GPU. A
sync inside one torch kernel (``torch.linalg.eigh``'s error check on CUDA) is seen on a
GPU only.
"""

from __future__ import annotations

import sys
import traceback
import warnings
from types import TracebackType

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tools._checkout import ROOT

__all__ = ["SyncWatch", "strict_step"]

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


def _recorder(opt: torch.optim.Optimizer) -> TorchDispatchMode:
    """The suite's CPU recorder of would-be syncs, ``opt``'s host scalars (its step
    counters, a CPU tensor learning rate) exempt."""
    tests = str(ROOT / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    from test_no_host_sync import SyncRecorder, host_scalars

    return SyncRecorder(host_scalars(opt))


class SyncWatch:
    """Records the syncs made inside the ``with`` block by ``opt``'s step ([Note: sync
    watch]): ``events``, one ``"path:line"`` (CUDA) or ``"op at path:line (code)"`` (CPU)
    per sync."""

    def __init__(self, device: str, opt: torch.optim.Optimizer) -> None:
        self.device = torch.device(device).type
        self.opt = opt
        self.events: list[str] = []

    def __enter__(self) -> SyncWatch:
        if self.device == "cuda":
            self._prev = torch.cuda.get_sync_debug_mode()
            self._catch = warnings.catch_warnings(record=True)
            self._log = self._catch.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        else:
            self._mode = _recorder(self.opt)
            self._mode.__enter__()
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        if self.device == "cuda":
            torch.cuda.set_sync_debug_mode(self._prev)
            self._catch.__exit__(et, e, tb)
            for w in self._log:
                # torch's sync warning; not its one-time notice on entering the mode
                # ("Synchronization debug mode is a prototype feature ..."), which a
                # first watched step would otherwise report as a sync at the mode switch
                if "called a synchronizing" in str(w.message):
                    self.events.append(_where(w.filename, w.lineno))
                else:  # not ours to swallow
                    warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        else:
            self._mode.__exit__(et, e, tb)
            self.events += self._mode.found


def strict_step(device: str, opt: torch.optim.Optimizer) -> str:
    """``opt.step()`` under ``torch.cuda.set_sync_debug_mode("error")``: ``"ok"``, or the
    error and the line that synced. On the CPU, the step under the recorder: ``"ok"`` or
    the first op that would sync."""
    if torch.device(device).type != "cuda":
        with _recorder(opt) as rec:
            opt.step()
        return "ok" if not rec.found else f"would sync: {rec.found[0]}"
    prev = torch.cuda.get_sync_debug_mode()
    try:
        torch.cuda.set_sync_debug_mode("error")
        opt.step()
        return "ok"
    except RuntimeError as e:
        frames = [(f.filename, f.lineno or 0) for f in reversed(traceback.extract_tb(e.__traceback__))]
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200]} (at {_library_frame(frames)})"
    finally:
        torch.cuda.set_sync_debug_mode(prev)
