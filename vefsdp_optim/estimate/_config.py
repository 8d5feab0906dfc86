"""The model configurations the estimate builds: LLaMA-3 (torchtitan's llama3 flavors), and
mixture-of-experts models (DeepSeek-V3 with its latent attention, Qwen3-MoE, Mixtral), from
built-in flavors or a Hugging Face ``config.json``. Only shapes matter on fake tensors."""

from __future__ import annotations

import dataclasses
import math

__all__ = ["CONFIGS", "ModelConfig", "check_config", "config_from_dict"]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder's shapes, torchtitan's field names (``TransformerModelArgs``).

    Dense LLaMA-3 sets the first seven fields. A mixture-of-experts model sets
    ``n_experts`` (routed experts per MoE layer, ``top_k`` of them per token, each an MLP
    of width ``moe_hidden_dim``), ``n_shared_experts`` (experts every token takes, fused
    into one MLP of ``n_shared_experts * moe_hidden_dim``) and ``n_dense_layers`` (the first
    layers keep a dense MLP of ``hidden_dim``: DeepSeek's ``first_k_dense_replace``).
    ``kv_lora_rank > 0`` selects DeepSeek's multi-head latent attention (``q_lora_rank``
    0: a plain query projection). ``attn_head_dim`` is a head size other than
    ``dim / n_heads`` (Qwen3's ``head_dim``); ``qk_norm`` an RMSNorm of each query and key
    head (Qwen3)."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int = 128256
    ffn_dim_multiplier: float | None = None
    multiple_of: int = 256
    ffn_dim: int | None = None  # the MLP's width where a config gives it (HF's intermediate_size)
    attn_head_dim: int | None = None
    qk_norm: bool = False
    n_experts: int = 0
    top_k: int = 0
    moe_hidden_dim: int = 0
    n_shared_experts: int = 0
    n_dense_layers: int = 0
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self) -> None:
        if self.n_experts and not (0 < self.top_k <= self.n_experts and self.moe_hidden_dim > 0):
            raise ValueError(
                f"a mixture of {self.n_experts} experts needs 0 < top_k <= n_experts and "
                f"moe_hidden_dim > 0, got top_k={self.top_k}, moe_hidden_dim={self.moe_hidden_dim}"
            )
        if not 0 <= self.n_dense_layers <= self.n_layers:
            raise ValueError(
                f"n_dense_layers={self.n_dense_layers} must be in [0, n_layers={self.n_layers}]"
            )
        if (
            self.kv_lora_rank
            and min(self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim) <= 0
        ):
            raise ValueError(
                "latent attention (kv_lora_rank > 0) needs qk_nope_head_dim, qk_rope_head_dim "
                "and v_head_dim > 0"
            )

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim or self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        """The dense MLP's width: ``ffn_dim`` where given, else as torchtitan's FeedForward
        computes it."""
        if self.ffn_dim is not None:
            return self.ffn_dim
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    def is_moe_layer(self, i: int) -> bool:
        return self.is_moe and i >= self.n_dense_layers

    def attention_params(self) -> int:
        d, h = self.dim, self.n_heads
        if self.kv_lora_rank:  # latent attention
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = (
                d * h * qk
                if not self.q_lora_rank
                else d * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * h * qk
            )
            kv = d * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
            kv += self.kv_lora_rank * h * (self.qk_nope_head_dim + self.v_head_dim)
            return q + kv + h * self.v_head_dim * d
        hd, kv = self.head_dim, self.n_kv_heads * self.head_dim
        return 2 * d * h * hd + 2 * d * kv + (2 * hd if self.qk_norm else 0)

    def num_params(self) -> int:
        d = self.dim
        dense_mlp = 3 * d * self.hidden_dim
        moe_mlp = (
            self.n_experts * 3 * d * self.moe_hidden_dim
            + self.n_experts * d
            + 3 * d * self.moe_hidden_dim * self.n_shared_experts
        )
        layers = sum(
            self.attention_params() + 2 * d + (moe_mlp if self.is_moe_layer(i) else dense_mlp)
            for i in range(self.n_layers)
        )
        return layers + 2 * self.vocab_size * d + d


