"""NorMuon and Polar Express.

Polar Express: the coefficients are the paper's Algorithm 1 table (written out here),
and the iteration follows its polynomials and improves on Jordan's quintic as a polar
factor. NorMuon: one device against a float64 re-implementation of its update written
here from the paper's equations (with Dion's final rescale, as the optimizer follows
Dion), and against Dion's own NorMuon where ``VEFSDP_DION_SRC`` names its source tree.
Sharded (FSDP2 and fully_shard at W = 2 and 3, FSDP2 + TP at dp 2 x tp 2) and through a
DCP checkpoint saved at W = 3 and loaded at W = 2, NorMuon and Muon with Polar Express
equal the same optimizer on one device fed the same gradients, bit for bit.
"""

from __future__ import annotations

import math
import os
from functools import partial

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from sharded_bag import full_params, owner_moves, set_full_grads, set_grads, shard_bag
from torch import nn

import vefsdp_optim
from vefsdp_optim._math import (
    NS_COEFFICIENTS,
    normuon_normalize_,
    polar_express_coefficients,
    zeropower_via_newtonschulz,
)

# -- Polar Express ----------------------------------------------------------------------

# arXiv 2505.16932, Algorithm 1: the unscaled (a, b, c) of iterations 1-8 (later ones repeat
# the last), a safety factor 1.01 applied as p(x / 1.01) to all but the last, and the
# input scaled by 1 / (1.01 ||X||_F + 1e-7)
PAPER_COEFFICIENTS = [
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
]


def _paper_schedule(steps: int) -> list[tuple[float, float, float]]:
    scaled = [(a / 1.01, b / 1.01**3, c / 1.01**5) for a, b, c in PAPER_COEFFICIENTS[:-1]]
    scaled.append(PAPER_COEFFICIENTS[-1])
    return scaled[:steps] + [scaled[-1]] * max(0, steps - len(scaled))


def _paper_polar_express(g: torch.Tensor, steps: int) -> torch.Tensor:
    """Algorithm 1 of the paper, in its own op order (bfloat16)."""
    x = g.bfloat16()
    if g.size(-2) > g.size(-1):
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) * 1.01 + 1e-7)
    for a, b, c in _paper_schedule(steps):
        s = x @ x.mT
        x = a * x + (b * s + c * s @ s) @ x
    if g.size(-2) > g.size(-1):
        x = x.mT
    return x


def test_polar_express_coefficients_are_the_papers() -> None:
    for steps in (1, 5, 8, 12):
        assert polar_express_coefficients(steps) == tuple(_paper_schedule(steps)), steps
    assert polar_express_coefficients(5)[0] == pytest.approx((8.2051604, -22.901935, 16.460725), rel=1e-6)


def _spread(shape: tuple[int, int], seed: int) -> torch.Tensor:
    """A random matrix whose singular values spread over [1e-3, 1] (gradient-like)."""
    g = torch.Generator().manual_seed(seed)
    m, n = shape
    k = min(m, n)
    u, _ = torch.linalg.qr(torch.randn(m, k, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, k, generator=g, dtype=torch.float64))
    s = torch.logspace(-3, 0, k, dtype=torch.float64)
    return ((u * s) @ v.T).float()


@pytest.mark.parametrize("shape", [(24, 64), (64, 24), (48, 48), (96, 256)])
def test_polar_express_is_a_better_polar_factor(shape: tuple[int, int]) -> None:
    """The largest |singular value - 1| of the result: on Gaussian matrices 5 steps reach
    0.15 (Jordan's quintic plateaus near 0.3), 8 steps 0.01; on a spectrum spread over
    [1e-3, 1] (whose smallest lies below the l = 1e-3 the polynomials start from once
    scaled) 8 steps reach 0.01 and 5 beat Jordan's. Each output singular value is the
    composed polynomials of its input one scaled by 1 / (1.01 ||X||_F), up to bfloat16
    (within 0.1: the smallest of a spread spectrum feel the input's rounding most)."""
    g = torch.Generator().manual_seed(sum(shape))
    for spread, x in ((False, torch.randn(shape, generator=g)), (True, _spread(shape, 1))):
        dev = {}
        for name, coeffs, steps in (("pe5", "polar_express", 5), ("pe8", "polar_express", 8),
                                    ("jordan5", NS_COEFFICIENTS, 5)):
            out = zeropower_via_newtonschulz(x, coeffs, steps).double()
            sv = torch.linalg.svdvals(out)
            dev[name] = float((sv - 1).abs().max())
            if coeffs == "polar_express":
                s = torch.linalg.svdvals(x.double()) / (1.01 * x.double().norm())
                for a, b, c in _paper_schedule(steps):
                    s = a * s + b * s**3 + c * s**5
                assert float((s.abs().sort(descending=True).values - sv).abs().max()) < 0.1, (name, shape)
        assert dev["pe8"] < 0.01 and dev["pe5"] < dev["jordan5"], (spread, dev)
        if not spread:
            assert dev["pe5"] < 0.15 and dev["jordan5"] > 0.25, dev


