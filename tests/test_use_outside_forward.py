"""A parameter used outside the forward of the fully_shard'd module that holds it
([Note: use outside forward]), e.g. ``x @ self.child.weight.T`` in a parent's forward:

- an op on its sharded face raises at the first backward on every rank, naming the
  parameter and the fixes (call the module, ``unshard()`` it, or ``full_tensor()``), never
  silently leaving it untrained; without grad (inference) the same op just computes;
- through ``full_tensor()`` (FSDP2's way) it trains as one device fed the ranks' averaged
  gradients, bit for bit, alone or with the module's own forward (before or after it),
  and before any forward of the root; so does a root parameter taken outside any forward;
- after ``module.unshard()`` (FSDP2's other way) the same, and the module is resharded
  after the backward, as under FSDP2;
- a parameter used nowhere (a module never called) gets no gradient and no error.

W = 1, 2, 3 on gloo, uneven shapes (a Linear(7, 5) over 3 ranks)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from dist_utils import average_like_ranks, run_distributed
from torch import nn
from torch.distributed.fsdp import FSDPModule

import vefsdp_optim

MODES = ("op", "full", "call_then_full", "full_then_call", "unshard")
STEPS = 3


def _full(p: torch.Tensor) -> torch.Tensor:
    """The whole parameter: the gathered (differentiable) copy of a sharded one."""
    return p.full_tensor() if isinstance(p, vefsdp_optim.ShardedParameter) else p


class Parent(nn.Module):
    """``child`` (its own shard group) is used by this forward directly, per ``mode``;
    ``unused`` (its own shard group) is never called."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.pre = nn.Linear(7, 7)  # makes the child's input require grad
        self.child = nn.Linear(7, 5)
        self.unused = nn.Linear(4, 2)
        self.out = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.pre(x))
        child = self.child
        if self.mode == "op":  # the sharded face itself: refused at backward
            h = x @ child.weight.T
        elif self.mode == "full":
            h = x @ _full(child.weight).T + _full(child.bias)
        elif self.mode == "call_then_full":
            h = child(x)
            h = h + x @ _full(child.weight).T
        elif self.mode == "full_then_call":
            h = x @ _full(child.weight).T
            h = h + child(x)
        else:  # "unshard": the unsharded faces, registered by unshard()
            if isinstance(child, FSDPModule):
                child.unshard()
            h = x @ child.weight.T + child.bias
        return self.out(torch.tanh(h))


def _shard(model: nn.Module) -> None:
    vefsdp_optim.fully_shard(model.child)
    vefsdp_optim.fully_shard(model.unused)
    vefsdp_optim.fully_shard(model)


def _input(step: int) -> torch.Tensor:
    return torch.randn(4, 7, generator=torch.Generator().manual_seed(10 + step))


def _average_like_ranks(model: nn.Module, w: int) -> None:
    """Each rank's gradient is the same: the ranks' average is the sum of W copies over W."""
    for p in model.parameters():
        if p.grad is not None:
            p.grad = average_like_ranks(p.grad, w)


def _same(ours: torch.Tensor | None, ref: torch.Tensor | None) -> bool:
    if ours is None or ref is None:
        return ours is None and ref is None
    with torch.no_grad():
        return torch.equal(_full(ours), ref)


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The model's loss plus a penalty on a root parameter, taken outside any forward."""
    return model(x).square().mean() + 1e-2 * _full(model.out.weight).square().sum()


