"""DistributedBuffer all-gather + reduce-scatter against FSDP2's own path, CPU gloo.

    python -m benchmarks.bench_buffer --out benchmarks/out/buffer.json [--steps 30]

One group of transformer-block-shaped parameters (uneven rows, ~3.2 M fp32 elements) on
W = 2 and 4 gloo ranks (spawned with torch.multiprocessing). Per step:

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

import argparse
import json
import math
import os
import resource
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from vefsdp_optim.comm import DistributedBuffer
from vefsdp_optim.sharding import TensorSpec, plan_group

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


def _setup_ours(group, rank: int, w: int, full: dict[str, torch.Tensor]):
    plan = plan_group([TensorSpec(n, s) for n, s in SHAPES.items()], w)
    buf = DistributedBuffer(plan, group, dtype=torch.float32)
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


def _setup_fsdp(w: int, rank: int, full: dict[str, torch.Tensor]):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (w,))
    module = _Block()
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(full[name])
    fully_shard(module, mesh=mesh)
    state = module._get_fsdp_state()
    state._lazy_init()  # what the first forward does: comm context, root state
    pg = state._fsdp_param_group
    names = [n for n, _ in module.named_parameters()]
    grads = [full[n] * (rank + 1) for n in names]
    return module, pg, grads


def _fsdp_step(module, pg, grads) -> tuple[float, float, dict[str, int]]:
    t0 = time.perf_counter()
    module.unshard()
    t1 = time.perf_counter()
    w = pg.mesh_info.shard_mesh_size
    shard = _nbytes([fp._sharded_param_data for fp in pg.fsdp_params])  # padded, persistent
    unsharded = _nbytes([fp.unsharded_param for fp in pg.fsdp_params])
    # at copy-out: sharded params + all-gather output (W padded shards) + unsharded params;
    # at reduce-scatter: unsharded grads + reduce-scatter input (W shards) + output (1 shard)
    peak = {"ag": shard + w * shard + unsharded, "rs": _nbytes(grads) + w * shard + shard}
    for fp, g in zip(pg.fsdp_params, grads, strict=True):
        fp.unsharded_param.grad = g
    t2 = time.perf_counter()
    pg.post_backward()
    t3 = time.perf_counter()
    for p in module.parameters():
        p.grad = None
    return t1 - t0, t3 - t2, peak


def _worker(rank: int, w: int, init_file: str, steps: int, mode: str, out_path: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=w)
    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(0)
    full = {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    res: dict[str, object] = {}
    buf = _setup_ours(group, rank, w, full) if mode in ("time", "ours") else None
    fsdp = _setup_fsdp(w, rank, full) if mode in ("time", "fsdp") else None
    if buf is not None and fsdp is not None:  # same values as FSDP2's unsharded params
        buf.all_gather()
        fsdp[0].unshard()
        for name, fp in zip(SHAPES, fsdp[1].fsdp_params, strict=True):
            if not torch.equal(fp.unsharded_param.detach(), buf.full_view(name)):
                raise AssertionError(f"all-gathered {name} differs from FSDP2's")
        fsdp[0].reshard()
        buf.free_global()
    times: dict[str, list[float]] = {"ours_ag": [], "ours_rs": [], "fsdp_ag": [], "fsdp_rs": []}
    peaks = {}
    for step in range(steps + 2):
        for side in ("ours", "fsdp") if step % 2 == 0 else ("fsdp", "ours"):
            if side == "ours" and buf is not None:
                ag, rs, peak = _ours_step(buf)
            elif side == "fsdp" and fsdp is not None:
                ag, rs, peak = _fsdp_step(*fsdp)
            else:
                continue
            peaks[side] = peak
            if step >= 2:  # warm-up
                times[f"{side}_ag"].append(ag)
                times[f"{side}_rs"].append(rs)
    if mode == "time":
        for side, step_fn, args in (("ours", _ours_step, (buf,)), ("fsdp", _fsdp_step, fsdp)):
            with _CopyBytes() as cb:
                step_fn(*args)
            res[f"{side}_copy_bytes"] = cb.bytes
            res[f"{side}_copy_ops"] = cb.ops
        res["times"] = {k: statistics.median(v) for k, v in times.items() if v}
        res["peak_buffer_bytes"] = peaks
        res["param_bytes"] = sum(math.prod(s) for s in SHAPES.values()) * 4
        res["ours_padding"] = buf.plan.padding
    else:
        res["rss_delta_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0
        res["rss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    gathered = [None] * w
    dist.all_gather_object(gathered, res, group=group)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


def _spawn(w: int, steps: int, mode: str) -> list[dict]:
    fd, init_file = tempfile.mkstemp(prefix="vefsdp_bench_")
    os.close(fd)
    os.unlink(init_file)
    fd, out_path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        mp.spawn(_worker, args=(w, init_file, steps, mode, out_path), nprocs=w, join=True)
        with open(out_path) as f:
            return json.load(f)
    finally:
        for p in (init_file, out_path):
            if os.path.exists(p):
                os.unlink(p)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/out/buffer.json")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--worlds", default=",".join(map(str, WORLDS)))
    a = ap.parse_args()
    numel = sum(math.prod(s) for s in SHAPES.values())
    rows = []
    for w in (int(x) for x in a.worlds.split(",")):
        per_rank = _spawn(w, a.steps, "time")
        rss = {side: _spawn(w, max(4, a.steps // 5), side) for side in ("ours", "fsdp")}
        t = {k: statistics.median(r["times"][k] for r in per_rank) for k in per_rank[0]["times"]}
        r0 = per_rank[0]
        row = {
            "world_size": w,
            "numel": numel,
            "ours_padding": r0["ours_padding"],
            "median_s": t,
            "ratio_ag": t["ours_ag"] / t["fsdp_ag"],
            "ratio_rs": t["ours_rs"] / t["fsdp_rs"],
            "ratio_step": (t["ours_ag"] + t["ours_rs"]) / (t["fsdp_ag"] + t["fsdp_rs"]),
            "copy_bytes_per_step": {"ours": r0["ours_copy_bytes"], "fsdp2": r0["fsdp_copy_bytes"]},
            "copy_ops": {"ours": r0["ours_copy_ops"], "fsdp2": r0["fsdp_copy_ops"]},
            "peak_buffer_bytes": r0["peak_buffer_bytes"],
            "rss_delta_kib_max_over_ranks": {s: max(r["rss_delta_kib"] for r in v) for s, v in rss.items()},
            "rss_kib_max_over_ranks": {s: max(r["rss_kib"] for r in v) for s, v in rss.items()},
        }
        rows.append(row)
    print(f"{numel / 1e6:.2f} M fp32 elements ({numel * 4 / 2**20:.1f} MiB), {a.steps} steps, medians")
    hdr = (f"{'W':>2} {'AG ours ms':>10} {'AG fsdp ms':>10} {'RS ours ms':>10} {'RS fsdp ms':>10} "
           f"{'step ratio':>10} {'copy MiB ours/fsdp':>19} {'AG peak MiB':>15} {'RS peak MiB':>15} "
           f"{'RSS+ MiB ours/fsdp':>19}")
    print(hdr)
    for r in rows:
        t, mib, pk = r["median_s"], 2**20, r["peak_buffer_bytes"]
        print(f"{r['world_size']:>2} {t['ours_ag'] * 1e3:>10.2f} {t['fsdp_ag'] * 1e3:>10.2f} "
              f"{t['ours_rs'] * 1e3:>10.2f} {t['fsdp_rs'] * 1e3:>10.2f} {r['ratio_step']:>10.3f} "
              f"{r['copy_bytes_per_step']['ours'] / mib:>9.2f}/{r['copy_bytes_per_step']['fsdp2'] / mib:<9.2f} "
              f"{pk['ours']['ag'] / mib:>7.1f}/{pk['fsdp']['ag'] / mib:<7.1f} "
              f"{pk['ours']['rs'] / mib:>7.1f}/{pk['fsdp']['rs'] / mib:<7.1f} "
              f"{r['rss_delta_kib_max_over_ranks']['ours'] / 1024:>9.1f}/"
              f"{r['rss_delta_kib_max_over_ranks']['fsdp'] / 1024:<9.1f}")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"shapes": SHAPES, "steps": a.steps, "rows": rows}, f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