def _exact_polar_express(g: torch.Tensor, steps: int) -> torch.Tensor:
    """Algorithm 1's iteration in float64 (no rounding to speak of)."""
    x = g.double()
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) * 1.01 + 1e-7)
    for a, b, c in _paper_schedule(steps):
        s = x @ x.mT
        x = a * x + (b * s + c * s @ s) @ x
    return x.mT if tall else x


def test_polar_express_matches_the_papers_algorithm() -> None:
    """Against the paper's iteration in float64: ours (two addmm per step, Muon's op
    order) within 3% in Frobenius norm, closer than the paper's own bfloat16 code (which
    rounds every intermediate) and far from Jordan's quintic; single matrices and batches."""
    from vefsdp_optim._math._newton_schulz import zeropower_via_newtonschulz_batched

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.double() - b).norm() / b.norm())

    g = torch.Generator().manual_seed(3)
    for shape in [(16, 40), (40, 16), (32, 32), (64, 160)]:
        x = torch.randn(shape, generator=g)
        for steps in (5, 9):
            exact = _exact_polar_express(x, steps)
            ours = rel(zeropower_via_newtonschulz(x, "polar_express", steps), exact)
            assert ours < 0.03 and ours <= rel(_paper_polar_express(x, steps), exact), (shape, steps)
            assert rel(zeropower_via_newtonschulz(x, NS_COEFFICIENTS, steps), exact) > 0.15
    xs = torch.randn(3, 12, 20, generator=g)  # tiny batched products may accumulate in bfloat16: 6%
    exact = _exact_polar_express(xs, 5)
    assert rel(zeropower_via_newtonschulz_batched(xs, "polar_express", 5, 1e-7), exact) < 0.06
    assert rel(zeropower_via_newtonschulz_batched(xs, NS_COEFFICIENTS, 5, 1e-7), exact) > 0.15


def test_bad_ns_coefficients_name_what_is_accepted() -> None:
    p = nn.Parameter(torch.zeros(4, 6))
    for cls in (vefsdp_optim.Muon, vefsdp_optim.NorMuon):
        for bad in ("polar", (1.0, 2.0), (1.0, "2", 3.0), None):
            with pytest.raises(ValueError, match=r"3 values \(a, b, c\).*'polar_express'"):
                cls([p], ns_coefficients=bad)
        with pytest.raises(ValueError, match="'polar_express'"):
            cls([{"params": [p], "ns_coefficients": "PolarExpress"}])
        assert cls([p], ns_coefficients="polar_express").defaults["ns_coefficients"] == "polar_express"
    with pytest.raises(ValueError, match="'polar_express'"):
        zeropower_via_newtonschulz(torch.ones(2, 3), ns_coefficients="polarexpress")


def test_muon_polar_express_on_one_device() -> None:
    """Muon(ns_coefficients="polar_express") is torch's Muon update with the Polar Express
    iteration in place of Newton-Schulz."""
    import torch.optim._muon as torch_muon

    torch.manual_seed(0)
    ps = [nn.Parameter(torch.randn(12, 20)), nn.Parameter(torch.randn(30, 8))]
    ref = [p.detach().clone() for p in ps]
    bufs = [torch.zeros_like(p) for p in ps]
    opt = vefsdp_optim.Muon(ps, lr=0.02, ns_coefficients="polar_express")
    for step in range(3):
        grads = [torch.randn(p.shape, generator=torch.Generator().manual_seed(step)) for p in ps]
        for p, gr in zip(ps, grads, strict=True):
            p.grad = gr.clone()
        opt.step()
        for q, buf, gr in zip(ref, bufs, grads, strict=True):
            buf.lerp_(gr, 1 - 0.95)
            o = zeropower_via_newtonschulz(gr.lerp(buf, 0.95), "polar_express", 5, 1e-7)
            q.mul_(1 - 0.02 * 0.1)
            q.add_(o, alpha=-torch_muon._adjust_lr(0.02, None, q.shape))
    for p, q in zip(ps, ref, strict=True):
        assert torch.equal(p.detach(), q)


