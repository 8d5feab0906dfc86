"""Planner benchmark on real model shapes: padding against the bound and FSDP2, and time.

    python -m benchmarks.bench_planner [--quick|--full] [--out benchmarks/out/planner.json]

For each group of ``benchmarks.model_shapes`` (one fully_shard unit), world size and
requirement kind, plans the group with align 16 and reports padding as a percentage of
the group's numel, the lower bound (``padding_lower_bound``), what FSDP2 pads for the
same tensors (``fsdp2_row_padding``: dim 0 of each padded to a multiple of W) and the
median planning time with the planner's cache cleared before each run. Then times
planning a whole 80-layer LLaMA-3-70B (82 groups) at W = 10,000.
"""

from __future__ import annotations

import math
import statistics
import time

from vefsdp_optim.sharding import TensorSpec, fsdp2_row_padding, plan_buffer
from vefsdp_optim.sharding._planner import _plan_cached

from ._common import cli, result, stats
from .model_shapes import GROUPS, UNIT_KINDS, ParamShape, llama3_70b_model, unit_for

WORLDS = (8, 64, 512, 1024, 10_000)
QUICK_WORLDS = (8, 1024, 10_000)
ALIGN = 16
MODEL_WORLD = 10_000


def _specs(group: list[ParamShape], kind: str) -> list[TensorSpec]:
    return [TensorSpec(p.name, p.shape, unit_for(p, kind)) for p in group]


def _time_plan(specs: list[TensorSpec], w: int, repeats: int):
    times, plan = [], None
    for _ in range(repeats):
        _plan_cached.cache_clear()
        t0 = time.perf_counter()
        plan = plan_buffer(specs, w, ALIGN)
        times.append(time.perf_counter() - t0)
    return plan, statistics.median(times)


def bench_groups(repeats: int, worlds: tuple[int, ...] = WORLDS) -> list[dict]:
    rows = []
    for gname, make in GROUPS.items():
        group = make()
        n = sum(math.prod(p.shape) for p in group)
        fsdp2 = {w: fsdp2_row_padding([p.shape for p in group], w) for w in worlds}
        for kind in UNIT_KINDS:
            specs = _specs(group, kind)
            for w in worlds:
                plan, t = _time_plan(specs, w, repeats)
                rows.append(dict(
                    group=gname, tensors=len(group), numel=n, world=w, unit=kind,
                    shard_size=plan.shard_size, padding=plan.padding,
                    padding_pct=100 * plan.padding / n, lower_bound=plan.lower_bound,
                    lower_bound_pct=100 * plan.lower_bound / n,
                    fsdp2_padding=fsdp2[w], fsdp2_padding_pct=100 * fsdp2[w] / n,
                    align_only=_align_only(n, w, kind),
                    plan_ms=1e3 * t))
    return rows


def _align_only(n: int, w: int, kind: str) -> int:
    """Padding that alignment alone forces: W * round_up(ceil(N / W), a) - N, where a is
    align, or lcm(align, block) for flat blocks (a tensor spanning three or more ranks
    needs m to be a multiple of its unit)."""
    k, arg = UNIT_KINDS[kind]
    a = math.lcm(ALIGN, arg) if k == "flat" else ALIGN
    m = -(-n // w)
    return w * (-(-m // a) * a) - n


def bench_model(repeats: int) -> list[dict]:
    groups = llama3_70b_model()
    out = []
    for kind in UNIT_KINDS:
        spec_groups = [_specs(g, kind) for g in groups]
        times: list[float] = []
        pad = total = 0
        for _ in range(repeats):
            _plan_cached.cache_clear()
            t0 = time.perf_counter()
            plans = [plan_buffer(s, MODEL_WORLD, ALIGN) for s in spec_groups]
            times.append(time.perf_counter() - t0)
            pad = sum(p.padding for p in plans)
            total = sum(p.total_numel for p in plans)
        out.append(dict(model="llama3-70b", groups=len(groups), world=MODEL_WORLD, unit=kind,
                        numel=total, padding=pad, padding_pct=100 * pad / total,
                        plan_s=stats(times)))
    return out


def _goals(rows: list[dict], model_rows: list[dict]) -> list[str]:
    notes = []
    fine = [r for r in rows if r["unit"] in ("elementwise", "flat256")]
    over = [r for r in fine if r["padding"] > r["align_only"]]
    notes.append(f"elementwise/flat256 groups padding no more than align needs: "
                 f"{len(fine) - len(over)}/{len(fine)}"
                 + (f" (over: {[(r['group'], r['world'], r['unit']) for r in over]})" if over else ""))
    off = [r for r in rows if r["padding"] > r["lower_bound"]]
    notes.append(f"plans above the lower bound: {len(off)}/{len(rows)}"
                 + "".join(f"\n  {r['group']} W={r['world']} {r['unit']}: "
                           f"{r['padding_pct']:.3f}% vs bound {r['lower_bound_pct']:.3f}%"
                           for r in off))
    big = [r for r in rows if r["padding_pct"] > 5]
    for r in big:
        notes.append(f"large padding: {r['group']} W={r['world']} {r['unit']}: "
                     f"{r['padding_pct']:.1f}% (bound {r['lower_bound_pct']:.1f}%): the group "
                     f"has fewer legal pieces than ranks; plan several layers as one group")
    slow = max(model_rows, key=lambda r: r["plan_s"]["median"])
    t = slow["plan_s"]["median"]
    notes.append(f"whole-model planning at W={MODEL_WORLD}: worst {t:.3f} s "
                 f"({slow['unit']}); goal < 1 s: {'met' if t < 1 else 'MISSED'}")
    return notes


_COLUMNS = ("group", "world", "unit", "shard_size", "padding_pct", "lower_bound_pct",
            "fsdp2_padding_pct", "plan_ms")


def run(quick: bool = True) -> dict:
    """Padding and planning time per group, kind and W (quick: W in QUICK_WORLDS, one
    timing each; full: every W of WORLDS, 5 timings), and whole-model planning at
    W = 10,000. No processes, no collectives: the planner is pure."""
    t0 = time.perf_counter()
    rows = bench_groups(1 if quick else 5, QUICK_WORLDS if quick else WORLDS)
    model_rows = bench_model(1 if quick else 3)
    table = [{k: r[k] for k in _COLUMNS} for r in rows]
    return result("planner", table, _goals(rows, model_rows), model_rows=model_rows,
                  align=ALIGN, groups_detail=rows, wall_s=time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> dict:
    return cli(run, "planner", argv)


if __name__ == "__main__":
    main()
