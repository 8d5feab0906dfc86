"""``torch.addmm`` / ``torch.baddbmm`` and ``a @ b.mT`` of bfloat16 CPU matrices with
torch's bits, fast where torch runs its reference loops.

[Note: fast bfloat16 addmm]
On a CPU where oneDNN cannot run bfloat16 products, torch computes them with its own
loops. Such a CPU has no AVX-512 and no AMX, as AMD Zen 3. ``addmm`` of two row-major
matrices then runs a scalar reference loop. ``a @ b.T`` of two row-major matrices runs
a vectorized dot product per output. Both are far slower than torch's float32 products
there, and Newton-Schulz makes three such products per iteration: ``X X^T``, then
``(b A + c A^2)`` and its product with ``X``. ``csrc/bf16_matmul.cpp`` computes each
loop's values in the same order with the same roundings, so its bits are torch's. It
lays them out for the vector units: eight outputs of a row per vector for the first
loop, a 3 x 3 tile of outputs that share each load for the second. The comments in
that file give each loop's order; the speeds are in docs/decisions.md.

Where they run: products of at least ``MIN_WORK`` multiply-adds, with ``a`` and ``b``
row-major (``contiguous``). Other layouts take other torch loops and keep them. Every
side must be at least 2, since torch has matrix-vector paths. CPU bfloat16 only, with no
autograd and not under torch.compile. And only where the kernel equals torch on this
process's torch and CPU. On first use both are run on a fixed set of probes: every
``k mod 4``; for the dot product, ``k`` mod 64 and mod 16; with and without ``c``; 2-D
and batched; sizes on both sides of oneDNN's small-product threshold. Any difference
turns that kernel off for the process, and torch's op runs, as it does where the
library cannot be built. Such a difference comes from a CPU where oneDNN takes bfloat16
products or a torch with other loops. ``VEFSDP_BF16_MATMUL=0`` turns both off.
"""

from __future__ import annotations

import logging
import os
import threading

import torch
from torch import Tensor

__all__ = ["ENV_VAR", "MIN_WORK", "addmm", "fast_addmm_available", "fast_mm_nt_available", "mm_nt"]

logger = logging.getLogger(__name__)

ENV_VAR = "VEFSDP_BF16_MATMUL"

# below this many multiply-adds (m n k per matrix) torch's call costs less than ours (~25
# us against ~6 us to call; break-even near 24**3 on a Zen 3): torch's own op runs
MIN_WORK = 1 << 15

_lock = threading.Lock()
# kernel name -> its operator or None; "why:" + name -> why it is off
_state: dict[str, object] = {}


def _differs(op_name: str, got: Tensor, want: Tensor, shape: str, how: str) -> str | None:
    if torch.equal(got.view(torch.int16), want.view(torch.int16)):
        return None
    return (f"{op_name} differs from torch on a {shape} probe ({how}): this torch or CPU takes "
            "another kernel")


def _probe_addmm(op) -> str | None:
    """Why ``bf16_addmm_out_`` differs from torch's addmm / baddbmm here (None: equal on
    every probe)."""
    g = torch.Generator().manual_seed(20261127)
    # (batch or 0, m, k, n): k mod 4 = 0..3, remainders of 8 columns and 3 rows, products
    # below and above 16**3 (oneDNN's lower bound on CPUs that have it) and one larger
    shapes = [(0, 2, 2, 2), (0, 3, 5, 7), (0, 13, 37, 19), (0, 33, 70, 41), (0, 40, 36, 44),
              (0, 64, 64, 64), (0, 96, 131, 130), (3, 17, 34, 9), (2, 48, 64, 40)]
    for batch, m, k, n in shapes:
        lead = (batch,) if batch else ()
        a = torch.randn(*lead, m, k, generator=g).bfloat16()
        b = torch.randn(*lead, k, n, generator=g).bfloat16()
        c = torch.randn(*lead, m, n, generator=g).bfloat16()
        for beta, alpha in ((0.0, 1.0), (-4.775, 2.0315), (3.4445, 1.0)):
            if batch:
                want = torch.baddbmm(c, a, b, beta=beta, alpha=alpha) if beta else torch.bmm(a, b)
            else:
                want = torch.addmm(c, a, b, beta=beta, alpha=alpha) if beta else torch.mm(a, b)
            got = torch.empty_like(want)
            op(a, b, c if beta else None, alpha, beta, got)
            why = _differs("bf16_addmm_out_", got, want, f"{(*lead, m, k)} @ {(*lead, k, n)}",
                           f"beta={beta}, alpha={alpha}")
            if why:
                return why
    return None


