"""The bfloat16 addmm kernel ([Note: fast bfloat16 addmm]): torch's bits on every shape and
value it takes, torch's own op wherever it does not apply or is off, and Newton-Schulz
through it equal to torch.optim.Muon's."""

import logging

import pytest
import torch

from vefsdp_optim._kernels import _bf16_matmul as bm
from vefsdp_optim._kernels import _native as qf
from vefsdp_optim._math import zeropower_via_newtonschulz


def _kernel(name="bf16_addmm_out_"):
    """The raw operator, where torch runs the loop it copies here (else skip: on a CPU
    with oneDNN bfloat16 products, or without a compiler, torch's op is the one used)."""
    ok, why = (bm.fast_addmm_available if name == "bf16_addmm_out_" else bm.fast_mm_nt_available)()
    if not ok:
        pytest.skip(f"the kernel is off here: {why}")
    return getattr(qf.native_ops(), name)


def _same_bits(a, b):
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def _torch(c, a, b, beta, alpha):
    if beta == 0 and alpha == 1:
        return torch.bmm(a, b) if a.dim() == 3 else torch.mm(a, b)
    return (torch.baddbmm if a.dim() == 3 else torch.addmm)(c, a, b, beta=beta, alpha=alpha)


@pytest.mark.parametrize("shape", [(2, 3, 2), (5, 4, 9), (7, 33, 17), (31, 66, 40), (64, 64, 64),
                                   (100, 257, 24), (3, 9, 13, 11)])
@pytest.mark.parametrize("beta,alpha", [(0.0, 1.0), (0.0, -0.5), (-4.775, 2.0315), (3.4445, 1.0), (1.0, 1.0)])
def test_kernel_equals_torch_bitwise(shape, beta, alpha):
    """Every k mod 4, column counts around the 8-wide panels, row counts around the
    3-row tiles, batches; torch's mm / addmm / bmm / baddbmm as the reference."""
    op = _kernel()
    *lead, m, k, n = shape
    g = torch.Generator().manual_seed(sum(shape))
    a = torch.randn(*lead, m, k, generator=g).bfloat16()
    b = torch.randn(*lead, k, n, generator=g).bfloat16()
    c = torch.randn(*lead, m, n, generator=g).bfloat16()
    out = torch.empty(*lead, m, n, dtype=torch.bfloat16)
    op(a, b, c if beta else None, alpha, beta, out)
    assert _same_bits(out, _torch(c, a, b, beta, alpha))


@pytest.mark.parametrize("beta", [0.0, 0.75])
def test_kernel_equals_torch_on_special_values(beta):
    """NaN, infinities, signed zeros, subnormal and huge values: torch's reference loop
    rounds each product and sum alone (a product that overflows is infinite even where
    a fused multiply-add would not be) and fuses only ``beta c + alpha s``."""
    op = _kernel()
    g = torch.Generator().manual_seed(7)
    m, k, n = 19, 45, 21
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-39, -3e-40,
                             2.0 ** 64, -2.0 ** 63, 3e38])
    a = torch.randn(m, k, generator=g)
    b = torch.randn(k, n, generator=g)
    c = torch.randn(m, n, generator=g)
    for t in (a, b, c):
        idx = torch.randint(0, t.numel(), (12,), generator=g)
        t.view(-1)[idx] = specials[torch.randint(0, len(specials), (12,), generator=g)]
    a, b, c = a.bfloat16(), b.bfloat16(), c.bfloat16()
    out = torch.empty(m, n, dtype=torch.bfloat16)
    op(a, b, c if beta else None, 1.5, beta, out)
    assert _same_bits(out, _torch(c, a, b, beta, 1.5))
    # overflow in the product, then the fused epilogue: both as torch's loop rounds them
    a2 = torch.zeros(1, 5)
    b2 = torch.zeros(5, 8)
    a2[0, 0], b2[0, :] = -2.0 ** 63, 2.0 ** 64
    a2[0, 4], b2[4, :] = 2.0 ** 64, 2.0 ** 64
    c2 = torch.full((1, 8), 2.0 ** 127)
    a2, b2, c2 = a2.bfloat16(), b2.bfloat16(), c2.bfloat16()
    for be in (0.0, 2.0):
        out2 = torch.empty(1, 8, dtype=torch.bfloat16)
        op(a2, b2, c2 if be else None, 1.0, be, out2)
        assert _same_bits(out2, _torch(c2, a2, b2, be, 1.0))