# -- NorMuon on one device ----------------------------------------------------------------

# name -> (shape, group keys): a grouped-query fused QKV, MoE experts (5: divides neither 2
# nor 3), experts with fused gate/up blocks, an equal split, wide, tall, a conv weight
PARAMS = {
    "qkv": ((16, 8), dict(split_sizes=[8, 4, 4])),
    "experts": ((5, 6, 4), dict(flatten=False)),
    "gate_up": ((3, 12, 5), dict(flatten=False, split_sizes=[6, 3, 3])),
    "equal": ((12, 7), dict(split_sizes=[4, 4, 4])),
    "wide": ((9, 14), {}),
    "tall": ((13, 5), {}),
    "conv": ((6, 3, 2, 2), dict(flatten=True)),
    "bias": ((9,), {}),
}
STEPS = 3


def _init(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, (s, _) in PARAMS.items()}


def _grad(step: int, name: str, shape: tuple[int, ...] | torch.Size | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + sum(map(ord, name)))
    return torch.randn(PARAMS[name][0] if shape is None else shape, generator=g)


def _groups(params: dict[str, torch.Tensor]) -> list[dict]:
    groups = [{"params": [params[k]], **keys} for k, (s, keys) in PARAMS.items() if len(s) >= 2]
    groups.append({"params": [params["bias"]], "use_muon": False})
    return groups


# the optimizers under test: the new optimizer with its defaults (Polar Express,
# spectral_norm, no Nesterov), with torch's Muon settings, and Muon with Polar Express
CONFIGS = {
    "normuon": ("NorMuon", dict(lr=0.02, weight_decay=0.1)),
    "normuon_torch": ("NorMuon", dict(lr=0.02, weight_decay=0.1, ns_coefficients=NS_COEFFICIENTS,
                                      nesterov=True, adjust_lr_fn=None, muon_beta2=0.9)),
    "muon_pe": ("Muon", dict(lr=0.02, weight_decay=0.1, ns_coefficients="polar_express")),
}


def _make(config: str, groups: list[dict]) -> torch.optim.Optimizer:
    cls, kw = CONFIGS[config]
    return getattr(vefsdp_optim, cls)(groups, **kw)


def _blocks(shape: tuple[int, ...], keys: dict) -> list[tuple[tuple, tuple[int, int]]]:
    """The separate matrices of a parameter: (index into its matrix view, (rows, cols))."""
    if len(shape) > 2 and keys.get("flatten") is False:
        lead = [tuple(ix) for ix in torch.cartesian_prod(*[torch.arange(d) for d in shape[:-2]])
                .reshape(-1, len(shape) - 2).tolist()]
        m, n = shape[-2:]
    else:
        lead, (m, n) = [()], (shape[0], math.prod(shape[1:]))
    out = []
    for ix in lead:
        r = 0
        for s in keys.get("split_sizes") or [m]:
            out.append((ix + (slice(r, r + s),), (s, n)))
            r += s
    return out


