"""One Shampoo step on a run of whole tiles: block-diagonal Shampoo with grafting.

``shampoo_step_`` is the whole algorithm of :class:`vefsdp_optim.Shampoo` on local
tensors: the momentum and the grafting method's second moment (elementwise), the tiles'
statistics and their inverse fourth roots (per tile), and the grafted, preconditioned
update. The optimizer routes to it each rank's compute slice, a run of whole row bands
(see vefsdp_optim/_shampoo.py), with the slice's tiles; a single
device passes the whole matrix. Tiles never interact, so any run of whole bands gets
the bits of that part of the whole-matrix step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from ._matrix_root import all_finite, matrix_inverse_root

__all__ = ["SHAMPOO_ROOT", "ShampooTile", "shampoo_step_", "shampoo_tiles",
           "shampoo_update_statistics_"]

#: P = L^(-1/4) M R^(-1/4): the exponent of 2-D Shampoo
SHAMPOO_ROOT = 4


def shampoo_tiles(rows: int, cols: int, max_dim: int) -> list[tuple[slice, slice]]:
    """Cut a (rows, cols) matrix into tiles of at most ``max_dim`` x ``max_dim``.

    Tiles are ``max_dim`` on a side except at the bottom and right edges (ragged), and
    listed in row-major tile order: ``(row_slice, col_slice)`` pairs, so
    ``matrix[row_slice, col_slice]`` is a tile. An empty matrix has no tiles.
    """
    for name, value in (("rows", rows), ("cols", cols)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    if isinstance(max_dim, bool) or not isinstance(max_dim, int) or max_dim < 1:
        raise ValueError(f"max_dim must be a positive int, got {max_dim!r}")
    return [
        (slice(r, min(r + max_dim, rows)), slice(c, min(c + max_dim, cols)))
        for r in range(0, rows, max_dim)
        for c in range(0, cols, max_dim)
    ]


class ShampooTile(NamedTuple):
    """One tile of a matrix and its statistics, updated in place by :func:`shampoo_step_`."""

    rows: slice  # of the matrix given to the step
    cols: slice
    L: Tensor  # (r, r) running mean of G G^T
    R: Tensor  # (c, c) running mean of G^T G
    L_inv_root: Tensor  # (r, r) (L / (1 - beta2^t) + epsilon I)^(-1/4); the identity at first
    R_inv_root: Tensor  # (c, c) the same of R


def shampoo_update_statistics_(
    grad: Tensor, tiles: Sequence[ShampooTile], *, step: int | Tensor, beta2: float, epsilon: float,
    start_preconditioning_step: int, precondition_frequency: int, host_step: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Each tile's ``L <- beta2 L + (1 - beta2) G G^T`` and ``R <- beta2 R + (1 - beta2)
    G^T G`` from the tile ``G`` of the (rows, cols) ``grad``, in place; at ``step =
    start_preconditioning_step + k * precondition_frequency`` the inverse roots are
    recomputed (:func:`matrix_inverse_root` of the bias-corrected statistic, written into
    ``L_inv_root`` / ``R_inv_root``). A tile whose gradient is not finite keeps its
    statistics (one NaN would poison them for good); a root that fails keeps the previous
    one. Both are selects on the device (see ``matrix_inverse_root`` in
    vefsdp_optim/_math/_matrix_root.py): nothing is read back to the host.

    ``step`` may be a 0-d tensor on the device (capturable), the bias correction then
    computed there; ``host_step`` (default ``step``) decides when the roots are recomputed.

    Returns ``(skipped tiles, failed roots)``: 0-dim int64 tensors on ``grad``'s device.
    """
    n = _host_count(step, host_step)
    recompute = (n >= start_preconditioning_step
                 and (n - start_preconditioning_step) % precondition_frequency == 0)
    tiles_ok, roots_ok = [], []  # 0-dim bools, counted once at the end
    for tile in tiles:
        stat_l, stat_r = tile.L, tile.R
        gt = grad[tile.rows, tile.cols].to(stat_l.dtype)  # (r, c)
        ok = all_finite(gt)  # 0-dim bool
        # the update's own ops on a new tensor, then the select: the bits of the in-place update
        torch.where(ok, stat_l.mul(beta2).addmm_(gt, gt.T, alpha=1 - beta2), stat_l, out=stat_l)
        torch.where(ok, stat_r.mul(beta2).addmm_(gt.T, gt, alpha=1 - beta2), stat_r, out=stat_r)
        tiles_ok.append(ok)
        if not recompute:
            continue
        bc2 = 1 - beta2**step
        for stat, inv_root in ((stat_l, tile.L_inv_root), (stat_r, tile.R_inv_root)):
            root, ok = matrix_inverse_root(stat / bc2, SHAMPOO_ROOT, epsilon)
            torch.where(ok, root, inv_root, out=inv_root)
            roots_ok.append(ok)
    return _count_false(tiles_ok, grad.device), _count_false(roots_ok, grad.device)


