"""Scale model: LLaMA-3-70B on 1,024 ranks with HSDP, this library's layout vs FSDP2's.

    python -m tools.scale_model [--quick|--full] [--out benchmarks/out/scale_model.json]

Nothing here runs at scale: per-step bytes, padding and Newton-Schulz flops are counted
exactly from the plans ``plan_buffer`` makes for the 82 fully_shard groups of
LLaMA-3-70B (``benchmarks.model_shapes.llama3_70b_model``) and from FSDP2's ``Shard(0)`` layout;
times are those counts divided by per-byte and per-flop rates, either the rates of a
stated reference cluster (``CLUSTER``: assumptions) or the rates measured on this
machine in the same run (gloo over loopback and one CPU core: context only, they are
not a cluster). Every assumption is listed in the result's notes.

Two HSDP meshes of 1,024 ranks: 128 replicas x 8 shards (a shard group is one 8-GPU
node: NVLink) and 16 replicas x 64 shards (a shard group spans 8 nodes: InfiniBand).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.distributed as dist

from benchmarks._common import cli, current_device, result, spawn, stats, synchronize
from benchmarks.model_shapes import ParamShape, llama3_70b_model, unit_for
from vefsdp_optim.sharding import RaggedShard, TensorSpec, plan_buffer

__all__ = ["CLUSTER", "MESHES", "estimate", "measure_rates", "muon_ns_flops", "run"]

WORLD = 1024
MESHES = ((128, 8), (16, 64))  # (replicas, shards), replicas * shards = WORLD
ALIGN = 16
NS_STEPS = 5
PARAM_BYTES, GRAD_BYTES, MUON_RETURN_BYTES = 2, 4, 2  # bf16 all-gather, fp32 reduce, bf16 update

# Reference cluster: ASSUMPTIONS, not measurements (H100 SXM nodes of 8 GPUs).
CLUSTER = {
    "nvlink_busbw_GBps": 360.0,  # NVLink 4: 450 GB/s per direction per GPU, ~80% achieved
    "ib_busbw_GBps": 40.0,  # one 400 Gb/s NDR port per GPU = 50 GB/s, ~80% achieved
    "gpus_per_node": 8,
    "bf16_tflops": 400.0,  # H100 SXM dense bf16 peak 989 TFLOP/s, ~40% on NS matmuls
}

# Requirement kind (model_shapes.UNIT_KINDS) per optimizer
OPTIMIZERS = {"AdamW": "elementwise", "AdamW8bit": "flat256", "Shampoo": "rows1024", "Muon": "whole"}


# -- exact counts ---------------------------------------------------------------------


def muon_ns_flops(shape: tuple[int, ...], steps: int = NS_STEPS) -> float:
    """Flops of ``steps`` quintic Newton-Schulz iterations on the (dim 0, rest) matrix:
    per iteration X X^T (2 s^2 l), G G (2 s^3) and (.) X (2 s^2 l), s <= l the sides."""
    m, n = shape[0], math.prod(shape[1:])
    s, lg = min(m, n), max(m, n)
    return float(steps) * (4.0 * s * s * lg + 2.0 * s**3)


def _fsdp2_shard(p: ParamShape, s: int) -> int:
    """Elements per rank of one parameter under FSDP2 Shard(0): dim 0 padded to S rows."""
    return -(-p.shape[0] // s) * math.prod(p.shape[1:])


def _moved(src: RaggedShard, dst: RaggedShard) -> int:
    """Elements whose rank differs between two layouts of one tensor."""
    stay = 0
    for (a0, n0), (a1, n1) in zip(src.extents, dst.extents, strict=True):
        stay += max(0, min(a0 + n0, a1 + n1) - max(a0, a1))
    return src.numel - stay


def _torchao_state_bytes(local: int) -> float:
    """torchao AdamW8bit state of a local shard: 8-bit (2 codes + 2 fp32 scales per 256)
    only when the local numel is >= 4096 and a multiple of 256, else two fp32 moments."""
    if local >= 4096 and local % 256 == 0:
        return local * (2 + 8 / 256)
    return local * 8.0


def _plan_counts(groups: list[list[ParamShape]], s: int) -> dict[str, Any]:
    """Per optimizer: shard size summed over groups (elements per rank) and padding."""
    numel = sum(math.prod(p.shape) for g in groups for p in g)
    out: dict[str, Any] = {"numel": numel}
    for opt, kind in OPTIMIZERS.items():
        m = pad = 0
        for g in groups:
            plan = plan_buffer([TensorSpec(p.name, p.shape, unit_for(p, kind)) for p in g], s, ALIGN)
            m += plan.shard_size
            pad += plan.padding
        out[opt] = {"m": m, "padding": pad}
    m2 = sum(_fsdp2_shard(p, s) for g in groups for p in g)
    out["FSDP2"] = {"m": m2, "padding": s * m2 - numel}
    return out


def _exchange_counts(groups: list[list[ParamShape]], s: int) -> dict[str, Any]:
    """Optimizer-side counts on FSDP2's layout and on the elementwise plan."""
    mats = [p for g in groups for p in g if p.matrix]
    shampoo_moved = flat_moved = 0
    ao_state = ours_state = 0.0
    for p in (p for g in groups for p in g):
        src = RaggedShard.shard0(p.shape, s)
        if p.matrix:
            shampoo_moved += _moved(src, src.snapped(unit_for(p, "rows1024")))
        flat_moved += _moved(src, src.snapped(256))
        for r in range(s):
            ao_state += _torchao_state_bytes(src.local(r)[1])
        ours_state += math.prod(p.shape) * (2 + 8 / 256)
    # Muon owners over the elementwise plan's layouts, balancing NS flops
    from vefsdp_optim.comm import assign_owners

    layouts, flops = [], []
    for g in groups:
        plan = plan_buffer([TensorSpec(p.name, p.shape, 1) for p in g], s, ALIGN)
        for p in g:
            if p.matrix:
                layouts.append(plan.layout(p.name))
                flops.append(muon_ns_flops(p.shape))
    own = assign_owners(layouts, flops)
    return {
        "shampoo_moved": shampoo_moved, "flat256_moved": flat_moved,
        "torchao_state_per_rank": ao_state / s, "ours8bit_state_per_rank": ours_state / s,
        "muon_owner_moved": own.elements_moved, "muon_all_gather_recv_per_rank": sum(
            math.prod(p.shape) - math.prod(p.shape) // s for p in mats),
        "ns_flops_total": sum(flops), "ns_flops_owner_max": max(own.loads),
        "owner_max_over_mean": own.max_over_mean,
    }


# -- rates ----------------------------------------------------------------------------


def _bw(s: int, rates: dict[str, float]) -> float:
    """Bytes/s of a collective over a shard group of ``s`` ranks (NVLink inside a node)."""
    key = "nvlink_busbw_GBps" if s <= rates["gpus_per_node"] else "ib_busbw_GBps"
    return rates[key] * 1e9


def estimate(rates: dict[str, float], quick: bool = True) -> list[dict[str, Any]]:
    """Per (mesh, optimizer, layout) row: per-rank bytes per step and their time at
    ``rates`` (CLUSTER's keys), padding, and Muon's per-rank Newton-Schulz flops."""
    groups = llama3_70b_model()
    return [row for r_, s in MESHES for row in _mesh_rows(groups, r_, s, rates)]


def _mesh_rows(groups: list[list[ParamShape]], r_: int, s: int, rates: dict[str, float]) -> list[dict[str, Any]]:
    rows = []
    plans = _plan_counts(groups, s)
    ex = _exchange_counts(groups, s)
    bw_shard, bw_rep = _bw(s, rates), rates["ib_busbw_GBps"] * 1e9
    numel = plans["numel"]

    def fsdp_bytes(m: int) -> dict[str, float]:
        ag = 2 * (s - 1) * m * PARAM_BYTES  # forward + backward re-gather
        rs = (s - 1) * m * GRAD_BYTES
        ar = 2 * (r_ - 1) / r_ * m * GRAD_BYTES  # replicas all-reduce the shard
        return {"ag_rs_GB": (ag + rs) / 1e9, "replica_allreduce_GB": ar / 1e9,
                "fsdp_s": (ag + rs) / bw_shard + ar / bw_rep}

    def row(opt: str, layout: str, m: int, pad: int, opt_bytes: float, ns: float | None,
            **extra: Any) -> dict[str, Any]:
        fb = fsdp_bytes(m)
        d = {"mesh": f"{r_}x{s}", "optimizer": opt, "layout": layout,
             "padding_pct": 100 * pad / numel, **fb,
             "optimizer_exchange_GB": opt_bytes / 1e9,
             "est_comm_s": fb["fsdp_s"] + opt_bytes / bw_shard}
        if ns is not None:
            d["ns_TFLOP_per_rank"] = ns / 1e12
            d["est_ns_s"] = ns / (rates["bf16_tflops"] * 1e12)
        d.update(extra)
        return d

    f2 = plans["FSDP2"]
    # exchange bytes per rank: elements moved / S ranks, out and back
    rows.append(row("AdamW", "ours: elementwise plan", plans["AdamW"]["m"], plans["AdamW"]["padding"], 0, None))
    rows.append(row("AdamW", "FSDP2 Shard(0)", f2["m"], f2["padding"], 0, None))
    rows.append(row("AdamW8bit", "ours: FlatBlocks(256) plan", plans["AdamW8bit"]["m"],
                    plans["AdamW8bit"]["padding"], 0, None,
                    state_GB_per_rank=ex["ours8bit_state_per_rank"] / 1e9))
    rows.append(row("AdamW8bit", "ours on FSDP2 Shard(0): boundary exchange", f2["m"], f2["padding"],
                    ex["flat256_moved"] / s * 2 * GRAD_BYTES, None,
                    state_GB_per_rank=ex["ours8bit_state_per_rank"] / 1e9))
    rows.append(row("AdamW8bit", "torchao on FSDP2 Shard(0): per-shard blocks", f2["m"], f2["padding"],
                    0, None, state_GB_per_rank=ex["torchao_state_per_rank"] / 1e9))
    rows.append(row("Shampoo", "ours: RowBlocks(1024) plan", plans["Shampoo"]["m"],
                    plans["Shampoo"]["padding"], 0, None))
    rows.append(row("Shampoo", "FSDP2 Shard(0) + redistribution to 1024-row bands", f2["m"],
                    f2["padding"], ex["shampoo_moved"] / s * 2 * GRAD_BYTES, None))
    own_bytes = ex["muon_owner_moved"] / s * (GRAD_BYTES + MUON_RETURN_BYTES)
    rows.append(row("Muon", "ours: whole-matrix plan, owner = holder", plans["Muon"]["m"],
                    plans["Muon"]["padding"], 0, ex["ns_flops_owner_max"],
                    owner_max_over_mean=ex["owner_max_over_mean"]))
    rows.append(row("Muon", "ours: elementwise plan + owner exchange", plans["AdamW"]["m"],
                    plans["AdamW"]["padding"], own_bytes, ex["ns_flops_owner_max"],
                    owner_max_over_mean=ex["owner_max_over_mean"]))
    rows.append(row("Muon", "FSDP2 Shard(0) + all-gather, every rank computes", f2["m"], f2["padding"],
                    ex["muon_all_gather_recv_per_rank"] * GRAD_BYTES, ex["ns_flops_total"]))
    return rows


def _rates_worker(nbytes: int, iters: int) -> dict[str, dict[str, float]]:
    device = current_device()
    w, group = dist.get_world_size(), dist.group.WORLD
    n = nbytes // 4
    x = torch.randn(n, device=device)
    out = torch.empty(n * w, device=device)
    a2a_out = torch.empty_like(x)
    # the newer names where this torch has them (the old ones are deprecated in 2.13)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    ops = {
        "all_gather": lambda: gather(out, x, group=group),
        "reduce_scatter": lambda: scatter(x, out, group=group),
        "all_to_all": lambda: dist.all_to_all_single(a2a_out, x, group=group),
    }
    res = {}
    for name, fn in ops.items():
        fn()
        ts = []
        for _ in range(iters):
            dist.barrier(group=group)
            synchronize(device)
            t0 = time.perf_counter()
            fn()
            synchronize(device)
            ts.append(time.perf_counter() - t0)
        moved = (w - 1) * nbytes if name != "all_to_all" else (w - 1) / w * nbytes
        res[name] = stats([moved / t / 1e9 for t in ts])  # GB/s per rank, bus-bandwidth style
    return res


