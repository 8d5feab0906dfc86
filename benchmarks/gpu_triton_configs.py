"""The Triton 8-bit Adam kernel's launch configuration on a CUDA GPU: step time of one
12.6 M-element tensor (4096 x 3072, block size 256) for each tile size (elements a
program takes) and warp count, against torch's fused AdamW on the same tensor, and
whether each configuration gives the default's bits.

    python benchmarks/gpu_triton_configs.py [--out results.json]

Runs on a torch outside the declared range too (benchmarks/_math_only.py). Not part of
``make gpu-check``: a tuning aid, whose numbers docs/performance.md records.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def ab(spec: str, run) -> int:
    """Two configurations, 7 interleaved rounds of 10 steps over 16 tensors (the whole
    step timed, so per-call launch gaps overlap kernels as in an optimizer step)."""
    import torch

    from vefsdp_optim._math import _quant8_triton as qt
    from vefsdp_optim._math import adam8bit_block_step_, dynamic_code_map, quantize_blockwise
    from vefsdp_optim._math._quant8 import TableQuantizer

    dev, bs = torch.device("cuda"), 256
    codes = dynamic_code_map(True).to(dev), dynamic_code_map(False).to(dev)
    quant = TableQuantizer(codes[0]), TableQuantizer(codes[1])
    sizes = [4096 * 3072] * 8 + [4096] * 8
    ps = [torch.randn(n, device=dev) for n in sizes]
    gs = [torch.randn(n, device=dev) * 1e-3 for n in sizes]
    st = [[*quantize_blockwise(torch.zeros(n, device=dev), codes[0], bs),
           *quantize_blockwise(torch.zeros(n, device=dev), codes[1], bs)] for n in sizes]
    cfgs = []
    for part in spec.split(","):
        tile, warps = (int(x) for x in part.split("/"))
        cfgs.append(dict(ROWS=max(1, tile // bs), BLOCK=bs, num_warps=warps))
    times: dict[int, list[float]] = {0: [], 1: []}
    saved = qt.launch_config
    try:
        for rnd in range(8):
            for i, cfg in enumerate(cfgs):
                qt.launch_config = lambda block_size, cfg=cfg: cfg
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                e0.record()
                for k in range(10):
                    for p, g, s in zip(ps, gs, st, strict=True):
                        adam8bit_block_step_(p, g, *s, step=rnd * 10 + k + 1, lr=1e-3, beta1=0.9,
                                             beta2=0.999, eps=1e-8, weight_decay=1e-2,
                                             decoupled=True, block_size=bs, signed_code=codes[0],
                                             unsigned_code=codes[1], quantizers=quant, fused=True)
                e1.record()
                torch.cuda.synchronize()
                if rnd:  # round 0 compiles
                    times[i].append(e0.elapsed_time(e1) / 10)
    finally:
        qt.launch_config = saved
    for i, part in enumerate(spec.split(",")):
        print(f"{part}: step ms median {statistics.median(times[i]):.4f} "
              f"(min {min(times[i]):.4f}, max {max(times[i]):.4f})")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--ab", default="", help="tile/warps,tile/warps: interleaved A/B of two "
                    "launch configurations on 8 x 12.6 M + 8 x 4096 elements, 7 rounds")
    a = ap.parse_args()
    try:
        import vefsdp_optim  # noqa: F401
    except ImportError:
        sys.modules.pop("vefsdp_optim", None)
        import benchmarks._math_only  # noqa: F401
    import torch

    from vefsdp_optim._math import _quant8_triton as qt
    from vefsdp_optim._math import adam8bit_block_step_, dynamic_code_map, quantize_blockwise
    from vefsdp_optim._math._quant8 import TableQuantizer

    dev, bs, shape = torch.device("cuda"), 256, (4096, 3072)
    n = shape[0] * shape[1]
    codes = dynamic_code_map(True).to(dev), dynamic_code_map(False).to(dev)
    quant = TableQuantizer(codes[0]), TableQuantizer(codes[1])
    gen = torch.Generator(device=dev).manual_seed(0)
    p0 = torch.randn(n, device=dev, generator=gen)
    g = torch.randn(n, device=dev, generator=gen) * 1e-3
    m0 = quantize_blockwise(torch.randn(n, device=dev, generator=gen) * 1e-3, codes[0], bs)
    v0 = quantize_blockwise(torch.rand(n, device=dev, generator=gen) * 1e-6, codes[1], bs)

    def run(cfg, reps):
        saved = qt.launch_config
        if cfg is not None:
            qt.launch_config = lambda block_size: cfg
        try:
            p, s = p0.clone(), [t.clone() for t in (*m0, *v0)]
            ts = []
            for i in range(reps + 3):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                adam8bit_block_step_(p, g, *s, step=i + 1, lr=1e-3, beta1=0.9, beta2=0.999,
                                     eps=1e-8, weight_decay=1e-2, decoupled=True, block_size=bs,
                                     signed_code=codes[0], unsigned_code=codes[1],
                                     quantizers=quant, fused=True)
                e1.record()
                torch.cuda.synchronize()
                if i >= 3:
                    ts.append(e0.elapsed_time(e1))
            return statistics.median(ts), (p, *s)
        finally:
            qt.launch_config = saved

    if a.ab:
        return ab(a.ab, run)
    run(None, 3)  # warm-up: compile, clocks
    base_ms, base_out = run(None, a.reps)
    pa = torch.nn.Parameter(p0.clone())
    pa.grad = g.clone()
    opt = torch.optim.AdamW([pa], lr=1e-3, fused=True)
    ts = []
    for i in range(a.reps + 3):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        opt.step()
        e1.record()
        torch.cuda.synchronize()
        if i >= 3:
            ts.append(e0.elapsed_time(e1))
    fused_ms = statistics.median(ts)
    rows = []
    for tile in (512, 1024, 2048, 4096, 8192):
        for warps in (1, 2, 4, 8, 16):
            if warps * 32 > tile:
                continue
            cfg = dict(ROWS=max(1, tile // bs), BLOCK=bs, num_warps=warps)
            try:
                ms, out = run(cfg, a.reps)
                same = all(torch.equal(x.view(torch.uint8) if x.dtype == torch.uint8 else x.view(torch.int32),
                                       y.view(torch.uint8) if y.dtype == torch.uint8 else y.view(torch.int32))
                           for x, y in zip(out, base_out, strict=True))
                rows.append(dict(tile=tile, warps=warps, ms=round(ms, 4), same_bits=same,
                                 over_fused=round(ms / fused_ms, 3),
                                 TBps=round(16 * n / ms / 1e9, 3)))
            except Exception as e:  # noqa: BLE001 - a config that fails is a row
                rows.append(dict(tile=tile, warps=warps, error=f"{type(e).__name__}: {e}"[:200]))
    res = dict(device=torch.cuda.get_device_name(0), torch=torch.__version__, n=n,
               default=qt.launch_config(bs), default_ms=base_ms, fused_adamw_ms=fused_ms, rows=rows)
    for r in rows:
        print(r)
    print(f"default {res['default']}: {base_ms:.4f} ms; torch fused AdamW {fused_ms:.4f} ms")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
