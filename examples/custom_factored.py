"""A custom optimizer with whole-matrix state, checkpoints included: a factored RMS step.

Like Adafactor's second moment: a matrix keeps one running mean of g^2 per row and one
per column (its WholeTensor requirement: the update needs the whole matrix), vectors
one per element. Declaring each state entry's kind in ``checkpoint_spec`` is all that
checkpoints need: save at 3 ranks, load at 2, on fully_shard or FSDP2, and the run goes
on as if uninterrupted (tests/test_custom_state.py).

    python examples/custom_factored.py
    torchrun --nproc-per-node 3 examples/custom_factored.py
"""

from __future__ import annotations

import os

import torch
from torch import nn

import vefsdp_optim
from vefsdp_optim import ELEMENTWISE, REPLICATED, WHOLE
from vefsdp_optim.sharding import Elementwise, WholeTensor


@vefsdp_optim.register_optimizer("factored_rms")
class FactoredRMS(vefsdp_optim.BlockOptimizer):
    def __init__(self, params, lr: float = 1e-2, beta2: float = 0.99, eps: float = 1e-30) -> None:
        super().__init__(params, dict(lr=lr, beta2=beta2, eps=eps))

    def requirement(self, shape, group):
        return WholeTensor() if len(shape) == 2 else Elementwise()

    def checkpoint_spec(self, shape, group):
        if len(shape) == 2:  # kept whole by the rank that updates the matrix
            return {"step": REPLICATED, "row": WHOLE, "col": WHOLE}
        return {"step": REPLICATED, "v": ELEMENTWISE}

    def init_state(self, p, ctx, group):
        step = torch.zeros((), dtype=torch.float32)
        if len(ctx.shape) == 2:  # p is the whole matrix, flat
            return {"step": step, "row": p.new_zeros(ctx.shape[0]), "col": p.new_zeros(ctx.shape[1])}
        return {"step": step, "v": torch.zeros_like(p)}  # p is this rank's slice

    def update_block(self, p, g, state, ctx, group):
        state["step"] += 1
        g2 = g.square() + group["eps"]
        if "row" in state:
            g2 = g2.view(ctx.shape)
            state["row"].lerp_(g2.mean(1), 1 - group["beta2"])
            state["col"].lerp_(g2.mean(0), 1 - group["beta2"])
            v = (torch.outer(state["row"], state["col"]) / state["row"].mean()).view(-1)
        else:
            v = state["v"].lerp_(g2, 1 - group["beta2"])
        p.addcdiv_(g, v.sqrt(), value=-group["lr"])


def main() -> None:
    import torch.distributed as dist

    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 30), nn.Tanh(), nn.Linear(30, 1))
    if distributed:
        vefsdp_optim.fully_shard(model)
    opt = FactoredRMS(model.parameters(), lr=3e-3)
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
