"""Muon step: vefsdp_optim.Muon vs Microsoft Dion's Muon (``dion.Muon``), same run.

Dion is not in the package index: point ``VEFSDP_DION_SRC`` at a checkout of
github.com/microsoft/dion (the folder holding ``dion/``); without it every row says
"peer not installed". Dion's code is imported from there at run time, never copied.

Cases, on gloo CPU ranks (W = 2; W = 4 with ``--full``):

* dense: the 16 hidden matrices of a 4-layer GPT (d = 256: qkv, proj, fc, out);
* moe: one MoE layer, experts ``[E, 512, 256]`` and ``[E, 256, 512]`` (E = 8; 6 at W = 4)
  as batches of matrices (``flatten=False`` for both optimizers).

Runners: ours on vefsdp_optim.fully_shard parameters (one group), ours on FSDP2
parameters, Dion's Muon on the same FSDP2 parameters (``use_polar_express=False``: the
quintic Newton-Schulz in bfloat16, 5 steps, as ours). The same gradients every step,
interleaved, a step's time is the slowest rank's; ratios are medians of paired ratios.

    VEFSDP_DION_SRC=/path/to/dion python -m benchmarks.bench_muon_dion [--quick|--full]
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

from ._common import (
    GradProbe,
    cli,
    current_device,
    fsdp2_params,
    interleave,
    not_run_row,
    paired_ratio,
    result,
    spawn,
    stats,
)

DION_ENV = "VEFSDP_DION_SRC"
D = 256


def _dense_shapes() -> list[tuple[int, ...]]:
    return [s for _ in range(4) for s in ((3 * D, D), (D, D), (4 * D, D), (D, 4 * D))]


def _moe_shapes(world: int) -> list[tuple[int, ...]]:
    e = 6 if world == 4 else 8
    return [(e, 2 * D, D), (e, D, 2 * D)]


def dion_src() -> str | None:
    """The Dion source tree named by VEFSDP_DION_SRC, or None when it is missing."""
    src = os.environ.get(DION_ENV)
    if src and os.path.isfile(os.path.join(src, "dion", "muon.py")):
        return src
    return None


def _worker(world: int, steps: int, case: str, src: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import vefsdp_optim

    if src not in sys.path:
        sys.path.insert(0, src)
    import dion

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
    runners = {"ours_fully_shard": ours_fs.step, "ours_fsdp2": ours_fsdp2.step, "dion_fsdp2": peer.step}
    times = interleave(runners, steps, warmup=1, group=dist.group.WORLD, device=device)
    return {"times": times, "shapes": shapes}


def _row(world: int, steps: int, case: str, src: str) -> dict:
    res = spawn(_worker, world, world, steps, case, src)[0]
    t = res["times"]
    return {
        "case": case, "world": world,
        "ours_fully_shard_ms": stats(t["ours_fully_shard"], 1e3),
        "ours_fsdp2_ms": stats(t["ours_fsdp2"], 1e3),
        "dion_fsdp2_ms": stats(t["dion_fsdp2"], 1e3),
        "ratio_fully_shard_vs_dion": paired_ratio(t["ours_fully_shard"], t["dion_fsdp2"]),
        "ratio_fsdp2_vs_dion": paired_ratio(t["ours_fsdp2"], t["dion_fsdp2"]),
    }


def run(quick: bool = True) -> dict:
    """Dense and MoE Muon steps vs Dion's (quick: W = 2, 5 timed steps; full: W = 2 and 4, 15)."""
    t0 = time.perf_counter()
    src = dion_src()
    notes = [f"dense: 16 matrices of a 4-layer GPT, d={D}; moe: experts {_moe_shapes(2)} (W=4: "
             f"{_moe_shapes(4)}), flatten=False; fp32 parameters, bf16 Newton-Schulz (5 quintic "
             "steps) in both; a step time is the slowest rank's; ratios: medians of paired ratios"]
    if src is None:
        rows = [{"case": c, "world": 2, "status": "peer not installed"} for c in ("dense", "moe")]
        notes.append(f"peer not installed: set {DION_ENV} to a checkout of github.com/microsoft/dion")
        return result("muon_dion", rows, notes, wall_s=time.perf_counter() - t0)
    steps = 5 if quick else 15
    rows, headline = [], []
    for w in (2,) if quick else (2, 4):
        for case in ("dense", "moe"):
            r = _row(w, steps, case, src)
            rows.append(r)
            headline += [
                {"comparison": f"Muon on fully_shard / dion.Muon on FSDP2, {case}, W={w}",
                 "ratio": r["ratio_fully_shard_vs_dion"]},
                {"comparison": f"Muon on FSDP2 / dion.Muon on FSDP2, {case}, W={w}",
                 "ratio": r["ratio_fsdp2_vs_dion"]},
            ]
        if (nr := not_run_row(w)) is not None:
            rows.append(nr)
    return result("muon_dion", rows, notes, headline=headline, wall_s=time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> dict:
    return cli(run, "muon_dion", argv)


if __name__ == "__main__":
    main()
