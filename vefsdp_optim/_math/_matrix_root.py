"""Shampoo's math: inverse p-th roots of symmetric PSD matrices, and tiling of large matrices."""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["all_finite", "matrix_inverse_root"]


def all_finite(x: Tensor) -> Tensor:
    """Whether every element of ``x`` is finite: a 0-dim bool tensor on ``x``'s device, no
    host read. ``max |x| < inf`` (the maximum of a NaN is NaN): two passes, where
    ``torch.isfinite(x).all()`` takes four on the CPU."""
    if x.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=x.device)
    return x.abs().amax() < math.inf


def matrix_inverse_root(
    a: Tensor, root: int, epsilon: float, *, dtype: torch.dtype = torch.float64
) -> tuple[Tensor, Tensor]:
    """``(A + epsilon I)^(-1/root)`` of a symmetric PSD matrix, by eigendecomposition.

    Computes ``A = Q diag(lam) Q^T`` with ``torch.linalg.eigh`` in ``dtype`` (only the
    lower triangle of ``a`` is read), then ``Q diag((max(lam, 0) + epsilon)^(-1/root)) Q^T``.
    Negative eigenvalues (rounding noise of a PSD matrix) are clamped to 0 first.

    Returns:
        ``(root_matrix, ok)``: ``root_matrix`` has ``a``'s shape and dtype; ``ok`` is a
        0-dim bool tensor on ``a``'s device, False when ``a`` or the result is not finite
        or the decomposition raised; ``root_matrix`` is then the identity and the caller
        should keep its previous root (``torch.where(ok, root_matrix, previous)``). No
        exception is raised for those, and nothing is read back to the host
        (see the comment in the body).
    """
    if not isinstance(a, Tensor):
        raise TypeError(f"a must be a torch.Tensor, got {type(a).__name__}")
    if a.ndim != 2 or a.shape[0] != a.shape[1]:
        raise ValueError(f"a must be a square 2-D matrix, got shape {tuple(a.shape)}")
    if not a.is_floating_point():
        raise TypeError(f"a must have a floating dtype, got {a.dtype}")
    if isinstance(root, bool) or not isinstance(root, int) or root < 1:
        raise ValueError(f"root must be a positive int, got {root!r}")
    if not epsilon >= 0:
        raise ValueError(f"epsilon must be >= 0, got {epsilon!r}")
    # A step must not read a device value back to the host (a CUDA stream sync each
    # time), so the finiteness checks are 0-dim flags on the device, used by selects:
    # a non-finite input is swapped for the identity BEFORE eigh (whose result is then
    # thrown away), so the decomposition never sees a NaN, and the result is the
    # identity wherever ``ok`` is False. On a finite input both selects pick the
    # computed values, so the bits are those of the unchecked computation. What is
    # left is torch's own check inside eigh (a failed decomposition raises, and on
    # CUDA eigh reads its error code back to the host: a sync no torch release in
    # the supported range lets a caller avoid); a raise is still caught, as a failure.
    eye = torch.eye(a.shape[0], dtype=dtype, device=a.device)
    a_work = a.to(dtype)
    finite = all_finite(a_work)  # 0-dim bool
    try:
        eigvals, eigvecs = torch.linalg.eigh(torch.where(finite, a_work, eye))  # (n,), (n, n)
    except (torch.linalg.LinAlgError, RuntimeError):
        return eye.to(a.dtype), torch.zeros((), dtype=torch.bool, device=a.device)
    scale = (eigvals.clamp(min=0) + epsilon) ** (-1.0 / root)  # (n,)
    result = (eigvecs * scale) @ eigvecs.T  # (n, n)
    ok = finite & all_finite(result)
    return torch.where(ok, result, eye).to(a.dtype), ok

