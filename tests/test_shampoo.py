"""Shampoo: an independent dense reference, world-size independence, robustness, a toy win.

Sharded runs (FSDP2 at W=1..4 and HSDP 2x2, with ragged tile edges) are compared with
the same optimizer on plain, unsharded tensors in one process; one tile is compared
with a dense Shampoo written out below from the formulas in the docstring.
"""

import math
import warnings

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from torch import nn

import vefsdp_optim
from vefsdp_optim import Shampoo

SHAPES = [(10, 7), (3, 9), (1, 5), (2, 3, 4), (6,)]
STEPS = 8
BASE = dict(lr=0.05, max_preconditioner_dim=4, start_preconditioning_step=2, precondition_frequency=2)
CASES = [
    dict(BASE, weight_decay=0.01),
    dict(BASE, grafting="sgd", betas=(0.8, 0.95), precondition_frequency=3),
    dict(BASE, grafting="none", lr=0.01, epsilon=1e-6),
]


def _params(shapes=SHAPES, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g, dtype=dtype) for s in shapes]


def _grads(step, shapes=SHAPES, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(s, generator=g, dtype=dtype) for s in shapes]


def _run_plain(kw, shapes=SHAPES, steps=STEPS, dtype=torch.float32):
    ps = [nn.Parameter(t) for t in _params(shapes, dtype)]
    opt = Shampoo(ps, **kw)
    for step in range(steps):
        for p, gr in zip(ps, _grads(step, shapes, dtype), strict=True):
            p.grad = gr
        opt.step()
    return [p.detach() for p in ps]


def _close(got, want, rtol=1e-5, atol=1e-6):
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


# -- an independent dense reference for one tile ---------------------------------------


def _inv_root(a, eps):
    lam, q = torch.linalg.eigh(a)
    return (q * (lam.clamp(min=0) + eps) ** -0.25) @ q.T


def _dense_shampoo(init, grads, lr, betas, eps, wd, start, freq, grafting, eps_g=1e-8):
    """Shampoo on one matrix smaller than max_preconditioner_dim, float64, by hand."""
    b1, b2 = betas
    w = init.clone()
    m, v = torch.zeros_like(w), torch.zeros_like(w)
    L, R = torch.zeros(w.shape[0], w.shape[0], dtype=w.dtype), torch.zeros(w.shape[1], w.shape[1], dtype=w.dtype)
    Li, Ri = torch.eye(w.shape[0], dtype=w.dtype), torch.eye(w.shape[1], dtype=w.dtype)
    for t, g in enumerate(grads, start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        L = b2 * L + (1 - b2) * g @ g.T
        R = b2 * R + (1 - b2) * g.T @ g
        m_hat = m / (1 - b1**t)
        adam = m_hat / (torch.sqrt(v / (1 - b2**t)) + eps_g)
        graft = adam if grafting == "adam" else m_hat
        if t >= start and (t - start) % freq == 0:
            Li, Ri = _inv_root(L / (1 - b2**t), eps), _inv_root(R / (1 - b2**t), eps)
        if t >= start:
            d = Li @ m_hat @ Ri
            if grafting != "none":
                d = d * graft.norm() / d.norm()
        else:
            d = graft
        w = w * (1 - lr * wd) - lr * d
    return w


@pytest.mark.parametrize("grafting", ["adam", "sgd", "none"])
def test_single_tile_matches_dense_reference(grafting):
    shape, steps = (3, 5), 7
    kw = dict(lr=0.03, betas=(0.85, 0.99), epsilon=1e-6, weight_decay=0.1, max_preconditioner_dim=8,
              precondition_frequency=2, start_preconditioning_step=3, grafting=grafting)
    (got,) = _run_plain(kw, [shape], steps, torch.float64)
    want = _dense_shampoo(_params([shape], torch.float64)[0],
                          [_grads(s, [shape], torch.float64)[0] for s in range(steps)],
                          kw["lr"], kw["betas"], kw["epsilon"], kw["weight_decay"],
                          kw["start_preconditioning_step"], kw["precondition_frequency"], grafting)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    # preconditioning changed the result: the check above is not Adam's
    adam_only = _run_plain(dict(kw, start_preconditioning_step=100), [shape], steps, torch.float64)[0]
    assert (got - adam_only).abs().max() > 1e-4


def test_vectors_and_warmup_are_torch_adamw():
    """1-D params, and matrices before start_preconditioning_step, are torch AdamW(eps=1e-8)."""
    shapes = [(6,), (5, 3)]
    kw = dict(lr=0.02, betas=(0.9, 0.99), weight_decay=0.1, start_preconditioning_step=100)
    got = _run_plain(kw, shapes, steps=5)
    ps = [nn.Parameter(t) for t in _params(shapes)]
    ref = torch.optim.AdamW(ps, lr=0.02, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    for step in range(5):
        for p, gr in zip(ps, _grads(step, shapes), strict=True):
            p.grad = gr
        ref.step()
    for a, b in zip(got, ps, strict=True):
        assert torch.equal(a, b.detach())


def _tiles(state: dict) -> dict:
    """{(band, col): {stat: tensor}} from the flat live keys "{stat}.{band}.{col}"."""
    out: dict = {}
    for k, v in state.items():
        if k.startswith(Shampoo.extra_state_prefixes):
            stat, b, c = k.rsplit(".", 2)
            out.setdefault((int(b), int(c)), {})[stat] = v
    return out


def test_tiles_are_keyed_by_global_band():
    p = nn.Parameter(torch.randn(10, 7))
    opt = Shampoo([p], max_preconditioner_dim=4)
    p.grad = torch.randn(10, 7)
    opt.step()
    tiles = _tiles(opt.state[p])
    assert sorted(tiles) == [(b, c) for b in range(3) for c in range(2)]
    assert tiles[(2, 1)]["L"].shape == (2, 2) and tiles[(2, 1)]["R"].shape == (3, 3)
    assert vefsdp_optim.get_optimizer("shampoo") is Shampoo


def test_state_dict_round_trip(tmp_path):
    shapes = [(10, 7), (6,)]
    kw = dict(BASE, weight_decay=0.01)
    ps = [nn.Parameter(t) for t in _params(shapes)]
    opt = Shampoo(ps, **kw)
    for step in range(3):
        for p, gr in zip(ps, _grads(step, shapes), strict=True):
            p.grad = gr
        opt.step()
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    qs = [nn.Parameter(p.detach().clone()) for p in ps]
    opt2 = Shampoo(qs, **kw)
    opt2.load_state_dict(torch.load(tmp_path / "opt.pt"))
    for step in range(3, STEPS):
        for p, q, gr in zip(ps, qs, _grads(step, shapes), strict=True):
            p.grad, q.grad = gr, gr.clone()
        opt.step()
        opt2.step()
    for p, q in zip(ps, qs, strict=True):
        assert torch.equal(p, q)


# -- sharded parameters equal the single-device run -------------------------------------


class _Bag(nn.Module):
    def __init__(self, init):
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(t.clone()) for t in init])


