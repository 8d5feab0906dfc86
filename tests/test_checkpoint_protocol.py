"""The checkpoint format on an optimizer that is not a BlockOptimizer: SGD with momentum
written on torch.optim.Optimizer, with the few methods of ``CheckpointedOptimizer``. Its
world-size-free state dict loads into a fresh copy, which then steps bit for bit as
torch.optim.SGD that never stopped."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest
import torch

from vefsdp_optim._checkpoint import ELEMENTWISE, CheckpointedOptimizer, export_state, load_state
from vefsdp_optim.sharding import Elementwise, Requirement


class CheckpointedSGD(torch.optim.Optimizer):
    """torch.optim.SGD's momentum update (its single-tensor path), its state 1-D as the
    format's elementwise state, declared to the checkpoint format (one device)."""

    structural_keys: tuple[str, ...] = ()
    extra_state_prefixes: tuple[str, ...] = ()

    def __init__(self, params: Iterable[torch.Tensor], lr: float, momentum: float, dampening: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum, "dampening": dampening})
        self.calls: list[tuple[str, int]] = []

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                grad, state = p.grad.view(-1), self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.clone(grad).detach()
                else:
                    state["momentum_buffer"].mul_(group["momentum"]).add_(grad, alpha=1 - group["dampening"])
                p.view(-1).add_(state["momentum_buffer"], alpha=-group["lr"])

    def requirement(self, shape: torch.Size, group: dict[str, Any]) -> Requirement:
        return Elementwise()

    def checkpoint_spec(self, shape: torch.Size, group: dict[str, Any]) -> dict[str, str | int]:
        return {"momentum_buffer": ELEMENTWISE}

    def checkpoint_layout(self, p, view, group):
        return view.layout

    def export_extra_state(self, state, view, layout, group):
        return {}

    def import_extra_state(self, state, saved, view, layout, group, name):
        pass

    def materialize_state(self, params: Iterable[torch.Tensor]) -> None:
        params = list(params)
        self.calls.append(("materialize", len(params)))
        for p in params:  # what the first step would create
            self.state[p]["momentum_buffer"] = torch.zeros(p.numel(), dtype=p.dtype)

    def forget_state(self, p: torch.Tensor) -> None:
        self.calls.append(("forget", 1))
        self.state[p] = {}

    def pin_owner(self, p, layout, rank) -> None:
        raise AssertionError("no owner at one device")


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in ((5, 3), (7,), (2, 3, 4))]


def _step(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], i: int) -> None:
    g = torch.Generator().manual_seed(100 + i)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()


def test_sgd_resumes_through_the_protocol_as_torch_sgd():
    kw = {"lr": 0.1, "momentum": 0.9, "dampening": 0.1}
    ref_params, params = _params(0), _params(0)
    ref, opt = torch.optim.SGD(ref_params, foreach=False, **kw), CheckpointedSGD(params, **kw)
    for i in range(3):
        _step(ref, ref_params, i)
        _step(opt, params, i)
    sd = export_state(opt, torch.optim.Optimizer.state_dict(opt))
    assert sorted(sd["state"]) == [0, 1, 2] and sd["param_groups"][0]["optimizer"] == "CheckpointedSGD"

    fresh_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = CheckpointedSGD(fresh_params, **kw)
    _: CheckpointedOptimizer = fresh  # the protocol's members, for a type checker
    load_state(fresh, sd)
    assert fresh.calls == [("materialize", 3)]
    for p, q in zip(ref_params, fresh_params, strict=True):
        assert torch.equal(ref.state[p]["momentum_buffer"].view(-1), fresh.state[q]["momentum_buffer"])
    for i in range(3, 6):
        _step(ref, ref_params, i)
        _step(fresh, fresh_params, i)
    for p, q in zip(ref_params, fresh_params, strict=True):
        assert torch.equal(p, q)


def test_a_parameter_saved_without_state_loses_its_state():
    """No state saved, none loaded (``load_state`` in vefsdp_optim/_checkpoint/_format.py): as
    torch's load, through ``forget_state``."""
    kw = {"lr": 0.1, "momentum": 0.9}
    params = _params(1)
    opt = CheckpointedSGD(params, **kw)
    _step(opt, params, 0)
    sd = export_state(opt, torch.optim.Optimizer.state_dict(opt))
    del sd["state"][1]
    load_state(opt, sd)
    assert opt.calls == [("forget", 1)] and not opt.state[params[1]] and opt.state[params[0]]


def test_a_mismatched_checkpoint_names_the_count():
    params = _params(2)
    opt = CheckpointedSGD(params, lr=0.1, momentum=0.9)
    _step(opt, params, 0)
    sd = export_state(opt, torch.optim.Optimizer.state_dict(opt))
    sd["param_groups"][0]["params"] = sd["param_groups"][0]["params"][:2]
    with pytest.raises(ValueError, match="checkpoint has 2 parameters, the optimizer has 3"):
        load_state(opt, sd)
