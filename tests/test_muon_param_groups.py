"""muon_param_groups: Muon's parameters chosen from a module, checked against the groups a
careful user writes by hand for each architecture (see vefsdp_optim/_param_groups.py).

Architectures built from their configs with random weights (no download): Hugging Face
Llama, Qwen2, Qwen3, Mixtral, Qwen2-MoE, GPT-2 (Conv1D), ViT and DeepSeek-V3 (skipped
where transformers, the ``hf`` extra, is missing), torchtitan's llama3 and DeepSeek-V3
debug models on the meta device (skipped where torchtitan is missing). The hand-written
groups name each parameter by the architecture's own names and sizes, not by the rules
the function applies. On FSDP2, our fully_shard, tensor parallelism and FSDP1 (gloo, W = 2
and 3): the same groups as the plain module, or the ValueError for flattened parameters.
"""

from __future__ import annotations

import fnmatch
import importlib.util
from typing import Any

import pytest
import torch
from dist_utils import run_distributed
from torch import nn

import vefsdp_optim

HAVE_HF = importlib.util.find_spec("transformers") is not None
HAVE_TITAN = importlib.util.find_spec("torchtitan") is not None
needs_hf = pytest.mark.skipif(not HAVE_HF, reason='transformers is not installed (pip install -e ".[hf]")')

SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)


def _chosen(model: nn.Module, **kw: Any) -> dict[str, tuple[bool, dict[str, Any]]]:
    return {c.name: (c.use_muon, c.options) for c in vefsdp_optim.muon_param_report(model, **kw)}


def _by_hand(model: nn.Module, rules: list[tuple[str, dict[str, Any] | None]]) -> dict[str, Any]:
    """What a careful user writes: the first ``(pattern, options)`` rule matching each name
    decides (``None``: AdamW); every parameter must match one rule."""
    out = {}
    for name, _ in model.named_parameters():
        opts = next((o for pat, o in rules if fnmatch.fnmatchcase(name, pat)), KeyError)
        assert opts is not KeyError, f"no hand rule for {name}"
        out[name] = (False, {}) if opts is None else (True, opts)
    return out


ADAMW_REST = [("*", None)]
DENSE_LLM = [(f"*.{p}_proj.weight", {}) for p in ("q", "k", "v", "o", "gate", "up", "down")]


def _hf(kind: str):
    import transformers as tf

    if kind == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**SMALL)), DENSE_LLM + ADAMW_REST
    if kind == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**SMALL)), DENSE_LLM + ADAMW_REST
    if kind == "qwen3":
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(**SMALL, head_dim=8)), DENSE_LLM + ADAMW_REST
    if kind == "mixtral":
        m = tf.MixtralForCausalLM(tf.MixtralConfig(**SMALL, num_local_experts=4))
        return m, [*DENSE_LLM[:4], ("*.mlp.gate.weight", {}),  # the router: a hidden matrix
                   ("*.experts.gate_up_proj", {"flatten": False, "split_sizes": [48, 48]}),
                   ("*.experts.down_proj", {"flatten": False}), *ADAMW_REST]
    if kind == "qwen2moe":
        m = tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(**SMALL, num_experts=4, moe_intermediate_size=16,
                                                     shared_expert_intermediate_size=24))
        return m, [("*.shared_expert_gate.weight", None),  # [1, hidden]: a gate vector
                   *DENSE_LLM, ("*.mlp.gate.weight", {}),
                   ("*.experts.gate_up_proj", {"flatten": False, "split_sizes": [16, 16]}),
                   ("*.experts.down_proj", {"flatten": False}), *ADAMW_REST]
    if kind == "gpt2":
        m = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=16,
                                             bos_token_id=0, eos_token_id=0))
        assert m.lm_head.weight is m.transformer.wte.weight
        return m, [(f"*.{c}.weight", {}) for c in ("c_attn", "c_proj", "c_fc")] + ADAMW_REST
    if kind == "vit":
        m = tf.ViTForImageClassification(tf.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                      intermediate_size=48, image_size=16, patch_size=4,
                                                      num_labels=5))
        return m, [("vit.embeddings.*", None), ("classifier.*", None),
                   *[(f"*.attention.{p}_proj.weight", {}) for p in "qkvo"],
                   ("*.mlp.fc1.weight", {}), ("*.mlp.fc2.weight", {}), *ADAMW_REST]
    if kind == "deepseek_v3":
        heads, nope, v, lora, rope = 4, 4, 8, 8, 4
        m = tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(
            vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
            first_k_dense_replace=1, num_attention_heads=heads, num_key_value_heads=heads, n_routed_experts=4,
            n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1, q_lora_rank=16,
            kv_lora_rank=lora, qk_rope_head_dim=rope, qk_nope_head_dim=nope, v_head_dim=v))
        return m, [("*.kv_a_proj_with_mqa.weight", {"split_sizes": [lora, rope]}),
                   ("*.kv_b_proj.weight", {"split_sizes": [nope, v] * heads}),
                   ("*.q_a_proj.weight", {}), ("*.q_b_proj.weight", {}), *DENSE_LLM, ("*.mlp.gate.weight", {}),
                   ("*.experts.gate_up_proj", {"flatten": False, "split_sizes": [16, 16]}),
                   ("*.experts.down_proj", {"flatten": False}), *ADAMW_REST]
    raise AssertionError(kind)


