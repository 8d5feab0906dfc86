"""The host's count of a capturable state's steps, for the decisions a step takes on the host."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["HostStepCounts", "ReplayCounting"]


class HostStepCounts:
    """Per capturable state, how many steps its device step count has taken, kept on the
    host so that the step never reads the device count back ([Note: capturable steps] in
    _capturable.py): SOAP and Shampoo decide from it when to refresh their
    preconditioners. It counts the optimizer's ``step()`` calls (a replay of a captured
    graph advances the device count alone, :meth:`add` counts replays); :meth:`rederive`
    sets it again from the device counts (a host read, at load time)."""

    def __init__(self) -> None:
        self._counts: dict[int, tuple[torch.Tensor, int]] = {}  # id(step tensor) -> (it, count)

    def start(self, step: torch.Tensor, count: int = 0) -> None:
        """Count the steps of ``step`` (a state's 0-d device step count) from ``count``."""
        self._counts[id(step)] = (step, count)

    def advance(self, step: torch.Tensor) -> int:
        """The count after this step (the caller then adds 1 to ``step`` on the device). A
        count this object never saw (a state built or loaded elsewhere) is read once."""
        entry = self._counts.get(id(step))
        count = entry[1] if entry is not None and entry[0] is step else int(step.item())
        self._counts[id(step)] = (step, count + 1)
        return count + 1

    def add(self, n: int) -> None:
        """Add ``n`` to every count (``n`` replays of a captured step)."""
        self._counts = {k: (step, count + n) for k, (step, count) in self._counts.items()}

    def rederive(self, steps: Iterable[Any]) -> None:
        """Forget every count and take each tensor of ``steps`` as it is (a host read)."""
        self._counts.clear()
        for step in steps:
            if isinstance(step, torch.Tensor):
                self.start(step, int(step.item()))


class ReplayCounting:
    """``count_replays`` of an optimizer that keeps ``_host_steps`` (SOAP, Shampoo)."""

    _host_steps: HostStepCounts

    def count_replays(self, n: int = 1) -> None:
        """Count ``n`` replays of a captured step (``capturable=True``) in the host's step
        counts, which decide when the preconditioners are refreshed: without this, the
        refreshes follow ``step()`` calls alone ([Note: capturable steps]). The ``step()``
        call a graph captured counts once, for its first replay: count the others::

            with torch.cuda.graph(graph):
                opt.step()  # counted: the step of the first replay
            graph.replay()
            ...
            graph.replay()
            opt.count_replays()
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be an int >= 0, got {n!r}")
        self._host_steps.add(n)
