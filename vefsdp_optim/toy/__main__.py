"""``python -m vefsdp_optim.toy`` (console script ``vefsdp-optim-toy``): bundled toy runs.

With no arguments: every built-in optimizer on the toy GPT, sharded by this library's
fully_shard over 2 gloo ranks on the CPU. ``--task moe --sharding ep --world-size 4
--check``: the expert-parallel run of ``_moe_ep.py``. ``--help`` lists the options.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence

from vefsdp_optim._registry import get_optimizer, list_optimizers

from ._moe_ep import (
    EP_DEFAULT_STEPS,
    EP_GRAD_RTOL,
    EP_LOSS_RTOL,
    EP_OPTIMIZERS,
    EPCheckConfig,
    launch_ep_check,
)
from ._report import check_results, curve_departure, format_table, write_outputs
from ._runner import (
    BUILTIN_OPTIMIZERS,
    SHARDINGS,
    RunConfig,
    RunResult,
    check_tolerance,
    launch,
    train_all,
)
from ._tasks import TASKS

__all__ = ["main", "parse_args", "configs_from_args", "ep_config_from_args"]


def _split(values: Sequence[str] | None) -> list[str]:
    return [v.strip() for item in values or () for v in item.split(",") if v.strip()]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m vefsdp_optim.toy",
        description="Train bundled toy tasks on the CPU with vefsdp_optim optimizers, sharded "
                    "or not, and compare them (loss floors, single-device references).")
    p.add_argument("--task", action="append", metavar="NAME",
                   help=f"task(s), repeatable or comma-separated: {', '.join(TASKS)} or 'all' "
                        "(default: gpt)")
    p.add_argument("--optimizer", action="append", metavar="NAME",
                   help="optimizer(s), repeatable or comma-separated: a registered name "
                        f"({', '.join(BUILTIN_OPTIMIZERS)}, ...), 'all' for the built-ins, or "
                        "'package.module:Class' (default: all)")
    p.add_argument("--sharding", choices=(*SHARDINGS, "ep"), default="fully_shard",
                   help="none (one process), fsdp2 (torch's fully_shard), fully_shard "
                        "(vefsdp_optim's) or ep (the moe task expert parallel, ep 2 x dp W/2, on "
                        "fully_shard, with QK-clip and a checkpoint moved to ep 1 x dp W halfway; "
                        "Muon or NorMuon) (default: fully_shard)")
    p.add_argument("--world-size", type=int, default=None, metavar="W",
                   help="ranks to spawn (gloo, CPU); under torchrun its WORLD_SIZE "
                        "(default: 2, 1 with --sharding none, 4 with --sharding ep)")
    p.add_argument("--steps", type=int, default=None,
                   help="training steps (default: each task's own, see --list)")
    p.add_argument("--seed", type=int, default=0, help="seed of data and initialization")
    p.add_argument("--lr", type=float, default=None,
                   help="learning rate for every optimizer (default: a per-optimizer, per-task "
                        "value; runs with --lr are not held to the task thresholds)")
    p.add_argument("--out", default="toy_out", metavar="DIR",
                   help="where losses.csv, results.json and loss_curves.png go (default: toy_out)")
    p.add_argument("--check", action="store_true",
                   help="also run each configuration on a single device and exit non-zero if a "
                        "sharded loss curve departs from it or a task misses its threshold")
    p.add_argument("--no-plot", action="store_true", help="do not write loss_curves.png")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--list", action="store_true", help="list tasks and optimizers and exit")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return _parser().parse_args(argv)


def configs_from_args(args: argparse.Namespace) -> tuple[list[RunConfig], int]:
    """The runs the arguments ask for and the world size; ValueError on bad values."""
    tasks = _split(args.task) or ["gpt"]
    if any(t.lower() == "all" for t in tasks):
        tasks = list(TASKS)
    opts = _split(args.optimizer) or ["all"]
    if any(o.lower() == "all" for o in opts):
        opts = [o for o in opts if o.lower() != "all"]
        opts = list(BUILTIN_OPTIMIZERS) + [o for o in opts if o.lower() not in BUILTIN_OPTIMIZERS]
    in_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world = args.world_size
    if world is None:
        world = int(os.environ["WORLD_SIZE"]) if in_torchrun else (1 if args.sharding == "none"
                                                                   else 2)
    if world < 1:
        raise ValueError(f"--world-size must be >= 1, got {world}")
    if args.sharding == "none" and world != 1:
        raise ValueError(f"--sharding none runs on one process; got --world-size {world} "
                         "(use fsdp2 or fully_shard to shard)")
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    if args.lr is not None and not args.lr > 0:
        raise ValueError(f"--lr must be > 0, got {args.lr}")
    for o in opts:  # a clear error now, not a traceback from a spawned rank later
        get_optimizer(o)
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ValueError(f"--out {args.out!r} is an existing file; give a directory (new "
                         "or existing)")
    configs = []
    for t in tasks:
        steps = args.steps if args.steps is not None else TASKS.get(t.lower(), TASKS["gpt"]).steps
        for o in opts:
            configs.append(RunConfig(t.lower(), o, args.sharding, steps, args.seed, args.lr))
    return configs, world


def ep_config_from_args(args: argparse.Namespace) -> tuple[EPCheckConfig, int]:
    """The expert-parallel run (``--sharding ep``) the arguments ask for and the world
    size; ValueError on bad values."""
    tasks = _split(args.task) or ["moe"]
    if [t.lower() for t in tasks] != ["moe"]:
        raise ValueError(f"--sharding ep runs the moe task only, got --task {','.join(tasks)}")
    opts = _split(args.optimizer) or ["muon"]
    if len(opts) != 1:
        raise ValueError("--sharding ep runs one optimizer (one of "
                         f"{', '.join(EP_OPTIMIZERS)}), got {opts}")
    in_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world = args.world_size
    if world is None:
        world = int(os.environ["WORLD_SIZE"]) if in_torchrun else 4
    if world < 2 or world % 2:
        raise ValueError("--sharding ep lays experts out over ep 2 x dp W/2: --world-size "
                         f"must be even and >= 2, got {world}")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ValueError(f"--out {args.out!r} is an existing file; give a directory (new "
                         "or existing)")
    steps = EP_DEFAULT_STEPS if args.steps is None else args.steps
    config = EPCheckConfig(optimizer=opts[0].lower(), steps=steps, seed=args.seed, lr=args.lr,
                           check=args.check)
    return config, world


def _main_ep(args: argparse.Namespace, config: EPCheckConfig, world: int) -> int:
    import json

    import torch.distributed as dist

    result = launch_ep_check(config, world)
    if dist.is_initialized():  # torchrun: the other ranks are done
        rank = dist.get_rank()
        dist.destroy_process_group()
        if rank != 0:
            return 0
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "moe_ep.json")
    with open(path, "w") as f:
        json.dump(result.to_json(), f, indent=1)
    split = config.split
    print(f"moe/{config.optimizer} W={world}: {result.layouts[0]} for steps 0-{split - 1}, "
          f"checkpoint, {result.layouts[1]} for steps {split}-{config.steps - 1}; loss "
          f"{result.losses[0]:.4f} -> {result.losses[-1]:.4f}; QK-clip scaled "
          f"{sum(result.clipped_heads)} heads in {sum(1 for c in result.clipped_heads if c)} of "
          f"{len(result.clipped_heads)} steps (threshold {config.qk_clip_threshold:g}); "
          f"{result.seconds:.1f} s")
    print(f"wrote {path}")
    if not args.check:
        return 0
    rel = [abs(a - b) / max(abs(b), 1e-12)
           for a, b in zip(result.losses, result.ref_losses, strict=True)]
    print(f"check: parameters vs one device replaying the same gradients: max |diff| "
          f"{max(result.param_diff, default=math.inf):.3g} over {len(result.param_diff)} steps, "
          f"{result.load_diff:.3g} after the load (must be 0); loss vs one device's forward: "
          f"{max(rel, default=math.inf):.3g} (tolerance {EP_LOSS_RTOL:g}); gradient: "
          f"{max(result.grad_rdiff, default=math.inf):.3g} (tolerance {EP_GRAD_RTOL:g})")
    failures = result.failures()
    for f in failures:
        print(f"CHECK FAILED [ep] moe/{config.optimizer} W={world}: {f}", file=sys.stderr)
    if failures:
        return 1
    print("all checks passed")
    return 0


def _list() -> str:
    lines = ["tasks:"]
    for t in TASKS.values():
        lines.append(f"  {t.name:<8} {t.steps:>4} steps  {t.description}")
    lines.append("optimizers (registered): " + ", ".join(list_optimizers()))
    lines.append("  or any 'package.module:Class' (e.g. "
                 "examples.custom_tile_sgd:TileNormalizedSGD)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the toy runs the arguments ask for; 0 on success, 1 when a --check fails."""
    parser = _parser()
    args = parser.parse_args(argv)
    if os.getcwd() not in sys.path:  # 'package.module:Class' from the working directory,
        sys.path.insert(0, os.getcwd())  # as under `python -m` (the console script lacks it)
    if args.list:
        print(_list())
        return 0
    if args.sharding == "ep":
        try:
            config, world = ep_config_from_args(args)
        except (ValueError, TypeError) as e:
            parser.error(str(e))
        return _main_ep(args, config, world)
    try:
        configs, world = configs_from_args(args)
    except (ValueError, TypeError) as e:
        parser.error(str(e))
    show = not args.quiet
    if args.sharding == "none":
        results = train_all(configs, show)
        rank = 0
    else:
        results = launch(configs, world, show)
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        if dist.is_initialized():  # torchrun: the other ranks are done
            dist.destroy_process_group()
    if rank != 0:
        return 0
    references: list[RunResult | None] = [None] * len(results)
    if args.check:
        todo = [i for i, r in enumerate(results) if r.config.sharding != "none"]
        if todo:
            if show:
                print("single-device references:", file=sys.stderr)
            refs = train_all([RunConfig(results[i].config.task, results[i].config.optimizer,
                                        "none", results[i].config.steps, results[i].config.seed,
                                        results[i].config.lr) for i in todo], show)
            for i, ref in zip(todo, refs, strict=True):
                references[i] = ref
    failures = check_results(results, references) if args.check else []
    print(format_table(results))
    for note in write_outputs(args.out, results, references, failures, plot=not args.no_plot):
        print(f"wrote {note}" if os.path.exists(note) else note)
    if args.check:
        for r, ref in zip(results, references, strict=True):
            if ref is not None:
                d, _ = curve_departure(r.losses, ref.losses)
                tol = check_tolerance(r.config.optimizer, r.world_size)
                print(f"check {r.config.task}/{r.config.optimizer}: largest relative loss "
                      f"difference to the single device {d:.2g} (tolerance {tol:g}) "
                      f"{'ok' if d <= tol else 'FAILED'}")
        for f in failures:
            print(f, file=sys.stderr)
        if failures:
            return 1
        print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
