"""Train torchtitan's DeepSeek-V3 debug model (MoE) with expert parallelism on the CPU,
under vefsdp_optim's fully_shard or FSDP2, Muon on the experts and AdamW on the rest.

torchtitan's own pieces, unchanged: the deepseek_v3 "debugmodel" config (MLA attention,
one dense block, then MoE blocks of 8 routed experts, top 3, and 2 shared experts), its
sharding config (``set_deepseek_v3_sharding_config`` with ``enable_ep``, what the
trainer's ``update_from_config`` does), ``ParallelDims`` with ``ep`` (its dense "fsdp" mesh
and sparse ("efsdp", "ep") mesh), ``parallelize_deepseekv3`` (``Module.parallelize``: the
experts become DTensors ``Shard(0)`` on "ep", the token dispatcher all-to-alls over it;
then ``apply_fsdp_to_decoder``: one ``fully_shard`` per block whose
``shard_placement_fn`` gives FSDP2's ``ShardPlacementResult`` on "efsdp" for the experts
and on "fsdp" for the rest, then the root; before it, activation checkpointing,
selective as in torchtitan's debug config, ``--ac``), ``init_weights`` and its cross-entropy loss
normalized by the global token count. The one swap, marked ``# vefsdp_optim``:
torchtitan's ``fully_shard`` is ours (one attribute of ``torchtitan.distributed.fsdp``);
our fully_shard gives each such block two shard groups (see ``_by_mesh`` in vefsdp_optim/_fsdp/_fully_shard.py).

Optimizers: Muon with ``flatten=False`` on the experts (each expert's matrix
orthogonalized whole) and AdamW on every other parameter. ``--fsdp both`` trains three
runs from the same weights on the same tokens:

1. our fully_shard + vefsdp_optim's Muon and AdamW;
2. FSDP2 + vefsdp_optim's Muon and AdamW;
3. FSDP2 + torch's optimizers: ``torch.optim.Muon`` on each expert matrix (every rank
   steps the gathered full experts alike and keeps its own part) and ``torch.optim.AdamW``;

and checks their losses step by step: 2 against 3 bit for bit (the same gradients, the
same math), 1 against 2 bit for bit where the dense data-parallel mesh has 2 ranks (at 4,
the two reduce-scatters add the four gradients in different orders: within 1e-4). No
gradient clipping (it would add the two norms' rounding).

What torchtitan needed on the CPU (docs/compatibility.md): ``tyro`` and ``spmd_types``
installed (``pip install --no-deps torchtitan==0.3.0``, then those two), a CPU device
mesh (``ParallelDims.build_mesh`` picks "cuda"), causal SDPA attention in place of
FlexAttention, float32 parameters, a synthetic token stream, and for FSDP2 runs
``set_force_sum_reduction_for_comms`` (gloo has no PREMUL_SUM).

    python examples/torchtitan_moe.py --world-size 2 --ep 2 --fsdp both
    python examples/torchtitan_moe.py --world-size 4 --ep 2 --fsdp both
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from torchtitan_llama3 import _compare, load_full_params, tokens  # noqa: E402

import vefsdp_optim  # noqa: E402  # vefsdp_optim

EXPERTS = "moe.routed_experts.inner_experts."


def model_config(args: argparse.Namespace):
    """deepseek_v3 "debugmodel" (dim 256, vocab 2048; ``--layers`` of its 6 blocks, the first
    dense) with causal SDPA attention and torchtitan's sharding config for ``--ep``."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.deepseek_v3 import model_registry
    from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config

    cfg = model_registry("debugmodel").model
    layers = []
    for layer in cfg.layers[: args.layers]:
        rope = dataclasses.replace(layer.attention.rope, max_seq_len=args.seq_len)
        attn = dataclasses.replace(layer.attention, rope=rope,
                                   inner_attention=ScaledDotProductAttention.Config())
        layers.append(dataclasses.replace(layer, attention=attn))
    cfg = dataclasses.replace(cfg, layers=layers)
    set_deepseek_v3_sharding_config(cfg, enable_sp=True, enable_ep=args.ep > 1)
    return cfg