def _host_count(step: int | Tensor, host_step: int | None) -> int:
    """The step count the host decides from: ``host_step``, or ``step`` when it is an int."""
    if host_step is not None:
        return host_step
    if isinstance(step, Tensor):
        raise TypeError("a Tensor step (capturable) needs its count on the host: host_step")
    return step


def _count_false(flags: list[Tensor], device: torch.device) -> Tensor:
    """How many of the 0-dim bool ``flags`` are False: a 0-dim int64 tensor on ``device``."""
    if not flags:
        return torch.zeros((), dtype=torch.int64, device=device)
    return len(flags) - torch.stack(flags).sum()


def shampoo_step_(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor | None,
    tiles: Sequence[ShampooTile],
    *,
    step: int | Tensor,
    lr: float | Tensor,
    betas: tuple[float, float],
    epsilon: float,
    weight_decay: float,
    grafting: str,
    grafting_epsilon: float,
    start_preconditioning_step: int,
    precondition_frequency: int,
    host_step: int | None = None,
) -> tuple[Tensor, Tensor]:
    r"""One step of block-diagonal Shampoo with grafting, in place.

    With ``(beta1, beta2) = betas`` and ``t = step`` (the count after this update, 1 on
    the first call)::

        m <- beta1 m + (1 - beta1) g                       (exp_avg, lerp)
        v <- beta2 v + (1 - beta2) g^2                      (exp_avg_sq; grafting "adam")
        A  = m_hat / (sqrt(v / (1 - beta2^t)) + grafting_epsilon)   (grafting "adam")
           = m_hat                                          (grafting "sgd" or "none")
        p <- p (1 - lr weight_decay)
        per tile: L, R and their roots (shampoo_update_statistics_, from the RAW g)
        t <  start_preconditioning_step, or no tiles:  p <- p - lr A
        t >= start_preconditioning_step, per tile:
            P = L^(-1/4) M R^(-1/4)        (M: the tile of m_hat = m / (1 - beta1^t))
            P <- P ||A_tile||_F / ||P||_F  (grafting "adam" or "sgd")
            p <- p - lr P

    Elements whose moments are not finite count as 0 in the tile products and norms and
    get a NaN update, as torch's AdamW makes them (see ``_preconditioned_update_``). No value
    is read back to the host.

    Args:
        param, grad, exp_avg, exp_avg_sq: one shape, on one device: the (rows, cols)
            matrix (a run of whole row bands of a parameter's (dim 0, rest) view) when
            ``tiles`` are given; any shape without tiles (0-D and 1-D parameters: the
            grafting method alone). ``exp_avg_sq`` is None unless ``grafting="adam"``.
        tiles: the tiles of the matrix (``ShampooTile``: slices into it and the tile's
            statistics, updated in place), e.g. from :func:`shampoo_tiles`.
        grafting: ``"adam"``, ``"sgd"`` or ``"none"``.
        step, lr: ints and floats; or, capturable ([Note: capturable steps] in
            _capturable.py), ``step`` a 0-d float32 tensor on the parameter's device
            and every coefficient computed from it and ``lr`` there (a float ``lr`` is
            made a float32 0-d tensor there first).
        host_step: the step count on the host (default ``step``, then an int): it decides
            when the roots are recomputed and whether the tiles precondition yet.

    Returns ``(tiles whose statistics skipped the step, roots that failed)``: 0-dim int64
    tensors on the parameter's device (zeros without tiles).
    """
    n = _host_count(step, host_step)
    if isinstance(step, Tensor):
        if not isinstance(lr, Tensor):
            lr = torch.full((), lr, dtype=torch.float32, device=param.device)
        # The bias corrections in float64, as the Python floats of capturable=False, which
        # the ops then round to the data's dtype alike: in float32, 1 - 0.999^t is off by
        # 1e-5 (relative) at t = 1, and a root's near-null directions ((0 + epsilon)^(-1/4))
        # amplify that into O(lr) updates
        step = step.double()
    beta1, beta2 = betas
    bc1 = 1 - beta1**step
    denom = _grafting_moments_(grad, exp_avg, exp_avg_sq, step=step, beta1=beta1, beta2=beta2,
                               grafting=grafting, grafting_epsilon=grafting_epsilon)
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    if tiles:
        report = shampoo_update_statistics_(
            grad, tiles, step=step, beta2=beta2, epsilon=epsilon,
            start_preconditioning_step=start_preconditioning_step,
            precondition_frequency=precondition_frequency, host_step=n)
    else:
        zero = torch.zeros((), dtype=torch.int64, device=param.device)
        report = (zero, zero)
    if not tiles or n < start_preconditioning_step:
        _grafted_update_(param, exp_avg, denom, lr=lr, bc1=bc1)
    else:
        _preconditioned_update_(param, exp_avg, denom, tiles, lr=lr, bc1=bc1, grafting=grafting)
    return report


