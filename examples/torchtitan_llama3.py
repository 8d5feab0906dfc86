"""Train torchtitan's llama3 debug model with vefsdp_optim's fully_shard and optimizers.

torchtitan's own pieces, unchanged: the llama3 "debugmodel" config, meta-device build,
``parallelize_llama`` (activation checkpointing, then ``apply_fsdp_to_decoder``, which
shards every block, [norm, lm_head] as one group and the root, and calls
``set_gradient_divide_factor(1.0)`` on every FSDPModule), ``init_weights``,
OptimizersContainer, LRSchedulersContainer (warmup + decay), ``clip_grad_norm_``, its
cross-entropy loss normalized by the global token count, and its CheckpointManager's
model wrapper. Two swaps, marked ``# vefsdp_optim``: torchtitan's ``fully_shard`` is
replaced by ours (one attribute of ``torchtitan.distributed.fsdp``), and our optimizers
are registered in the OptimizersContainer's factory under names of their own.

Needs: ``pip install -e ".[torchtitan]"`` (torchtitan 0.3.0; torch stays pinned).
Without a GPU (as here), the script chooses:

- a gloo process group and a CPU device mesh (torchtitan's ``ParallelDims.build_mesh``
  picks "cuda" when no accelerator is visible; the script points it at "cpu");
- ``spmd_backend="partial_dtensor"``: torchtitan's FSDP path over a 1-D "fsdp" mesh.
  The default "spmd_types" backend passes ``dp_mesh_dims``; our fully_shard takes the
  named submesh and trains the same way, but FSDP2 then wants every parameter as a
  DTensor on the full SPMD mesh (torchtitan's trainer makes them), so the comparison
  run uses "partial_dtensor";
- float32 parameters (``mixed_precision_param="float32"``);
- causal SDPA attention instead of FlexAttention (which torch.compile's its kernel and
  needs document positions from torchtitan's dataloader);
- a synthetic token stream instead of the Hugging Face tokenizer and C4 (downloads);
- FSDP2 runs (``--fsdp torch`` / ``both``) call ``set_force_sum_reduction_for_comms``:
  gloo has no PREMUL_SUM, which FSDP2 uses for summed gradients (ours need nothing).

    python examples/torchtitan_llama3.py --world-size 2 --fsdp both --optimizer adamw
    torchrun --nproc-per-node 2 examples/torchtitan_llama3.py --optimizer muon
    python examples/torchtitan_llama3.py --world-size 4 --tp 2 --fsdp both --optimizer muon

``--fsdp both`` trains with our fully_shard, then with FSDP2's, from the same weights on
the same tokens, prints both losses per step and checks them: equal bit for bit at
dp 2 where no gradient is clipped (``--max-norm 1e9``: the summed gradients are the
same bits), within 1e-4 otherwise. Clipping scales by max_norm / grad_norm, and the two
norms differ: ours (partial sums of squares over the ragged shards, one all_reduce)
matches the float64 norm of the gathered gradients to 1e-7 on this model, FSDP2's
DTensor norm on the CPU was 8e-5 (relative) off it, on lm_head.weight.

``--tp N`` (W = dp x N ranks): ParallelDims builds its ("fsdp", "tp") mesh and
``parallelize_llama`` applies torchtitan's own TP plan (``set_llama3_sharding_config``
with sequence parallelism, as its trainer's ``update_from_config`` declares it; loss
parallel over the vocabulary-sharded logits) before ``apply_fsdp_to_decoder`` shards
over the "fsdp" submesh, with our fully_shard or FSDP2's (the same one swap). FSDP2 +
TP hands our optimizers DTensors placed (_StridedShard(0, sf=N), Shard(0)) (wqkv, w1,
w3, embedding, lm_head), (Shard(0), Shard(1)) (wo, w2) and (Shard(0), Replicate())
(norms). The tp ranks of one dp rank read the same sequences. At tp > 1, ``--fsdp
both`` trains three runs from the same weights on the same tokens: our fully_shard,
FSDP2's (checked as at tp 1), and torch's AdamW on FSDP2 + TP, against which our adamw
on FSDP2 + TP must give the same losses bit for bit (clipped or not: one gradient, one
clip); for the other optimizers the two curves are printed.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import vefsdp_optim  # vefsdp_optim

# name in torchtitan's ParamGroupConfig -> (optimizer, its group keywords for Muon's
# vectors / embeddings / head when the optimizer is Muon)
OPTIMIZERS = {
    "vefsdp.AdamW": vefsdp_optim.AdamW,
    "vefsdp.AdamW8bit": vefsdp_optim.AdamW8bit,
    "vefsdp.Muon": vefsdp_optim.Muon,
    "vefsdp.Shampoo": vefsdp_optim.Shampoo,
}
CHOICES = {"adamw": "vefsdp.AdamW", "adamw8bit": "vefsdp.AdamW8bit", "muon": "vefsdp.Muon",
           "shampoo": "vefsdp.Shampoo", "torch-adamw": "AdamW"}


def optimizers_container_class() -> type:
    """torchtitan's OptimizersContainer with our optimizers in its factory."""
    from dataclasses import dataclass

    from torchtitan.components.optimizer import OptimizersContainer

    class VefsdpOptimizersContainer(OptimizersContainer):  # vefsdp_optim
        @dataclass(kw_only=True, slots=True)
        class Config(OptimizersContainer.Config):
            pass

        @staticmethod
        def _resolve_optimizer_factory(name: str):  # noqa: ANN205
            if name in OPTIMIZERS:
                return OPTIMIZERS[name]
            return OptimizersContainer._resolve_optimizer_factory(name)

    return VefsdpOptimizersContainer


