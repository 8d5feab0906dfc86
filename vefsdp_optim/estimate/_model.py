"""The transformers of the memory estimate: the parameter shapes, names and parallel plan
of torchtitan's llama3 (``torchtitan/models/llama3``) and the layout of its deepseek_v3 and
qwen3 MoE models, written out here so that an estimate needs neither torchtitan nor a
download. Only shapes and the ops that make activations matter on fake tensors; the
arithmetic is a plain pre-norm decoder (_layers.py)."""

from __future__ import annotations

import torch
from torch import nn

from ._config import ModelConfig
from ._layers import Attention, FeedForward, LatentAttention, MoE, rope_table

__all__ = ["Transformer", "tp_plan", "tp_plan_root"]


class TransformerBlock(nn.Module):
    """Pre-norm attention and MLP: torchtitan's llama3 block, or its deepseek_v3 / qwen3
    block (latent or normed attention; a mixture of experts, ``moe``, in place of the
    dense ``feed_forward`` past the first ``n_dense_layers``)."""

    def __init__(self, cfg: ModelConfig, i: int) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim)
        self.attention = LatentAttention(cfg) if cfg.kv_lora_rank else Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim)
        if cfg.is_moe_layer(i):
            self.moe = MoE(cfg)
        else:
            self.feed_forward = FeedForward(cfg.dim, cfg.hidden_dim)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), freqs_cis)
        mlp = self.moe if hasattr(self, "moe") else self.feed_forward
        return x + mlp(self.ffn_norm(x))


class Transformer(nn.Module):
    """torchtitan's ``Transformer`` (llama3, deepseek_v3, qwen3): its parameter names and
    shapes, and its rotary table ``freqs_cis``, a buffer of ``max_seq_len`` rows."""

    def __init__(self, cfg: ModelConfig, max_seq_len: int = 2048) -> None:
        super().__init__()
        self.cfg, self.max_seq_len = cfg, max_seq_len
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.register_buffer("freqs_cis", rope_table(max_seq_len, self._rope_dim()),
                             persistent=True)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i) for i in range(cfg.n_layers)})
        self.norm = nn.RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def _rope_dim(self) -> int:
        return self.cfg.qk_rope_head_dim if self.cfg.kv_lora_rank else self.cfg.head_dim

    def init_buffers(self) -> None:
        """The rotary table's values, after ``to_empty``."""
        with torch.no_grad():
            table = rope_table(self.max_seq_len, self._rope_dim(), self.freqs_cis.device)
            self.freqs_cis.copy_(table)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


def tp_plan() -> dict[str, object]:
    """Each block's tensor-parallel plan, torchtitan's (without sequence parallel):
    column-parallel q, k, v, w1, w3 and row-parallel wo, w2."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }


def tp_plan_root() -> dict[str, object]:
    """The root's tensor-parallel plan, torchtitan's without loss parallel: the embedding
    row-parallel, the output head column-parallel with its logits gathered."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
        "output": ColwiseParallel(output_layouts=Replicate()),
    }
