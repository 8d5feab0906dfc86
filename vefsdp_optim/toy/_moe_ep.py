"""The expert-parallel MoE toy run: ``python -m vefsdp_optim.toy --task moe --sharding ep
--world-size 4 --check``.

The moe task's model on W gloo ranks as torchtitan lays out an MoE run: each block's
expert weights ``[experts, out, in]`` are DTensors ``Shard(0)`` over an ``ep`` mesh axis
and sharded by this library's ``fully_shard`` over the matching ``edp`` axis, the dense
weights by ``fully_shard`` over all W ranks (``dp``). Muon orthogonalizes each expert
whole (``flatten=False``) and the fused QKV as Q, K and V blocks (``split_sizes``), AdamW
takes the embeddings, the head and the 1-D parameters, and QK-clip rescales the heads whose
logits pass the threshold after every step. Halfway, the run saves a checkpoint
(``vefsdp_optim.save``), rebuilds the model as ep 1 x dp W (experts plain, sharded over
all ranks), loads it and trains on. With ``--check``, rank 0 replays the same full
gradients (and the same max logits) on one device (see the comment above ``EP_OPTIMIZERS``).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from vefsdp_optim._registry import get_optimizer
from vefsdp_optim._teardown import exit_rank

from ._runner import _DEFAULT_LR, default_lr
from ._tasks import MOE_EXPERTS, get_task

__all__ = ["EP_OPTIMIZERS", "EPCheckConfig", "EPCheckResult", "shard_moe", "build_moe_optimizer",
           "run_ep_check", "launch_ep_check"]

# Every rank trains on the whole global batch (the toy runs' rule), so an ep rank runs its
# own experts on all tokens and the partial sums of the ep ranks are all-reduced; the
# backward of that sum passes the gradient through unchanged (each ep rank's loss is the
# same loss, not a part of it: an all-reduce there would count it ep times). The expert
# gradients are then averaged over edp and the dense ones over dp, of equal copies, so the
# reduced gradient is the one-device gradient up to the order of the expert sum. The
# check therefore splits what must be exact from what may round:
# - the parameters after every step equal, bit for bit, one device stepping the same
#   optimizer on the gathered full gradients and the same max logits (QK-clip), before
#   and after the checkpoint moves from ep 2 x dp W/2 to ep 1 x dp W: the optimizer's math
#   is the same on both sides;
# - the loss of each step and the full gradient equal the one-device model's own forward
#   and backward on those same parameters to EP_LOSS_RTOL and EP_GRAD_RTOL: the expert sum
#   is added in another order (per ep rank, then across), and after the move to ep 1 the
#   loss is the one device's bit for bit.
# The max logits are reduced with MAX over all ranks before the clip, as a data-parallel
# run must (``QKClip`` in _qk_clip.py).

EP_OPTIMIZERS = ("muon", "normuon")
EP_LOSS_RTOL = 1e-5  # measured at seed 0, 40 steps, W = 4: 0 (the same bits)
EP_GRAD_RTOL = 1e-4  # measured there: 6.4e-7
# low on purpose: the toy's largest head logit is 1.8 at step 0, so the clip fires from the start
QK_CLIP_THRESHOLD = 1.5
EP_DEFAULT_STEPS = 40


@dataclass(frozen=True, slots=True)
class EPCheckConfig:
    """One expert-parallel run: ``ep`` ranks per expert group, the optimizer (Muon or
    NorMuon on the matrices, AdamW on the rest), ``steps`` with the layout change after
    ``resume_at`` of them, QK-clip's threshold."""

    optimizer: str = "muon"
    steps: int = EP_DEFAULT_STEPS
    resume_at: int | None = None  # None: steps // 2
    ep: int = 2
    seed: int = 0
    lr: float | None = None  # None: the toy runs' default for the optimizer
    qk_clip_threshold: float = QK_CLIP_THRESHOLD
    check: bool = True  # replay the gradients on one device (rank 0)

    def __post_init__(self) -> None:
        if self.optimizer.strip().lower() not in EP_OPTIMIZERS:
            raise ValueError(f"--sharding ep runs Muon on the experts: optimizer must be one of "
                             f"{EP_OPTIMIZERS}, got {self.optimizer!r}")
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 2:
            raise ValueError("steps must be an int >= 2 (it resumes from a checkpoint "
                             f"in between), got {self.steps!r}")
        if self.resume_at is not None and not 1 <= self.resume_at < self.steps:
            raise ValueError(f"resume_at must be in [1, steps={self.steps}), got "
                             f"{self.resume_at!r}")
        if isinstance(self.ep, bool) or not isinstance(self.ep, int) or self.ep < 1:
            raise ValueError(f"ep must be a positive int, got {self.ep!r}")
        if self.ep > MOE_EXPERTS:
            raise ValueError(f"ep={self.ep} is more than the moe task's {MOE_EXPERTS} experts")
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"lr must be > 0 or None, got {self.lr!r}")
        if not self.qk_clip_threshold > 0:
            raise ValueError(f"qk_clip_threshold must be > 0, got {self.qk_clip_threshold!r}")

    @property
    def split(self) -> int:
        return self.steps // 2 if self.resume_at is None else self.resume_at


