"""One Muon (and NorMuon) step on a whole tensor, and the phases the step loop runs apart.

``muon_step_`` is the whole algorithm of :class:`vefsdp_optim.Muon` on one parameter,
the way ``torch.optim._muon._single_tensor_muon`` writes it, plus the library's block
structure ([Note: Muon blocks] in _newton_schulz.py: ``flatten``, ``split_sizes``,
per-head blocks), its 8-bit momentum ([Note: 8-bit Muon momentum]) and Polar Express's
coefficients ([Note: Polar Express]). ``normuon_step_`` is :class:`vefsdp_optim.NorMuon`'s.

[Note: Muon's phases]
A step is three phases, and ``muon_step_`` is literally their composition:

    x = muon_momentum_(grad, momentum)           elementwise: any slice of the tensor
    o = muon_orthogonalise(x, blocks, ...)        per whole block: Newton-Schulz
        (normuon_normalize_blocks(o, ...))        per whole block: NorMuon only
    muon_apply_(param, o, lr=..., ...)            elementwise: decay, then the step

The optimizer runs the same functions where the data are: the momentum on each rank's
storage shard (the float momentum stays sharded; the 8-bit one on the compute slices,
whose 256-element blocks it needs whole), Newton-Schulz on the rank that holds each
whole block (the owner of a whole matrix), the update back on the shards. An
elementwise function gives each element the same bits on a slice as on the whole
tensor, and each block is orthogonalised whole, so the sharded step is this function
at any world size. The step loop orthogonalises a bucket's blocks with the batched form
of ``muon_orthogonalise``, ``muon_orthogonalise_batched`` in _muon.py (one batched
Newton-Schulz per block shape across parameters, only where ``newtonschulz_batch_exact``
has checked it gives the per-block bits), and NorMuon's blocks with
``normuon_orthogonalise_batched`` there (that, then one batched normalization per block
shape where ``normuon_batch_exact`` has checked it: [Note: batched NorMuon
normalization] in _normuon.py): the same results, bit for bit, tested in
tests/test_math_functional.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from ._muon_int8 import muon_momentum_int8_
from ._newton_schulz import (
    NS_COEFFICIENTS,
    NS_EPS,
    NS_STEPS,
    NsCoefficients,
    muon_adjust_lr,
    muon_blocks,
    zeropower_via_newtonschulz,
)
from ._normuon import normuon_normalize_

__all__ = [
    "Int8Momentum",
    "MuonBlock",
    "muon_apply_",
    "muon_lr_runs",
    "muon_momentum_",
    "muon_orthogonalise",
    "muon_step_",
    "normuon_normalize_blocks",
    "normuon_step_",
]

#: ``(flat offset, rows, cols)`` of one separately orthogonalised block of a flat tensor
MuonBlock = tuple[int, int, int]


class Int8Momentum(NamedTuple):
    """Muon's momentum kept in 8 bits ([Note: 8-bit Muon momentum]), updated in place."""

    codes: Tensor  # uint8, one per element
    absmax: Tensor  # float32, one per MOMENTUM_BLOCK elements
    code: Tensor  # the signed dynamic code map (256 float32 values)
    # int64 0-dim tensor: the momentum steps taken (the rounding's dither phase, [Note:
    # no dead zone]); incremented in place, as torch's functional optimizers do with
    # their state_steps; read on the host each step, so on the CPU it costs no sync
    step: Tensor
    offset: int = 0  # flat index of codes[0] in the whole parameter (its rounding's key)