def param_groups(name: str, lr: float) -> list:
    """torchtitan ParamGroupConfigs: regex on parameter names, first match wins."""
    from torchtitan.components.optimizer import ParamGroupConfig

    adamw = dict(lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    if name == "vefsdp.Muon":  # matrices of the blocks to Muon, the rest to its AdamW
        return [
            ParamGroupConfig(pattern=r"layers\..*\.weight$", optimizer_name=name,
                             optimizer_kwargs=dict(lr=0.02, weight_decay=0.1)),
            ParamGroupConfig(pattern=r".*", optimizer_name=name,
                             optimizer_kwargs=dict(lr=lr, use_muon=False, weight_decay=0.1)),
        ]
    if name == "vefsdp.AdamW8bit":
        adamw["min_8bit_size"] = 4096
    if name == "vefsdp.Shampoo":
        adamw = dict(lr=lr, weight_decay=0.1, max_preconditioner_dim=256)
    return [ParamGroupConfig(pattern=r".*", optimizer_name=name, optimizer_kwargs=adamw)]


def build_model(args: argparse.Namespace, fsdp: str, world_size: int, full_sd: dict):
    """torchtitan's model build, parallelize and init, with our fully_shard swapped in.

    With ``--tp N`` the mesh is ParallelDims' ("fsdp", "tp") of W/N x N, and
    ``parallelize_llama`` applies torchtitan's TP plan (``Module.parallelize``: colwise
    wq/wkv/w1/w3, rowwise wo/w2, vocab-sharded embedding and head, sequence-parallel
    norms) before its ``apply_fsdp_to_decoder`` shards over the "fsdp" submesh (with our
    fully_shard: ``fully_shard(module, mesh=dp_mesh)`` on the TP'd modules)."""
    import torchtitan.distributed.fsdp as tt_fsdp
    import torchtitan.distributed.parallel_dims as tt_dims
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as tt_utils
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.models.llama3 import parallelize_llama

    tt_dims.device_type = "cpu"  # no accelerator: a CPU (gloo) mesh
    parallel_dims = ParallelDims(dp_replicate=1, dp_shard=world_size // args.tp, cp=1,
                                 tp=args.tp, pp=1, ep=1, world_size=world_size,
                                 spmd_backend="partial_dtensor")
    parallel_dims.build_mesh()
    tt_utils.set_spmd_backend("partial_dtensor")  # as the trainer: read by its loss
    with torch.device("meta"):
        model = model_config(args).build()
    torch_fully_shard = tt_fsdp.fully_shard
    if fsdp == "vefsdp":
        tt_fsdp.fully_shard = vefsdp_optim.fully_shard  # vefsdp_optim: the one swap
    ac = {"full": FullAC.Config(), "selective": SelectiveAC.Config(), "none": None}[args.ac]
    try:
        model = parallelize_llama(
            model, parallel_dims=parallel_dims,
            training=TrainingConfig(seq_len=args.seq_len, mixed_precision_param="float32"),
            parallelism=ParallelismConfig(spmd_backend="partial_dtensor",
                                          tensor_parallel_degree=args.tp),
            compile_config=CompileConfig(), ac_config=ac, dump_folder=args.dump_folder)
    finally:
        tt_fsdp.fully_shard = torch_fully_shard
    if fsdp == "torch":  # gloo has no PREMUL_SUM (FSDP2's summed-gradient reduction)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    load_full_params(model, full_sd)  # the same start for both runs (a seed checkpoint)
    model.train()
    return model, parallel_dims


@torch.no_grad()
def load_full_params(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Copy unsharded weights into the sharded parameters, each rank taking its part.

    Per parameter rather than through set_model_state_dict: on FSDP2, torchtitan's fused
    QKV load hook hands a plain tensor to a DTensor copy ("got mixed torch.Tensor and
    DTensor"). Our parameters take the full tensor itself; DTensors one distributed
    the same way, split locally (every rank holds the full tensor; the scatter path of
    distribute_tensor fails on uneven _StridedShard, e.g. dp 3 x tp 2)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, p in model.named_parameters():
        src = full[name.replace("_checkpoint_wrapped_module.", "")]
        if isinstance(p, DTensor):
            src = distribute_tensor(src, p.device_mesh, p.placements, src_data_rank=None)
        p.copy_(src)


def model_config(args: argparse.Namespace):
    """llama3 "debugmodel" (6 layers, dim 256, vocab 2048) with causal SDPA attention, and
    torchtitan's TP plan with sequence parallelism declared on it (what the trainer's
    ``update_from_config`` does; only ``parallelize`` at tp > 1 reads it)."""
    import dataclasses

    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import llama3_configs
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    cfg = llama3_configs["debugmodel"](attn_backend="flex")
    layers = []
    for layer in cfg.layers[: args.layers]:
        rope = dataclasses.replace(layer.attention.rope, max_seq_len=args.seq_len)
        attn = dataclasses.replace(layer.attention, rope=rope,
                                   inner_attention=ScaledDotProductAttention.Config())
        layers.append(dataclasses.replace(layer, attention=attn))
    cfg = dataclasses.replace(cfg, layers=layers)
    set_llama3_sharding_config(cfg, enable_sp=True)
    return cfg


def tokens(step: int, rank: int, args: argparse.Namespace) -> torch.Tensor:
    """Synthetic text (no tokenizer, no dataset download): walks through a fixed random
    successor table over 64 of the 2048 tokens, 10% of them replaced by noise. The
    loss falls from ln(2048) as the model learns which tokens occur, then what follows
    each; every rank reads its own sequences."""
    table = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(10_000 * step + rank)
    seq = torch.empty(args.batch, args.seq_len + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(0, 64, (args.batch,), generator=g)
    for i in range(1, args.seq_len + 1):
        seq[:, i] = table[seq[:, i - 1]]
    noise = torch.rand(seq.shape, generator=g) < 0.1
    return torch.where(noise, torch.randint(0, 64, seq.shape, generator=g), seq)


def train(args: argparse.Namespace, fsdp: str, optimizer: str) -> tuple[list[float], list[float]]:
    """One torchtitan-style run; returns the global loss and gradient norm of each step."""
    from torchtitan.components.checkpointer.base import ModelWrapper
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.optimizer import LRSchedulersContainer
    from torchtitan.distributed import utils as dist_utils

    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    with torch.device("cpu"):
        full_sd = model_config(args).build()
    full_sd.init_weights(buffer_device=None)
    full_sd = {k: v.detach() for k, v in full_sd.named_parameters()}
    model, parallel_dims = build_model(args, fsdp, world_size, full_sd)
    # the tp ranks of one data-parallel rank read the same sequences (torchtitan's
    # dataloader reads by the "batch" mesh) and compute one loss (loss parallel); at
    # dp 1 torchtitan has neither mesh
    loss_mesh = parallel_dims.get_optional_mesh("loss")
    data_rank = (parallel_dims.get_mesh("batch").get_local_rank() if loss_mesh is not None
                 else 0)

    name = CHOICES[optimizer]
    container = optimizers_container_class()
    optimizers = container.Config(param_groups=param_groups(name, args.lr),
                                  implementation="for-loop").build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optimizers, training_steps=args.steps)
    loss_fn = CrossEntropyLoss.Config().build()
    # CheckpointManager's view of the model: caches the state dict, then compares storages
    ModelWrapper(model).state_dict()

    label = f"{fsdp}+{optimizer}"
    losses, norms = [], []
    for step in range(args.steps):
        seq = tokens(step, data_rank, args)
        inputs, labels = seq[:, :-1], seq[:, 1:]
        global_tokens = dist_utils.dist_sum_tensor(torch.tensor(labels.numel()), loss_mesh)
        optimizers.zero_grad()
        loss, _ = loss_fn(model(inputs), labels, global_tokens)
        loss.backward()
        norm = dist_utils.clip_grad_norm_(list(model.parameters()), args.max_norm)
        optimizers.step()
        lr_schedulers.step()
        total = loss.detach().clone()
        if loss_mesh is not None:  # sum over dp of (local sum / global tokens)
            dist.all_reduce(total, group=loss_mesh.get_group())
        losses.append(total.item())
        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        if rank == 0:
            print(f"[{label}] step {step:2d}  loss {losses[-1]!r:20s}  "
                  f"grad_norm {norms[-1]!r:20s}"
                  f"  lr {lr_schedulers.schedulers[0].get_last_lr()[0]:.2e}", flush=True)
    return losses, norms


def runs(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(fsdp, optimizer) of each run. ``--fsdp both``: our fully_shard, then FSDP2's, with
    the chosen optimizer; at tp > 1 then torch's AdamW on FSDP2 + TP as well."""
    if args.fsdp != "both":
        return [(args.fsdp, args.optimizer)]
    both = [("vefsdp", args.optimizer), ("torch", args.optimizer)]
    if args.tp > 1 and args.optimizer != "torch-adamw":
        both.append(("torch", "torch-adamw"))
    return both


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    results = {key: train(args, *key) for key in runs(args)}
    if dist.get_rank() == 0:
        losses = next(iter(results.values()))[0]
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
    if args.fsdp == "both":
        check(results, args)
    return results


def check(results: dict, args: argparse.Namespace) -> None:
    """The losses of ``--fsdp both``'s runs against each other, step by step; every
    comparison is made and printed, then one AssertionError names those that failed."""
    dp = dist.get_world_size() // args.tp
    mesh = f"dp {dp} x tp {args.tp}: " if args.tp > 1 else ""
    (ours, our_norms), (fsdp2, fsdp2_norms) = (results[("vefsdp", args.optimizer)],
                                               results[("torch", args.optimizer)])
    # our fully_shard against FSDP2's: the summed gradients are the same bits at dp 2;
    # clipping scales by max_norm / grad_norm and the two norms round differently
    clipped = any(n > args.max_norm for n in our_norms + fsdp2_norms)
    failed = [_compare(ours, fsdp2, dp == 2 and not clipped,
                       f"{mesh}losses of vefsdp_optim's fully_shard", "FSDP2's",
                       "within 1e-4 (gradients were clipped, or dp != 2)")]
    reference = results.get(("torch", "torch-adamw"))
    if args.tp > 1 and reference is not None:
        # on FSDP2 + TP, the chosen optimizer against torch's AdamW: one gradient, one clip
        if CHOICES[args.optimizer] == "vefsdp.AdamW":
            failed.append(_compare(fsdp2, reference[0], True,
                                   f"{mesh}losses of adamw on FSDP2 + TP", "torch AdamW's", ""))
        elif dist.get_rank() == 0:  # another update rule: the two curves side by side
            for step, (a, b) in enumerate(zip(fsdp2, reference[0], strict=True)):
                print(f"step {step:2d}  {args.optimizer} {a:.6f}  torch-adamw {b:.6f}",
                      flush=True)
            print(f"{mesh}final loss on FSDP2 + TP of {args.optimizer} {fsdp2[-1]:.4f}, "
                  f"of torch AdamW {reference[0][-1]:.4f}", flush=True)
    failed = [f for f in failed if f]
    if failed:
        raise AssertionError("; ".join(failed))


def _compare(ours: list[float], theirs: list[float], exact: bool, what: str, where: str,
             inexact: str) -> str | None:
    """None (and a line printed) where the losses are equal bit for bit (``exact``) or
    within 1e-4 at every step; else what differed, first step first."""
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if (a != b) if exact else abs(a - b) > 1e-4 * max(1.0, abs(b)):
            msg = f"step {step}: {what} {a!r}, {where} {b!r} ({'bitwise' if exact else 'tol 1e-4'})"
            if dist.get_rank() == 0:
                print(f"MISMATCH {msg}", flush=True)
            return msg
    if dist.get_rank() == 0:
        print(f"{what} == {where}, {'bit for bit' if exact else inexact}", flush=True)
    return None


def _spawned(rank: int, world_size: int, init_file: str, args: argparse.Namespace) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    run(args)
    vefsdp_optim.exit_rank()  # barrier, destroy, no interpreter finalization (gloo's race)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--optimizer", choices=sorted(CHOICES), default="adamw",
                   help="ours (adamw, adamw8bit, muon, shampoo) or torchtitan's torch-adamw")
    p.add_argument("--fsdp", choices=("vefsdp", "torch", "both"), default="vefsdp")
    p.add_argument("--ac", choices=("full", "selective", "none"), default="full",
                   help="torchtitan's activation checkpointing policy")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--layers", type=int, default=6, help="blocks of the debug model (6)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--max-norm", type=float, default=1.0, help="clip_grad_norm_'s max norm")
    p.add_argument("--world-size", type=int, default=2, help="gloo ranks to spawn without torchrun")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel degree: a (W/tp, tp) mesh, torchtitan's TP plan")
    p.add_argument("--dump-folder", default="./outputs")
    args = p.parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", args.world_size))
    if args.tp < 1 or world_size % args.tp:
        p.error(f"--tp {args.tp} must be >= 1 and divide the world size {world_size}")
    return args


def main() -> None:
    args = parse()
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group("gloo")
        run(args)
        vefsdp_optim.exit_rank()
        return
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_spawned, args=(args.world_size, os.path.join(tmp, "pg"), args),
                 nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
