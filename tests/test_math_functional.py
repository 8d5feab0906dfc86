"""Each optimizer's mathematics as one pure function on a whole tensor (``vefsdp_optim._math``),
against an independent reference, and each batched form the step loop runs against the
pure function applied block by block, bit for bit.

The references: torch's functional optimizers (``torch.optim.adamw.adamw``,
``torch.optim._muon._single_tensor_muon``) where torch has the algorithm; elsewhere the
algorithm written out here from its paper's formulas, in the library's documented op
order (8-bit Adam), or in float64 (Shampoo, SOAP).
"""

from __future__ import annotations

import pytest
import torch
from torch.optim import _muon as torch_muon
from torch.optim.adam import adam as torch_adam
from torch.optim.adamw import adamw as torch_adamw

from vefsdp_optim._math import (
    NS_COEFFICIENTS,
    Int8Momentum,
    ShampooTile,
    SoapHparams,
    SoapState,
    adam8bit_block_step_,
    adam_foreach_,
    adamw_step_,
    dequantize_blockwise,
    dynamic_code_map,
    muon_adjust_lr,
    muon_orthogonalize,
    muon_step_,
    normuon_normalize_blocks,
    normuon_step_,
    num_blocks,
    polar_express_coefficients,
    quantize_blockwise,
    shampoo_step_,
    shampoo_tiles,
    soap_geometry,
    soap_step_,
    zeropower_via_newtonschulz,
)
from vefsdp_optim._math._muon_int8 import requantize_momentum_

SIGNED, UNSIGNED = dynamic_code_map(True), dynamic_code_map(False)

# ----------------------------------------------------------------------------- AdamW


def _adam_state(shape: tuple[int, ...]) -> list[torch.Tensor]:
    return [torch.zeros(shape), torch.zeros(shape), torch.zeros(shape)]


@pytest.mark.parametrize("amsgrad,maximize", [(False, False), (True, True)])
def test_adamw_step_equals_torch_functional_adamw(amsgrad: bool, maximize: bool) -> None:
    """adamw_step_ on one whole tensor: torch.optim.adamw.adamw's bits (its CPU default,
    the single-tensor form)."""
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(37, 11, generator=gen)
    p_ref = p.clone()
    m, v, vmax = _adam_state(p.shape)
    m_ref, v_ref, vmax_ref = _adam_state(p.shape)
    step_ref = torch.tensor(0.0)
    hp = dict(lr=3e-3, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.05, amsgrad=amsgrad,
              maximize=maximize)
    for t in range(1, 6):
        g = torch.randn(p.shape, generator=gen)
        adamw_step_(p, g, m, v, vmax if amsgrad else None, step=t, **hp)
        torch_adamw([p_ref], [g], [m_ref], [v_ref], [vmax_ref] if amsgrad else [], [step_ref],
                    foreach=False, **hp)
    for a, b in [(p, p_ref), (m, m_ref), (v, v_ref)] + ([(vmax, vmax_ref)] if amsgrad else []):
        assert torch.equal(a, b)


