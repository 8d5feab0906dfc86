"""Optimizer step benchmarks on FSDP2 parameters (W = 2 and 4; gloo on the CPU, NCCL
with one CUDA device per rank).

Muon: vefsdp_optim.Muon vs torch.optim.Muon on the same FSDP2 model (DTensor
dispatch) vs an all-gather-then-every-rank-computes Muon. AdamW: vefsdp_optim.AdamW
vs torch.optim.AdamW (foreach) on the same FSDP2 parameters, and vefsdp_optim.AdamW on
the same parameters under vefsdp_optim.fully_shard (one fused update per store) vs
torch's on FSDP2. Interleaved, medians;
collectives per step and bytes moved counted by wrapping torch.distributed.

    python -m benchmarks.bench_optim [--quick|--full] [--out benchmarks/out/optim.json]
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ._common import (
    GradProbe,
    cli,
    current_device,
    device_for_world,
    fsdp2_params,
    interleave,
    not_run_row,
    paired_ratio,
    result,
    spawn,
    stats,
)

SHAPES = [(384, 256), (256, 384), (1024, 256), (256, 1024), (130, 257), (257,)]


def _count_collectives():
    """Wrap the c10d Python entry points; returns (counter, restore)."""
    names = ["all_to_all_single", "all_gather_into_tensor", "all_gather", "reduce_scatter_tensor",
             "all_reduce", "all_gather_object", "broadcast", "all_gather_single",
             "reduce_scatter_single"]
    counter = {"calls": 0, "bytes": 0}
    saved = {}
    for n in names:
        f = getattr(dist, n, None)
        if f is None:
            continue
        saved[n] = f

        def wrap(*a, _f=f, **k):
            counter["calls"] += 1
            for t in a[:2]:
                if isinstance(t, torch.Tensor):
                    counter["bytes"] += t.numel() * t.element_size()
                    break
            return _f(*a, **k)

        setattr(dist, n, wrap)

    def restore():
        for n, f in saved.items():
            setattr(dist, n, f)

    return counter, restore


class _FuncolCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts functional collectives (DTensor's redistributions go through these)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "c10d" in str(func.namespace) and "wait" not in str(func):
            self.calls += 1
        return func(*args, **(kwargs or {}))


@torch.no_grad()
def _allgather_muon_step(params, bufs, mesh, lr=1e-3, wd=0.1, momentum=0.95):
    """Every rank gathers every full update and runs Newton-Schulz on it (the naive way)."""
    from torch.distributed.tensor import DTensor

    from vefsdp_optim._math import muon_adjust_lr, zeropower_via_newtonschulz

    for p, buf in zip(params, bufs, strict=True):
        g = p.grad._local_tensor
        buf.lerp_(g, 1 - momentum)
        upd = g.lerp(buf, momentum)
        full = DTensor.from_local(upd, mesh, p.placements, shape=p.shape, stride=p.stride()).full_tensor()
        ortho = zeropower_via_newtonschulz(full.view(p.shape[0], -1))
        local = p._local_tensor
        rows = local.shape[0]
        start = dist.get_rank() * -(-p.shape[0] // dist.get_world_size())
        local.mul_(1 - lr * wd)
        local.add_(ortho[start:start + rows].reshape(local.shape), alpha=-muon_adjust_lr(lr, None, p.shape))


def _fully_shard_adamw(init: list[torch.Tensor], grads: list[torch.Tensor], mesh) -> tuple:  # noqa: ANN001
    """Our AdamW on our fully_shard parameters, gradients from a real backward (so they
    live in the group's gradient buffer and the fused path applies)."""
    import vefsdp_optim

    m = GradProbe(init)
    vefsdp_optim.fully_shard(m, mesh=mesh)
    opt = vefsdp_optim.AdamW(list(m.parameters()))
    m(grads).backward()
    return opt


def _worker(world: int, steps: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import vefsdp_optim

    device = current_device()
    mesh = init_device_mesh(torch.device(device).type, (world,))
    g = torch.Generator().manual_seed(0)
    init = [(torch.randn(s, generator=g) * 0.02).to(device) for s in SHAPES]
    grads = [torch.randn(s, generator=g).to(device) for s in SHAPES]

    def model():
        return fsdp2_params(init, grads, mesh)

    mats = lambda ps: [p for p in ps if p.ndim == 2]  # noqa: E731
    ps_ours, ps_torch, ps_ag, ps_aw, ps_taw = model(), model(), model(), model(), model()
    bufs = [torch.zeros_like(p.to_local()) for p in mats(ps_ag)]
    adamw_fs = _fully_shard_adamw(init, grads, mesh)
    runners = {
        "muon_ours": (vefsdp_optim.Muon(mats(ps_ours)).step),
        "muon_torch": (torch.optim.Muon(mats(ps_torch)).step),
        "muon_allgather": (lambda: _allgather_muon_step(mats(ps_ag), bufs, mesh)),
        "adamw_ours": (vefsdp_optim.AdamW(ps_aw).step),
        "adamw_torch": (torch.optim.AdamW(ps_taw, foreach=True).step),
        "adamw_ours_fully_shard": adamw_fs.step,
    }
    comm = {}
    for k, fn in runners.items():  # warm-up + one counted step each
        fn()
        counter, restore = _count_collectives()
        mode = _FuncolCounter()
        try:
            with mode:
                fn()
        finally:
            restore()
        # the Python wrappers and the dispatcher both see c10d calls made through
        # torch.distributed; DTensor's own collectives are invisible to both here
        comm[k] = {"collectives": max(counter["calls"], mode.calls), "bytes_c10d": counter["bytes"]}
    times = interleave(runners, steps, warmup=0, group=dist.group.WORLD, device=device)
    if adamw_fs.fused_updates == 0:
        raise AssertionError("AdamW on fully_shard parameters did not take the fused path")
    # owner balance of our Muon
    from vefsdp_optim.comm import assign_owners, sharded_view

    views = [sharded_view(p) for p in mats(ps_ours)]
    own = assign_owners([v.layout for v in views], [float(s[0] * s[1] * min(s)) for s in SHAPES if len(s) == 2])
    return {"world_size": world, "times": times, "comm": comm,
            "owner_max_over_mean": own.max_over_mean}


def _row(world: int, steps: int) -> dict:
    res = spawn(_worker, world, world, steps)[0]
    t = res["times"]
    return {
        "device": device_for_world(world)[0], "world": world,
        "muon_ours_ms": stats(t["muon_ours"], 1e3), "muon_torch_ms": stats(t["muon_torch"], 1e3),
        "muon_allgather_ms": stats(t["muon_allgather"], 1e3),
        "ratio_muon_vs_torch_muon": paired_ratio(t["muon_ours"], t["muon_torch"]),
        "ratio_muon_vs_allgather_muon": paired_ratio(t["muon_ours"], t["muon_allgather"]),
        "adamw_ours_ms": stats(t["adamw_ours"], 1e3), "adamw_torch_ms": stats(t["adamw_torch"], 1e3),
        "ratio_adamw_vs_torch_adamw": paired_ratio(t["adamw_ours"], t["adamw_torch"]),
        "adamw_ours_fully_shard_ms": stats(t["adamw_ours_fully_shard"], 1e3),
        "ratio_adamw_fully_shard_vs_torch_adamw_fsdp2": paired_ratio(t["adamw_ours_fully_shard"],
                                                                     t["adamw_torch"]),
        "collectives_muon_ours/torch/allgather": "/".join(
            str(res["comm"][k]["collectives"]) for k in ("muon_ours", "muon_torch", "muon_allgather")),
        "owner_max_over_mean": res["owner_max_over_mean"],
    }


def run(quick: bool = True) -> dict:
    """Muon and AdamW steps on the same FSDP2 model, interleaved (quick: 5 timed steps;
    full: 20), at W = 2 and 4."""
    t0 = time.perf_counter()
    steps = 5 if quick else 20
    rows, headline = [], []
    for w in (2, 4):
        r = _row(w, steps)
        rows.append(r)
        headline += [
            {"comparison": f"Muon step / torch.optim.Muon on FSDP2, W={w}", "ratio": r["ratio_muon_vs_torch_muon"]},
            {"comparison": f"Muon step / all-gather Muon, W={w}", "ratio": r["ratio_muon_vs_allgather_muon"]},
            {"comparison": f"AdamW step / torch.optim.AdamW (foreach) on FSDP2, W={w}",
             "ratio": r["ratio_adamw_vs_torch_adamw"]},
            {"comparison": f"AdamW step on fully_shard (fused) / torch.optim.AdamW on FSDP2, W={w}",
             "ratio": r["ratio_adamw_fully_shard_vs_torch_adamw_fsdp2"]},
        ]
        if (nr := not_run_row(w)) is not None:
            rows.append(nr)
    notes = [f"parameters {SHAPES} (fp32), Muon on the 2-D ones; the same gradients every step; "
             "a step time is the slowest rank's; collectives counted on one step (DTensor's own "
             "redistributions are counted through the dispatcher)"]
    return result("optim", rows, notes, headline=headline, wall_s=time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> dict:
    return cli(run, "optim", argv)


if __name__ == "__main__":
    main()