def muon_momentum_(grad: Tensor, momentum_buffer: Tensor | Int8Momentum, *, momentum: float,
                   nesterov: bool) -> Tensor:
    """Muon's momentum step, in place on ``momentum_buffer``; returns Newton-Schulz's input.

    ``buf <- buf + (1 - momentum) (grad - buf)`` (``lerp``, torch.optim.Muon's), and the
    input ``grad.lerp(buf, momentum)`` (``nesterov``) or ``buf``, in bfloat16: Newton-Schulz
    starts with that cast, so casting first gives the same bits in half the bytes (the
    step loop sends it to the block's owner). Nesterov's lerp is computed in float32 and
    rounded once (``out=``): the bits of lerp then cast. Elementwise: any slice of a tensor
    with its slice of the momentum gets the bits of that part of the whole step; an
    :class:`Int8Momentum` needs whole 256-element blocks (its quantization blocks).
    """
    if isinstance(momentum_buffer, Int8Momentum):
        codes, absmax, code, step, offset = momentum_buffer
        if not (isinstance(step, Tensor) and step.dtype == torch.int64 and step.dim() == 0):
            raise TypeError("Int8Momentum.step must be a 0-dim int64 tensor (the momentum steps taken), "
                            f"got {step!r}")
        out = muon_momentum_int8_(grad, codes, absmax, momentum=momentum, nesterov=nesterov,
                                  code=code, step=int(step), offset=offset).to(torch.bfloat16)
        step.add_(1)
        return out
    momentum_buffer.lerp_(grad, 1 - momentum)
    if not nesterov:
        return momentum_buffer.to(torch.bfloat16)
    return torch.lerp(grad, momentum_buffer, momentum,
                      out=torch.empty(grad.shape, dtype=torch.bfloat16, device=grad.device))


def muon_orthogonalise(
    update: Tensor, blocks: Sequence[MuonBlock], ns_coefficients: NsCoefficients = NS_COEFFICIENTS,
    ns_steps: int = NS_STEPS, eps: float = NS_EPS,
) -> Tensor:
    """Newton-Schulz (:func:`zeropower_via_newtonschulz`) of each block of the 1-D ``update``
    alone, as the matrix ``update[a:a + rows * cols].view(rows, cols)``; ``blocks``
    (``(a, rows, cols)``) cover ``update`` exactly. Returns a 1-D bfloat16 tensor of
    ``update.numel()`` elements (a view of Newton-Schulz's result for a single block)."""
    out = None
    for a, rows, cols in blocks:
        n = rows * cols
        ortho = zeropower_via_newtonschulz(update[a:a + n].view(rows, cols), ns_coefficients, ns_steps, eps)
        if a == 0 and n == update.numel():  # one block: a view when wide
            return ortho.reshape(-1)
        if out is None:
            out = torch.empty(update.numel(), dtype=torch.bfloat16, device=update.device)
        out[a:a + n].view(rows, cols).copy_(ortho)
    if out is None:
        return torch.empty(update.numel(), dtype=torch.bfloat16, device=update.device)
    return out


def normuon_normalize_blocks(ortho: Tensor, blocks: Sequence[MuonBlock], variances: Sequence[Tensor],
                             beta2: float, dtype: torch.dtype) -> Tensor:
    """NorMuon's normalization (:func:`normuon_normalize_`) of each block of the 1-D
    Newton-Schulz result ``ortho``, with ``variances[k]`` (rows of block k, updated in
    place) the row second moment of ``blocks[k]``; returns a new 1-D ``dtype`` tensor."""
    out = torch.empty(ortho.numel(), dtype=dtype, device=ortho.device)
    for (a, rows, cols), v in zip(blocks, variances, strict=True):
        n = rows * cols
        normuon_normalize_(ortho[a:a + n].view(rows, cols), v, beta2, out=out[a:a + n].view(rows, cols))
    return out


#: elements per piece of a mixed-dtype add on the CPU (a multiple of every vector length)
_ADD_PIECE = 1 << 16