def test_adamw_batched_forms_equal_the_pure_function_per_tensor() -> None:
    """The two batched forms of adamw_step_ the step loop runs: adam_foreach_ (torch's
    multi-tensor Adam over a bucket of slices) and adamw_step_ on one flat store holding
    several parameters end to end (see ``_FlatState`` in vefsdp_optim/_adamw.py): each is adamw_step_ on every
    tensor alone, bit for bit."""
    gen = torch.Generator().manual_seed(1)
    shapes = [(64, 33), (7,), (1, 129), (300,)]
    params = [torch.randn(s, generator=gen) for s in shapes]
    alone = [p.clone() for p in params]
    foreach = [p.clone() for p in params]
    flat = torch.cat([p.reshape(-1) for p in params])
    s_alone = [_adam_state(s) for s in shapes]
    s_foreach = [_adam_state(s) for s in shapes]
    s_flat = _adam_state(flat.shape)
    steps = [torch.tensor(0.0) for _ in shapes]
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, amsgrad=False,
              maximize=False, decoupled=True)
    for t in range(1, 5):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        for p, g, (m, v, _) in zip(alone, grads, s_alone, strict=True):
            adamw_step_(p, g, m, v, None, step=t, **hp)
        adam_foreach_(foreach, grads, [s[0] for s in s_foreach], [s[1] for s in s_foreach], [], steps,
                      foreach=True, **hp)
        adamw_step_(flat, torch.cat([g.reshape(-1) for g in grads]), s_flat[0], s_flat[1], None, step=t,
                    **hp)
    offsets = torch.tensor([0] + [p.numel() for p in params]).cumsum(0).tolist()
    for i, p in enumerate(alone):
        lo, hi = offsets[i], offsets[i + 1]
        assert torch.equal(foreach[i], p) and torch.equal(flat[lo:hi], p.reshape(-1))
        assert torch.equal(s_foreach[i][0], s_alone[i][0]) and torch.equal(s_flat[1][lo:hi],
                                                                             s_alone[i][1].reshape(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize(("amsgrad", "maximize", "decoupled", "wd"),
                         [(False, False, True, 0.1), (True, True, True, 0.1), (False, True, False, 0.1),
                          (True, False, False, 0.1), (False, False, True, 0.0)])
def test_adam_foreach_reads_steps_once_with_torchs_bits(dtype, amsgrad, maximize, decoupled, wd,
                                                        monkeypatch) -> None:
    """adam_foreach_'s own multi-tensor path (see ``_multi_tensor_adam_host_steps_`` in
    vefsdp_optim/_math/_adam.py) against torch.optim.adam.adam(foreach=True) itself: equal
    counts (one scalar per op), then mixed counts (a fresh tensor among stepped ones:
    lists), every flag; bit for bit, the counts included. Tensor hyperparameters and mixed
    dtypes go to torch's own path."""
    import vefsdp_optim._math._adam as ours_module

    def not_torchs(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("adam_foreach_ called torch's Adam: its own path did not run")

    monkeypatch.setattr(ours_module, "_torch_adam", not_torchs)
    gen = torch.Generator().manual_seed(3)
    shapes = [(5, 7), (9,), (1, 3, 4), (1,)]
    ours = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    ref = [p.clone() for p in ours]
    states = {k: [[torch.zeros_like(p) for p in ours] for _ in range(3)] + [[torch.tensor(0.0) for _ in ours]]
              for k in ("ours", "ref")}
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=wd, amsgrad=amsgrad, maximize=maximize)
    for t in range(5):
        grads = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
        idx = list(range(len(shapes))) if t != 2 else [0, 2, 3]  # step 2: one tensor sits out
        if t == 4:
            states["ours"][3][1].zero_()  # and now restarts: a fresh count among stepped ones
            states["ref"][3][1].zero_()
        for name, ps in (("ours", ours), ("ref", ref)):
            m, v, vmax, steps = states[name]
            args = ([ps[i] for i in idx], [grads[i] for i in idx], [m[i] for i in idx], [v[i] for i in idx],
                    [vmax[i] for i in idx] if amsgrad else [], [steps[i] for i in idx])
            if name == "ours":
                adam_foreach_(*args, foreach=True, decoupled=decoupled, **hp)
            else:
                torch_adam(*args, foreach=True, capturable=False, differentiable=False, fused=None,
                                      grad_scale=None, found_inf=None, decoupled_weight_decay=decoupled, **hp)
    for i in range(len(shapes)):
        assert torch.equal(ours[i], ref[i]), i
        for j in range(4):
            assert torch.equal(states["ours"][j][i], states["ref"][j][i]), (i, j)


# ----------------------------------------------------------------------------- 8-bit Adam


def _adam8bit_reference(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *, step: int,
                        lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                        decoupled: bool, block_size: int) -> tuple[torch.Tensor, ...]:
    """One 8-bit Adam(W) step written from vefsdp_optim/_math/_adam8bit_step.py with the reference
    quantizer (quantize_blockwise's binary search): new (p, m codes, m absmax, v codes,
    v absmax). ``m`` and ``v`` are the dequantized float32 moments."""
    f32 = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731 - one rounding to float32
    bc1, bc2 = 1 - beta1**step, 1 - beta2**step
    p, g, m, v = p.clone(), g.clone(), m.clone(), v.clone()
    if weight_decay:
        if decoupled:
            p = p * f32(1 - lr * weight_decay)
        else:
            g = g + p * f32(weight_decay)
    m = m + (g - m) * f32(1 - beta1)
    v = v * f32(beta2) + (g * g) * f32(1 - beta2)
    denom = v.double().sqrt().float() / f32(bc2**0.5) + f32(eps)
    p = p + (m * f32(-(lr / bc1))) / denom
    return (p, *quantize_blockwise(m, SIGNED, block_size), *quantize_blockwise(v, UNSIGNED, block_size))


@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("fused", [False, None])
def test_adam8bit_step_equals_reference(decoupled: bool, fused: bool | None) -> None:
    """adam8bit_block_step_ on one whole tensor (eager ops, or the fused kernel the
    optimizer runs on this machine): the reference's bits, step after step."""
    gen = torch.Generator().manual_seed(2)
    numel, block_size = 1000, 64  # 16 blocks, the last one 40 elements
    p = torch.randn(numel, generator=gen)
    state = [*quantize_blockwise(torch.zeros(numel), SIGNED, block_size),
             *quantize_blockwise(torch.zeros(numel), UNSIGNED, block_size)]
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, decoupled=decoupled,
              block_size=block_size)
    for t in range(1, 6):
        g = torch.randn(numel, generator=gen)
        m = dequantize_blockwise(state[0], state[1], SIGNED, block_size)
        v = dequantize_blockwise(state[2], state[3], UNSIGNED, block_size)
        want = _adam8bit_reference(p, g, m, v, step=t, **hp)
        adam8bit_block_step_(p, g, *state, step=t, signed_code=SIGNED, unsigned_code=UNSIGNED,
                             fused=fused, **hp)
        for got, ref in zip((p, *state), want, strict=True):
            assert torch.equal(got, ref), t
    assert state[1].numel() == num_blocks(numel, block_size) and bool((state[1] > 0).all())


# ----------------------------------------------------------------------------- Shampoo


def _inv_fourth_root(a: torch.Tensor, eps: float) -> torch.Tensor:
    lam, q = torch.linalg.eigh(a + eps * torch.eye(a.shape[0], dtype=a.dtype))
    return q @ torch.diag(lam ** -0.25) @ q.T


def _shampoo_tiles_state(rows: int, cols: int, d: int, dtype: torch.dtype) -> list[ShampooTile]:
    out = []
    for rs, cs in shampoo_tiles(rows, cols, d):
        r, c = rs.stop - rs.start, cs.stop - cs.start
        out.append(ShampooTile(rs, cs, torch.zeros(r, r, dtype=dtype), torch.zeros(c, c, dtype=dtype),
                               torch.eye(r, dtype=dtype), torch.eye(c, dtype=dtype)))
    return out


SHAMPOO_HP = dict(lr=0.05, betas=(0.9, 0.99), epsilon=1e-6, weight_decay=0.01, grafting_epsilon=1e-8,
                  start_preconditioning_step=2, precondition_frequency=2)


@pytest.mark.parametrize("grafting", ["adam", "sgd", "none"])
def test_shampoo_step_equals_float64_reference(grafting: str) -> None:
    """shampoo_step_ on one whole float64 matrix against Shampoo written from its formulas
    (grafted direction, per-tile L^(-1/4) M R^(-1/4) rescaled to the graft's norm)."""
    gen = torch.Generator().manual_seed(3)
    rows, cols, d = 11, 7, 4  # ragged tiles on both edges
    hp = dict(SHAMPOO_HP, grafting=grafting)
    beta1, beta2 = hp["betas"]
    lr, eps = hp["lr"], hp["epsilon"]
    p = torch.randn(rows, cols, generator=gen, dtype=torch.float64)
    p_ref = p.clone()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    tiles = _shampoo_tiles_state(rows, cols, d, torch.float64)
    m_ref, v_ref = torch.zeros_like(p), torch.zeros_like(p)
    stats = {(rs.start, cs.start): [torch.zeros(rs.stop - rs.start, rs.stop - rs.start, dtype=p.dtype),
                                    torch.zeros(cs.stop - cs.start, cs.stop - cs.start, dtype=p.dtype),
                                    torch.eye(rs.stop - rs.start, dtype=p.dtype),
                                    torch.eye(cs.stop - cs.start, dtype=p.dtype)]
             for rs, cs in shampoo_tiles(rows, cols, d)}
    for t in range(1, 7):
        g = torch.randn(rows, cols, generator=gen, dtype=torch.float64)
        shampoo_step_(p, g, m, v if grafting == "adam" else None, tiles, step=t, **hp)
        # the reference
        m_ref = beta1 * m_ref + (1 - beta1) * g
        v_ref = beta2 * v_ref + (1 - beta2) * g * g
        m_hat = m_ref / (1 - beta1**t)
        graft = m_hat / ((v_ref / (1 - beta2**t)).sqrt() + hp["grafting_epsilon"]) if grafting == "adam" else m_hat
        p_ref = p_ref * (1 - lr * hp["weight_decay"])
        update = graft.clone()
        for rs, cs in shampoo_tiles(rows, cols, d):
            st = stats[(rs.start, cs.start)]
            gt = g[rs, cs]
            st[0] = beta2 * st[0] + (1 - beta2) * gt @ gt.T
            st[1] = beta2 * st[1] + (1 - beta2) * gt.T @ gt
            if t >= 2 and t % 2 == 0:
                st[2] = _inv_fourth_root(st[0] / (1 - beta2**t), eps)
                st[3] = _inv_fourth_root(st[1] / (1 - beta2**t), eps)
            if t >= 2:
                direction = st[2] @ m_hat[rs, cs] @ st[3]
                if grafting != "none":
                    direction = direction * graft[rs, cs].norm() / direction.norm()
                update[rs, cs] = direction
        p_ref = p_ref - lr * update
        torch.testing.assert_close(p, p_ref, rtol=1e-9, atol=1e-12)


def test_shampoo_step_on_band_runs_equals_whole_matrix() -> None:
    """The optimizer steps each rank's run of whole row bands with its own tiles
    (see vefsdp_optim/_shampoo.py): the bits of the whole-matrix step."""
    gen = torch.Generator().manual_seed(4)
    rows, cols, d = 10, 9, 4  # bands of 4, 4, 2 rows
    hp = dict(SHAMPOO_HP, grafting="adam")
    p = torch.randn(rows, cols, generator=gen)
    p_runs = p.clone()
    state = [torch.zeros_like(p), torch.zeros_like(p), _shampoo_tiles_state(rows, cols, d, p.dtype)]
    runs = [(0, 4), (4, 10)]
    state_runs = [[torch.zeros(b - a, cols), torch.zeros(b - a, cols), _shampoo_tiles_state(b - a, cols, d, p.dtype)]
                  for a, b in runs]
    for t in range(1, 7):
        g = torch.randn(rows, cols, generator=gen)
        shampoo_step_(p, g, *state, step=t, **hp)
        for (a, b), st in zip(runs, state_runs, strict=True):
            shampoo_step_(p_runs[a:b], g[a:b], *st, step=t, **hp)
    assert torch.equal(p, p_runs)
    assert torch.equal(torch.cat([st[0] for st in state_runs]), state[0])


# ----------------------------------------------------------------------------- SOAP


def test_soap_step_equals_float64_reference() -> None:
    """soap_step_ on one whole float64 matrix (both dims with a factor, full rank) against SOAP written
    from the paper's algorithm: Adam on Q_L^T G Q_R, the update rotated back, the factors'
    running means, a power iteration with QR every precondition_frequency Adam steps."""
    gen = torch.Generator().manual_seed(5)
    rows, cols = 5, 5  # full-rank factors: the eigenvectors are well defined
    hp = SoapHparams(lr=3e-3, betas=(0.95, 0.95), shampoo_beta=-1, eps=1e-8, weight_decay=0.01,
                     precondition_frequency=2, normalize_grads=False, correct_bias=True)
    geo = soap_geometry((rows, cols), 100)
    f64 = dict(dtype=torch.float64)
    p = torch.randn(rows, cols, generator=gen, **f64)
    p_ref = p.clone()
    state = SoapState(torch.zeros(rows, cols, **f64), torch.zeros(rows, cols, **f64),
                      [torch.zeros(rows, rows, **f64), torch.zeros(cols, cols, **f64)], [None, None])
    b1, b2 = hp.betas
    beta = hp.factor_beta
    m, v = torch.zeros(rows, cols, **f64), torch.zeros(rows, cols, **f64)
    fl, fr = torch.zeros(rows, rows, **f64), torch.zeros(cols, cols, **f64)
    ql = qr = None

    def eigvecs(f: torch.Tensor) -> torch.Tensor:  # by decreasing eigenvalue
        return torch.linalg.eigh(f + 1e-30 * torch.eye(f.shape[0], **f64))[1].flip(1)

    def power_step(f: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        order = torch.argsort(torch.diag(q.T @ f @ q), descending=True)
        return torch.linalg.qr(f @ q[:, order])[0], order

    for s in range(1, 8):
        g = torch.randn(rows, cols, generator=gen, **f64)
        soap_step_(p.view(-1), g.view(-1), state, s, hp, geo)
        if s == 1:
            fl, fr = (1 - beta) * g @ g.T, (1 - beta) * g.T @ g
            ql, qr = eigvecs(fl), eigvecs(fr)
            continue
        t = s - 1
        g_rot = ql.T @ g @ qr
        m = b1 * m + (1 - b1) * g_rot
        v = b2 * v + (1 - b2) * g_rot**2
        u = ql @ (m / (v.sqrt() + hp.eps)) @ qr.T
        p_ref = p_ref - hp.lr * (1 - b2**t) ** 0.5 / (1 - b1**t) * u
        p_ref = p_ref - hp.lr * hp.weight_decay * p_ref
        m_orig = ql @ m @ qr.T
        fl, fr = beta * fl + (1 - beta) * g @ g.T, beta * fr + (1 - beta) * g.T @ g
        if t % hp.precondition_frequency == 0:
            ql, order_l = power_step(fl, ql)
            qr, order_r = power_step(fr, qr)
            v = v[order_l][:, order_r]
        m = ql.T @ m_orig @ qr
        torch.testing.assert_close(p, p_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(state.exp_avg_sq, v, rtol=1e-9, atol=1e-14)


# ----------------------------------------------------------------------------- Muon, NorMuon

MUON_HP = dict(lr=0.02, weight_decay=0.1, momentum=0.95, ns_steps=5, eps=1e-7)


def _torch_muon(params: list[torch.Tensor], grads: list[torch.Tensor], bufs: list[torch.Tensor], *,
                nesterov: bool, adjust_lr_fn: str | None = None) -> None:
    torch_muon._single_tensor_muon(params, grads, bufs, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn,
                                   ns_coefficients=NS_COEFFICIENTS, has_complex=False, **MUON_HP)


@pytest.mark.parametrize("nesterov,adjust", [(True, None), (False, "match_rms_adamw"), (True, "original")])
def test_muon_step_equals_torch_functional_muon(nesterov: bool, adjust: str | None) -> None:
    """muon_step_ on one whole matrix: torch.optim._muon._single_tensor_muon's bits."""
    gen = torch.Generator().manual_seed(6)
    for shape in [(48, 40), (40, 96), (7, 3)]:
        p = torch.randn(shape, generator=gen)
        p_ref, buf, buf_ref = p.clone(), torch.zeros(shape), torch.zeros(shape)
        for _ in range(3):
            g = torch.randn(shape, generator=gen)
            muon_step_(p, g, buf, nesterov=nesterov, adjust_lr_fn=adjust, **MUON_HP)
            _torch_muon([p_ref], [g], [buf_ref], nesterov=nesterov, adjust_lr_fn=adjust)
        assert torch.equal(p, p_ref) and torch.equal(buf, buf_ref), shape


@pytest.mark.parametrize("layout", ["split_sizes", "heads", "experts"])
def test_muon_step_blocks_equal_torch_on_separate_blocks(layout: str) -> None:
    """split_sizes (fused QKV), per-head blocks and flatten=False (experts): each block
    exactly torch.optim.Muon's step on it as a separate parameter."""
    gen = torch.Generator().manual_seed(7)
    if layout == "split_sizes":
        shape, kw, cuts = (96, 32), dict(split_sizes=(64, 16, 16)), [(0, 64), (64, 80), (80, 96)]
    elif layout == "heads":  # num_heads=4: split_sizes of rows // 4 each
        shape, kw, cuts = (64, 24), dict(split_sizes=(16,) * 4), [(r, r + 16) for r in range(0, 64, 16)]
    else:
        shape, kw, cuts = (3, 20, 12), dict(flatten=False), [(e, e + 1) for e in range(3)]
    p = torch.randn(shape, generator=gen)
    refs = [p[a:b].clone().squeeze(0) if layout == "experts" else p[a:b].clone() for a, b in cuts]
    buf, bufs = torch.zeros(shape), [torch.zeros_like(r) for r in refs]
    for _ in range(3):
        g = torch.randn(shape, generator=gen)
        muon_step_(p, g, buf, nesterov=True, adjust_lr_fn="match_rms_adamw", **kw, **MUON_HP)
        grads = [g[a:b].squeeze(0) if layout == "experts" else g[a:b].contiguous() for a, b in cuts]
        _torch_muon(refs, grads, bufs, nesterov=True, adjust_lr_fn="match_rms_adamw")
    for (a, b), r in zip(cuts, refs, strict=True):
        assert torch.equal(p[a:b].reshape(r.shape), r), (a, b)


def _polar_express_float64(x: torch.Tensor, steps: int, eps: float) -> torch.Tensor:
    """Polar Express (arXiv 2505.16932, Algorithm 1) in float64 from its coefficients."""
    x = x.double()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (x.norm() * 1.01 + eps)
    for a, b, c in polar_express_coefficients(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def test_muon_step_polar_express_close_to_float64() -> None:
    """ns_coefficients="polar_express": the bfloat16 iteration within bfloat16 rounding of
    the algorithm in float64."""
    gen = torch.Generator().manual_seed(8)
    p = torch.randn(64, 40, generator=gen)
    p0, buf, g = p.clone(), torch.zeros_like(p), torch.randn(64, 40, generator=gen)
    muon_step_(p, g, buf, nesterov=False, ns_coefficients="polar_express", **MUON_HP)
    lr, wd = MUON_HP["lr"], MUON_HP["weight_decay"]
    ortho = (p0 * (1 - lr * wd) - p) / muon_adjust_lr(lr, None, (64, 40))
    want = _polar_express_float64(g * (1 - MUON_HP["momentum"]), 5, MUON_HP["eps"])
    assert (ortho.double() - want).abs().max() < 0.03
    sv = torch.linalg.svdvals(want)  # near-orthogonal: singular values near 1
    assert 0.6 < sv.min() and sv.max() < 1.4, sv


def test_muon_step_int8_momentum_equals_reference() -> None:
    """momentum_dtype=torch.int8: the momentum dequantized, torch's lerp in float32,
    requantized in 256-element blocks (requantize_momentum_; its rule is checked against
    a reference in tests/test_muon_int8.py); then torch's Newton-Schulz and step."""
    gen = torch.Generator().manual_seed(9)
    shape = (40, 33)  # 1320 elements: 6 blocks, the last one 40
    p = torch.randn(shape, generator=gen)
    p_ref = p.clone()
    codes, absmax = quantize_blockwise(torch.zeros(p.numel()), SIGNED, 256)
    state = Int8Momentum(codes, absmax, SIGNED, torch.zeros((), dtype=torch.int64))
    m_codes, m_absmax = codes.clone(), absmax.clone()
    for step in range(3):
        g = torch.randn(shape, generator=gen)
        muon_step_(p, g, state, nesterov=True, **MUON_HP)
        m = dequantize_blockwise(m_codes, m_absmax, SIGNED, 256).view(shape)
        m.lerp_(g, 1 - MUON_HP["momentum"])
        x = torch_muon._zeropower_via_newtonschulz(g.lerp(m, MUON_HP["momentum"]), NS_COEFFICIENTS, 5, 1e-7)
        p_ref.mul_(1 - MUON_HP["lr"] * MUON_HP["weight_decay"])
        p_ref.add_(x, alpha=-muon_adjust_lr(MUON_HP["lr"], None, shape))
        requantize_momentum_(m.reshape(-1), m_codes, m_absmax, code=SIGNED, offset=0, step=step)  # _math/_muon_int8.py
        assert torch.equal(p, p_ref) and torch.equal(state.codes, m_codes) and torch.equal(state.absmax, m_absmax)
        assert int(state.step) == step + 1


def test_int8_momentum_step_must_be_an_int64_tensor() -> None:
    """Int8Momentum.step is the count the rounding's dither runs on, updated in place:
    a Python int or a float tensor would not be, so they are refused by name."""
    codes, absmax = quantize_blockwise(torch.zeros(256), SIGNED, 256)
    p, g = torch.zeros(16, 16), torch.ones(16, 16)
    for bad in (3, torch.tensor(3.0), torch.zeros(1, dtype=torch.int64)):
        with pytest.raises(TypeError, match="Int8Momentum.step must be a 0-dim int64 tensor"):
            muon_step_(p, g, Int8Momentum(codes, absmax, SIGNED, bad), nesterov=True, **MUON_HP)
    step = torch.tensor(7)
    muon_step_(p, g, Int8Momentum(codes, absmax, SIGNED, step), nesterov=True, **MUON_HP)
    assert int(step) == 8


def test_normuon_step_equals_reference() -> None:
    """normuon_step_ on one whole matrix (two row blocks) against NorMuon written from
    Dion's formulas: per block, v <- b2 v + (1 - b2) mean_j O_ij^2, O / (sqrt(v) + 1e-8)
    rescaled to ||O||_F, then lr * sqrt(rows / cols) ("spectral_norm") and decay."""
    gen = torch.Generator().manual_seed(10)
    shape, split, beta2 = (48, 32), (32, 16), 0.95
    p = torch.randn(shape, generator=gen)
    p_ref, buf, buf_ref = p.clone(), torch.zeros(shape), torch.zeros(shape)
    vs = [torch.zeros(32), torch.zeros(16)]
    vs_ref = [torch.zeros(32), torch.zeros(16)]
    lr, wd, mom = MUON_HP["lr"], MUON_HP["weight_decay"], MUON_HP["momentum"]
    for _ in range(3):
        g = torch.randn(shape, generator=gen)
        normuon_step_(p, g, buf, vs, nesterov=False, muon_beta2=beta2, split_sizes=split, **MUON_HP)
        buf_ref.lerp_(g, 1 - mom)
        p_ref.mul_(1 - lr * wd)
        for k, (a, b) in enumerate([(0, 32), (32, 48)]):
            o = zeropower_via_newtonschulz(buf_ref[a:b], "polar_express", 5, 1e-7).float()
            vs_ref[k] = beta2 * vs_ref[k] + (1 - beta2) * (o * o).mean(dim=1)
            o_hat = o / (vs_ref[k].sqrt() + 1e-8)[:, None]
            o_hat = o_hat * o.norm() / o_hat.norm().clamp(min=1e-8)
            p_ref[a:b] -= lr * ((b - a) / shape[1]) ** 0.5 * o_hat
        torch.testing.assert_close(p, p_ref, rtol=1e-5, atol=1e-6)
        for v, v_ref in zip(vs, vs_ref, strict=True):
            torch.testing.assert_close(v, v_ref, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_bucket_ops_equal_the_per_matrix_functions(nesterov: bool) -> None:
    """The step loop's foreach forms of Muon's momentum and apply over a bucket
    (muon_momentum_foreach_, muon_apply_foreach_) are muon_momentum_ and muon_apply_ on
    each tensor, bit for bit: tensors of several sizes (an empty shard, one above the
    pieces of the mixed-dtype add), several adjusted learning rates, bfloat16 and float32
    updates (Muon's and NorMuon's), runs of several learning rates in one tensor, three
    steps."""
    from vefsdp_optim._math import (
        muon_apply_,
        muon_apply_foreach_,
        muon_momentum_,
        muon_momentum_foreach_,
    )
    from vefsdp_optim._math._muon import _ADD_PIECE

    gen = torch.Generator().manual_seed(12)
    sizes = [2048, 0, 1536, 2048, _ADD_PIECE + 4097, 96, 2048, _ADD_PIECE + 4097]
    # one lr, or runs (lo, hi, lr) of blocks of several shapes (muon_apply_'s adjusted_lr)
    lrs = [0.02 * 0.2 * 64, 0.0, 0.02 * 0.2 * 48, 0.02 * 0.2 * 64, 0.5, 0.02,
           [(0, 100, 0.3), (100, 1000, 0.02 * 0.2 * 64), (1000, 2048, 0.3)],
           [(0, 7, 0.1), (7, _ADD_PIECE + 4097, 0.2)]]
    params = [torch.randn(n, generator=gen) for n in sizes]
    ref_params = [p.clone() for p in params]
    bufs = [torch.randn(n, generator=gen) for n in sizes]
    ref_bufs = [b.clone() for b in bufs]
    for step in range(3):
        grads = [torch.randn(n, generator=gen) for n in sizes]
        xs = muon_momentum_foreach_(grads, bufs, momentum=0.95, nesterov=nesterov)
        refs = [muon_momentum_(g, b, momentum=0.95, nesterov=nesterov) for g, b in zip(grads, ref_bufs, strict=True)]
        for x, r, b, rb in zip(xs, refs, bufs, ref_bufs, strict=True):
            assert x.dtype == r.dtype == torch.bfloat16 and torch.equal(x, r) and torch.equal(b, rb)
        updates = [x if step != 1 else x.float() * 1.5 for x in xs]  # NorMuon's float32 updates
        muon_apply_foreach_(params, updates, lrs, lr=0.02, weight_decay=0.1)
        for p, u, a_lr in zip(ref_params, updates, lrs, strict=True):
            muon_apply_(p, u, lr=0.02, weight_decay=0.1, adjusted_lr=a_lr)
        for p, rp in zip(params, ref_params, strict=True):
            assert torch.equal(p, rp), p.numel()


def test_muon_orthogonalize_batched_equals_per_block() -> None:
    """The step loop's batched Newton-Schulz over a bucket (vefsdp_optim._math.
    muon_orthogonalize_batched) is muon_orthogonalize on each input, bit for bit: inputs
    of one block, of equal blocks, of mixed shapes, tall and wide, and blocks below the
    batch guard."""
    from vefsdp_optim._math import muon_orthogonalize_batched

    gen = torch.Generator().manual_seed(11)

    def blocks_of(shapes: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
        out, a = [], 0
        for r, c in shapes:
            out.append((a, r, c))
            a += r * c
        return out

    layouts = [[(32, 40)], [(32, 40)], [(32, 40)] * 3, [(64, 33), (32, 40)], [(64, 33)], [(8, 8)] * 2,
               [(8, 8)], [(33, 70), (33, 70)], [(40, 32)]]
    blocks = [blocks_of(s) for s in layouts]
    updates = [torch.randn(sum(r * c for r, c in s), generator=gen).bfloat16() for s in layouts]
    for ns in [(NS_COEFFICIENTS, 5, 1e-7), ("polar_express", 5, 1e-7)]:
        got = muon_orthogonalize_batched(updates, blocks, *ns)
        for x, b, o in zip(updates, blocks, got, strict=True):
            assert torch.equal(o, muon_orthogonalize(x, b, *ns)), b


def test_muon_orthogonalize_batched_takes_joined_outputs_as_a_view() -> None:
    """Equal whole-block inputs that are consecutive views of one buffer from an aligned
    start (the exchange's joined outputs, ``_JOIN_ALIGN`` in comm/_redistribute.py) are batched as a view of
    that buffer, with no stack; anything else (an unaligned start, a gap) is stacked. The
    bits are muon_orthogonalize's on each input either way."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from vefsdp_optim._math import muon_orthogonalize_batched

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.stacks = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            self.stacks += func.overloadpacket is torch.ops.aten.stack
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(13)
    n, k = 32 * 40, 4
    flat = torch.randn(k * n + 2 * n + 64, generator=gen).bfloat16()
    cases = {"joined": ([flat[j * n:(j + 1) * n] for j in range(k)], 0),
             "unaligned": ([flat[1 + j * n:1 + (j + 1) * n] for j in range(k)], 1),
             "gap": ([flat[j * n:(j + 1) * n] for j in (0, 1, 3, 4)], 1),
             "fresh": ([flat[j * n:(j + 1) * n].clone() for j in range(k)], 1)}
    blocks = [[(0, 32, 40)]] * k
    muon_orthogonalize_batched(cases["fresh"][0], blocks)  # the batch probe's own ops, once
    for name, (updates, stacks) in cases.items():
        with Count() as count:
            got = muon_orthogonalize_batched(updates, blocks)
        assert count.stacks == stacks, name
        for x, o in zip(updates, got, strict=True):
            assert torch.equal(o, muon_orthogonalize(x, [(0, 32, 40)])), name


def test_normuon_orthogonalize_batched_equals_per_block() -> None:
    """NorMuon's batched orthogonalization of a bucket (vefsdp_optim._math.
    normuon_orthogonalize_batched: Newton-Schulz and the normalization, each batched per
    block shape) is muon_orthogonalize then normuon_normalize_blocks on each input, bit
    for bit, the row second moments included, over three steps: the layouts of the
    Newton-Schulz test plus equal-shape whole inputs, tall and wide, an odd shape and
    a float64 moment."""
    from vefsdp_optim._math import normuon_orthogonalize_batched

    gen = torch.Generator().manual_seed(12)
    layouts = [[(32, 40)], [(32, 40)], [(32, 40)] * 3, [(64, 33), (32, 40)], [(64, 33)], [(8, 8)] * 2,
               [(8, 8)], [(33, 70), (33, 70)], [(40, 32)], [(96, 48)], [(96, 48)], [(48, 96)] * 2, [(48, 96)]]
    blocks = []
    for shapes in layouts:
        out, a = [], 0
        for r, c in shapes:
            out.append((a, r, c))
            a += r * c
        blocks.append(out)
    for dtype in (torch.float32, torch.float64):
        ours = [[torch.rand(r, generator=gen, dtype=dtype) for _, r, _ in b] for b in blocks]
        ref = [[v.clone() for v in vs] for vs in ours]
        for _ in range(3):
            updates = [torch.randn(sum(r * c for r, c in s), generator=gen).bfloat16() for s in layouts]
            got = normuon_orthogonalize_batched(updates, blocks, ours, 0.9, dtype, "polar_express", 5, 1e-7)
            for x, b, vs, o in zip(updates, blocks, ref, got, strict=True):
                ortho = muon_orthogonalize(x, b, "polar_express", 5, 1e-7)
                assert torch.equal(o, normuon_normalize_blocks(ortho, b, vs, 0.9, dtype)), (dtype, b)
            assert all(torch.equal(a, b) for va, vb in zip(ours, ref, strict=True) for a, b in zip(va, vb, strict=True))
