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


class _ToEP(torch.autograd.Function):
    """Enter the expert-parallel region: the input as it is; its gradient summed over the
    ep ranks, each of which back-propagated through its own experts only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: object) -> torch.Tensor:  # noqa: ANN001
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        import torch.distributed as dist

        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _FromEP(torch.autograd.Function):
    """Leave the expert-parallel region: the ep ranks' partial sums added (all-reduce);
    the gradient as it is, since every ep rank holds the same tokens and the same loss."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: object) -> torch.Tensor:  # noqa: ANN001
        import torch.distributed as dist

        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        return grad, None


class _Experts(nn.Module):
    """Stacked expert weights ``[experts, out, in]``, every expert run on every token and
    weighted by its gate (zero outside the top 2). As DTensors sharded over an ``ep``
    mesh (expert parallel), each rank runs its own experts on every token and the
    partial sums are added over ``ep`` (see vefsdp_optim/toy/_moe_ep.py)."""

    def __init__(self, d: int, experts: int, d_ff: int) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(experts, d_ff, d) / math.sqrt(d))
        self.w_out = nn.Parameter(torch.randn(experts, d, d_ff) / math.sqrt(d_ff))

    def forward(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        w_in, w_out, group = self.w_in, self.w_out, None
        if isinstance(w_in, DTensor):  # expert parallel: this ep rank's experts
            from vefsdp_optim.comm import dtensor_boxes

            mesh = w_in.device_mesh
            boxes, _ = dtensor_boxes(mesh, tuple(w_in.placements), tuple(w_in.shape))
            first = boxes.boxes[mesh.get_local_rank(0)].offsets[0]
            w_in, w_out, group = w_in.to_local(), w_out.to_local(), mesh.get_group(0)
            h, weight = _ToEP.apply(h, group), _ToEP.apply(weight, group)
            weight = weight[..., first:first + w_in.shape[0]]
        inner = F.gelu(torch.einsum("btd,efd->btef", h, w_in))
        out = (torch.einsum("btef,edf->bted", inner, w_out) * weight.unsqueeze(-1)).sum(2)
        return out if group is None else _FromEP.apply(out, group)


class _MoEBlock(nn.Module):
    """Pre-norm block: grouped-query attention with one fused QKV projection (Q, K and V
    row blocks of unequal size) and a top-2 mixture of experts whose weights are 3-D
    ``[experts, out, in]`` tensors (computed densely: every expert on every token).
    With ``track_max_logits`` set, each forward leaves the largest pre-softmax logit of
    each query head in ``max_logits`` ``(heads,)``, for QK-clip."""

    def __init__(self, d: int, heads: int, kv_heads: int, experts: int, d_ff: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, d // heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, d + 2 * kv_heads * self.hd)  # rows: [q | k | v]
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.router = nn.Linear(d, experts, bias=False)
        self.experts = _Experts(d, experts, d_ff)
        self.track_max_logits = False
        self.max_logits: torch.Tensor | None = None  # (heads,) of the last forward

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
        if self.track_max_logits:
            with torch.no_grad():  # the logits SDPA computes: q k^T / sqrt(hd), causal
                s = (q @ k.transpose(-2, -1)) / math.sqrt(self.hd)
                causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
                s = s.masked_fill(~causal, float("-inf"))
                self.max_logits = s.amax(dim=(0, 2, 3))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, D))
        h = self.ln2(x)
        gates = self.router(h).softmax(-1)  # (B, T, E)
        top, idx = gates.topk(2, dim=-1)
        weight = torch.zeros_like(gates).scatter(-1, idx, top / top.sum(-1, keepdim=True))
        return x + self.experts(h, weight)


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
        self.layers = nn.ModuleList([_MoEBlock(d, heads, kv_heads, experts, d_ff)
                                     for _ in range(n_layers)])
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