def _paper_reference(config: str, init: dict[str, torch.Tensor], steps: int = STEPS) -> dict[str, torch.Tensor]:
    """NorMuon from the paper's equations (arXiv 2510.05491, Algorithm 1), float64 past
    the orthogonalization, on every block as its own matrix:

        M_t = b1 M_{t-1} + (1 - b1) G_t            (float32, torch's op order, as Muon)
        O_t = NS(M_t)                              (Nesterov: NS(b1 M_t + (1 - b1) G_t))
        v_t = b2 v_{t-1} + (1 - b2) mean_cols(O_t * O_t)
        Ô_t = O_t / (sqrt(v_t) + 1e-8)             (row-wise)
        W  <- W (1 - lr wd) - lr_adj Ô_t ||O_t||_F / ||Ô_t||_F

    The last line is Dion's (the paper scales Ô_t to RMS 0.2 there): ||O_t||_F kept, the
    shape in lr_adj (spectral_norm: lr sqrt(rows / cols); None: torch's sqrt(max(1, r/c))).
    The bias gets torch's AdamW."""
    _, kw = CONFIGS[config]
    lr, wd = kw["lr"], kw["weight_decay"]
    b1, b2 = kw.get("momentum", 0.95), kw.get("muon_beta2", 0.95)
    nesterov, coeffs = kw.get("nesterov", False), kw.get("ns_coefficients", "polar_express")
    adjust = kw.get("adjust_lr_fn", "spectral_norm")
    w = {k: v.double().clone() for k, v in init.items() if k != "bias"}
    mom = {k: torch.zeros(PARAMS[k][0]) for k in w}
    var: dict[tuple[str, int], torch.Tensor] = {}
    bias = nn.Parameter(init["bias"].clone())
    adam = torch.optim.AdamW([bias], lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd)
    for step in range(steps):
        for k in w:
            g = _grad(step, k)
            mom[k].lerp_(g, 1 - b1)
            u = (g.lerp(mom[k], b1) if nesterov else mom[k]).reshape(-1)
            shape, keys = PARAMS[k]
            view = w[k].view(-1)
            flat_off = 0
            w[k] *= 1 - lr * wd
            for j, (_, (rows, cols)) in enumerate(_blocks(shape, keys)):
                n = rows * cols
                o = zeropower_via_newtonschulz(u[flat_off:flat_off + n].view(rows, cols), coeffs, 5, 1e-7).double()
                v = var.setdefault((k, j), torch.zeros(rows, dtype=torch.float64))
                v.mul_(b2).add_((1 - b2) * (o * o).mean(dim=1))
                o_hat = o / (v.sqrt() + 1e-8)[:, None]
                o_hat *= o.norm() / o_hat.norm().clamp(min=1e-8)
                ratio = math.sqrt(rows / cols) if adjust == "spectral_norm" else math.sqrt(max(1, rows / cols))
                view[flat_off:flat_off + n] -= lr * ratio * o_hat.reshape(-1)
                flat_off += n
        bias.grad = _grad(step, "bias")
        adam.step()
    out = {k: v.float() for k, v in w.items()}
    out["bias"] = bias.detach()
    return out


def _plain_run(config: str, init: dict[str, torch.Tensor], steps: int = STEPS) -> dict[str, torch.Tensor]:
    params = {k: nn.Parameter(v.clone()) for k, v in init.items()}
    opt = _make(config, _groups(params))
    for step in range(steps):
        for k, p in params.items():
            p.grad = _grad(step, k)
        opt.step()
    return {k: p.detach() for k, p in params.items()}


@pytest.mark.parametrize("config", ["normuon", "normuon_torch"])
def test_normuon_equals_the_papers_update(config: str) -> None:
    init = _init()
    got, want = _plain_run(config, init), _paper_reference(config, init)
    for k in PARAMS:
        moved = float((want[k] - init[k]).abs().max())
        assert moved > 1e-3, k
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=2e-6, msg=k)


def test_normuon_normalize_against_float64() -> None:
    g = torch.Generator().manual_seed(5)
    o = torch.randn(7, 11, generator=g).bfloat16()
    v0 = torch.rand(7, generator=g)
    v = v0.clone()
    out = normuon_normalize_(o, v, 0.9)
    od = o.double()
    vd = 0.9 * v0.double() + 0.1 * (od * od).mean(1)
    want = od / (vd.sqrt() + 1e-8)[:, None]
    want *= od.norm() / want.norm()
    torch.testing.assert_close(v.double(), vd, rtol=1e-6, atol=0)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-7)
    buf = torch.empty(100)
    into = normuon_normalize_(o, v0.clone(), 0.9, out=buf[3:80].view(7, 11))
    assert torch.equal(into, out) and into.data_ptr() == buf[3:].data_ptr()
    full = o.float()  # an input of the moment's dtype is not modified (nor aliased by the result)
    kept = full.clone()
    assert torch.equal(normuon_normalize_(full, v0.clone(), 0.9), out) and torch.equal(full, kept)
    zero = normuon_normalize_(torch.zeros(3, 4), torch.zeros(3), 0.95)  # Newton-Schulz of a zero matrix
    assert torch.equal(zero, torch.zeros(3, 4))
    with pytest.raises(ValueError, match="variance must have shape"):
        normuon_normalize_(o, torch.zeros(6), 0.9)
    with pytest.raises(ValueError, match="float32 or wider"):
        normuon_normalize_(o, torch.zeros(7, dtype=torch.bfloat16), 0.9)


