"""Muon's owner rounds (see ``make_buckets`` in vefsdp_optim/_step_loop.py) and cost-balanced owners.

Whole matrices sent to owner ranks are exchanged round by round, each round's send
and return in flight while another round's Newton-Schulz runs. The reference is
torch.optim.Muon on one device, bit for bit, at W = 2 and 3 on FSDP2 parameters, with
every round its own bucket; the event order shows the overlap.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from torch import nn

import vefsdp_optim
from vefsdp_optim._math import muon_blocks_cost, muon_cost

SHAPES = [(12, 8), (8, 8), (16, 8), (8, 16), (6, 10), (12, 8), (10, 6), (9, 9)]
HP = dict(lr=0.02, weight_decay=0.1)
STEPS = 3


def _init():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _grad(step, i):
    return torch.randn(SHAPES[i], generator=torch.Generator().manual_seed(100 * step + i))


def _reference():
    ps = [nn.Parameter(t.clone()) for t in _init()]
    opt = torch.optim.Muon(ps, **HP)
    for step in range(STEPS):
        for i, p in enumerate(ps):
            p.grad = _grad(step, i)
        opt.step()
    return [p.detach() for p in ps]


def _rounds_run():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    import vefsdp_optim._block_optimizer as bo

    model = nn.ParameterList([nn.Parameter(t.clone()) for t in _init()])
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    opt = vefsdp_optim.Muon(list(model), **HP)
    opt.min_round_numel = 1  # every round its own bucket
    events: list[tuple] = []
    ids = {id(p): i for i, p in enumerate(model)}
    orig_exchange, orig_compute, orig_apply = bo.exchange, opt.compute_bucket, opt._apply

    def exchange(bucket, tensors, *, forward, **kwargs):
        events.append(("send" if forward else "return", tuple(ids[id(it.param)] for it in bucket)))
        return orig_exchange(bucket, tensors, forward=forward, **kwargs)

    def compute(items, inputs):
        events.append(("compute", tuple(ids[id(it.param)] for it in items)))
        return orig_compute(items, inputs)

    def apply(bucket, back):
        events.append(("apply", tuple(ids[id(it.param)] for it in bucket)))
        return orig_apply(bucket, back)

    bo.exchange, opt.compute_bucket, opt._apply = exchange, compute, apply
    owners = []
    try:
        for step in range(STEPS):
            for i, p in enumerate(model):
                p.grad = distribute_tensor(_grad(step, i), p.device_mesh, p.placements)
            if step == STEPS - 1:
                events.clear()
            opt.step()
    finally:
        bo.exchange = orig_exchange
    for owners_ in opt._planner.owner_cache.values():
        owners = list(owners_)
    return [p.full_tensor().detach() for p in model], events, owners


@pytest.mark.parametrize("world_size", [2, 3])
def test_rounds_equal_torch_and_overlap(world_size):
    results = run_distributed(_rounds_run, world_size)
    want = _reference()
    for full, _, _ in results:
        for i, (a, b) in enumerate(zip(full, want, strict=True)):
            assert torch.equal(a, b), (i, (a - b).abs().max())
    _, events, owners = results[0]
    rounds = [ids for kind, ids in events if kind == "compute"]
    assert sorted(i for r in rounds for i in r) == list(range(len(SHAPES)))
    assert len(rounds) > 1
    for r in rounds:  # at most one matrix per owner in a round
        assert len({owners[i] for i in r}) == len(r), (r, owners)
    pos = {e: k for k, e in enumerate(events)}
    for k, r in enumerate(rounds):
        if k + 1 < len(rounds):  # the next round's send is in flight during this compute
            assert pos[("send", rounds[k + 1])] < pos[("compute", r)]
            # and this round's return during the next compute
            assert pos[("compute", rounds[k + 1])] < pos[("apply", r)]
        assert pos[("return", r)] < pos[("apply", r)]


def test_cost_counts_each_block():
    """Owners are balanced by the Newton-Schulz cost of the blocks really orthogonalized:
    each QKV block and each expert alone, not the fused matrix."""
    p = nn.Parameter(torch.zeros(16, 8))
    opt = vefsdp_optim.Muon([{"params": [p], "split_sizes": [8, 4, 4]}])
    group = opt.param_groups[0]
    assert opt.cost(p.shape, group) == 8 * 8 * 8 + 2 * 4 * 8 * 4 < muon_cost((16, 8))
    e = nn.Parameter(torch.zeros(5, 6, 4))
    opt = vefsdp_optim.Muon([{"params": [e], "flatten": False}, {"params": [e.new_zeros(3, 12, 5)],
                                                                 "flatten": True}])
    assert opt.cost(e.shape, opt.param_groups[0]) == 5 * muon_cost((6, 4)) == muon_blocks_cost(
        (5, 6, 4), flatten=False)
    assert opt.cost(torch.Size((3, 12, 5)), opt.param_groups[1]) == muon_cost((3, 60))
    assert opt.cost(torch.Size((7,)), opt.param_groups[0]) == 7.0  # AdamW elements


@pytest.mark.parametrize("exact", [True, False])
def test_experts_batched_or_not_equal_torch(monkeypatch, exact):
    """Runs of equal experts are orthogonalized in one batch where that keeps every bit
    (see ``newtonschulz_batch_exact`` in vefsdp_optim/_math/_newton_schulz.py), one by
    one elsewhere: torch.optim.Muon's bits either way."""
    import vefsdp_optim._math._muon as muon_mod

    calls = []
    real = muon_mod.newtonschulz_batch_exact
    monkeypatch.setattr(muon_mod, "newtonschulz_batch_exact",
                        lambda *a: calls.append(a) or (exact and real(*a)))
    g = torch.Generator().manual_seed(3)
    init = torch.randn(5, 12, 8, generator=g)
    p = nn.Parameter(init.clone())
    opt = vefsdp_optim.Muon([{"params": [p], "flatten": False}], **HP)
    ref = [nn.Parameter(init[e].clone()) for e in range(5)]
    ref_opt = torch.optim.Muon(ref, **HP)
    for _ in range(STEPS):
        grad = torch.randn(5, 12, 8, generator=g)
        p.grad = grad.clone()
        for e, r in enumerate(ref):
            r.grad = grad[e].clone()
        opt.step()
        ref_opt.step()
    assert calls and calls[0][:3] == (5, 12, 8)
    for e, r in enumerate(ref):
        assert torch.equal(p.detach()[e], r.detach()), e


def test_batch_check_uses_a_probe_and_matches_loop():
    from vefsdp_optim._math._newton_schulz import (
        NS_COEFFICIENTS,
        newtonschulz_batch_exact,
        zeropower_via_newtonschulz,
        zeropower_via_newtonschulz_batched,
    )

    x = torch.randn(3, 10, 6)
    batched = zeropower_via_newtonschulz_batched(x)
    assert batched.shape == (3, 10, 6) and batched.dtype == torch.bfloat16
    if newtonschulz_batch_exact(3, 10, 6, x.device, NS_COEFFICIENTS, 5, 1e-7, torch.get_num_threads()):
        assert torch.equal(batched, torch.stack([zeropower_via_newtonschulz(m) for m in x]))
    with pytest.raises(ValueError, match="3-D batch"):
        zeropower_via_newtonschulz_batched(x[0])
