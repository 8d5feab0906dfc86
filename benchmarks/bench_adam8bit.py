"""AdamW8bit and Adam8bit against torch.optim, torchao and bitsandbytes, CPU.

    python -m benchmarks.bench_adam8bit [--quick|--full] [--out benchmarks/out/adam8bit.json]

1. One transformer-block-shaped set of parameters (D = 576, uneven rows, ~4.4 M fp32
   elements), the same random gradients fed to every optimizer, one intra-op thread:
   torch.optim.AdamW / Adam (foreach), ours fused (the default) and eager
   (``fused=False``), torchao's and bitsandbytes' AdamW8bit / Adam8bit (a row saying
   why where a peer is not installed). The optimizers step in turn, in alternating
   order, after warm-up steps that include torchao's torch.compile; medians and
   quartiles of step times and of the per-step ratios. State bytes are counted from the
   state tensors (the shared 256-value code maps left out). A bandwidth probe (a large
   ``copy_``) gives the limit; each row reports the bytes a step must move per second
   as a fraction of it. Our kernel's build time (cold and warm cache) is reported.
   Then AdamW8bit against torch.optim.AdamW (foreach) at 2 intra-op threads, likewise.
2. Final loss after N steps of each optimizer on one toy regression (an MLP whose
   weights are above the 8-bit threshold, the same seed and data for all).
3. FSDP2 ``fully_shard`` at W = 2 (spawned ranks: gloo on the CPU, NCCL with one CUDA
   device per rank): bytes this library's boundary
   exchange sends per AdamW8bit step (counted at ``all_to_all_single``), against the
   parameter bytes, and the median step time against torch.optim.AdamW on the same
   DTensors.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from vefsdp_optim._adam8bit import AdamW8bit

from ._common import (
    cli,
    current_device,
    device_for_world,
    not_run_row,
    paired_ratio,
    result,
    spawn,
    stats,
    synchronize,
)

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


def _peer(kind: str, name: str):
    """``(class, note)`` of a peer's 8-bit optimizer, or ``(None, why)``."""
    try:
        if kind == "torchao":
            import torchao
            import torchao.optim as mod
            version = torchao.__version__
        else:
            import bitsandbytes
            import bitsandbytes.optim as mod
            version = bitsandbytes.__version__
    except Exception as e:  # noqa: BLE001 - reported in the JSON row
        return None, f"peer not installed: {kind} not importable ({type(e).__name__}: {e})"
    return getattr(mod, name), f"{kind} {version}"


def _torchao_adamw8bit():
    return _peer("torchao", "AdamW8bit")


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


def _params(seed: int = 0, device: str = "cpu") -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter((torch.randn(s, generator=g) * 0.02).to(device)) for s in SHAPES.values()]


def _bytes_moved(opt_name: str) -> int:
    """Minimum bytes one step must move: 8-bit tensors read param, grad and 2 codes and
    write param and codes (16 B/element); fp32-moment tensors 28 B/element."""
    n = [torch.Size(s).numel() for s in SHAPES.values()]
    if "8bit" not in opt_name:
        return 28 * sum(n)
    return sum(16 * k if k >= 4096 else 28 * k for k in n)


def bandwidth_probe(numel: int = 1 << 26, reps: int = 7) -> dict:
    """Memory bandwidth of one thread: a large ``copy_`` (read + write), median of reps."""
    src = torch.rand(numel)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    gbs = [2 * numel * 4 / t / 1e9 for t in times]
    return dict(bytes_per_copy=2 * numel * 4, gb_per_s=stats(gbs))


def kernel_build_time() -> dict:
    """Seconds to build our fused kernel from a cold cache and to load it from a warm one."""
    import os
    import tempfile

    from vefsdp_optim._kernels import _native as qf

    old = os.environ.get("XDG_CACHE_HOME")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["XDG_CACHE_HOME"] = tmp
        try:
            t0 = time.perf_counter()
            qf._build()
            cold = time.perf_counter() - t0
            t0 = time.perf_counter()
            qf._build()
            warm = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - reported
            return dict(error=f"{type(e).__name__}: {e}")
        finally:
            if old is None:
                os.environ.pop("XDG_CACHE_HOME", None)
            else:
                os.environ["XDG_CACHE_HOME"] = old
    return dict(cold_s=cold, warm_s=warm)