HF_KINDS = ["llama", "qwen2", "qwen3", "mixtral", "qwen2moe", "gpt2", "vit", "deepseek_v3"]


@needs_hf
@pytest.mark.parametrize("kind", HF_KINDS)
def test_hugging_face_architectures_get_the_groups_written_by_hand(kind: str) -> None:
    torch.manual_seed(0)
    model, rules = _hf(kind)
    assert _chosen(model) == _by_hand(model, rules)


@needs_hf
@pytest.mark.parametrize("kind", ["mixtral", "deepseek_v3"])
def test_the_groups_train_as_the_hand_written_ones(kind: str) -> None:
    """Muon and NorMuon built from the chosen groups take the same steps as from groups a
    user writes by hand (each name's options), bit for bit."""
    for cls in (vefsdp_optim.Muon, vefsdp_optim.NorMuon):
        torch.manual_seed(0)
        a, rules = _hf(kind)
        b = _hf(kind)[0]
        b.load_state_dict(a.state_dict())
        hand: dict[tuple, list] = {}
        for name, p in b.named_parameters():
            use, opts = _by_hand(b, rules)[name]
            hand.setdefault((use, tuple((k, tuple(v) if isinstance(v, list) else v)
                                        for k, v in sorted(opts.items()))), []).append(p)
        opts = [cls(vefsdp_optim.muon_param_groups(a), lr=0.02),
                cls([{"params": ps, "use_muon": k[0], **dict(k[1])} for k, ps in hand.items()], lr=0.02)]
        ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1))
        for _ in range(2):
            for model, opt in zip((a, b), opts, strict=True):
                opt.zero_grad()
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
        for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
            assert torch.equal(p, q), (cls.__name__, name)


@pytest.mark.skipif(not HAVE_TITAN, reason='torchtitan is not installed (pip install -e ".[torchtitan]")')
@pytest.mark.parametrize("kind", ["llama3", "deepseek_v3"])
def test_torchtitan_models_get_the_groups_written_by_hand(kind: str) -> None:
    if kind == "llama3":
        from torchtitan.models.llama3 import llama3_configs

        with torch.device("meta"):
            model = llama3_configs["debugmodel"](attn_backend="flex").build()
        rules = [("*.wqkv.weight", {}), ("*.wo.weight", {}), ("*.feed_forward.w?.weight", {}), *ADAMW_REST]
    else:
        from torchtitan.models.deepseek_v3 import model_registry

        with torch.device("meta"):
            model = model_registry("debugmodel").model.build()
        attn = next(m for n, m in model.named_modules() if n.endswith(".attention"))
        rules = [("*.wkv_a.weight", {"split_sizes": [attn.kv_lora_rank, attn.qk_rope_head_dim]}),
                 ("*.wkv_b.weight", {"split_sizes": [attn.qk_nope_head_dim, attn.v_head_dim] * attn.n_heads}),
                 ("*.attention.w?.weight", {}), ("*.feed_forward.w?.weight", {}),
                 ("*.shared_experts.w?.weight", {}), ("*.router.gate.weight", {}),
                 ("*.inner_experts.w?_*", {"flatten": False}), *ADAMW_REST]
    assert _chosen(model) == _by_hand(model, rules)


