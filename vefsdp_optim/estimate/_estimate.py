"""The estimator: one rank per process, a report over the ranks asked for."""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import os
import statistics
import subprocess
import sys
from typing import Any

from .._torch_compat import (
    checkpoint_wrapper,
    fake_store,
    fake_tensor_mode,
    global_peak_memory_tracker,
)
from ._config import CONFIGS, ModelConfig, check_config, config_from_dict
from ._model import Transformer, tp_plan, tp_plan_root

__all__ = ["OPTIMIZERS", "STATE_KINDS", "estimate_rank", "main", "real_tensors_on_the_fake_group",
           "state_by_kind"]

OPTIMIZERS = ("AdamW", "Adam", "AdamW8bit", "Adam8bit", "Muon", "NorMuon", "Shampoo", "SOAP",
              "torch.AdamW")
# optimizer state keys -> kind, first match (prefix) wins
STATE_KINDS: tuple[tuple[str, str], ...] = (
    ("exp_avg_codes", "8-bit codes and scales"), ("exp_avg_sq_codes", "8-bit codes and scales"),
    ("exp_avg_absmax", "8-bit codes and scales"), ("exp_avg_sq_absmax", "8-bit codes and scales"),
    ("momentum_codes", "Muon momentum (8-bit)"), ("momentum_absmax", "Muon momentum (8-bit)"),
    ("momentum_buffer", "Muon momentum"), ("variance_neuron", "NorMuon neuron moments"),
    ("exp_avg", "Adam moments"), ("max_exp_avg_sq", "Adam moments"),
    ("L_inv_root", "Shampoo roots"), ("R_inv_root", "Shampoo roots"), ("L.", "Shampoo factors"),
    ("R.", "Shampoo factors"), ("GG.", "SOAP factors"), ("Q.", "SOAP bases"),
)
MiB = 2**20


def _kind(key: object) -> str:
    name = str(key)
    for prefix, kind in STATE_KINDS:
        if name.startswith(prefix):
            return kind
    return "other (" + name.split(".")[0] + ")"


def state_by_kind(opt: Any) -> dict[str, int]:
    """The bytes of ``opt.state``'s tensors on this rank (a DTensor's or a sharded
    parameter's local tensor), by kind (STATE_KINDS); step counts under "step"."""
    out: dict[str, int] = {}
    for state in opt.state.values():
        for key, v in state.items():
            local = v.to_local() if hasattr(v, "to_local") else v
            if not hasattr(local, "untyped_storage"):
                continue
            kind = "step" if key in ("step", "momentum_step") else _kind(key)
            out[kind] = out.get(kind, 0) + local.numel() * local.element_size()
    return out


def _optimizer(name: str, model: Any, kwargs: dict[str, Any]) -> Any:
    import torch

    import vefsdp_optim

    kwargs = {"lr": 1e-3, **kwargs}
    if name == "torch.AdamW":
        return torch.optim.AdamW(model.parameters(), **kwargs)
    cls = getattr(vefsdp_optim, name)
    if name in ("Muon", "NorMuon"):  # the blocks' matrices; embeddings, head and norms on AdamW
        named = list(model.named_parameters())
        matrices = [p for n, p in named if n.startswith("layers.") and p.dim() == 2]
        # each expert whole
        experts = [p for n, p in named if n.startswith("layers.") and p.dim() == 3]
        rest = [p for n, p in named if not (n.startswith("layers.") and p.dim() in (2, 3))]
        groups = [{"params": matrices}, {"params": rest, "use_muon": False}]
        if experts:
            groups.insert(1, {"params": experts, "flatten": False})
        return cls(groups, **kwargs)
    return cls(model.parameters(), **kwargs)


