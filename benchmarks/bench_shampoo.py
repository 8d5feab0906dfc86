"""Shampoo step time and state memory against AdamW, one process, CPU.

    python -m benchmarks.bench_shampoo --out benchmarks/out/shampoo.json [--steps 40]

A small set of plain fp32 parameters (256x256 .. 512x1024 matrices and a bias), the
same gradients every step. Per optimizer, after one warm-up step (state allocation and,
for Shampoo, the first inverse roots):

- step time: median and mean over ``--steps`` steps, the optimizers' steps interleaved (``--steps-freq1`` for Shampoo at
  precondition_frequency 1, whose every step recomputes 2 roots per tile by a float64
  eigendecomposition). At frequency 20 the mean includes exactly one root recomputation
  in 20 steps; the median shows the ordinary step;
- state memory: bytes of every tensor in ``optimizer.state``, per parameter element.

Shampoo runs with start_preconditioning_step=1 (preconditioned from the first step) and
the default max_preconditioner_dim=1024, so every matrix here is one tile. Ratios to
torch.optim.AdamW (foreach) are what to read; absolute times on a shared machine mean
little.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import vefsdp_optim
from vefsdp_optim import Shampoo

SHAPES = [(256, 256), (256, 512), (512, 512), (512, 1024), (512,)]


def _state_bytes(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_state_bytes(v) for v in state)
    return 0


def _setup(make: Callable[[list[nn.Parameter]], torch.optim.Optimizer]) -> tuple[list[nn.Parameter], torch.optim.Optimizer]:
    g = torch.Generator().manual_seed(0)
    ps = [nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g) * 1e-2
    opt = make(ps)
    opt.step()  # warm-up: state allocation, first roots
    return ps, opt


def _bench(runs: dict[str, tuple[Callable[[list[nn.Parameter]], torch.optim.Optimizer], int]]) -> dict[str, dict[str, float]]:
    """Steps of the optimizers interleaved round-robin, so that load from other
    processes on the machine falls on all of them alike."""
    setups = {name: _setup(make) for name, (make, _) in runs.items()}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for k in range(max(steps for _, steps in runs.values())):
        for name, (_, steps) in runs.items():
            if k >= steps:
                continue
            t0 = time.perf_counter()
            setups[name][1].step()
            times[name].append(time.perf_counter() - t0)
    out = {}
    for name, (ps, opt) in setups.items():
        numel = sum(p.numel() for p in ps)
        state = sum(_state_bytes(opt.state[p]) for p in ps)
        out[name] = {
            "median_ms": statistics.median(times[name]) * 1e3,
            "mean_ms": statistics.fmean(times[name]) * 1e3,
            "steps": len(times[name]),
            "state_bytes": state,
            "state_bytes_per_param": state / numel,
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/out/shampoo.json")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--steps-freq1", type=int, default=10)
    args = ap.parse_args()

    runs: dict[str, tuple[Callable[[list[nn.Parameter]], torch.optim.Optimizer], int]] = {
        "torch_adamw": (lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.0), args.steps),
        "vefsdp_adamw": (lambda ps: vefsdp_optim.AdamW(ps, lr=1e-3, weight_decay=0.0), args.steps),
        "shampoo_freq20": (lambda ps: Shampoo(ps, lr=1e-3, precondition_frequency=20,
                                              start_preconditioning_step=1), args.steps),
        "shampoo_freq1": (lambda ps: Shampoo(ps, lr=1e-3, precondition_frequency=1,
                                             start_preconditioning_step=1), args.steps_freq1),
    }
    results = _bench(runs)
    base = results["torch_adamw"]["median_ms"]
    for name, r in results.items():
        r["median_vs_torch_adamw"] = r["median_ms"] / base
        r["mean_vs_torch_adamw"] = r["mean_ms"] / results["torch_adamw"]["mean_ms"]
        print(f"{name:16s} median {r['median_ms']:9.2f} ms  mean {r['mean_ms']:9.2f} ms  "
              f"x{r['median_vs_torch_adamw']:7.2f} (median vs torch AdamW)  "
              f"state {r['state_bytes_per_param']:6.2f} B/param")
    out = {
        "shapes": SHAPES,
        "numel": sum(math.prod(s) for s in SHAPES),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "results": results,
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
