"""The fully_shard <-> optimizer contract ([Note: flat store contract]), the explicit
re-plan step, the lifecycle states, and every param group's hyperparameters in a bucket.

References are unsharded: torch.optim on full tensors, or the same optimizer on one
process.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from torch import nn

import vefsdp_optim
from vefsdp_optim._flat_store import FlatStore, flat_store
from vefsdp_optim._fsdp._lifecycle import GatherState, GradState, Role, TrainingState, advance
from vefsdp_optim.sharding import FlatBlocks


def _net() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(13, 37), nn.Tanh(), nn.Linear(37, 11))


def _contract() -> dict[str, object]:
    from torch.distributed.fsdp import fully_shard as fsdp2_shard

    out: dict[str, object] = {}
    model = _net()
    vefsdp_optim.fully_shard(model)
    stores = {id(flat_store(p)) for p in model.parameters()}
    store = flat_store(next(model.parameters()))
    out["one_store"] = len(stores) == 1 and isinstance(store, FlatStore)
    out["members"] = [id(p) for p in store.members()] == [id(p) for p in model.parameters()]
    flat = store.flat_param()
    out["segments"] = all(
        torch.equal(flat[o:o + n], p.to_local())
        for p in model.parameters() for o, n in [store.segment(p)])
    out["no_grads"] = not store.grads_in_place()
    model(torch.randn(4, 13)).sum().backward()
    out["grads"] = store.grads_in_place()
    p0 = next(model.parameters())
    p0.grad = p0.grad.clone()  # a .grad that is no longer the buffer's segment
    out["grad_replaced"] = not store.grads_in_place() or store.segment(p0)[1] == 0
    out["grad_not_stored"] = flat_store(p0.grad) is None
    ref = _net()
    fsdp2_shard(ref)
    out["dtensor"] = all(flat_store(p) is None for p in ref.parameters())
    out["plain"] = flat_store(torch.zeros(3)) is None
    return out


@pytest.mark.parametrize("world_size", [1, 3])
def test_fully_shard_parameters_implement_the_flat_store_contract(world_size: int) -> None:
    for res in run_distributed(_contract, world_size):
        assert all(res.values()), res


def _replan_refuses() -> dict[str, object]:
    out: dict[str, object] = {}
    w = dist.get_world_size()
    x = torch.randn(5, 13, generator=torch.Generator().manual_seed(1))
    records: list[logging.LogRecord] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("vefsdp_optim")
    handler, level = _Keep(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        # a re-plan before any state exists: it moves parameters and says so
        model = _net()
        vefsdp_optim.fully_shard(model)
        opt = vefsdp_optim.AdamW8bit(model.parameters(), min_8bit_size=0, block_size=64)
        out["moved"] = w == 1 or bool(opt.replan_report.changed)
        out["logged"] = w == 1 or any("re-planned" in r.getMessage() for r in records)
        out["satisfied"] = all(p.ragged_layout.satisfies(FlatBlocks(64), tuple(p.shape))
                               for p in model.parameters() if p.numel() >= 64)
        # an optimizer that has stepped protects its state from a later re-plan
        model = _net()
        vefsdp_optim.fully_shard(model)
        first = vefsdp_optim.AdamW(model.parameters())
        model(x).square().mean().backward()
        first.step()
        before = [p.full_tensor() for p in model.parameters()]
        try:
            vefsdp_optim.AdamW8bit(model.parameters(), min_8bit_size=0, block_size=64)
            out["refused"] = w == 1  # at W = 1 nothing moves, so nothing to refuse
        except ValueError as e:
            out["refused"] = w > 1 and "AdamW" in str(e) and "before the first step" in str(e)
        # nothing moved: the first optimizer goes on as an unsharded AdamW would
        out["untouched"] = all(torch.equal(a, p.full_tensor())
                               for a, p in zip(before, model.parameters(), strict=True))
        model(x).square().mean().backward()
        first.step()
        out["first_steps"] = True
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_replan_is_logged_and_refuses_to_invalidate_state(world_size: int) -> None:
    for res in run_distributed(_replan_refuses, world_size):
        assert all(res.values()), res


def test_lifecycle_transitions_are_checked() -> None:
    assert advance(GatherState.SHARDED, GatherState.GATHERING, "g") is GatherState.GATHERING
    assert advance(GradState.ACCUMULATING, GradState.REDUCING, "g") is GradState.REDUCING
    for cur, new in ((GatherState.GATHERING, GatherState.SHARDED),
                     (GradState.IDLE, GradState.REDUCING),
                     (GradState.REDUCING, GradState.ACCUMULATING),
                     (TrainingState.IDLE, TrainingState.IDLE),
                     (Role.ROOT, Role.NON_ROOT)):
        with pytest.raises(AssertionError, match="illegal transition"):
            advance(cur, new, "what")
    with pytest.raises(AssertionError, match="illegal transition"):
        advance(GradState.IDLE, GatherState.SHARDED, "mixed enums")


# -- every param group's hyperparameters, in one exchange bucket ----------------------------


def _grouped_params() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(4)
    mats = [torch.randn(6, 5, generator=g), torch.randn(4, 6, generator=g)]
    vecs = [torch.randn(5, generator=g), torch.randn(7, generator=g), torch.randn(3, generator=g)]
    return mats, vecs


def test_muon_honours_each_groups_hyperparameters() -> None:
    """Three groups (Muon matrices; two AdamW groups with their own lr, weight decay,
    betas and eps) equal torch.optim.Muon + one torch.optim.AdamW per group, bitwise."""
    mats, vecs = _grouped_params()
    ours = [nn.Parameter(t.clone()) for t in mats + vecs]
    ref = [nn.Parameter(t.clone()) for t in mats + vecs]
    hp_a = dict(lr=3e-3, weight_decay=0.0, betas=(0.8, 0.9))
    hp_b = dict(lr=5e-4, weight_decay=0.3, betas=(0.9, 0.99))
    opt = vefsdp_optim.Muon([
        {"params": ours[:2]},
        {"params": ours[2:4], "use_muon": False, **hp_a, "eps": 1e-6},
        {"params": ours[4:], "use_muon": False, **hp_b},
    ], lr=0.02)
    refs = [torch.optim.Muon(ref[:2], lr=0.02, weight_decay=0.1),
            torch.optim.AdamW(ref[2:4], **hp_a, eps=1e-6),
            torch.optim.AdamW(ref[4:], **hp_b, eps=1e-8)]
    g = torch.Generator().manual_seed(9)
    for step in range(4):
        if step == 2:  # a scheduler changes one group's lr between steps
            opt.param_groups[1]["lr"] = refs[1].param_groups[0]["lr"] = 1e-3
        for a, b in zip(ours, ref, strict=True):
            a.grad = torch.randn(a.shape, generator=g)
            b.grad = a.grad.clone()
        opt.step()
        for r in refs:
            r.step()
    for a, b in zip(ours, ref, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["adamw", "adamw8bit"])
def test_each_group_keeps_its_hyperparameters(name: str) -> None:
    """Two groups of one optimizer equal two single-group optimizers of the same class."""
    mats, vecs = _grouped_params()
    init = mats + vecs
    kw = dict(min_8bit_size=8, block_size=8) if name == "adamw8bit" else {}
    cls = vefsdp_optim.get_optimizer(name)
    ours = [nn.Parameter(t.clone()) for t in init]
    ref = [nn.Parameter(t.clone()) for t in init]
    opt = cls([{"params": ours[:3], "lr": 1e-2, "weight_decay": 0.0},
               {"params": ours[3:], "lr": 2e-3, "weight_decay": 0.2, "betas": (0.5, 0.6)}], **kw)
    refs = [cls(ref[:3], lr=1e-2, weight_decay=0.0, **kw),
            cls(ref[3:], lr=2e-3, weight_decay=0.2, betas=(0.5, 0.6), **kw)]
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        for a, b in zip(ours, ref, strict=True):
            a.grad = torch.randn(a.shape, generator=g)
            b.grad = a.grad.clone()
        opt.step()
        for r in refs:
            r.step()
    assert all(torch.equal(a, b) for a, b in zip(ours, ref, strict=True))
    assert not any(torch.equal(a, copy.deepcopy(t)) for a, t in zip(ours, init, strict=True))