def _time_steps(runs: dict[str, tuple[list[nn.Parameter], torch.optim.Optimizer]], steps: int,
                warmup: int, device: str) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Seconds per timed step of each optimizer, and of its first step: the same random
    gradients fed to all, in alternating order, after ``warmup`` untimed steps."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    first: dict[str, float] = {}
    g = torch.Generator().manual_seed(1)
    ref = next(iter(runs.values()))[0]
    for step in range(warmup + steps):
        grads = [(torch.randn(p.shape, generator=g) * 1e-3).to(device) for p in ref]
        names = list(runs) if step % 2 == 0 else list(runs)[::-1]  # alternating order
        for name in names:
            ps, opt = runs[name]
            for p, gr in zip(ps, grads, strict=True):
                p.grad = gr
            synchronize(device)
            t0 = time.perf_counter()
            opt.step()
            synchronize(device)
            dt = time.perf_counter() - t0
            if step == 0:
                first[name] = dt
            if step >= warmup:
                times[name].append(dt)
    return times, first


def bench_threads(steps: int, warmup: int, threads: int = 2) -> list[dict]:
    """AdamW8bit and torch.optim.AdamW (foreach) at ``threads`` intra-op threads (our
    kernel takes runs of blocks on each, ``adam8bit_steps_cpu`` in vefsdp_optim/_kernels/csrc/quant8_adam_op.cpp)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        device = current_device()
        runs = {}
        for name, make in (("torch.optim.AdamW", lambda ps: torch.optim.AdamW(ps, foreach=True)),
                           ("vefsdp_optim.AdamW8bit", lambda ps: AdamW8bit(ps))):
            ps = _params(device=device)
            runs[name] = (ps, make(ps))
        times, _ = _time_steps(runs, steps, warmup, device)
    finally:
        torch.set_num_threads(saved)
    return [dict(optimizer=f"{name}, {threads} threads", device=device, step_ms=stats(t, 1e3),
                 ratio_vs_torch=paired_ratio(t, times["torch.optim.AdamW"]),
                 torch_baseline=f"torch.optim.AdamW, {threads} threads")
            for name, t in times.items()]


def bench_step(steps: int, warmup: int) -> dict:
    from vefsdp_optim._adam8bit import Adam8bit

    peers = {(k, n): _peer(k, n) for k in ("torchao", "bitsandbytes") for n in ("AdamW8bit", "Adam8bit")}
    makers = {
        "torch.optim.AdamW": lambda ps: torch.optim.AdamW(ps, foreach=True),
        "vefsdp_optim.AdamW8bit": lambda ps: AdamW8bit(ps),
        "vefsdp_optim.AdamW8bit (eager)": lambda ps: AdamW8bit(ps, fused=False),
        "torch.optim.Adam": lambda ps: torch.optim.Adam(ps, foreach=True),
        "vefsdp_optim.Adam8bit": lambda ps: Adam8bit(ps),
    }
    skipped = []
    for (kind, name), (cls, note) in peers.items():
        label = f"{kind}.{name}"
        if cls is None:
            skipped.append(dict(optimizer=label, skipped=note))
            continue
        makers[label] = (lambda c: lambda ps: c(ps))(cls)
    runs = {}
    device = current_device()
    for name, make in makers.items():
        ps = _params(device=device)
        runs[name] = (ps, make(ps))
    numel = sum(p.numel() for p in _params())
    times, first = _time_steps(runs, steps, warmup, device)
    probe = bandwidth_probe()
    limit = probe["gb_per_s"]["median"] * 1e9
    base_b = state_bytes(runs["torch.optim.AdamW"][1])
    rows = []
    for name, (_, opt) in runs.items():
        b = state_bytes(opt)
        base = "torch.optim.Adam" if "Adam8bit" in name or name == "torch.optim.Adam" else "torch.optim.AdamW"
        med = statistics.median(times[name])
        rows.append(dict(optimizer=name, device=device, step_ms=stats(times[name], 1e3),
                         first_step_ms=first[name] * 1e3,
                         ratio_vs_torch=paired_ratio(times[name], times[base]), torch_baseline=base,
                         state_bytes=b, state_bytes_per_param=b / numel,
                         state_bytes_ratio_vs_adamw=b / base_b,
                         bytes_moved_gb_per_s=_bytes_moved(name) / med / 1e9,
                         fraction_of_copy_bandwidth=_bytes_moved(name) / med / limit))
    for ours in ("AdamW8bit", "Adam8bit"):
        for kind in ("torchao", "bitsandbytes"):
            peer = f"{kind}.{ours}"
            if peer in times:
                rows.append(dict(optimizer=f"vefsdp_optim.{ours} / {peer}", device=device,
                                 ratio=paired_ratio(times[f"vefsdp_optim.{ours}"], times[peer])))
    rows.append(dict(optimizer="bandwidth probe: copy_ of 256 MiB, 1 thread", device=device,
                     gb_per_s=probe["gb_per_s"]))
    rows.extend(skipped)
    notes = ("torchao quantizes only tensors whose local numel is >= 4096 and a multiple of "
             "block_size; the others keep fp32 moments. bitsandbytes and ours: numel >= 4096")
    return dict(numel=numel, steps=steps, warmup=warmup,
                peers={f"{k}.{n}": note for (k, n), (_, note) in peers.items()}, torchao_rule=notes,
                rows=rows, build=kernel_build_time(), probe=probe)


def bench_regression(steps: int) -> list[dict]:
    ao_cls, ao_note = _torchao_adamw8bit()
    device = current_device()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2048, 64, generator=g)
    w_true = torch.randn(64, 1, generator=g)
    y = (torch.tanh(x @ w_true) + 0.05 * torch.randn(2048, 1, generator=g)).to(device)
    x = x.to(device)
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
                              nn.Linear(256, 1)).to(device)
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
    def __init__(self, device: str) -> None:
        super().__init__()
        self.ps = nn.ParameterList(_params(device=device))


def _fsdp_worker(w: int, steps: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    device = current_device()
    mesh = init_device_mesh(torch.device(device).type, (w,))
    runs = {}
    for name in ("torch.optim.AdamW", "vefsdp_optim.AdamW8bit"):
        model = _Bag(device)
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
        grads = [(torch.randn(s, generator=g) * 1e-3).to(device) for s in SHAPES.values()]
        for name in list(runs) if step % 2 == 0 else list(runs)[::-1]:  # interleaved
            ps, opt = runs[name]
            for p, gr in zip(ps, grads, strict=True):
                p.grad = distribute_tensor(gr, mesh, p.placements)
            dist.barrier()
            is_ours = name.startswith("vefsdp")
            if is_ours:
                sent["bytes"], sent["calls"] = 0, 0
                dist.all_to_all_single = counting
            synchronize(device)
            t0 = time.perf_counter()
            try:
                opt.step()
            finally:
                dist.all_to_all_single = orig
            synchronize(device)
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slowest rank's step
            if step >= 2:
                times[name].append(float(dt.item()))
                if is_ours:
                    per_step_bytes.append((sent["bytes"], sent["calls"]))
    return dict(rank=dist.get_rank(), times=times,
                sent_bytes=per_step_bytes[-1][0], a2a_calls=per_step_bytes[-1][1],
                state_bytes={n: state_bytes(o) for n, (_, o) in runs.items()})


def bench_fsdp2(w: int, steps: int) -> dict:
    per_rank = spawn(_fsdp_worker, w, w, steps)
    param_bytes = sum(torch.Size(s).numel() * 4 for s in SHAPES.values())
    sent = sum(r["sent_bytes"] for r in per_rank)
    t = per_rank[0]["times"]
    return dict(
        device=device_for_world(w)[0], world=w, param_bytes=param_bytes,
        exchange_bytes_sent_per_step_all_ranks=sent,
        exchange_bytes_over_param_bytes=sent / param_bytes,
        all_to_all_calls_per_step_per_rank=per_rank[0]["a2a_calls"],
        adamw8bit_ms=stats(t["vefsdp_optim.AdamW8bit"], 1e3),
        torch_adamw_ms=stats(t["torch.optim.AdamW"], 1e3),
        ratio_vs_torch_adamw=paired_ratio(t["vefsdp_optim.AdamW8bit"], t["torch.optim.AdamW"]),
        state_bytes_all_ranks_adamw8bit=sum(r["state_bytes"]["vefsdp_optim.AdamW8bit"] for r in per_rank),
        state_bytes_all_ranks_torch_adamw=sum(r["state_bytes"]["torch.optim.AdamW"] for r in per_rank),
    )


def run(quick: bool = True) -> dict:
    """Step time and state bytes vs torch AdamW and torchao AdamW8bit (one process),
    toy-regression loss, and the FSDP2 W = 2 exchange (quick: 7 timed steps, 80
    regression steps; full: 15 and 300)."""
    t0 = time.perf_counter()
    steps, warmup, reg_steps = (7, 2, 80) if quick else (15, 3, 300)
    torch.set_num_threads(1)
    step = bench_step(steps, warmup)
    threaded = bench_threads(steps, warmup, 2)
    regression = bench_regression(reg_steps)
    fsdp = [bench_fsdp2(2, steps)]
    if (nr := not_run_row(2)) is not None:
        fsdp.append(nr)
    by = {r["optimizer"]: r for r in step["rows"]}
    headline = []
    for ours in ("AdamW8bit", "Adam8bit"):
        row = by[f"vefsdp_optim.{ours}"]
        headline.append({"comparison": f"{ours} step / {row['torch_baseline']} (foreach) step, 1 thread",
                         "ratio": row["ratio_vs_torch"]})
        for kind in ("torchao", "bitsandbytes"):
            key = f"vefsdp_optim.{ours} / {kind}.{ours}"
            if key in by:
                headline.append({"comparison": f"{ours} step / {kind} {ours} step, 1 thread",
                                 "ratio": by[key]["ratio"]})
    headline.append({"comparison": "AdamW8bit step / torch.optim.AdamW (foreach) step, 2 threads",
                     "ratio": threaded[-1]["ratio_vs_torch"]})  # the AdamW8bit row
    headline.append({"comparison": "AdamW8bit bytes moved per second / copy_ bandwidth (1 thread)",
                     "ratio": by["vefsdp_optim.AdamW8bit"]["fraction_of_copy_bandwidth"]})
    headline.append({"comparison": "AdamW8bit state bytes / torch.optim.AdamW",
                     "ratio": by["vefsdp_optim.AdamW8bit"]["state_bytes_ratio_vs_adamw"]})
    headline.append({"comparison": "AdamW8bit on FSDP2 W=2: exchange bytes / parameter bytes",
                     "ratio": fsdp[0]["exchange_bytes_over_param_bytes"]})
    build = step["build"]
    ao_first = by.get("torchao.AdamW8bit", {}).get("first_step_ms")
    if "cold_s" in build:
        headline.append({"metric": "AdamW8bit fused kernel build, cold cache (s)", "value": build["cold_s"]})
    if ao_first:
        headline.append({"metric": "torchao AdamW8bit first step, torch.compile included (s)",
                         "value": ao_first / 1e3})
    notes = [f"{step['numel'] / 1e6:.2f} M fp32 elements, 1 intra-op thread; peers: "
             + ", ".join(f"{k}: {v}" for k, v in step["peers"].items()) + f"; {step['torchao_rule']}",
             "fused kernel build (C++ via cpp_extension, cold cache): "
             + (f"{build['cold_s']:.2f} s, load from the on-disk cache {build['warm_s'] * 1e3:.0f} ms"
                if "cold_s" in build else build.get("error", "?"))
             + (f"; torchao AdamW8bit first step (torch.compile included): {ao_first / 1e3:.1f} s"
                if ao_first else ""),
             "bytes moved: 16 B/element for 8-bit tensors (param r/w, grad, 2 codes r/w), 28 for "
             "fp32 moments; fraction = those bytes per second / a 256 MiB copy_'s (read + write)",
             f"toy regression: final loss after {reg_steps} steps, ratio to torch AdamW's"]
    return result("adam8bit", step["rows"] + threaded, notes, headline=headline, regression=regression,
                  fsdp2=fsdp, shapes=SHAPES, wall_s=time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> dict:
    return cli(run, "adam8bit", argv)


if __name__ == "__main__":
    main()
