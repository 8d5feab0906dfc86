"""The expert-parallel MoE toy run (``--task moe --sharding ep``): its check's verdicts,
its arguments, and the run itself at W = 4 (ep 2 x dp 2, then ep 1 x dp 4 from the
checkpoint) against one device replaying the same gradients; and that the check fails
when expert parallelism's backward or the optimizer state's load is broken."""

import json
import re

import pytest
from dist_utils import run_distributed

from vefsdp_optim.toy import EPCheckConfig, EPCheckResult
from vefsdp_optim.toy.__main__ import main

# -- the verdicts, without running -------------------------------------------------------------


def _result(**kw) -> EPCheckResult:
    n = 4
    base = dict(config=EPCheckConfig(steps=n), world_size=4, layouts=["ep2 x edp2", "ep1 x edp4"],
                losses=[3.0, 2.5, 2.0, 1.5], ref_losses=[3.0, 2.5, 2.0, 1.5], grad_rdiff=[1e-7] * 2 + [0.0] * 2,
                param_diff=[0.0] * n, clipped_heads=[0, 1, 0, 2])
    base.update(kw)
    return EPCheckResult(**base)


def test_ep_check_passes_and_names_each_failure():
    assert _result().failures() == []
    assert _result(config=EPCheckConfig(steps=4, check=False), param_diff=[1.0] * 4).failures() == []
    cases = {
        "param_diff": ([0.0, 0.0, 2e-8, 0.0], r"after step 2 .*2e-08.*1 steps differ"),
        "load_diff": (1e-9, r"after loading the checkpoint into ep1 x edp4"),
        "ref_losses": ([3.0, 2.5 * (1 + 3e-5), 2.0, 1.5], r"loss departs .* at step 1 \(tolerance 1e-05\)"),
        "grad_rdiff": ([1e-7, 0.5, 0.0, 0.0], r"full gradient departs .* by 0\.5"),
        "clipped_heads": ([0, 0, 0, 0], r"QK-clip never fired"),
    }
    for key, (value, pattern) in cases.items():
        failures = _result(**{key: value}).failures()
        assert len(failures) == 1 and re.search(pattern, failures[0]), (key, failures)
    # after the move to ep 1 the forward is one device's: any difference fails
    failures = _result(ref_losses=[3.0, 2.5, 2.0, 1.5 * (1 + 1e-7)]).failures()
    assert len(failures) == 1 and "bit for bit" in failures[0], failures


@pytest.mark.parametrize("argv,match", [
    (["--task", "gpt"], r"--sharding ep runs the moe task only, got --task gpt"),
    (["--optimizer", "adamw"], r"optimizer must be one of \('muon', 'normuon'\), got 'adamw'"),
    (["--optimizer", "muon,normuon"], r"runs one optimizer"),
    (["--world-size", "3"], r"--world-size must be even and >= 2, got 3"),
    (["--steps", "1"], r"steps must be an int >= 2"),
])
def test_ep_bad_arguments_exit_with_a_clear_message(argv, match, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--sharding", "ep", *argv])
    assert e.value.code == 2
    assert re.search(match, capsys.readouterr().err), argv


@pytest.mark.parametrize("kw,match", [
    (dict(resume_at=4, steps=4), r"resume_at must be in \[1, steps=4\), got 4"),
    (dict(ep=6), r"ep=6 is more than the moe task's 5 experts"),
    (dict(qk_clip_threshold=0.0), r"qk_clip_threshold must be > 0, got 0.0"),
])
def test_ep_config_refuses_bad_values(kw, match):
    with pytest.raises(ValueError, match=match):
        EPCheckConfig(**kw)


# -- the run at W = 4 --------------------------------------------------------------------------


@pytest.mark.slow  # 8 s on an idle 2-core machine, 20 s under load: 4 ranks spawned, 8 steps, a checkpoint
def test_cli_ep2_dp2_resumes_at_ep1_dp4_and_checks(tmp_path, capsys):
    rc = main(["--task", "moe", "--sharding", "ep", "--world-size", "4", "--steps", "8", "--check",
               "--quiet", "--out", str(tmp_path)])
    text = capsys.readouterr()
    assert rc == 0, text.out + text.err
    assert "all checks passed" in text.out
    r = json.loads((tmp_path / "moe_ep.json").read_text())
    assert r["layouts"] == ["ep2 x edp2", "ep1 x edp4"] and r["failures"] == []
    assert r["param_diff"] == [0.0] * 8 and r["load_diff"] == 0.0
    assert r["ref_losses"][4:] == r["losses"][4:]  # no expert parallelism after the move
    assert sum(r["clipped_heads"][:4]) > 0 and sum(r["clipped_heads"][4:]) > 0
    assert r["losses"][-1] < 0.8 * r["losses"][0]


def _broken_run(ckpt_dir: str) -> list[str] | None:
    """The run with expert parallelism's backward left without its all-reduce (each ep
    rank's dense gradient then lacks the other ranks' experts) and only the model loaded
    from the checkpoint (the optimizer's momentum restarts after the move)."""
    import vefsdp_optim
    from vefsdp_optim.toy import _models, run_ep_check

    to_ep, load = _models._ToEP.backward, vefsdp_optim.load
    _models._ToEP.backward = staticmethod(lambda ctx, grad: (grad, None))
    vefsdp_optim.load = lambda state, path, **kw: load({"model": state["model"]}, path, **kw)
    try:
        r = run_ep_check(EPCheckConfig(steps=4), ckpt_dir)
    finally:
        _models._ToEP.backward, vefsdp_optim.load = to_ep, load
    return None if r is None else r.failures()


@pytest.mark.slow
def test_ep_check_catches_a_broken_backward_and_a_lost_optimizer_state(tmp_path):
    failures = run_distributed(_broken_run, 4, str(tmp_path / "ckpt"))[0]
    assert re.search(r"parameters differ .* after step 2 ", failures[0]), failures  # the first step at ep 1
    assert re.search(r"full gradient departs .* by 0\.\d", failures[-1]), failures
    # the parameters that parted then give other losses than one device's at step 3
    assert all(re.search(r"loss departs|loss should be one device's", f) for f in failures[1:-1]), failures
