"""Every optimizer on N-D meshes: FSDP2 x tensor parallel (x replicate), expert parallel.

The parameters are DTensors placed ``(_StridedShard(0), Shard(0))`` (colwise),
``(Shard(0), Shard(1))`` (rowwise), ``(Shard(0), Replicate())`` (rowwise bias) and
``(Shard(0),)`` on the dp submesh (norms), on uneven shapes. Each step's full gradients
(what FSDP2 + TP computed, gathered) are replayed on one device by an unsharded
optimizer: torch.optim.AdamW for AdamW, our own single-device runs for the others.
The trained parameters must be bitwise equal.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed
from torch import nn

OPTIMIZERS = ("adamw", "muon", "adamw8bit", "adam8bit", "shampoo")


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


def make_optimizer(name: str, params: list, *, fused_adamw: bool = False) -> torch.optim.Optimizer:
    import vefsdp_optim as vo

    params = list(params)
    if name == "adamw":
        return vo.AdamW(params, lr=1e-2, weight_decay=0.1)
    if name == "torch_adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    if name == "muon":
        mats = [p for p in params if p.dim() == 2]
        rest = [p for p in params if p.dim() != 2]
        return vo.Muon([{"params": mats}, {"params": rest, "use_muon": False}], lr=2e-2,
                       weight_decay=0.1)
    if name == "adamw8bit":
        return vo.AdamW8bit(params, lr=1e-2, block_size=16, min_8bit_size=16)
    if name == "adam8bit":
        return vo.Adam8bit(params, lr=1e-2, block_size=16, min_8bit_size=16)
    if name == "shampoo":
        return vo.Shampoo(params, lr=1e-2, max_preconditioner_dim=4, precondition_frequency=2)
    raise ValueError(name)


def _parallelize(model: nn.Module, tp_mesh, plan: dict[str, str]) -> None:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(model, tp_mesh, {k: styles[v]() for k, v in plan.items()})


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()


def _train_nd(name: str, mesh_shape: tuple[int, ...], names: tuple[str, ...], steps: int = 3,
              replicate: bool = False) -> dict[str, object]:
    """FSDP2 (+ HSDP when ``replicate``) + TP on ``mesh_shape``; every step's gathered full
    gradients replayed on one device; returns the largest difference and what moved."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = TPBlock()
    ref = TPBlock()
    ref.load_state_dict(model.state_dict())
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    _parallelize(model, mesh["tp"], TP_PLAN)
    dp = mesh[names[:-1]] if replicate else mesh["dp"]
    fully_shard(model, mesh=dp)
    opt = make_optimizer(name, model.parameters())
    ref_opt = make_optimizer("torch_adamw" if name == "adamw" else name, ref.parameters())
    tp_rank = mesh["tp"].get_local_rank()
    dp_rank = dist.get_rank() // mesh_shape[-1]
    del tp_rank
    worst = 0.0
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + dp_rank)
        x = torch.randn(3, 5, 10, generator=g)
        model(x).pow(2).mean().backward()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            q.grad = _full(p.grad)
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            worst = max(worst, float((_full(p) - q.detach()).abs().max()))
    placements = sorted({str(p.placements) for p in model.parameters()})
    return {"worst": worst, "placements": placements}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_fsdp2_tp_2x2_bitwise(name: str) -> None:
    results = run_distributed(_train_nd, 4, name, (2, 2), ("dp", "tp"))
    for r in results:
        assert r["worst"] == 0.0, r
    assert any("_StridedShard" in p for p in results[0]["placements"]), results[0]["placements"]
    assert any("Shard(dim=1)" in p for p in results[0]["placements"]), results[0]["placements"]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_fsdp2_tp_3x2_bitwise(name: str) -> None:
    for r in run_distributed(_train_nd, 6, name, (3, 2), ("dp", "tp")):
        assert r["worst"] == 0.0, r


# -- checkpoints across meshes: dp 2 x tp 2 <-> a 1-D mesh of 3 <-> one device ------------------


@pytest.mark.parametrize("src, dst", [
    (("fsdp2_tp", 4), ("fsdp2", 3)),
    (("fsdp2_tp", 4), ("single", "single")),
    (("fsdp2", 3), ("fsdp2_tp", 4)),
])
def test_checkpoint_across_meshes(tmp_path, src, dst):
    from test_checkpoint import _resume_case

    _resume_case(tmp_path, src[0], src[1], dst[0], dst[1])


# dp 3 x tp 2 is left out: torch 2.13's DTensor describes the uneven _StridedShard boxes
# of FSDP2 + TP's *model* parameters (37 rows: tp 19 / 18, then dp 7 / 7 / 5) as
# overlapping 6-row chunks, and DCP refuses the model state before the optimizer's.
@pytest.mark.slow
@pytest.mark.parametrize("src, dst", [(("single", "single"), ("fsdp2_tp", 4))])
def test_checkpoint_across_meshes_more(tmp_path, src, dst):
    from test_checkpoint import _resume_case

    _resume_case(tmp_path, src[0], src[1], dst[0], dst[1])
