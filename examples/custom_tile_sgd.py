"""A custom block-structured optimizer in ~30 lines: tile-wise normalized SGD.

Each band of ``tile_rows`` rows of a matrix is updated by ``-lr * G_band / ||G_band||``,
a norm over the whole band, so the band must be whole on one rank. Declaring the
requirement is all it takes: vefsdp_optim moves only boundary rows for FSDP2 shards
(none at all for a planned fully_shard layout) and the result equals a single device.

Run it on one process, or with torchrun on several (CPU: gloo):
    python examples/custom_tile_sgd.py
    torchrun --nproc-per-node 3 examples/custom_tile_sgd.py
"""

from __future__ import annotations

import os

import torch
from torch import nn

import vefsdp_optim
from vefsdp_optim.sharding import Elementwise, RowBlocks


@vefsdp_optim.register_optimizer("tile_sgd")
class TileNormalizedSGD(vefsdp_optim.BlockOptimizer):
    def __init__(self, params, lr: float = 0.01, tile_rows: int = 4, eps: float = 1e-12) -> None:
        if lr < 0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not isinstance(tile_rows, int) or tile_rows < 1:
            raise ValueError(f"tile_rows must be a positive int, got {tile_rows!r}")
        super().__init__(params, dict(lr=lr, tile_rows=tile_rows, eps=eps))

    def requirement(self, shape, group):
        return RowBlocks(group["tile_rows"]) if len(shape) >= 2 else Elementwise()

    def update_block(self, p, g, state, ctx, group):
        if len(ctx.shape) < 2:  # vectors: plain SGD
            p.add_(g, alpha=-group["lr"])
            return
        cols = ctx.numel // ctx.shape[0]
        band = group["tile_rows"] * cols  # elements per band; ctx.start is a multiple
        for lo in range(0, p.numel(), band):
            gb = g[lo:lo + band]
            p[lo:lo + band].add_(gb / (gb.norm() + group["eps"]), alpha=-group["lr"])


def main() -> None:
    import torch.distributed as dist

    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 30), nn.Tanh(), nn.Linear(30, 1))
    if distributed:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
    opt = vefsdp_optim.get_optimizer("tile_sgd")(model.parameters(), lr=0.02, tile_rows=4)
    x = torch.randn(256, 16, generator=torch.Generator().manual_seed(1))
    y = x[:, :1].sin()
    for step in range(50):
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 10 == 0 and (not distributed or dist.get_rank() == 0):
            print(f"step {step:3d} loss {loss.item():.4f}")
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
