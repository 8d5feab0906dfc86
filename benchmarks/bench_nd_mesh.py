"""Optimizer steps on FSDP2 x tensor parallel (dp 2 x tp 2, W = 4; gloo on the CPU).

The benchmark GPT's hidden matrices (4 layers at d = 256: qkv colwise, proj rowwise,
fc colwise, out rowwise) and its norms (replicated over tp), parallelized with torch's
``parallelize_module`` and sharded with FSDP2 over dp, so the parameters carry FSDP2 +
TP's placements (``(_StridedShard(0), Shard(0))``, ``(Shard(0), Shard(1))``,
``(Shard(0), Replicate())``). The same full gradients every step.

* each of our optimizers against torch.optim.AdamW (foreach) on the same parameters,
  and AdamW, AdamW8bit and Muon on our fully_shard + TP (gradients set directly, so
  AdamW's fused whole-buffer path does not apply);
* our Muon (whole matrices on owners over all 4 ranks, bitwise equal to one device)
  against our Muon on one device with one thread (the same matrices, whole), and
  against torch.optim.Muon on the DTensors (Newton-Schulz on the shards: not equal to
  one device); Muon with ``ns_steps=0`` isolates the exchange and bookkeeping.

    python -m benchmarks.bench_nd_mesh [--quick|--full]
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from ._common import cli, current_device, interleave, paired_ratio, result, spawn, stats

D, LAYERS = 256, 4


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.proj = nn.Linear(D, D, bias=False)
        self.fc = nn.Linear(D, 4 * D, bias=False)
        self.out = nn.Linear(4 * D, D, bias=False)


def _model(mesh, ours: bool = False) -> nn.Module:  # noqa: ANN001
    from torch.distributed.fsdp import fully_shard

    if ours:
        from vefsdp_optim import fully_shard  # noqa: F811
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    m = nn.ModuleList([_Layer() for _ in range(LAYERS)])
    plan = {"qkv": ColwiseParallel(), "proj": RowwiseParallel(), "fc": ColwiseParallel(),
            "out": RowwiseParallel()}
    for layer in m:
        parallelize_module(layer, mesh["tp"], plan)
        fully_shard(layer, mesh=mesh["dp"])
    return m


def _set_grads(params: list[nn.Parameter]) -> None:
    from vefsdp_optim import ShardedParameter
    from vefsdp_optim.comm import sharded_view

    for i, p in enumerate(params):
        full = torch.randn(p.shape, generator=torch.Generator().manual_seed(i))
        if isinstance(p, ShardedParameter):
            lay = p.ragged_layout
            p.grad = p.with_local(full.reshape(-1)[lay.local_index(p.shard_rank)].clone())
            continue
        p.grad = torch.zeros_like(p)
        view = sharded_view(p.grad)
        view.local.copy_(full.reshape(-1)[view.layout.local_index(view.rank)])


def _optimizers(name: str, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    import vefsdp_optim as vo

    mats = [p for p in params if p.ndim == 2]
    rest = [p for p in params if p.ndim != 2]
    if name == "torch_adamw":
        return torch.optim.AdamW(params, foreach=True)
    if name == "torch_muon":
        return torch.optim.Muon(mats)
    if name.startswith("muon"):
        kw = {"ns_steps": 0} if name == "muon_ns0" else {}
        return vo.Muon([{"params": mats, **kw}, {"params": rest, "use_muon": False}])
    cls = {"adamw": vo.AdamW, "adamw8bit": vo.AdamW8bit, "adam8bit": vo.Adam8bit, "shampoo": vo.Shampoo}[name]
    return cls(params)


NAMES = ("torch_adamw", "adamw", "adamw8bit", "adam8bit", "shampoo", "muon", "muon_ns0", "torch_muon")
#: the same optimizers on our fully_shard + TP (the same placements inside, BoxShard runs outside)
OURS = ("adamw", "adamw8bit", "muon")


def _worker(steps: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(current_device(), (2, 2), mesh_dim_names=("dp", "tp"))
    runners = {}
    for name in NAMES:
        params = list(_model(mesh).parameters())
        _set_grads(params)
        runners[name] = _optimizers(name, params).step
    for name in OURS:
        params = list(_model(mesh, ours=True).parameters())
        _set_grads(params)
        runners[f"{name}_fully_shard"] = _optimizers(name, params).step
    times = interleave(runners, steps, warmup=1, group=dist.group.WORLD, device=current_device())
    placements = sorted({str(p.placements) for p in _model(mesh).parameters()})
    return {"times": times, "placements": placements}


def _one_device(steps: int) -> dict:
    """Our Muon on the whole matrices, one process, one thread."""
    import vefsdp_optim as vo

    torch.set_num_threads(1)
    torch.manual_seed(0)
    m = nn.ModuleList([_Layer() for _ in range(LAYERS)])
    params = list(m.parameters())
    for i, p in enumerate(params):
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(i))
    mats = [p for p in params if p.ndim == 2]
    rest = [p for p in params if p.ndim != 2]
    opt = vo.Muon([{"params": mats}, {"params": rest, "use_muon": False}])
    return interleave({"muon_one_device": opt.step}, steps, warmup=1)


def run(quick: bool = True) -> dict:
    """quick: 5 timed steps; full: 20."""
    t0 = time.perf_counter()
    steps = 5 if quick else 20
    res = spawn(_worker, 4, steps)[0]
    one = spawn(_one_device, 1, steps)[0]
    t = res["times"]
    rows = []
    for name in NAMES[1:]:
        peer = "torch_adamw"
        rows.append({"optimizer": name, "ms": stats(t[name], 1e3),
                     "ratio_vs_torch_adamw": paired_ratio(t[name], t[peer])})
    for name in OURS:
        rows.append({"optimizer": f"{name} (our fully_shard + TP)", "ms": stats(t[f"{name}_fully_shard"], 1e3),
                     "ratio_vs_torch_adamw": paired_ratio(t[f"{name}_fully_shard"], t["torch_adamw"])})
    muon_vs_one = stats(t["muon"], 1e3)["median"] / stats(one["muon_one_device"], 1e3)["median"]
    rows.append({"optimizer": "muon (one device, 1 thread)", "ms": stats(one["muon_one_device"], 1e3),
                 "ratio_vs_one_device": muon_vs_one})
    headline = [
        {"comparison": "AdamW step / torch.optim.AdamW on FSDP2 + TP, dp 2 x tp 2",
         "ratio": rows[0]["ratio_vs_torch_adamw"]},
        {"comparison": "Muon step on FSDP2 + TP (W=4) / Muon on one device (medians)", "ratio": muon_vs_one},
        {"comparison": "Muon step / torch.optim.Muon (on shards, not exact) on FSDP2 + TP",
         "ratio": paired_ratio(t["muon"], t["torch_muon"])},
    ]
    notes = [f"{LAYERS} layers at d = {D}: qkv / fc colwise, proj / out rowwise, norms replicated over "
             "tp; FSDP2 over dp; placements " + ", ".join(res["placements"]),
             "a step time is the slowest rank's; 4 ranks share the machine's cores (one thread each): "
             "against one device on one thread, 0.5x is the 2-core bound",
             "muon_ns0: Muon with ns_steps=0, the exchange and bookkeeping without Newton-Schulz"]
    return result("nd_mesh", rows, notes, headline=headline, wall_s=time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> dict:
    return cli(run, "nd_mesh", argv)


if __name__ == "__main__":
    main()
