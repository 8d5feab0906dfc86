"""The memory estimator (python -m vefsdp_optim.estimate) against the same run on real
tensors: on a small LLaMA-3-shaped model, one rank of a W = 3 (or dp 2 x tp 2) job under
torch's fake process group, the estimate on fake tensors reports the same optimizer
state bytes, by kind, and the same peak by category (torch's MemTracker) as the run on
real CPU tensors; and the state bytes are those of the optimizer's own state, counted
here independently. Then the report as a user runs it, at W = 1,024, and its errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

FAST = [("Shampoo", "fsdp2", 2)]
# the rest of the optimizers and meshes (tests/test_fake_mode.py checks every optimizer's
# state on fake tensors under both shardings; these check the estimator's whole report)
SLOW = [("AdamW8bit", "ours", 1), ("torch.AdamW", "fsdp2", 1), ("AdamW", "fsdp2", 1), ("Muon", "fsdp2", 2),
        ("NorMuon", "ours", 1), ("SOAP", "fsdp2", 1), ("Shampoo", "ours", 2)]


def _estimate(*args: str) -> list[dict]:
    proc = subprocess.run([sys.executable, "-m", "vefsdp_optim.estimate", "--model", "debug", "--seq", "64",
                           "--json", *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


def _ones(*runs: list[str]) -> list[dict]:
    """One rank's result per argument list, each from the process that plays it (what the
    report gathers); the processes run at once (independent: each its own fake group)."""
    cmd = [sys.executable, "-m", "vefsdp_optim.estimate", "--model", "debug", "--seq", "64"]
    procs = [subprocess.Popen([*cmd, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for args in runs]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-4000:]
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]


def _check(optimizer: str, sharding: str, tp: int, rank: int = 2) -> None:
    # W = 3 (uneven shards) without tensor parallelism, dp 2 x tp 2 with it
    args = ["--dp", str(3 if tp == 1 else 2), "--tp", str(tp), "--sharding", sharding, "--optimizer", optimizer,
            "--one", str(rank)]
    for f, r in [_ones(args, [*args, "--real"])]:
        assert f["state"] == r["state"], (f["rank"], f["state"], r["state"])
        assert f["peak"] == r["peak"], (f["rank"], f["peak"], r["peak"])
        assert f["state_total"] > 0 and f["peak"]["Total"] > f["state_total"]
        assert f["device"] == "cpu" or f["device"] == "cuda"


@pytest.mark.parametrize(("optimizer", "sharding", "tp"), FAST)
def test_estimate_equals_the_real_run(optimizer: str, sharding: str, tp: int) -> None:
    _check(optimizer, sharding, tp)


@pytest.mark.slow
@pytest.mark.parametrize(("optimizer", "sharding", "tp"), SLOW)
def test_estimate_equals_the_real_run_everywhere(optimizer: str, sharding: str, tp: int) -> None:
    _check(optimizer, sharding, tp, rank=1)


def _held(cfg, rank: int, dp: int, ep: int) -> int:
    """The parameter elements rank ``rank`` of a dp-rank FSDP2 job holds, from the shapes
    alone: each tensor cut on dim 0 into torch.chunk's pieces over the dp ranks; with
    ep > 1 each expert weight first cut into ep equal runs of experts (this rank's:
    ``rank % ep``), then its local experts over the dp / ep ranks that share them, on dim 1
    where those ranks outnumber the experts (torchtitan's rule)."""
    import math

    from vefsdp_optim.estimate import Transformer

    def piece(n: int, w: int, r: int) -> int:
        c = math.ceil(n / w)
        return max(0, min(n, (r + 1) * c) - r * c)

    with torch.device("meta"):
        model = Transformer(cfg)
    total = 0
    for p in model.parameters():
        if p.dim() == 3 and ep > 1:
            e, edp = p.shape[0] // ep, dp // ep
            dim = 1 if edp * ep > p.shape[0] else 0
            local = [e, *p.shape[1:]]
            rows = piece(local[dim], edp, rank // ep)
            total += rows * math.prod(local) // local[dim]
        else:
            total += piece(p.shape[0], dp, rank) * math.prod(p.shape[1:])
    return total


MOE = [("AdamW", "fsdp2")]
MOE_SLOW = [("Muon", "ours"), ("Muon", "fsdp2"), ("AdamW8bit", "ours")]


def _check_moe(optimizer: str, sharding: str, rank: int = 3) -> None:
    """debug-moe (latent attention, one dense layer, 8 routed experts and a shared one) at
    dp 4 x ep 2: the estimate on fake tensors equals the run on real ones, and AdamW's
    state is two float32 moments of exactly the elements this rank holds."""
    from vefsdp_optim.estimate import CONFIGS

    args = ["--dp", "4", "--ep", "2", "--sharding", sharding, "--optimizer", optimizer, "--one", str(rank)]
    cmd = [sys.executable, "-m", "vefsdp_optim.estimate", "--model", "debug-moe", "--seq", "64"]
    procs = [subprocess.Popen([*cmd, *a], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for a in (args, [*args, "--real"])]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-4000:]
    f, r = (json.loads(out.strip().splitlines()[-1]) for out, _ in outs)
    assert f["state"] == r["state"] and f["peak"] == r["peak"], (f, r)
    if optimizer == "AdamW" and sharding == "fsdp2":
        held = _held(CONFIGS["debug-moe"], rank, dp=4, ep=2)
        assert f["state"]["Adam moments"] == 2 * 4 * held, (f["state"], held)
    assert f["peak"]["Total"] > f["state_total"] > 0


@pytest.mark.parametrize(("optimizer", "sharding"), MOE)
def test_moe_estimate_equals_the_real_run(optimizer: str, sharding: str) -> None:
    _check_moe(optimizer, sharding)


@pytest.mark.slow
@pytest.mark.parametrize(("optimizer", "sharding"), MOE_SLOW)
def test_moe_estimate_equals_the_real_run_everywhere(optimizer: str, sharding: str) -> None:
    _check_moe(optimizer, sharding, rank=0)


# torchtitan's llama3 debugmodel as torchtitan's llama3 fields
TITAN_DEBUG = {"dim": 256, "n_layers": 6, "n_heads": 16, "vocab_size": 2048, "multiple_of": 256}


@pytest.mark.parametrize("ac", ["none", "full"])
def test_equals_torchtitans_estimator(tmp_path, ac: str) -> None:
    """torchtitan's own estimator (tools/titan_estimator.py; a checkout named by
    VEFSDP_TORCHTITAN_SRC) on its llama3 debugmodel, FSDP2 over 8 ranks, its default
    optimizer (torch's fused AdamW): the estimate tracking from the first step, as it does,
    gives its peak by category exactly; with the warm-up step, no more than that."""
    from tools.titan_estimator import run_titan, titan_src

    src = titan_src()
    if src is None:
        pytest.skip("peer not installed: set VEFSDP_TORCHTITAN_SRC to a torchtitan checkout holding "
                    "scripts/estimate/estimation.py (the commit before 76d5c72e2)")
    titan = run_titan(src, 8, ["--job.config_file", "torchtitan/models/llama3/train_configs/debug_model.toml",
                               "--memory_estimation.enable", "--parallelism.data_parallel_shard_degree", "8",
                               "--training.local_batch_size", "2", "--training.seq_len", "512",
                               "--activation_checkpoint.mode", ac], timeout=600)
    want = titan[-1]["cpu"]  # the global peak over its two iterations
    path = tmp_path / "titan_debug.json"
    path.write_text(json.dumps(TITAN_DEBUG))
    cmd = [sys.executable, "-m", "vefsdp_optim.estimate", "--config", str(path), "--dp", "8", "--optimizer",
           "torch.AdamW", "--opt", "fused=True", "--batch", "2", "--seq", "512", "--ac", ac, "--one", "0"]
    got = [json.loads(subprocess.run(c, capture_output=True, text=True, timeout=600, check=True)
                      .stdout.strip().splitlines()[-1])["peak"] for c in ([*cmd, "--no-warmup"], cmd)]
    assert got[0] == want, (got[0], want)
    assert got[1]["Total"] <= want["Total"]


def test_state_by_kind_counts_the_optimizers_own_state() -> None:
    """state_by_kind against the state tensors summed by hand, on one device."""
    import torch

    import vefsdp_optim
    from vefsdp_optim.estimate import state_by_kind

    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(64, 48)), torch.nn.Parameter(torch.randn(5000))]
    opt = vefsdp_optim.AdamW8bit(ps, lr=1e-3)
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()
    by_kind = state_by_kind(opt)
    st0, st1 = opt.state[ps[0]], opt.state[ps[1]]
    assert by_kind["Adam moments"] == st0["exp_avg"].nbytes + st0["exp_avg_sq"].nbytes  # below min_8bit_size
    assert by_kind["8-bit codes and scales"] == sum(st1[k].nbytes for k in (
        "exp_avg_codes", "exp_avg_absmax", "exp_avg_sq_codes", "exp_avg_sq_absmax"))
    assert by_kind["step"] == st0["step"].nbytes + st1["step"].nbytes