def real_tensors_on_the_fake_group() -> None:
    """Let real tensors run on torch's fake process group: it fills an all_to_all's output
    from this rank's input and refuses an empty input with a non-empty output (a rank that
    only receives); it moves nothing either way, so such an output is left as it is. For
    the real-tensor check of an estimate (``real=True``) and benchmarks/bench_scale.py;
    fake tensors never reach the group's kernels. Idempotent."""
    import torch.distributed as dist

    real = dist.all_to_all_single
    if getattr(real, "_vefsdp_fake_group", False):
        return

    def all_to_all_single(output: Any, input: Any, output_split_sizes: Any = None,
                          input_split_sizes: Any = None, **kwargs: Any) -> Any:
        if input.numel() == 0 and output.numel() and output_split_sizes:
            output, output_split_sizes = output[:0], [0] * len(output_split_sizes)
        return real(output, input, output_split_sizes, input_split_sizes, **kwargs)

    all_to_all_single._vefsdp_fake_group = True  # type: ignore[attr-defined]
    dist.all_to_all_single = all_to_all_single


def _expert_parallel(experts: list[Any], ep_mesh: Any) -> None:
    """Each expert weight a DTensor ``Shard(0)`` over ``ep_mesh`` (torchtitan's
    ``ExpertParallel``): this rank's experts, a new tensor (not a view of all of them)."""
    from torch import nn
    from torch.distributed.tensor import DTensor, Shard

    ep, r = ep_mesh.size(), ep_mesh.get_local_rank()
    for module in experts:
        for name, p in list(module.named_parameters(recurse=False)):
            n = p.shape[0] // ep
            local = p.detach().narrow(0, r * n, n).clone()
            t = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False, shape=p.shape,
                                   stride=p.stride())
            setattr(module, name, nn.Parameter(t))


def _parallelize(model: Any, tp_mesh: Any, dp_mesh: Any, fully_shard: Any, ac: str,
                 param_dtype: str, ep_meshes: tuple[Any, Any] | None = None) -> None:
    """torchtitan's order: tensor and expert parallel (the root's embedding and head, each
    block; the experts over ``ep``), activation checkpointing of each block, then FSDP per
    block (its experts first, over ``edp``, where ep > 1) and the root. ``ep_meshes``:
    (ep, edp) meshes."""
    from ._layers import GroupedExperts

    if tp_mesh is not None:
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(model, tp_mesh, tp_plan_root())
        for block in model.layers.values():
            parallelize_module(block, tp_mesh, tp_plan())
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    if ep_meshes is not None:
        _expert_parallel(experts, ep_meshes[0])
    if ac == "full":
        for name, block in list(model.layers.items()):
            model.layers[name] = checkpoint_wrapper(block)
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    # torchtitan's default: parameters gathered in bfloat16, gradients reduced in float32
    mp = MixedPrecisionPolicy(param_dtype=getattr(torch, param_dtype), reduce_dtype=torch.float32)
    if ep_meshes is not None:
        from torch.distributed.tensor import Shard

        ep_mesh, edp_mesh = ep_meshes
        # torchtitan's rule: experts cut on dim 1 where the shards outnumber them
        shards = edp_mesh.size(edp_mesh.ndim - 1) * ep_mesh.size()
        placement = Shard(1) if shards > experts[0].w1.shape[0] else Shard(0)
        for module in experts:
            fully_shard(module, mesh=edp_mesh, mp_policy=mp, shard_placement_fn=lambda p: placement)
    # torchtitan's apply_fsdp: the embedding, each block, the norm and head together (not
    # resharded after forward: backward needs them at once), the root
    fully_shard(model.tok_embeddings, mesh=dp_mesh, mp_policy=mp)
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, mp_policy=mp)
    fully_shard([model.norm, model.output], mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp)


def _device(choice: str) -> str:
    import torch

    if choice != "auto":
        return choice
    return "cuda" if torch.cuda.is_available() else "cpu"


