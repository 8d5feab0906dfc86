"""AdamW's fused fully_shard stores (see ``_FlatState`` in vefsdp_optim/_adamw.py) equal torch.optim.AdamW.

Every case runs the library's AdamW on fully_shard parameters at W = 1..3 and
torch.optim.AdamW on unsharded copies fed the very gradients the sharded run saw, and
compares parameters and state bit for bit. The fused path is checked to be taken (and
its op count not to grow with the parameters of a store), the fallbacks to be exact.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import vefsdp_optim

STEPS = 4


class _Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.s = nn.Parameter(torch.tensor(1.25))  # 0-d: empty slices on all ranks but one

    def forward(self, x):
        return x * self.s


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.a = nn.Linear(7, 13)
        self.b = nn.Linear(13, 5)
        self.c = nn.Linear(5, 3)
        self.d = _Scale()

    def forward(self, x):
        return self.d(self.c(torch.tanh(self.b(torch.tanh(self.a(x))))))


def _sharded_net():
    model = _Net()
    init = [p.detach().clone() for p in model.parameters()]
    vefsdp_optim.fully_shard(model.a)
    vefsdp_optim.fully_shard(model)  # root store: b, c, d
    return model, init


def _flat_stores(ps):
    from vefsdp_optim._flat_store import flat_store

    return {id(flat_store(p)): flat_store(p) for p in ps}.values()


def _padding_zero(ps, opt):
    """Every element of the local buffers that belongs to no parameter is still zero."""
    for binding in _flat_stores(ps):  # fully_shard's StoreBinding: the optimizer's key
        master = binding.store.master
        used = torch.zeros(master.local.numel(), dtype=torch.bool)
        for mp in binding.store.params:
            v = master.local_view(mp.fqn)
            a = v.storage_offset() - master.local.storage_offset()
            used[a:a + v.numel()] = True
        flat = opt._flat.get(binding)
        tensors = [master.local, master.local_grad] + ([] if flat is None else [flat.exp_avg, flat.exp_avg_sq])
        for t in tensors:
            if t[~used].count_nonzero():
                return False
    return True


def _state_equal(opt, ps, ref_opt, ref_ps):
    """self.state holds this rank's slice of torch's per-parameter state, bit for bit."""
    for p, q in zip(ps, ref_ps, strict=True):
        mine, theirs = opt.state.get(p, {}), ref_opt.state.get(q, {})
        if set(mine) != set(theirs):
            return f"state keys {sorted(mine)} vs torch {sorted(theirs)}"
        if not mine:
            continue
        start, length = p.ragged_layout.local(dist.get_rank())
        if mine["step"].dtype != theirs["step"].dtype or float(mine["step"]) != float(theirs["step"]):
            return f"step {mine['step']} vs torch {theirs['step']}"
        for k in mine:
            if k != "step" and not torch.equal(mine[k], theirs[k].reshape(-1)[start:start + length]):
                return f"state {k} differs"
    return None


def _run_case(kw=None, groups=None, skip=None, sched=False, replace_state_at=None, steps=STEPS):
    """One training run; returns a dict of checks (all should be True / None)."""
    kw = kw or {}
    model, init = _sharded_net()
    ps = list(model.parameters())
    ref_ps = [nn.Parameter(t.clone()) for t in init]
    if groups is None:
        opt = vefsdp_optim.AdamW(ps, **kw)
        ref = torch.optim.AdamW(ref_ps, **kw)
    else:  # groups: list of (index list, options)
        opt = vefsdp_optim.AdamW([dict(params=[ps[i] for i in ix], **o) for ix, o in groups], **kw)
        ref = torch.optim.AdamW([dict(params=[ref_ps[i] for i in ix], **o) for ix, o in groups], **kw)
    scheds = []
    if sched:
        scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + 0.7 * s)) for o in (opt, ref)]
    x = torch.randn(9, 7, generator=torch.Generator().manual_seed(5))
    for step in range(steps):
        opt.zero_grad()
        model(x).square().mean().backward()
        for q, p in zip(ref_ps, ps, strict=True):
            q.grad = p.grad.full_tensor().detach().clone()  # the very gradients the sharded run sees
        if skip is not None and step in skip[1]:
            ps[skip[0]].grad = None
            ref_ps[skip[0]].grad = None
        if replace_state_at == step:  # what a load_state_dict that swaps tensors does
            for st in opt.state.values():
                for k in list(st):
                    st[k] = st[k].clone()
        opt.step()
        ref.step()
        for s in scheds:
            s.step()
    params_equal = all(torch.equal(p.full_tensor().detach(), q.detach()) for p, q in zip(ps, ref_ps, strict=True))
    return dict(params_equal=params_equal, state=_state_equal(opt, ps, ref, ref_ps),
                padding_zero=_padding_zero(ps, opt), fused=opt.fused_updates,
                lr=[g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref.param_groups])


def _all_cases():
    n = len(list(_Net().parameters()))  # a.weight, a.bias | b.w, b.b, c.w, c.b, d.s
    return {
        "default": _run_case(),
        "amsgrad_maximize": _run_case(dict(amsgrad=True, maximize=True, lr=3e-2)),
        "wd0": _run_case(dict(weight_decay=0.0, lr=1e-2, betas=(0.8, 0.9), eps=1e-6)),
        "scheduler": _run_case(dict(lr=5e-2), sched=True),
        # one param group per fully_shard store, different hparams: both stores fuse
        "groups_per_store": _run_case(groups=[([0, 1], dict(lr=2e-2, weight_decay=0.1)),
                                               (list(range(2, n)), dict(lr=4e-3, betas=(0.5, 0.7)))]),
        # weights vs biases: every store spans two param groups -> the per-slice fallback
        "groups_mixed": _run_case(groups=[([0, 2, 4], dict(lr=2e-2, weight_decay=0.2)),
                                          ([1, 3, 5, 6], dict(lr=1e-3, weight_decay=0.0))]),
        # b.bias has no grad at step 1: root store falls back from then on (unequal steps)
        "no_grad_step": _run_case(skip=(3, {1})),
        "state_replaced": _run_case(replace_state_at=2),
    }


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_fused_adamw_matches_torch(world_size):
    for res in run_distributed(_all_cases, world_size):
        for name, r in res.items():
            assert r["params_equal"], name
            assert r["state"] is None, (name, r["state"])
            assert r["padding_zero"], name
            assert r["lr"], name
        two = 2 * STEPS  # two fully_shard stores per step
        for name in ("default", "amsgrad_maximize", "wd0", "scheduler", "groups_per_store", "state_replaced"):
            assert res[name]["fused"] == two, (name, res[name]["fused"])
        assert res["groups_mixed"]["fused"] == 0
        # step 0 both fused; step 1 store a fused, root falls back; then root's steps differ
        assert res["no_grad_step"]["fused"] == 1 + STEPS


class _OpCounter(TorchDispatchMode):
    """Ops dispatched, and the tensors they take (a foreach op over n tensors takes n)."""

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.tensors = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.tensors += sum(isinstance(a, torch.Tensor) for a in tree_flatten((args, kwargs or {}))[0])
        return func(*args, **(kwargs or {}))


def _ops_per_step(n_layers, fuse):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4 + i, 5 + i) for i in range(n_layers)])
    vefsdp_optim.fully_shard(model)  # one store, 2 * n_layers params
    opt = vefsdp_optim.AdamW(model.parameters(), amsgrad=True)
    opt.fuse_stores = fuse
    x = torch.randn(3, 4)
    counts = []
    for _ in range(3):
        opt.zero_grad()
        model(x).sum().backward()
        mode = _OpCounter()
        with mode:
            opt.step()
        counts.append((mode.ops, mode.tensors))
    return counts, opt.fused_updates


def _op_counts():
    return {(n, f): _ops_per_step(n, f) for n in (1, 6) for f in (True, False)}


@pytest.mark.parametrize("world_size", [1, 2])
def test_fused_ops_per_step_do_not_grow_with_params(world_size):
    for res in run_distributed(_op_counts, world_size):
        (few, f1), (many, f6) = res[(1, True)], res[(6, True)]
        assert f1 == f6 == 3
        assert few[1:] == many[1:], (few, many)  # after the first step (state creation)
        assert max(ops for ops, _ in many[1:]) <= 16, many  # about ten elementwise ops on the flat buffers
        (slow_few, _), (slow_many, g6) = res[(1, False)], res[(6, False)]
        # the per-slice path's foreach ops take every slice: their tensors grow
        assert g6 == 0 and slow_many[-1][1] > slow_few[-1][1], (slow_few, slow_many)
