"""DistributedBuffer all-gather + reduce-scatter against FSDP2's own path, CPU gloo.

    python -m benchmarks.bench_buffer [--quick|--full] [--out benchmarks/out/buffer.json]

One group of transformer-block-shaped parameters (uneven rows, ~3.2 M fp32 elements) on
W = 2 and 4 ranks (spawned; gloo on the CPU, NCCL where there is one CUDA device per
rank). Per step:

- ours: ``buf.all_gather()`` (re-allocating the freed global buffer), then
  ``buf.reduce_scatter("avg")`` from a filled gradient buffer, then ``free_global()``;
- FSDP2: ``module.unshard()`` (copy-in, all-gather, copy-out), then the unsharded grads
  are set and the group's own ``post_backward()`` runs (reshard, chunk_cat copy-in,
  reduce-scatter, sharded-grad views), the same code a backward pass ends with, minus
  the autograd compute, which both sides would share.

The two alternate step by step; times are medians. Bytes copied outside the collectives
are counted with a TorchDispatchMode (copy_, cat, clone, FSDP2's all_gather_copy_in /
split_with_sizes_copy / chunk_cat) on one step of each. Memory: bytes of the buffers a
step holds at its peak (from the tensors themselves), and the RSS high-water mark
(resource.getrusage) of a separate process per side that runs only that side.
"""

from __future__ import annotations

import math
import resource
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from vefsdp_optim.comm import DistributedBuffer
from vefsdp_optim.sharding import TensorSpec, plan_buffer

from ._common import (
    cli,
    current_device,
    device_for_world,
    interleave,
    not_run_row,
    paired_ratio,
    result,
    spawn,
    stats,
)

D = 512
FF = 4 * D + 3  # uneven rows
SHAPES = {
    "norm1": (D,),
    "qkv": (3 * D + 5, D),
    "proj": (D, D),
    "norm2": (D,),
    "fc1": (FF, D),
    "fc1_bias": (FF,),
    "fc2": (D, FF),
}
WORLDS = (2, 4)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        for name, shape in SHAPES.items():
            self.register_parameter(name, nn.Parameter(torch.randn(shape)))


