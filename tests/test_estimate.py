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
        ({"dim": 64, "n_layers": 2, "n_heads": 4, "moe_args": {}}, ValueError,
         r"unknown model config keys \['moe_args'\]"),
        ({"dim": 64, "n_heads": 4}, ValueError, r"lacks \['n_layers'\]"),
        ([1, 2], TypeError, "must be a JSON object"),
    ]:
        with pytest.raises(err, match=match):
            config_from_dict(bad)
