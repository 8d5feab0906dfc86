"""The toy GPTs: a pre-norm decoder, and one with a fused GQA projection and MoE blocks."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TinyGPT", "TinyMoEGPT"]


# -- models -------------------------------------------------------------------------------


class _Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, D // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, D))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """Pre-norm decoder-only transformer; ``layers`` are the fully_shard units."""

    def __init__(self, vocab: int, seq: int, d: int, n_layers: int, heads: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos_embed = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.layers = nn.ModuleList([_Block(d, heads) for _ in range(n_layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) + self.pos_embed[: idx.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln_f(x))


class _MoEBlock(nn.Module):
    """Pre-norm block: grouped-query attention with one fused QKV projection (Q, K and V
    row blocks of unequal size) and a top-2 mixture of experts whose weights are 3-D
    ``[experts, out, in]`` tensors (computed densely: every expert on every token)."""

    def __init__(self, d: int, heads: int, kv_heads: int, experts: int, d_ff: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, d // heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, d + 2 * kv_heads * self.hd)  # rows: [q | k | v]
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.router = nn.Linear(d, experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(experts, d_ff, d) / math.sqrt(d))
        self.w_out = nn.Parameter(torch.randn(experts, d, d_ff) / math.sqrt(d_ff))

    @property
    def split_sizes(self) -> list[int]:
        kv = self.kv_heads * self.hd
        return [self.heads * self.hd, kv, kv]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(self.split_sizes, dim=-1)
        q = q.view(B, T, self.heads, self.hd).transpose(1, 2)
        rep = self.heads // self.kv_heads
        k = k.view(B, T, self.kv_heads, self.hd).transpose(1, 2).repeat_interleave(rep, dim=1)
        v = v.view(B, T, self.kv_heads, self.hd).transpose(1, 2).repeat_interleave(rep, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, D))
        h = self.ln2(x)
        gates = self.router(h).softmax(-1)  # (B, T, E)
        top, idx = gates.topk(2, dim=-1)
        weight = torch.zeros_like(gates).scatter(-1, idx, top / top.sum(-1, keepdim=True))
        inner = F.gelu(torch.einsum("btd,efd->btef", h, self.w_in))
        out = torch.einsum("btef,edf->bted", inner, self.w_out)
        return x + (out * weight.unsqueeze(-1)).sum(2)


class TinyMoEGPT(nn.Module):
    """TinyGPT with grouped-query attention (fused QKV) and MoE feed-forward blocks.

    ``muon_group_keys(name)`` names Muon's block structure for a parameter: experts as
    a batch of matrices (``flatten=False``), the fused QKV weight as Q, K and V row
    blocks (``split_sizes``).
    """

    def __init__(self, vocab: int, seq: int, d: int, n_layers: int, heads: int, kv_heads: int,
                 experts: int, d_ff: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos_embed = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.layers = nn.ModuleList([_MoEBlock(d, heads, kv_heads, experts, d_ff) for _ in range(n_layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def muon_group_keys(self, name: str) -> dict[str, object]:
        if name.endswith(("w_in", "w_out")):
            return {"flatten": False}
        if name.endswith("qkv.weight"):
            return {"split_sizes": self.layers[0].split_sizes}
        return {}

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) + self.pos_embed[: idx.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln_f(x))