def _grafting_moments_(grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor | None, *,
                       step: int | Tensor, beta1: float, beta2: float, grafting: str,
                       grafting_epsilon: float) -> Tensor | None:
    """The momentum and, for grafting "adam", the second moment, in place; returns Adam's
    denominator ``sqrt(v / (1 - beta2^t)) + grafting_epsilon`` (None for other grafting)."""
    exp_avg.lerp_(grad, 1 - beta1)
    if grafting != "adam":
        return None
    bc2_sqrt = (1 - beta2**step) ** 0.5
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)  # type: ignore[union-attr]
    return (exp_avg_sq.sqrt() / bc2_sqrt).add_(grafting_epsilon)  # type: ignore[union-attr]


def _grafted_update_(param: Tensor, exp_avg: Tensor, denom: Tensor | None, *, lr: float | Tensor,
                     bc1: float | Tensor) -> None:
    """The grafted method alone (torch AdamW's op order for grafting="adam")."""
    if isinstance(bc1, Tensor):  # capturable: the step size on the device
        step_size = lr / bc1
        if denom is not None:
            param.addcdiv_(exp_avg * step_size.neg(), denom)
        else:
            param.sub_(exp_avg * step_size)
    elif denom is not None:
        param.addcdiv_(exp_avg, denom, value=-lr / bc1)
    else:
        param.add_(exp_avg, alpha=-lr / bc1)


def _preconditioned_update_(param: Tensor, exp_avg: Tensor, denom: Tensor | None,
                            tiles: Sequence[ShampooTile], *, lr: float | Tensor,
                            bc1: float | Tensor, grafting: str) -> None:
    """``p <- p - lr P`` per tile, ``P`` the preconditioned momentum at the grafted norm."""
    m_hat = exp_avg / bc1  # (rows, cols)
    graft = m_hat if denom is None else m_hat / denom  # (rows, cols)
    # Elements whose moments are not finite (a NaN or inf gradient reached them) must not
    # spread through the tile products: they count as 0 in the preconditioned direction
    # and its grafting norm, and get a NaN update, so exactly they become NaN, as torch's
    # AdamW makes them. The mask is applied at every step, with no host check of whether
    # any element is bad (as in ``matrix_inverse_root`` in _matrix_root.py): on finite
    # moments the selects change nothing, so the bits are those of the unmasked products.
    # graft (m_hat, or m_hat / denom with denom > 0 or NaN) is finite only where m_hat
    # is: one test covers both
    good = graft.abs() < math.inf  # (rows, cols): finite (NaN compares False)
    zero = m_hat.new_zeros(())
    torch.where(good, m_hat, zero, out=m_hat)  # m_hat and graft are this step's own tensors
    if denom is not None:
        torch.where(good, graft, zero, out=graft)
    update = torch.empty_like(m_hat)  # (rows, cols)
    for tile in tiles:
        rs, cs, l_root, r_root = tile.rows, tile.cols, tile.L_inv_root, tile.R_inv_root
        dtype = l_root.dtype
        direction = l_root @ m_hat[rs, cs].to(dtype) @ r_root
        if grafting != "none":
            target = torch.linalg.vector_norm(graft[rs, cs].to(dtype))
            norm = torch.linalg.vector_norm(direction)
            direction = direction * (target / norm.clamp_min(torch.finfo(dtype).tiny))
        update[rs, cs] = direction
    torch.where(good, update, m_hat.new_full((), math.nan), out=update)
    if isinstance(bc1, Tensor):  # capturable
        param.sub_(update * lr)
    else:
        param.add_(update, alpha=-lr)
