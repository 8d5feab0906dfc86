"""AdamW and Muon equal their unsharded torch references, on plain and FSDP2 params.

Every check feeds the same full gradients to a sharded run and to torch.optim on
full tensors, then compares the full parameters.
"""

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from torch import nn

import vefsdp_optim

SHAPES = [(7, 5), (7,), (3, 7), (2, 3, 4), (1, 6), (10, 4), (5, 1)]
STEPS = 3


def _params(seed=0, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in shapes]


def _grads(step, shapes=SHAPES):
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(s, generator=g) for s in shapes]


def _reference(kind, init, shapes=SHAPES, **kw):
    """torch.optim on full tensors; Muon's 1-D params go to torch AdamW, >2-D are viewed 2-D."""
    ps = [nn.Parameter(t.clone()) for t in init]
    if kind == "adamw":
        opts = [torch.optim.AdamW(ps, **kw)]
        views = ps
    else:
        mats = [p for p in ps if p.ndim >= 2]
        vecs = [p for p in ps if p.ndim < 2]
        views = {id(p): nn.Parameter(p.detach().reshape(p.shape[0], -1).clone()) for p in mats}
        opts = [torch.optim.Muon(list(views.values()), **kw)]
        if vecs:
            opts.append(torch.optim.AdamW(vecs, lr=kw.get("lr", 1e-3), betas=(0.9, 0.95), eps=1e-8,
                                          weight_decay=kw.get("weight_decay", 0.1)))
    for step in range(STEPS):
        for p, gr in zip(ps, _grads(step, shapes), strict=True):
            if kind == "muon" and p.ndim >= 2:
                views[id(p)].grad = gr.reshape(views[id(p)].shape)
            else:
                p.grad = gr
        for o in opts:
            o.step()
    if kind == "muon":
        return [views[id(p)].detach().reshape(p.shape) if p.ndim >= 2 else p.detach() for p in ps]
    return [p.detach() for p in ps]


def _run_plain(kind, shapes=SHAPES, **kw):
    ps = [nn.Parameter(t.clone()) for t in _params(shapes=shapes)]
    opt = getattr(vefsdp_optim, {"adamw": "AdamW", "muon": "Muon"}[kind])(ps, **kw, **_OURS_KW[kind])
    for step in range(STEPS):
        for p, gr in zip(ps, _grads(step, shapes), strict=True):
            p.grad = gr
        opt.step()
    return [p.detach() for p in ps]


ADAMW_CASES = [dict(), dict(amsgrad=True), dict(maximize=True, weight_decay=0.0),
               dict(lr=0.1, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.3)]
_OURS_KW = {"adamw": {}, "muon": {"flatten": True}}  # >2-D as one (dim 0, rest) matrix, as _reference
MUON_CASES = [dict(), dict(nesterov=False, lr=0.02), dict(adjust_lr_fn="match_rms_adamw", momentum=0.9)]


def _assert_same(got, want, exact):
    for a, b in zip(got, want, strict=True):
        if exact:
            assert torch.equal(a, b), (a - b).abs().max()
        else:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kw", ADAMW_CASES)
def test_adamw_plain_matches_torch(kw):
    _assert_same(_run_plain("adamw", **kw), _reference("adamw", _params(), **kw), exact=False)


@pytest.mark.parametrize("kw", MUON_CASES)
def test_muon_plain_matches_torch_bitwise(kw):
    _assert_same(_run_plain("muon", **kw), _reference("muon", _params(), **kw), exact=True)


def test_adamw_defaults_and_signature_match_torch():
    import inspect

    ours = inspect.signature(vefsdp_optim.AdamW).parameters
    theirs = inspect.signature(torch.optim.AdamW).parameters
    for name in ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize"):
        assert ours[name].default == theirs[name].default, name
    ours = inspect.signature(vefsdp_optim.Muon).parameters
    theirs = inspect.signature(torch.optim.Muon).parameters
    for name in theirs:
        if name != "params":
            assert ours[name].default == theirs[name].default, name


def test_bad_arguments_raise_clearly():
    p = [nn.Parameter(torch.zeros(3, 3))]
    with pytest.raises(ValueError, match="learning rate"):
        vefsdp_optim.AdamW(p, lr=-1.0)
    with pytest.raises(ValueError, match="beta"):
        vefsdp_optim.AdamW(p, betas=(1.0, 0.9))
    with pytest.raises(ValueError, match="not supported"):
        vefsdp_optim.Muon(p, adjust_lr_fn="bogus")
    with pytest.raises(TypeError, match="use_muon"):
        vefsdp_optim.Muon([{"params": p, "use_muon": "no"}])
    with pytest.raises(NotImplementedError, match="non-contiguous"):
        vefsdp_optim.AdamW([nn.Parameter(torch.zeros(4, 3).t())])


def test_muon_use_muon_false_group_is_adamw():
    init = _params(shapes=[(4, 3), (5, 2)])
    ps = [nn.Parameter(t.clone()) for t in init]
    opt = vefsdp_optim.Muon([{"params": [ps[0]]}, {"params": [ps[1]], "use_muon": False, "eps": 1e-6}], lr=0.01)
    ref = [nn.Parameter(t.clone()) for t in init]
    r_muon = torch.optim.Muon([ref[0]], lr=0.01)
    r_adam = torch.optim.AdamW([ref[1]], lr=0.01, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)
    for step in range(STEPS):
        for p, q, gr in zip(ps, ref, _grads(step, [(4, 3), (5, 2)]), strict=True):
            p.grad, q.grad = gr, gr.clone()
        opt.step()
        r_muon.step()
        r_adam.step()
    assert torch.equal(ps[0], ref[0])
    torch.testing.assert_close(ps[1], ref[1], rtol=1e-6, atol=1e-7)