@dataclass(slots=True)
class EPCheckResult:
    """Rank 0's record of an expert-parallel run; the ``ref_*`` and ``*_diff`` lists are
    empty without ``check``."""

    config: EPCheckConfig
    world_size: int
    layouts: list[str]  # before and after the checkpoint, e.g. ["ep2 x edp2", "ep1 x edp4"]
    losses: list[float]  # the sharded forward's loss of every step
    ref_losses: list[float] = field(default_factory=list)  # one device's forward, same parameters
    # max over params of |g - g_ref| / max|g_ref|
    grad_rdiff: list[float] = field(default_factory=list)
    param_diff: list[float] = field(default_factory=list)  # max |p - p_ref| after each step
    load_diff: float = 0.0  # max |p - p_ref| right after the load
    clipped_heads: list[int] = field(default_factory=list)  # heads above the threshold, per step
    seconds: float = 0.0

    def failures(self) -> list[str]:
        """What the check found wrong (see the comment above ``EP_OPTIMIZERS``); empty when it
        passed."""
        if not self.config.check:
            return []
        out = []
        bad = [i for i, d in enumerate(self.param_diff) if d != 0.0]
        if bad:
            out.append(f"parameters differ from one device replaying the same gradients after step "
                       f"{bad[0]} (max |diff| {self.param_diff[bad[0]]:.3g}; {len(bad)} "
                       "steps differ)")
        if self.load_diff != 0.0:
            out.append(f"parameters after loading the checkpoint into {self.layouts[-1]} "
                       f"differ from one device by {self.load_diff:.3g}")
        rel = [abs(a - b) / max(abs(b), 1e-12)
               for a, b in zip(self.losses, self.ref_losses, strict=True)]
        if len(rel) != len(self.losses) or any(not math.isfinite(r) or r > EP_LOSS_RTOL
                                               for r in rel):
            worst = max(range(len(rel)),
                        key=lambda i: rel[i] if math.isfinite(rel[i]) else math.inf, default=0)
            out.append(f"loss departs from one device's forward on the same parameters: "
                       f"{rel[worst] if rel else math.inf:.3g} at step {worst} (tolerance "
                       f"{EP_LOSS_RTOL:g})")
        after = rel[self.config.split:]
        if any(r != 0.0 for r in after):
            out.append(f"after the move to {self.layouts[-1]} (no expert parallelism) the "
                       "loss should be one device's bit for bit; largest relative difference "
                       f"{max(after):.3g}")
        g = [d for d in self.grad_rdiff if not (math.isfinite(d) and d <= EP_GRAD_RTOL)]
        if g:
            out.append(f"full gradient departs from one device's backward by {max(g):.3g} "
                       f"(tolerance {EP_GRAD_RTOL:g})")
        if not any(self.clipped_heads):
            out.append("QK-clip never fired (threshold "
                       f"{self.config.qk_clip_threshold:g}): the check did not exercise it")
        return out

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["failures"] = self.failures()
        return out


# -- layout and optimizer --------------------------------------------------------------------


