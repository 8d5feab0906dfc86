"""NorMuon and Polar Express steps vs Microsoft Dion's (``dion.NorMuon``, ``dion.Muon``).

Dion is not in the package index: point ``VEFSDP_DION_SRC`` at a checkout of
github.com/microsoft/dion (the folder holding ``dion/``); without it every row says
"peer not installed". Dion's code is imported from there at run time, never copied.

Two comparisons, on FSDP2 row shards over W = 2 gloo CPU ranks, the same parameters and
gradients for every runner:

* ``normuon``: vefsdp_optim.NorMuon vs dion.NorMuon, both with their defaults' Polar
  Express (5 iterations of the same three matmuls; each its own coefficient table),
  ``spectral_norm`` lr adjustment, momentum 0.95 without Nesterov, ``muon_beta2`` 0.95,
  on a sweep of matrix sets (a lead on one shape is not a lead): the
  dense GPT of bench_muon_dion, square, wide, tall, many small, and MoE experts
  (``flatten=False``); the geometric mean and the worst case over the sweep.
* ``polar_express``: vefsdp_optim.Muon(ns_coefficients="polar_express") vs
  dion.Muon(use_polar_express=True), on the dense and MoE sets.

Our optimizers also run on vefsdp_optim.fully_shard parameters (one group). The
runners step in alternating order; a step's time is the slowest rank's; a ratio is the
median (and quartiles) of the per-step ratios ours / Dion, pooled over fresh runs
(``--full``: 3 runs of 20 steps; quick: one of 8). Dion compiles its Polar Express and
NorMuon normalization with torch.compile (inductor: C++ on the CPU); the untimed warm-up
steps include that compilation.

    VEFSDP_DION_SRC=/path/to/dion python -m benchmarks.bench_normuon_dion [--quick|--full]
"""

from __future__ import annotations

import math
import os
import time

import torch
import torch.distributed as dist

from ._common import (
    DION_NOT_INSTALLED,
    GradProbe,
    cli,
    cpu_flags,
    current_device,
    dion_src,
    fsdp2_params,
    import_dion,
    interleave,
    interleave_cpu,
    not_run_row,
    ns_kernels,
    paired_ratio,
    result,
    spawn,
    stats,
)

WORLD = 2
D = 256
# case -> (matrix shapes, whether they are expert stacks: flatten=False)
SWEEP: dict[str, tuple[list[tuple[int, ...]], bool]] = {
    "dense": ([s for _ in range(4) for s in ((3 * D, D), (D, D), (4 * D, D), (D, 4 * D))], False),
    "square": ([(512, 512)] * 4, False),
    "wide": ([(256, 1024)] * 4, False),
    "tall": ([(1024, 256)] * 4, False),
    "small": ([(128, 128)] * 32, False),
    "moe": ([(8, 2 * D, D), (8, D, 2 * D)], True),
}
PE_CASES = ("dense", "moe")
HP = dict(lr=0.02, weight_decay=0.1)


