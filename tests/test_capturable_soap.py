"""SOAP and Shampoo with ``capturable=True`` beyond tests/test_capturable.py: their step
counts through checkpoints (the device count saved and loaded, the form following the
group's ``capturable``) and the host's count of ``step()`` calls, which decides when the
preconditioners are refreshed ([Note: capturable steps])."""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch
from capturable_utils import capturable_on_cpu
from torch import nn

import vefsdp_optim

SHAPES = [(12, 10), (5, 3, 4), (9,)]
STEPS, SPLIT = 6, 2  # refreshes at steps 3 and 5 (SOAP: Adam steps 2 and 4; Shampoo: from 1, every 2)

FACTORIES = {
    "SOAP": lambda ps, **kw: vefsdp_optim.SOAP(ps, lr=1e-2, precondition_frequency=2, **kw),
    "Shampoo": lambda ps, **kw: vefsdp_optim.Shampoo(ps, lr=1e-2, max_preconditioner_dim=8,
                                                     precondition_frequency=2, start_preconditioning_step=1,
                                                     weight_decay=0.01, **kw),
}


def _params() -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def _step(opt: torch.optim.Optimizer, params: list[nn.Parameter], step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()


def _run(name: str, capturable: bool, steps: range, params: list[nn.Parameter] | None = None,
         opt: torch.optim.Optimizer | None = None) -> tuple[list[nn.Parameter], torch.optim.Optimizer]:
    params = _params() if params is None else params
    opt = FACTORIES[name](params, capturable=capturable) if opt is None else opt
    for step in steps:
        _step(opt, params, step)
    return params, opt


def _saved(opt: torch.optim.Optimizer) -> dict[str, Any]:
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _resume(name: str, sd: dict[str, Any], params: list[nn.Parameter], capturable: bool,
            ) -> torch.optim.Optimizer:
    fresh = [nn.Parameter(p.detach().clone()) for p in params]
    opt = FACTORIES[name](fresh, capturable=capturable)
    opt.load_state_dict(sd)
    return opt


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_resumed_capturable_run_equals_uninterrupted(name: str) -> None:
    """Saved after SPLIT steps and loaded into a fresh optimizer: the step counts are
    device tensors again, the host counts are read from them (the refreshes come at the
    same steps), and the run goes on bit for bit."""
    with capturable_on_cpu():
        want, _ = _run(name, True, range(STEPS))
        params, opt = _run(name, True, range(SPLIT))
        sd = _saved(opt)
        resumed = _resume(name, sd, params, capturable=True)
        for st in resumed.state.values():
            assert isinstance(st["step"], torch.Tensor) and st["step"].dtype == torch.float32
            assert st["step"].device.type == "cpu" and float(st["step"]) == SPLIT
        got = resumed.param_groups[0]["params"]
        _run(name, True, range(SPLIT, STEPS), got, resumed)
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_step_count_follows_the_loaded_groups_capturable(name: str) -> None:
    """As torch.optim's: the saved groups' ``capturable`` is the group's after a load,
    and the step count takes its form (SOAP: an int without it, as the reference's;
    Shampoo: a host float32 tensor), both ways; the runs go on close to one another."""
    with capturable_on_cpu():
        want, _ = _run(name, True, range(STEPS))
        params, opt = _run(name, True, range(SPLIT))
        sd = _saved(opt)
    assert all(g["capturable"] is True for g in sd["param_groups"])
    eager_sd = copy.deepcopy(sd)
    for g in eager_sd["param_groups"]:
        g["capturable"] = False
    eager = _resume(name, eager_sd, params, capturable=False)
    assert all(g["capturable"] is False for g in eager.param_groups)
    for st in eager.state.values():
        if name == "SOAP":
            assert type(st["step"]) is int and st["step"] == SPLIT
        else:
            assert st["step"].device.type == "cpu" and float(st["step"]) == SPLIT
    got = eager.param_groups[0]["params"]
    _run(name, False, range(SPLIT, STEPS), got, eager)
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
    # and back: a capturable=False checkpoint (an int step for SOAP) into a capturable group
    back_sd = _saved(eager)
    for g in back_sd["param_groups"]:
        g["capturable"] = True
    with capturable_on_cpu():
        back = _resume(name, back_sd, got, capturable=False)
        for st in back.state.values():
            assert isinstance(st["step"], torch.Tensor) and st["step"].dtype == torch.float32
            assert float(st["step"]) == STEPS
        _run(name, True, range(STEPS, STEPS + 2), back.param_groups[0]["params"], back)


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_host_count_of_a_state_made_elsewhere_is_read_once(name: str) -> None:
    """A step tensor the host counts never saw (a state set from outside, not through
    load_state_dict) is read once at its next step; the refreshes then come at the same
    steps as in the uninterrupted run."""
    with capturable_on_cpu():
        want, _ = _run(name, True, range(STEPS))
        params, opt = _run(name, True, range(SPLIT))
        for st in opt.state.values():
            st["step"] = st["step"].clone()
        _run(name, True, range(SPLIT, STEPS), params, opt)
    for w, g in zip(want, params, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def _replay(opt: torch.optim.Optimizer, params: list[nn.Parameter], step: int) -> None:
    """What a replay of a captured (non-refreshing) step does: its device work, with no
    host count of it (the CPU has no graphs: an eager step, its host count taken back)."""
    _step(opt, params, step)
    opt._host_steps.add(-1)


@pytest.mark.parametrize("name", sorted(FACTORIES))
@pytest.mark.parametrize("counted", [True, False])
def test_count_replays_keeps_the_refresh_schedule(name: str, counted: bool) -> None:
    """Step 4 replayed, then step() at 5 and 6: with count_replays the refresh comes at
    step 5 as in the run of step() calls alone; without, the schedule follows step() calls
    and the run differs."""
    with capturable_on_cpu():
        want, _ = _run(name, True, range(STEPS))
        params, opt = _run(name, True, range(3))
        _replay(opt, params, 3)
        if counted:
            opt.count_replays(1)
        _run(name, True, range(4, STEPS), params, opt)
    same = all(torch.equal(g, w) for g, w in zip(params, want, strict=True))
    assert same is counted
    with pytest.raises(ValueError, match="n must be an int >= 0, got -1"):
        opt.count_replays(-1)


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_state_tensors_stay_put(name: str) -> None:
    """A graph reads and writes the tensors it saw when captured: every state tensor keeps
    its storage across the steps, the first one and the refreshes too (SOAP copies its new
    moments and bases into them, where capturable=False rebinds, as the reference)."""
    with capturable_on_cpu():
        params, opt = _run(name, True, range(1))
        ptrs = {(id(p), k): v.data_ptr() for p, st in opt.state.items() for k, v in st.items()
                if isinstance(v, torch.Tensor)}
        _run(name, True, range(1, STEPS), params, opt)
    now = {(id(p), k): v.data_ptr() for p, st in opt.state.items() for k, v in st.items()
           if isinstance(v, torch.Tensor)}
    assert now == ptrs


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_capturable_must_be_a_bool(name: str) -> None:
    with pytest.raises(TypeError, match="capturable must be a bool, got 1"):
        FACTORIES[name](_params(), capturable=1)