def estimate_rank(cfg: ModelConfig, rank: int, *, dp: int, tp: int = 1, replicas: int = 1,
                  ep: int = 1, capacity_factor: float = 1.0, sharding: str = "fsdp2",
                  optimizer: str = "AdamW", opt_kwargs: dict[str, Any] | None = None,
                  batch: int = 1, seq: int = 2048,
                  ac: str = "none", param_dtype: str = "bfloat16", device: str = "auto",
                  real: bool = False, warmup: bool = True) -> dict[str, Any]:
    """Rank ``rank`` of a ``dp * tp``-rank job, in this process (which must not have a
    process group yet): peak memory by category, the optimizer state by kind, after two
    steps. ``ep``: expert-parallel ranks, taken from each replica's data-parallel shards
    (torchtitan's layout: the experts ``Shard(0)`` over ep, FSDP over the dp / ep ranks
    that hold the same experts); ``capacity_factor``: the rows each ep rank's dispatch
    buffers hold, in units of a balanced router's (_layers.py). ``real=True`` runs on
    real tensors instead of fakes (small models: the check of the estimate; on CUDA it
    also reports ``torch.cuda.max_memory_allocated`` over the steps). ``warmup=False``
    tracks from the first step, as torchtitan's estimator does (its figures, DTensor's
    first-use shape propagation included)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if sharding not in ("fsdp2", "ours"):
        raise ValueError(f"sharding must be 'fsdp2' or 'ours', got {sharding!r}")
    if ac not in ("none", "full"):
        raise ValueError(f"ac must be 'none' or 'full' (activation checkpointing of every block), "
                         f"got {ac!r}")
    if param_dtype not in ("bfloat16", "float32"):
        raise ValueError(f"param_dtype must be 'bfloat16' or 'float32', got {param_dtype!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    if dp < 1 or tp < 1 or replicas < 1 or dp % replicas:
        raise ValueError(f"dp={dp}, tp={tp}, replicas={replicas}: each >= 1 and replicas "
                         "dividing dp")
    if not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be > 0, got {capacity_factor!r}")
    world = dp * tp
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank}")
    check_config(cfg, tp, ep, dp // replicas)
    dev = _device(device)
    torch.set_num_threads(1)
    if real:
        real_tensors_on_the_fake_group()
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world)
    dims, names = [dp // replicas], ["shard"]
    if replicas > 1:
        dims, names = [replicas, *dims], ["replicate", *names]
    if tp > 1:
        dims, names = [*dims, tp], [*names, "tp"]
    # outside the mode: a host rank tensor
    mesh = init_device_mesh(dev, tuple(dims), mesh_dim_names=tuple(names))
    # sub-meshes outside the mode too (slicing reads the rank tensor)
    dp_mesh = mesh[tuple(n for n in names if n != "tp")] if len(names) > 1 else mesh
    tp_mesh = mesh["tp"] if tp > 1 else None
    ep_meshes = None
    if ep > 1:  # the same ranks as (replicas, dp shards / ep, ep): ep the innermost
        edims, enames = [dp // replicas // ep, ep], ["edp", "ep"]
        if replicas > 1:
            edims, enames = [replicas, *edims], ["replicate", *enames]
        emesh = init_device_mesh(dev, tuple(edims), mesh_dim_names=tuple(enames))
        ep_meshes = (emesh["ep"], emesh[tuple(n for n in enames if n != "ep")])
    if sharding == "ours":
        from vefsdp_optim import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    mode = contextlib.nullcontext() if real else fake_tensor_mode(allow_non_fake_inputs=True)
    torch.manual_seed(0)
    if sharding == "fsdp2":
        # torchtitan's flow: the model on the meta device, parallelized and sharded there
        # (torch's meshes read their host rank tensors, which the fake mode would fake),
        # then made fake (real with real=True) by to_empty
        with torch.device("meta"):
            model = Transformer(cfg, max_seq_len=seq)
        _parallelize(model, tp_mesh, dp_mesh, fully_shard, ac, param_dtype, ep_meshes)
        with mode:
            model.to_empty(device=dev)
            model.init_buffers()
    else:  # our fully_shard keeps its flat buffers made at sharding: made under the mode
        with mode:
            with torch.device(dev):
                model = Transformer(cfg, max_seq_len=seq)
            _parallelize(model, tp_mesh, dp_mesh, fully_shard, ac, param_dtype, ep_meshes)
    for m in model.modules():
        if hasattr(m, "capacity_factor"):
            m.capacity_factor = capacity_factor
    with mode:
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.02)
        opt = _optimizer(optimizer, model, dict(opt_kwargs or {}))
        if sharding == "fsdp2":  # torch's FSDP2 tracker, as torchtitan's estimator uses
            tracker = global_peak_memory_tracker(model, opt)
        else:
            tracker = global_peak_memory_tracker()
            tracker.track_external(model, opt)
        # torchtitan's estimator: one batch of inputs and labels, made before the steps
        tokens = torch.randint(cfg.vocab_size, (batch, seq), device=dev)
        labels = torch.randint(cfg.vocab_size, (batch, seq), device=dev)
        if sharding == "fsdp2":
            tracker.track_inputs((tokens, labels))

        def train_step() -> None:
            logits = model(tokens)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                                                     reduction="sum")
            del logits  # as torchtitan's step: the logits are not kept through backward
            loss.backward()
            opt.step()
            opt.zero_grad()

        # One step before the tracked ones. DTensor's first use of an op runs it on
        # global-shape fake tensors to propagate shapes, in the active fake mode; the tracker
        # counts them, a GPU run never allocates them (torch.optim.AdamW on FSDP2, W = 3:
        # 1.2x its state with foreach=False, 5x with foreach=True, at the first step). Later
        # uses hit DTensor's cache: the tracked steps are steady-state steps, as on a GPU.
        if warmup:
            train_step()
        measure_cuda = real and dev == "cuda"
        if measure_cuda:  # the check of the estimate on a GPU: the allocator's own peak, same steps
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        with tracker:
            for _ in range(2):
                train_step()
                # per-module stats are per iteration (torchtitan's estimator does this)
                tracker.reset_mod_stats()
        cuda_peak = None
        if measure_cuda:
            torch.cuda.synchronize()
            cuda_peak = int(torch.cuda.max_memory_allocated())
        peak = tracker.get_tracker_snapshot("peak")
        state = state_by_kind(opt)
    dist.destroy_process_group()
    by_device = {str(d): {getattr(k, "value", str(k)): int(v) for k, v in snap.items()}
                 for d, snap in peak.items()}
    main_dev = max(by_device, key=lambda d: by_device[d].get("Total", 0))
    return {"rank": rank, "world": world, "device": dev, "peak": by_device[main_dev],
            "state": state, "state_total": sum(v for k, v in state.items()),
            "params": cfg.num_params(),
            "cuda_max_allocated": cuda_peak}


def _parse_kwargs(pairs: list[str]) -> dict[str, Any]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.isidentifier():
            raise SystemExit(f"--opt takes KEY=VALUE (a Python literal), got {pair!r}")
        if value.startswith("torch."):  # a dtype: momentum_dtype=torch.int8
            import torch

            dtype = getattr(torch, value.removeprefix("torch."), None)
            if not isinstance(dtype, torch.dtype):
                raise SystemExit(f"--opt {pair!r}: {value} is not a torch dtype")
            out[key] = dtype
            continue
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


def _config(args: argparse.Namespace) -> ModelConfig:
    import dataclasses

    if args.config:
        with open(args.config) as f:
            cfg = config_from_dict(json.load(f))
    else:
        cfg = CONFIGS[args.model]
    if not args.layers:
        return cfg
    return dataclasses.replace(cfg, n_layers=args.layers,
                               n_dense_layers=min(cfg.n_dense_layers, args.layers))


def _spawn(args: argparse.Namespace, rank: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "vefsdp_optim.estimate", *args.argv, "--one", str(rank)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"rank {rank} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _report(args: argparse.Namespace, runs: list[dict[str, Any]]) -> str:
    def mib(x: float) -> str:
        return f"{x / MiB:,.1f}"

    cats = sorted({k for r in runs for k in r["peak"] if k != "Total"})
    kinds = sorted({k for r in runs for k in r["state"]})
    totals = [r["peak"].get("Total", 0) for r in runs]
    busiest = runs[max(range(len(runs)), key=lambda i: totals[i])]
    median = statistics.median(totals)
    head = (f"{args.model} ({runs[0]['params'] / 1e9:.2f} B parameters), W = {runs[0]['world']} "
            f"(dp {args.dp}{f' as {args.replicas} replicas' if args.replicas > 1 else ''}, "
            f"tp {args.tp}"
            f"{f', ep {args.ep}' if args.ep > 1 else ''}), "
            f"{args.sharding}, {args.optimizer} {args.opt or ''}, batch {args.batch} x "
            f"seq {args.seq}, "
            f"activation checkpointing {args.ac}, parameters gathered in {args.param_dtype}, "
            f"{'real' if args.real else 'fake'} {runs[0]['device']} tensors; MiB per rank")
    lines = [head, "",
             "| rank | peak | " + " | ".join(cats) + " | state: " + " | ".join(kinds) + " |",
             "| --- " * (2 + len(cats) + len(kinds)) + "|"]
    for r in runs:
        lines.append(f"| {r['rank']} | {mib(r['peak'].get('Total', 0))} | "
                     + " | ".join(mib(r["peak"].get(c, 0)) for c in cats) + " | "
                     + " | ".join(mib(r["state"].get(k, 0)) for k in kinds) + " |")
    lines += ["", f"busiest rank: {busiest['rank']}, peak {mib(max(totals))} MiB, optimizer state "
              f"{mib(busiest['state_total'])} MiB; median peak over the {len(runs)} ranks asked: "
              f"{mib(median)} MiB"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m vefsdp_optim.estimate", description=__doc__)
    p.add_argument("--model", choices=sorted(CONFIGS), default="llama3-8b")
    p.add_argument("--config", default=None, metavar="JSON",
                   help="the model from a file instead: a Hugging Face config.json of a "
                        "LLaMA-shaped model, "
                        "or torchtitan's llama3 TransformerModelArgs fields")
    p.add_argument("--layers", type=int, default=0, help="override the model's layer count")
    p.add_argument("--dp", type=int, required=True,
                   help="data-parallel ranks (sharded, or replicas x shards)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    p.add_argument("--replicas", type=int, default=1, help="HSDP replicas (dp = replicas x shards)")
    p.add_argument("--ep", type=int, default=1,
                   help="expert-parallel ranks, from the data-parallel shards "
                        "(mixtures of experts)")
    p.add_argument("--capacity-factor", type=float, default=1.0,
                   help="each ep rank's dispatch rows, in units of a balanced router's")
    p.add_argument("--sharding", choices=("fsdp2", "ours"), default="fsdp2")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="AdamW")
    p.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE",
                   help="an optimizer option")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--ac", choices=("none", "full"), default="none",
                   help="activation checkpointing of every block")
    p.add_argument("--param-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="the dtype parameters are gathered in (mixed precision; gradients "
                        "reduce in float32)")
    p.add_argument("--ranks", default="", help="comma-separated ranks (default: 0, W/2, W-1)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--json", action="store_true", help="print the per-rank results as JSON")
    p.add_argument("--real", action="store_true",
                   help="run on real tensors instead of fakes (small models: to check the "
                        "estimate)")
    p.add_argument("--no-warmup", action="store_true",
                   help="track from the first step, as torchtitan's estimator (DTensor's "
                        "first-use shape "
                        "propagation on global-shape fake tensors counted)")
    p.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    cfg = _config(args)
    kw = _parse_kwargs(args.opt)
    common = dict(dp=args.dp, tp=args.tp, replicas=args.replicas, ep=args.ep,
                  capacity_factor=args.capacity_factor, sharding=args.sharding,
                  optimizer=args.optimizer, opt_kwargs=kw, batch=args.batch, seq=args.seq,
                  ac=args.ac,
                  param_dtype=args.param_dtype, device=args.device, real=args.real,
                  warmup=not args.no_warmup)
    if args.one is not None:
        print(json.dumps(estimate_rank(cfg, args.one, **common)))
        return
    world = args.dp * args.tp
    ranks = ([int(r) for r in args.ranks.split(",")] if args.ranks
             else sorted({0, world // 2, world - 1}))
    bad = [r for r in ranks if not 0 <= r < world]
    if bad:
        raise SystemExit(f"--ranks {bad} outside [0, {world})")
    args.argv = [a for i, a in enumerate(argv) if a != "--json"]
    runs = [_spawn(args, r) for r in ranks]
    print(json.dumps(runs) if args.json else _report(args, runs))