def _add_(p: Tensor, update: Tensor, alpha: float) -> None:
    """``p.add_(update, alpha=alpha)`` (1-D, equal lengths), as torch.optim.Muon adds its
    bfloat16 update to a float32 parameter, with the same bits. On the CPU an add of two
    dtypes first converts the whole bfloat16 operand into a new float32 tensor (the
    common-dtype copy of TensorIterator) and runs through a slower loop, several times
    the cost of the add itself on a large parameter; in pieces of ``_ADD_PIECE`` elements
    the temporaries stay small. Elementwise, so the pieces do not change a bit; the
    pieces start at multiples of every vector length, so each element keeps its place
    in the vector loops too."""
    n = p.numel()
    if update.dtype == p.dtype or n <= _ADD_PIECE or p.device.type != "cpu":
        p.add_(update, alpha=alpha)
        return
    for i in range(0, n, _ADD_PIECE):
        p[i:i + _ADD_PIECE].add_(update[i:i + _ADD_PIECE], alpha=alpha)


def muon_apply_(param: Tensor, update: Tensor, *, lr: float, weight_decay: float,
                adjusted_lr: float | Sequence[tuple[int, int, float]]) -> None:
    """``param <- param (1 - lr weight_decay) - adjusted_lr update``, in place (1-D, equal
    lengths; torch.optim.Muon's decoupled decay and step). ``adjusted_lr``: one learning
    rate (:func:`muon_adjust_lr` of the block shape), or runs ``(lo, hi, lr)`` of
    ``param``'s elements, each with its blocks' (blocks of several shapes,
    :func:`muon_lr_runs`). Elementwise: any slice gets that part of the whole step's bits."""
    param.mul_(1 - lr * weight_decay)
    if not isinstance(adjusted_lr, (list, tuple)):
        _add_(param, update, -adjusted_lr)
        return
    for lo, hi, a_lr in adjusted_lr:
        _add_(param[lo:hi], update[lo:hi], -a_lr)


def muon_lr_runs(blocks: Sequence[MuonBlock], lr: float, adjust_lr_fn: str | None) -> list[tuple[int, int, float]]:
    """The runs ``(lo, hi, adjusted lr)`` of :func:`muon_apply_` for a whole tensor of
    ``blocks``: consecutive blocks with one adjusted learning rate share a run."""
    runs: list[tuple[int, int, float]] = []
    for a, rows, cols in blocks:
        a_lr = muon_adjust_lr(lr, adjust_lr_fn, (rows, cols))
        if runs and runs[-1][2] == a_lr and runs[-1][1] == a:
            runs[-1] = (runs[-1][0], a + rows * cols, a_lr)
        else:
            runs.append((a, a + rows * cols, a_lr))
    return runs


def _check_step(param: Tensor, grad: Tensor, momentum_buffer: Tensor | Int8Momentum) -> None:
    if grad.shape != param.shape:
        raise ValueError(f"grad must have the parameter's shape {tuple(param.shape)}, got {tuple(grad.shape)}")
    n = (momentum_buffer.codes if isinstance(momentum_buffer, Int8Momentum) else momentum_buffer).numel()
    if n != param.numel():
        raise ValueError(f"the momentum holds {n} elements for a parameter of {param.numel()}")
    if not (param.is_contiguous() and grad.is_contiguous()):
        raise ValueError("param and grad must be contiguous (their flat order is the blocks')")