class _CopyBytes(TorchDispatchMode):
    """Bytes written by copying ops (not by collectives)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = str(func)
        n = 0
        if name.startswith("fsdp.all_gather_copy_in"):
            n = sum(t.numel() * t.element_size() for t in args[0])
        elif name.startswith(("fsdp.split_with_sizes_copy", "fsdp.chunk_cat", "aten.split_with_sizes_copy")):
            n = sum(t.numel() * t.element_size() for t in kwargs["out"]) if "out" in kwargs else 0
        elif name.startswith(("aten.copy_", "aten._foreach_copy_")):
            dst = args[0]
            n = sum(t.numel() * t.element_size() for t in (dst if isinstance(dst, list | tuple) else [dst]))
        elif name.startswith(("aten.cat", "aten.clone", "aten._to_copy", "aten.chunk_cat")):
            res = out if isinstance(out, list | tuple) else [out]
            n = sum(t.numel() * t.element_size() for t in res if isinstance(t, torch.Tensor))
        if n:
            self.bytes += n
            self.ops[name] = self.ops.get(name, 0) + n
        return out


def _nbytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in seen and s.nbytes():
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def _setup_ours(group, rank: int, w: int, full: dict[str, torch.Tensor], device: str):
    plan = plan_buffer([TensorSpec(n, s) for n, s in SHAPES.items()], w)
    buf = DistributedBuffer(plan, group, dtype=torch.float32, device=device)
    for name, t in full.items():
        start, n = buf.local_extent(name)
        buf.local_view(name).copy_(t.flatten()[start:start + n])
    buf.alloc_grad_global()
    for name, t in full.items():
        buf.grad_full_view(name).copy_(t * (rank + 1))
    return buf


def _ours_step(buf: DistributedBuffer) -> tuple[float, float, dict[str, int]]:
    t0 = time.perf_counter()
    buf.all_gather()
    t1 = time.perf_counter()
    buf.reduce_scatter("avg")
    t2 = time.perf_counter()
    peak = {"ag": _nbytes([buf.local, buf.global_buffer]), "rs": _nbytes([buf.grad_global, buf.local_grad])}
    buf.free_global()
    return t1 - t0, t2 - t1, peak


def _setup_fsdp(w: int, rank: int, full: dict[str, torch.Tensor], device: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(torch.device(device).type, (w,))
    module = _Block().to(device)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(full[name])
    fully_shard(module, mesh=mesh)
    state = module._get_fsdp_state()
    state._lazy_init()  # what the first forward does: comm context, root state
    fsdp_param_group = state._fsdp_param_group
    names = [n for n, _ in module.named_parameters()]
    grads = [full[n] * (rank + 1) for n in names]
    return module, fsdp_param_group, grads


def _fsdp_step(module, fsdp_param_group, grads) -> tuple[float, float, dict[str, int]]:
    t0 = time.perf_counter()
    module.unshard()
    t1 = time.perf_counter()
    w = fsdp_param_group.mesh_info.shard_mesh_size
    shard = _nbytes([fp._sharded_param_data for fp in fsdp_param_group.fsdp_params])  # padded, persistent
    unsharded = _nbytes([fp.unsharded_param for fp in fsdp_param_group.fsdp_params])
    # at copy-out: sharded params + all-gather output (W padded shards) + unsharded params;
    # at reduce-scatter: unsharded grads + reduce-scatter input (W shards) + output (1 shard)
    peak = {"ag": shard + w * shard + unsharded, "rs": _nbytes(grads) + w * shard + shard}
    for fp, g in zip(fsdp_param_group.fsdp_params, grads, strict=True):
        fp.unsharded_param.grad = g
    t2 = time.perf_counter()
    fsdp_param_group.post_backward()
    t3 = time.perf_counter()
    for p in module.parameters():
        p.grad = None
    return t1 - t0, t3 - t2, peak


def _worker(w: int, steps: int, mode: str) -> dict[str, object]:
    """One rank. ``mode``: "time" (both sides, interleaved, plus copy counts), or "ours" /
    "fsdp" (that side alone, for its RSS high-water mark)."""
    device = current_device()
    rank = dist.get_rank()
    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(0)
    full = {n: torch.randn(s, generator=gen).to(device) for n, s in SHAPES.items()}
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    res: dict[str, object] = {}
    buf = _setup_ours(group, rank, w, full, device) if mode in ("time", "ours") else None
    fsdp = _setup_fsdp(w, rank, full, device) if mode in ("time", "fsdp") else None
    if buf is not None and fsdp is not None:  # same values as FSDP2's unsharded params
        buf.all_gather()
        fsdp[0].unshard()
        for name, fp in zip(SHAPES, fsdp[1].fsdp_params, strict=True):
            if not torch.equal(fp.unsharded_param.detach(), buf.full_view(name)):
                raise AssertionError(f"all-gathered {name} differs from FSDP2's")
        fsdp[0].reshard()
        buf.free_global()
    split: dict[str, list[float]] = {"ours_ag": [], "ours_rs": [], "fsdp_ag": [], "fsdp_rs": []}
    peaks: dict[str, dict[str, int]] = {}

    def side(name, step_fn, args):
        def go():
            ag, rs, peak = step_fn(*args)
            split[f"{name}_ag"].append(ag)
            split[f"{name}_rs"].append(rs)
            peaks[name] = peak
        return go

    runners = {}
    if buf is not None:
        runners["ours"] = side("ours", _ours_step, (buf,))
    if fsdp is not None:
        runners["fsdp"] = side("fsdp", _fsdp_step, fsdp)
    step_times = interleave(runners, steps, warmup=2, group=group, device=device)
    if mode == "time":
        for name, step_fn, args in (("ours", _ours_step, (buf,)), ("fsdp", _fsdp_step, fsdp)):
            with _CopyBytes() as cb:
                step_fn(*args)
            res[f"{name}_copy_bytes"] = cb.bytes
            res[f"{name}_copy_ops"] = cb.ops
        res["step_times"] = step_times
        res["split"] = {k: v[2:] for k, v in split.items()}  # drop the warm-up calls
        res["peak_buffer_bytes"] = peaks
        res["ours_padding"] = buf.plan.padding
    else:
        res["rss_delta_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0
        if device.startswith("cuda"):
            res["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(device)
    return res


def run(quick: bool = True) -> dict:
    """Step = all-gather + reduce-scatter of one group, ours vs FSDP2's, at W = 2 and 4
    (quick: 6 timed steps; full: 30 and the RSS high-water mark of each side alone)."""
    t0 = time.perf_counter()
    steps = 6 if quick else 30
    numel = sum(math.prod(s) for s in SHAPES.values())
    rows, notes = [], []
    for w in WORLDS:
        device = device_for_world(w)[0]
        per_rank = spawn(_worker, w, w, steps, "time")
        # RSS high-water marks need one process per side: full mode only (4 more spawns)
        rss = {} if quick else {s: spawn(_worker, w, w, max(3, steps // 5), s) for s in ("ours", "fsdp")}
        r0 = per_rank[0]  # the step series are the max over ranks, equal on every rank
        st, sp = r0["step_times"], r0["split"]
        mib = 2**20
        rows.append({
            "device": device, "world": w,
            "ours_step_ms": stats(st["ours"], 1e3), "fsdp2_step_ms": stats(st["fsdp"], 1e3),
            "ratio_step": paired_ratio(st["ours"], st["fsdp"]),
            "ratio_ag": paired_ratio(sp["ours_ag"], sp["fsdp_ag"]),
            "ratio_rs": paired_ratio(sp["ours_rs"], sp["fsdp_rs"]),
            "copy_MiB_ours": r0["ours_copy_bytes"] / mib, "copy_MiB_fsdp2": r0["fsdp_copy_bytes"] / mib,
            "ag_peak_MiB_ours": r0["peak_buffer_bytes"]["ours"]["ag"] / mib,
            "ag_peak_MiB_fsdp2": r0["peak_buffer_bytes"]["fsdp"]["ag"] / mib,
            "ours_padding": r0["ours_padding"],
        })
        if rss:
            rows[-1]["rss_delta_MiB_ours"] = max(r["rss_delta_kib"] for r in rss["ours"]) / 1024
            rows[-1]["rss_delta_MiB_fsdp2"] = max(r["rss_delta_kib"] for r in rss["fsdp"]) / 1024
        notes.append(f"W={w}: copy ops ours {r0['ours_copy_ops']}, FSDP2 {r0['fsdp_copy_ops']}")
        if (nr := not_run_row(w)) is not None:
            rows.append(nr)
    notes.insert(0, f"one group of {numel / 1e6:.2f} M fp32 elements ({numel * 4 / 2**20:.1f} MiB); "
                    "a step is one all-gather + one reduce-scatter (FSDP2: unshard + post_backward); "
                    "times are the slowest rank's; ratio < 1 means this library is faster")
    headline = [{"comparison": f"DistributedBuffer AG+RS step / FSDP2 unshard+post_backward, W={r['world']}",
                 "ratio": r["ratio_step"]} for r in rows if "ratio_step" in r]
    headline += [{"comparison": f"bytes copied outside collectives, ours / FSDP2, W={r['world']}",
                  "ratio": r["copy_MiB_ours"] / r["copy_MiB_fsdp2"]} for r in rows if "ratio_step" in r]
    return result("buffer", rows, notes, headline=headline, shapes=SHAPES, steps=steps,
                  wall_s=time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> dict:
    return cli(run, "buffer", argv)


if __name__ == "__main__":
    main()
