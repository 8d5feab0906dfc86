"""fully_shard + vefsdp_optim.AdamW against FSDP2 + torch.optim.AdamW over the Muon sweep's
dense shapes: a lead on one model is not a lead.

    python -m benchmarks.bench_fully_shard_sweep [--quick|--full] [--cases PATTERNS]

Models: ``count`` residual blocks, each holding one weight of the sweep's shape (no bias),
so the parameters are exactly the grid of ``bench_muon_sweep``'s dense families:

* square ``d x d``: ``x + gelu(x W^T)``;
* tall ``4d x d``: ``x + mean over 4 of gelu(x W^T)`` (the 4d outputs as 4 groups of d);
* wide ``d x 4d``: ``x + gelu([x, x, x, x] W^T)``;

plus a final norm and the mean square of the output as the loss; ``BATCH`` rows. Each
block and then the root are sharded, as FSDP2 scripts do. A step is forward, backward,
the optimizer's step and ``zero_grad``. Both systems start from the same weights, see
the same batches and alternate every step after a warm-up (``interleave``: a barrier
before each call, the slowest rank's time); the first losses are compared. A ratio is
the median (quartiles) of the per-step ratios ours / FSDP2; the summary holds their
geometric mean and worst case per world size (the goal: <= 0.85 on every shape).

Grid (``--full``): square, tall and wide at d = 64, 128, 256, 512, 1024 with 2, 4 and 16
blocks, on W = 2 and 4 gloo CPU ranks (90 cases). Quick: a fixed subset of the same grid
(``QUICK``). ``--cases`` takes fnmatch patterns on ``family:d:count:W``.
"""

from __future__ import annotations

import argparse
import fnmatch
import math
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from benchmarks._common import (
    current_device,
    interleave,
    machine_info,
    markdown_table,
    paired_ratio,
    result,
    spawn,
    stats,
    write_json,
)
from benchmarks.bench_fully_shard import (
    _build,  # blocks then the root, ours / FSDP2 with their AdamW
)

BATCH = 64
FAMILIES = ("square", "tall", "wide")
DIMS = (64, 128, 256, 512, 1024)
COUNTS = (2, 4, 16)
WORLDS = (2, 4)


@dataclass(frozen=True)
class Case:
    family: str
    d: int
    count: int
    world: int

    @classmethod
    def parse(cls, s: str) -> Case:
        f, d, c, w = s.split(":")
        return cls(f, int(d), int(c), int(w))

    @property
    def shape(self) -> tuple[int, int]:
        return {"square": (self.d, self.d), "tall": (4 * self.d, self.d), "wide": (self.d, 4 * self.d)}[self.family]

    @property
    def spec(self) -> str:
        return f"{self.family}:{self.d}:{self.count}:{self.world}"


QUICK = [Case.parse(s) for s in (
    "square:64:16:2", "square:256:4:2", "square:1024:2:2", "tall:128:16:2", "wide:512:2:2",
    "square:128:16:4", "wide:256:4:4", "tall:512:2:4")]


def full_grid() -> list[Case]:
    return [Case(f, d, c, w) for w in WORLDS for f in FAMILIES for d in DIMS for c in COUNTS]


