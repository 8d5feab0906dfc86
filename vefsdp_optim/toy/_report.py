"""Checks, the summary table, and the files a toy run writes (CSV, JSON, PNG)."""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ._runner import RunResult, check_tolerance
from ._tasks import get_task

__all__ = [
    "CheckFailure",
    "curve_departure",
    "check_results",
    "format_table",
    "write_outputs",
]


@dataclass(frozen=True, slots=True)
class CheckFailure:
    """One failed ``--check``: which run, which check, and the numbers."""

    task: str
    optimizer: str
    sharding: str
    world_size: int
    check: str  # "reference" or "threshold"
    message: str

    def __str__(self) -> str:
        return (f"CHECK FAILED [{self.check}] {self.task}/{self.optimizer} "
                f"{self.sharding} W={self.world_size}: {self.message}")


def curve_departure(got: Sequence[float], want: Sequence[float]) -> tuple[float, int]:
    """Largest relative difference ``|got - want| / |want|`` of two loss curves, and its
    step; ``inf`` where the lengths differ or a value is not finite."""
    if len(got) != len(want):
        return math.inf, min(len(got), len(want))
    worst, at = 0.0, 0
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if not (math.isfinite(a) and math.isfinite(b)):
            return math.inf, i
        d = abs(a - b) / max(abs(b), 1e-12)
        if d > worst:
            worst, at = d, i
    return worst, at


def threshold_of(result: RunResult) -> float | None:
    """The --check threshold of a run, or None when it has fewer than the task's steps."""
    task = get_task(result.config.task)
    if result.floor is None or len(result.losses) < task.steps:
        return None
    return task.threshold(result.config.optimizer, result.floor)


def check_results(results: Sequence[RunResult],
                  references: Sequence[RunResult | None]) -> list[CheckFailure]:
    """Failures of the sharded-vs-reference and the loss-threshold checks.

    A run departs when its loss curve differs from the single-device reference of the
    same configuration by more than ``check_tolerance(optimizer, world_size)`` (relative,
    at any step). A run misses its threshold when its final loss is above
    ``floor + max_excess`` of the task; only runs of at least the task's default steps
    at its default learning rate are held to a threshold (see Task).
    """
    fails = []
    for res, ref in zip(results, references, strict=True):
        c = res.config
        where = dict(task=c.task, optimizer=c.optimizer, sharding=c.sharding,
                     world_size=res.world_size)
        if ref is not None:
            tol = check_tolerance(c.optimizer, res.world_size)
            d, step = curve_departure(res.losses, ref.losses)
            if not d <= tol:
                i = min(step, len(res.losses) - 1, len(ref.losses) - 1)
                fails.append(CheckFailure(
                    **where, check="reference",
                    message=(f"loss curve departs from the single-device reference by "
                             f"{d:.3g} relative at step {step} (tolerance {tol:g}): "
                             f"{res.losses[i]!r} vs {ref.losses[i]!r}")))
        thr = threshold_of(res)
        if thr is not None and c.lr is None and not res.final_loss <= thr:
            fails.append(CheckFailure(
                **where, check="threshold",
                message=(f"final loss {res.final_loss:.5g} is above the task threshold "
                         f"{thr:.5g} (floor {res.floor:.5g})")))
    return fails


def _fmt(x: float | None, digits: int = 4) -> str:
    if x is None:
        return "-"
    if not math.isfinite(x):
        return str(x)
    return f"{x:.{digits}f}" if abs(x) >= 10 ** -(digits - 1) or x == 0 else f"{x:.3g}"


def format_table(results: Sequence[RunResult]) -> str:
    """A plain-text table: one row per run."""
    head = ["task", "optimizer", "sharding", "W", "steps", "final loss", "floor", "threshold",
            "steps/s", "peak RSS/rank (MB)"]
    rows = []
    for r in results:
        c = r.config
        rss = "/".join(f"{m:.0f}" for m in r.peak_rss_mb) or "-"
        rows.append([c.task, c.optimizer, c.sharding, str(r.world_size), str(len(r.losses)),
                     _fmt(r.final_loss), _fmt(r.floor), _fmt(threshold_of(r)),
                     f"{r.steps_per_s:.1f}", rss])
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h)
              for i, h in enumerate(head)]
    line = lambda cells: "  ".join(  # noqa: E731
        s.ljust(w) for s, w in zip(cells, widths, strict=True)).rstrip()
    out = [line(head), line(["-" * w for w in widths])]
    out += [line(row) for row in rows]
    return "\n".join(out)


def _rows(kind: str, results: Sequence[RunResult]) -> list[dict[str, Any]]:
    return [dict(run=kind, task=r.config.task, optimizer=r.config.optimizer,
                 sharding=r.config.sharding, world_size=r.world_size, step=i, loss=v)
            for r in results for i, v in enumerate(r.losses)]


def write_outputs(out_dir: str, results: Sequence[RunResult],
                  references: Sequence[RunResult | None] = (),
                  failures: Sequence[CheckFailure] = (), plot: bool = True) -> list[str]:
    """Write ``losses.csv``, ``results.json`` and (if matplotlib imports) ``loss_curves.png``
    into ``out_dir``; returns the paths written, and a note where the plot was skipped."""
    os.makedirs(out_dir, exist_ok=True)
    refs = [r for r in references if r is not None]
    written = []
    path = os.path.join(out_dir, "losses.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["run", "task", "optimizer", "sharding", "world_size",
                                          "step", "loss"])
        w.writeheader()
        w.writerows(_rows("main", results) + _rows("reference", refs))
    written.append(path)
    path = os.path.join(out_dir, "results.json")
    summary = []
    for r in results:
        d = r.to_json()
        d["threshold"] = threshold_of(r)
        summary.append(d)
    with open(path, "w") as f:
        json.dump({"runs": summary, "references": [r.to_json() for r in refs],
                   "failures": [str(x) for x in failures]}, f, indent=1)
    written.append(path)
    if plot:
        written.append(plot_curves(os.path.join(out_dir, "loss_curves.png"), results))
    return written


def plot_curves(path: str, results: Sequence[RunResult]) -> str:
    """One panel per task: every run's loss above the floor per step (log scale; the loss
    itself where the floor is unknown), as a moving average of 10 steps. Returns ``path``,
    or a one-line note when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ("loss_curves.png skipped: matplotlib is not installed "
                "(pip install 'vefsdp-optim[plot]')")
    tasks = list(dict.fromkeys(r.config.task for r in results))
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4.2), squeeze=False)
    k = 10  # moving average: stochastic batches stay readable
    for ax, task in zip(axes[0], tasks, strict=True):
        runs = [r for r in results if r.config.task == task]
        floor = runs[0].floor
        several = len({(x.config.sharding, x.world_size) for x in runs}) > 1
        for r in runs:
            ys = [sum(r.losses[max(0, i - k + 1): i + 1]) / min(k, i + 1)
                  for i in range(len(r.losses))]
            if floor is not None:
                ys = [max(y - floor, 1e-5) for y in ys]
            label = f"{r.config.optimizer}  {r.final_loss:.4f}"
            if several:
                label += f" ({r.config.sharding}, W={r.world_size})"
            ax.plot(range(len(ys)), ys, label=label, lw=1.3)
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("loss - floor" if floor is not None else "loss")
        r0 = runs[0]
        floor_s = f", floor {floor:.4g}" if floor is not None else ""
        ax.set_title(f"{task} ({r0.config.sharding}, W={r0.world_size}{floor_s})", fontsize=10)
        ax.legend(fontsize=8, title="final loss", title_fontsize=8)
        ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
