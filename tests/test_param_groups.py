"""Every optimizer honours every hyperparameter of every param group (hypothesis).

Random splits of a set of parameters into param groups, each with its own random
hyperparameters, some changed between steps (as an LR scheduler does) and one group
added with ``add_param_group``. Reference: one single-group optimizer per group
(torch.optim.AdamW / torch.optim.Muon + torch.optim.AdamW where torch has the
algorithm, else the same class), on the same gradients: bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import vefsdp_optim

SHAPES = [(6, 5), (5,), (4, 6), (3, 4, 2), (7,), (2, 9)]
STEPS = 3


def _hp(name: str) -> st.SearchStrategy[dict]:
    lr = st.sampled_from([1e-3, 3e-3, 1e-2])
    wd = st.sampled_from([0.0, 0.05, 0.2])
    betas = st.sampled_from([(0.9, 0.999), (0.8, 0.95), (0.5, 0.9)])
    if name == "adamw":
        return st.fixed_dictionaries({"lr": lr, "weight_decay": wd, "betas": betas,
                                      "eps": st.sampled_from([1e-8, 1e-6]),
                                      "amsgrad": st.booleans(), "maximize": st.booleans()})
    if name in ("adamw8bit", "adam8bit"):
        return st.fixed_dictionaries({"lr": lr, "weight_decay": wd, "betas": betas,
                                      "block_size": st.sampled_from([4, 8, 16]),
                                      "min_8bit_size": st.sampled_from([0, 10])})
    if name == "shampoo":
        return st.fixed_dictionaries({"lr": lr, "weight_decay": wd, "betas": betas,
                                      "max_preconditioner_dim": st.sampled_from([2, 3, 8]),
                                      "grafting": st.sampled_from(["adam", "sgd", "none"])})
    return st.fixed_dictionaries({"lr": lr, "weight_decay": wd, "betas": betas,
                                  "momentum": st.sampled_from([0.9, 0.95]),
                                  "nesterov": st.booleans(), "ns_steps": st.sampled_from([3, 5]),
                                  "use_muon": st.booleans()})


def _split(n: int) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(0, 2), min_size=n, max_size=n)


def _reference(name: str, group: dict, params: list[nn.Parameter]) -> list[torch.optim.Optimizer]:
    hp = {k: v for k, v in group.items() if k != "params"}
    if name == "adamw":
        return [torch.optim.AdamW(params, **hp)]
    if name == "muon":
        use = hp.pop("use_muon")
        lr, wd, betas = hp["lr"], hp["weight_decay"], hp.pop("betas")
        mats = [p for p in params if p.ndim == 2 and use]
        rest = [p for p in params if not (p.ndim == 2 and use)]
        opts: list[torch.optim.Optimizer] = []
        if mats:
            opts.append(torch.optim.Muon(mats, **hp))
        if rest:
            opts.append(torch.optim.AdamW(rest, lr=lr, weight_decay=wd, betas=betas, eps=1e-8))
        return opts
    return [vefsdp_optim.get_optimizer(name)(params, **hp)]


@pytest.mark.parametrize("name", ["adamw", "muon", "adamw8bit", "adam8bit", "shampoo"])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_param_groups_equal_one_optimizer_per_group(name: str, data: st.DataObject) -> None:
    shapes = SHAPES if name != "muon" else [s for s in SHAPES if len(s) <= 2]
    which = data.draw(_split(len(shapes)))
    groups_ix = sorted(set(which))
    hps = {g: data.draw(_hp(name)) for g in groups_ix}
    late = data.draw(st.sampled_from(groups_ix))  # this group is added by add_param_group
    new_lr = data.draw(st.sampled_from([5e-4, 2e-2]))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 3)))
    init = [torch.randn(s, generator=gen) for s in shapes]
    ours = [nn.Parameter(t.clone()) for t in init]
    refs_p = [nn.Parameter(t.clone()) for t in init]
    cls = vefsdp_optim.get_optimizer(name)
    first = [{"params": [p for p, w in zip(ours, which, strict=True) if w == g], **hps[g]}
             for g in groups_ix if g != late]
    if not first:  # a single group: build with it, still exercise add_param_group below
        first, late = [{"params": [p for p, w in zip(ours, which, strict=True) if w == late],
                        **hps[late]}], None
    opt = cls(first)
    if late is not None:
        opt.add_param_group({"params": [p for p, w in zip(ours, which, strict=True) if w == late],
                             **hps[late]})
    order = [g for g in groups_ix if g != late] + ([late] if late is not None else [])
    refs = {g: _reference(name, {**hps[g]}, [p for p, w in zip(refs_p, which, strict=True) if w == g])
            for g in order}
    for step in range(STEPS):
        if step == 2:  # a scheduler changes the first group's lr between steps
            opt.param_groups[0]["lr"] = new_lr
            for r in refs[order[0]]:
                r.param_groups[0]["lr"] = new_lr
        for a, b in zip(ours, refs_p, strict=True):
            a.grad = torch.randn(a.shape, generator=gen)
            b.grad = a.grad.clone()
        opt.step()
        for g in order:
            for r in refs[g]:
                r.step()
    for a, b in zip(ours, refs_p, strict=True):
        assert torch.equal(a, b), (name, which, hps)
