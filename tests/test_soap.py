"""SOAP.

One device: against a float64 SOAP written out below from the paper's algorithm (arXiv
2409.11321, with the reference implementation's conventions: a first step that only
starts the preconditioner, Adam's bias correction on the step size, weight decay after
the update) and, where ``VEFSDP_SOAP_REF`` names a folder holding the reference's
``soap.py`` (github.com/nikhilvyas/SOAP), against the reference itself on a small MLP.
Sharded (FSDP2 and fully_shard at W = 2 and 3, FSDP2 + TP at dp 2 x tp 2) and through a
DCP checkpoint saved at W = 3 and loaded at W = 2, SOAP equals the same optimizer on one
device fed the same gradients, bit for bit.
"""

from __future__ import annotations

import importlib.util
import math
import os
import warnings
from functools import partial

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from sharded_bag import full_params, owner_moves, set_full_grads, shard_bag
from torch import nn

import vefsdp_optim
from vefsdp_optim import SOAP
from vefsdp_optim._math._soap import (
    soap_eigenbasis,
    soap_geometry,
    soap_power_iteration,
    soap_project,
    soap_project_back,
)

# -- the math, one process ----------------------------------------------------------------


def test_geometry_follows_the_reference_rules() -> None:
    g = soap_geometry((64, 32), 10000)
    assert g.work_shape == (64, 32) and g.preconditioned == (True, True)
    g = soap_geometry((12000, 64), 10000)  # a vocabulary dim above max_precond_dim: not rotated
    assert g.preconditioned == (False, True) and g.factor_dims == (1,)
    assert soap_geometry((7,), 10000).preconditioned == (False,)  # 1-D: only with precondition_1d
    assert soap_geometry((7,), 10000, precondition_1d=True).preconditioned == (True,)
    assert soap_geometry((7,), 6, precondition_1d=True).preconditioned == (False,)
    assert soap_geometry((), 10).work_shape == () and not soap_geometry((), 10).has_factors
    # merge_dims merges while the product stays <= max_precond_dim; a larger dim stays alone
    assert soap_geometry((4, 5, 6), 25, merge_dims=True).work_shape == (20, 6)
    assert soap_geometry((3, 40, 2, 2), 12, merge_dims=True).work_shape == (3, 40, 4)
    assert soap_geometry((3, 40, 2, 2), 12, merge_dims=True).preconditioned == (True, False, True)
    assert soap_geometry((), 10, merge_dims=True).work_shape == (1,)
    cl = soap_geometry((8, 3, 3, 4), 100, merge_dims=True, data_format="channels_last")
    assert cl.channels_last and cl.work_shape == (96, 3)  # seen as (8, 4, 3, 3)
    x = torch.arange(8 * 3 * 3 * 4.0)
    assert torch.equal(cl.to_work(x), x.view(8, 3, 3, 4).permute(0, 3, 1, 2).reshape(96, 3))
    assert torch.equal(cl.from_work(cl.to_work(x)).reshape(-1), x)
    assert not soap_geometry((8, 3, 3, 4), 100, data_format="channels_last").channels_last  # without merge_dims
    with pytest.raises(ValueError, match="data_format must be one of"):
        soap_geometry((2, 2), 4, data_format="NHWC")


def _rotate64(x: torch.Tensor, qs: list, back: bool) -> torch.Tensor:
    """Q_i^T (into the basis) or Q_i (back) applied along each dim i, by movedim."""
    for i, q in enumerate(qs):
        if q is not None:
            x = torch.movedim(torch.tensordot(q if back else q.T, x, dims=([1], [i])), 0, i)
    return x