def test_normuon_state_signature_and_errors() -> None:
    assert vefsdp_optim.get_optimizer("normuon") is vefsdp_optim.NorMuon
    params = {k: nn.Parameter(v.clone()) for k, v in _init().items()}
    opt = vefsdp_optim.NorMuon(_groups(params))
    for k, p in params.items():
        p.grad = _grad(0, k)
    opt.step()
    st = opt.state[params["gate_up"]]  # 3 experts x (6, 3, 3) rows: 9 blocks
    assert sorted(st) == ["compute", "momentum_buffer"] + sorted(f"variance_neuron.{b}" for b in range(9))
    assert [st[f"variance_neuron.{b}"].shape[0] for b in range(3)] == [6, 3, 3]
    sd = opt.state_dict()
    assert "variance_neuron.0" in sd["state"][0] and sd["param_groups"][0]["muon_beta2"] == 0.95
    other = {k: nn.Parameter(v.clone()) for k, v in _init().items()}
    groups = _groups(other)
    groups[0]["split_sizes"] = [8, 8]  # qkv's blocks differ from the checkpoint's
    opt2 = vefsdp_optim.NorMuon(groups)
    with pytest.raises(ValueError, match=r"variance_neuron.1 has shape \(4,\), expected \(8,\).*split_sizes"):
        opt2.load_state_dict(sd)
    with pytest.raises(ValueError, match=r"muon_beta2 must be a float in \[0, 1\]"):
        vefsdp_optim.NorMuon(_groups(other), muon_beta2=1.5)
    with pytest.raises(ValueError, match="adjust_lr_fn 'spectral' is not supported"):
        vefsdp_optim.NorMuon([{"params": [other["wide"]], "adjust_lr_fn": "spectral"}])
    with pytest.raises(ValueError,
                       match="spectral_norm is not supported; use one of None, 'original', 'match_rms_adamw'"):
        vefsdp_optim.Muon([other["wide"]], adjust_lr_fn="spectral_norm")  # torch's Muon has no such name


def test_torch_save_round_trip_single_device(tmp_path) -> None:
    """Saved after 2 steps with torch.save, loaded (weights_only) into a fresh optimizer:
    the run goes on as if uninterrupted."""
    params = {k: nn.Parameter(v.clone()) for k, v in _init().items()}
    opt = _make("normuon", _groups(params))
    for step in range(2):
        for k, p in params.items():
            p.grad = _grad(step, k)
        opt.step()
    torch.save({"params": {k: p.detach() for k, p in params.items()}, "optim": opt.state_dict()},
               tmp_path / "ckpt.pt")
    sd = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    fresh = {k: nn.Parameter(v.clone()) for k, v in sd["params"].items()}
    opt2 = _make("normuon", _groups(fresh))
    opt2.load_state_dict(sd["optim"])
    assert torch.equal(opt2.state[fresh["qkv"]]["variance_neuron.2"], opt.state[params["qkv"]]["variance_neuron.2"])
    for k, p in fresh.items():
        p.grad = _grad(2, k)
    opt2.step()
    want = _plain_run("normuon", _init())
    for k, p in fresh.items():
        assert torch.equal(p.detach(), want[k]), k


def test_owners_stay_when_a_parameter_has_no_gradient() -> None:
    want = owner_moves(sharded=False, name="NorMuon")
    for got in run_distributed(owner_moves, 2, True, "NorMuon"):
        for k in want:
            assert torch.equal(got[k], want[k]), (k, (got[k] - want[k]).abs().max())


def _dion_src() -> str | None:
    """The benchmarks' one Dion loader (benchmarks/_common.py) finds the checkout."""
    from repo_packages import register_package

    register_package("benchmarks")
    from benchmarks._common import dion_src

    return dion_src("normuon")


@pytest.mark.slow
@pytest.mark.skipif(_dion_src() is None, reason="peer not installed: set VEFSDP_DION_SRC to a checkout of "
                    "github.com/microsoft/dion (the folder holding dion/)")
