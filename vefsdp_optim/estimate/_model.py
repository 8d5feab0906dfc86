"""LLaMA-3 shaped transformers for the memory estimate: the parameter shapes, names and
parallel plan of torchtitan's llama3 (``torchtitan/models/llama3``), written out here so
that an estimate needs neither torchtitan nor a download. Only shapes and the ops that
make activations matter on fake tensors; the arithmetic is a plain pre-norm decoder."""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

__all__ = ["CONFIGS", "ModelConfig", "Transformer", "check_config", "tp_plan", "tp_plan_root"]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A LLaMA-3 configuration, torchtitan's field names (``TransformerModelArgs``)."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int = 128256
    ffn_dim_multiplier: float | None = None
    multiple_of: int = 256

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        """The MLP's width, as torchtitan's FeedForward computes it."""
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def num_params(self) -> int:
        d, h, kv = self.dim, self.hidden_dim, self.n_kv_heads * self.head_dim
        layer = d * d * 2 + d * kv * 2 + 3 * d * h + 2 * d
        return self.n_layers * layer + 2 * self.vocab_size * d + d


# torchtitan's llama3 flavors (torchtitan/models/llama3/__init__.py), and a small one
CONFIGS: dict[str, ModelConfig] = {
    "debug": ModelConfig(dim=256, n_layers=2, n_heads=16, n_kv_heads=4, vocab_size=2048),
    "llama3-8b": ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3,
                             multiple_of=1024),
    "llama3-70b": ModelConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3,
                              multiple_of=4096),
    "llama3-405b": ModelConfig(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim_multiplier=1.2,
                               multiple_of=4096),
}


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.rep = cfg.n_heads // cfg.n_kv_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: the local heads under tensor parallelism (column-parallel projections)
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k, v = k.repeat_interleave(self.rep, dim=1), v.repeat_interleave(self.rep, dim=1)
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """torchtitan's llama3 ``Transformer``: its parameter names and shapes."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(cfg.n_layers)})
        self.norm = nn.RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


def tp_plan() -> dict[str, object]:
    """Each block's tensor-parallel plan, torchtitan's (without sequence parallel):
    column-parallel q, k, v, w1, w3 and row-parallel wo, w2."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel()}


def tp_plan_root() -> dict[str, object]:
    """The root's tensor-parallel plan, torchtitan's without loss parallel: the embedding
    row-parallel, the output head column-parallel with its logits gathered."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Replicate())}


def check_config(cfg: ModelConfig, tp: int) -> None:
    if cfg.n_kv_heads % tp or cfg.n_heads % tp:
        raise ValueError(f"tp={tp} must divide the heads ({cfg.n_heads}) and the kv heads ({cfg.n_kv_heads})")
    if math.gcd(cfg.hidden_dim, tp) != tp:
        raise ValueError(f"tp={tp} must divide the MLP width {cfg.hidden_dim}")