def test_rotations_apply_each_basis_along_its_dim() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 5, generator=g, dtype=torch.float64)
    qs = [torch.linalg.qr(torch.randn(4, 4, generator=g, dtype=torch.float64))[0], None,
          torch.linalg.qr(torch.randn(5, 5, generator=g, dtype=torch.float64))[0]]
    torch.testing.assert_close(soap_project(x, qs), _rotate64(x, qs, False), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(soap_project_back(x, qs), _rotate64(x, qs, True), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(soap_project_back(soap_project(x, qs), qs), x, rtol=1e-12, atol=1e-12)
    m = x[:, 0]  # a matrix takes the mm path
    torch.testing.assert_close(soap_project(m, [qs[0], qs[2]]), qs[0].T @ m @ qs[2], rtol=1e-12, atol=1e-12)


def test_rotations_are_the_references_tensordot_calls_bit_for_bit() -> None:
    """SOAP rotations (``soap_project`` in vefsdp_optim/_math/_soap.py): a matrix
    is rotated by mm, not tensordot; the bits must not change (sizes of 1, a dim
    without a factor, N-D tensors, both directions)."""
    g = torch.Generator().manual_seed(4)
    for shape in [(1, 9), (9, 1), (1, 1), (5, 32), (64, 32), (3, 300), (4, 1, 6), (3, 4, 5, 2)]:
        x = torch.randn(shape, generator=g)
        full = [torch.linalg.qr(torch.randn(d, d, generator=g))[0] for d in shape]
        for drop in range(-1, len(shape)):
            qs = [None if i == drop else q for i, q in enumerate(full)]
            for back, side in ((False, 0), (True, 1)):
                want = x
                for q in qs:
                    want = want.permute(*range(1, want.ndim), 0) if q is None else torch.tensordot(
                        want, q, dims=[[0], [side]])
                got = (soap_project_back if back else soap_project)(x, qs)
                assert torch.equal(got, want) and got.stride() == want.stride(), (shape, drop, back)


def test_eigenbasis_and_power_iteration() -> None:
    g = torch.Generator().manual_seed(1)
    a = torch.randn(6, 9, generator=g, dtype=torch.float64)
    f = a @ a.T
    q = soap_eigenbasis(f)
    lam = torch.diag(q.T @ f @ q)
    assert bool((lam[:-1] >= lam[1:]).all())  # decreasing
    torch.testing.assert_close(q.T @ q, torch.eye(6, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(q.T @ f @ q, torch.diag(lam), rtol=0, atol=1e-10)
    # one power iteration from a perturbed, shuffled basis: sort by Rayleigh quotient, F Q, QR
    basis = torch.linalg.qr(q[:, [2, 0, 5, 1, 4, 3]] + 0.05 * torch.randn(6, 6, generator=g, dtype=torch.float64))[0]
    v = torch.arange(12.0, dtype=torch.float64).view(2, 6)
    new, v_sorted = soap_power_iteration(f, basis, v, 1)
    order = torch.argsort(torch.diag(basis.T @ f @ basis), descending=True)
    torch.testing.assert_close(new, torch.linalg.qr(f @ basis[:, order])[0], rtol=0, atol=1e-12)
    assert torch.equal(v_sorted, v[:, order])
    # it converges to the eigenvectors (up to sign)
    for _ in range(60):
        new, _ = soap_power_iteration(f, new, v, 1)
    torch.testing.assert_close((new.T @ q).abs(), torch.eye(6, dtype=torch.float64), rtol=0, atol=1e-6)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_eigenbasis_of_a_non_finite_factor_is_the_identity(bad: float) -> None:
    """Selected on the device (no host sync), with no warning; the reference raises."""
    f = torch.randn(5, 5, generator=torch.Generator().manual_seed(2))
    f = f @ f.T
    f[1, 3] = f[3, 1] = bad
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        q = soap_eigenbasis(f)
    assert torch.equal(q, torch.eye(5))
    p = nn.Parameter(torch.randn(5, 4))
    opt = SOAP([p], precondition_frequency=1)
    p.grad = torch.randn(5, 4)
    p.grad[2, 1] = bad
    opt.step()  # the first step: factors and their bases
    assert torch.equal(opt.state[p]["Q.0"], torch.eye(5)) and torch.equal(opt.state[p]["Q.1"], torch.eye(4))


# -- an independent float64 SOAP ------------------------------------------------------------


def _merged(shape: tuple[int, ...], cap: int) -> tuple[int, ...]:
    out, run = [], 1
    for d in shape:
        if run * d > cap:
            out.append(run if run > 1 else d)
            run = d if run > 1 else 1
        else:
            run *= d
    return tuple(out + [run] if run > 1 or not out else out)


def _paper_soap(init: torch.Tensor, grads: list[torch.Tensor], *, lr: float = 3e-3,
                betas: tuple[float, float] = (0.95, 0.95), shampoo_beta: float = -1, eps: float = 1e-8,
                weight_decay: float = 0.01, precondition_frequency: int = 10, max_precond_dim: int = 10000,
                merge_dims: bool = False, precondition_1d: bool = False, normalize_grads: bool = False,
                correct_bias: bool = True) -> torch.Tensor:
    """SOAP (arXiv 2409.11321, Algorithm 3) in float64, on one tensor, by movedim and
    einsum. Per dim i of the (merged) shape with n_i <= max_precond_dim (1-D only with
    precondition_1d): L_i = b L_i + (1 - b) G_(i) G_(i)^T; Q_i = eigenvectors of L_i
    (decreasing) at the first step, then every f steps Q_i = QR(L_i Q_i sorted by
    diag(Q_i^T L_i Q_i)), the second moment's entries permuted alike; Adam on G rotated by
    Q_i^T, its direction rotated back; the first step only starts L_i and Q_i."""
    b1, b2 = betas
    bl = shampoo_beta if shampoo_beta >= 0 else b2
    w = init.clone()
    shape = tuple(w.shape)
    work = _merged(shape, max_precond_dim) if merge_dims and len(shape) != 1 else shape
    has = [(len(shape) != 1 or precondition_1d) and n <= max_precond_dim for n in work]
    L = [torch.zeros(n, n, dtype=torch.float64) if h else None for n, h in zip(work, has, strict=True)]
    Q: list = [None] * len(work)
    m = torch.zeros(work, dtype=torch.float64)
    v = torch.zeros(work, dtype=torch.float64)

    def rotate(x: torch.Tensor, back: bool) -> torch.Tensor:
        return _rotate64(x, Q, back)

    for s, g in enumerate(grads):
        g = g.reshape(work)
        if s > 0:
            t = s
            gr = rotate(g, False)
            m = b1 * m + (1 - b1) * gr
            v = b2 * v + (1 - b2) * gr * gr
            u = rotate(m / (v.sqrt() + eps), True)
            if normalize_grads:
                u = u / (1e-30 + u.pow(2).mean().sqrt())
            step = lr * math.sqrt(1 - b2**t) / (1 - b1**t) if correct_bias else lr
            w = w - step * u.reshape(shape)
            w = w - lr * weight_decay * w
        for i, h in enumerate(has):
            if h:
                gi = torch.movedim(g, i, 0).reshape(work[i], -1)
                L[i] = bl * L[i] + (1 - bl) * gi @ gi.T
        if s == 0:
            for i, h in enumerate(has):
                if h:
                    lam, vec = torch.linalg.eigh(L[i])
                    Q[i] = vec.flip(1)
        elif s % precondition_frequency == 0:
            m = rotate(m, True)  # momentum back to the gradient's basis
            for i, h in enumerate(has):
                if h:
                    order = torch.argsort(torch.diag(Q[i].T @ L[i] @ Q[i]), descending=True)
                    v = v.index_select(i, order)
                    Q[i] = torch.linalg.qr(L[i] @ Q[i][:, order])[0]
            m = rotate(m, False)
    return w


def _grads64(shape: tuple[int, ...], steps: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(steps)]


# shapes whose factors have full rank from the first step (a factor with a null space has
# eigenvectors there that any rounding difference rotates, and Adam's per-coordinate
# scaling then differs by O(lr): see ``soap_step_`` in vefsdp_optim/_math/_soap.py)
PAPER_CASES = [
    ((6, 6), dict(precondition_frequency=3, weight_decay=0.1)),
    ((3, 4, 5), dict(precondition_frequency=2, betas=(0.9, 0.99), shampoo_beta=0.8, eps=1e-6)),
    ((3, 4, 5), dict(max_precond_dim=4, precondition_frequency=2, correct_bias=False)),  # dim 5 not rotated
    ((2, 3, 8), dict(merge_dims=True, max_precond_dim=6, precondition_frequency=2)),  # work (6, 8)
    ((4, 4), dict(normalize_grads=True, precondition_frequency=4, lr=0.01)),
    ((9,), dict(weight_decay=0.2)),  # Adam, as the reference's first step
    ((1,), dict(precondition_1d=True, precondition_frequency=2)),
]


@pytest.mark.parametrize("shape,kw", PAPER_CASES)
def test_equals_the_papers_algorithm_in_float64(shape: tuple[int, ...], kw: dict) -> None:
    steps = 13
    init = torch.randn(shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    grads = _grads64(shape, steps)
    p = nn.Parameter(init.clone())
    opt = SOAP([p], **kw)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    want = _paper_soap(init, grads, **kw)
    moved = float((want - init).abs().max())
    assert moved > 1e-3
    torch.testing.assert_close(p.detach(), want, rtol=0, atol=1e-9 * max(1.0, moved))


def test_first_step_only_starts_the_preconditioner() -> None:
    p = nn.Parameter(torch.randn(5, 3))
    before = p.detach().clone()
    opt = SOAP([p], weight_decay=0.5)
    p.grad = torch.randn(5, 3)
    opt.step()
    assert torch.equal(p.detach(), before)
    st = opt.state[p]
    assert st["step"] == 1 and sorted(st) == ["GG.0", "GG.1", "Q.0", "Q.1", "exp_avg", "exp_avg_sq", "step"]
    torch.testing.assert_close(st["GG.0"], 0.05 * p.grad @ p.grad.T)
    p.grad = torch.randn(5, 3)
    opt.step()
    assert not torch.equal(p.detach(), before)


def _reference_module():
    src = os.environ.get("VEFSDP_SOAP_REF")
    path = os.path.join(src, "soap.py") if src else ""
    if not os.path.isfile(path):
        return None
    spec = importlib.util.spec_from_file_location("soap_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _train_mlp(make, steps: int = 50) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    opt = make(model.parameters())
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(64, 12, generator=g), torch.randn(64, 4, generator=g)
        loss = (model(x) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


REF_CONFIGS = [{}, dict(precondition_frequency=3, weight_decay=0.1, shampoo_beta=0.9),
               dict(max_precond_dim=20, merge_dims=True, precondition_1d=True, normalize_grads=True)]


@pytest.mark.skipif(_reference_module() is None, reason="peer not installed: set VEFSDP_SOAP_REF to a folder "
                    "holding the reference's soap.py (a checkout of github.com/nikhilvyas/SOAP)")
@pytest.mark.parametrize("kw", REF_CONFIGS)
def test_follows_the_reference_on_an_mlp(kw: dict) -> None:
    """50 steps on a small MLP: within 1e-5 relative of the reference (measured: the same bits)."""
    ref = _reference_module()
    want = _train_mlp(lambda ps: ref.SOAP(ps, **kw))
    got = _train_mlp(lambda ps: SOAP(ps, **kw))
    init = _train_mlp(lambda ps: SOAP(ps, lr=0.0), steps=0)
    for a, b, c in zip(got, want, init, strict=True):
        assert float((b - c).norm()) > 1e-3 * float(c.norm())  # it trained
        assert float((a - b).norm()) <= 1e-5 * float(b.norm()), float((a - b).norm() / b.norm())


# -- the optimizer on one device ----------------------------------------------------------


def test_signature_defaults_registry_and_errors() -> None:
    import inspect

    sig = inspect.signature(SOAP.__init__)
    want = dict(lr=3e-3, betas=(0.95, 0.95), shampoo_beta=-1, eps=1e-8, weight_decay=0.01,
                precondition_frequency=10, max_precond_dim=10000, merge_dims=False, precondition_1d=False,
                normalize_grads=False, data_format="channels_first", correct_bias=True)
    assert {k: v.default for k, v in sig.parameters.items() if k not in ("self", "params", "capturable")} == want
    assert sig.parameters["capturable"].kind is inspect.Parameter.KEYWORD_ONLY  # ours, after the reference's
    assert vefsdp_optim.get_optimizer("soap") is SOAP and "soap" in vefsdp_optim.list_optimizers()
    p = [nn.Parameter(torch.zeros(3, 3))]
    for kw, exc, match in [
        (dict(lr=-1.0), ValueError, "Invalid learning rate"),
        (dict(betas=(0.9, 1.0)), ValueError, r"betas must be a pair of floats in \[0, 1\)"),
        (dict(shampoo_beta=1.0), ValueError, "shampoo_beta must be a float in"),
        (dict(precondition_frequency=0), ValueError, "precondition_frequency must be an int >= 1, got 0"),
        (dict(max_precond_dim=2.5), ValueError, "max_precond_dim must be an int >= 0"),
        (dict(merge_dims=1), TypeError, "merge_dims must be a bool"),
        (dict(correct_bias="yes"), TypeError, "correct_bias must be a bool"),
        (dict(data_format="NHWC"), ValueError, r"data_format must be one of \('channels_first', 'channels_last'\)"),
    ]:
        with pytest.raises(exc, match=match):
            SOAP(p, **kw)
    opt = SOAP(p)
    with pytest.raises(ValueError, match="precondition_frequency"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))], "precondition_frequency": -3})


def test_requirements_and_state_declarations() -> None:
    from vefsdp_optim.sharding import Elementwise, WholeTensor

    opt = SOAP([nn.Parameter(torch.zeros(1))])
    g = opt.param_groups[0]
    assert opt.requirement(torch.Size([8, 4]), g) == WholeTensor()
    assert opt.requirement(torch.Size([8]), g) == Elementwise()
    assert opt.requirement(torch.Size([20000, 20000]), g) == Elementwise()  # no dim rotated: Adam
    assert opt.checkpoint_spec(torch.Size([12000, 64]), g) == {
        "step": "replicated", "exp_avg": "whole", "exp_avg_sq": "whole", "GG.1": "whole", "Q.1": "whole"}
    assert opt.checkpoint_spec(torch.Size([8]), g) == {
        "step": "replicated", "exp_avg": "elementwise", "exp_avg_sq": "elementwise"}
    assert opt.requirement(torch.Size([8]), dict(g, normalize_grads=True)) == WholeTensor()  # a whole-tensor mean


def test_state_dict_round_trip_and_bfloat16(tmp_path) -> None:
    shapes = [(6, 5), (7,), (3, 2, 2)]
    gen = torch.Generator().manual_seed(2)
    init = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(6)]
    ps = [nn.Parameter(t.clone()) for t in init]
    opt = SOAP(ps, precondition_frequency=2)
    for step in range(3):
        for p, gr in zip(ps, grads[step], strict=True):
            p.grad = gr.clone()
        opt.step()
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    qs = [nn.Parameter(p.detach().clone()) for p in ps]
    opt2 = SOAP(qs, precondition_frequency=2)
    opt2.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=True))
    for step in range(3, 6):
        for p, q, gr in zip(ps, qs, grads[step], strict=True):
            p.grad, q.grad = gr.clone(), gr.clone()
        opt.step()
        opt2.step()
    assert all(torch.equal(p, q) for p, q in zip(ps, qs, strict=True))
    # bfloat16 parameters: float32 state, the update rounded once into the parameter
    b = nn.Parameter(init[0].bfloat16())
    f = nn.Parameter(b.detach().float())
    ob, of = SOAP([b], lr=0.01), SOAP([f], lr=0.01)
    for step in range(4):
        b.grad, f.grad = grads[step][0].bfloat16(), grads[step][0].bfloat16().float()
        ob.step()
        of.step()
        f.data = f.data.bfloat16().float()
    assert ob.state[b]["exp_avg"].dtype == torch.float32
    torch.testing.assert_close(b.detach().float(), f.detach(), rtol=0, atol=1e-2)


