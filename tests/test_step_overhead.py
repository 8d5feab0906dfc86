"""The step's Python side: the collector paused during a step and restored after
([Note: no collection during a step]), no cyclic garbage left for it, and the flat
views of 1-D tensors taken without a copy or a second view."""

import gc

import pytest
import torch
from torch import nn

import vefsdp_optim
from vefsdp_optim.comm import sharded_view
from vefsdp_optim.comm._views import step_grad_view

OPTIMIZERS = ["AdamW", "AdamW8bit", "Muon", "Shampoo", "SOAP", "NorMuon"]
SHAPES = [(64, 32), (32,), (5000,), (16, 16), (6, 10)]


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def _grads(ps, seed):
    g = torch.Generator().manual_seed(seed)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g)


class _Spy(vefsdp_optim.AdamW):
    """AdamW that records whether the collector was on while it computed a bucket."""

    def __init__(self, *a, fail=False, **kw):
        super().__init__(*a, **kw)
        self.seen = []
        self.fail = fail

    def compute_bucket(self, items, inputs):
        self.seen.append(gc.isenabled())
        if self.fail:
            raise RuntimeError("injected failure inside the step")
        return super().compute_bucket(items, inputs)


@pytest.fixture
def collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def test_step_runs_with_the_collector_paused_and_restores_it(collector_on):
    ps = _params()
    opt = _Spy(ps, lr=1e-2)
    _grads(ps, 1)
    opt.step()
    assert opt.seen and not any(opt.seen)  # paused inside
    assert gc.isenabled()  # and on again after


def test_step_leaves_a_disabled_collector_disabled(collector_on):
    ps = _params()
    opt = _Spy(ps, lr=1e-2)
    _grads(ps, 1)
    gc.disable()
    try:
        opt.step()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_collector_restored_when_the_step_raises(collector_on):
    ps = _params()
    opt = _Spy(ps, lr=1e-2, fail=True)
    _grads(ps, 1)
    with pytest.raises(RuntimeError, match="injected failure"):
        opt.step()
    assert gc.isenabled()


def test_closure_runs_with_the_collector_on(collector_on):
    ps = _params()
    opt = vefsdp_optim.AdamW(ps, lr=1e-2)
    seen = []

    def closure():
        seen.append(gc.isenabled())
        _grads(ps, 2)
        return torch.tensor(0.0)

    opt.step(closure)
    assert seen == [True]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_step_leaves_no_cyclic_garbage(name, collector_on):
    """What a paused collector would have found must be nothing: a step's objects are
    all freed by reference counting."""
    ps = _params()
    opt = getattr(vefsdp_optim, name)(ps, lr=1e-3)
    for s in range(2):  # state made, caches filled
        _grads(ps, 10 + s)
        opt.step()
    _grads(ps, 20)
    gc.collect()
    opt.step()
    assert gc.collect() == 0


def test_paused_step_equals_torch_adamw(collector_on):
    """Same bits as torch.optim.AdamW with the collector paused (a guard against the
    step's own path changing with it)."""
    ps, ref = _params(), _params()
    ours = vefsdp_optim.AdamW(ps, lr=1e-2, weight_decay=0.1)
    theirs = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    for s in range(3):
        _grads(ps, 30 + s)
        _grads(ref, 30 + s)
        ours.step()
        theirs.step()
    for a, b in zip(ps, ref, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("make", [
    lambda: torch.randn(7),
    lambda: nn.Parameter(torch.randn(7)),
    lambda: torch.randn(3, 4),
    lambda: torch.randn(2, 3, 4),
    lambda: torch.randn(0),
])
def test_flat_view_shares_storage_and_is_detached(make):
    t = make()
    v = sharded_view(t).local
    assert v.dim() == 1 and v.numel() == t.numel()
    assert v.data_ptr() == t.data_ptr() and not v.requires_grad
    assert v._base is None or v.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    v.add_(1.0)  # writes through to t
    assert torch.equal(t.detach().reshape(-1), v)


@pytest.mark.parametrize("shape", [(7,), (3, 4), (2, 3, 4), (0,)])
def test_step_grad_view_is_the_gradient_without_a_detach(shape):
    g = torch.randn(shape)
    v = step_grad_view(g)
    ref = sharded_view(g)
    assert v.layout == ref.layout and v.shape == ref.shape and v.process_group is None
    assert v.local.data_ptr() == g.data_ptr() and torch.equal(v.local, g.reshape(-1))
    assert (v.local is g) == (len(shape) == 1)
    assert ref.local is not g  # the public view stays a detached one


def test_step_grad_view_falls_back_to_sharded_view():
    p = nn.Parameter(torch.randn(3, 4))  # requires grad: detached, as sharded_view does
    v = step_grad_view(p)
    assert not v.local.requires_grad and v.local.data_ptr() == p.data_ptr()
    with pytest.raises(NotImplementedError, match="non-contiguous"):
        step_grad_view(torch.randn(4, 3).t())