def build_model(args: argparse.Namespace, fsdp: str, full: dict[str, torch.Tensor]):
    """torchtitan's build, parallelize (EP, then FSDP) and init, with our fully_shard
    swapped in for ``fsdp == "vefsdp"``; every run starts from ``full``."""
    import torchtitan.distributed.fsdp as tt_fsdp
    import torchtitan.distributed.parallel_dims as tt_dims
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as tt_utils
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.models.deepseek_v3 import parallelize_deepseekv3

    tt_dims.device_type = "cpu"  # no accelerator: a CPU (gloo) mesh
    world_size = dist.get_world_size()
    parallel_dims = ParallelDims(dp_replicate=1, dp_shard=world_size, cp=1, tp=1, pp=1,
                                 ep=args.ep, world_size=world_size,
                                 spmd_backend="partial_dtensor")
    parallel_dims.build_mesh()
    tt_utils.set_spmd_backend("partial_dtensor")
    with torch.device("meta"):
        model = model_config(args).build()
    ac = {"full": FullAC.Config(), "selective": SelectiveAC.Config(), "none": None}[args.ac]
    torch_fully_shard = tt_fsdp.fully_shard
    if fsdp == "vefsdp":
        tt_fsdp.fully_shard = vefsdp_optim.fully_shard  # vefsdp_optim: the one swap
    try:
        model = parallelize_deepseekv3(
            model, parallel_dims=parallel_dims,
            training=TrainingConfig(seq_len=args.seq_len, mixed_precision_param="float32"),
            parallelism=ParallelismConfig(spmd_backend="partial_dtensor",
                                          expert_parallel_degree=args.ep),
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
    load_full_params(model, full)
    model.train()
    return model, parallel_dims


class TorchMuonPerExpert:
    """torch.optim.Muon on each expert matrix of sharded 3-D expert weights: every rank
    gathers the full weights and gradients, steps one torch Muon over their E matrices
    (the same on every rank) and keeps its own part. The reference for vefsdp_optim's
    Muon with ``flatten=False``; memory and work are a full replica's, by design."""

    def __init__(self, params: list[torch.Tensor], **hp: float) -> None:
        self.params = params
        self.mats = [[torch.nn.Parameter(m.clone()) for m in p.full_tensor().detach()] for p in params]
        self.opt = torch.optim.Muon([m for ms in self.mats for m in ms], **hp)

    def zero_grad(self) -> None:
        self.opt.zero_grad()
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        from torch.distributed.tensor import distribute_tensor

        for p, ms in zip(self.params, self.mats, strict=True):
            for m, g in zip(ms, p.grad.full_tensor(), strict=True):
                m.grad = g.clone()
        self.opt.step()
        for p, ms in zip(self.params, self.mats, strict=True):
            p.copy_(distribute_tensor(torch.stack([m.detach() for m in ms]), p.device_mesh,
                                      p.placements, src_data_rank=None))


def optimizers(model: torch.nn.Module, kind: str, args: argparse.Namespace) -> list:
    """Muon (flatten=False) on the experts, AdamW on the rest; ``kind``: ours or torch."""
    experts = [p for n, p in model.named_parameters() if EXPERTS in n]
    rest = [p for n, p in model.named_parameters() if EXPERTS not in n]
    muon = dict(lr=args.muon_lr, weight_decay=0.1)
    adamw = dict(lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    if kind == "ours":
        return [vefsdp_optim.Muon([{"params": experts, "flatten": False}], **muon),
                vefsdp_optim.AdamW(rest, **adamw)]
    return [TorchMuonPerExpert(experts, **muon), torch.optim.AdamW(rest, **adamw)]


def train(args: argparse.Namespace, fsdp: str, kind: str) -> list[float]:
    """One run; the global loss of each step."""
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.distributed import utils as dist_utils

    torch.manual_seed(0)
    with torch.device("cpu"):
        ref = model_config(args).build()
    ref.init_weights(buffer_device=None)
    full = {k: v.detach() for k, v in ref.named_parameters()}
    model, parallel_dims = build_model(args, fsdp, full)
    n_experts = sum(1 for n, _ in model.named_parameters() if EXPERTS in n)
    opts = optimizers(model, kind, args)
    loss_fn = CrossEntropyLoss.Config().build()
    loss_mesh = parallel_dims.get_optional_mesh("loss")
    label = f"{fsdp}+{kind}"
    losses = []
    for step in range(args.steps):
        seq = tokens(step, dist.get_rank(), args)
        inputs, labels = seq[:, :-1], seq[:, 1:]
        global_tokens = dist_utils.dist_sum_tensor(torch.tensor(labels.numel()), loss_mesh)
        for o in opts:
            o.zero_grad()
        loss, _ = loss_fn(model(inputs), labels, global_tokens)
        loss.backward()
        for o in opts:
            o.step()
        total = loss.detach().clone()
        dist.all_reduce(total)  # sum over the ranks of (local sum / global tokens)
        losses.append(total.item())
        if dist.get_rank() == 0:
            print(f"[{label}] step {step:2d}  loss {losses[-1]!r}", flush=True)
    if dist.get_rank() == 0:
        print(f"[{label}] {n_experts} expert weights under Muon (flatten=False)", flush=True)
        if fsdp == "vefsdp":  # for the test: one fully_shard per MoE block, a shard group per mesh
            sizes = {tuple(g.settings.world_size for g in b._vefsdp_state.shard_groups)
                     for b in model.layers.values() if getattr(b, "moe_enabled", False)}
            print(f"[{label}] shard groups of each MoE block over {' or '.join(map(str, map(list, sizes)))} "
                  "ranks", flush=True)
    return losses


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    keys = ([("vefsdp", "ours"), ("torch", "ours"), ("torch", "torch")] if args.fsdp == "both"
            else [(args.fsdp, "ours")])
    results = {key: train(args, *key) for key in keys}
    if dist.get_rank() == 0:
        losses = next(iter(results.values()))
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
    if args.fsdp == "both":
        check(results, args)
    return results


def check(results: dict, args: argparse.Namespace) -> None:
    """FSDP2 + ours against FSDP2 + torch's optimizers (bit for bit), and our fully_shard
    against FSDP2 (bit for bit at a dense mesh of 2, within 1e-4 otherwise)."""
    dp = dist.get_world_size()
    mesh = f"ep {args.ep}, dp {dp}: "
    failed = [
        _compare(results[("torch", "ours")], results[("torch", "torch")], True,
                 f"{mesh}losses of vefsdp_optim's Muon + AdamW on FSDP2",
                 "torch.optim.Muon per expert + AdamW's", ""),
        _compare(results[("vefsdp", "ours")], results[("torch", "ours")], dp == 2,
                 f"{mesh}losses of vefsdp_optim's fully_shard", "FSDP2's",
                 "within 1e-4 (dense reduce-scatter over 4 ranks: another order of the sum)"),
    ]
    failed = [f for f in failed if f]
    if failed:
        raise AssertionError("; ".join(failed))


def _spawned(rank: int, world_size: int, init_file: str, args: argparse.Namespace) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    run(args)
    vefsdp_optim.exit_rank()  # barrier, destroy, no interpreter finalization (gloo's race)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fsdp", choices=("vefsdp", "torch", "both"), default="both")
    p.add_argument("--ac", choices=("full", "selective", "none"), default="selective",
                   help="torchtitan's activation checkpointing policy (its debug model's: selective)")
    p.add_argument("--ep", type=int, default=2, help="expert-parallel degree (divides W and 8)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--layers", type=int, default=3, help="blocks of the debug model (6; the first dense)")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW's")
    p.add_argument("--muon-lr", type=float, default=0.02)
    p.add_argument("--world-size", type=int, default=2, help="gloo ranks to spawn without torchrun")
    p.add_argument("--dump-folder", default="./outputs")
    args = p.parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", args.world_size))
    if args.ep < 1 or world_size % args.ep or 8 % args.ep:
        p.error(f"--ep {args.ep} must be >= 1 and divide the world size {world_size} and the 8 experts")
    if args.layers < 2:
        p.error(f"--layers {args.layers}: the first block is dense; 2 or more give an MoE block")
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
