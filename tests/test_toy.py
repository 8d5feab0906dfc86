"""Toy runs: the entropy floor, --check per optimizer on fully_shard / FSDP2, the CLI."""

import csv
import json
import math
import os
import sys

import pytest
import torch
from dist_utils import run_distributed

from vefsdp_optim.toy import MarkovLanguage, get_task, markov_entropy_rate
from vefsdp_optim.toy.__main__ import main
from vefsdp_optim.toy._report import check_results, curve_departure
from vefsdp_optim.toy._runner import (
    BUILTIN_OPTIMIZERS,
    RunConfig,
    RunResult,
    check_tolerance,
    train,
    train_all,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUSTOM = "examples.custom_tile_sgd:TileNormalizedSGD"

# -- the loss floor ---------------------------------------------------------------------


def test_two_state_chain_entropy_rate_by_hand():
    a, b = 0.3, 0.1
    P = torch.tensor([[1 - a, a], [b, 1 - b]], dtype=torch.float64)
    h = lambda p: -(p * math.log(p) + (1 - p) * math.log(1 - p))  # noqa: E731
    pi0, pi1 = b / (a + b), a / (a + b)
    assert markov_entropy_rate(P) == pytest.approx(pi0 * h(a) + pi1 * h(b), rel=1e-12)


@pytest.mark.parametrize("vocab,branching,seed", [(16, 3, 1), (64, 4, 0)])
def test_entropy_floor_matches_empirical_estimate(vocab, branching, seed):
    lang = MarkovLanguage(vocab=vocab, branching=branching, seed=seed)
    assert torch.allclose(lang.P.sum(1), torch.ones(vocab, dtype=torch.float64))
    assert ((lang.P > 0).sum(1) == branching).all()
    toks = lang.sample(256, 1000, torch.Generator().manual_seed(7))  # 255,744 transitions
    prev, nxt = toks[:, :-1].reshape(-1), toks[:, 1:].reshape(-1)
    counts = torch.zeros(vocab, vocab, dtype=torch.float64)
    counts.index_put_((prev, nxt), torch.ones(prev.numel(), dtype=torch.float64), accumulate=True)
    row = counts.sum(1, keepdim=True)
    p_hat = counts / row.clamp_min(1)
    plug_in = -(counts * torch.where(counts > 0, p_hat.log(), 0.0)).sum() / counts.sum()
    assert float(plug_in) == pytest.approx(lang.entropy_rate, abs=0.01)
    # first tokens come from the stationary distribution: its frequencies match pi
    freq = torch.bincount(toks.reshape(-1), minlength=vocab).double() / toks.numel()
    from vefsdp_optim.toy._tasks import stationary_distribution

    assert (freq - stationary_distribution(lang.P)).abs().max() < 0.01


def test_gpt_floor_is_the_language_entropy_rate():
    problem = get_task("gpt").build(0)
    assert problem.floor == pytest.approx(MarkovLanguage(vocab=64, seed=0).entropy_rate)
    assert 0.5 < problem.floor < math.log(64)


# -- --check per optimizer, sharded at W = 2 and 3 --------------------------------------


def _configs(sharding, optimizers, tasks=("gpt", "conv", "mlp")):
    # gpt: the real model; conv: 4-D weights; mlp: 22 steps, past Shampoo's first root (20)
    steps = {"gpt": 2, "conv": 2, "mlp": 22}
    return [RunConfig(t, o, sharding, steps[t]) for o in optimizers for t in tasks]


def _ranks(configs):
    if ROOT not in sys.path:  # for package.module:Class paths under examples/
        sys.path.insert(0, ROOT)
    return [r.to_json() for r in train_all(configs)]


def _check_against_single_device(configs, world_size):
    per_rank = run_distributed(_ranks, world_size, configs)
    results = [RunResult.from_json(d) for d in per_rank[0]]
    for other in per_rank[1:]:  # every rank saw the same losses
        assert [d["losses"] for d in other] == [r.losses for r in results]
    refs = train_all([RunConfig(c.task, c.optimizer, "none", c.steps) for c in configs])
    assert not check_results(results, refs), check_results(results, refs)
    for r in results:
        assert r.world_size == world_size and len(r.peak_rss_mb) == world_size
        assert len(r.losses) == r.config.steps and all(map(math.isfinite, r.losses))
    return results, refs


# ~6 s on 2 cores: the slow tier. The quick tier runs the toy's check on a custom optimizer
# (below) and every built-in against one device bitwise (test_optim_db_ours at W = 3)
@pytest.mark.slow
def test_check_every_builtin_optimizer_fully_shard_w2():
    results, refs = _check_against_single_device(_configs("fully_shard", BUILTIN_OPTIMIZERS), 2)
    # the runs trained: the mlp loss fell in 22 steps for every optimizer
    for r in results:
        if r.config.task == "mlp":
            assert r.losses[-1] < 0.8 * r.losses[0], (r.config.optimizer, r.losses)


def test_custom_optimizer_by_module_path():
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    configs = [RunConfig("mlp", CUSTOM, "fully_shard", 6)]
    _check_against_single_device(configs, 2)


def test_check_reports_departures_and_missed_thresholds():
    cfg = RunConfig("illcond", "adamw", "fully_shard", get_task("illcond").steps)
    losses = [1.0] * cfg.steps
    ref = RunResult(RunConfig("illcond", "adamw", "none", cfg.steps), 1, losses, 1.0, 0.5)
    ok = RunResult(cfg, 2, list(losses), 1.0, 0.5)
    (fail,) = check_results([ok], [ref])  # same curve; 1.0 > floor 0.5 + allowance
    assert fail.check == "threshold" and "above the task threshold" in str(fail)
    bent = list(losses)
    bent[7] *= 1 + 1e-7  # W = 2: built-ins must be bit-identical
    fails = check_results([RunResult(cfg, 2, bent, 1.0, 0.5)], [ref])
    assert [f.check for f in fails] == ["reference", "threshold"]
    assert "step 7" in str(fails[0])
    assert check_tolerance("adamw", 3) == 1e-5 and check_tolerance("muon", 3) == 1e-3
    bent[7] = 1 + 0.5 * check_tolerance("adamw", 3)
    assert [f.check for f in check_results([RunResult(cfg, 3, bent, 1.0, 0.5)], [ref])] == [
        "threshold"]
    bent[7] = 1 + 2 * check_tolerance("adamw", 3)
    assert [f.check for f in check_results([RunResult(cfg, 3, bent, 1.0, 0.5)], [ref])] == [
        "reference", "threshold"]
    assert check_tolerance(CUSTOM, 2) == 1e-5
    assert curve_departure([1.0, 2.0], [1.0]) == (math.inf, 1)
    assert curve_departure([1.0, math.nan], [1.0, 2.0])[0] == math.inf


def test_illcond_shampoo_beats_adamw_and_meets_thresholds():
    task = get_task("illcond")
    res = {o: train(RunConfig("illcond", o, "none", task.steps)) for o in ("adamw", "shampoo")}
    assert res["shampoo"].final_loss - res["shampoo"].floor < 0.5 * (res["adamw"].final_loss
                                                                      - res["adamw"].floor)
    assert not check_results(list(res.values()), [None, None])


@pytest.mark.slow
@pytest.mark.parametrize("task", ["gpt", "mlp", "conv", "illcond"])
def test_every_builtin_meets_the_task_threshold(task):
    steps = get_task(task).steps
    results = train_all([RunConfig(task, o, "none", steps) for o in BUILTIN_OPTIMIZERS])
    assert not check_results(results, [None] * len(results))


# -- the command line -------------------------------------------------------------------


def test_cli_writes_csv_json_and_passes_check(tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["--task", "mlp,illcond", "--optimizer", "adamw", "--optimizer", "muon",
               "--sharding", "none", "--steps", "4", "--check", "--quiet", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "final loss" in text and "all checks passed" in text
    with open(out / "losses.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4 * 4 and {r["task"] for r in rows} == {"mlp", "illcond"}
    want = train(RunConfig("mlp", "muon", "none", 4)).losses
    got = [float(r["loss"]) for r in rows if r["task"] == "mlp" and r["optimizer"] == "muon"]
    assert got == want
    data = json.loads((out / "results.json").read_text())
    assert len(data["runs"]) == 4 and data["failures"] == []
    assert data["runs"][0]["config"]["task"] == "mlp" and len(data["runs"][0]["losses"]) == 4
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "pip install" in text
    else:
        assert (out / "loss_curves.png").stat().st_size > 1000


@pytest.mark.slow  # ~50 s on 2 cores; every optimizer against one device at W = 2 is in the quick tier
def test_cli_spawns_odd_world_fsdp2_and_checks(tmp_path, capsys):
    # the CLI's own spawn path, at W = 3 (gradients averaged inexactly: the per-optimizer
    # tolerances apply), past Shampoo's first root at step 20
    rc = main(["--task", "mlp", "--optimizer", "adamw,adamw8bit,muon,shampoo", "--sharding",
               "fsdp2", "--world-size", "3", "--steps", "22", "--check", "--quiet", "--no-plot",
               "--out", str(tmp_path)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert text.count("fsdp2") == 4 and "all checks passed" in text
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert [r["world_size"] for r in runs] == [3] * 4
    assert all(len(r["peak_rss_mb"]) == 3 and r["losses"][-1] < 0.8 * r["losses"][0] for r in runs)


@pytest.mark.parametrize("argv,match", [
    (["--optimizer", "nope"], r"unknown optimizer 'nope'.*adamw.*shampoo"),
    (["--task", "vision"], r"unknown task 'vision'.*gpt"),
    (["--sharding", "none", "--world-size", "2"], r"--sharding none runs on one process"),
    (["--steps", "0"], r"--steps must be >= 1, got 0"),
    (["--sharding", "ddp"], r"invalid choice: 'ddp'"),
    (["--optimizer", "no_such_module:Opt"], r"cannot import optimizer"),
])
def test_bad_arguments_exit_with_a_clear_message(argv, match, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    import re

    assert re.search(match, capsys.readouterr().err, re.S)


@pytest.mark.slow
def test_fsdp2_quickstart_example_runs_and_trains():
    import subprocess

    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "fsdp2_quickstart.py"), "--optimizer",
         "muon", "--steps", "11", "--world-size", "2"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    first, last = (float(line.split()[-1]) for line in out.stdout.splitlines()[:2])
    assert last < 0.5 * first, out.stdout
