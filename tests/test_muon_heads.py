"""Per-head Muon (group key ``num_heads``, Dion's name): a 2-D weight viewed as
``num_heads`` equal row blocks, each orthogonalized with its own lr adjustment, equal to
torch.optim.Muon on the separate head parameters; heads kept whole by the planner,
sharded at W = 2 and 3 (FSDP2 and fully_shard) equal to one device."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed
from torch import nn

import vefsdp_optim
from vefsdp_optim.sharding import FlatBlocks

HEADS = 4
SHAPES = {"q": (12, 7), "o": (8, 12)}  # 4 heads of 3 rows; 4 heads of 2 rows
HP = dict(lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")


def _grad(step: int, name: str) -> torch.Tensor:
    return torch.randn(SHAPES[name], generator=torch.Generator().manual_seed(100 * step + ord(name)))


def _init() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}


def _torch_heads(steps: int) -> dict[str, torch.Tensor]:
    """torch.optim.Muon on every head as its own parameter."""
    init = _init()
    heads = {k: [nn.Parameter(h.clone()) for h in v.chunk(HEADS)] for k, v in init.items()}
    opt = torch.optim.Muon([p for hs in heads.values() for p in hs], **HP)
    for step in range(steps):
        for k, hs in heads.items():
            for h, g in zip(hs, _grad(step, k).chunk(HEADS), strict=True):
                h.grad = g.clone()
        opt.step()
    return {k: torch.cat([h.detach() for h in hs]) for k, hs in heads.items()}


def test_num_heads_equals_torch_on_separate_heads() -> None:
    params = {k: nn.Parameter(v.clone()) for k, v in _init().items()}
    opt = vefsdp_optim.Muon(list(params.values()), num_heads=HEADS, **HP)
    assert opt.requirement(torch.Size(SHAPES["q"]), opt.param_groups[0]) == FlatBlocks(3 * 7)
    for step in range(3):
        for k, p in params.items():
            p.grad = _grad(step, k)
        opt.step()
    want = _torch_heads(3)
    for k in SHAPES:
        assert torch.equal(params[k].detach(), want[k]), k
    whole = nn.Parameter(_init()["q"])  # the heads really differ from one matrix
    one = vefsdp_optim.Muon([whole], **HP)
    whole.grad = _grad(0, "q")
    one.step()
    assert not torch.allclose(whole.detach(), _torch_heads(1)["q"])


def test_num_heads_errors() -> None:
    p = nn.Parameter(torch.zeros(10, 4))
    with pytest.raises(ValueError, match="num_heads=4 does not divide the 10 rows"):
        vefsdp_optim.Muon([p], num_heads=4)
    with pytest.raises(ValueError, match="both num_heads=2 and split_sizes"):
        vefsdp_optim.Muon([{"params": [p], "num_heads": 2, "split_sizes": [5, 5]}])
    with pytest.raises(TypeError, match="num_heads must be a positive int"):
        vefsdp_optim.Muon([p], num_heads=2.0)
    with pytest.raises(ValueError, match="num_heads must be >= 1"):
        vefsdp_optim.NorMuon([{"params": [p], "num_heads": 0}])


def _sharded(kind: str) -> float:
    from vefsdp_optim import ShardedParameter

    model = nn.Module()
    for k, v in _init().items():
        model.register_parameter(k, nn.Parameter(v.clone()))
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        from vefsdp_optim import fully_shard
    fully_shard(model)
    opt = vefsdp_optim.Muon(list(model.parameters()), num_heads=HEADS, **HP)
    for step in range(3):
        for k, p in model.named_parameters():
            g = _grad(step, k)
            if isinstance(p, ShardedParameter):
                p.grad = p.with_local(g.reshape(-1)[p.ragged_layout.local_index(p.shard_rank)].clone())
            else:
                from torch.distributed.tensor import distribute_tensor

                p.grad = distribute_tensor(g, p.device_mesh, p.placements)
        opt.step()
    want = _torch_heads(3)
    return max(float((p.full_tensor() - want[k]).abs().max()) for k, p in model.named_parameters())


def _both() -> dict[str, float]:
    return {kind: _sharded(kind) for kind in ("fsdp2", "fully_shard")}


@pytest.mark.parametrize("world_size", [2, 3])
def test_num_heads_sharded_equals_torch_on_separate_heads(world_size: int) -> None:
    for r in run_distributed(_both, world_size):
        assert r == {"fsdp2": 0.0, "fully_shard": 0.0}, r
