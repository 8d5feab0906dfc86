"""Muon's math: Newton-Schulz orthogonalization (the learning-rate adjustment and the
blocks are in _muon_blocks.py).

The op sequence of ``zeropower_via_newtonschulz`` is the one of ``torch.optim.Muon``
(bfloat16 cast, transpose of tall matrices, division by the clamped Frobenius norm,
then ``ns_steps`` quintic iterations written with two ``addmm``), so that the result
is bit-identical to torch's on the same device. Keep it that way: any reordering, even
an algebraically equal one, changes the bfloat16 rounding. ``ns_coefficients=
"polar_express"`` runs the same iteration with Polar Express's per-iteration
coefficients and input scale instead (see vefsdp_optim/_math/_polar_express.py).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch
from torch import Tensor

from .._kernels import addmm, mm_nt
from ._batch_probe import batch_probe
from ._polar_express import POLAR_EXPRESS, POLAR_EXPRESS_SAFETY, polar_express_coefficients

__all__ = [
    "NS_COEFFICIENTS",
    "NsCoefficients",
    "check_ns_coefficients",
    "NS_EPS",
    "NS_STEPS",
    "newtonschulz_batch_exact",
    "zeropower_via_newtonschulz",
    "zeropower_via_newtonschulz_batched",
]

NS_COEFFICIENTS: tuple[float, float, float] = (3.4445, -4.775, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7
_MAX_NS_STEPS = 100

#: ``(a, b, c)`` of one quintic for every iteration, or ``"polar_express"``
NsCoefficients = tuple[float, float, float] | str


def check_ns_coefficients(ns_coefficients: object) -> NsCoefficients:
    """``ns_coefficients`` as the iteration takes it: a tuple of 3 real numbers
    ``(a, b, c)`` used at every iteration, or ``"polar_express"``
    (see vefsdp_optim/_math/_polar_express.py); ValueError naming what is accepted otherwise."""
    if isinstance(ns_coefficients, str):
        if ns_coefficients == POLAR_EXPRESS:
            return POLAR_EXPRESS
    elif isinstance(ns_coefficients, (tuple, list)) and len(ns_coefficients) == 3 and all(
            isinstance(v, numbers.Real) and not isinstance(v, bool) for v in ns_coefficients):
        return tuple(ns_coefficients)  # type: ignore[return-value]
    raise ValueError(
        f"ns_coefficients must hold exactly 3 values (a, b, c) used at every iteration, or be "
        f"{POLAR_EXPRESS!r} (Polar Express's per-iteration coefficients), got {ns_coefficients!r}")


def _schedule(ns_coefficients: NsCoefficients,
              ns_steps: int) -> tuple[bool, Sequence[tuple[float, float, float]]]:
    """(whether it is Polar Express, the (a, b, c) of each iteration)."""
    if isinstance(ns_coefficients, str):
        check_ns_coefficients(ns_coefficients)
        return True, polar_express_coefficients(ns_steps)
    if len(ns_coefficients) != 3:
        check_ns_coefficients(ns_coefficients)
    return False, (tuple(ns_coefficients),) * ns_steps  # type: ignore[return-value]


def zeropower_via_newtonschulz(
    grad: Tensor,
    ns_coefficients: NsCoefficients = NS_COEFFICIENTS,
    ns_steps: int = NS_STEPS,
    eps: float = NS_EPS,
) -> Tensor:
    """Approximate the orthogonal factor ``U V^T`` of a 2-D matrix ``grad = U S V^T``.

    Runs ``ns_steps`` iterations of the quintic Newton-Schulz map
    ``X <- a X + (b X X^T + c (X X^T)^2) X`` in bfloat16, on the wide orientation of the
    matrix (tall matrices are transposed first and back at the end), after scaling
    ``X`` by its Frobenius norm clamped below at ``eps``.

    Args:
        grad: a 2-D tensor of shape (rows, cols), any float dtype.
        ns_coefficients: ``(a, b, c)`` of the quintic polynomial, or ``"polar_express"``:
            Polar Express's coefficients per iteration, after scaling ``X`` by
            ``1 / (1.01 ||X||_F + eps)`` (see vefsdp_optim/_math/_polar_express.py).
        ns_steps: number of iterations, ``0 <= ns_steps < 100``.
        eps: lower clamp of the norm (guards the all-zero matrix); with Polar Express,
            added to the scaled norm instead, as the paper does.

    Returns:
        A new bfloat16 tensor of shape (rows, cols), bit-identical to
        ``torch.optim.Muon``'s orthogonalization of the same input on the same device.
        ``grad`` is not modified (torch's private function scales a bfloat16 input in
        place; the result is the same).
    """
    if not isinstance(grad, Tensor):
        raise TypeError(f"grad must be a torch.Tensor, got {type(grad).__name__}")
    if grad.ndim != 2:
        raise ValueError(
            f"grad must be a 2-D matrix, got shape {tuple(grad.shape)}; "
            "view higher-dimensional tensors with muon_matrix_view first"
        )
    if isinstance(ns_steps, bool) or not isinstance(ns_steps, int):
        raise TypeError(f"ns_steps must be an int, got {type(ns_steps).__name__}")
    if not 0 <= ns_steps < _MAX_NS_STEPS:
        raise ValueError(f"ns_steps must be in [0, {_MAX_NS_STEPS}), got {ns_steps}")
    polar, schedule = _schedule(ns_coefficients, ns_steps)
    tall = grad.size(0) > grad.size(1)
    x = grad.bfloat16()  # (rows, cols), bf16
    if tall:
        x = x.T  # (cols, rows): iterate on the wide orientation, X X^T is the small Gram
    norm = x.norm() * POLAR_EXPRESS_SAFETY + eps if polar else x.norm().clamp(min=eps)
    # torch's version divides a bfloat16 input in place; ours divides only its own cast
    x = x.div(norm) if grad.dtype == torch.bfloat16 else x.div_(norm)  # not grad's memory
    for a, b, c in schedule:
        # torch's bits (x @ x.T, torch.addmm); faster where torch runs its reference
        # loops ([Note: fast bfloat16 addmm])
        gram = mm_nt(x, x)  # (short, short)
        gram_update = addmm(gram, gram, gram, beta=b, alpha=c)
        x = addmm(x, gram_update, x, beta=a)
    if tall:
        x = x.T
    return x


def zeropower_via_newtonschulz_batched(
    grads: Tensor,
    ns_coefficients: NsCoefficients = NS_COEFFICIENTS,
    ns_steps: int = NS_STEPS,
    eps: float = NS_EPS,
) -> Tensor:
    """``zeropower_via_newtonschulz`` of each ``grads[i]`` of a 3-D batch, with batched
    matmuls (``baddbmm``) in the same op order: the norms (one reduction over the last
    two dims) and their division, then each step's two products for the whole batch.
    Whether the bits equal the per-matrix function's depends on the kernels of the
    device and shape: use it only where :func:`newtonschulz_batch_exact` says so."""
    if not isinstance(grads, Tensor) or grads.ndim != 3:
        raise ValueError("grads must be a 3-D batch of matrices, got "
                         f"{getattr(grads, 'shape', grads)!r}")
    polar, schedule = _schedule(ns_coefficients, ns_steps)
    tall = grads.size(1) > grads.size(2)
    x = grads.bfloat16()  # (batch, rows, cols), bf16
    if tall:
        x = x.mT  # (batch, cols, rows)
    # each matrix's norm in one reduction over its two dims (each output one matrix's
    # reduction; the probe checks its bits against the single matrix's), and a division
    # is exact elementwise, broadcast or not
    norms = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)  # (batch, 1, 1)
    norms = norms * POLAR_EXPRESS_SAFETY + eps if polar else norms.clamp(min=eps)
    x = x.div(norms) if grads.dtype == torch.bfloat16 else x.div_(norms)
    for a, b, c in schedule:
        gram = mm_nt(x, x)  # (batch, short, short): x @ x.mT
        gram_update = addmm(gram, gram, gram, beta=b, alpha=c)  # torch.baddbmm's bits
        x = addmm(x, gram_update, x, beta=a)
    if tall:
        x = x.mT
    return x


#: the shortest side of a matrix that batched Newton-Schulz may take (see
#: ``newtonschulz_batch_exact``)
BATCH_MIN_DIM = 32


def newtonschulz_batch_exact(
    batch: int, rows: int, cols: int, device: torch.device, ns_coefficients: NsCoefficients,
    ns_steps: int, eps: float, threads: int,
) -> bool:
    """Whether the batched Newton-Schulz gives, on ``device`` with ``threads`` intra-op
    threads, the same bits as the per-matrix one for ``batch`` matrices of ``rows x cols``.

    Batched and single matmuls may take different kernels (a naive loop for tiny CPU
    products, another cuBLAS algorithm), so equal bits are checked, not assumed: once per
    shape, on a fixed random batch (never on the data, whose zeros would agree under any
    kernel). Kernels choose by shape, dtype, device and threads, never by value, so one
    check answers for every input of that shape. Except for the smallest products, where a
    check on random data is not enough: on the CPU a bfloat16 product of ``m * n * k <=
    16**3`` multiply-adds leaves oneDNN for another loop in ``addmm`` but not in a batched
    ``baddbmm`` (whose size counts the batch), and a short contraction rounds alike under
    both summation orders on most values. Newton-Schulz's smallest product is ``short**3``
    (the Gram matrix squared), so a matrix whose shorter side is below ``BATCH_MIN_DIM =
    32`` is never batched: every product then has >= 32**3 terms on either kernel and
    contractions of >= 32 terms, whose summation order a random probe shows (the cases
    measured: docs/decisions.md). On the CPU the probe is host work, run by the first step
    that meets each class; on an accelerator it is queued and its answer read later without
    a host sync, the per-matrix path running until then (see
    vefsdp_optim/_math/_batch_probe.py).
    """
    if min(rows, cols) < BATCH_MIN_DIM:
        return False
    device = torch.device(device)

    def run() -> Tensor:
        g = torch.Generator(device=device).manual_seed(rows * 1_000_003 + cols)
        probe = torch.randn(batch, rows, cols, generator=g, device=device)
        want = torch.stack([zeropower_via_newtonschulz(m, ns_coefficients, ns_steps, eps)
                            for m in probe])
        got = zeropower_via_newtonschulz_batched(probe, ns_coefficients, ns_steps, eps)
        return torch.eq(got, want).all()

    key = ("newton-schulz", batch, rows, cols, device, ns_coefficients, ns_steps, eps, threads)
    return batch_probe(key, device, run)