def muon_step_(
    param: Tensor,
    grad: Tensor,
    momentum_buffer: Tensor | Int8Momentum,
    *,
    lr: float,
    weight_decay: float,
    momentum: float,
    nesterov: bool,
    ns_coefficients: NsCoefficients = NS_COEFFICIENTS,
    ns_steps: int = NS_STEPS,
    eps: float = NS_EPS,
    adjust_lr_fn: str | None = None,
    flatten: bool = True,
    split_sizes: Sequence[int] | None = None,
) -> None:
    r"""One Muon step on a whole parameter, in place on ``param`` and the momentum.

    For each block (one ``(dim 0, rest)`` matrix; with ``flatten=False`` each
    ``[..., m, n]`` slice; each cut into row blocks of ``split_sizes``: [Note: Muon
    blocks]) ``B`` of ``param``, with ``G`` and ``M`` its gradient and momentum::

        M <- M + (1 - momentum) (G - M)                       (lerp)
        X  = G + momentum (M - G)   if nesterov   else   M
        O  = NewtonSchulz(X)        (ns_coefficients, ns_steps, eps; bfloat16)
        B <- B (1 - lr weight_decay) - muon_adjust_lr(lr, adjust_lr_fn, B.shape) O

    For a 2-D parameter without ``split_sizes`` this is ``torch.optim.Muon``'s step, bit
    for bit (``torch.optim._muon._single_tensor_muon``). Per-head Muon is ``split_sizes``
    of ``rows // num_heads`` each.

    Args:
        param: a contiguous tensor of 2 or more dims.
        grad: its gradient, the same shape.
        momentum_buffer: a tensor of ``param``'s elements (torch's ``momentum_buffer``),
            or an :class:`Int8Momentum` ([Note: 8-bit Muon momentum]).
        ns_coefficients: ``(a, b, c)`` of the quintic, or ``"polar_express"``
            ([Note: Polar Express]).
    """
    _check_step(param, grad, momentum_buffer)
    blocks = muon_blocks(param.shape, flatten, split_sizes)
    update = muon_momentum_(grad.view(-1), _flat(momentum_buffer), momentum=momentum, nesterov=nesterov)
    ortho = muon_orthogonalise(update, blocks, ns_coefficients, ns_steps, eps)
    _apply_whole_(param, ortho, blocks, lr=lr, weight_decay=weight_decay, adjust_lr_fn=adjust_lr_fn)


def normuon_step_(
    param: Tensor,
    grad: Tensor,
    momentum_buffer: Tensor | Int8Momentum,
    variances: Sequence[Tensor],
    *,
    lr: float,
    weight_decay: float,
    momentum: float,
    nesterov: bool,
    muon_beta2: float,
    ns_coefficients: NsCoefficients = "polar_express",
    ns_steps: int = NS_STEPS,
    eps: float = NS_EPS,
    adjust_lr_fn: str | None = "spectral_norm",
    flatten: bool = True,
    split_sizes: Sequence[int] | None = None,
) -> None:
    """One NorMuon step on a whole parameter, in place: :func:`muon_step_` with each
    block's Newton-Schulz result normalized row by row before the step ([Note: NorMuon
    normalization]). ``variances[k]``: block k's row second moment (its rows, float32
    for a float32 or bfloat16 parameter: ``promote_types(param.dtype, float32)``),
    updated in place; the step's update is in that dtype."""
    _check_step(param, grad, momentum_buffer)
    blocks = muon_blocks(param.shape, flatten, split_sizes)
    if len(variances) != len(blocks):
        raise ValueError(f"{len(variances)} row second moments for a parameter of {len(blocks)} blocks")
    update = muon_momentum_(grad.view(-1), _flat(momentum_buffer), momentum=momentum, nesterov=nesterov)
    ortho = muon_orthogonalise(update, blocks, ns_coefficients, ns_steps, eps)
    ortho = normuon_normalize_blocks(ortho, blocks, variances, muon_beta2,
                                     torch.promote_types(param.dtype, torch.float32))
    _apply_whole_(param, ortho, blocks, lr=lr, weight_decay=weight_decay, adjust_lr_fn=adjust_lr_fn)


def _flat(momentum_buffer: Tensor | Int8Momentum) -> Tensor | Int8Momentum:
    return momentum_buffer if isinstance(momentum_buffer, Int8Momentum) else momentum_buffer.view(-1)


def _apply_whole_(param: Tensor, ortho: Tensor, blocks: Sequence[MuonBlock], *, lr: float,
                  weight_decay: float, adjust_lr_fn: str | None) -> None:
    shapes = {(rows, cols) for _, rows, cols in blocks}
    adjusted: float | list[tuple[int, int, float]] = (
        muon_adjust_lr(lr, adjust_lr_fn, next(iter(shapes))) if len(shapes) == 1
        else muon_lr_runs(blocks, lr, adjust_lr_fn))
    muon_apply_(param.view(-1), ortho, lr=lr, weight_decay=weight_decay, adjusted_lr=adjusted)