def _trains(mode: str, copy_in: bool = True) -> dict[str, object]:
    """``mode`` on fully_shard vs one device, STEPS steps of AdamW: every gradient and
    every parameter bitwise after each step."""
    w = dist.get_world_size()
    torch.manual_seed(0)
    model = Parent(mode)
    ref = copy.deepcopy(model)
    _shard(model)
    model.set_gradient_copy_in(copy_in)  # False: gradients added into the buffer in place
    opt = vefsdp_optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    out: dict[str, object] = {"grads_equal": [], "params_equal": [], "resharded": []}
    for step in range(STEPS):
        x = _input(step)
        _loss(model, x).backward()
        _loss(ref, x).backward()
        out["resharded"].append(all(isinstance(p, vefsdp_optim.ShardedParameter) for p in model.parameters()))
        _average_like_ranks(ref, w)
        out["grads_equal"].append({n: _same(p.grad, q.grad) for (n, p), q in
                                   zip(model.named_parameters(), ref.parameters(), strict=True)})
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        out["params_equal"].append(all(_same(p, q.detach()) for p, q in
                                       zip(model.parameters(), ref.parameters(), strict=True)))
    return out


def _refused() -> dict[str, object]:
    """An op on the sharded face: the backward raises naming it; without grad it computes."""
    torch.manual_seed(0)
    model = Parent("op")
    ref = copy.deepcopy(model)
    _shard(model)
    x = _input(0)
    out: dict[str, object] = {}
    with torch.no_grad():
        out["inference_equal"] = torch.equal(model(x), ref(x))
    loss = model(x).square().mean()
    try:
        loss.backward()
        out["error"] = None
    except RuntimeError as e:
        out["error"] = str(e)
    model.reset_iter_state()
    out["weight_grad"] = model.child.weight.grad is None
    out["unused_grads"] = [p.grad is None for p in model.unused.parameters()]
    dist.barrier()  # every rank raised alike: the group still works
    return out


def _before_forward() -> dict[str, object]:
    """full_tensor() before any forward of the root: its own backward reduces it."""
    w = dist.get_world_size()
    torch.manual_seed(0)
    model = Parent("full")
    ref = copy.deepcopy(model)
    _shard(model)
    (_full(model.child.weight) * 3).square().sum().backward()
    (ref.child.weight * 3).square().sum().backward()
    _average_like_ranks(ref, w)
    # child.bias, unused, keeps None as on one device (see ``StoreGrads`` in vefsdp_optim/_fsdp/_grads.py)
    out = {n: _same(p.grad, q.grad) for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True)}
    out["child.bias"] = out["child.bias"] and model.child.bias.grad is None
    # then a normal iteration still trains everything as one device
    model.zero_grad()
    ref.zero_grad()
    x = _input(0)
    model(x).square().mean().backward()
    ref(x).square().mean().backward()
    _average_like_ranks(ref, w)
    out["after"] = all(_same(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters(), strict=True))
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("mode", [m for m in MODES if m != "op"])
def test_outside_use_trains_as_one_device(world_size: int, mode: str) -> None:
    for r in run_distributed(_trains, world_size, mode):
        for step, grads in enumerate(r["grads_equal"]):
            unused = {n for n in grads if n.startswith("unused.")}
            assert unused and all(grads[n] for n in unused), (step, grads)  # None on both sides
            assert all(grads.values()), (step, grads)
        assert all(r["params_equal"]) and all(r["resharded"]), r


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("mode", ["full", "full_then_call"])
def test_full_tensor_adds_in_place(world_size: int, mode: str) -> None:
    for r in run_distributed(_trains, world_size, mode, False):
        assert all(all(g.values()) for g in r["grads_equal"]) and all(r["params_equal"]), r


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_op_on_sharded_face_raises_naming_it(world_size: int) -> None:
    for r in run_distributed(_refused, world_size):
        assert r["inference_equal"], r
        msg = r["error"]
        assert msg is not None, r
        assert "parameter child.weight " in msg, msg
        assert "Call the module" in msg and "child.unshard()" in msg, msg
        assert "child.weight.full_tensor()" in msg, msg
        assert r["weight_grad"] and all(r["unused_grads"]), r


@pytest.mark.parametrize("world_size", [1, 3])
def test_full_tensor_before_any_forward(world_size: int) -> None:
    for r in run_distributed(_before_forward, world_size):
        assert all(r.values()), r
