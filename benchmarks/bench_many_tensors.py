"""The step's cost per parameter: many small parameters, one process, one intra-op thread.

    python -m benchmarks.bench_many_tensors [--quick|--full] [--out benchmarks/out/many_tensors.json]

A model with hundreds or thousands of parameters (norms, biases, per-head or per-expert
weights) pays an optimizer's per-parameter cost on every step, on top of the
arithmetic. For K parameters of one shape (plain tensors, the same random
gradients fed to all, alternating order, medians; one intra-op thread):

- vefsdp_optim.AdamW against torch.optim.AdamW (foreach): the same arithmetic (ours
  runs torch's multi-tensor ops per bucket, op for op, with the step counts read in one
  stack: ``_multi_tensor_adam_host_steps_`` in vefsdp_optim/_math/_adam.py), so the ratio is our step loop's cost per
  parameter, less the per-tensor reads of torch's;
- vefsdp_optim.AdamW8bit against torch.optim.AdamW (foreach), at 4096 elements and
  more (the 8-bit threshold);
- the same two with the cyclic garbage collector left on during the step, so that the
  pause of [Note: no collection during a step] (vefsdp_optim/_step_loop.py) is
  measured alone, in the same run.

Each row gives the step's median and mean (a full collection every few steps moves the
mean, not the median; throughput is the mean), the mean's cost per parameter, the
paired ratio of medians to torch's step and the ratio of the means, and the collector's
collections per step (young, middle and full generation).
"""

from __future__ import annotations

import contextlib
import gc
import math
import statistics
import time
from typing import Any

import torch
from torch import nn

from ._common import cli, paired_ratio, result, stats

# (K, shape): K parameters of that shape (1-D: norms and biases; 2-D: weights)
CASES_QUICK = [(1000, (64,)), (1000, (8, 8)), (1000, (64, 64)), (200, (128, 128))]
CASES_FULL = [(1000, (64,)), (1000, (8, 8)), (300, (64,)), (1000, (4096,)), (1000, (64, 64)),
              (300, (64, 64)), (200, (128, 128)), (50, (256, 256))]


@contextlib.contextmanager
def _collector_on_during_steps():
    """The library's step with the collector left on (its state before the pause)."""
    import vefsdp_optim._block_optimizer as bo

    saved = getattr(bo, "gc_paused", None)
    if saved is None:  # a library without the pause
        yield
        return
    bo.gc_paused = contextlib.nullcontext
    try:
        yield
    finally:
        bo.gc_paused = saved


def _runs(k: int, shape: tuple[int, ...], reverse: bool = False,
          ) -> dict[str, tuple[list[nn.Parameter], torch.optim.Optimizer, bool]]:
    """name -> (params, optimizer, collector on during its step), built in this order, or
    in the reverse order (the dict keeps the first order either way)."""
    from vefsdp_optim import AdamW, AdamW8bit

    g = torch.Generator().manual_seed(0)
    init = [torch.randn(shape, generator=g) * 0.02 for _ in range(k)]
    e = math.prod(shape)

    makers: dict[str, tuple[Any, bool]] = {
        "torch.optim.AdamW (foreach)": (lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True), False),
        "vefsdp_optim.AdamW": (lambda ps: AdamW(ps, lr=1e-3), False),
        "vefsdp_optim.AdamW, collector on": (lambda ps: AdamW(ps, lr=1e-3), True),
    }
    if e >= 4096:
        makers["vefsdp_optim.AdamW8bit"] = (lambda ps: AdamW8bit(ps, lr=1e-3), False)
        makers["vefsdp_optim.AdamW8bit, collector on"] = (lambda ps: AdamW8bit(ps, lr=1e-3), True)
    built = {}
    for name in (list(makers)[::-1] if reverse else makers):
        ps = [nn.Parameter(t.clone()) for t in init]
        make, collector_on = makers[name]
        opt = make(ps)
        for p in ps:  # the state (made at the first step) next to its parameters, in build order
            p.grad = torch.zeros_like(p)
        opt.step()
        built[name] = (ps, opt, collector_on)
    return {name: built[name] for name in makers}


