"""Muon step: vefsdp_optim.Muon vs Microsoft Dion's Muon (``dion.Muon``), same run.

Dion is not in the package index: point ``VEFSDP_DION_SRC`` at a checkout of
github.com/microsoft/dion (the folder holding ``dion/``); without it every row says
"peer not installed". Dion's code is imported from there at run time, never copied.

Cases, on gloo CPU ranks, W = 2 and 4:

* dense: the 16 hidden matrices of a 4-layer GPT (d = 256: qkv, proj, fc, out);
* moe: one MoE layer, experts ``[E, 512, 256]`` and ``[E, 256, 512]`` (E = 8; 6 at W = 4)
  as batches of matrices (``flatten=False`` for both optimizers).

Runners: ours on vefsdp_optim.fully_shard parameters (one group), ours on FSDP2
parameters, Dion's Muon on the same FSDP2 parameters (``use_polar_express=False``: the
quintic Newton-Schulz in bfloat16, 5 steps, as ours), and ours on one device: rank 0 steps
the whole tensors (one thread) while the other ranks wait, the step the sharded runs
scale from (with W ranks on W cores, 1/W is the bound). The same gradients every step,
interleaved (alternating order), a step's time is the slowest rank's; ratios are the
median and quartiles of the per-step ratios, pooled over fresh runs (``--full``: 3 runs
of 20 steps per case; quick: one of 8), with each run's median to show the spread. Each
row also gives the share of the step spent in matmul kernels (torch.profiler), and the
notes name the CPU's bf16 features (AVX-512 BF16, AMX): bf16 matmul speed dominates
Newton-Schulz, so it sets what the rest of the step can gain.

    VEFSDP_DION_SRC=/path/to/dion python -m benchmarks.bench_muon_dion [--quick|--full]
"""

from __future__ import annotations

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
    not_run_row,
    ns_kernels,
    paired_ratio,
    result,
    spawn,
    stats,
)

D = 256


def _dense_shapes() -> list[tuple[int, ...]]:
    return [s for _ in range(4) for s in ((3 * D, D), (D, D), (4 * D, D), (D, 4 * D))]


def _moe_shapes(world: int) -> list[tuple[int, ...]]:
    e = 6 if world == 4 else 8
    return [(e, 2 * D, D), (e, D, 2 * D)]


_MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul")


def _matmul_share(step, device: str, n: int = 2) -> float:
    """Fraction of ``n`` steps' wall time spent in matmul kernels on this rank (profiler)."""
    from torch.profiler import ProfilerActivity, profile

    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            step()
    wall = time.perf_counter() - t0
    mm = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in _MATMUL_OPS) / 1e6
    return mm / wall if device == "cpu" else float("nan")