def measure_rates(quick: bool = True) -> dict[str, Any]:
    """This machine's per-byte (W = 2 spawned ranks) and per-flop (bf16 matmul) rates."""
    comm = spawn(_rates_worker, 2, (8 if quick else 64) << 20, 5 if quick else 20)[0]
    device = current_device()
    a = torch.randn(512, 512, device=device, dtype=torch.bfloat16)
    ts = []
    for _ in range(4 if quick else 10):
        synchronize(device)
        t0 = time.perf_counter()
        a @ a
        synchronize(device)
        ts.append(time.perf_counter() - t0)
    flops = stats([2 * 512**3 / t / 1e12 for t in ts[1:]])
    return {"comm_GBps": comm, "bf16_matmul_TFLOPs": flops, "device": device,
            "threads": torch.get_num_threads()}


def _findings(rows: list[dict[str, Any]]) -> list[str]:
    """What the counts say, in words (computed from the rows, not typed in)."""
    out = []
    for r_, s in MESHES:
        mesh = f"{r_}x{s}"
        g = {r["layout"]: r for r in rows if r["mesh"] == mesh}
        f2 = g["FSDP2 Shard(0)"]
        mw, me = g["ours: whole-matrix plan, owner = holder"], g["ours: elementwise plan + owner exchange"]
        ag = g["FSDP2 Shard(0) + all-gather, every rank computes"]
        sh, shf = g["ours: RowBlocks(1024) plan"], g["FSDP2 Shard(0) + redistribution to 1024-row bands"]
        out.append(
            f"{mesh}: FSDP2 pads {f2['padding_pct']:.3g}%"
            + (f" (every LLaMA-3-70B dim 0 divides by {s})" if f2["padding_pct"] == 0 else "")
            + "; "
            f"Muon: owner exchange moves {me['optimizer_exchange_GB']:.3g} GB per rank vs "
            f"{ag['optimizer_exchange_GB']:.3g} GB for all-gather, and runs "
            f"{me['ns_TFLOP_per_rank']:.4g} vs {ag['ns_TFLOP_per_rank']:.4g} TFLOP of Newton-Schulz "
            f"per rank (est. {me['est_comm_s'] + me['est_ns_s']:.3g} s vs "
            f"{ag['est_comm_s'] + ag['est_ns_s']:.3g} s of communication + NS per step); a "
            f"whole-matrix plan per layer group would pad {mw['padding_pct']:.3g}% (a layer has 7 "
            f"matrices for {s} ranks), so the elementwise plan + owner exchange is the one to use; "
            f"Shampoo: a RowBlocks(1024) plan per layer pads {sh['padding_pct']:.3g}% while "
            f"FSDP2's layout + band redistribution moves {shf['optimizer_exchange_GB']:.3g} GB "
            f"per rank (est. {sh['est_comm_s']:.3g} s vs {shf['est_comm_s']:.3g} s)")
    return out