class _Tiny(nn.Module):
    """Every kind the rules tell apart, in torch alone: a tied embedding and head, a
    norm, a fused gate_up projection, a 3-D expert stack, a convolution, a [1, 1, d]
    token and a 3-D tensor that is none of those."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 12)
        self.conv = nn.Conv2d(3, 12, 3)
        self.norm = nn.LayerNorm(12)
        self.mlp = nn.Module()
        self.mlp.gate_up_proj = nn.Linear(12, 2 * 14, bias=False)
        self.mlp.down_proj = nn.Linear(14, 12)
        self.experts = nn.Module()
        self.experts.w = nn.Parameter(torch.randn(3, 10, 12))
        self.token = nn.Parameter(torch.randn(1, 1, 12))
        self.odd = nn.Parameter(torch.randn(2, 5, 12))
        self.lm_head = nn.Linear(12, 50, bias=False)
        self.lm_head.weight = self.embed.weight


TINY = {"embed.weight": (False, {}), "conv.weight": (True, {"flatten": True}), "conv.bias": (False, {}),
        "norm.weight": (False, {}), "norm.bias": (False, {}),
        "mlp.gate_up_proj.weight": (True, {"split_sizes": [14, 14]}), "mlp.down_proj.weight": (True, {}),
        "mlp.down_proj.bias": (False, {}), "experts.w": (True, {"flatten": False}),
        "token": (False, {}), "odd": (False, {})}


def test_every_rule_on_a_plain_module_and_the_asked_options() -> None:
    model = _Tiny()
    assert _chosen(model) == TINY
    asked = _chosen(model, adamw=["mlp.down_*"], split_sizes={"experts.w": [4, 6]},
                    num_heads={"mlp.gate_up_proj.*": 4})
    assert asked == {**TINY, "mlp.down_proj.weight": (False, {}),
                     "experts.w": (True, {"flatten": False, "split_sizes": [4, 6]}),
                     "mlp.gate_up_proj.weight": (True, {"num_heads": 4})}
    groups = vefsdp_optim.muon_param_groups(model, muon_options={"lr": 0.1}, adamw_options={"lr": 0.01})
    assert [(g["use_muon"], g["lr"], g["param_names"]) for g in groups] == [
        (True, 0.1, ["conv.weight"]), (True, 0.1, ["mlp.gate_up_proj.weight"]),
        (True, 0.1, ["mlp.down_proj.weight"]), (True, 0.1, ["experts.w"]),
        (False, 0.01, ["token", "odd", "embed.weight", "conv.bias", "norm.weight", "norm.bias",
                       "mlp.down_proj.bias"])]
    report = str(vefsdp_optim.muon_param_report(model))
    assert "embed.weight [50, 12]: AdamW (the input embedding (tied to the output head))" in report
    assert "odd [2, 5, 12]: AdamW (a 3-D parameter of _Tiny that is neither" in report
    opt = vefsdp_optim.Muon(groups, lr=0.02)  # the options are the optimizer's
    assert [g["lr"] for g in opt.param_groups] == [0.1] * 4 + [0.01]


def test_bad_arguments_name_what_is_accepted() -> None:
    with pytest.raises(TypeError, match="expects an nn.Module, got list"):
        vefsdp_optim.muon_param_groups([nn.Linear(2, 2)])
    with pytest.raises(TypeError, match=r"split_sizes\['x'\] must be a sequence of positive ints, got 3"):
        vefsdp_optim.muon_param_groups(_Tiny(), split_sizes={"x": 3})
    with pytest.raises(TypeError, match=r"num_heads\['x'\] must be a positive int, got 0"):
        vefsdp_optim.muon_param_groups(_Tiny(), num_heads={"x": 0})
    with pytest.raises(ValueError, match="'x' is in both split_sizes and num_heads"):
        vefsdp_optim.muon_param_groups(_Tiny(), split_sizes={"x": [1]}, num_heads={"x": 1})


def on_shardings() -> dict[str, Any]:
    """The report of _Tiny (same seed on every rank) plain, under FSDP2, under our
    fully_shard and with its two MLP matrices tensor parallel over all ranks; and one
    Muon step on FSDP2 from the groups."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out: dict[str, Any] = {}
    for how in ("plain", "fsdp2", "ours", "tp"):
        torch.manual_seed(0)
        model = _Tiny()
        if how == "fsdp2":
            fully_shard(model.mlp, mesh=mesh)
            fully_shard(model, mesh=mesh)
        elif how == "ours":
            vefsdp_optim.fully_shard(model, mesh=mesh)
        elif how == "tp":
            parallelize_module(model.mlp, mesh, {"gate_up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()})
        out[how] = _chosen(model)
        if how == "fsdp2":
            opt = vefsdp_optim.Muon(vefsdp_optim.muon_param_groups(model), lr=0.02)
            for p in model.parameters():
                p.grad = torch.ones_like(p)
            opt.step()
            out["stepped"] = True
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_same_groups_on_every_sharding(world_size: int) -> None:
    for res in run_distributed(on_shardings, world_size):
        assert res.pop("stepped")
        assert res == {how: TINY for how in ("plain", "fsdp2", "ours", "tp")}


def on_fsdp1() -> str:
    from torch.distributed.fsdp import FullyShardedDataParallel

    model = FullyShardedDataParallel(nn.Sequential(nn.Linear(7, 5), nn.Linear(5, 3)),
                                     use_orig_params=False, device_id=torch.device("cpu"))
    try:
        vefsdp_optim.muon_param_groups(model)
    except ValueError as e:
        return str(e)
    return "accepted"


def test_flattened_parameters_are_refused() -> None:
    for msg in run_distributed(on_fsdp1, 2):
        assert "is an FSDP1 FlatParameter" in msg and "fully_shard" in msg, msg
