"""Resuming from a checkpoint saved while a parameter had no optimizer state yet (a
param group whose parameters first get a gradient later): that parameter has no state
after loading and its first step is its first, as with torch.optim (see ``load_state``
in vefsdp_optim/_checkpoint/_format.py, ``_empty_stateless_entries`` in
vefsdp_optim/_checkpoint/_save_load.py). The reference is the same run without the
round trip."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import vefsdp_optim

NAMES = ["AdamW", "AdamW8bit", "Shampoo", "SOAP", "Muon", "NorMuon"]
KW = {"AdamW8bit": dict(min_8bit_size=16, block_size=16)}
STEPS = 5


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 9), nn.Linear(9, 5))


def _opt(name: str, m: nn.Module) -> torch.optim.Optimizer:
    groups = [{"params": list(m[0].parameters())}, {"params": list(m[1].parameters()), "lr": 3e-2}]
    if name in ("Muon", "NorMuon"):
        groups = [{"params": [m[0].weight, m[1].weight]}, {"params": [m[0].bias, m[1].bias], "use_muon": False}]
    return getattr(vefsdp_optim, name)(groups, lr=1e-2, **KW.get(name, {}))


def _grads(m: nn.Module, s: int) -> None:
    for i, (n, p) in enumerate(m.named_parameters()):
        late = n.startswith("1.") or n.endswith("bias")  # no gradient before step 2
        g = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * s + i))
        p.grad = None if late and s < 2 else g


def _run(name: str, resume_at: int | None, how: str, tmp_path) -> list[torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    m = _model()
    opt = _opt(name, m)
    for s in range(STEPS):
        _grads(m, s)
        opt.step()
        if s == resume_at:
            stateless = [p for p in m.parameters() if p.grad is None]
            opt.zero_grad()  # DCP's _init_optim_state creates state only where no gradient is set
            if how == "state_dict":
                sd = copy.deepcopy(opt.state_dict())
                opt = _opt(name, m)
                opt.load_state_dict(sd)
            else:
                options = StateDictOptions(flatten_optimizer_state_dict=how == "dcp_flat")
                path = tmp_path / f"{name}-{how}-{s}"
                vefsdp_optim.save({"optim": get_optimizer_state_dict(m, opt, options=options)}, path)
                opt = _opt(name, m)
                sd = {"optim": get_optimizer_state_dict(m, opt, options=options)}
                vefsdp_optim.load(sd, path)
                set_optimizer_state_dict(m, opt, sd["optim"], options=options)
            assert all(not opt.state.get(p) for p in stateless), name
    return [p.detach() for p in m.parameters()]


@pytest.mark.parametrize("how", ["state_dict", "dcp", "dcp_flat"])
@pytest.mark.parametrize("name", NAMES)
def test_resume_before_first_step_equals_uninterrupted(name: str, how: str, tmp_path) -> None:
    ref = _run(name, None, how, tmp_path)
    for at in (0, 1):
        got = _run(name, at, how, tmp_path)
        for a, b in zip(got, ref, strict=True):
            assert torch.equal(a, b), (name, how, at, (a - b).abs().max())


def test_dcp_load_still_names_a_partly_missing_entry(tmp_path) -> None:
    """Only an entry the checkpoint lacks wholly is taken as 'no state'."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    m = _model()
    opt = _opt("AdamW", m)
    _grads(m, 3)
    opt.step()
    opt.zero_grad()
    sd = {"optim": get_optimizer_state_dict(m, opt)}
    del sd["optim"]["state"]["0.weight"]["exp_avg_sq"]
    vefsdp_optim.save(sd, tmp_path / "c")
    fresh = _opt("AdamW", m)
    want = {"optim": get_optimizer_state_dict(m, fresh)}
    with pytest.raises(ValueError, match=r"missing from the checkpoint: optim\.state\.0\.weight\.exp_avg_sq"):
        vefsdp_optim.load(want, tmp_path / "c")
    # and a checkpoint without the optimizer at all is not taken as stateless parameters
    vefsdp_optim.save({"model": m.state_dict()}, tmp_path / "m")
    with pytest.raises(ValueError, match="missing from the checkpoint"):
        vefsdp_optim.load({"model": m.state_dict(), "optim": get_optimizer_state_dict(m, fresh)}, tmp_path / "m")


@pytest.mark.parametrize("name", NAMES)
def test_load_into_a_live_optimizer_creates_missing_state(name: str) -> None:
    """A live optimizer whose parameter has not stepped yet takes that parameter's saved
    state (as torch.optim does); it was dropped when any other parameter had state."""
    a, b = _model(), _model()
    oa, ob = _opt(name, a), _opt(name, b)
    for s in range(2, 4):  # a: every parameter steps; b: the late ones never do
        _grads(a, s)
        oa.step()
        _grads(b, s - 2)
        ob.step()
    ob.load_state_dict(copy.deepcopy(oa.state_dict()))
    b.load_state_dict(a.state_dict())
    for s in range(4, STEPS + 2):
        for m, o in ((a, oa), (b, ob)):
            _grads(m, s)
            o.step()
    for x, y in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(x, y), (name, (x - y).abs().max())
