"""AdamW8bit against torch.optim.AdamW and torchao's AdamW8bit, CPU.

    python -m benchmarks.bench_adam8bit --out benchmarks/out/adam8bit.json [--steps 12]

1. One transformer-block-shaped set of parameters (D = 576, uneven rows, ~4.4 M fp32
   elements), the same random gradients fed to every optimizer. The optimizers step in
   turn (interleaved, after warm-up steps that include torchao's torch.compile), and the
   median step time of each is reported with ratios to torch.optim.AdamW. State bytes
   are counted from the state tensors themselves (torchao's 8-bit states: codes and
   scales; the shared 256-value code map is left out on both 8-bit sides).
2. Final loss after N steps of each optimizer on one toy regression (an MLP whose
   weights are above the 8-bit threshold, the same seed and data for all).
3. FSDP2 ``fully_shard`` at W = 2 (spawned gloo ranks): bytes this library's boundary
   exchange sends per AdamW8bit step (counted at ``all_to_all_single``), against the
   parameter bytes, and the median step time against torch.optim.AdamW on the same
   DTensors.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.tensor import DTensor

from vefsdp_optim._adam8bit import AdamW8bit

D = 576  # rows of 576 elements: a row boundary is a multiple of 256 only every 4 rows
FF = 4 * D + 3
SHAPES = {
    "norm1": (D,),
    "qkv": (3 * D + 5, D),
    "proj": (D, D),
    "norm2": (D,),
    "fc1": (FF, D),
    "fc1_bias": (FF,),
    "fc2": (D, FF),
}
STATE_8BIT_KEYS = ("exp_avg_codes", "exp_avg_absmax", "exp_avg_sq_codes", "exp_avg_sq_absmax")


def _torchao_adamw8bit():
    try:
        from torchao.optim import AdamW8bit as AoAdamW8bit
    except ImportError as e:  # reported in the JSON row
        return None, f"torchao not importable: {e}"
    import torchao

    return AoAdamW8bit, f"torchao {torchao.__version__}"


def _tensor_bytes(t: torch.Tensor) -> int:
    if isinstance(t, DTensor):
        return _tensor_bytes(t.to_local())
    if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor:
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(t, n)) for n in names if n != "qmap")
    return t.numel() * t.element_size()


def state_bytes(opt: torch.optim.Optimizer) -> int:
    total = 0
    for st in opt.state.values():
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and k != "step":
                total += _tensor_bytes(v)
    return total


def _params(seed: int = 0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g) * 0.02) for s in SHAPES.values()]


def bench_step(steps: int, warmup: int) -> dict:
    ao_cls, ao_note = _torchao_adamw8bit()
    makers = {
        "torch.optim.AdamW": lambda ps: torch.optim.AdamW(ps),
        "vefsdp_optim.AdamW8bit": lambda ps: AdamW8bit(ps),
    }
    if ao_cls is not None:
        makers["torchao.AdamW8bit"] = lambda ps: ao_cls(ps)
    runs = {}
    for name, make in makers.items():
        ps = _params()
        runs[name] = (ps, make(ps))
    numel = sum(p.numel() for p in _params())
    times: dict[str, list[float]] = {name: [] for name in runs}
    g = torch.Generator().manual_seed(1)
    for step in range(warmup + steps):
        grads = [torch.randn(p.shape, generator=g) * 1e-3 for p in runs["torch.optim.AdamW"][0]]
        for name, (ps, opt) in runs.items():  # interleaved
            for p, gr in zip(ps, grads, strict=True):
                p.grad = gr
            t0 = time.perf_counter()
            opt.step()
            dt = time.perf_counter() - t0
            if step >= warmup:
                times[name].append(dt)
    base_t = statistics.median(times["torch.optim.AdamW"])
    base_b = state_bytes(runs["torch.optim.AdamW"][1])
    rows = []
    for name, (_, opt) in runs.items():
        t, b = statistics.median(times[name]), state_bytes(opt)
        rows.append(dict(optimizer=name, median_step_s=t, step_time_ratio_vs_adamw=t / base_t,
                         state_bytes=b, state_bytes_per_param=b / numel,
                         state_bytes_ratio_vs_adamw=b / base_b))
    if ao_cls is None:
        rows.append(dict(optimizer="torchao.AdamW8bit", skipped=ao_note))
    note = ("torchao quantizes only tensors whose local numel is >= 4096 and a multiple of "
            "block_size; the others keep fp32 moments")
    return dict(numel=numel, steps=steps, warmup=warmup, torchao=ao_note, torchao_rule=note,
                rows=rows)


def bench_regression(steps: int) -> list[dict]:
    ao_cls, ao_note = _torchao_adamw8bit()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2048, 64, generator=g)
    w_true = torch.randn(64, 1, generator=g)
    y = torch.tanh(x @ w_true) + 0.05 * torch.randn(2048, 1, generator=g)
    makers = {
        "torch.optim.AdamW": lambda ps: torch.optim.AdamW(ps, lr=2e-3),
        "vefsdp_optim.AdamW8bit": lambda ps: AdamW8bit(ps, lr=2e-3),
    }
    if ao_cls is not None:
        makers["torchao.AdamW8bit"] = lambda ps: ao_cls(ps, lr=2e-3)
    rows = []
    for name, make in makers.items():
        torch.manual_seed(3)
        model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(),
                              nn.Linear(256, 1))
        opt = make(model.parameters())
        for _ in range(steps):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        with torch.no_grad():
            rows.append(dict(optimizer=name, steps=steps,
                             final_loss=nn.functional.mse_loss(model(x), y).item()))
    base = rows[0]["final_loss"]
    for r in rows:
        r["final_loss_ratio_vs_adamw"] = r["final_loss"] / base
    if ao_cls is None:
        rows.append(dict(optimizer="torchao.AdamW8bit", skipped=ao_note))
    return rows


# -- FSDP2 at W = 2 ---------------------------------------------------------------------


class _Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ps = nn.ParameterList(_params())


def _fsdp_worker(rank: int, w: int, init_file: str, steps: int, out_path: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=w)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import distribute_tensor

        mesh = init_device_mesh("cpu", (w,))
        runs = {}
        for name in ("torch.optim.AdamW", "vefsdp_optim.AdamW8bit"):
            model = _Bag()
            fully_shard(model, mesh=mesh)
            ps = list(model.ps)
            opt = torch.optim.AdamW(ps) if name.startswith("torch") else AdamW8bit(ps)
            runs[name] = (ps, opt)
        sent = {"bytes": 0, "calls": 0}
        orig = dist.all_to_all_single

        def counting(output, input, *a, **k):  # noqa: A002 - torch's argument name
            sent["bytes"] += input.numel() * input.element_size()
            sent["calls"] += 1
            return orig(output, input, *a, **k)

        times: dict[str, list[float]] = {n: [] for n in runs}
        per_step_bytes = []
        g = torch.Generator().manual_seed(1)
        for step in range(steps + 2):
            grads = [torch.randn(s, generator=g) * 1e-3 for s in SHAPES.values()]
            for name, (ps, opt) in runs.items():
                for p, gr in zip(ps, grads, strict=True):
                    p.grad = distribute_tensor(gr, mesh, p.placements)
                dist.barrier()
                is_ours = name.startswith("vefsdp")
                if is_ours:
                    sent["bytes"], sent["calls"] = 0, 0
                    dist.all_to_all_single = counting
                t0 = time.perf_counter()
                try:
                    opt.step()
                finally:
                    dist.all_to_all_single = orig
                dt = time.perf_counter() - t0
                if step >= 2:
                    times[name].append(dt)
                    if is_ours:
                        per_step_bytes.append((sent["bytes"], sent["calls"]))
        result = dict(rank=rank, times={n: statistics.median(v) for n, v in times.items()},
                      sent_bytes=per_step_bytes[-1][0], a2a_calls=per_step_bytes[-1][1],
                      local_param_bytes=sum(p.to_local().numel() * 4 for p in runs["torch.optim.AdamW"][0]),
                      state_bytes={n: state_bytes(o) for n, (_, o) in runs.items()})
        out: list = [None] * w
        dist.all_gather_object(out, result)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(out, f)
    finally:
        dist.destroy_process_group()


def bench_fsdp2(w: int, steps: int) -> dict:
    fd, init_file = tempfile.mkstemp(prefix="vefsdp_pg_")
    os.close(fd)
    os.unlink(init_file)
    fd, out_path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        mp.spawn(_fsdp_worker, args=(w, init_file, steps, out_path), nprocs=w, join=True)
        with open(out_path) as f:
            per_rank = json.load(f)
    finally:
        for path in (init_file, out_path):
            if os.path.exists(path):
                os.unlink(path)
    param_bytes = sum(torch.Size(s).numel() * 4 for s in SHAPES.values())
    sent = sum(r["sent_bytes"] for r in per_rank)
    t_ours = max(r["times"]["vefsdp_optim.AdamW8bit"] for r in per_rank)
    t_ref = max(r["times"]["torch.optim.AdamW"] for r in per_rank)
    return dict(
        world_size=w, steps=steps, param_bytes=param_bytes,
        exchange_bytes_sent_per_step_all_ranks=sent,
        exchange_bytes_over_param_bytes=sent / param_bytes,
        all_to_all_calls_per_step_per_rank=per_rank[0]["a2a_calls"],
        median_step_s={"vefsdp_optim.AdamW8bit": t_ours, "torch.optim.AdamW": t_ref},
        step_time_ratio_vs_adamw=t_ours / t_ref,
        state_bytes_all_ranks={n: sum(r["state_bytes"][n] for r in per_rank)
                               for n in per_rank[0]["state_bytes"]},
        per_rank=per_rank,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/out/adam8bit.json")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--regression-steps", type=int, default=300)
    a = ap.parse_args()
    torch.set_num_threads(1)
    result = dict(shapes=SHAPES, threads=1)
    result["step"] = bench_step(a.steps, a.warmup)
    print(json.dumps(result["step"], indent=1))
    result["regression"] = bench_regression(a.regression_steps)
    print(json.dumps(result["regression"], indent=1))
    result["fsdp2"] = bench_fsdp2(2, a.steps)
    print(json.dumps({k: v for k, v in result["fsdp2"].items() if k != "per_rank"}, indent=1))
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
