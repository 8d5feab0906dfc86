"""The Triton 8-bit Adam kernel's launch configuration on a CUDA GPU: step time of one
12.6 M-element tensor (4096 x 3072, block size 256) for each tile size (elements a
program takes) and warp count, against torch's fused AdamW on the same tensor, and
whether each configuration gives the default's bits.

    python tools/gpu_triton_configs.py [--out results.json]

Runs from an uninstalled checkout too (tools/_checkout.py). Not part of
``make gpu-check``: a tuning aid, whose numbers docs/performance.md records.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _import_math() -> None:
    """The package from this checkout, installed or not ([Note: checkout imports])."""
    import tools._checkout  # noqa: F401
    import vefsdp_optim  # noqa: F401


class _Kernel:
    """AdamW8bit's defaults at block size 256, one ``adam8bit_block_step_`` per tensor,
    with the launch configuration replaceable (None: the library's)."""

    def __init__(self, dev) -> None:
        from vefsdp_optim._math import dynamic_code_map
        from vefsdp_optim._math._quant8 import TableQuantizer

        self.bs = 256
        self.codes = dynamic_code_map(True).to(dev), dynamic_code_map(False).to(dev)
        self.quant = TableQuantizer(self.codes[0]), TableQuantizer(self.codes[1])

    def state(self, m, v) -> list:
        from vefsdp_optim._math import quantize_blockwise

        return [*quantize_blockwise(m, self.codes[0], self.bs),
                *quantize_blockwise(v, self.codes[1], self.bs)]

    def step(self, p, g, s, t: int, cfg: dict | None) -> None:
        from vefsdp_optim._kernels import _quant8_triton as qt
        from vefsdp_optim._math import adam8bit_block_step_

        saved = qt.launch_config
        if cfg is not None:
            qt.launch_config = lambda block_size: cfg
        try:
            adam8bit_block_step_(p, g, *s, step=t, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                                 weight_decay=1e-2, decoupled=True, block_size=self.bs,
                                 signed_code=self.codes[0], unsigned_code=self.codes[1],
                                 quantizers=self.quant, fused=True)
        finally:
            qt.launch_config = saved

    def config(self, spec: str) -> dict:
        """``tile/warps`` as a launch configuration."""
        tile, warps = (int(x) for x in spec.split("/"))
        return dict(ROWS=max(1, tile // self.bs), BLOCK=self.bs, num_warps=warps)


def _bits(t):
    """``t``'s bits, to compare NaN and signed zeros exactly (uint8 codes as they are)."""
    import torch

    return t if t.dtype == torch.uint8 else t.view(torch.int32)


def ab(spec: str, kernel: _Kernel) -> int:
    """Two configurations, 7 interleaved rounds of 10 steps over 16 tensors (the whole
    step timed, so per-call launch gaps overlap kernels as in an optimizer step)."""
    import torch

    dev = torch.device("cuda")
    sizes = [4096 * 3072] * 8 + [4096] * 8
    ps = [torch.randn(n, device=dev) for n in sizes]
    gs = [torch.randn(n, device=dev) * 1e-3 for n in sizes]
    st = [kernel.state(torch.zeros(n, device=dev), torch.zeros(n, device=dev)) for n in sizes]
    specs = spec.split(",")
    cfgs = [kernel.config(x) for x in specs]
    times: dict[int, list[float]] = {i: [] for i in range(len(cfgs))}
    for rnd in range(8):
        for i, cfg in enumerate(cfgs):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            e0.record()
            for k in range(10):
                for p, g, s in zip(ps, gs, st, strict=True):
                    kernel.step(p, g, s, rnd * 10 + k + 1, cfg)
            e1.record()
            torch.cuda.synchronize()
            if rnd:  # round 0 compiles
                times[i].append(e0.elapsed_time(e1) / 10)
    for i, part in enumerate(specs):
        print(f"{part}: step ms median {statistics.median(times[i]):.4f} "
              f"(min {min(times[i]):.4f}, max {max(times[i]):.4f})")
    return 0


def _median_ms(fn, reps: int, warmup: int = 3) -> float:
    """Median of ``reps`` CUDA-event timings of ``fn(i)`` after ``warmup`` calls."""
    import torch

    ts = []
    for i in range(reps + warmup):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn(i)
        e1.record()
        torch.cuda.synchronize()
        if i >= warmup:
            ts.append(e0.elapsed_time(e1))
    return statistics.median(ts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--ab", default="", help="tile/warps,tile/warps: interleaved A/B of two "
                    "launch configurations on 8 x 12.6 M + 8 x 4096 elements, 7 rounds")
    a = ap.parse_args()
    _import_math()
    import torch

    from vefsdp_optim._kernels import _quant8_triton as qt

    dev = torch.device("cuda")
    kernel = _Kernel(dev)
    if a.ab:
        return ab(a.ab, kernel)
    n = 4096 * 3072
    gen = torch.Generator(device=dev).manual_seed(0)
    p0 = torch.randn(n, device=dev, generator=gen)
    g = torch.randn(n, device=dev, generator=gen) * 1e-3
    s0 = kernel.state(torch.randn(n, device=dev, generator=gen) * 1e-3,
                      torch.rand(n, device=dev, generator=gen) * 1e-6)

    def run(cfg, reps):
        p, s = p0.clone(), [t.clone() for t in s0]
        ms = _median_ms(lambda i: kernel.step(p, g, s, i + 1, cfg), reps)
        return ms, (p, *s)

    run(None, 3)  # warm-up: compile, clocks
    base_ms, base_out = run(None, a.reps)
    pa = torch.nn.Parameter(p0.clone())
    pa.grad = g.clone()
    opt = torch.optim.AdamW([pa], lr=1e-3, fused=True)
    fused_ms = _median_ms(lambda i: opt.step(), a.reps)
    rows = []
    for tile in (256, 512, 1024, 2048, 4096, 8192):
        for warps in (1, 2, 4, 8, 16):
            if warps * 32 > tile:
                continue
            try:
                ms, out = run(kernel.config(f"{tile}/{warps}"), a.reps)
                same = all(torch.equal(_bits(x), _bits(y)) for x, y in zip(out, base_out, strict=True))
                rows.append(dict(tile=tile, warps=warps, ms=round(ms, 4), same_bits=same,
                                 over_fused=round(ms / fused_ms, 3),
                                 TBps=round(16 * n / ms / 1e9, 3)))
            except Exception as e:  # noqa: BLE001 - a config that fails is a row
                rows.append(dict(tile=tile, warps=warps, error=f"{type(e).__name__}: {e}"[:200]))
    res = dict(device=torch.cuda.get_device_name(0), torch=torch.__version__, n=n,
               default=qt.launch_config(kernel.bs), default_ms=base_ms, fused_adamw_ms=fused_ms,
               rows=rows)
    for r in rows:
        print(r)
    print(f"default {res['default']}: {base_ms:.4f} ms; torch fused AdamW {fused_ms:.4f} ms")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