def _worker(world: int, steps: int, case: str, src: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import vefsdp_optim

    dion = import_dion(src)

    device = current_device()
    mesh = init_device_mesh(torch.device(device).type, (world,))
    shapes = _dense_shapes() if case == "dense" else _moe_shapes(world)
    g = torch.Generator().manual_seed(0)
    init = [(torch.randn(s, generator=g) * 0.02).to(device) for s in shapes]
    grads = [torch.randn(s, generator=g).to(device) for s in shapes]
    keys = {"flatten": False}
    hp = dict(lr=0.02, weight_decay=0.1)

    def fsdp2():
        return fsdp2_params(init, grads, mesh)

    probe = GradProbe(init)
    vefsdp_optim.fully_shard(probe, mesh=mesh)
    ours_fs = vefsdp_optim.Muon([{"params": list(probe.parameters()), **keys}], **hp)
    probe(grads).backward()
    ours_fsdp2 = vefsdp_optim.Muon([{"params": fsdp2(), **keys}], **hp)
    peer = dion.Muon(fsdp2(), distributed_mesh=mesh, mu=0.95, nesterov=True, flatten=False,
                     use_polar_express=False, **hp)
    one_device = lambda: None  # noqa: E731 - the ranks other than 0 wait at the barrier
    if dist.get_rank() == 0:
        whole = [torch.nn.Parameter(t.clone()) for t in init]
        for p, gr in zip(whole, grads, strict=True):
            p.grad = gr.clone()
        one_device = vefsdp_optim.Muon([{"params": whole, **keys}], **hp).step
    runners = {"ours_fully_shard": ours_fs.step, "ours_fsdp2": ours_fsdp2.step, "dion_fsdp2": peer.step,
               "ours_one_device": one_device}
    times = interleave(runners, steps, warmup=2, group=dist.group.WORLD, device=device)
    share = {}
    for name, step in runners.items():
        dist.barrier()
        share[name] = _matmul_share(step, device)
    return {"times": times, "shapes": shapes, "matmul_share": share}


def _row(world: int, steps: int, case: str, src: str, repeats: int) -> dict:
    """``repeats`` fresh runs of ``steps`` alternating steps each; ratios pooled over
    all per-step pairs, with the spread of the per-run medians."""
    runs = [spawn(_worker, world, world, steps, case, src) for _ in range(repeats)]
    t = {k: [x for r in runs for x in r[0]["times"][k]] for k in runs[0][0]["times"]}
    per_run = {
        name: [paired_ratio(r[0]["times"][ours], r[0]["times"]["dion_fsdp2"])["median"] for r in runs]
        for name, ours in (("fully_shard", "ours_fully_shard"), ("fsdp2", "ours_fsdp2"))}
    # the slowest rank's matmul share (ranks may idle: MoE experts at W = 4)
    share = {k: round(max(rank["matmul_share"][k] for rank in r), 3)
             for r in runs[-1:] for k in r[0]["matmul_share"]}
    return {
        "case": case, "world": world, "runs": repeats,
        "ours_fully_shard_ms": stats(t["ours_fully_shard"], 1e3),
        "ours_fsdp2_ms": stats(t["ours_fsdp2"], 1e3),
        "dion_fsdp2_ms": stats(t["dion_fsdp2"], 1e3),
        "ours_one_device_ms": stats(t["ours_one_device"], 1e3),
        "ratio_fully_shard_vs_dion": paired_ratio(t["ours_fully_shard"], t["dion_fsdp2"]),
        "ratio_fsdp2_vs_dion": paired_ratio(t["ours_fsdp2"], t["dion_fsdp2"]),
        "ratio_fully_shard_vs_one_device": paired_ratio(t["ours_fully_shard"], t["ours_one_device"]),
        "ratio_fsdp2_vs_one_device": paired_ratio(t["ours_fsdp2"], t["ours_one_device"]),
        "run_medians_fully_shard": [round(x, 3) for x in per_run["fully_shard"]],
        "run_medians_fsdp2": [round(x, 3) for x in per_run["fsdp2"]],
        "matmul_share": share,
    }


def run(quick: bool = True) -> dict:
    """Dense and MoE Muon steps vs Dion's at W = 2 and 4 (quick: one run of 8 timed steps
    per case; full: 3 fresh runs of 20 per case)."""
    t0 = time.perf_counter()
    src = dion_src()
    flags = cpu_flags()
    have = [k for k, v in flags.items() if v]
    notes = [f"dense: 16 matrices of a 4-layer GPT, d={D}; moe: experts {_moe_shapes(2)} (W=4: "
             f"{_moe_shapes(4)}), flatten=False; fp32 parameters, bf16 Newton-Schulz (5 quintic "
             "steps) in both; the four runners step in alternating order; a step time is the "
             "slowest rank's; ratios: median (p25-p75) of the per-step ratios ours / Dion pooled "
             "over runs; run_medians: each fresh run's median ratio (the spread between runs); "
             "one device: ours on the whole tensors on rank 0 (one thread, the other ranks idle), "
             "interleaved with the rest: the sharded steps' ratio to it is their scaling "
             "(W ranks on W cores: 1/W at best; W=4 here shares fewer cores)",
             "CPU flags that set bf16 matmul speed (Newton-Schulz is most of the step: see "
             f"matmul_share): {', '.join(f'{k}={v}' for k, v in flags.items())}"
             + ("" if flags.get("avx512_bf16") or flags.get("amx_bf16") else
                "; no native bf16 matmul here: torch runs its own loops, and absolute times "
                "are far from a modern CPU's"),
             "one intra-op thread per rank; on this machine ranks share "
             f"{os.cpu_count()} cores, so W=4 and any concurrent load blur the ratios",
             ns_kernels()]
    if not have:
        notes[1] = "CPU flags: /proc/cpuinfo not readable; avx512_bf16 / amx presence unknown"
    if src is None:
        rows = [{"case": c, "world": w, "status": "peer not installed"}
                for w in (2, 4) for c in ("dense", "moe")]
        notes.append(DION_NOT_INSTALLED)
        return result("muon_dion", rows, notes, cpu_flags=flags, wall_s=time.perf_counter() - t0)
    steps, repeats = (8, 1) if quick else (20, 3)
    rows, headline = [], []
    for w in (2, 4):
        for case in ("dense", "moe"):
            r = _row(w, steps, case, src, repeats)
            rows.append(r)
            headline += [
                {"comparison": f"Muon on fully_shard / dion.Muon on FSDP2, {case}, W={w}",
                 "ratio": r["ratio_fully_shard_vs_dion"]},
                {"comparison": f"Muon on FSDP2 / dion.Muon on FSDP2, {case}, W={w}",
                 "ratio": r["ratio_fsdp2_vs_dion"]},
                {"comparison": f"Muon on fully_shard at W={w} / Muon on one device (one thread), {case}",
                 "ratio": r["ratio_fully_shard_vs_one_device"]},
                {"comparison": f"Muon on FSDP2 at W={w} / Muon on one device (one thread), {case}",
                 "ratio": r["ratio_fsdp2_vs_one_device"]},
            ]
        if (nr := not_run_row(w)) is not None:
            rows.append(nr)
    return result("muon_dion", rows, notes, headline=headline, cpu_flags=flags,
                  wall_s=time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> dict:
    return cli(run, "muon_dion", argv)


if __name__ == "__main__":
    main()