class Block(nn.Module):
    def __init__(self, family: str, d: int) -> None:
        super().__init__()
        self.family = family
        shape = Case(family, d, 1, 1).shape
        self.weight = nn.Parameter(torch.randn(shape) / math.sqrt(shape[1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.family == "square":
            return x + F.gelu(x @ self.weight.T)
        if self.family == "tall":
            h = F.gelu(x @ self.weight.T)  # (B, 4d)
            return x + h.view(x.shape[0], 4, -1).mean(1)
        return x + F.gelu(x.repeat(1, 4) @ self.weight.T)


class Stack(nn.Module):
    def __init__(self, case: Case) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(case.family, case.d) for _ in range(case.count))
        self.norm = nn.LayerNorm(case.d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.layers:
            x = b(x)
        return self.norm(x).square().mean()


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> float:
    loss = model(x)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def _case_rank(case: Case, steps: int, warmup: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    device = current_device()
    torch.manual_seed(0)
    base = Stack(case)
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    data = torch.randn(steps + warmup + 2, BATCH, case.d, generator=g).to(device)
    systems = {s: _build(s, base, device) for s in ("ours", "fsdp2")}
    first = {s: _step(*systems[s], data[0]) for s in systems}
    it = {s: iter(range(1, data.shape[0])) for s in systems}
    runners = {s: (lambda s=s: _step(*systems[s], data[next(it[s])])) for s in systems}
    times = interleave(runners, steps, warmup, group=dist.group.WORLD, device=device)
    return {"times": times, "first": first}


def _steps_for(case: Case, quick: bool) -> tuple[int, int]:
    numel = case.count * math.prod(case.shape)
    steps = 40 if numel < 1 << 20 else 20 if numel < 1 << 23 else 10
    return (steps // 2 if quick else steps), 3


def run_cases(cases: list[Case], quick: bool) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for case in cases:
        steps, warmup = _steps_for(case, quick)
        out = spawn(_case_rank, case.world, case, steps, warmup)[0]
        t = out["times"]
        first = out["first"]
        rows.append({
            "family": case.family, "shape": f"{case.shape[0]}x{case.shape[1]} x{case.count}", "W": case.world,
            "params": case.count * math.prod(case.shape), "steps": steps,
            "ours_ms": stats(t["ours"], 1e3), "fsdp2_ms": stats(t["fsdp2"], 1e3),
            "ratio": paired_ratio(t["ours"], t["fsdp2"]),
            "first_loss_equal": abs(first["ours"] - first["fsdp2"]) <= 1e-6 * max(1.0, abs(first["fsdp2"])),
        })
        print(f"{case.spec}: ratio {rows[-1]['ratio']['median']:.3f}", file=sys.stderr, flush=True)
    summary = []
    for w in sorted({r["W"] for r in rows}):
        meds = [(r["ratio"]["median"], f"{r['shape']} W={w}") for r in rows if r["W"] == w]
        geo = math.exp(sum(math.log(m) for m, _ in meds) / len(meds))
        worst = max(meds)
        summary.append({"W": w, "shapes": len(meds), "geomean": round(geo, 3), "worst": round(worst[0], 3),
                        "worst_shape": worst[1], "above_0.85": sum(m > 0.85 for m, _ in meds), "goal": 0.85})
    info = machine_info()
    notes = [
        f"models: count residual blocks of one weight each (square x + gelu(x W^T); tall 4d x d, "
        f"wide d x 4d), a LayerNorm, loss mean square; batch {BATCH} rows; fp32; AdamW lr 1e-3, "
        "weight decay 0.1 (ours vefsdp_optim.AdamW on fully_shard, peer torch.optim.AdamW(foreach=True) on FSDP2)",
        "timing: forward + backward + step + zero_grad, the two systems alternating every step after "
        "3 warm-up steps; a step's time is the slowest rank's; ratio: median (p25-p75) of per-step ratios ours / FSDP2",
        f"one intra-op thread per rank, gloo on {info.get('cpu', 'the CPU')} ({info.get('cores', '?')} cores); "
        "W=4 ranks time-share the cores: read the ratios, not the times",
        "first_loss_equal: the first step's losses of the two systems (same weights, same batch) agree",
    ]
    headline = [{"comparison": f"fully_shard step / FSDP2, W={s['W']}, geomean over {s['shapes']} shapes "
                               f"(worst {s['worst']}: {s['worst_shape']})", "ratio": s["geomean"]}
                for s in summary]
    return result("fully_shard_sweep", rows, notes, headline=headline, summary=summary)


def run(quick: bool = True) -> dict[str, Any]:
    return run_cases(QUICK if quick else full_grid(), quick)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="quick", action="store_true", default=True)
    mode.add_argument("--full", dest="quick", action="store_false")
    ap.add_argument("--cases", default="", help="fnmatch patterns on family:d:count:W, comma-separated")
    ap.add_argument("--out", default="benchmarks/out/fully_shard_sweep.json")
    args = ap.parse_args(argv)
    if args.cases:
        pats = [p for p in args.cases.split(",") if p]
        cases = [c for c in full_grid() if any(fnmatch.fnmatch(c.spec, p) for p in pats)]
        if not cases:
            raise ValueError(f"no case of the full grid matches {args.cases!r} (family:d:count:W)")
        res = run_cases(cases, args.quick)
    else:
        res = run(args.quick)
    write_json(args.out, res)
    print(markdown_table(res["rows"]))
    print(markdown_table(res["summary"]))
    for n in res["notes"]:
        print("-", n)
    return res


if __name__ == "__main__":
    main()
