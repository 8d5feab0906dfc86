"""NorMuon's neuron-wise normalization (Li et al., arXiv 2510.05491), as Dion computes it.

[Note: NorMuon normalization] After Newton-Schulz, each row (output neuron) of the
orthogonalized update ``O`` (m x n) is divided by the root of an exponential moving
average of its mean square, and the result is rescaled to ``O``'s Frobenius norm:

    v <- beta2 v + (1 - beta2) mean_j O_ij^2          (v: m values, the row second moment)
    Ô  = O / (sqrt(v) + eps)   (row-wise)
    Ô <- Ô * ||O||_F / max(||Ô||_F, eps)

The paper's Algorithm 1 scales ``Ô`` to RMS 0.2 (``0.2 sqrt(mn) / ||Ô||_F``) in place of
the last line; Dion keeps ``||O||_F`` and leaves the shape-dependent scale to its
learning-rate adjustment, and so does this function (for an exactly orthogonal ``O``,
``||O||_F = sqrt(min(m, n))``, and Dion's ``adjust_lr="rms_norm"`` turns it into the
paper's scale). These are Dion's formulas (``_normuon_normalization_core``), computed in
float32 or wider in three passes over the matrix: the cast, the row norms ``r_i`` (from
which ``mean_j O_ij^2 = r_i^2 / n``, ``||O||_F = ||r||`` and ``||Ô||_F = ||r / d||`` with
``d = sqrt(v) + eps`` follow), and one multiplication of each row by
``||O||_F / (max(||Ô||_F, eps) d_i)``; Dion's op order (a pass per product and norm) gives
the same values up to float32 rounding.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["NORMUON_EPS", "normuon_normalize_"]

NORMUON_EPS = 1e-8  # Dion's constant, in the denominator and the norm's clamp


def normuon_normalize_(
    ortho: Tensor, variance: Tensor, beta2: float, eps: float = NORMUON_EPS, out: Tensor | None = None,
) -> Tensor:
    """NorMuon's normalization of one orthogonalized matrix ([Note: NorMuon normalization]).

    Args:
        ortho: the (rows, cols) Newton-Schulz result, any float dtype (bfloat16 from Muon's
            iteration); not modified.
        variance: the (rows,) row second moment, float32 or wider: updated in place, and
            the dtype the normalization computes in.
        beta2: its decay, in [0, 1] (Dion's ``muon_beta2``).
        eps: added to ``sqrt(variance)`` and the lower clamp of the new norm.
        out: a contiguous (rows, cols) tensor of ``variance``'s dtype to write into (may
            be a view of a larger buffer); a new one when None.

    Returns:
        ``out`` (or the new tensor): the normalized update.
    """
    if ortho.ndim != 2:
        raise ValueError(f"ortho must be a 2-D matrix, got shape {tuple(ortho.shape)}")
    rows = ortho.shape[0]
    if variance.shape != (rows,):
        raise ValueError(f"variance must have shape ({rows},) for a matrix of shape {tuple(ortho.shape)}, "
                         f"got {tuple(variance.shape)}")
    if not variance.is_floating_point() or variance.dtype.itemsize < 4:
        raise ValueError(f"variance must be float32 or wider, got {variance.dtype}")
    if not 0.0 <= beta2 <= 1.0:
        raise ValueError(f"beta2 must be in [0, 1], got {beta2}")
    if out is None:
        u = ortho.to(variance.dtype, memory_format=torch.contiguous_format, copy=True)  # (rows, cols)
    else:
        if out.shape != ortho.shape or out.dtype != variance.dtype or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous {variance.dtype} tensor of shape {tuple(ortho.shape)}, "
                             f"got {out.dtype} {tuple(out.shape)} (contiguous: {out.is_contiguous()})")
        u = out.copy_(ortho)
    row = torch.linalg.vector_norm(u, dim=-1)  # (rows,): ||O_i.||
    variance.lerp_(row.square() / u.shape[-1], 1 - beta2)  # mean_j O_ij^2
    denom = variance.sqrt().add_(eps)  # (rows,)
    new_norm = torch.linalg.vector_norm(row / denom).clamp_(min=eps)  # ||O / denom||_F
    u.mul_((torch.linalg.vector_norm(row) / new_norm / denom).unsqueeze(-1))
    return u
