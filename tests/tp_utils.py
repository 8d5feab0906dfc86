"""The tensor-parallel harness shared by the N-D mesh tests (test_nd_mesh, SOAP's and
NorMuon's FSDP2 + TP cases, expert parallel): a small block with colwise / rowwise
Linear pairs and its plan, ``parallelize`` with torch's styles, full tensors back, and
each rank's part of a full gradient cut by the library's layout and checked against
DTensor's own gather.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["TP_PLAN", "TPBlock", "full_grad", "gathered", "parallelize", "set_box_grad"]


class TPBlock(nn.Module):
    """A norm and two colwise / rowwise Linear pairs, odd sizes (dp 3 cuts them unevenly)."""

    def __init__(self, d: int = 10, h: int = 14) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)
        self.up2 = nn.Linear(d, 2 * h, bias=False)
        self.down2 = nn.Linear(2 * h, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.down(torch.relu(self.up(self.norm(x))))
        return x + self.down2(torch.tanh(self.up2(x)))


TP_PLAN = {"up": "colwise", "down": "rowwise", "up2": "colwise", "down2": "rowwise"}


def parallelize(model: nn.Module, tp_mesh, plan: dict[str, str]) -> None:
    """``parallelize_module`` with ``plan``'s styles ("colwise", "rowwise") by submodule."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(model, tp_mesh, {k: styles[v]() for k, v in plan.items()})


def gathered(p: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor or ShardedParameter, a copy of a plain one."""
    return p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()


def full_grad(step: int, name: str, shape: torch.Size) -> torch.Tensor:
    """The full gradient of parameter ``name`` at ``step``, the same on every rank."""
    g = torch.Generator().manual_seed(1000 * step + sum(map(ord, name)))
    return torch.randn(shape, generator=g)


def set_box_grad(p: torch.Tensor, full: torch.Tensor) -> None:
    """This rank's part of ``full`` as ``p.grad``: cut with the library's layout, then
    checked against DTensor's own gather, so a wrong layout fails here."""
    from torch.distributed.tensor import DTensor

    from vefsdp_optim import ShardedParameter
    from vefsdp_optim.comm import sharded_view

    if isinstance(p, ShardedParameter):  # our fully_shard: its RaggedShard or BoxShard runs
        p.grad = p.with_local(full.reshape(-1)[p.ragged_layout.local_index(p.shard_rank)].clone())
        assert torch.equal(p.grad.full_tensor(), full), tuple(p.shape)
        return
    if not isinstance(p, DTensor):
        p.grad = full.clone()
        return
    g = torch.zeros_like(p)
    view = sharded_view(g)
    view.local.copy_(full.reshape(-1)[view.layout.local_index(view.rank)])
    assert torch.equal(g.full_tensor(), full), (p.placements, tuple(p.shape))
    p.grad = g
