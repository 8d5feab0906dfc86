"""Training loop of the toy runs: one process, or every rank of a gloo process group.

``train(config)`` runs one (task, optimizer, sharding) configuration on the calling
process; with a sharding other than ``"none"`` every rank of the default process group
must call it with the same configuration. ``train_all`` runs a list of them and gathers
each rank's peak RSS; ``launch`` spawns ``W`` gloo ranks for it (or uses the process
group torchrun set up).
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from vefsdp_optim._registry import get_optimizer
from vefsdp_optim._teardown import exit_rank

from ._tasks import ToyProblem, get_task

__all__ = [
    "RunConfig",
    "RunResult",
    "SHARDINGS",
    "BUILTIN_OPTIMIZERS",
    "default_lr",
    "check_tolerance",
    "build_optimizer",
    "train",
    "train_all",
    "launch",
]

SHARDINGS = ("none", "fsdp2", "fully_shard")
BUILTIN_OPTIMIZERS = ("adamw", "adamw8bit", "adam8bit", "muon", "normuon", "shampoo", "soap")
MIN_8BIT_SIZE = 256  # toy tensors are small: quantize every one with a whole block
TAIL = 10  # final loss = mean of the last TAIL steps

# Learning rates that train every task at the default steps (see README "Toy runs").
_DEFAULT_LR = {"adamw": 3e-3, "adamw8bit": 3e-3, "adam8bit": 3e-3, "muon": 0.02, "normuon": 0.01,
               "shampoo": 3e-3, "soap": 3e-3}
_TASK_LR = {("illcond", "muon"): 3e-3, ("conv", "normuon"): 0.02, ("illcond", "soap"): 1e-2}
for _t in ("mlp", "conv"):
    _TASK_LR.update({(_t, o): 1e-2 for o in ("adamw", "adamw8bit", "adam8bit", "shampoo", "soap")})
# Relative tolerance of a sharded loss curve against the single-device reference. Each
# rank trains on the whole batch, so at W = 2 the averaged gradient is exactly the
# single-device one ((g + g) / 2 == g) and every built-in optimizer must give the same
# bits: tolerance 0. At other W the average can differ in the last bit, and the
# optimizers amplify that differently (the measurements: docs/decisions.md): AdamW 1e-5;
# Shampoo (float64 roots) 1e-4; 8-bit Adam (a last-bit change can move a value to the
# next 8-bit code) and Muon (Newton-Schulz in bfloat16) 1e-3. SOAP: a last-bit change of
# a gradient turns the eigenvectors of its factors' null spaces (a factor of a
# non-square matrix is rank-deficient at its first eigendecomposition) and Adam scales
# their coordinates to O(1), so its curves part within steps (given the same gradient it
# is bitwise equal at any W: tests/test_soap.py) -> 2.0: only a divergence fails; its
# W = 2 runs are bit-identical like the others'. Custom optimizers: 1e-5 at any W.
_TOLERANCE = {"shampoo": 1e-4, "muon": 1e-3, "normuon": 1e-3, "adamw8bit": 1e-3, "adam8bit": 1e-3,
              "soap": 2.0}
DEFAULT_TOLERANCE = 1e-5


def default_lr(task: str, optimizer: str) -> float | None:
    """The toy runs' learning rate for a built-in optimizer; None: the class default."""
    key = optimizer.strip().lower()
    return _TASK_LR.get((task, key), _DEFAULT_LR.get(key))


def check_tolerance(optimizer: str, world_size: int | None = None) -> float:
    """Largest relative loss difference allowed between a run on ``world_size`` ranks and
    its single-device reference (see ``_TOLERANCE``); None: any W."""
    key = optimizer.strip().lower()
    if world_size is not None and world_size <= 2 and key in BUILTIN_OPTIMIZERS:
        return 0.0
    return _TOLERANCE.get(key, DEFAULT_TOLERANCE)


@dataclass(frozen=True, slots=True)
class RunConfig:
    """One toy run: which task, optimizer (name or ``package.module:Class``), sharding."""

    task: str
    optimizer: str
    sharding: str = "fully_shard"
    steps: int = 300
    seed: int = 0
    lr: float | None = None  # None: default_lr(task, optimizer)

    def __post_init__(self) -> None:
        get_task(self.task)  # raises ValueError naming the known tasks
        if self.sharding not in SHARDINGS:
            raise ValueError(f"sharding must be one of {SHARDINGS}, got {self.sharding!r}")
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"steps must be a positive int, got {self.steps!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"seed must be an int, got {self.seed!r}")
        if self.lr is not None and not (isinstance(self.lr, float) and self.lr > 0):
            raise ValueError(f"lr must be a positive float or None, got {self.lr!r}")
        get_optimizer(self.optimizer)  # raises ValueError listing the registered names

    @property
    def effective_lr(self) -> float | None:
        return self.lr if self.lr is not None else default_lr(self.task, self.optimizer)


