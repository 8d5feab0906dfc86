"""Muon's step on an MoE model: vefsdp_optim.Muon on our fully_shard vs Microsoft Dion's
Muon and torch.optim.Muon, both on FSDP2, in the same run.

The model is the toy runs' MoE GPT (``vefsdp_optim.toy``'s TinyMoEGPT) at d = 256: per
block a fused QKV (512 x 256), the output projection, a router (8 x 256) and stacked
experts ``w_in`` [8, 512, 256] and ``w_out`` [8, 256, 512]; 2 blocks (4.6 M Muon
parameters, 91% of them experts). Every runner runs the same algorithm: each expert one
matrix, each dense weight one matrix (the fused QKV whole: Dion has no ``split_sizes``),
a quintic Newton-Schulz in bfloat16 (5 steps; Dion's with its own per-step coefficient
schedule), Nesterov momentum 0.95, lr 0.02 scaled to AdamW's RMS (``match_rms_adamw`` /
Dion's ``rms_norm``), weight decay 0.1. Runners:

* ``ours_fully_shard``: vefsdp_optim.Muon, experts ``flatten=False``, on parameters of
  this library's ``fully_shard`` (gradients from a real backward into its buffer);
* ``ours_fsdp2``: the same optimizer on FSDP2 parameters;
* ``dion_fsdp2``: Dion's Muon (``flatten=False``: 3-D tensors as batches of matrices,
  ``use_polar_express=False``) on FSDP2 parameters, ``distributed_mesh`` the FSDP mesh;
* ``torch_fsdp2``: torch.optim.Muon on FSDP2 parameters with every expert its own 2-D
  parameter (torch's Muon takes only 2-D ones; it runs on the DTensors through their
  dispatch).

On gloo CPU ranks, W = 2 and 4; the same gradients every step, the runners interleaved in
alternating order, a step's time is the slowest rank's. Each row ends with the largest
difference of each peer's parameters from ours after the run, relative to their largest
magnitude: not 0 for torch's, whose Newton-Schulz runs through DTensor's sharded matmuls
(on one device torch.optim.Muon and ours give the same bits), nor for Dion's, whose
coefficients differ.

Dion is not in the package index: point ``VEFSDP_DION_SRC`` at a checkout of
github.com/microsoft/dion (the folder holding ``dion/``); without it the Dion column is
left out and the other runners still run.

    VEFSDP_DION_SRC=/path/to/dion python -m benchmarks.bench_muon_moe [--quick|--full]
"""

from __future__ import annotations

import os
import time
from typing import Any

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

D, LAYERS, EXPERTS, D_FF, HEADS, KV_HEADS = 256, 2, 8, 512, 4, 2
HP = dict(lr=0.02, weight_decay=0.1)


def moe_matrices() -> list[tuple[str, torch.Tensor]]:
    """The Muon parameters (name, initial value) of the MoE GPT, in model order."""
    from vefsdp_optim.toy._models import TinyMoEGPT

    torch.manual_seed(0)
    model = TinyMoEGPT(vocab=256, seq=64, d=D, n_layers=LAYERS, heads=HEADS, kv_heads=KV_HEADS,
                       experts=EXPERTS, d_ff=D_FF)
    return [(n, p.detach().clone()) for n, p in model.named_parameters()
            if p.ndim >= 2 and "embed" not in n and "head" not in n]


def _is_expert(name: str) -> bool:
    return name.endswith(("w_in", "w_out"))


def _full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()


