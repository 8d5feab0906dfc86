"""A Parameter tied across fully_shard calls (see ``_tie_error`` in vefsdp_optim/_fsdp/_fully_shard.py):
refused on every rank, in either order and by the root call after one child, naming
both modules; the fix the error names (one shard group for both) keeps the tie and trains as
one device with torch.optim.AdamW, bit for bit."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed
from torch import nn

import vefsdp_optim


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.mid = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.embed(tokens))))


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.roll(1, 1).flatten())


def _refusals() -> dict[str, str]:
    """The message of each refused second call (or "no error")."""
    import torch.distributed as dist

    out: dict[str, str] = {}
    for first in ("embed", "head"):
        for second in ("sibling", "root"):
            model = Tied()
            other = "head" if first == "embed" else "embed"
            vefsdp_optim.fully_shard(getattr(model, first))
            try:
                vefsdp_optim.fully_shard(getattr(model, other) if second == "sibling" else model)
                out[f"{first}_then_{second}"] = "no error"
            except ValueError as e:
                out[f"{first}_then_{second}"] = str(e)
    dist.barrier()  # every rank raised alike: the group still works
    return out


@pytest.mark.parametrize("world_size", [1, 2])
def test_tie_across_groups_is_refused_in_either_order(world_size: int) -> None:
    fix = "fully_shard([embed_module, head_module])"
    for r in run_distributed(_refusals, world_size):
        for first in ("embed", "head"):
            msg = r[f"{first}_then_sibling"]  # the root is unknown: modules by class
            assert "Embedding.weight" in msg and "Linear.weight" in msg and fix in msg, msg
            msg = r[f"{first}_then_root"]  # the root call: modules by their paths
            other = "head" if first == "embed" else "embed"
            assert f"{other}.weight (" in msg and f"{first}.weight (" in msg, msg
            assert "Embedding.weight" in msg and "Linear.weight" in msg, msg
            assert f"fully_shard([m.{first}, m.{other}]), then fully_shard(m)" in msg, msg


def _one_group(steps: int) -> dict[str, float]:
    import torch.distributed as dist

    out: dict[str, float] = {}
    model, ref = Tied(), Tied()
    ref.load_state_dict(model.state_dict())
    vefsdp_optim.fully_shard([model.embed, model.head])
    vefsdp_optim.fully_shard(model)
    out["params"] = len(list(model.parameters()))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    w = dist.get_world_size()

    def tokens(step: int, rank: int) -> torch.Tensor:
        return torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(10 * step + rank))

    for step in range(steps):
        _loss(model, tokens(step, dist.get_rank())).backward()
        opt.step()
        opt.zero_grad()
        # one device: the same average of the ranks' gradients (the sum of W, divided by W)
        grads = None
        for r in range(w):
            ref.zero_grad()
            _loss(ref, tokens(step, r)).backward()
            g = [p.grad.clone() for p in ref.parameters()]
            grads = g if grads is None else [a + b for a, b in zip(grads, g, strict=True)]
        for p, g in zip(ref.parameters(), grads, strict=True):
            p.grad = g / w
        ref_opt.step()
    out["tie_kept"] = float(model.head.weight is model.embed.weight)
    out["max_diff"] = max(float((p.full_tensor() - q.detach()).abs().max())
                          for p, q in zip(model.parameters(), ref.parameters(), strict=True))
    return out


@pytest.mark.parametrize("world_size", [1, 2])
def test_one_group_keeps_the_tie_and_trains_as_one_device(world_size: int) -> None:
    for r in run_distributed(_one_group, world_size, 3):
        assert r["params"] == 1 + 2, r  # embed/head tied (1), mid weight and bias (2)
        assert r["tie_kept"] == 1.0 and r["max_diff"] == 0.0, r
