"""SOAP's math (arXiv 2409.11321): Adam in the eigenbasis of Shampoo's preconditioner.

Pure functions on one whole tensor (or, for a tensor without factors, any slice of one):
the geometry the factors act on, the factor update, the eigenbasis (an eigendecomposition
first, then one power iteration with QR), the rotations into and out of the basis, and
one whole SOAP step. The numerics are those of the reference implementation
(github.com/nikhilvyas/SOAP, ``soap.py``), in its op order.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .._torch_compat import tensordot
from ._matrix_root import all_finite

__all__ = [
    "SOAP_DATA_FORMATS",
    "SoapGeometry",
    "SoapHparams",
    "SoapState",
    "soap_eigenbasis",
    "soap_geometry",
    "soap_power_iteration",
    "soap_project",
    "soap_project_back",
    "soap_step_",
    "soap_update_factors_",
]

SOAP_DATA_FORMATS = ("channels_first", "channels_last")

# SOAP keeps one factor (Shampoo's L, R, ...: a d x d running mean of the gradient's
# outer products over every other dim) per dim of a tensor's *work shape* whose size is
# at most max_precond_dim; a larger dim has none and is left unrotated, as in the
# reference (it does not tile). The work shape is the tensor's shape, except:
#   - 1-D tensors have a factor only with precondition_1d (and n <= max_precond_dim);
#   - merge_dims merges consecutive dims while their product stays <= max_precond_dim
#     (a dim larger than it stays alone); a 0-D tensor then becomes (1,);
#   - data_format="channels_last" with merge_dims views a 4-D tensor permuted
#     (0, 3, 1, 2) before merging.
# The moments live in the work shape. A tensor with a factor (or with normalize_grads,
# a mean over the whole update) needs the whole tensor on one rank; one without is Adam
# element by element and takes any slice.


@dataclass(frozen=True, slots=True)
class SoapGeometry:
    """How SOAP views one tensor (see the comment above)."""

    shape: tuple[int, ...]  # the parameter's shape
    work_shape: tuple[int, ...]  # the shape the factors act on
    channels_last: bool  # a 4-D tensor permuted (0, 3, 1, 2) before the reshape to work_shape
    preconditioned: tuple[bool, ...]  # per work dim: whether it has a factor

    def __post_init__(self) -> None:
        if len(self.preconditioned) != len(self.work_shape):
            raise ValueError(f"preconditioned {self.preconditioned} must have one entry per dim of "
                             f"work_shape {self.work_shape}")
        if math.prod(self.work_shape) != math.prod(self.shape):
            raise ValueError(f"work_shape {self.work_shape} must hold the {math.prod(self.shape)} "
                             f"elements of shape {self.shape}")
        if self.channels_last and len(self.shape) != 4:
            raise ValueError(f"channels_last applies to 4-D tensors, got shape {self.shape}")

    @property
    def has_factors(self) -> bool:
        return any(self.preconditioned)

    @property
    def factor_dims(self) -> tuple[int, ...]:
        """The work dims with a factor."""
        return tuple(i for i, p in enumerate(self.preconditioned) if p)

    def to_work(self, x: Tensor) -> Tensor:
        """``x`` (any tensor of the parameter's elements in flat order) in the work shape."""
        x = x.reshape(self.shape)
        if self.channels_last:
            x = x.permute(0, 3, 1, 2)
        return x.reshape(self.work_shape)

    def from_work(self, x: Tensor) -> Tensor:
        """A work-shaped ``x`` back in the parameter's shape."""
        if self.channels_last:
            n, h, w, c = self.shape
            return x.reshape(n, c, h, w).permute(0, 2, 3, 1)
        return x.reshape(self.shape)


def _merged(shape: Sequence[int], max_precond_dim: int) -> tuple[int, ...]:
    out: list[int] = []
    run = 1
    for d in shape:
        if run * d > max_precond_dim:
            if run > 1:
                out.append(run)
                run = d
            else:
                out.append(d)
                run = 1
        else:
            run *= d
    if run > 1 or not out:
        out.append(run)
    return tuple(out)


def soap_geometry(shape: Sequence[int], max_precond_dim: int, merge_dims: bool = False,
                  precondition_1d: bool = False,
                  data_format: str = "channels_first") -> SoapGeometry:
    """The work shape and factor dims of a tensor of ``shape`` (see ``SoapGeometry``)."""
    shape = tuple(int(d) for d in shape)
    if data_format not in SOAP_DATA_FORMATS:
        raise ValueError(f"data_format must be one of {SOAP_DATA_FORMATS}, got {data_format!r}")
    if len(shape) == 1:
        return SoapGeometry(shape, shape, False, (precondition_1d and shape[0] <= max_precond_dim,))
    channels_last = merge_dims and data_format == "channels_last" and len(shape) == 4
    work = shape
    if merge_dims:
        seen = (shape[0], shape[3], shape[1], shape[2]) if channels_last else shape
        work = _merged(seen, max_precond_dim)
    return SoapGeometry(shape, work, channels_last, tuple(d <= max_precond_dim for d in work))


@dataclass(frozen=True, slots=True)
class SoapHparams:
    """One param group's SOAP hyperparameters (the reference's names)."""

    lr: float | Tensor
    betas: tuple[float, float]
    shampoo_beta: float  # < 0: betas[1]
    eps: float
    weight_decay: float
    precondition_frequency: int
    normalize_grads: bool
    correct_bias: bool

    def __post_init__(self) -> None:
        if not isinstance(self.lr, Tensor) and not self.lr >= 0:  # a Tensor's: SOAP's constructor
            raise ValueError(f"Invalid learning rate: {self.lr}")
        if not (isinstance(self.betas, tuple) and len(self.betas) == 2
                and all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0.0 <= b < 1.0
                        for b in self.betas)):
            raise ValueError(f"betas must be a pair of floats in [0, 1), got {self.betas!r}")
        sb = self.shampoo_beta
        if isinstance(sb, bool) or not isinstance(sb, (int, float)) or math.isnan(sb) or sb >= 1.0:
            raise ValueError("shampoo_beta must be a float in [0, 1), or negative for "
                             f"betas[1], got {sb!r}")
        if not self.eps >= 0:
            raise ValueError(f"Invalid epsilon value: {self.eps}")
        if not self.weight_decay >= 0:
            raise ValueError(f"Invalid weight_decay value: {self.weight_decay}")
        f = self.precondition_frequency
        if isinstance(f, bool) or not isinstance(f, int) or f < 1:
            raise ValueError(f"precondition_frequency must be an int >= 1, got {f!r}")
        for name in ("normalize_grads", "correct_bias"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def factor_beta(self) -> float:
        """The factors' running-mean coefficient: shampoo_beta, or betas[1] when negative."""
        return self.shampoo_beta if self.shampoo_beta >= 0 else self.betas[1]


# -- rotations and factors ------------------------------------------------------------------

# A rotation contracts the work dims one at a time, first to last, each with its basis Q
# (over dim 0, the new dim moved last); a dim without a factor is only moved last. After
# all dims the order is the original again. Into the basis the contraction is with Q
# (x -> Q^T x along that dim), back with Q^T. These are the reference's
# torch.tensordot(x, Q, dims=([0], [0 or 1])) calls; for a matrix, written as the
# transpose and mm that tensordot runs (the operands reach mm with the same strides, so
# the bits are the same) without its wrapper, which costs as much as the mm on small
# matrices.


def soap_project(x: Tensor, bases: Sequence[Tensor | None]) -> Tensor:
    """``x`` (work shape) rotated into the eigenbasis: ``Q_i^T`` applied along each dim i."""
    return _rotate(x, bases, False)


def soap_project_back(x: Tensor, bases: Sequence[Tensor | None]) -> Tensor:
    """``x`` (work shape) rotated back from the eigenbasis: ``Q_i`` along each dim i."""
    return _rotate(x, bases, True)


def _rotate(x: Tensor, bases: Sequence[Tensor | None], back: bool) -> Tensor:
    if len(bases) != x.ndim:
        raise ValueError(f"{len(bases)} bases for a tensor of shape {tuple(x.shape)}")
    if x.ndim == 2:  # the permute is a transpose and the reshapes keep the shape: mm alone
        for q in bases:
            x = x.T if q is None else torch.mm(x.T, q.T if back else q)
        return x
    order = (*range(1, x.ndim), 0)
    side = [1 if back else 0]
    for q in bases:
        x = x.permute(order) if q is None else tensordot(x, q, [0], side)
    return x


def soap_update_factors_(factors: Sequence[Tensor | None], grad: Tensor, beta: float) -> None:
    """``F_i <- beta F_i + (1 - beta) G_(i) G_(i)^T`` for each factor, in place (``lerp``);
    ``G_(i)`` is the work-shaped ``grad`` with dim i as rows, the others as columns."""
    if len(factors) != grad.ndim:
        raise ValueError(f"{len(factors)} factors for a gradient of shape {tuple(grad.shape)}")
    for i, f in enumerate(factors):
        if f is None:
            continue
        others = [d for d in range(grad.ndim) if d != i]
        f.lerp_(tensordot(grad, grad, others, others), 1 - beta)


def soap_eigenbasis(factor: Tensor) -> Tensor:
    """Eigenvectors of a symmetric factor, by decreasing eigenvalue (columns).

    ``eigh`` of ``factor + 1e-30 I`` in float32 (float64 for a float64 factor), retried in
    float64 if it raises; the result in the factor's dtype. A non-finite factor (from a
    non-finite gradient) gets the identity, selected on the device with no host sync (the
    decomposition runs on the identity in its place: ``matrix_inverse_root`` in
    vefsdp_optim/_math/_matrix_root.py), and so does a finite one whose float64 retry
    raises too (with a warning, a host-side exception being at hand). The reference raises
    for a non-finite factor, which under sharding is one owner rank alone and would leave
    the others waiting in the step's exchange; the parameter becomes non-finite either way.
    """
    work = factor if factor.dtype in (torch.float32, torch.float64) else factor.float()
    eye = torch.eye(work.shape[0], dtype=work.dtype, device=work.device)
    finite = all_finite(work)  # 0-dim bool
    work = torch.where(finite, work, eye)  # the factor's bits where finite
    try:
        _, q = torch.linalg.eigh(work + 1e-30 * eye)
    except (torch.linalg.LinAlgError, RuntimeError):
        try:
            _, q = torch.linalg.eigh(work.double() + 1e-30 * eye.double())
        except (torch.linalg.LinAlgError, RuntimeError) as e:
            warnings.warn(f"SOAP: no eigenbasis for a factor of shape {tuple(factor.shape)} ({e}); "
                          "the identity is used", RuntimeWarning, stacklevel=2)
            return eye.to(factor.dtype)
        q = q.to(work.dtype)
    return torch.where(finite, torch.flip(q, [1]), eye).to(factor.dtype)


def soap_power_iteration(factor: Tensor, basis: Tensor, exp_avg_sq: Tensor,
                         dim: int) -> tuple[Tensor, Tensor]:
    """One power iteration with QR: the new basis of ``factor`` from ``basis``.

    The columns of ``basis`` are sorted by their Rayleigh quotients ``diag(Q^T F Q)``,
    decreasing, and the second moment ``exp_avg_sq`` (work shape) is permuted along
    ``dim`` the same way; the new basis is the Q of ``F Q_sorted = QR``.
    Returns ``(new_basis, permuted exp_avg_sq)``.
    """
    f = factor if factor.dtype in (torch.float32, torch.float64) else factor.float()
    q = basis.to(f.dtype)
    order = torch.argsort(torch.diag(q.T @ f @ q), descending=True)
    exp_avg_sq = exp_avg_sq.index_select(dim, order)
    new, _ = torch.linalg.qr(f @ q[:, order])
    return new.to(factor.dtype), exp_avg_sq


def _device_lr(lr: float | Tensor, param: Tensor) -> Tensor:
    """A capturable step's lr: a Tensor as it is, a float as a float32 0-d tensor on the
    parameter's device (a fill, the same bits as a float32 tensor of that value)."""
    if isinstance(lr, Tensor):
        return lr
    return torch.full((), lr, dtype=torch.float32, device=param.device)


# -- one step --------------------------------------------------------------------------------


@dataclass(slots=True)
class SoapState:
    """One tensor's SOAP state; a step rebinds the moments and the bases to new tensors
    where the reference does (so their memory layouts, and the matmuls' bits, are its)."""

    exp_avg: Tensor  # work shape (a 1-D slice without geometry), in the eigenbasis
    exp_avg_sq: Tensor  # as exp_avg
    factors: list[Tensor | None]  # per work dim: (d, d) running mean of G G^T, or None
    bases: list[Tensor | None]  # per work dim: (d, d) eigenvectors as columns, or None


def soap_step_(param: Tensor, grad: Tensor, state: SoapState, step: int | Tensor, hp: SoapHparams,
               geometry: SoapGeometry | None, host_step: int | None = None) -> None:
    """One SOAP step on a whole tensor: ``param`` in place, ``state`` updated.

    ``param`` and ``grad`` hold the tensor's elements in flat order (1-D). ``geometry``
    None: no factors and no ``normalize_grads``, elementwise Adam, so any slice of a
    tensor may be given (with its slice of the moments). ``step`` counts the calls, from 1:

    * step 1 only starts the factors (``F_i = (1 - beta_F) G_(i) G_(i)^T``) and takes
      their eigenbases (:func:`soap_eigenbasis`); the parameter does not move;
    * step s > 1 is Adam step t = s - 1 on the rotated gradient ``G' = rot(G)``:
      ``m <- b1 m + (1 - b1) G'``, ``v <- b2 v + (1 - b2) G'^2``,
      ``u = rot^-1(m / (sqrt(v) + eps))`` (divided by its RMS + 1e-30 with
      ``normalize_grads``), ``p <- p - lr sqrt(1 - b2^t) / (1 - b1^t) u`` (``lr`` alone
      without ``correct_bias``), then ``p <- p - lr wd p``; then the factors take ``G``,
      when ``t`` is a multiple of ``precondition_frequency`` the bases are renewed by
      :func:`soap_power_iteration` (``v`` permuted with them), and ``m`` is rotated back
      and into the bases (see the comment in the body).

    Capturable ([Note: capturable steps] in _capturable.py): ``step`` a 0-d float32
    tensor on ``param``'s device, from which the bias corrections are computed there,
    with ``lr`` (a float made a float32 0-d tensor there first), and ``host_step`` the
    same count on the host, which decides the first step and the basis renewals.
    """
    if host_step is None:
        if isinstance(step, Tensor):
            raise TypeError("a Tensor step (capturable) needs its count on the host: host_step")
        host_step = step
    if host_step < 1:
        raise ValueError(f"step counts the calls from 1, got {host_step}")
    if geometry is not None and param.numel() != math.prod(geometry.shape):
        raise ValueError(f"param has {param.numel()} elements, geometry {geometry.shape} "
                         f"{math.prod(geometry.shape)}: SOAP with factors needs the whole tensor")
    rotated = geometry is not None and geometry.has_factors
    bases = state.bases
    m, v = state.exp_avg, state.exp_avg_sq
    g = geometry.to_work(grad) if geometry is not None else grad
    if g.dtype != m.dtype:
        g = g.to(m.dtype)
    if host_step == 1:
        if rotated:
            soap_update_factors_(state.factors, g, hp.factor_beta)
            state.bases = [None if f is None else soap_eigenbasis(f) for f in state.factors]
        return

    t = host_step - 1
    beta1, beta2 = hp.betas
    g_rot = soap_project(g, bases) if rotated else g
    m.mul_(beta1).add_(g_rot, alpha=1.0 - beta1)
    v.mul_(beta2).add_(g_rot.square(), alpha=1.0 - beta2)
    on_device = isinstance(step, Tensor)  # capturable: the coefficients on the device
    lr = _device_lr(hp.lr, param) if on_device else hp.lr
    step_size = lr
    if hp.correct_bias:
        # ``shampoo_step_`` in vefsdp_optim/_math/_shampoo.py
        t_now = step.double() - 1 if on_device else t
        step_size = step_size * ((1.0 - beta2**t_now) ** 0.5) / (1.0 - beta1**t_now)
    denom = v.sqrt().add_(hp.eps)
    u = (torch.div(m, denom, out=denom) if denom.shape == m.shape and denom.stride() == m.stride()
         else m / denom)
    if rotated:
        u = soap_project_back(u, bases)
    if hp.normalize_grads:
        u = u / (1e-30 + torch.mean(u**2) ** 0.5)
    if geometry is not None:
        u = geometry.from_work(u)
    if on_device:
        param.view(u.shape).sub_(u * step_size)
        if hp.weight_decay > 0.0:
            param.sub_(param * (lr * hp.weight_decay))
    else:
        param.view(u.shape).add_(u, alpha=-step_size)
        if hp.weight_decay > 0.0:
            param.add_(param, alpha=-hp.lr * hp.weight_decay)
    if not rotated:
        return
    # m goes back to the gradient's basis and into the (maybe new) eigenbasis at every
    # step, as in the reference: Q Q^T = I only up to rounding, and the directions of a
    # factor's (near-)null space amplify any rounding difference to O(lr) in the
    # parameters (Adam divides each coordinate by its own scale), so skipping it would
    # not follow the reference for long
    m_orig = soap_project_back(m, bases)
    soap_update_factors_(state.factors, g, hp.factor_beta)
    if t % hp.precondition_frequency == 0:
        new_bases: list[Tensor | None] = []
        for i, (q, f) in enumerate(zip(bases, state.factors, strict=True)):
            if q is None or f is None:
                new_bases.append(None)
                continue
            q_new, v = soap_power_iteration(f, q, v, i)
            new_bases.append(q_new)
        state.bases, state.exp_avg_sq = new_bases, v
    state.exp_avg = soap_project(m_orig, state.bases)