@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_bits_do_not_depend_on_threads(threads):
    op = _kernel()
    g = torch.Generator().manual_seed(3)
    a, b, c = (torch.randn(s, generator=g).bfloat16() for s in ((70, 96), (96, 130), (70, 130)))
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = torch.empty(70, 130, dtype=torch.bfloat16)
        op(a, b, c, 2.0315, -4.775, out)
    finally:
        torch.set_num_threads(saved)
    assert _same_bits(out, torch.addmm(c, a, b, beta=-4.775, alpha=2.0315))


class _Spy:
    def __init__(self, op):
        self.op, self.calls = op, 0

    def __call__(self, *args):
        self.calls += 1
        return self.op(*args)


def test_addmm_takes_the_kernel_only_where_it_applies(monkeypatch):
    """Row-major bfloat16 CPU products of at least MIN_WORK multiply-adds take the kernel;
    a transposed operand, a small product, float32, or autograd take torch's op; the
    result is torch's either way."""
    spy = _Spy(_kernel())
    monkeypatch.setitem(bm._state, "bf16_addmm_out_", spy)
    g = torch.Generator().manual_seed(5)
    a, b, c = (torch.randn(s, generator=g).bfloat16() for s in ((40, 48), (48, 36), (40, 36)))
    assert 40 * 48 * 36 >= bm.MIN_WORK
    cases = [
        ((c, a, b), 1),  # row-major: the kernel
        ((c.T.contiguous().T, a, b), 1),  # c in any layout: the kernel reads it as it lies
        ((c, a, b.T.contiguous().T), 0),  # b column-major: torch's dot-product path
        ((c[:4, :4], a[:4, :4], b[:4, :4]), 0),  # under MIN_WORK
        ((c.float(), a.float(), b.float()), 0),  # float32
    ]
    for (cc, aa, bb), calls in cases:
        before = spy.calls
        got = bm.addmm(cc, aa, bb, beta=-4.775, alpha=2.0315)
        assert spy.calls - before == calls, (aa.shape, aa.stride(), bb.stride(), aa.dtype)
        want = torch.addmm(cc, aa, bb, beta=-4.775, alpha=2.0315)
        assert torch.equal(got.float(), want.float())
    leaf = a.clone().requires_grad_()
    before = spy.calls
    bm.addmm(c, leaf, b, beta=1.0).sum().backward()  # autograd: torch's op, which has a gradient
    assert spy.calls == before and leaf.grad is not None


def test_probe_turns_the_kernel_off_where_it_differs(monkeypatch, caplog):
    """A kernel that is off by one bit somewhere is never used: the probe compares it
    with torch first, and torch's op runs."""
    _kernel()
    real = qf.native_ops().bf16_addmm_out_

    class Ops:
        @staticmethod
        def bf16_addmm_out_(a, b, c, alpha, beta, out):
            real(a, b, c, alpha, beta, out)
            if a.shape[-2] == 64:  # one probe shape, one element
                out.view(torch.int16).view(-1)[0] ^= 1

        bf16_mm_nt_out_ = None

    monkeypatch.setattr(bm, "_state", {})
    monkeypatch.setattr(qf, "native_ops", lambda: Ops)
    with caplog.at_level(logging.INFO, logger=bm.__name__):
        ok, why = bm.fast_addmm_available()
    assert not ok and "differs from torch" in why and "(64, 64)" in why
    assert "fast bfloat16 matmul bf16_addmm_out_ off" in caplog.text


def test_env_var_turns_the_kernels_off(monkeypatch):
    monkeypatch.setattr(bm, "_state", {})
    monkeypatch.setenv(bm.ENV_VAR, "0")
    assert bm.fast_addmm_available() == (False, f"{bm.ENV_VAR}=0")
    assert bm.fast_mm_nt_available() == (False, f"{bm.ENV_VAR}=0")


@pytest.mark.parametrize("shape", [(2, 2, 2), (3, 4, 17), (5, 5, 16), (7, 11, 64), (31, 40, 70), (64, 64, 64),
                                   (20, 33, 143), (96, 130, 257), (4, 17, 9, 130)])
