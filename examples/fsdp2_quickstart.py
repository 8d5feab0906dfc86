"""An ordinary FSDP2 training script, turned to vefsdp_optim optimizers.

The only changes to the FSDP2 script are the lines marked ``# vefsdp_optim``: the
optimizer import (and, with ``--fsdp vefsdp``, this library's own ``fully_shard``, a
drop-in for torch's with zero-copy buffers). Everything runs on the CPU with gloo:

    torchrun --nproc-per-node 2 examples/fsdp2_quickstart.py --optimizer muon
    python examples/fsdp2_quickstart.py --world-size 3 --optimizer adamw8bit --fsdp vefsdp

(the second form spawns the gloo ranks itself). On GPUs, launch with torchrun and the
script uses NCCL and one device per rank.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import vefsdp_optim  # vefsdp_optim


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self, vocab: int = 96, d: int = 64, n_layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([Block(d) for _ in range(n_layers)])
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def make_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    # was: torch.optim.AdamW(model.parameters(), lr=3e-3)
    if name == "adamw":
        return vefsdp_optim.AdamW(model.parameters(), lr=3e-3)  # vefsdp_optim
    if name == "adamw8bit":
        return vefsdp_optim.AdamW8bit(model.parameters(), lr=3e-3, min_8bit_size=1024)
    if name == "shampoo":
        return vefsdp_optim.Shampoo(model.parameters(), lr=3e-3, max_preconditioner_dim=128)
    if name == "muon":  # matrices to Muon; embeddings, head and vectors to its AdamW
        named = list(model.named_parameters())
        hidden = [p for n, p in named if p.ndim >= 2 and "embed" not in n and "head" not in n]
        rest = [p for n, p in named if not (p.ndim >= 2 and "embed" not in n and "head" not in n)]
        return vefsdp_optim.Muon([
            {"params": hidden},
            {"params": rest, "use_muon": False, "lr": 3e-3},
        ], lr=0.02)
    # any registered name or "package.module:Class"
    return vefsdp_optim.get_optimizer(name)(model.parameters())


def train(args: argparse.Namespace) -> None:
    rank = dist.get_rank()
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    torch.manual_seed(0)  # the same initial model on every rank
    model = Model().to(device)
    if args.fsdp == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from vefsdp_optim import fully_shard  # vefsdp_optim
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = make_optimizer(args.optimizer, model)

    # data: each rank its own slice of the global batch; the toy task: echo each token
    g = torch.Generator().manual_seed(1000 + rank)
    for step in range(args.steps):
        idx = torch.randint(0, 96, (8, 32), generator=g).to(device)
        logits = model(idx)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 10 == 0 or step == args.steps - 1:
            avg = loss.detach().clone()
            dist.all_reduce(avg)
            if rank == 0:
                print(f"step {step:3d}  loss {avg.item() / dist.get_world_size():.4f}", flush=True)


def _spawned(rank: int, world_size: int, init_file: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    train(args)
    vefsdp_optim.exit_rank()  # barrier, destroy, no interpreter finalization (gloo's race)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--optimizer", default="adamw",
                   help="adamw, adamw8bit, shampoo, muon, or a registered name / package.module:Class")
    p.add_argument("--fsdp", choices=("torch", "vefsdp"), default="torch",
                   help="torch's FSDP2 fully_shard or vefsdp_optim.fully_shard")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--world-size", type=int, default=2, help="ranks to spawn without torchrun")
    args = p.parse_args()
    if "RANK" in os.environ:  # torchrun
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
        train(args)
        vefsdp_optim.exit_rank()
        return
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_spawned, args=(args.world_size, os.path.join(tmp, "pg"), args),
                 nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