# -- FSDP2 (DTensor) parameters, at several world sizes ------------------------------


class _Bag(nn.Module):
    def __init__(self, init):
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(t.clone()) for t in init])


def _fsdp2_case(kind, kw, hsdp):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    w = dist.get_world_size()
    if hsdp:
        mesh = init_device_mesh("cpu", (2, w // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (w,))
    init = _params()
    model = _Bag(init)
    fully_shard(model, mesh=mesh)
    ps = list(model.ps)
    opt = getattr(vefsdp_optim, {"adamw": "AdamW", "muon": "Muon"}[kind])(ps, **kw, **_OURS_KW[kind])
    for step in range(STEPS):
        for p, gr in zip(ps, _grads(step), strict=True):
            p.grad = distribute_tensor(gr, mesh, p.placements)
        opt.step()
    got = [p.full_tensor() for p in ps]
    want = _reference(kind, init, **kw)
    _assert_same(got, want, exact=(kind == "muon"))
    return True


def _fsdp2_all_cases(hsdp=False):
    for kw in ADAMW_CASES[:2]:
        _fsdp2_case("adamw", kw, hsdp)
    for kw in MUON_CASES:
        _fsdp2_case("muon", kw, hsdp)
    return True


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_fsdp2_params_match_unsharded_torch(world_size):
    assert all(run_distributed(_fsdp2_all_cases, world_size))


def test_hsdp_2x2_params_match_unsharded_torch():
    assert all(run_distributed(_fsdp2_all_cases, 4, True))


def _count_muon_collectives():
    """Newton-Schulz runs once per matrix in the world; one exchange each way per bucket."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    import vefsdp_optim._math as vmath

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _Bag(_params())
    fully_shard(model, mesh=mesh)
    ps = list(model.ps)
    opt = vefsdp_optim.Muon(ps, flatten=True)
    calls = {"ns": 0, "a2a": 0}
    orig_ns, orig_a2a = vmath.zeropower_via_newtonschulz, dist.all_to_all_single
    import vefsdp_optim._math._muon as muon_mod

    def ns(*a, **k):
        calls["ns"] += 1
        return orig_ns(*a, **k)

    def a2a(*a, **k):
        calls["a2a"] += 1
        return orig_a2a(*a, **k)

    muon_mod.zeropower_via_newtonschulz, dist.all_to_all_single = ns, a2a
    try:
        for p, gr in zip(ps, _grads(0), strict=True):
            p.grad = distribute_tensor(gr, mesh, p.placements)
        opt.step()
    finally:
        muon_mod.zeropower_via_newtonschulz, dist.all_to_all_single = orig_ns, orig_a2a
    return calls


@pytest.mark.parametrize("world_size", [3])
def test_muon_newton_schulz_once_per_matrix(world_size):
    calls = run_distributed(_count_muon_collectives, world_size)
    n_matrices = sum(len(s) >= 2 for s in SHAPES)
    assert sum(c["ns"] for c in calls) == n_matrices
    assert all(c["a2a"] == 2 for c in calls)  # one bucket: one exchange each way


# -- the library's own fully_shard parameters -----------------------------------------


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.a = nn.Linear(6, 13)
        self.b = nn.Linear(13, 5)
        self.c = nn.Linear(5, 1)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _fully_shard_case(kind, kw):
    model = _Net()
    init = [p.detach().clone() for p in model.parameters()]
    vefsdp_optim.fully_shard(model.a)
    vefsdp_optim.fully_shard(model)
    ps = list(model.parameters())
    opt = getattr(vefsdp_optim, {"adamw": "AdamW", "muon": "Muon"}[kind])(ps, **kw, **_OURS_KW[kind])
    ref_ps = [nn.Parameter(t.clone()) for t in init]
    if kind == "adamw":
        refs = [torch.optim.AdamW(ref_ps, **kw)]
    else:
        refs = [torch.optim.Muon([q for q in ref_ps if q.ndim == 2], **kw),
                torch.optim.AdamW([q for q in ref_ps if q.ndim < 2], lr=kw.get("lr", 1e-3),
                                  betas=(0.9, 0.95), eps=1e-8, weight_decay=kw.get("weight_decay", 0.1))]
    x = torch.randn(9, 6, generator=torch.Generator().manual_seed(5))
    for _ in range(STEPS):
        opt.zero_grad()
        model(x).square().mean().backward()
        for q, p in zip(ref_ps, ps, strict=True):
            q.grad = p.grad.full_tensor().detach().clone()  # the very gradients the sharded run sees
        opt.step()
        for r in refs:
            r.step()
    _assert_same([p.full_tensor().detach() for p in ps], [q.detach() for q in ref_ps],
                 exact=(kind == "muon"))
    return opt.replan_report is not None


def _fully_shard_all():
    return [_fully_shard_case("adamw", {}), _fully_shard_case("muon", {}),
            _fully_shard_case("muon", dict(nesterov=False, lr=0.02))]


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_fully_shard_params_match_unsharded_torch(world_size):
    for got in run_distributed(_fully_shard_all, world_size):
        assert all(got)  # the optimizer asked fully_shard for its requirements
