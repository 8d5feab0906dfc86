"""The benchmarks of ``make gpu-check``: AdamW8bit against torch's fused AdamW, Muon
against torch.optim.Muon (and Dion's where ``VEFSDP_DION_SRC`` names its source), and
our ``fully_shard`` against FSDP2 on the benchmark GPT (benchmarks/bench_fully_shard.py's
model and sharding, at GPU size): step time, ``max_memory_allocated`` and
``max_memory_reserved``.

Each candidate runs alone on fresh tensors (same values for each), one after another
in one process, after the allocator's cache is emptied and its peaks reset; step times
are CUDA events around each step (on the CPU dry run, the wall clock), medians with
quartiles. A peer that is not installed or fails is a row saying so.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tools._checkout  # noqa: F401 - before vefsdp_optim: [Note: checkout imports]
from tools._gpu_parts import progress, run_on_ranks

__all__ = ["adam8bit_part", "batches", "build_system", "fully_shard_part", "gpt", "muon_part", "sync",
           "train_step"]

# the benchmark GPT (vefsdp_optim.toy's TinyGPT, as benchmarks/bench_fully_shard.py uses it)
GPT: dict[str, dict[str, int]] = {
    "gpu": dict(vocab=8192, seq=512, d=1024, layers=8, heads=16, batch=8),  # 118 M parameters
    "tiny": dict(vocab=64, seq=16, d=32, layers=2, heads=2, batch=2),
}
ADAM8_SHAPES = {"gpu": [(4096, 3072)] * 8 + [(4096,)] * 8, "tiny": [(64, 48)] * 2 + [(64,)] * 2}
STEPS = {"gpu": (3, 20), "tiny": (1, 3)}  # (warm-up, timed)


def sync(device: str | torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def gpt(size: str) -> nn.Module:
    from vefsdp_optim.toy._models import TinyGPT

    c = GPT[size]
    torch.manual_seed(0)
    return TinyGPT(c["vocab"], c["seq"], d=c["d"], n_layers=c["layers"], heads=c["heads"])


def batches(n: int, size: str, device: str) -> torch.Tensor:
    c = GPT[size]
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, c["vocab"], (n, c["batch"], c["seq"] + 1), generator=g).to(device)


def build_system(system: str, base: nn.Module, device: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``base`` copied to ``device``, sharded block by block and at the root by ``system``
    ("ours": vefsdp_optim.fully_shard + vefsdp_optim.AdamW; "fsdp2": torch's fully_shard
    + torch.optim.AdamW): benchmarks/bench_fully_shard.py's ``_build``."""
    from benchmarks.bench_fully_shard import _build

    return _build(system, base, device)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, tok: torch.Tensor) -> torch.Tensor:
    logits = model(tok[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tok[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def _time(device: str, fn: Callable[[], Any]) -> float:
    """Milliseconds of ``fn()``: CUDA events on a GPU, the wall clock on the CPU."""
    if torch.device(device).type == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _stats(ts: list[float]) -> dict[str, float]:
    if len(ts) < 2:
        return dict(step_ms=ts[0] if ts else float("nan"))
    q = statistics.quantiles(ts, n=4)
    return dict(step_ms=statistics.median(ts), step_ms_p25=q[0], step_ms_p75=q[2])


def _memory(device: str, base: int) -> dict[str, float | None]:
    if torch.device(device).type != "cuda":
        return dict(max_allocated_MiB=None, max_reserved_MiB=None)
    return dict(max_allocated_MiB=(torch.cuda.max_memory_allocated(device) - base) / 2**20,
                max_reserved_MiB=torch.cuda.max_memory_reserved(device) / 2**20)


def _fresh(device: str) -> int:
    """Empty the allocator's cache and reset its peaks; the bytes still allocated."""
    if torch.device(device).type != "cuda":
        return 0
    sync(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def _optimizer_rows(device: str, size: str, makers: dict[str, Callable[[], tuple[Any, list]]],
                    notes: list[str]) -> tuple[list[dict[str, Any]], dict[str, list[float]]]:
    """Each maker builds its parameters (gradients set) and optimizer; its steps timed.
    Memory: the peak over the parameters and gradients already there."""
    warmup, steps = STEPS[size]
    rows, times = [], {}
    for name, make in makers.items():
        progress({"start": name})
        base = _fresh(device)
        try:
            opt, keep = make()
            base_params = base + sum(t.numel() * t.element_size() for t in keep)
            ts = [_time(device, opt.step) for _ in range(warmup + steps)][warmup:]
        except Exception as e:  # noqa: BLE001 - a peer's failure is a row, not the end
            rows.append(dict(optimizer=name, error=f"{type(e).__name__}: {e}"[:300]))
            progress(rows[-1])
            continue
        times[name] = ts
        mem = _memory(device, base_params)
        mem = {k.replace("max_allocated", "max_allocated_over_params_grads"): v for k, v in mem.items()}
        rows.append(dict(optimizer=name, **_stats(ts), **mem))
        progress(rows[-1])
        del opt, keep
    return rows, times


def _ratios(times: dict[str, list[float]], pairs: list[tuple[str, str]]) -> dict[str, float]:
    """Median step time of ``a`` over that of ``b`` for each pair that ran; a peer's
    name matches by its prefix (its version follows)."""
    out = {}
    for a, b in pairs:
        for name in times:
            if a in times and name.startswith(b) and name != a:
                out[f"{a} / {name}"] = statistics.median(times[a]) / statistics.median(times[name])
    return out


def _count(n: int) -> str:
    return f"{n / 1e6:.1f} M" if n >= 100_000 else f"{n:,}"


# -- AdamW8bit against torch's fused AdamW ------------------------------------------------------


def _adam8bit(size: str, device: str) -> dict[str, Any]:
    import vefsdp_optim
    from vefsdp_optim._kernels import select_backend

    shapes = ADAM8_SHAPES[size]

    def params() -> list[nn.Parameter]:
        gen = torch.Generator().manual_seed(0)
        ps = [nn.Parameter((torch.randn(s, generator=gen) * 0.02).to(device)) for s in shapes]
        for p in ps:
            p.grad = (torch.randn(p.shape, generator=gen) * 1e-3).to(device)
        return ps

    def with_params(cls: Callable[..., Any], **kw: Any) -> Callable[[], tuple[Any, list]]:
        def make() -> tuple[Any, list]:
            ps = params()
            return cls(ps, lr=1e-3, **kw), [t for p in ps for t in (p, p.grad)]
        return make

    notes: list[str] = []
    makers = {"torch.optim.AdamW (fused)": with_params(torch.optim.AdamW, fused=True),
              "vefsdp_optim.AdamW8bit": with_params(vefsdp_optim.AdamW8bit),
              "vefsdp_optim.AdamW8bit (eager)": with_params(vefsdp_optim.AdamW8bit, fused=False)}
    try:
        import bitsandbytes as bnb

        makers[f"bitsandbytes.AdamW8bit ({bnb.__version__})"] = with_params(bnb.optim.AdamW8bit)
    except Exception as e:  # noqa: BLE001 - reported
        notes.append(f"bitsandbytes not run: {type(e).__name__}: {str(e)[:120]}")
    try:
        import torchao
        from torchao.optim import AdamW8bit as AoAdamW8bit

        makers[f"torchao.AdamW8bit ({torchao.__version__})"] = with_params(AoAdamW8bit)
    except Exception as e:  # noqa: BLE001 - reported
        notes.append(f"torchao not run: {type(e).__name__}: {str(e)[:120]}")
    rows, times = _optimizer_rows(device, size, makers, notes)
    numel = sum(torch.Size(s).numel() for s in shapes)
    warmup, steps = STEPS[size]
    notes.insert(0, f"{_count(numel)} parameters ({len(shapes)} tensors), {steps} timed steps after "
                    f"{warmup} warm-up; our backend: {select_backend(torch.device(device).type, 256)}")
    ours = "vefsdp_optim.AdamW8bit"
    pairs = [(ours, p) for p in ("torch.optim.AdamW (fused)", "bitsandbytes", "torchao", f"{ours} (eager)")]
    return dict(rows=rows, ratios=_ratios(times, pairs), notes=notes)


def adam8bit_part(part: str, world: int, device: str, size: str, part_dir: Path) -> dict[str, Any]:
    res = run_on_ranks(_adam8bit, 0, device, part_dir, size, device)[0]
    return dict(kind="bench", world=1, status="pass" if not any("error" in r for r in res["rows"]) else "fail", **res)


# -- Muon against torch.optim.Muon (and Dion's) -------------------------------------------------


def _muon_shapes(size: str) -> list[tuple[int, int]]:
    d, layers = GPT[size]["d"], GPT[size]["layers"]
    return [s for _ in range(layers) for s in ((3 * d, d), (d, d), (4 * d, d), (d, 4 * d))]


def _muon(size: str, device: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    import vefsdp_optim
    from benchmarks._common import DION_ENV, GradProbe, dion_src, fsdp2_params, import_dion

    shapes = _muon_shapes(size)
    dev = f"cuda:{torch.cuda.current_device()}" if torch.device(device).type == "cuda" else "cpu"
    mesh = init_device_mesh(torch.device(device).type, (dist.get_world_size(),))
    hp = dict(lr=0.02, weight_decay=0.1)

    def tensors() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        gen = torch.Generator().manual_seed(0)
        init = [(torch.randn(s, generator=gen) * 0.02).to(dev) for s in shapes]
        return init, [torch.randn(s, generator=gen).to(dev) for s in shapes]

    def plain(cls: Callable[..., Any]) -> Callable[[], tuple[Any, list]]:
        def make() -> tuple[Any, list]:
            init, grads = tensors()
            ps = [nn.Parameter(t) for t in init]
            for p, g in zip(ps, grads, strict=True):
                p.grad = g
            return cls(ps, **hp), [*ps, *grads]
        return make

    def ours_fully_shard() -> tuple[Any, list]:
        init, grads = tensors()
        probe = GradProbe(init)
        vefsdp_optim.fully_shard(probe, mesh=mesh)
        opt = vefsdp_optim.Muon(list(probe.parameters()), **hp)
        probe(grads).backward()
        return opt, []

    notes: list[str] = []
    makers = {"torch.optim.Muon": plain(torch.optim.Muon), "vefsdp_optim.Muon": plain(vefsdp_optim.Muon),
              "vefsdp_optim.Muon on fully_shard": ours_fully_shard}
    src = dion_src()
    if src is None:
        notes.append(f"dion.Muon not run: {DION_ENV} does not name Dion's source (the folder holding dion/)")
    else:
        dion = import_dion(src)

        def dion_muon() -> tuple[Any, list]:
            init, grads = tensors()
            ps = fsdp2_params(init, grads, mesh)
            return dion.Muon(ps, distributed_mesh=mesh, mu=0.95, nesterov=True, flatten=False,
                             use_polar_express=False, **hp), []
        makers["dion.Muon on FSDP2"] = dion_muon
    rows, times = _optimizer_rows(dev, size, makers, notes)
    warmup, steps = STEPS[size]
    n = sum(a * b for a, b in shapes)
    notes.insert(0, f"the {len(shapes)} hidden matrices of the benchmark GPT (d = {GPT[size]['d']}, "
                    f"{GPT[size]['layers']} blocks): {_count(n)} fp32 parameters; lr 0.02, weight decay "
                    f"0.1, the defaults otherwise; {steps} timed steps after {warmup} warm-up; world size "
                    f"{dist.get_world_size()}; on fully_shard and FSDP2 the memory column counts the "
                    "sharded parameters and gradients too")
    pairs = [("vefsdp_optim.Muon", "torch.optim.Muon"), ("vefsdp_optim.Muon on fully_shard", "torch.optim.Muon"),
             ("vefsdp_optim.Muon on fully_shard", "dion.Muon")]
    return dict(rows=rows, ratios=_ratios(times, pairs), notes=notes)


def muon_part(part: str, world: int, device: str, size: str, part_dir: Path) -> dict[str, Any]:
    res = run_on_ranks(_muon, world, device, part_dir, size, device)[0]
    return dict(kind="bench", world=world, status="pass" if not any("error" in r for r in res["rows"]) else "fail",
                **res)


# -- fully_shard against FSDP2 on the benchmark GPT ---------------------------------------------


def _one_system(system: str, base: nn.Module, dev: str, data: torch.Tensor,
                warmup: int) -> tuple[list[float], float, dict[str, float | None]]:
    """``system`` built afresh from ``base``: its timed steps, first loss and memory peaks."""
    _fresh(dev)
    model, opt = build_system(system, base, dev)
    losses: list[torch.Tensor] = []
    times = [_time(dev, lambda k=k: losses.append(train_step(model, opt, data[k]))) for k in range(len(data))]
    return times[warmup:], float(losses[0]), _memory(dev, 0)


def _fully_shard(size: str, device: str, rounds: int) -> dict[str, Any]:
    dev = f"cuda:{torch.cuda.current_device()}" if torch.device(device).type == "cuda" else "cpu"
    warmup, steps = (3, 10) if size == "gpu" else (1, 2)
    base = gpt(size)
    data = batches(warmup + steps, size, dev)
    names = {"ours": "vefsdp_optim.fully_shard + vefsdp_optim.AdamW",
             "fsdp2": "torch fully_shard (FSDP2) + torch.optim.AdamW"}
    times: dict[str, list[float]] = {s: [] for s in names}
    mem: dict[str, dict[str, Any]] = {}
    first: dict[str, float] = {}
    errors: dict[str, str] = {}
    for r in range(rounds):
        for s in (("ours", "fsdp2") if r % 2 == 0 else ("fsdp2", "ours")):
            if s in errors:
                continue
            progress({"start": f"{s} round {r}"})
            try:
                ts, loss, m = _one_system(s, base, dev, data, warmup)
            except Exception as e:  # noqa: BLE001 - reported
                errors[s] = f"{type(e).__name__}: {str(e)[:300]}"
                continue
            times[s] += ts
            first.setdefault(s, loss)
            mem[s] = {k: None if v is None else max(v, mem.get(s, {}).get(k) or 0.0) for k, v in m.items()}
    rows = []
    for s, label in names.items():
        if s in errors:
            rows.append(dict(system=label, error=errors[s]))
        else:
            rows.append(dict(system=label, **_stats(times[s]), **mem[s], first_loss=first[s]))
    ratios = {}
    if not errors:
        ratios["step time ours / FSDP2"] = statistics.median(times["ours"]) / statistics.median(times["fsdp2"])
        if mem["ours"]["max_allocated_MiB"] is not None:
            for k in ("max_allocated_MiB", "max_reserved_MiB"):
                ratios[f"{k.removesuffix('_MiB')} ours / FSDP2"] = mem["ours"][k] / mem["fsdp2"][k]
    c = GPT[size]
    n = sum(p.numel() for p in base.parameters())
    notes = [f"benchmark GPT: {_count(n)} fp32 parameters (d = {c['d']}, {c['layers']} blocks, "
             f"{c['heads']} heads, vocab {c['vocab']}, sequence {c['seq']}, batch {c['batch']}), each block "
             f"then the root sharded, world size {dist.get_world_size()}; a step is forward, backward, the "
             f"optimizer's step and zero_grad; {steps} timed steps after {warmup} warm-up in each of {rounds} "
             "rounds (the order alternates), each system built afresh each round; memory: the peaks of "
             "its rounds (the allocator's cache emptied and its peaks reset before each)"]
    if len(first) == 2 and abs(first["ours"] - first["fsdp2"]) > 1e-4 * abs(first["fsdp2"]):
        notes.append(f"the first losses differ: {first} (same weights, same batch)")
    return dict(rows=rows, ratios=ratios, notes=notes, errors=errors)


def fully_shard_part(part: str, world: int, device: str, size: str, part_dir: Path) -> dict[str, Any]:
    res = run_on_ranks(_fully_shard, world, device, part_dir, size, device, 2)[0]
    return dict(kind="bench", world=world, status="fail" if res.pop("errors") else "pass", **res)