# torchtitan's llama3 flavors (torchtitan/models/llama3/__init__.py); DeepSeek-V3 671B and
# Qwen3-30B-A3B as published in their config.json; and two small ones
CONFIGS: dict[str, ModelConfig] = {
    "debug": ModelConfig(dim=256, n_layers=2, n_heads=16, n_kv_heads=4, vocab_size=2048),
    "debug-moe": ModelConfig(
        dim=128,
        n_layers=2,
        n_heads=4,
        n_kv_heads=4,
        vocab_size=1024,
        ffn_dim=384,
        n_experts=8,
        top_k=2,
        moe_hidden_dim=96,
        n_shared_experts=1,
        n_dense_layers=1,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
    ),
    "llama3-8b": ModelConfig(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=1024
    ),
    "llama3-70b": ModelConfig(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=4096
    ),
    "llama3-405b": ModelConfig(
        dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim_multiplier=1.2, multiple_of=4096
    ),
    "deepseek-v3-671b": ModelConfig(
        dim=7168,
        n_layers=61,
        n_heads=128,
        n_kv_heads=128,
        vocab_size=129280,
        ffn_dim=18432,
        n_experts=256,
        top_k=8,
        moe_hidden_dim=2048,
        n_shared_experts=1,
        n_dense_layers=3,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
    ),
    "qwen3-moe-30b-a3b": ModelConfig(
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        vocab_size=151936,
        ffn_dim=6144,
        attn_head_dim=128,
        qk_norm=True,
        n_experts=128,
        top_k=8,
        moe_hidden_dim=768,
    ),
}


def check_config(cfg: ModelConfig, tp: int, ep: int = 1, dp_shard: int = 1) -> None:
    """The mesh fits the model: tp divides the heads and the MLP; ep divides the experts
    and the data-parallel shards; experts are not tensor parallel here."""
    if cfg.n_kv_heads % tp or cfg.n_heads % tp:
        raise ValueError(
            f"tp={tp} must divide the heads ({cfg.n_heads}) and the kv heads ({cfg.n_kv_heads})"
        )
    if math.gcd(cfg.hidden_dim, tp) != tp:
        raise ValueError(f"tp={tp} must divide the MLP width {cfg.hidden_dim}")
    if cfg.is_moe and tp > 1:
        raise NotImplementedError(
            f"tp={tp} with a mixture of experts is not modeled (the experts would need "
            "their own tensor-parallel plan); accepted: tp 1 with ep and dp"
        )
    if cfg.kv_lora_rank and tp > 1:
        raise NotImplementedError(f"tp={tp} with latent attention is not modeled; accepted: tp 1")
    if ep < 1:
        raise ValueError(f"ep must be >= 1, got {ep}")
    if ep > 1:
        if not cfg.is_moe:
            raise ValueError(f"ep={ep} needs a mixture-of-experts model; this one is dense")
        if cfg.n_experts % ep or dp_shard % ep:
            raise ValueError(
                f"ep={ep} must divide the experts ({cfg.n_experts}) and the data-parallel shards "
                f"of one replica ({dp_shard}): expert parallelism borrows its ranks from them"
            )


# torchtitan's TransformerModelArgs fields that do not change a parameter's shape
_TITAN_SHAPELESS = {
    "norm_eps",
    "rope_theta",
    "rope_scaling_args",
    "max_seq_len",
    "depth_init",
    "use_flex_attn",
    "attn_mask_type",
    "eos_id",
    "attn_type",
}
_TITAN_FIELDS = {
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "vocab_size",
    "ffn_dim_multiplier",
    "multiple_of",
}
_HF_LLAMA_TYPES = ("llama", "mistral")
_HF_MOE_TYPES = ("deepseek_v3", "qwen3_moe", "mixtral")
_HF_MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")


def _hf_common(d: dict) -> dict:
    for key in ("tie_word_embeddings", "attention_bias", "mlp_bias"):
        if d.get(key):
            raise NotImplementedError(
                f"{key}=true is not modeled (the estimate's model has an untied "
                "output head and no biases)"
            )
    if d.get("hidden_act", "silu") != "silu":
        raise NotImplementedError(
            f"hidden_act {d['hidden_act']!r} is not modeled; accepted: 'silu'"
        )
    heads = int(d["num_attention_heads"])
    return dict(
        dim=int(d["hidden_size"]),
        n_layers=int(d["num_hidden_layers"]),
        n_heads=heads,
        n_kv_heads=int(d.get("num_key_value_heads") or heads),
        vocab_size=int(d["vocab_size"]),
        ffn_dim=int(d["intermediate_size"]),
    )


