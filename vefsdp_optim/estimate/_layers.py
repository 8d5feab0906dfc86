"""The layers of the estimate's models, with torchtitan's parameter names: grouped-query
attention (LLaMA-3, Qwen3 with its query and key norms), DeepSeek-V3's latent attention,
the SwiGLU MLP and the mixture of experts (a router, grouped experts, shared experts).

Only shapes and the ops that make activations matter on fake tensors: positions are
rotated as torchtitan rotates them (complex pairs in float32), and the experts' dispatch is
static. Each token's ``top_k`` (token, expert) pairs
are sorted by expert; with expert parallelism (the experts a DTensor ``Shard(0)`` over an
``ep`` mesh) they go to the ep ranks in one all-to-all of equal splits and come back in a
second, as a balanced router sends them, ``capacity_factor`` times that many rows each (the
buffers of a dropless dispatch of balanced load at 1.0; above it, the headroom an
imbalanced router needs). Each rank's experts run as one batched product over equal rows."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from .._torch_compat import all_to_all_autograd, view_base
from ._config import ModelConfig

__all__ = ["Attention", "FeedForward", "GroupedExperts", "LatentAttention", "MoE", "rope_table",
           "rotary"]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.rep = cfg.n_heads // cfg.n_kv_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        if cfg.qk_norm:  # Qwen3: each query and key head normalized
            self.q_norm = nn.RMSNorm(cfg.head_dim)
            self.k_norm = nn.RMSNorm(cfg.head_dim)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: the local heads under tensor parallelism (column-parallel projections)
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(q, freqs_cis), rotary(k, freqs_cis)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        # grouped-query attention without repeating the keys and values (torchtitan's sdpa)
        out = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
            enable_gqa=self.rep > 1)
        return self.wo(out.transpose(1, 2).contiguous().view(b, s, -1))


def rope_table(seq: int, dim: int, device: torch.device | str | None = None) -> torch.Tensor:
    """torchtitan's ``freqs_cis``: (seq, dim // 2) complex64 rotations (theta 500,000)."""
    inv = 1.0 / (500000.0 ** (torch.arange(0, dim, 2, device=device)[: dim // 2].float() / dim))
    freqs = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv)
    return torch.polar(torch.ones_like(freqs), freqs)


def rotary(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """torchtitan's ``apply_rotary_emb`` on one tensor (b, s, heads, dim): in float32 as
    complex pairs, back to ``x``'s dtype."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    f = freqs_cis[: x.shape[1]].view(1, x.shape[1], 1, -1)
    return torch.view_as_real(xc * f).flatten(3).type_as(x)


class LatentAttention(nn.Module):
    """DeepSeek-V3's multi-head latent attention (torchtitan's deepseek_v3 names): the
    query through a rank-``q_lora_rank`` bottleneck (or one projection at 0), keys and
    values from one rank-``kv_lora_rank`` latent plus a shared rotary key part."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, qk = cfg.n_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        self.n_heads, self.qk, self.nope, self.rope = (
            h,
            qk,
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
        )
        self.kv_rank, self.v_dim = cfg.kv_lora_rank, cfg.v_head_dim
        if cfg.q_lora_rank:
            self.wq_a = nn.Linear(cfg.dim, cfg.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(cfg.q_lora_rank)
            self.wq_b = nn.Linear(cfg.q_lora_rank, h * qk, bias=False)
        else:
            self.wq = nn.Linear(cfg.dim, h * qk, bias=False)
        self.wkv_a = nn.Linear(cfg.dim, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(cfg.kv_lora_rank)
        self.wkv_b = nn.Linear(
            cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False
        )
        self.wo = nn.Linear(h * cfg.v_head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq_b(self.q_norm(self.wq_a(x))) if hasattr(self, "wq_a") else self.wq(x)
        q_nope, q_pe = q.view(b, s, self.n_heads, self.qk).split([self.nope, self.rope], dim=-1)
        q = torch.cat([q_nope, rotary(q_pe, freqs_cis)], dim=-1).transpose(1, 2)
        kv, k_pe = self.wkv_a(x).split([self.kv_rank, self.rope], dim=-1)
        k_pe = rotary(k_pe.unsqueeze(2), freqs_cis)
        kv = self.wkv_b(self.kv_norm(kv)).view(b, s, self.n_heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(b, s, self.n_heads, self.rope)], dim=-1)
        if (
            self.v_dim < self.qk
        ):  # values padded to the key size, as flash attention kernels take them
            v = nn.functional.pad(v, (0, self.qk - self.v_dim))
        out = nn.functional.scaled_dot_product_attention(
            q, k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out[..., : self.v_dim].transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t``'s first ``n`` rows, zero rows appended where it has fewer."""
    if t.shape[0] == n:
        return t
    if t.shape[0] > n:
        return t[:n]
    return torch.cat([t, t.new_zeros(n - t.shape[0], *t.shape[1:])])


class GroupedExperts(nn.Module):
    """``n`` SwiGLU experts as stacked weights ``w1, w3`` (n, hidden, dim) and ``w2``
    (n, dim, hidden), torchtitan's ``GroupedExperts``."""

    def __init__(self, dim: int, hidden: int, n: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n, hidden, dim))
        self.capacity_factor = 1.0

    def forward(self, routed: torch.Tensor) -> torch.Tensor:
        """``routed``: this rank's (token, expert) pairs sorted by expert, (pairs, dim)."""
        from torch.distributed.tensor import DTensor

        w1, w2, w3, group, ep = self.w1, self.w2, self.w3, None, 1
        if isinstance(w1, DTensor):  # expert parallel: this ep rank's experts
            group = w1.device_mesh.get_group()
            ep = w1.device_mesh.size()
            w1, w2, w3 = w1.to_local(), w2.to_local(), w3.to_local()
        pairs, dim = routed.shape
        cap = math.ceil(pairs * self.capacity_factor / ep)  # rows to each ep rank
        recv = _rows(routed, ep * cap)
        if ep > 1:
            recv = _all_to_all(recv, ep, group)
        n_local = w1.shape[0]
        per = math.ceil(recv.shape[0] / n_local)
        xs = _rows(recv, n_local * per).view(n_local, per, dim)
        h = nn.functional.silu(torch.bmm(xs, w1.mT.to(xs.dtype))) * torch.bmm(
            xs, w3.mT.to(xs.dtype)
        )
        ys = torch.bmm(h, w2.mT.to(xs.dtype)).reshape(-1, dim)[: recv.shape[0]]
        if ep > 1:
            ys = _all_to_all(ys, ep, group)
        out = _rows(ys, pairs)
        # not a view: FSDP's hooks on a wrapped module's output (ep > 1) would be lost to one
        return out.clone() if view_base(out) is not None and ep > 1 else out


def _all_to_all(t: torch.Tensor, ep: int, group: Any) -> torch.Tensor:
    return all_to_all_autograd(t.contiguous(), [t.shape[0] // ep] * ep, group)


class Router(nn.Module):
    def __init__(self, dim: int, n_experts: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, n_experts, bias=False)


class MoE(nn.Module):
    """A router choosing ``top_k`` of ``n_experts`` per token, the grouped experts, and the
    shared experts every token takes (torchtitan's ``MoE``)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.router = Router(cfg.dim, cfg.n_experts)
        self.experts = GroupedExperts(cfg.dim, cfg.moe_hidden_dim, cfg.n_experts)
        if cfg.n_shared_experts:
            self.shared_experts = FeedForward(cfg.dim, cfg.moe_hidden_dim * cfg.n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        x = x.reshape(-1, d)
        weights, idx = torch.sigmoid(self.router.gate(x).float()).topk(self.top_k, dim=-1)
        order = idx.flatten().argsort(stable=True)  # the (token, choice) pairs by expert
        token = order // self.top_k
        y = self.experts(x[token]) * weights.flatten()[order].unsqueeze(-1).to(x.dtype)
        out = torch.zeros_like(x).index_add_(0, token, y)
        if hasattr(self, "shared_experts"):
            out = out + self.shared_experts(x)
        return out.view(b, s, d)