def _worker(world: int, steps: int, src: str | None) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    import vefsdp_optim

    device = current_device()
    mesh = init_device_mesh(torch.device(device).type, (world,))
    named = moe_matrices()
    init = [t.to(device) for _, t in named]
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(t.shape, generator=g).to(device) for t in init]
    experts = [_is_expert(n) for n, _ in named]

    def groups(ps: list[torch.Tensor]) -> list[dict[str, Any]]:
        return [{"params": [p for p, e in zip(ps, experts, strict=True) if e], "flatten": False},
                {"params": [p for p, e in zip(ps, experts, strict=True) if not e]}]

    ours_kw = dict(adjust_lr_fn="match_rms_adamw", **HP)
    probe = GradProbe(init)
    vefsdp_optim.fully_shard(probe, mesh=mesh)
    ours_fs = vefsdp_optim.Muon(groups(list(probe.parameters())), **ours_kw)
    probe(grads).backward()
    ps_fsdp2 = fsdp2_params(init, grads, mesh)
    ours_fsdp2 = vefsdp_optim.Muon(groups(ps_fsdp2), **ours_kw)
    # torch.optim.Muon: every expert its own 2-D parameter
    split_init, split_grads = [], []
    for t, gr, e in zip(init, grads, experts, strict=True):
        split_init += list(t.unbind(0)) if e else [t]
        split_grads += list(gr.unbind(0)) if e else [gr]
    ps_torch = fsdp2_params([t.contiguous() for t in split_init], [t.contiguous() for t in split_grads], mesh)
    torch_muon = torch.optim.Muon(ps_torch, adjust_lr_fn="match_rms_adamw", momentum=0.95, nesterov=True, **HP)
    runners = {"ours_fully_shard": ours_fs.step, "ours_fsdp2": ours_fsdp2.step, "torch_fsdp2": torch_muon.step}
    peers = {"torch_fsdp2": ps_torch}
    if src is not None:
        dion = import_dion(src)
        ps_dion = fsdp2_params(init, grads, mesh)
        peer = dion.Muon(ps_dion, distributed_mesh=mesh, mu=0.95, nesterov=True, flatten=False,
                         adjust_lr="rms_norm", use_polar_express=False, **HP)
        runners["dion_fsdp2"] = peer.step
        peers["dion_fsdp2"] = ps_dion
    times = interleave(runners, steps, warmup=2, group=dist.group.WORLD, device=device)
    # agreement after the same steps: each peer's parameters against ours on fully_shard
    ours = [_full(p) for p in probe.parameters()]
    diff = {}
    for name, ps in peers.items():
        full = [_full(p) for p in ps]
        if name == "torch_fsdp2":  # restack the experts
            it, full = iter(full), []
            for t, e in zip(init, experts, strict=True):
                full.append(torch.stack([next(it) for _ in range(t.shape[0])]) if e else next(it))
        diff[name] = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(full, ours, strict=True))
    return {"times": times, "diff": diff}


def _row(world: int, steps: int, src: str | None) -> dict[str, Any]:
    out = spawn(_worker, world, world, steps, src)[0]
    t = out["times"]
    row: dict[str, Any] = {"world": world, "steps": steps}
    for k in ("ours_fully_shard", "ours_fsdp2", "dion_fsdp2", "torch_fsdp2"):
        if k in t:
            row[f"{k}_ms"] = stats(t[k], 1e3)
    for peer in ("dion_fsdp2", "torch_fsdp2"):
        if peer in t:
            row[f"fully_shard_vs_{peer.split('_')[0]}"] = paired_ratio(t["ours_fully_shard"], t[peer])
    if "dion_fsdp2" in t:
        row["fsdp2_vs_dion"] = paired_ratio(t["ours_fsdp2"], t["dion_fsdp2"])
    row["rel_diff_vs_ours"] = {k: float(f"{v:.2g}") for k, v in out["diff"].items()}
    return row


def run(quick: bool = True) -> dict[str, Any]:
    """The MoE model's Muon step, ours vs Dion's and torch's, W = 2 and 4 (quick: 8 timed
    steps per world size; full: 30)."""
    t0 = time.perf_counter()
    src = dion_src()
    flags = cpu_flags()
    shapes = sorted({tuple(t.shape) for _, t in moe_matrices()})
    notes = [f"the MoE GPT's Muon matrices: {LAYERS} blocks, d={D}, {EXPERTS} experts of d_ff={D_FF} "
             f"(shapes {shapes}); experts as batches of matrices (ours and Dion: flatten=False; torch: "
             "one 2-D parameter per expert); fp32 parameters, bf16 quintic Newton-Schulz (5 steps) in all "
             "(Dion: its own coefficient schedule); "
             "the runners step in alternating order; a step time is the slowest rank's; ratios: median "
             "(p25-p75) of the per-step ratios ours / peer",
             "rel_diff_vs_ours: max |p_peer - p_ours| / max |p_ours| after the run, per peer (torch's "
             "Newton-Schulz runs on DTensors through sharded matmuls; on one device it equals ours bit for "
             "bit; Dion's coefficients differ)",
             "CPU flags that set bf16 matmul speed: " + ", ".join(f"{k}={v}" for k, v in flags.items()),
             f"one intra-op thread per rank; ranks share {os.cpu_count()} cores", ns_kernels()]
    if src is None:
        notes.append(DION_NOT_INSTALLED.replace("nothing was timed", "the Dion column is left out"))
    steps = 8 if quick else 30
    rows, headline = [], []
    for w in (2, 4):
        r = _row(w, steps, src)
        rows.append(r)
        if "fully_shard_vs_dion" in r:
            headline.append({"comparison": f"Muon on fully_shard / dion.Muon on FSDP2, MoE model, W={w}",
                             "ratio": r["fully_shard_vs_dion"]})
        headline.append({"comparison": f"Muon on fully_shard / torch.optim.Muon per expert on FSDP2, "
                                       f"MoE model, W={w}", "ratio": r["fully_shard_vs_torch"]})
        if (nr := not_run_row(w)) is not None:
            rows.append(nr)
    return result("muon_moe", rows, notes, headline=headline, cpu_flags=flags, wall_s=time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return cli(run, "muon_moe", argv)


if __name__ == "__main__":
    main()