def shard_moe(model: nn.Module, ep: int) -> str:
    """Lay ``model`` (the moe task's TinyMoEGPT) out on the default process group as
    torchtitan does: experts ``Shard(0)`` over ``ep`` and fully_shard over ``edp`` (its
    ``shard_placement_fn``: ``Shard(1)`` when edp x ep exceeds the experts, else
    ``Shard(0)``), each block and the root over every rank. Returns the layout's name."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from vefsdp_optim import fully_shard

    world = dist.get_world_size()
    if world % ep:
        raise ValueError(f"ep={ep} must divide the world size {world}")
    dp = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    if ep > 1:
        mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("edp", "ep"))
        edp = mesh["edp"]
        for layer in model.layers:
            for k in ("w_in", "w_out"):
                t = distribute_tensor(getattr(layer.experts, k).detach(), mesh["ep"], [Shard(0)])
                setattr(layer.experts, k, nn.Parameter(t))
    else:
        edp = dp
    placement = Shard(1) if edp.size() * ep > MOE_EXPERTS else Shard(0)
    for layer in model.layers:
        fully_shard(layer.experts, mesh=edp, shard_placement_fn=lambda p: placement)
        fully_shard(layer, mesh=dp)
    fully_shard(model, mesh=dp)
    return f"ep{ep} x edp{edp.size()}"


def build_moe_optimizer(config: EPCheckConfig, model: nn.Module) -> torch.optim.Optimizer:
    """Muon (or NorMuon) on ``model``: each expert a matrix (``flatten=False``), the fused
    QKV as Q, K, V blocks with QK-clip registered per block, the other matrices whole;
    AdamW (``use_muon=False``, lr 3e-3) on the embeddings, the head and 1-D parameters."""
    named = list(model.named_parameters())
    keys_of: Callable[[str], dict[str, Any]] = model.muon_group_keys
    groups: dict[str, dict[str, Any]] = {}
    rest = []
    for n, p in named:
        if p.ndim < 2 or "embed" in n or "head" in n:
            rest.append(p)
            continue
        keys = {"flatten": True, **keys_of(n)}
        if n.endswith("qkv.weight"):
            keys["qk_clip_threshold"] = config.qk_clip_threshold
        groups.setdefault(repr(sorted(keys.items())), {"params": [], **keys})["params"].append(p)
    lr = config.lr if config.lr is not None else default_lr("moe", config.optimizer)
    cls = get_optimizer(config.optimizer)
    opt = cls([*groups.values(), {"params": rest, "use_muon": False, "lr": _DEFAULT_LR["adamw"]}],
              lr=lr, weight_decay=0.0)
    for i, layer in enumerate(model.layers):
        opt.register_qk_clip(f"layers.{i}", num_heads=layer.heads, head_dim=layer.hd,
                             num_kv_heads=layer.kv_heads, qkv=layer.qkv.weight)
        layer.track_max_logits = True
    return opt


# -- the run -----------------------------------------------------------------------------------


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor().detach() if hasattr(t, "full_tensor") else t.detach().clone()


def _max_logits(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each attention's per-head max logit of the last forward, MAX over every rank."""
    stacked = torch.stack([layer.max_logits for layer in model.layers])
    if dist.is_initialized():
        dist.all_reduce(stacked, op=dist.ReduceOp.MAX)
    return {f"layers.{i}": stacked[i].clone() for i in range(len(model.layers))}


class _Reference:
    """Rank 0's one-device model and optimizer, stepped on the sharded run's full gradients."""

    def __init__(self, config: EPCheckConfig) -> None:
        self.model = get_task("moe").build(config.seed).model
        self.opt = build_moe_optimizer(config, self.model)
        self.params = dict(self.model.named_parameters())

    def step(self, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable[..., torch.Tensor],
             grads: dict[str, torch.Tensor],
             logits: dict[str, torch.Tensor]) -> tuple[float, float]:
        """Its own loss and the gradient's relative difference, then a step on ``grads``."""
        self.opt.zero_grad(set_to_none=True)
        loss = loss_fn(self.model(x), y)
        loss.backward()
        rdiff = 0.0
        for n, p in self.params.items():
            g = grads[n]
            rdiff = max(rdiff,
                        float((p.grad - g).abs().max() / p.grad.abs().max().clamp_min(1e-30)))
            p.grad = g.clone()
        self.opt.step()
        self.opt.qk_clip_(logits)
        return float(loss.detach()), rdiff

    def diff(self, params: dict[str, torch.Tensor]) -> float:
        if params.keys() != self.params.keys():
            raise AssertionError(f"parameter names differ: {sorted(params)} vs "
                                 f"{sorted(self.params)}")
        return max(float((params[n] - p.detach()).abs().max()) for n, p in self.params.items())