# -- sharded: FSDP2 and fully_shard at W = 2, 3 -----------------------------------------------

# name -> shape; group "plain" at the defaults but precondition_frequency 2 (renewals in
# 5 steps), group "more" with max_precond_dim 8 (emb's 12-row dim not rotated), merge_dims,
# precondition_1d and normalize_grads (every tensor of it whole on an owner)
PARAMS = {"w": (10, 7), "conv": (4, 3, 2, 2), "b": (6,), "emb": (12, 5), "v": (5,), "s": (1,)}
GROUPS = {"plain": ["w", "conv", "b"], "more": ["emb", "v", "s"]}
HP = dict(lr=0.01, weight_decay=0.1, precondition_frequency=2)
MORE = dict(max_precond_dim=8, merge_dims=True, precondition_1d=True, normalize_grads=True)
STEPS = 5


def _init(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, s in PARAMS.items()}


def _grad(step: int, name: str) -> torch.Tensor:
    return torch.randn(PARAMS[name], generator=torch.Generator().manual_seed(1000 * step + sum(map(ord, name))))


def _make(params: dict[str, torch.Tensor]) -> SOAP:
    return SOAP([{"params": [params[k] for k in GROUPS["plain"]]},
                 {"params": [params[k] for k in GROUPS["more"]], **MORE}], **HP)


