"""Shampoo step time and state memory against AdamW, one process, CPU.

    python -m benchmarks.bench_shampoo [--quick|--full] [--out benchmarks/out/shampoo.json]

A small set of plain fp32 parameters (256x256 .. 512x1024 matrices and a bias), the
same gradients every step. Per optimizer, after one warm-up step (state allocation and,
for Shampoo, the first inverse roots):

- step time: median and mean over the timed steps (quick 10, full 40), the optimizers'
  steps interleaved (full mode only: 10 for Shampoo at precondition_frequency 1, whose
  every step recomputes 2 roots per tile by a float64 eigendecomposition). At frequency
  20 the mean includes exactly one root recomputation in 20 steps; the median shows the
  ordinary step;
- state memory: bytes of every tensor in ``optimizer.state``, per parameter element.

Shampoo runs with start_preconditioning_step=1 (preconditioned from the first step) and
the default max_preconditioner_dim=1024, so every matrix here is one tile. Ratios to
torch.optim.AdamW (foreach) are what to read; absolute times on a shared machine mean
little.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import vefsdp_optim
from vefsdp_optim import Shampoo

from ._common import cli, current_device, paired_ratio, result, stats, synchronize

SHAPES = [(256, 256), (256, 512), (512, 512), (512, 1024), (512,)]


def _state_bytes(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_state_bytes(v) for v in state)
    return 0


def _setup(make: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
           ) -> tuple[list[nn.Parameter], torch.optim.Optimizer]:
    g = torch.Generator().manual_seed(0)
    dev = current_device()
    ps = [nn.Parameter(torch.randn(s, generator=g).to(dev)) for s in SHAPES]
    for p in ps:
        p.grad = (torch.randn(p.shape, generator=g) * 1e-2).to(dev)
    opt = make(ps)
    opt.step()  # warm-up: state allocation, first roots
    return ps, opt


def _bench(runs: dict[str, tuple[Callable[[list[nn.Parameter]], torch.optim.Optimizer], int]]) -> tuple[dict, dict]:
    """Steps of the optimizers interleaved round-robin, so that load from other
    processes on the machine falls on all of them alike."""
    setups = {name: _setup(make) for name, (make, _) in runs.items()}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for k in range(max(steps for _, steps in runs.values())):
        for name, (_, steps) in runs.items():
            if k >= steps:
                continue
            dev = setups[name][0][0].device
            synchronize(dev)
            t0 = time.perf_counter()
            setups[name][1].step()
            synchronize(dev)
            times[name].append(time.perf_counter() - t0)
    out = {}
    for name, (ps, opt) in setups.items():
        numel = sum(p.numel() for p in ps)
        state = sum(_state_bytes(opt.state[p]) for p in ps)
        out[name] = {
            "optimizer": name,
            "step_ms": stats(times[name], 1e3),
            "mean_ms": statistics.fmean(times[name]) * 1e3,
            "state_bytes": state,
            "state_bytes_per_param": state / numel,
        }
    return out, times


def run(quick: bool = True) -> dict:
    """Shampoo (frequency 20 and 1) and this library's AdamW against torch AdamW, one
    process on ``current_device()``."""
    t0 = time.perf_counter()
    steps = 10 if quick else 40
    runs: dict[str, tuple[Callable[[list[nn.Parameter]], torch.optim.Optimizer], int]] = {
        "torch_adamw": (lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.0), steps),
        "vefsdp_adamw": (lambda ps: vefsdp_optim.AdamW(ps, lr=1e-3, weight_decay=0.0), steps),
        "shampoo_freq20": (lambda ps: Shampoo(ps, lr=1e-3, precondition_frequency=20,
                                              start_preconditioning_step=1), steps),
    }
    if not quick:  # every step recomputes the roots (float64 eigh): slow, full mode only
        runs["shampoo_freq1"] = (lambda ps: Shampoo(ps, lr=1e-3, precondition_frequency=1,
                                                    start_preconditioning_step=1), 10)
    results, times = _bench(runs)
    base = times["torch_adamw"]
    rows = []
    for name, r in results.items():
        n = len(times[name])  # paired with the torch AdamW steps of the same rounds
        r["ratio_vs_torch_adamw"] = paired_ratio(times[name], base[:n])
        r["mean_ratio_vs_torch_adamw"] = r["mean_ms"] / (statistics.fmean(base) * 1e3)
        rows.append(r)
    by = {r["optimizer"]: r for r in rows}
    headline = [{"comparison": "Shampoo (freq 20) step / torch AdamW step, 1 process",
                 "ratio": by["shampoo_freq20"]["ratio_vs_torch_adamw"]},
                {"comparison": "Shampoo state bytes / torch AdamW state bytes",
                 "ratio": by["shampoo_freq20"]["state_bytes"] / by["torch_adamw"]["state_bytes"]}]
    notes = [f"{sum(math.prod(s) for s in SHAPES) / 1e6:.2f} M fp32 elements in {len(SHAPES)} tensors "
             f"on {current_device()}, {torch.get_num_threads()} intra-op threads; Shampoo with "
             "start_preconditioning_step=1, every matrix one tile; at frequency 20 the median is "
             "the ordinary step, the mean includes root recomputations"]
    return result("shampoo", rows, notes, headline=headline, shapes=SHAPES,
                  wall_s=time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> dict:
    return cli(run, "shampoo", argv)


if __name__ == "__main__":
    main()