def test_normuon_equals_dions() -> None:
    """Dion's NorMuon (single device) with our Polar Express as its orthogonalizer (Dion's
    own uses another coefficient table), on wide, tall, split (QKV) and flatten=False
    (experts) parameters: equal up to float32 rounding without momentum, and within the
    bfloat16 rounding of differently scaled momentum with it (Dion sums, torch averages:
    the same direction, rounded differently into Newton-Schulz)."""
    from benchmarks._common import import_dion

    dion = import_dion(_dion_src())

    def ns(x: torch.Tensor, epsilon: object = None) -> torch.Tensor:
        mats = x.reshape(-1, *x.shape[-2:])
        return torch.stack([zeropower_via_newtonschulz(m, "polar_express", 5, 1e-7) for m in mats]).view(x.shape)

    shapes = {"wide": (32, 48), "tall": (40, 24), "qkv": (16, 8), "experts": (3, 6, 4)}
    keys = {"qkv": {"split_sizes": [8, 4, 4]}, "experts": {"flatten": False}}
    for mu, nesterov, tol in ((0.0, False, 5e-7), (0.95, False, 0.1), (0.9, True, 0.1)):
        g = torch.Generator().manual_seed(0)
        init = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
        ours = {k: nn.Parameter(x.clone()) for k, x in init.items()}
        theirs = {k: nn.Parameter(x.clone()) for k, x in init.items()}
        o1 = vefsdp_optim.NorMuon([{"params": [p], **keys.get(k, {})} for k, p in ours.items()],
                                  lr=0.01, momentum=mu, nesterov=nesterov)
        o2 = dion.NorMuon([{"params": [p], **keys.get(k, {})} for k, p in theirs.items()],
                          lr=0.01, mu=mu, nesterov=nesterov, newton_schulz_func=ns)
        for _ in range(4):
            for k, p in ours.items():
                p.grad = torch.randn(p.shape, generator=g)
                theirs[k].grad = p.grad.clone()
            o1.step()
            o2.step()
        for k, x in init.items():
            p, q = ours[k].detach(), theirs[k].detach()
            moved = float((q - x).abs().max())
            # Dion scales a split block's bfloat16 Newton-Schulz result by its lr factor
            # before normalizing (q here: 1 / sqrt(2)), which rounds it to bfloat16 again
            bound = tol if mu == 0 and k != "qkv" else max(tol, 4e-3) * moved
            assert moved > 1e-3 and float((p - q).abs().max()) <= bound, (mu, k)


# -- sharded: FSDP2 and fully_shard at W = 2, 3 -----------------------------------------------


def _sharded_runs(configs: list[str]) -> dict[tuple[str, str], dict[str, torch.Tensor]]:
    out = {}
    for config in configs:
        for kind in ("fsdp2", "fully_shard"):
            model = shard_bag(kind, _init())
            opt = _make(config, _groups(dict(model.named_parameters())))
            for step in range(STEPS):
                set_full_grads(model, partial(_grad, step))
                opt.step()
            out[config, kind] = full_params(model)
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_sharded_equals_one_device(world_size: int) -> None:
    configs = list(CONFIGS)
    got = run_distributed(_sharded_runs, world_size, configs)
    want = {c: _plain_run(c, _init()) for c in configs}
    for (config, kind), full in got[0].items():
        for k in PARAMS:
            assert torch.equal(full[k], want[config][k]), (config, kind, k, (full[k] - want[config][k]).abs().max())


# -- whole matrices batched on their owner ------------------------------------------------------

BATCH_SHAPES = [(64, 96)] * 4 + [(96, 64)] * 3  # sides >= 64: the batched kernels may be used


def _batch_grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    return [torch.randn(s, generator=g) for s in BATCH_SHAPES]


def _batch_run(kind: str, cls: str, steps: int = 3) -> tuple[list[torch.Tensor], int]:
    """Muon / NorMuon over BATCH_SHAPES (plain, FSDP2 or fully_shard): the full
    parameters and how many batched Newton-Schulz calls ran on this rank."""
    import vefsdp_optim._math._muon as muon_module

    g = torch.Generator().manual_seed(9)
    model = nn.ParameterList([nn.Parameter(torch.randn(s, generator=g)) for s in BATCH_SHAPES])
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    elif kind == "fully_shard":
        vefsdp_optim.fully_shard(model)
    kw = dict(ns_coefficients="polar_express") if cls == "NorMuon" else {}
    opt = getattr(vefsdp_optim, cls)(list(model), lr=0.02, **kw)
    calls = []
    orig = muon_module.zeropower_via_newtonschulz_batched
    muon_module.zeropower_via_newtonschulz_batched = lambda *a: calls.append(1) or orig(*a)
    try:
        for step in range(steps):
            set_grads(list(model), _batch_grads(step))
            opt.step()
    finally:
        muon_module.zeropower_via_newtonschulz_batched = orig
    return [p.full_tensor().detach() if hasattr(p, "full_tensor") else p.detach() for p in model], len(calls)


def _batch_sharded() -> dict[tuple[str, str], tuple[list[torch.Tensor], int]]:
    return {(kind, cls): _batch_run(kind, cls) for kind in ("fsdp2", "fully_shard") for cls in ("Muon", "NorMuon")}