def _plain_run(steps: int = STEPS) -> dict[str, torch.Tensor]:
    params = {k: nn.Parameter(v.clone()) for k, v in _init().items()}
    opt = _make(params)
    for step in range(steps):
        for k, p in params.items():
            p.grad = _grad(step, k)
        opt.step()
    return {k: p.detach() for k, p in params.items()}


def _sharded_runs() -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for kind in ("fsdp2", "fully_shard"):
        model = shard_bag(kind, _init())
        opt = _make(dict(model.named_parameters()))
        for step in range(STEPS):
            set_full_grads(model, partial(_grad, step))
            opt.step()
        out[kind] = full_params(model)
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_sharded_equals_one_device(world_size: int) -> None:
    want = _plain_run()
    for kind, full in run_distributed(_sharded_runs, world_size)[0].items():
        for k in PARAMS:
            assert torch.equal(full[k], want[k]), (kind, k, (full[k] - want[k]).abs().max())


def test_owners_stay_when_a_parameter_has_no_gradient() -> None:
    want = owner_moves(sharded=False)
    for got in run_distributed(owner_moves, 2):
        for k in want:
            assert torch.equal(got[k], want[k]), (k, (got[k] - want[k]).abs().max())


# -- FSDP2 + tensor parallel, dp 2 x tp 2 ----------------------------------------------------


