"""The harness of the fully_shard parity tests (tests/test_fully_shard.py and
tests/test_dp_mesh_dims.py): the models, training, and the comparison."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

RTOL, ATOL = 1e-6, 1e-7


class Block(nn.Module):
    def __init__(self, d: int = 12, heads: int = 2, hidden: int = 19) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d, bias=False)
        self.norm2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class Transformer(nn.Module):
    def __init__(self, vocab: int = 23, d: int = 12, n: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, vocab)

    def forward(self, tok: torch.Tensor) -> torch.Tensor:
        x = self.emb(tok)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class OddMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(7, 13)
        self.l2 = nn.Linear(13, 5, bias=False)
        self.scale = nn.Parameter(torch.randn(1, 5))
        self.l3 = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l3(torch.tanh(self.l2(torch.relu(self.l1(x)))) * self.scale)


def _build(kind: str) -> tuple[nn.Module, list[nn.Module], torch.Tensor]:
    torch.manual_seed(1)
    if kind == "transformer":
        m = Transformer()
        data = torch.randint(0, 23, (4, 2, 6))
        return m, list(m.blocks), data
    m = OddMLP()
    data = torch.randn(4, 3, 7)
    return m, [m.l1, m.l2], data


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().square().mean()


def _train(model: nn.Module, data: torch.Tensor, steps: int, accum: int = 1, clip: float | None = None,
           foreach: bool | None = None, fsdp_model: nn.Module | None = None,
           average_over: int = 1) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=foreach)
    for s in range(steps):
        for k in range(accum):
            if fsdp_model is not None:
                fsdp_model.set_requires_gradient_sync(k == accum - 1)
            _loss(model, data[(s * accum + k) % data.shape[0]]).backward()
        if average_over > 1:
            _average_like_ranks(model, average_over)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()


def _average_like_ranks(model: nn.Module, w: int) -> None:
    """Round each gradient as the average of w identical ranks' gradients does.

    AdamW turns a gradient that is zero in exact arithmetic (the key bias of attention)
    into a unit step, so the ulp-level rounding of (g + ... + g) / w must be modelled.
    """
    for p in model.parameters():
        if p.grad is not None:
            s = p.grad.clone()
            for _ in range(w - 1):
                s = s + p.grad
            p.grad = s / w


def _full(model: nn.Module) -> list[torch.Tensor]:
    out = []
    for p in model.parameters():
        out.append(p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone())
    return out


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[float]:
    """Max relative error per parameter (raises on shape mismatch)."""
    errs = []
    for x, y in zip(a, b, strict=True):
        assert x.shape == y.shape, (x.shape, y.shape)
        errs.append(((x - y).abs().max() / (y.abs().max() + ATOL)).item())
    return errs
