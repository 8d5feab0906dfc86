"""Parameter shapes of real models, from their public configs, grouped as fully_shard would.

Each group is a list of ``ParamShape(name, shape, matrix)``: ``matrix`` is True for
weights a matrix optimizer (Muon, Shampoo) works on, False for vectors (norms, biases,
attention sinks), which stay elementwise. Mixture-of-experts weights stored as 3-D
``(experts, rows, cols)`` tensors (GPT-OSS, as in the public HF implementation) are a
batch of matrices: see ``unit_for``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

__all__ = [
    "ParamShape",
    "UNIT_KINDS",
    "unit_for",
    "llama3_70b_layer",
    "llama3_70b_embedding",
    "llama3_70b_head",
    "llama3_70b_model",
    "gpt_oss_120b_layer",
    "deepseek_v3_moe_layer",
    "GROUPS",
]


class ParamShape(NamedTuple):
    name: str
    shape: tuple[int, ...]
    matrix: bool


# LLaMA-3-70B (meta-llama/Meta-Llama-3-70B config.json)
_L3 = dict(hidden=8192, inter=28672, heads=64, kv_heads=8, head_dim=128, vocab=128256, layers=80)


def llama3_70b_layer(i: int = 0) -> list[ParamShape]:
    h, f, d = _L3["hidden"], _L3["inter"], _L3["head_dim"]
    q, kv = _L3["heads"] * d, _L3["kv_heads"] * d
    p = f"layers.{i}."
    return [
        ParamShape(p + "input_layernorm.weight", (h,), False),
        ParamShape(p + "self_attn.q_proj.weight", (q, h), True),
        ParamShape(p + "self_attn.k_proj.weight", (kv, h), True),
        ParamShape(p + "self_attn.v_proj.weight", (kv, h), True),
        ParamShape(p + "self_attn.o_proj.weight", (h, q), True),
        ParamShape(p + "post_attention_layernorm.weight", (h,), False),
        ParamShape(p + "mlp.gate_proj.weight", (f, h), True),
        ParamShape(p + "mlp.up_proj.weight", (f, h), True),
        ParamShape(p + "mlp.down_proj.weight", (h, f), True),
    ]


def llama3_70b_embedding() -> list[ParamShape]:
    return [ParamShape("embed_tokens.weight", (_L3["vocab"], _L3["hidden"]), True)]


def llama3_70b_head() -> list[ParamShape]:
    """The root group: final norm and the untied output projection."""
    return [
        ParamShape("norm.weight", (_L3["hidden"],), False),
        ParamShape("lm_head.weight", (_L3["vocab"], _L3["hidden"]), True),
    ]


def llama3_70b_model() -> list[list[ParamShape]]:
    """80 layer groups, the embedding and the head: one group per fully_shard call."""
    return [llama3_70b_embedding(), *(llama3_70b_layer(i) for i in range(_L3["layers"])),
            llama3_70b_head()]


# GPT-OSS-120B (openai/gpt-oss-120b config.json; HF GptOssDecoderLayer)
_OSS = dict(hidden=2880, experts=128, inter=2880, heads=64, kv_heads=8, head_dim=64)


def gpt_oss_120b_layer(i: int = 0) -> list[ParamShape]:
    h, e, f, d = _OSS["hidden"], _OSS["experts"], _OSS["inter"], _OSS["head_dim"]
    q, kv = _OSS["heads"] * d, _OSS["kv_heads"] * d
    p = f"layers.{i}."
    a = p + "self_attn."
    x = p + "mlp.experts."
    return [
        ParamShape(p + "input_layernorm.weight", (h,), False),
        ParamShape(a + "q_proj.weight", (q, h), True),
        ParamShape(a + "q_proj.bias", (q,), False),
        ParamShape(a + "k_proj.weight", (kv, h), True),
        ParamShape(a + "k_proj.bias", (kv,), False),
        ParamShape(a + "v_proj.weight", (kv, h), True),
        ParamShape(a + "v_proj.bias", (kv,), False),
        ParamShape(a + "o_proj.weight", (h, q), True),
        ParamShape(a + "o_proj.bias", (h,), False),
        ParamShape(a + "sinks", (_OSS["heads"],), False),
        ParamShape(p + "post_attention_layernorm.weight", (h,), False),
        ParamShape(p + "mlp.router.weight", (e, h), True),
        ParamShape(p + "mlp.router.bias", (e,), False),
        ParamShape(x + "gate_up_proj", (e, h, 2 * f), True),
        ParamShape(x + "gate_up_proj_bias", (e, 2 * f), False),
        ParamShape(x + "down_proj", (e, f, h), True),
        ParamShape(x + "down_proj_bias", (e, h), False),
    ]


# DeepSeek-V3 (deepseek-ai/DeepSeek-V3 config.json; MLA attention, 256 routed experts +
# 1 shared, routed experts as separate 2-D weights as in its modeling_deepseek.py)
_DS = dict(hidden=7168, heads=128, q_lora=1536, kv_lora=512, rope=64, nope=128, v_head=128,
           experts=256, moe_inter=2048, shared=1)


def deepseek_v3_moe_layer(i: int = 3) -> list[ParamShape]:
    h, n = _DS["hidden"], _DS["heads"]
    qk = _DS["nope"] + _DS["rope"]
    f = _DS["moe_inter"]
    p = f"layers.{i}."
    a = p + "self_attn."
    out = [
        ParamShape(p + "input_layernorm.weight", (h,), False),
        ParamShape(a + "q_a_proj.weight", (_DS["q_lora"], h), True),
        ParamShape(a + "q_a_layernorm.weight", (_DS["q_lora"],), False),
        ParamShape(a + "q_b_proj.weight", (n * qk, _DS["q_lora"]), True),
        ParamShape(a + "kv_a_proj_with_mqa.weight", (_DS["kv_lora"] + _DS["rope"], h), True),
        ParamShape(a + "kv_a_layernorm.weight", (_DS["kv_lora"],), False),
        ParamShape(a + "kv_b_proj.weight", (n * (_DS["nope"] + _DS["v_head"]), _DS["kv_lora"]), True),
        ParamShape(a + "o_proj.weight", (h, n * _DS["v_head"]), True),
        ParamShape(p + "post_attention_layernorm.weight", (h,), False),
        ParamShape(p + "mlp.gate.weight", (_DS["experts"], h), True),
        ParamShape(p + "mlp.gate.e_score_correction_bias", (_DS["experts"],), False),
    ]
    experts = [(f"mlp.experts.{e}.", 1) for e in range(_DS["experts"])]
    experts.append(("mlp.shared_experts.", _DS["shared"]))
    for prefix, mult in experts:
        out += [
            ParamShape(p + prefix + "gate_proj.weight", (f * mult, h), True),
            ParamShape(p + prefix + "up_proj.weight", (f * mult, h), True),
            ParamShape(p + prefix + "down_proj.weight", (h, f * mult), True),
        ]
    return out


GROUPS = {
    "llama3-70b layer": llama3_70b_layer,
    "gpt-oss-120b layer": gpt_oss_120b_layer,
    "deepseek-v3 moe layer": deepseek_v3_moe_layer,
    "llama3-70b embedding": llama3_70b_embedding,
    "llama3-70b head": llama3_70b_head,
}

# Requirement kinds of the benchmark: name -> (kind, parameter)
UNIT_KINDS = {
    "elementwise": ("elem", 1),
    "flat256": ("flat", 256),
    "rows128": ("rows", 128),
    "rows1024": ("rows", 1024),
    "whole": ("whole", 0),
}


def unit_for(p: ParamShape, kind: str) -> int:
    """The unit of ``p`` under requirement ``kind`` (a key of UNIT_KINDS).

    Vectors stay elementwise for the row and whole kinds. A 3-D ``(experts, rows, cols)``
    weight is a batch of matrices: a band of k rows is ``k * cols`` when k divides
    ``rows`` (bands never straddle two experts), else one whole expert matrix; "whole"
    is one expert matrix, since matrix optimizers treat experts one by one.
    """
    k, arg = UNIT_KINDS[kind]
    if k == "elem":
        return 1
    if k == "flat":
        return arg
    if not p.matrix:
        return 1
    rows, cols = p.shape[-2], p.shape[-1]
    per_matrix = rows * cols
    if k == "whole":
        return per_matrix if len(p.shape) > 2 else math.prod(p.shape)
    if len(p.shape) > 2:
        return arg * cols if rows % arg == 0 else per_matrix
    return min(arg, rows) * cols
