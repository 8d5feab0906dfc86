"""LLaMA-3 shaped transformers for the memory estimate: the parameter shapes, names and
parallel plan of torchtitan's llama3 (``torchtitan/models/llama3``), written out here so
that an estimate needs neither torchtitan nor a download. Only shapes and the ops that
make activations matter on fake tensors; the arithmetic is a plain pre-norm decoder."""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

__all__ = ["CONFIGS", "ModelConfig", "Transformer", "check_config", "config_from_dict", "tp_plan", "tp_plan_root"]


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
    ffn_dim: int | None = None  # the MLP's width where a config gives it (HF's intermediate_size)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        """The MLP's width: ``ffn_dim`` where given, else as torchtitan's FeedForward
        computes it."""
        if self.ffn_dim is not None:
            return self.ffn_dim
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


# torchtitan's TransformerModelArgs fields that do not change a parameter's shape
_TITAN_SHAPELESS = {"norm_eps", "rope_theta", "rope_scaling_args", "max_seq_len", "depth_init", "use_flex_attn",
                    "attn_mask_type", "eos_id", "attn_type"}
_TITAN_FIELDS = {"dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim_multiplier", "multiple_of"}
_HF_LLAMA_TYPES = ("llama", "mistral")
_HF_MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")


def config_from_dict(d: dict) -> ModelConfig:
    """A model from a Hugging Face ``config.json`` of a LLaMA-shaped model (``model_type``
    llama or mistral: ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``,
    ``num_key_value_heads``, ``intermediate_size``, ``vocab_size``) or from torchtitan's
    llama3 ``TransformerModelArgs`` fields (``dim``, ``n_layers``, ``n_heads``,
    ``n_kv_heads``, ``vocab_size``, ``ffn_dim_multiplier``, ``multiple_of``). What this
    model does not have (tied embeddings, biases, another head size, experts) raises,
    naming the key: the estimate would be of another model."""
    if not isinstance(d, dict):
        raise TypeError(f"a model config must be a JSON object, got {type(d).__name__}")
    moe = [k for k in _HF_MOE_KEYS if d.get(k)]
    if moe:
        raise NotImplementedError(f"mixture-of-experts configs ({', '.join(moe)}) are not modeled yet; "
                                  "accepted: dense LLaMA-shaped models")
    if "hidden_size" in d:  # Hugging Face
        kind = d.get("model_type")
        if kind not in _HF_LLAMA_TYPES:
            raise ValueError(f"model_type {kind!r} is not modeled; accepted: {', '.join(_HF_LLAMA_TYPES)} "
                             "(or torchtitan's llama3 fields)")
        for key in ("tie_word_embeddings", "attention_bias", "mlp_bias"):
            if d.get(key):
                raise NotImplementedError(f"{key}=true is not modeled (the estimate's model has an untied "
                                          "output head and no biases)")
        if d.get("hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act {d['hidden_act']!r} is not modeled; accepted: 'silu'")
        dim, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
        if d.get("head_dim") not in (None, dim // heads):
            raise NotImplementedError(f"head_dim {d['head_dim']} is not modeled; accepted: hidden_size / "
                                      f"num_attention_heads = {dim // heads}")
        return ModelConfig(dim=dim, n_layers=int(d["num_hidden_layers"]), n_heads=heads,
                           n_kv_heads=int(d.get("num_key_value_heads") or heads), vocab_size=int(d["vocab_size"]),
                           ffn_dim=int(d["intermediate_size"]))
    unknown = sorted(set(d) - _TITAN_FIELDS - _TITAN_SHAPELESS)
    if unknown:
        raise ValueError(f"unknown model config keys {unknown}; accepted: a Hugging Face config.json "
                         f"(hidden_size, ...) or torchtitan's fields {sorted(_TITAN_FIELDS)}")
    missing = sorted({"dim", "n_layers", "n_heads"} - set(d))
    if missing:
        raise ValueError(f"model config lacks {missing}")
    kw = {k: d[k] for k in _TITAN_FIELDS if d.get(k) is not None}
    kw.setdefault("n_kv_heads", kw["n_heads"])
    return ModelConfig(**kw)
