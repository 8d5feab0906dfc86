"""Muon's math: Newton-Schulz orthogonalisation and the learning-rate adjustment.

The op sequence of ``zeropower_via_newtonschulz`` is the one of ``torch.optim.Muon``
(bfloat16 cast, transpose of tall matrices, division by the clamped Frobenius norm,
then ``ns_steps`` quintic iterations written with two ``addmm``), so that the result
is bit-identical to torch's on the same device. Keep it that way: any reordering, even
an algebraically equal one, changes the bfloat16 rounding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "NS_COEFFICIENTS",
    "NS_EPS",
    "NS_STEPS",
    "muon_adjust_lr",
    "muon_cost",
    "muon_matrix_view",
    "zeropower_via_newtonschulz",
]

NS_COEFFICIENTS: tuple[float, float, float] = (3.4445, -4.775, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7
_MAX_NS_STEPS = 100


def zeropower_via_newtonschulz(
    grad: Tensor,
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
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
        ns_coefficients: ``(a, b, c)`` of the quintic polynomial.
        ns_steps: number of iterations, ``0 <= ns_steps < 100``.
        eps: lower clamp of the norm (guards the all-zero matrix).

    Returns:
        A new bfloat16 tensor of shape (rows, cols), bit-identical to
        ``torch.optim.Muon``'s orthogonalisation of the same input on the same device.
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
    if len(ns_coefficients) != 3:
        raise ValueError(
            f"ns_coefficients must hold exactly 3 values (a, b, c), got {ns_coefficients!r}"
        )
    if isinstance(ns_steps, bool) or not isinstance(ns_steps, int):
        raise TypeError(f"ns_steps must be an int, got {type(ns_steps).__name__}")
    if not 0 <= ns_steps < _MAX_NS_STEPS:
        raise ValueError(f"ns_steps must be in [0, {_MAX_NS_STEPS}), got {ns_steps}")
    a, b, c = ns_coefficients
    tall = grad.size(0) > grad.size(1)
    x = grad.bfloat16()  # (rows, cols), bf16
    if x is grad:
        x = x.clone()  # torch's version divides a bfloat16 input in place; ours never does
    if tall:
        x = x.T  # (cols, rows): iterate on the wide orientation, X X^T is the small Gram
    x.div_(x.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram = x @ x.T  # (short, short)
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, gram_update, x, beta=a)
    if tall:
        x = x.T
    return x


def muon_matrix_view(shape: Sequence[int]) -> tuple[int, int]:
    """The (rows, cols) matrix Muon orthogonalises for a parameter of ``shape``.

    A 2-D shape is itself; a tensor of more dims is viewed as (dim 0, product of the
    rest), e.g. a conv weight (out, in, kh, kw) -> (out, in * kh * kw). This is the
    row-major reshape, so the flat storage is unchanged.
    """
    dims = tuple(shape)
    if len(dims) < 2:
        raise ValueError(
            f"Muon needs a tensor of at least 2 dims, got shape {dims}; "
            "optimise 0-D and 1-D parameters with an elementwise optimizer"
        )
    if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in dims):
        raise ValueError(f"shape must hold non-negative ints, got {dims}")
    return dims[0], math.prod(dims[1:])


def muon_cost(shape: Sequence[int]) -> float:
    """Relative cost ``m * n * min(m, n)`` of Newton-Schulz on the ``muon_matrix_view``
    of ``shape`` (used to balance owners)."""
    m, n = muon_matrix_view(shape)
    return float(m) * n * min(m, n)


def muon_adjust_lr(lr: float, adjust_lr_fn: str | None, shape: Sequence[int]) -> float:
    """Muon's learning rate for a parameter of ``shape``, as ``torch.optim.Muon`` scales it.

    ``None`` or ``"original"``: ``lr * sqrt(max(1, rows / cols))`` (Keller Jordan's);
    ``"match_rms_adamw"``: ``lr * 0.2 * sqrt(max(rows, cols))`` (Moonshot's). For a
    2-D shape this equals torch's ``_adjust_lr``; a shape of more dims uses its
    ``muon_matrix_view`` (the matrix actually orthogonalised), not its first two dims.
    """
    rows, cols = muon_matrix_view(shape)
    if rows == 0 or cols == 0:
        raise ValueError(f"Muon needs a non-empty matrix, got shape {tuple(shape)}")
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    else:
        raise ValueError(
            f"adjust_lr_fn must be None, 'original' or 'match_rms_adamw', got {adjust_lr_fn!r}"
        )
    return lr * ratio