def _train_tp(steps: int = 4) -> float:
    """FSDP2 + TP on a dp 2 x tp 2 mesh; each step's gathered full gradients replayed on
    one device by the same optimizer: the largest parameter difference."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from tp_utils import TP_PLAN, TPBlock, gathered, parallelize

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model, ref = TPBlock(), TPBlock()
    ref.load_state_dict(model.state_dict())
    parallelize(model, mesh["tp"], TP_PLAN)
    fully_shard(model, mesh=mesh["dp"])
    opt, ref_opt = (SOAP(m.parameters(), lr=0.01, precondition_frequency=2) for m in (model, ref))
    worst = 0.0
    for step in range(steps):
        x = torch.randn(3, 5, 10, generator=torch.Generator().manual_seed(100 * step + dist.get_rank() // 2))
        model(x).pow(2).mean().backward()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            q.grad = gathered(p.grad)
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            worst = max(worst, float((gathered(p) - q.detach()).abs().max()))
    return worst


def test_fsdp2_tp_2x2_equals_one_device() -> None:
    assert run_distributed(_train_tp, 4) == [0.0] * 4


# -- DCP checkpoint: saved at W = 3, loaded at W = 2 ---------------------------------------------

SPLIT = 3  # after a basis renewal (Adam step 2)


def _ckpt_save(kind: str, root: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    model = shard_bag(kind, _init())
    opt = _make(dict(model.named_parameters()))
    for step in range(SPLIT):
        set_full_grads(model, partial(_grad, step))
        opt.step()
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=os.path.join(root, kind))


def _ckpt_load(kind: str, root: str) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model = shard_bag(kind, _init(seed=7))  # other values: all must come from the checkpoint
    opt = _make(dict(model.named_parameters()))
    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(sd, checkpoint_id=os.path.join(root, kind))
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])
    for step in range(SPLIT, STEPS):
        set_full_grads(model, partial(_grad, step))
        opt.step()
    return full_params(model)


@pytest.mark.parametrize("kind", ["fully_shard", "fsdp2"])
def test_checkpoint_resharded_3_to_2(kind: str, tmp_path) -> None:
    run_distributed(_ckpt_save, 3, kind, str(tmp_path))
    got = run_distributed(_ckpt_load, 2, kind, str(tmp_path))[0]
    want = _plain_run()
    for k in PARAMS:
        assert torch.equal(got[k], want[k]), (kind, k, (got[k] - want[k]).abs().max())


# -- the benchmark's peer --------------------------------------------------------------------


def test_benchmark_says_peer_not_installed(monkeypatch) -> None:
    from repo_packages import register_package

    register_package("benchmarks")
    from benchmarks import bench_soap

    monkeypatch.delenv("VEFSDP_SOAP_REF", raising=False)
    res = bench_soap.run(quick=True)
    assert res["rows"] and all(r["status"].startswith("peer not installed") for r in res["rows"])