def _worker(steps: int, comparison: str, case: str, src: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import vefsdp_optim

    dion = import_dion(src)

    device = current_device()
    mesh = init_device_mesh(torch.device(device).type, (dist.get_world_size(),))
    shapes, experts = SWEEP[case]
    g = torch.Generator().manual_seed(0)
    init = [(torch.randn(s, generator=g) * 0.02).to(device) for s in shapes]
    grads = [torch.randn(s, generator=g).to(device) for s in shapes]
    keys = {"flatten": False} if experts else {}

    def fsdp2():
        return fsdp2_params(init, grads, mesh)

    if comparison == "normuon":
        def ours(params):
            return vefsdp_optim.NorMuon([{"params": params, **keys}], momentum=0.95, nesterov=False,
                                        muon_beta2=0.95, adjust_lr_fn="spectral_norm", **HP)

        peer = dion.NorMuon(fsdp2(), distributed_mesh=mesh, mu=0.95, nesterov=False, muon_beta2=0.95,
                            adjust_lr="spectral_norm", flatten=False, use_polar_express=True, **HP)
    else:
        def ours(params):
            return vefsdp_optim.Muon([{"params": params, **keys}], momentum=0.95, nesterov=True,
                                     ns_coefficients="polar_express", **HP)

        peer = dion.Muon(fsdp2(), distributed_mesh=mesh, mu=0.95, nesterov=True, flatten=False,
                         use_polar_express=True, **HP)
    probe = GradProbe(init)
    vefsdp_optim.fully_shard(probe, mesh=mesh)
    ours_fs = ours(list(probe.parameters()))
    probe(grads).backward()
    runners = {"ours_fully_shard": ours_fs.step, "ours_fsdp2": ours(fsdp2()).step, "dion_fsdp2": peer.step}
    interleave(runners, 0, warmup=3, group=dist.group.WORLD, device=device)
    load = os.getloadavg()[0]
    return {"times": interleave_cpu(runners, steps, device), "load": load}


def _row(comparison: str, case: str, steps: int, src: str, repeats: int) -> dict:
    runs = [spawn(_worker, WORLD, steps, comparison, case, src) for _ in range(repeats)]
    t = {k: [x for r in runs for x in r[0]["times"][k]] for k in runs[0][0]["times"]}
    shapes, _ = SWEEP[case]
    return {
        "comparison": comparison, "case": case, "world": WORLD, "runs": repeats,
        "shapes": sorted({tuple(s) for s in shapes}), "matrices": len(shapes),
        "ours_fully_shard_ms": stats(t["ours_fully_shard"], 1e3),
        "ours_fsdp2_ms": stats(t["ours_fsdp2"], 1e3),
        "dion_fsdp2_ms": stats(t["dion_fsdp2"], 1e3),
        "ratio_fsdp2_vs_dion": paired_ratio(t["ours_fsdp2"], t["dion_fsdp2"]),
        "ratio_fully_shard_vs_dion": paired_ratio(t["ours_fully_shard"], t["dion_fsdp2"]),
        "cpu_ratio_fsdp2_vs_dion": paired_ratio(t["ours_fsdp2:cpu"], t["dion_fsdp2:cpu"]),
        "cpu_ratio_fully_shard_vs_dion": paired_ratio(t["ours_fully_shard:cpu"], t["dion_fsdp2:cpu"]),
        "run_medians_fsdp2": [round(paired_ratio(r[0]["times"]["ours_fsdp2"],
                                                 r[0]["times"]["dion_fsdp2"])["median"], 3) for r in runs],
        "load": [round(r[0]["load"], 1) for r in runs],
    }


def _summary(rows: list[dict], comparison: str, key: str) -> dict:
    """Geometric mean and worst (largest) of the cases' median ratios."""
    medians = {r["case"]: r[key]["median"] for r in rows if r.get("comparison") == comparison and key in r}
    if not medians:
        return {}
    worst = max(medians, key=medians.get)
    return {"geomean": round(math.exp(sum(math.log(v) for v in medians.values()) / len(medians)), 3),
            "worst": round(medians[worst], 3), "worst_case": worst, "cases": len(medians)}


def run(quick: bool = True) -> dict:
    """NorMuon over the sweep and Polar Express Muon on dense / MoE vs Dion at W = 2
    (quick: one run of 8 timed steps per case; full: 3 fresh runs of 20)."""
    t0 = time.perf_counter()
    src = dion_src("muon", "normuon")
    flags = cpu_flags()
    notes = [
        f"W={WORLD} gloo CPU ranks, FSDP2 row shards, fp32 parameters, one intra-op thread per rank; "
        "NorMuon: both with Polar Express (5 iterations, bf16; ours the paper's table, Dion's "
        "modded-nanogpt's), spectral_norm, momentum 0.95 without Nesterov, muon_beta2 0.95; "
        "polar_express: Muon with Nesterov momentum and Polar Express on both sides",
        "sweep: " + "; ".join(f"{c}: {len(s)} x {sorted(set(s))}{' (experts, flatten=False)' if e else ''}"
                              for c, (s, e) in SWEEP.items()),
        "ratios: median (p25-p75) of per-step ratios ours / Dion, pooled over runs; summary: geometric "
        "mean and worst case of the cases' medians; cpu_ratio: the same with each step's CPU time on the "
        "rank's one compute thread (the slowest rank's: Python, copies and matmuls without the waits for "
        "peers and the scheduler, which a loaded machine stretches; gloo's transport threads not counted); "
        "load: 1-minute load average when each run's timing began",
        "CPU flags that set bf16 matmul speed: " + ", ".join(f"{k}={v}" for k, v in flags.items()),
        ns_kernels(),
        "Dion normalizes each rank's row shard of the orthogonalized update on FSDP2 (its Frobenius "
        "rescale uses the shard's norm: not the single-device result at W > 1); ours normalizes "
        "whole matrices on their owner (bitwise the single-device result) and sends float32 back",
    ]
    if src is None:
        rows = [{"comparison": cmp, "case": c, "world": WORLD, "status": "peer not installed"}
                for cmp, cases in (("normuon", SWEEP), ("polar_express", PE_CASES)) for c in cases]
        notes.append(DION_NOT_INSTALLED)
        return result("normuon_dion", rows, notes, cpu_flags=flags, wall_s=time.perf_counter() - t0)
    steps, repeats = (8, 1) if quick else (20, 3)
    rows = [_row("normuon", c, steps, src, repeats) for c in SWEEP]
    rows += [_row("polar_express", c, steps, src, repeats) for c in PE_CASES]
    if (nr := not_run_row(WORLD)) is not None:
        rows.append(nr)
    summary = {f"{cmp}_{kind}{runner}": _summary(rows, cmp, f"{kind}ratio_{runner}_vs_dion")
               for cmp in ("normuon", "polar_express") for runner in ("fsdp2", "fully_shard")
               for kind in ("", "cpu_")}
    headline = [{"comparison": f"NorMuon on FSDP2 / dion.NorMuon on FSDP2, W={WORLD}, {r['case']}",
                 "ratio": r["ratio_fsdp2_vs_dion"]} for r in rows if r.get("comparison") == "normuon"]
    headline += [{"comparison": f"Muon (Polar Express) on FSDP2 / dion.Muon (use_polar_express) on FSDP2, "
                                f"W={WORLD}, {r['case']}", "ratio": r["ratio_fsdp2_vs_dion"]}
                 for r in rows if r.get("comparison") == "polar_express"]
    return result("normuon_dion", rows, notes, headline=headline, summary=summary, cpu_flags=flags,
                  wall_s=time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> dict:
    return cli(run, "normuon_dion", argv)


if __name__ == "__main__":
    main()
