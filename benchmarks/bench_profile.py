"""Where one optimizer step spends its time, and the optimization that profile guided.

    python -m benchmarks.bench_profile [--quick|--full] [--out benchmarks/out/profile.json]

1. ``torch.profiler`` over AdamW8bit steps (one process, one intra-op thread, the
   transformer-block shapes of ``bench_adam8bit``): the operators with the most self
   time, per step and as a share of the step.
2. Before / after: the 8-bit moment path (dequantize both moments, requantize both) of
   the table quantizer as it was at commit ``BEFORE_COMMIT`` (read with ``git show``)
   against the current one, and whole AdamW8bit steps with each, interleaved, with
   the codes checked bit-equal. What changed: codes written straight into the uint8
   state from a uint8 table plus one midpoint per bucket (no int32 code temporaries,
   no ``base + j`` index arithmetic, no ``clone`` and no copy into the state), absmax as
   ``max(amax, -amin)`` instead of ``abs().amax()`` (no |x| temporary), and dequantize
   scaling in place.
"""

from __future__ import annotations

import ast
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

import vefsdp_optim._adam8bit as a8
import vefsdp_optim._math._adam8bit_step as step8
import vefsdp_optim._math._quant8 as q8
from vefsdp_optim._math import num_blocks

from ._common import cli, current_device, interleave, paired_ratio, result, stats

BEFORE_COMMIT = "cb82dc4"  # the table quantizer before the profile-guided change
_REPO = Path(__file__).resolve().parent.parent


def _load_before() -> tuple[Any, Any] | str:
    """``(_TableQuantizer, _dequantize)`` as of BEFORE_COMMIT, or why not."""
    try:
        src = subprocess.run(["git", "show", f"{BEFORE_COMMIT}:vefsdp_optim/_adam8bit.py"],
                             capture_output=True, text=True, check=True, cwd=_REPO).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        return f"not run: cannot read commit {BEFORE_COMMIT} with git ({e})"
    tree = ast.parse(src)
    parts = [ast.get_source_segment(src, n) for n in tree.body
             if isinstance(n, ast.ClassDef | ast.FunctionDef) and n.name in ("_TableQuantizer", "_dequantize")]
    ns: dict[str, Any] = {"torch": torch, "num_blocks": num_blocks}
    exec(compile("from __future__ import annotations\n\n" + "\n\n".join(parts),  # noqa: S102
                 f"{BEFORE_COMMIT}:vefsdp_optim/_adam8bit.py", "exec"), ns)
    return ns["_TableQuantizer"], ns["_dequantize"]


class _OldCall:
    """The old quantizer behind the current call site: quantize, then copy into ``out``
    (what the step did before)."""

    def __init__(self, q: Any) -> None:
        self.q = q

    def __call__(self, x: torch.Tensor, bs: int, out: torch.Tensor | None = None):
        c, a = self.q(x, bs)
        if out is not None:
            out.copy_(c)
        return c, a


def _setup(device: str):
    from .bench_adam8bit import _params

    ps = _params(device=device)
    opt = a8.AdamW8bit(ps, fused=False)  # the eager table path (the fused kernel bypasses it)
    g = torch.Generator().manual_seed(1)
    grads = [(torch.randn(p.shape, generator=g) * 1e-3).to(device) for p in ps]
    for p, gr in zip(ps, grads, strict=True):
        p.grad = gr
    opt.step()
    return ps, opt


def profile_rows(steps: int, device: str, before: tuple[Any, Any] | None = None,
                 top: int = 10) -> tuple[list[dict[str, Any]], float]:
    """The ``top`` operators by self time over ``steps`` AdamW8bit steps; with ``before``
    (old quantizer class, old dequantize) the step runs with those pieces."""
    from torch.profiler import ProfilerActivity, profile

    _, opt = _setup(device)
    new_deq = q8.dequantize_table
    if before is not None:
        signed, unsigned = opt._code_maps(torch.device(device))
        opt._quantizers[torch.device(device)] = (_OldCall(before[0](signed)), _OldCall(before[0](unsigned)))
        step8.dequantize_table = before[1]
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    try:
        with profile(activities=acts) as prof:
            for _ in range(steps):
                opt.step()
    finally:
        step8.dequantize_table = new_deq
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    rows = []
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]:
        rows.append({"op": e.key, "calls_per_step": e.count / steps,
                     "self_ms_per_step": e.self_cpu_time_total / 1e3 / steps,
                     "share_pct": 100 * e.self_cpu_time_total / total})
    return rows, total / 1e3 / steps


