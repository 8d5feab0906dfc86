"""SOAP's step against the reference SOAP's own code (github.com/nikhilvyas/SOAP), one device.

The reference is not on the package index: point ``VEFSDP_SOAP_REF`` at a folder holding
its ``soap.py`` (a checkout of the repository); without it every row says "peer not
installed". Its code is imported from there at run time, never copied.

Both optimizers step their own copy of the same parameters with the same fixed
gradients, at the reference's defaults (``precondition_frequency=10``,
``max_precond_dim=10000``), in alternating order ([Note: timing statistics] in
_common.py), after 2 untimed warm-up steps (the first step of either only starts the
factors). Their results are bit-identical (tests/test_soap.py), so both do the same
arithmetic; what differs is the work around it. A sweep of parameter sets (a lead on
one shape is not a lead): a tiny MLP, a GPT block at d = 256 (with biases and norms), square, wide and tall
matrices, convolution kernels and an embedding whose vocabulary dim (12,000) exceeds
``max_precond_dim`` (so only its 64-wide dim is rotated); the geometric mean and the
worst case of the per-case median ratios. Timed steps: quick 20 (two basis updates by
power iteration among them), full 60 over 3 fresh runs. The mean ratio includes the
steps that renew the bases; the median is the ordinary step.

    VEFSDP_SOAP_REF=/path/to/SOAP python -m benchmarks.bench_soap [--quick|--full]
"""

from __future__ import annotations

import importlib.util
import math
import os
import statistics
import time
from types import ModuleType
from typing import Any

import torch
from torch import nn

from ._common import cli, current_device, paired_ratio, result, stats, synchronize

SOAP_ENV = "VEFSDP_SOAP_REF"
NOT_INSTALLED = (f"peer not installed: set {SOAP_ENV} to a folder holding the reference's soap.py "
                 "(a checkout of github.com/nikhilvyas/SOAP); nothing was timed")

CASES: dict[str, list[tuple[int, ...]]] = {
    "mlp": [(64, 32), (64,), (32, 64), (32,)] * 4,
    "gpt_block_d256": [(768, 256), (768,), (256, 256), (256,), (1024, 256), (1024,), (256, 1024), (256,),
                       (256,), (256,)],
    "square_512": [(512, 512)] * 2,
    "wide_256x1024": [(256, 1024)] * 2,
    "tall_1024x256": [(1024, 256)] * 2,
    "conv_64x32x3x3": [(64, 32, 3, 3), (64,)] * 2,
    "embedding_12000x64": [(12000, 64)],
}
QUICK_CASES = ("mlp", "gpt_block_d256", "square_512", "conv_64x32x3x3", "embedding_12000x64")


def reference_soap() -> ModuleType | None:
    """The reference's ``soap`` module from ``$VEFSDP_SOAP_REF/soap.py``, or None."""
    src = os.environ.get(SOAP_ENV)
    path = os.path.join(src, "soap.py") if src else None
    if path is None or not os.path.isfile(path):
        return None
    spec = importlib.util.spec_from_file_location("soap_reference", path)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _setup(make: Any, shapes: list[tuple[int, ...]], device: str) -> torch.optim.Optimizer:
    g = torch.Generator().manual_seed(0)
    ps = [nn.Parameter(torch.randn(s, generator=g).to(device)) for s in shapes]
    for p in ps:
        p.grad = (torch.randn(p.shape, generator=g) * 1e-2).to(device)
    return make(ps)


def _timed(runners: dict[str, Any], steps: int, warmup: int, device: str) -> dict[str, dict[str, list[float]]]:
    """``interleave``'s alternating order, recording each step's wall time and, on the CPU,
    the process's CPU time (which a shared machine's other jobs do not inflate)."""
    names = list(runners)
    out: dict[str, dict[str, list[float]]] = {n: {"wall": [], "cpu": []} for n in names}
    for step in range(warmup + steps):
        for name in names if step % 2 == 0 else names[::-1]:
            synchronize(device)
            w0, c0 = time.perf_counter(), time.process_time()
            runners[name]()
            synchronize(device)
            w, c = time.perf_counter() - w0, time.process_time() - c0
            if step >= warmup:
                out[name]["wall"].append(w)
                out[name]["cpu"].append(c)
    return out


def _row(case: str, ref: ModuleType, steps: int, repeats: int) -> dict[str, Any]:
    import vefsdp_optim

    device = current_device()
    shapes = CASES[case]
    t: dict[str, dict[str, list[float]]] = {"ours": {"wall": [], "cpu": []}, "reference": {"wall": [], "cpu": []}}
    for _ in range(repeats):
        runners = {"ours": _setup(vefsdp_optim.SOAP, shapes, device).step,
                   "reference": _setup(ref.SOAP, shapes, device).step}
        for k, v in _timed(runners, steps, 2, device).items():
            for kind in ("wall", "cpu"):
                t[k][kind].extend(v[kind])
    row = {
        "case": case, "tensors": len(shapes), "elements": sum(math.prod(s) for s in shapes),
        "ours_ms": stats(t["ours"]["wall"], 1e3), "reference_ms": stats(t["reference"]["wall"], 1e3),
        "ratio_vs_reference": paired_ratio(t["ours"]["wall"], t["reference"]["wall"]),
        "mean_ratio": statistics.fmean(t["ours"]["wall"]) / statistics.fmean(t["reference"]["wall"]),
    }
    if torch.device(device).type == "cpu":
        row["cpu_time_ratio"] = sum(t["ours"]["cpu"]) / sum(t["reference"]["cpu"])
    return row


def run(quick: bool = True) -> dict:
    """Our SOAP's step / the reference's, one process on ``current_device()`` with one
    intra-op thread, over the sweep (quick: 5 cases, 20 timed steps; full: 7 cases, 3
    runs of 20)."""
    t0 = time.perf_counter()
    cases = QUICK_CASES if quick else tuple(CASES)
    ref = reference_soap()
    if ref is None:
        rows = [{"case": c, "status": NOT_INSTALLED} for c in cases]
        return result("soap", rows, [NOT_INSTALLED], wall_s=time.perf_counter() - t0)
    steps, repeats = (20, 1) if quick else (20, 3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # both alike; steadier on a shared machine
    try:
        rows = [_row(c, ref, steps, repeats) for c in cases]
    finally:
        torch.set_num_threads(threads)
    medians = {r["case"]: r["ratio_vs_reference"]["median"] for r in rows}
    worst = max(medians, key=medians.get)
    geomean = math.exp(sum(math.log(v) for v in medians.values()) / len(medians))
    headline = [{"comparison": "SOAP step / reference SOAP step, one device: geometric mean over the sweep",
                 "ratio": round(geomean, 3)},
                {"comparison": f"SOAP step / reference SOAP step, one device: worst case ({worst})",
                 "ratio": round(medians[worst], 3)}]
    notes = [f"on {current_device()} with 1 intra-op thread; fp32; the reference's defaults; the same "
             "parameters and gradients for both, bit-identical results",
             f"geometric mean of the median ratios {geomean:.3f}, worst {medians[worst]:.3f} ({worst})",
             "cpu_time_ratio: the two optimizers' summed process CPU time over the timed steps (CPU "
             "only), which other jobs on a shared machine do not inflate as they do wall time"]
    return result("soap", rows, notes, headline=headline, wall_s=time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> dict:
    return cli(run, "soap", argv)


if __name__ == "__main__":
    main()
