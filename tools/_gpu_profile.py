"""Do our ``fully_shard``'s all-gathers and reduce-scatters run off the default stream?
(``make gpu-check``.) FSDP2 on the same model is the control.

[Note: collectives in a profiler trace]
torch.profiler with CUDA activities records each GPU kernel, copy and set with its
stream and the ``External id`` of the CPU op that launched it (the innermost one:
ProcessGroupNCCL wraps each collective in an op named ``nccl:<collective>``). A GPU
event is an all-gather (a reduce-scatter) when its kernel is NCCL's or its op is a c10d
one, and one of the two names says all-gather (reduce-scatter), with underscores
ignored; a copy NCCL makes for a group of one counts too. The default stream is the
stream of a marker kernel (``torch.cuda._sleep``) launched on it inside the trace, else
the stream that ran the most compute. The check passes when both kinds were seen and
none ran on the default stream; ``overlap_share`` is the part of their GPU time during
which a kernel of another kind ran on another stream (what the streams are for). With
no collective in the trace (our ``fully_shard`` makes none at W = 1) nothing is judged.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import tools._checkout  # noqa: F401 - before vefsdp_optim: [Note: checkout imports]
from tools._gpu_parts import progress, run_on_ranks

__all__ = ["analyze_trace", "collective_kind", "profiler_part"]

_COMM_OPS = ("nccl:", "gloo:", "c10d::", "record_param_comms")


def collective_kind(kernel: str, op: str) -> str | None:
    """"all_gather", "reduce_scatter" or None for a GPU event ([Note: collectives in a
    profiler trace])."""
    k, o = kernel.lower(), op.lower()
    if not (k.startswith("nccl") or o.startswith(_COMM_OPS)):
        return None
    s = (k + " " + o).replace("_", "")
    if "allgather" in s:
        return "all_gather"
    if "reducescatter" in s:
        return "reduce_scatter"
    return None


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _overlap(a: float, b: float, union: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in union if x < b and y > a)


def analyze_trace(trace: dict[str, Any]) -> dict[str, Any]:
    """The all-gathers and reduce-scatters of a chrome trace (torch.profiler's
    ``export_chrome_trace``): their streams against the default stream, their overlap
    with compute, and a verdict ``ok`` (None: nothing to judge, with ``why``)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    ops: dict[Any, str] = {}
    cpu_comm: Counter[str] = Counter()
    for e in events:
        if e.get("cat") in ("cpu_op", "user_annotation"):
            ext = (e.get("args") or {}).get("External id")
            if ext is not None:
                ops.setdefault(ext, e.get("name", ""))
            if str(e.get("name", "")).startswith(_COMM_OPS):
                cpu_comm[e["name"]] += 1
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    kinds: dict[str, list[dict[str, Any]]] = {"all_gather": [], "reduce_scatter": []}
    compute: list[dict[str, Any]] = []
    for e in gpu:
        args = e.get("args") or {}
        kind = collective_kind(str(e.get("name", "")), ops.get(args.get("External id"), ""))
        if kind is not None:
            kinds[kind].append(e)
        elif e.get("cat") == "kernel":
            compute.append(e)
    out: dict[str, Any] = {"gpu_events": len(gpu), "cpu_comm_ops": dict(cpu_comm), "ok": None}
    if not gpu:
        out["why"] = "no GPU activity in the trace (the CPU has no streams)"
        return out

    def stream(e: dict[str, Any]) -> Any:
        return (e.get("args") or {}).get("stream", e.get("tid"))

    markers = [stream(e) for e in compute if "spin_kernel" in str(e.get("name", ""))]
    if markers:
        default, source = markers[0], "marker kernel"
    else:
        busy: Counter[Any] = Counter()
        for e in compute:
            busy[stream(e)] += float(e.get("dur", 0))
        default, source = (busy.most_common(1)[0][0] if busy else None), "the stream with the most compute"
    out.update(default_stream=default, default_stream_from=source)
    union = _union([(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in compute
                    if "spin_kernel" not in str(e.get("name", ""))])
    for kind, evs in kinds.items():
        total = sum(float(e.get("dur", 0)) for e in evs)
        over = sum(_overlap(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), union) for e in evs)
        out[kind] = dict(n=len(evs), streams=sorted({str(stream(e)) for e in evs}),
                         on_default=sum(stream(e) == default for e in evs), gpu_us=round(total, 1),
                         overlap_share=round(over / total, 3) if total else None)
    seen = [k for k in kinds if out[k]["n"]]
    if len(seen) < 2:
        missing = [k.replace("_", "-") + "s" for k in kinds if not out[k]["n"]]
        out["why"] = f"no {' or '.join(missing)} in the trace"
        return out
    on_default = {k: out[k]["on_default"] for k in kinds if out[k]["on_default"]}
    out["ok"] = not on_default
    out["why"] = ("all off the default stream" if not on_default else
                  "on the default stream: " + ", ".join(f"{n} of {out[k]['n']} {k.replace('_', '-')}s"
                                                        for k, n in on_default.items()))
    return out


def _profile_rank(size: str, device: str, trace_dir: str) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    from tools._gpu_bench import batches, build_system, gpt, sync, train_step

    cuda = torch.device(device).type == "cuda"
    dev = f"cuda:{torch.cuda.current_device()}" if cuda else "cpu"
    rank = dist.get_rank()
    res: dict[str, Any] = {}
    base = gpt(size)
    data = batches(4, size, dev)
    for system in ("ours", "fsdp2"):
        progress({"start": f"profiler {system}"})
        try:
            model, opt = build_system(system, base, dev)
            for k in range(2):
                train_step(model, opt, data[k])
            sync(dev)
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=acts) as prof:
                if cuda:
                    torch.cuda._sleep(1000)  # the marker on the default stream
                for k in range(2, 4):
                    train_step(model, opt, data[k])
                sync(dev)
            path = Path(trace_dir) / f"trace_{system}_rank{rank}.json"
            prof.export_chrome_trace(str(path))
            res[system] = analyze_trace(json.loads(path.read_text()))
            path.unlink()
            del model, opt
            if cuda:
                torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001 - reported
            res[system] = {"ok": False, "why": f"{type(e).__name__}: {str(e)[:500]}"}
        progress({"system": system, **res[system]})
    return res


def profiler_part(part: str, world: int, device: str, size: str, part_dir: Path) -> dict[str, Any]:
    """The stream check at ``world`` ranks: rank 0's analysis for ours and FSDP2."""
    per_rank = run_on_ranks(_profile_rank, world, device, part_dir, size, device, str(part_dir))
    ours = per_rank[0]["ours"]
    if world == 1 and ours.get("ok") is None and torch.device(device).type == "cuda":
        ours["why"] = (ours.get("why", "") + "; fully_shard makes no collective with one rank: "
                       "the check needs 2 GPUs")
    status = {True: "pass", False: "fail", None: "skip"}[ours.get("ok")]
    return dict(kind="check", world=world, status=status, ours=ours, fsdp2=per_rank[0]["fsdp2"],
                other_ranks={str(r): {s: x[s].get("ok") for s in x} for r, x in enumerate(per_rank[1:], 1)})