def _hf_moe(d: dict, kind: str) -> ModelConfig:
    kw = _hf_common(d)
    if kind == "deepseek_v3":
        if d.get("moe_layer_freq", 1) != 1:
            raise NotImplementedError(
                f"moe_layer_freq {d['moe_layer_freq']} is not modeled; accepted: 1"
            )
        return ModelConfig(
            **kw,
            n_experts=int(d["n_routed_experts"]),
            top_k=int(d["num_experts_per_tok"]),
            moe_hidden_dim=int(d["moe_intermediate_size"]),
            n_shared_experts=int(d.get("n_shared_experts") or 0),
            n_dense_layers=int(d.get("first_k_dense_replace") or 0),
            q_lora_rank=int(d.get("q_lora_rank") or 0),
            kv_lora_rank=int(d["kv_lora_rank"]),
            qk_nope_head_dim=int(d["qk_nope_head_dim"]),
            qk_rope_head_dim=int(d["qk_rope_head_dim"]),
            v_head_dim=int(d["v_head_dim"]),
        )
    if kind == "qwen3_moe":
        if d.get("decoder_sparse_step", 1) != 1 or d.get("mlp_only_layers"):
            raise NotImplementedError(
                "decoder_sparse_step other than 1 and mlp_only_layers are not modeled; "
                "accepted: every layer a mixture of experts"
            )
        return ModelConfig(
            **kw,
            attn_head_dim=int(d.get("head_dim") or kw["dim"] // kw["n_heads"]),
            qk_norm=True,
            n_experts=int(d["num_experts"]),
            top_k=int(d["num_experts_per_tok"]),
            moe_hidden_dim=int(d["moe_intermediate_size"]),
        )
    # mixtral: every layer's MLP is the experts, intermediate_size wide
    if d.get("head_dim") not in (None, kw["dim"] // kw["n_heads"]):
        raise NotImplementedError(
            f"head_dim {d['head_dim']} is not modeled for mixtral; accepted: "
            f"hidden_size / num_attention_heads = {kw['dim'] // kw['n_heads']}"
        )
    return ModelConfig(
        **kw,
        n_experts=int(d["num_local_experts"]),
        top_k=int(d["num_experts_per_tok"]),
        moe_hidden_dim=kw["ffn_dim"],
    )


def config_from_dict(d: dict) -> ModelConfig:
    """A model from a Hugging Face ``config.json`` (``model_type`` llama or mistral, dense;
    deepseek_v3, qwen3_moe or mixtral, mixtures of experts) or from torchtitan's llama3
    ``TransformerModelArgs`` fields (``dim``, ``n_layers``, ``n_heads``, ``n_kv_heads``,
    ``vocab_size``, ``ffn_dim_multiplier``, ``multiple_of``). What this model does not have
    (tied embeddings, biases, another head size for a dense model) raises, naming the key:
    the estimate would be of another model."""
    if not isinstance(d, dict):
        raise TypeError(f"a model config must be a JSON object, got {type(d).__name__}")
    if "hidden_size" in d:  # Hugging Face
        kind = d.get("model_type")
        if kind in _HF_MOE_TYPES:
            return _hf_moe(d, kind)
        if kind not in _HF_LLAMA_TYPES:
            raise ValueError(
                f"model_type {kind!r} is not modeled; accepted: "
                f"{', '.join(_HF_LLAMA_TYPES + _HF_MOE_TYPES)} (or torchtitan's llama3 fields)"
            )
        moe = [k for k in _HF_MOE_KEYS if d.get(k)]
        if moe:
            raise NotImplementedError(
                f"mixture-of-experts configs ({', '.join(moe)}) of model_type {kind} are "
                f"not modeled; accepted mixtures of experts: {', '.join(_HF_MOE_TYPES)}"
            )
        kw = _hf_common(d)
        if d.get("head_dim") not in (None, kw["dim"] // kw["n_heads"]):
            raise NotImplementedError(
                f"head_dim {d['head_dim']} is not modeled; accepted: hidden_size / "
                f"num_attention_heads = {kw['dim'] // kw['n_heads']}"
            )
        return ModelConfig(**kw)
    unknown = sorted(set(d) - _TITAN_FIELDS - _TITAN_SHAPELESS)
    if unknown:
        raise ValueError(
            f"unknown model config keys {unknown}; accepted: a Hugging Face config.json "
            f"(hidden_size, ...) or torchtitan's fields {sorted(_TITAN_FIELDS)}"
        )
    missing = sorted({"dim", "n_layers", "n_heads"} - set(d))
    if missing:
        raise ValueError(f"model config lacks {missing}")
    kw = {k: d[k] for k in _TITAN_FIELDS if d.get(k) is not None}
    kw.setdefault("n_kv_heads", kw["n_heads"])
    return ModelConfig(**kw)