def _fsdp2_cases(hsdp):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    w = dist.get_world_size()
    mesh = (init_device_mesh("cpu", (2, w // 2), mesh_dim_names=("replicate", "shard")) if hsdp
            else init_device_mesh("cpu", (w,)))
    for kw in CASES:
        model = _Bag(_params())
        fully_shard(model, mesh=mesh)
        ps = list(model.ps)
        opt = Shampoo(ps, **kw)
        for step in range(STEPS):
            for p, gr in zip(ps, _grads(step), strict=True):
                p.grad = distribute_tensor(gr, mesh, p.placements)
            opt.step()
        _close([p.full_tensor() for p in ps], _run_plain(kw))
    return True


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_fsdp2_params_match_single_device(world_size):
    assert all(run_distributed(_fsdp2_cases, world_size, False))


def test_hsdp_2x2_params_match_single_device():
    assert all(run_distributed(_fsdp2_cases, 4, True))


# -- robustness --------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_non_finite_statistic_keeps_previous_root(bad):
    p = nn.Parameter(torch.randn(6, 5))
    opt = Shampoo([p], lr=0.05, max_preconditioner_dim=4, start_preconditioning_step=1,
                  precondition_frequency=1)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        p.grad = torch.randn(6, 5, generator=g)
        opt.step()
    tiles = _tiles(opt.state[p])
    tiles[(0, 0)]["L"][1, 2] = bad
    tiles[(1, 1)]["R"][0, 0] = bad
    before = {k: {n: t.clone() for n, t in tile.items()} for k, tile in tiles.items()}
    p.grad = torch.randn(6, 5, generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # decided on the device: no warning (it would need a host read)
        opt.step()
    assert opt.state[p]["root_failures"].device == p.device and int(opt.state[p]["root_failures"]) == 2
    tiles = _tiles(opt.state[p])
    assert torch.equal(tiles[(0, 0)]["L_inv_root"], before[(0, 0)]["L_inv_root"])
    assert torch.equal(tiles[(1, 1)]["R_inv_root"], before[(1, 1)]["R_inv_root"])
    assert not torch.equal(tiles[(0, 0)]["R_inv_root"], before[(0, 0)]["R_inv_root"])  # still updated
    assert not torch.equal(tiles[(1, 0)]["L_inv_root"], before[(1, 0)]["L_inv_root"])
    assert torch.isfinite(p).all()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            p.grad = torch.randn(6, 5, generator=g)
            opt.step()
    assert torch.isfinite(p).all()
    assert int(opt.state[p]["root_failures"]) == 8 and int(opt.state[p]["skipped_tiles"]) == 0


def test_bad_arguments_raise():
    p = [nn.Parameter(torch.zeros(3, 3))]
    with pytest.raises(ValueError, match=r"grafting must be one of \('adam', 'sgd', 'none'\)"):
        Shampoo(p, grafting="adagrad")
    with pytest.raises(ValueError, match="max_preconditioner_dim must be an int >= 1, got 0"):
        Shampoo(p, max_preconditioner_dim=0)
    with pytest.raises(TypeError, match="precondition_frequency must be an int"):
        Shampoo(p, precondition_frequency=2.5)
    with pytest.raises(ValueError, match="start_preconditioning_step"):
        Shampoo(p, start_preconditioning_step=-1)
    with pytest.raises(ValueError, match="learning rate"):
        Shampoo(p, lr=-1.0)
    with pytest.raises(ValueError, match="beta"):
        Shampoo(p, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="epsilon"):
        Shampoo(p, epsilon=-1.0)
    with pytest.raises(ValueError, match="grafting_epsilon"):
        Shampoo(p, grafting_epsilon=-1.0)
    with pytest.raises(ValueError, match="grafting must be one of"):
        Shampoo([{"params": p, "grafting": "rmsprop"}])
    with pytest.raises(NotImplementedError, match="non-contiguous"):
        Shampoo([nn.Parameter(torch.zeros(4, 3).t())])


# -- an ill-conditioned least-squares problem ------------------------------------------


def _least_squares():
    g = torch.Generator().manual_seed(0)
    n, d, k = 64, 16, 8
    u, _ = torch.linalg.qr(torch.randn(n, d, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    x = ((u * torch.logspace(0, -3, d, dtype=torch.float64)) @ v.T).float()  # condition 1e3
    return x, x @ torch.randn(d, k, generator=g)


def _final_loss(make, steps):
    x, y = _least_squares()
    w = nn.Parameter(torch.zeros(x.shape[1], y.shape[1]))
    opt = make([w])
    for _ in range(steps):
        opt.zero_grad()
        ((x @ w - y) ** 2).sum().backward()
        opt.step()
    return ((x @ w - y) ** 2).sum().item()


LR_GRID = [0.03, 0.1, 0.3, 1.0, 3.0]


def test_beats_adamw_on_ill_conditioned_least_squares():
    steps = 150
    adamw = {lr: _final_loss(lambda ps, lr=lr: torch.optim.AdamW(ps, lr=lr, weight_decay=0.0), steps)
             for lr in LR_GRID}
    shampoo = {lr: _final_loss(lambda ps, lr=lr: Shampoo(ps, lr=lr, start_preconditioning_step=5,
                                                          precondition_frequency=5), steps)
               for lr in LR_GRID}
    best_a, best_s = min(adamw.values()), min(shampoo.values())
    print(f"least squares, {steps} steps: AdamW best {best_a:.3e} (lr grid {adamw}); "
          f"Shampoo best {best_s:.3e} (lr grid {shampoo})")
    assert best_s < 0.2 * best_a


# -- this library's fully_shard (planned RaggedShard layout) -----------------------------


def _fully_shard():
    fn = getattr(vefsdp_optim, "fully_shard", None)
    if fn is None:
        from vefsdp_optim._fsdp import fully_shard as fn
    return fn


class _Linear(_Bag):
    def forward(self, gs):  # d(loss)/d(p) = g for every parameter
        return sum((p * g).sum() for p, g in zip(self.ps, gs, strict=True))


def _fully_shard_cases():
    """Lockstep with a plain run fed the gradients fully_shard produced (its averaging
    over ranks may round them, and near-singular statistics amplify any difference)."""
    for kw in CASES[:2]:
        model = _Linear(_params())
        _fully_shard()(model)
        ps = list(model.ps)
        opt = Shampoo(ps, **kw)
        ref = [nn.Parameter(t) for t in _params()]
        ref_opt = Shampoo(ref, **kw)
        for step in range(STEPS):
            opt.zero_grad()
            model(_grads(step)).backward()
            for p, q in zip(ps, ref, strict=True):
                q.grad = p.grad.full_tensor()
            opt.step()
            ref_opt.step()
        _close([p.full_tensor() for p in ps], [q.detach() for q in ref])
    return True


@pytest.mark.parametrize("world_size", [1, 3])
def test_fully_shard_params_match_single_device(world_size):
    assert all(run_distributed(_fully_shard_cases, world_size))