@dataclass(slots=True)
class RunResult:
    """Per-step losses and timings of one run (rank 0's view; losses equal on all ranks)."""

    config: RunConfig
    world_size: int
    losses: list[float]  # one per step, the loss before that step's update
    seconds: float  # wall time of the steps (after the first, which includes warm-up)
    floor: float | None
    # per rank: the process's peak RSS so far (monotone over the runs of one process)
    peak_rss_mb: list[float] = field(default_factory=list)

    @property
    def final_loss(self) -> float:
        tail = self.losses[-min(TAIL, len(self.losses)):]
        return sum(tail) / len(tail)

    @property
    def steps_per_s(self) -> float:
        return (len(self.losses) - 1) / self.seconds if self.seconds > 0 else math.nan

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(final_loss=self.final_loss, steps_per_s=self.steps_per_s)
        return out

    @staticmethod
    def from_json(d: dict[str, Any]) -> RunResult:
        names = {f.name for f in fields(RunResult)}
        d = {k: v for k, v in d.items() if k in names}
        d["config"] = RunConfig(**d["config"])
        return RunResult(**d)


# -- model and optimizer ------------------------------------------------------------------


def _shard(model: nn.Module, sharding: str) -> None:
    if sharding == "none":
        return
    if not dist.is_initialized():
        raise RuntimeError(f"sharding={sharding!r} needs an initialized process group")
    if sharding == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        from vefsdp_optim import fully_shard

        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)


def _is_embed_or_head(name: str) -> bool:
    return "embed" in name or "head" in name


def build_optimizer(name: str, model: nn.Module, lr: float | None) -> torch.optim.Optimizer:
    """The optimizer ``name`` over ``model``'s parameters, with the toy runs' settings.

    Built-ins use ``weight_decay=0`` (the loss floors assume no regularization); the
    8-bit optimizers quantize every tensor of at least MIN_8BIT_SIZE elements. Muon
    (and NorMuon, otherwise at its own defaults: Polar Express, Dion's lr adjustment)
    takes the matrices (2 or more dims) outside embeddings and the output head; the
    rest go to its ``use_muon=False`` AdamW group with lr 3e-3. Muon's block structure
    comes from ``model.muon_group_keys(name)`` where the model has it (the moe task: its
    experts with ``flatten=False``, its fused QKV with ``split_sizes``); other weights of
    more than 2 dims (convolutions) get ``flatten=True``. Other optimizers get
    ``lr`` when it is not None, and otherwise their own defaults.
    """
    cls = get_optimizer(name)
    key = name.strip().lower()
    named = list(model.named_parameters())
    if key in ("muon", "normuon"):
        mats = [(n, p) for n, p in named if p.ndim >= 2 and not _is_embed_or_head(n)]
        rest = [p for n, p in named if not (p.ndim >= 2 and not _is_embed_or_head(n))]
        # Muon's block structure: a model may name it per parameter (MoE experts, fused
        # QKV: muon_group_keys); otherwise >2-D weights (convolutions) are one matrix
        keys_of = getattr(model, "muon_group_keys", None)
        by_keys: dict[str, dict[str, Any]] = {}
        for n, p in mats:
            keys = {"flatten": True, **(keys_of(n) if keys_of is not None else {})}
            by_keys.setdefault(repr(sorted(keys.items())), {"params": [],
                                                            **keys})["params"].append(p)
        groups = list(by_keys.values())
        if rest:
            groups.append({"params": rest, "use_muon": False, "lr": _DEFAULT_LR["adamw"]})
        return cls(groups, lr=lr, weight_decay=0.0)
    kwargs: dict[str, Any] = {} if lr is None else {"lr": lr}
    if key in BUILTIN_OPTIMIZERS:
        kwargs["weight_decay"] = 0.0
    if key in ("adamw8bit", "adam8bit"):
        kwargs["min_8bit_size"] = MIN_8BIT_SIZE
    return cls([p for _, p in named], **kwargs)