def test_whole_matrices_batched_per_owner_keep_every_bit() -> None:
    """The matrices a rank orthogonalizes in one bucket go through Newton-Schulz as one
    batch (where the probe allows): on one device Muon still equals torch.optim.Muon
    (per matrix) bit for bit, and sharded runs (2 and 3 owners: other batch sizes) equal
    one device."""
    g = torch.Generator().manual_seed(9)
    ref = [nn.Parameter(torch.randn(s, generator=g)) for s in BATCH_SHAPES]
    torch_muon = torch.optim.Muon(ref, lr=0.02)
    for step in range(3):
        for p, gr in zip(ref, _batch_grads(step), strict=True):
            p.grad = gr.clone()
        torch_muon.step()
    ours, batched = _batch_run("plain", "Muon")
    assert batched == 6  # 2 shapes x 3 steps
    assert all(torch.equal(a, b.detach()) for a, b in zip(ours, ref, strict=True))
    want = {"Muon": ours, "NorMuon": _batch_run("plain", "NorMuon")[0]}
    for world in (2, 3):
        for (kind, cls), (got, _) in run_distributed(_batch_sharded, world)[0].items():
            assert all(torch.equal(a, b) for a, b in zip(got, want[cls], strict=True)), (world, kind, cls)


def _moment_families(batch: int, rows: int, cols: int, g: torch.Generator):
    """Newton-Schulz results a random probe does not stand for (the probe is normal):
    quantized values, mostly zeros, rank two, constant rows, a zero matrix."""
    yield "normal", torch.randn(batch, rows, cols, generator=g)
    yield "quantized", torch.randint(-127, 128, (batch, rows, cols), generator=g).float() / 127
    yield "zeros", torch.randn(batch, rows, cols, generator=g) * (torch.rand(batch, rows, cols, generator=g) < 0.1)
    yield "rank2", torch.randn(batch, rows, 2, generator=g) @ torch.randn(batch, 2, cols, generator=g)
    yield "rows", torch.randn(batch, rows, 1, generator=g).expand(batch, rows, cols).contiguous()
    yield "zero", torch.zeros(batch, rows, cols)