def run(quick: bool = True) -> dict:
    t0 = time.perf_counter()
    measured = measure_rates(quick)
    rows = estimate(CLUSTER, quick)
    here = {"nvlink_busbw_GBps": measured["comm_GBps"]["all_gather"]["median"],
            "ib_busbw_GBps": measured["comm_GBps"]["all_gather"]["median"],
            "gpus_per_node": CLUSTER["gpus_per_node"],
            "bf16_tflops": measured["bf16_matmul_TFLOPs"]["median"]}
    for r, h in zip(rows, estimate(here, quick), strict=True):
        r["est_comm_s_at_measured_rates"] = h["est_comm_s"]
        if "est_ns_s" in h:
            r["est_ns_s_at_measured_rates"] = h["est_ns_s"]
    measured_rows = [{"quantity": f"{k} GB/s per rank (W=2, {measured['device']})", "value": v}
                     for k, v in measured["comm_GBps"].items()]
    measured_rows.append({"quantity": f"bf16 512^3 matmul TFLOP/s ({measured['device']}, "
                                      f"{measured['threads']} threads)",
                          "value": measured["bf16_matmul_TFLOPs"]})
    by = {(r["mesh"], r["optimizer"], r["layout"].split(":")[0]): r for r in rows}
    headline = []
    for r_, s in MESHES:
        mesh = f"{r_}x{s}"
        ours = by[mesh, "Muon", "ours"]  # the whole-matrix plan row comes first
        peer = by[mesh, "Muon", "FSDP2 Shard(0) + all-gather, every rank computes"]
        headline.append({"comparison": f"scale model {mesh}: Muon NS flops per rank, owner / every rank",
                         "ratio": ours["ns_TFLOP_per_rank"] / peer["ns_TFLOP_per_rank"]})
        own = next(r for r in rows if r["mesh"] == mesh and r["layout"].startswith("ours: elementwise plan + owner"))
        headline.append({"comparison": f"scale model {mesh}: Muon optimizer bytes per rank, "
                                       "owner exchange / all-gather",
                         "ratio": own["optimizer_exchange_GB"] / peer["optimizer_exchange_GB"]})
        sh = by[mesh, "Shampoo", "ours"]
        shf = by[mesh, "Shampoo", "FSDP2 Shard(0) + redistribution to 1024-row bands"]
        headline.append({"comparison": f"scale model {mesh}: Shampoo est. comm s, RowBlocks(1024) plan "
                                       "/ FSDP2 layout + band redistribution",
                         "ratio": sh["est_comm_s"] / shf["est_comm_s"]})
    notes = _findings(rows) + [
        f"LLaMA-3-70B: {len(llama3_70b_model())} fully_shard groups (embedding, 80 layers, "
        "norm + lm_head), shapes from its public config; planner align 16; FSDP2 pads dim 0 "
        "of each parameter to a multiple of S",
        f"HSDP on {WORLD} ranks: meshes (replicas x shards) {MESHES}; optimizer state and "
        "compute are sharded over the S ranks of a shard group, replicas repeat it",
        "per step and rank: parameters all-gathered twice in bf16 (forward, backward "
        "re-gather: reshard_after_forward=True), gradients reduce-scattered once in fp32 and "
        "all-reduced across replicas in fp32 (ring: 2(R-1)/R x shard bytes); ring all-gather / "
        "reduce-scatter move (S-1) x shard bytes per rank",
        "optimizer exchange: bytes per rank = elements that change rank / S, there and back "
        "(fp32 both ways; Muon: fp32 update to the owner, bf16 orthogonalized update back); "
        "all-gather Muon: every rank receives (S-1)/S of every matrix in fp32 and runs NS on all",
        "AdamW8bit state: ours 2 B/elem + 2 fp32 scales per 256-element block on whole blocks; "
        "torchao on FSDP2 quantizes a local shard only when its numel is >= 4096 and a multiple "
        "of 256, otherwise keeps two fp32 moments (8 B/elem)",
        f"Muon NS flops: {NS_STEPS} quintic iterations, 4 s^2 l + 2 s^3 each (s <= l the matrix "
        "sides); owners chosen by vefsdp_optim.comm.assign_owners over all matrices of the model "
        "in one shard group, balancing those flops",
        "reference cluster rates are ASSUMPTIONS: " + ", ".join(f"{k}={v}" for k, v in CLUSTER.items())
        + "; a shard group of <= 8 ranks uses NVLink, larger ones and replica all-reduce use IB",
        "est_*_at_measured_rates columns use this machine's measured gloo loopback all-gather "
        "rate and CPU bf16 matmul rate for every link: context for how far this box is from a "
        "cluster, not a prediction",
        "not modelled: overlap of communication with compute, latency terms, activation "
        "memory, the embedding's and head's compute",
    ]
    return result("scale_model", rows, notes, headline=headline, measured_here=measured_rows,
                  cluster_assumptions=[CLUSTER], wall_s=time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> dict:
    return cli(run, "scale_model", argv)


if __name__ == "__main__":
    main()