# -- the loop ----------------------------------------------------------------------------


Progress = Callable[[int, int, float], None]  # (step, steps, loss)


def train(config: RunConfig, progress: Progress | None = None) -> RunResult:
    """Run ``config`` on this process (all ranks together when sharded); rank 0's result.

    Runs on one CPU thread (the same kernels in sharded and reference runs); the caller's
    thread count and global RNG state are restored afterwards.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            return _train(config, progress)
    finally:
        torch.set_num_threads(threads)


def _train(config: RunConfig, progress: Progress | None) -> RunResult:
    task = get_task(config.task)
    problem: ToyProblem = task.build(config.seed)
    model = problem.model
    _shard(model, config.sharding)
    opt = build_optimizer(config.optimizer, model, config.effective_lr)
    losses: list[float] = []
    t0 = time.perf_counter()
    for step in range(config.steps):
        if step == 1:
            t0 = time.perf_counter()
        x, y = problem.batch(step)
        loss = problem.loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        value = float(loss.detach())
        losses.append(value)
        if not math.isfinite(value):  # every rank sees the same loss: all stop here
            break
        if progress is not None:
            progress(step + 1, config.steps, value)
    seconds = time.perf_counter() - t0
    world = dist.get_world_size() if config.sharding != "none" else 1
    return RunResult(config, world, losses, seconds, problem.floor)


def _peak_rss_mb() -> float:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 1024.0 if sys.platform != "darwin" else rss / 2**20  # KiB on Linux, bytes on macOS


def _bar(prefix: str) -> Progress:
    """A plain-text progress bar on stderr; on a non-terminal only the final line."""
    tty = sys.stderr.isatty()

    def show(step: int, steps: int, loss: float) -> None:
        if step != steps and (not tty or step % max(1, steps // 50)):
            return
        width = 30
        done = width * step // steps
        cr = "\r" if tty else ""
        sys.stderr.write(f"{cr}{prefix:<28} [{'#' * done}{'.' * (width - done)}] "
                         f"{step:>5}/{steps} loss {loss:8.4f}")
        if step == steps:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return show


def train_all(configs: Sequence[RunConfig], show_progress: bool = False) -> list[RunResult]:
    """Run every config on this process (every rank calls it with the same list)."""
    sharded = dist.is_initialized()
    rank = dist.get_rank() if sharded else 0
    results = []
    for i, cfg in enumerate(configs):
        if cfg.sharding != "none" and not sharded:
            raise RuntimeError(f"{cfg} needs a process group; use launch()")
        prefix = f"[{i + 1}/{len(configs)}] {cfg.task}/{cfg.optimizer}"
        bar = _bar(prefix) if show_progress and rank == 0 else None
        res = train(cfg, bar)
        rss = _peak_rss_mb()
        if sharded:
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, rss)
            res.peak_rss_mb = [float(r) for r in gathered]
        else:
            res.peak_rss_mb = [rss]
        results.append(res)
    return results


def _spawned(rank: int, world_size: int, init_file: str, out_file: str,
             configs: list[RunConfig], show_progress: bool) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    try:
        results = train_all(configs, show_progress)
        if rank == 0:
            with open(out_file, "w") as f:
                json.dump([r.to_json() for r in results], f)
    except BaseException:
        dist.destroy_process_group()
        raise
    exit_rank()  # barrier, destroy, no interpreter finalization ([Note: gloo teardown])


def launch(configs: Sequence[RunConfig], world_size: int,
           show_progress: bool = True) -> list[RunResult]:
    """Run sharded configs on ``world_size`` ranks: under torchrun, on its process group;
    otherwise on gloo ranks spawned here. Returns rank 0's results (on every rank)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    configs = list(configs)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        if not dist.is_initialized():
            dist.init_process_group("gloo")
        if dist.get_world_size() != world_size:
            raise ValueError(f"--world-size {world_size} but torchrun started "
                             f"{dist.get_world_size()} ranks")
        results = train_all(configs, show_progress)
        return results
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="vefsdp_toy_") as tmp:
        init_file, out_file = os.path.join(tmp, "pg"), os.path.join(tmp, "results.json")
        mp.spawn(_spawned, args=(world_size, init_file, out_file, configs, show_progress),
                 nprocs=world_size, join=True)
        with open(out_file) as f:
            return [RunResult.from_json(d) for d in json.load(f)]
