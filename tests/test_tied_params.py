"""A Parameter tied across sibling fully_shard calls ([Note: tied parameters across
groups]): refused in either order, naming both modules; the fix (one group for both)
keeps the tie and trains as one device with torch.optim.AdamW."""

from __future__ import annotations

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


def _case() -> dict[str, object]:
    import torch.distributed as dist

    out: dict[str, object] = {}
    for order in ("embed_first", "head_first"):
        torch.manual_seed(0)
        model = Tied()
        first, second = (model.embed, model.head) if order == "embed_first" else (model.head, model.embed)
        vefsdp_optim.fully_shard(first)
        try:
            vefsdp_optim.fully_shard(second)
            out[order] = "no error"
        except ValueError as e:
            out[order] = str(e)
    torch.manual_seed(0)
    model, ref = Tied(), Tied()
    ref.load_state_dict(model.state_dict())
    vefsdp_optim.fully_shard([model.embed, model.head])
    vefsdp_optim.fully_shard(model)
    out["params"] = len(list(model.parameters()))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    w = dist.get_world_size()
    for step in range(3):
        tokens = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
        _loss(model, tokens).backward()
        opt.step()
        opt.zero_grad()
        # one device: the same average of the ranks' gradients (the sum of W, divided by W)
        every = [torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(10 * step + r))
                 for r in range(w)]
        grads = None
        for toks in every:
            ref.zero_grad()
            _loss(ref, toks).backward()
            g = [p.grad.clone() for p in ref.parameters()]
            grads = g if grads is None else [a + b for a, b in zip(grads, g, strict=True)]
        for p, g in zip(ref.parameters(), grads, strict=True):
            p.grad = g / w
        ref_opt.step()
    out["max_diff"] = max(float((p.full_tensor() - q.detach()).abs().max())
                          for p, q in zip(model.parameters(), ref.parameters(), strict=True))
    return out


def test_tie_across_sibling_groups_is_refused_and_one_group_keeps_it() -> None:
    for r in run_distributed(_case, 2):
        for order in ("embed_first", "head_first"):
            msg = r[order]
            assert "Embedding.weight" in msg and "Linear.weight" in msg, msg
            assert "fully_shard([embed_module, head_module])" in msg, msg
        assert r["params"] == 2 + 1, r  # embed/head tied (1), mid weight and bias (2)
        assert r["max_diff"] == 0.0, r