def _probe_mm_nt(op) -> str | None:
    """Why ``bf16_mm_nt_out_`` differs from torch's ``a @ b.mT`` here (None: equal)."""
    g = torch.Generator().manual_seed(20261128)
    # (batch or 0, m, n, k): k mod 64 and mod 16 each part of the dot product, remainders
    # of the 3 x 3 tiles, X X^T (one tensor twice) and two tensors
    shapes = [(0, 2, 2, 2), (0, 3, 4, 17), (0, 13, 19, 37), (0, 33, 41, 70), (0, 64, 64, 64),
              (0, 40, 44, 143), (0, 96, 130, 257), (3, 17, 9, 34), (2, 48, 40, 200)]
    for batch, m, n, k in shapes:
        lead = (batch,) if batch else ()
        a = torch.randn(*lead, m, k, generator=g).bfloat16()
        for b in (torch.randn(*lead, n, k, generator=g).bfloat16(), a):
            want = a @ b.mT
            got = torch.empty_like(want)
            op(a, b, got)
            why = _differs("bf16_mm_nt_out_", got, want, f"{tuple(a.shape)} @ {tuple(b.shape)}.mT",
                           "X X^T" if b is a else "two matrices")
            if why:
                return why
    return None


_PROBES = {"bf16_addmm_out_": _probe_addmm, "bf16_mm_nt_out_": _probe_mm_nt}


def _op(name: str):
    """The kernel ``name`` if it may run in this process, else None (decided once)."""
    if name in _state:
        return _state[name]
    with _lock:
        if name not in _state:
            op, why = None, None
            if os.environ.get(ENV_VAR, "1") == "0":
                why = f"{ENV_VAR}=0"
            else:
                from ._native import fused_unavailable_reason, native_ops

                ops = native_ops()
                if ops is None:
                    why = f"the native library is unavailable: {fused_unavailable_reason()}"
                else:
                    candidate = getattr(ops, name)
                    try:
                        with torch.no_grad():
                            why = _PROBES[name](candidate)
                    # e.g. a build without AVX2 refuses the dot-product order
                    except RuntimeError as e:
                        why = f"{name} cannot run here: {e}"
                    if why is None:
                        op = candidate
            if why is not None:
                logger.info("fast bfloat16 matmul %s off (%s); torch's own runs", name, why)
            _state["why:" + name] = why
            _state[name] = op
    return _state[name]


def fast_addmm_available() -> tuple[bool, str | None]:
    """(whether the addmm kernel runs in this process, why not)."""
    return _op("bf16_addmm_out_") is not None, _state.get("why:bf16_addmm_out_")  # type: ignore[return-value]


def fast_mm_nt_available() -> tuple[bool, str | None]:
    """(whether the ``a @ b.mT`` kernel runs in this process, why not)."""
    return _op("bf16_mm_nt_out_") is not None, _state.get("why:bf16_mm_nt_out_")  # type: ignore[return-value]


_UNDECIDED = object()  # a kernel not probed yet


def _plain(*ts: Tensor) -> bool:
    """CPU bfloat16, row-major, no autograd, not under torch.compile (the kernels have
    no fake implementation to trace; torch's ops compile)."""
    return (all(t.device.type == "cpu" and t.dtype == torch.bfloat16 for t in ts)
            and not torch.compiler.is_compiling()
            and all(t.is_contiguous() for t in ts[:2])
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in ts)))


def mm_nt(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b.mT`` (2-D, or 3-D batches), bit for bit; the kernel of [Note: fast bfloat16
    addmm] where it applies (``a`` and ``b`` row-major, as ``X`` in ``X @ X.T``)."""
    if (_state.get("bf16_mm_nt_out_", _UNDECIDED) is not None  # off: decided once, checked first
            and a.dim() in (2, 3) and b.dim() == a.dim() and a.shape[:-2] == b.shape[:-2]
            and a.shape[-1] == b.shape[-1] and min(a.shape[-2], b.shape[-2], a.shape[-1]) >= 2
            and a.shape[-2] * b.shape[-2] * a.shape[-1] >= MIN_WORK and _plain(a, b)):
        op = _op("bf16_mm_nt_out_")
        if op is not None:
            out = torch.empty((*a.shape[:-1], b.shape[-2]), dtype=torch.bfloat16)
            op(a, b, out)
            return out
    return a @ b.mT


def addmm(c: Tensor, a: Tensor, b: Tensor, *, beta: float = 1.0, alpha: float = 1.0) -> Tensor:
    """``torch.addmm(c, a, b, beta=beta, alpha=alpha)`` (2-D) or ``torch.baddbmm`` (3-D),
    bit for bit; the kernel of [Note: fast bfloat16 addmm] where it applies."""
    batched = a.dim() == 3
    if (_state.get("bf16_addmm_out_", _UNDECIDED) is not None  # off: decided once, checked first
            and a.dim() in (2, 3) and b.dim() == a.dim()
            and min(a.shape[-2], a.shape[-1], b.shape[-1]) >= 2
            and a.shape[-2] * a.shape[-1] * b.shape[-1] >= MIN_WORK
            and c.shape == (*a.shape[:-1], b.shape[-1])
            and (not batched or a.shape[0] == b.shape[0])
            and _plain(a, b, c)):
        op = _op("bf16_addmm_out_")
        if op is not None:
            out = torch.empty(c.shape, dtype=torch.bfloat16)
            op(a, b, c if beta != 0 else None, float(alpha), float(beta), out)
            return out
    if batched:
        return torch.baddbmm(c, a, b, beta=beta, alpha=alpha)
    return torch.addmm(c, a, b, beta=beta, alpha=alpha)