@pytest.mark.parametrize("same", [True, False])
def test_mm_nt_kernel_equals_torch_bitwise(shape, same):
    """``a @ b.mT`` (torch's dot-product loop): every part of the dot (k below and above
    64, k mod 16), the 3 x 3 tiles' remainders, X X^T and two matrices, batches."""
    op = _kernel("bf16_mm_nt_out_")
    *lead, m, n, k = shape
    g = torch.Generator().manual_seed(sum(shape) + same)
    a = torch.randn(*lead, m, k, generator=g).bfloat16()
    b = a if same else torch.randn(*lead, n, k, generator=g).bfloat16()
    out = torch.empty(*lead, m, b.shape[-2], dtype=torch.bfloat16)
    op(a, b, out)
    assert _same_bits(out, a @ b.mT)


def test_mm_nt_kernel_on_two_views_of_one_storage():
    """``a`` the first rows of ``b`` (one data pointer, fewer rows): each read as itself."""
    op = _kernel("bf16_mm_nt_out_")
    x = torch.randn(40, 70, generator=torch.Generator().manual_seed(2)).bfloat16()
    for a, b in ((x[:25], x), (x, x[:25])):
        out = torch.empty(a.shape[0], b.shape[0], dtype=torch.bfloat16)
        op(a, b, out)
        assert _same_bits(out, a @ b.mT)


def test_mm_nt_kernel_equals_torch_on_special_values():
    """NaN, infinities, signed zeros, subnormal and huge values; and an overflowing
    product in each part of the dot: fused in the 64-wide and 16-wide parts (finite),
    unfused in the last k mod 16 terms (infinite), as torch's loop computes them."""
    op = _kernel("bf16_mm_nt_out_")
    g = torch.Generator().manual_seed(11)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-39, -3e-40,
                             2.0 ** 64, -2.0 ** 63, 3e38])
    a, b = torch.randn(19, 150, generator=g), torch.randn(23, 150, generator=g)
    for t in (a, b):
        idx = torch.randint(0, t.numel(), (12,), generator=g)
        t.view(-1)[idx] = specials[torch.randint(0, len(specials), (12,), generator=g)]
    a, b = a.bfloat16(), b.bfloat16()
    out = torch.empty(19, 23, dtype=torch.bfloat16)
    op(a, b, out)
    assert _same_bits(out, a @ b.mT)
    for k, first, second in ((128, 0, 64), (32, 0, 8), (17, 0, 16)):  # main, 16-wide, scalar tail
        x = torch.zeros(2, k)
        x[:, first], x[:, second] = -2.0 ** 63, 2.0 ** 64
        y = torch.zeros(2, k)
        y[:, first], y[:, second] = 2.0 ** 64, 2.0 ** 64
        x, y = x.bfloat16(), y.bfloat16()
        out = torch.empty(2, 2, dtype=torch.bfloat16)
        op(x, y, out)
        assert _same_bits(out, x @ y.mT), (k, out, x @ y.mT)


def test_mm_nt_takes_the_kernel_only_where_it_applies(monkeypatch):
    spy = _Spy(_kernel("bf16_mm_nt_out_"))
    monkeypatch.setitem(bm._state, "bf16_mm_nt_out_", spy)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(40, 96, generator=g).bfloat16()
    for a, b, calls in ((x, x, 1), (x[:, :48], x[:, :48], 0), (x.T.contiguous().T, x, 0), (x[:3, :3], x[:3, :3], 0),
                        (x.float(), x.float(), 0)):
        before = spy.calls
        got = bm.mm_nt(a, b)
        assert spy.calls - before == calls, (a.shape, a.stride())
        assert torch.equal(got.float(), (a @ b.mT).float())


@pytest.mark.parametrize("shape", [(96, 200), (200, 96), (128, 128), (50, 70)])
def test_newton_schulz_through_the_kernel_equals_torch_muon(shape):
    """torch.optim.Muon's own Newton-Schulz (torch's addmm) against ours (the kernel's),
    wide, tall and square."""
    _kernel()
    from torch.optim._muon import _zeropower_via_newtonschulz

    g = torch.Generator().manual_seed(shape[0])
    x = torch.randn(shape, generator=g)
    want = _zeropower_via_newtonschulz(x.clone(), (3.4445, -4.775, 2.0315), 5, 1e-7)
    assert _same_bits(zeropower_via_newtonschulz(x), want)