@pytest.mark.slow  # two ranks of a 1,024-rank job through the CLI: ~20-30 s on 2 cores
def test_report_at_w1024() -> None:
    proc = subprocess.run([sys.executable, "-m", "vefsdp_optim.estimate", "--model", "debug", "--seq", "64",
                           "--dp", "256", "--tp", "4", "--optimizer", "Shampoo", "--ranks", "0,1023"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "W = 1024" in proc.stdout and "busiest rank" in proc.stdout and "Shampoo factors" in proc.stdout


def test_bad_input() -> None:
    from vefsdp_optim.estimate import CONFIGS, estimate_rank, main

    # the CLI refuses before it starts a rank (in this process: what `python -m` runs)
    with pytest.raises(SystemExit, match=r"--ranks \[4\] outside \[0, 4\)"):
        main(["--model", "debug", "--dp", "4", "--ranks", "4"])

    with pytest.raises(ValueError, match="tp=3 must divide the heads"):
        estimate_rank(CONFIGS["debug"], 0, dp=2, tp=3)
    with pytest.raises(ValueError, match="sharding must be 'fsdp2' or 'ours'"):
        estimate_rank(CONFIGS["debug"], 0, dp=2, sharding="fsdp1")
    with pytest.raises(ValueError, match="optimizer must be one of"):
        estimate_rank(CONFIGS["debug"], 0, dp=2, optimizer="Lion")
    with pytest.raises(ValueError, match="ep=2 needs a mixture-of-experts model"):
        estimate_rank(CONFIGS["debug"], 0, dp=2, ep=2)
    with pytest.raises(ValueError, match=r"ep=3 must divide the experts \(8\) and the data-parallel shards"):
        estimate_rank(CONFIGS["debug-moe"], 0, dp=6, ep=3)
    with pytest.raises(NotImplementedError, match="tp=2 with a mixture of experts is not modeled"):
        estimate_rank(CONFIGS["debug-moe"], 0, dp=2, tp=2)
    with pytest.raises(ValueError, match="capacity_factor must be > 0"):
        estimate_rank(CONFIGS["debug-moe"], 0, dp=2, capacity_factor=0.0)


# Meta-Llama-3-8B's and -70B's config.json (the shape keys, as published with the weights)
HF_LLAMA3 = {
    "llama3-8b": {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                  "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
                  "hidden_act": "silu", "tie_word_embeddings": False, "rope_theta": 500000.0},
    "llama3-70b": {"model_type": "llama", "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
                   "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 128256,
                   "hidden_act": "silu", "tie_word_embeddings": False, "rope_theta": 500000.0},
}


@pytest.mark.parametrize("name", sorted(HF_LLAMA3))
def test_models_from_hf_and_torchtitan_configs(name: str) -> None:
    """A Hugging Face config.json and torchtitan's llama3 fields give the same model as the
    built-in flavor (torchtitan's): every parameter's shape, and the parameter count, which
    is Meta's published 8.03 B / 70.55 B."""
    from vefsdp_optim.estimate import CONFIGS, Transformer, config_from_dict

    want = CONFIGS[name]
    titan = {"dim": want.dim, "n_layers": want.n_layers, "n_heads": want.n_heads, "n_kv_heads": want.n_kv_heads,
             "vocab_size": want.vocab_size, "ffn_dim_multiplier": want.ffn_dim_multiplier,
             "multiple_of": want.multiple_of, "norm_eps": 1e-5, "rope_theta": 500000}
    for cfg in (config_from_dict(HF_LLAMA3[name]), config_from_dict(titan)):
        assert cfg.hidden_dim == want.hidden_dim and cfg.num_params() == want.num_params()
        with torch.device("meta"):
            got, ref = Transformer(cfg), Transformer(want)
        assert [(n, p.shape) for n, p in got.named_parameters()] == [(n, p.shape) for n, p in ref.named_parameters()]
    assert round(want.num_params() / 1e9, 2) == {"llama3-8b": 8.03, "llama3-70b": 70.55}[name]


# the shape keys of DeepSeek-V3's, Qwen3-30B-A3B's and Mixtral-8x7B's config.json, as published
HF_MOE = {
    "deepseek-v3-671b": {"model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61,
                         "num_attention_heads": 128, "num_key_value_heads": 128, "intermediate_size": 18432,
                         "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
                         "num_experts_per_tok": 8, "first_k_dense_replace": 3, "moe_layer_freq": 1,
                         "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
                         "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 129280,
                         "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False},
    "qwen3-moe-30b-a3b": {"model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48,
                          "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                          "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
                          "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
                          "vocab_size": 151936, "tie_word_embeddings": False, "hidden_act": "silu",
                          "attention_bias": False},
}
MIXTRAL_8X7B = {"model_type": "mixtral", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                "num_key_value_heads": 8, "intermediate_size": 14336, "num_local_experts": 8,
                "num_experts_per_tok": 2, "vocab_size": 32000, "tie_word_embeddings": False, "hidden_act": "silu"}


@pytest.mark.parametrize("name", sorted(HF_MOE))
def test_moe_models_from_hf_configs(name: str) -> None:
    """DeepSeek-V3's and Qwen3-30B-A3B's config.json give the built-in flavors, and the
    parameter count of the module built on the meta device (its first dense and first MoE
    layers, the rest counted by the layer kinds) is the published 671 B / 30.5 B; Mixtral
    8x7B's is its published 46.7 B."""
    import dataclasses

    from vefsdp_optim.estimate import CONFIGS, Transformer, config_from_dict

    want = CONFIGS[name]
    assert config_from_dict(HF_MOE[name]) == want
    short = dataclasses.replace(want, n_layers=want.n_dense_layers + 1)
    with torch.device("meta"):
        model = Transformer(short)
    def count(i: int) -> int:
        return sum(p.numel() for p in model.layers[str(i)].parameters())

    dense = count(0) if want.n_dense_layers else 0
    moe = count(want.n_dense_layers)
    rest = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("layers."))
    total = rest + want.n_dense_layers * dense + (want.n_layers - want.n_dense_layers) * moe
    assert total == want.num_params()
    assert round(total / 1e9, 1) == {"deepseek-v3-671b": 671.0, "qwen3-moe-30b-a3b": 30.5}[name]
    assert round(config_from_dict(MIXTRAL_8X7B).num_params() / 1e9, 1) == 46.7


# a small Llama config.json (the shape keys of Meta-Llama-3-8B's, narrower)
SMALL_HF = dict(HF_LLAMA3["llama3-8b"], hidden_size=256, num_hidden_layers=2, num_attention_heads=16,
                num_key_value_heads=4, intermediate_size=768, vocab_size=2048)


# ~8 s of subprocess on 2 cores: the slow tier (the quick tier runs the CLI in
# test_estimate_equals_the_real_run and reads configs in the test below)
@pytest.mark.slow
def test_config_file_on_the_cli(tmp_path) -> None:
    from vefsdp_optim.estimate import config_from_dict

    path = tmp_path / "config.json"
    path.write_text(json.dumps(SMALL_HF))
    proc = subprocess.run([sys.executable, "-m", "vefsdp_optim.estimate", "--config", str(path), "--seq", "16",
                           "--dp", "2", "--one", "0"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["params"] == config_from_dict(SMALL_HF).num_params() and out["peak"]["Total"] > 0


def test_config_errors() -> None:
    from vefsdp_optim.estimate import config_from_dict

    hf = SMALL_HF
    for bad, err, match in [
        (dict(hf, tie_word_embeddings=True), NotImplementedError, "tie_word_embeddings=true is not modeled"),
        (dict(hf, model_type="gpt2"), ValueError, "model_type 'gpt2' is not modeled; accepted: llama, mistral"),
        (dict(hf, head_dim=32), NotImplementedError, "head_dim 32 is not modeled"),
        (dict(hf, num_local_experts=8), NotImplementedError, r"mixture-of-experts configs \(num_local_experts\)"),
        (dict(HF_MOE["qwen3-moe-30b-a3b"], decoder_sparse_step=2), NotImplementedError,
         "decoder_sparse_step other than 1"),
        (dict(HF_MOE["deepseek-v3-671b"], moe_layer_freq=2), NotImplementedError, "moe_layer_freq 2"),
        (dict(HF_MOE["deepseek-v3-671b"], num_experts_per_tok=300), ValueError, "0 < top_k <= n_experts"),
        ({"dim": 64, "n_layers": 2, "n_heads": 4, "moe_args": {}}, ValueError,
         r"unknown model config keys \['moe_args'\]"),
        ({"dim": 64, "n_heads": 4}, ValueError, r"lacks \['n_layers'\]"),
        ([1, 2], TypeError, "must be a JSON object"),
    ]:
        with pytest.raises(err, match=match):
            config_from_dict(bad)