@pytest.mark.parametrize("shape", [(32, 32), (33, 40), (40, 33), (70, 33), (96, 48), (128, 128), (8, 64),
                                   (70, 5), (257, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_batched_normalization_equals_per_matrix(shape: tuple[int, int], dtype: torch.dtype) -> None:
    """Where the probe allows a batch, normuon_normalize_batched_ equals normuon_normalize_
    on each matrix, bit for bit (update and row second moments), on every family, from
    contiguous and transposed (a tall Newton-Schulz result) batches in bfloat16 (whose
    squares often sum exactly in any order) and in the moment's dtype (which do not);
    below ``BATCH_MIN_DIM`` the guard refuses (see ``normuon_normalize_batched_`` in vefsdp_optim/_math/_normuon.py)."""
    from vefsdp_optim._math._newton_schulz import BATCH_MIN_DIM
    from vefsdp_optim._math._normuon import normuon_batch_exact, normuon_normalize_batched_

    rows, cols = shape
    threads = torch.get_num_threads()
    allowed = [b for b in (2, 3, 8) if normuon_batch_exact(b, rows, cols, dtype, torch.device("cpu"), 0.95, threads)]
    if min(shape) < BATCH_MIN_DIM:
        assert allowed == []
        return
    assert allowed == [2, 3, 8]  # the CPU's last-dim reductions: every batch
    g = torch.Generator().manual_seed(rows * 7 + cols)
    for b in allowed:
        for name, x in _moment_families(b, rows, cols, g):
            for ortho in (x.bfloat16(), x.bfloat16().mT.contiguous().mT, x.to(dtype), x.to(dtype).mT.contiguous().mT):
                start = torch.rand(b, rows, generator=g, dtype=dtype) * (name != "zero")
                want_v, got_v = [v.clone() for v in start], [v.clone() for v in start]
                want = torch.stack([normuon_normalize_(m, v, 0.95) for m, v in zip(ortho, want_v, strict=True)])
                got = normuon_normalize_batched_(ortho, got_v, 0.95)
                assert torch.equal(got, want), (shape, b, name, ortho.stride())
                assert all(torch.equal(u, v) for u, v in zip(got_v, want_v, strict=True)), (shape, b, name)


def test_normuon_batches_the_normalization_and_equals_the_pure_step() -> None:
    """On one device NorMuon normalizes each shape's matrices in one batch and equals
    normuon_step_ (per matrix) on every parameter, bit for bit."""
    import vefsdp_optim._math._normuon as muon_module
    from vefsdp_optim._math import normuon_step_

    g = torch.Generator().manual_seed(9)
    init = [torch.randn(s, generator=g) for s in BATCH_SHAPES]
    params = [nn.Parameter(t.clone()) for t in init]
    opt = vefsdp_optim.NorMuon(params, lr=0.02)
    batches = []
    orig = muon_module.normuon_normalize_batched_
    muon_module.normuon_normalize_batched_ = lambda o, *a, **k: batches.append(tuple(o.shape)) or orig(o, *a, **k)
    try:
        for step in range(3):
            for p, gr in zip(params, _batch_grads(step), strict=True):
                p.grad = gr.clone()
            opt.step()
    finally:
        muon_module.normuon_normalize_batched_ = orig
    assert sorted(set(batches)) == [(3, 96, 64), (4, 64, 96)] and len(batches) == 6
    hp = dict(lr=0.02, weight_decay=0.01, momentum=0.95, nesterov=False, muon_beta2=0.95)
    grads = [_batch_grads(step) for step in range(3)]
    for i, (t, p) in enumerate(zip(init, params, strict=True)):
        ref, buf, vs = t.clone(), torch.zeros_like(t), [torch.zeros(t.shape[0])]
        for step in range(3):
            normuon_step_(ref, grads[step][i], buf, vs, **hp)
        assert torch.equal(p.detach(), ref), i


# -- FSDP2 + tensor parallel, dp 2 x tp 2 ----------------------------------------------------


def _tp_groups(params: list[nn.Parameter], config: str) -> torch.optim.Optimizer:
    mats = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    return _make(config, [{"params": mats}, {"params": rest, "use_muon": False}])


def _train_tp(configs: list[str], steps: int = 3) -> dict[str, float]:
    """FSDP2 + TP on a dp 2 x tp 2 mesh; each step's gathered full gradients replayed on
    one device by the same optimizer: the largest parameter difference per config."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from tp_utils import TP_PLAN, TPBlock, gathered, parallelize

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    worst = {}
    for config in configs:
        torch.manual_seed(0)
        model, ref = TPBlock(), TPBlock()
        ref.load_state_dict(model.state_dict())
        parallelize(model, mesh["tp"], TP_PLAN)
        fully_shard(model, mesh=mesh["dp"])
        opt, ref_opt = _tp_groups(list(model.parameters()), config), _tp_groups(list(ref.parameters()), config)
        worst[config] = 0.0
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
                worst[config] = max(worst[config], float((gathered(p) - q.detach()).abs().max()))
    return worst


def test_fsdp2_tp_2x2_equals_one_device() -> None:
    for r in run_distributed(_train_tp, 4, ["normuon", "muon_pe"]):
        assert r == {"normuon": 0.0, "muon_pe": 0.0}, r


# -- DCP checkpoint: saved at W = 3, loaded at W = 2 ---------------------------------------------

SPLIT = 2


def _ckpt_save(configs: list[str], kind: str, root: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    for config in configs:
        model = shard_bag(kind, _init())
        opt = _make(config, _groups(dict(model.named_parameters())))
        for step in range(SPLIT):
            set_full_grads(model, partial(_grad, step))
            opt.step()
        dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                 checkpoint_id=os.path.join(root, f"{config}-{kind}"))


def _ckpt_load(configs: list[str], kind: str, root: str) -> dict[str, dict[str, torch.Tensor]]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    out = {}
    for config in configs:
        model = shard_bag(kind, _init(seed=7))  # other values: all must come from the checkpoint
        opt = _make(config, _groups(dict(model.named_parameters())))
        sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(sd, checkpoint_id=os.path.join(root, f"{config}-{kind}"))
        set_model_state_dict(model, sd["model"])
        set_optimizer_state_dict(model, opt, sd["optim"])
        for step in range(SPLIT, STEPS):
            set_full_grads(model, partial(_grad, step))
            opt.step()
        out[config] = full_params(model)
    return out


@pytest.mark.parametrize("kind", ["fully_shard", "fsdp2"])
def test_checkpoint_resharded_3_to_2(kind: str, tmp_path) -> None:
    configs = ["normuon", "muon_pe"]
    run_distributed(_ckpt_save, 3, configs, kind, str(tmp_path))
    got = run_distributed(_ckpt_load, 2, configs, kind, str(tmp_path))[0]
    for config in configs:
        want = _plain_run(config, _init())
        for k in PARAMS:
            assert torch.equal(got[config][k], want[k]), (config, kind, k, (got[config][k] - want[k]).abs().max())