def before_after(steps: int, device: str) -> tuple[list[dict[str, Any]], list[str]]:
    before = _load_before()
    if isinstance(before, str):
        return [{"what": "before/after", "status": before}], []
    old_q, old_deq = before
    new_q, new_deq = q8.TableQuantizer, q8.dequantize_table
    notes = []
    # 1) the moment path alone, on every quantized tensor's moments
    ps, opt = _setup(device)
    states = [opt.state[p] for p in ps if "exp_avg_codes" in opt.state[p]]
    codes = opt._code_maps(torch.device(device))
    olds = (old_q(codes[0]), old_q(codes[1]))
    news = (new_q(codes[0]), new_q(codes[1]))
    bs = opt.param_groups[0]["block_size"]

    def path(quants, deq, check: list | None = None):
        def go():
            for st in states:
                for i, name in enumerate(("exp_avg", "exp_avg_sq")):
                    m = deq(st[name + "_codes"], st[name + "_absmax"], codes[i], bs)
                    m.mul_(0.9)
                    c, a = quants[i](m, bs)
                    if check is not None:
                        check.append((c, a))
        return go

    got_old: list = []
    got_new: list = []
    path(olds, old_deq, got_old)()
    path(news, new_deq, got_new)()
    same = all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(got_old, got_new, strict=True))
    if not same:
        raise AssertionError("the current quantizer's codes differ from the old one's")
    notes.append(f"codes and absmax of the moment path bit-equal before and after: {same}")
    t = interleave({"before": path(olds, old_deq), "after": path(news, new_deq)}, steps, warmup=1,
                   device=device)
    n_q = sum(st["exp_avg_codes"].numel() for st in states)
    rows = [{"what": f"moment path: dequantize + requantize 2 moments of {n_q / 1e6:.2f} M elements",
             "before_ms": stats(t["before"], 1e3), "after_ms": stats(t["after"], 1e3),
             "after_over_before": paired_ratio(t["after"], t["before"])}]
    # 2) whole AdamW8bit steps: the old pieces swapped in for one optimizer
    ps_b, opt_b = _setup(device)
    ps_a, opt_a = _setup(device)
    opt_b._quantizers[torch.device(device)] = (_OldCall(olds[0]), _OldCall(olds[1]))

    def step_before():
        step8.dequantize_table = old_deq
        try:
            opt_b.step()
        finally:
            step8.dequantize_table = new_deq

    t = interleave({"before": step_before, "after": opt_a.step}, steps, warmup=1, device=device)
    same = all(torch.equal(x, y) for x, y in zip(ps_b, ps_a, strict=True))
    notes.append(f"parameters after {steps + 2} steps bit-equal before and after: {same}")
    if not same:
        raise AssertionError("AdamW8bit with the old quantizer gives different parameters")
    rows.append({"what": "whole AdamW8bit step (bench_adam8bit shapes)",
                 "before_ms": stats(t["before"], 1e3), "after_ms": stats(t["after"], 1e3),
                 "after_over_before": paired_ratio(t["after"], t["before"])})
    return rows, notes


def run(quick: bool = True) -> dict:
    t0 = time.perf_counter()
    torch.set_num_threads(1)
    device = current_device()
    steps = 3 if quick else 10
    old = _load_before()
    extra: dict[str, Any] = {}
    if not isinstance(old, str):
        extra["profile_before"], before_ms = profile_rows(steps, device, old, top=12)
    prof, step_ms = profile_rows(steps, device)  # after the before-profile: both warm
    ba, notes = before_after(5 if quick else 20, device)
    notes.insert(0, f"profile (rows above): {steps} AdamW8bit steps on {device}, 1 thread, "
                    f"{step_ms:.1f} ms of operator self time per step under the profiler")
    if extra:
        notes.insert(1, f"profile_before: the same steps with the quantizer of {BEFORE_COMMIT}: "
                        f"{before_ms:.1f} ms per step; it showed index_select (the 3 table lookups "
                        "per element), copy_ (int32 -> uint8 codes, then into the state), the "
                        "index arithmetic (add, clone, bitwise ops) and abs() temporaries as the "
                        "bulk, which the change removes or shrinks to uint8")
    notes.append(f"before = the table quantizer and dequantize of commit {BEFORE_COMMIT}, read "
                 "with git show; after = this checkout's; both interleaved in one process")
    head = [{"comparison": "profile-guided: AdamW8bit step after / before the quantizer change",
             "ratio": ba[-1]["after_over_before"]}] if "after_over_before" in ba[-1] else []
    return result("profile", prof, notes, headline=head, before_after=ba, **extra,
                  wall_s=time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> dict:
    return cli(run, "profile", argv)


if __name__ == "__main__":
    main()