def bench_case(k: int, shape: tuple[int, ...], steps: int, warmup: int) -> list[dict]:
    """Half the steps with the runners built in one order, half in the reverse order
    ([Note: build order]); the per-step ratios pair steps within each half."""
    times: dict[str, list[float]] = {}
    collections: dict[str, list[int]] = {}
    for reverse in (False, True):
        _time_runs(_runs(k, shape, reverse), shape, steps - steps // 2 if reverse else steps // 2, warmup,
                   times, collections)
    names = list(times)
    base = times[names[0]]
    rows = []
    for name in names:
        mean = statistics.fmean(times[name])
        rows.append(dict(
            case=f"{k} x {tuple(shape)}", optimizer=name, step_ms=stats(times[name], 1e3), mean_ms=mean * 1e3,
            us_per_param=mean * 1e6 / k,
            ratio_vs_torch=paired_ratio(times[name], base),
            mean_ratio_vs_torch=mean / statistics.fmean(base),
            gc_per_step="/".join(f"{c / steps:.2f}" for c in collections[name])))
    return rows


# [Note: build order]
# Where a case's memory exceeds the caches (1000 x (64, 64): ~64 MB a runner), where a
# runner's parameters and moments land in memory moves its step by up to ~10% on the
# 2-core AMD machine: two copies of one optimizer built one after the other differed by
# 2-6% and torch's foreach AdamW built after ours ran 10% slower than built before it,
# in the same interleaved run. So each case runs half its steps with the runners built
# (parameters and moments: one untimed step each) in one order and half in the reverse
# order, and the ratios pair the steps within each half.


def _time_runs(runs: dict[str, tuple[list[nn.Parameter], torch.optim.Optimizer, bool]], shape: tuple[int, ...],
               steps: int, warmup: int, times: dict[str, list[float]], collections: dict[str, list[int]]) -> None:
    """Time ``steps`` interleaved steps of ``runs`` after ``warmup``, into ``times`` and
    ``collections`` (per runner name)."""
    names = list(runs)
    k = len(next(iter(runs.values()))[0])
    for n in names:
        times.setdefault(n, [])
        collections.setdefault(n, [0, 0, 0])
    g = torch.Generator().manual_seed(1)
    for step in range(warmup + steps):
        grads = [torch.randn(shape, generator=g) * 1e-3 for _ in range(k)]
        for name in names if step % 2 == 0 else names[::-1]:
            ps, opt, collector_on = runs[name]
            for p, gr in zip(ps, grads, strict=True):
                p.grad = gr
            ctx = _collector_on_during_steps() if collector_on else contextlib.nullcontext()
            with ctx:
                before = [s["collections"] for s in gc.get_stats()]
                t0 = time.perf_counter()
                opt.step()
                dt = time.perf_counter() - t0
                after = [s["collections"] for s in gc.get_stats()]
            if step >= warmup:
                times[name].append(dt)
                for i in range(3):
                    collections[name][i] += after[i] - before[i]


def run(quick: bool = True) -> dict:
    """Every case of the grid (quick: 4 cases, 18 timed steps; full: 8 cases, 40)."""
    t0 = time.perf_counter()
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    steps, warmup = (18, 2) if quick else (40, 3)
    rows: list[dict] = []
    try:
        for k, shape in CASES_QUICK if quick else CASES_FULL:
            rows += bench_case(k, shape, steps, warmup)
    finally:
        torch.set_num_threads(saved)
    headline = [{"comparison": f"{r['optimizer']} mean step / torch.optim.AdamW (foreach)'s, {r['case']}",
                 "ratio": r["mean_ratio_vs_torch"]}
                for r in rows if "collector on" not in r["optimizer"] and not r["optimizer"].startswith("torch")]
    notes = ["K parameters of one shape, plain tensors, one intra-op thread; the optimizers in alternating "
             "order; us_per_param from the mean step",
             "half the steps with the runners (parameters and moments) built in one order, half in the reverse "
             "order: where a case outgrows the caches, the build order alone moves a step by up to ~10% "
             "([Note: build order])",
             "gc_per_step: the cyclic collector's collections per step, generations 0/1/2",
             "'collector on': the same optimizer with the collector left on during its step ([Note: no "
             "collection during a step] undone, the rest of the library as it is)"]
    return result("many_tensors", rows, notes, headline=headline, wall_s=time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> dict:
    return cli(run, "many_tensors", argv)


if __name__ == "__main__":
    main()