def run_ep_check(config: EPCheckConfig, ckpt_dir: str) -> EPCheckResult | None:
    """Every rank of the default process group: train ``config`` at ep ``config.ep``, save
    to ``ckpt_dir`` after ``config.split`` steps, resume at ep 1 and finish. Rank 0 returns
    the result (others None)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            return _run(config, ckpt_dir)
    finally:
        torch.set_num_threads(threads)


def _run(config: EPCheckConfig, ckpt_dir: str) -> EPCheckResult | None:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    import vefsdp_optim

    rank = dist.get_rank()
    task = get_task("moe")
    problem = task.build(config.seed)
    model = problem.model
    layouts = [shard_moe(model, config.ep)]
    opt = build_moe_optimizer(config, model)
    ref = _Reference(config) if config.check and rank == 0 else None
    result = EPCheckResult(config, dist.get_world_size(), layouts, [])
    t0 = time.perf_counter()
    for step in range(config.steps):
        if step == config.split:  # checkpoint, then a fresh model on the other layout
            state = {"model": get_model_state_dict(model),
                     "optim": get_optimizer_state_dict(model, opt)}
            vefsdp_optim.save(state, ckpt_dir)
            del model, opt, state
            model = task.build(config.seed + 1).model  # other values: the load must set every one
            layouts.append(shard_moe(model, 1))
            opt = build_moe_optimizer(config, model)
            state = {"model": get_model_state_dict(model),
                     "optim": get_optimizer_state_dict(model, opt)}
            vefsdp_optim.load(state, ckpt_dir)
            set_model_state_dict(model, state["model"])
            set_optimizer_state_dict(model, opt, state["optim"])
            params = {n: _full(p) for n, p in model.named_parameters()}
            if ref is not None:
                result.load_diff = ref.diff(params)
        x, y = problem.batch(step)
        loss = problem.loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        logits = _max_logits(model)
        result.losses.append(float(loss.detach()))
        result.clipped_heads.append(int(sum((v > config.qk_clip_threshold).sum()
                                            for v in logits.values())))
        grads = {n: _full(p.grad) for n, p in model.named_parameters()} if config.check else {}
        opt.step()
        opt.qk_clip_(logits)
        if config.check:
            params = {n: _full(p) for n, p in model.named_parameters()}
            if ref is not None:
                ref_loss, rdiff = ref.step(x, y, problem.loss, grads, logits)
                result.ref_losses.append(ref_loss)
                result.grad_rdiff.append(rdiff)
                result.param_diff.append(ref.diff(params))
        if not math.isfinite(result.losses[-1]):
            break
    result.seconds = time.perf_counter() - t0
    return result if rank == 0 else None


def _spawned(rank: int, world_size: int, init_file: str, out_file: str, config: EPCheckConfig,
             ckpt_dir: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    try:
        result = run_ep_check(config, ckpt_dir)
        if rank == 0:
            with open(out_file, "w") as f:
                json.dump(result.to_json(), f)
    except BaseException:
        dist.destroy_process_group()
        raise
    exit_rank()


def launch_ep_check(config: EPCheckConfig, world_size: int,
                    ckpt_dir: str | None = None) -> EPCheckResult:
    """Run ``config`` on ``world_size`` spawned gloo ranks (or torchrun's); rank 0's result
    on rank 0 (None elsewhere under torchrun). The checkpoint goes to ``ckpt_dir`` (default:
    a temporary directory, removed afterwards)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 2:
        raise ValueError(f"--sharding ep needs a world size >= 2, got {world_size!r}")
    if world_size % config.ep:
        raise ValueError(f"--world-size {world_size} is not a multiple of ep={config.ep}")
    with tempfile.TemporaryDirectory(prefix="vefsdp_toy_ep_") as tmp:
        ckpt = ckpt_dir or os.path.join(tmp, "ckpt")
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
            if not dist.is_initialized():
                dist.init_process_group("gloo")
            if dist.get_world_size() != world_size:
                raise ValueError(f"--world-size {world_size} but torchrun started "
                                 f"{dist.get_world_size()} ranks")
            if ckpt_dir is None:  # one directory for every rank: rank 0's
                box = [ckpt]
                dist.broadcast_object_list(box, src=0)
                ckpt = box[0]
            return run_ep_check(config, ckpt)
        import torch.multiprocessing as mp

        init_file, out_file = os.path.join(tmp, "pg"), os.path.join(tmp, "result.json")
        mp.spawn(_spawned, args=(world_size, init_file, out_file, config, ckpt), nprocs=world_size,
                 join=True)
        with open(out_file) as f:
            d = json.load(f)
    d.pop("failures")
    d["config"] = EPCheckConfig(**d["config"])
    return EPCheckResult(**d)
