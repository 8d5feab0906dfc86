"""One Muon (and NorMuon) step on a whole tensor, and the phases the step loop runs apart.

``muon_step_`` is the whole algorithm of :class:`vefsdp_optim.Muon` on one parameter, the way
``torch.optim._muon._single_tensor_muon`` writes it, plus the library's block structure ([Note:
Muon blocks] in _muon_blocks.py: ``flatten``, ``split_sizes``, per-head blocks), its 8-bit
momentum (see vefsdp_optim/_math/_muon_int8.py) and Polar Express's coefficients (see
vefsdp_optim/_math/_polar_express.py). ``normuon_step_`` (:class:`vefsdp_optim.NorMuon`'s) is in
_normuon.py.

A step is three phases, and ``muon_step_`` is literally their composition:

    x = muon_momentum_(grad, momentum)           elementwise: any slice of the tensor
    o = muon_orthogonalize(x, blocks, ...)        per whole block: Newton-Schulz
        (normuon_normalize_blocks(o, ...))        per whole block: NorMuon only
    muon_apply_(param, o, lr=..., ...)            elementwise: decay, then the step

The optimizer runs the same functions where the data are: the momentum on each rank's storage
shard (the float momentum stays sharded; the 8-bit one on the compute slices, whose 256-element
blocks it needs whole), Newton-Schulz on the rank that holds each whole block (the owner of a
whole matrix), the update back on the shards. An elementwise function gives each element the same
bits on a slice as on the whole tensor, and each block is orthogonalized whole, so the sharded
step is this function at any world size. The step loop orthogonalizes a bucket's blocks with the
batched form of ``muon_orthogonalize``, ``muon_orthogonalize_batched`` below (one batched
Newton-Schulz per block shape across parameters, only where ``newtonschulz_batch_exact`` has
checked it gives the per-block bits), and NorMuon's blocks with ``normuon_orthogonalize_batched``
in _normuon.py (that, then one batched normalization per block shape where
``normuon_batch_exact`` has checked it: ``normuon_normalize_batched_`` in
vefsdp_optim/_math/_normuon.py): the same results, bit for bit, tested in
tests/test_math_functional.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from vefsdp_optim._torch_compat import foreach_add_, foreach_lerp_, foreach_mul_, view_base

from ._muon_blocks import muon_adjust_lr, muon_blocks
from ._muon_int8 import muon_momentum_int8_
from ._newton_schulz import (
    NS_COEFFICIENTS,
    NS_EPS,
    NS_STEPS,
    NsCoefficients,
    newtonschulz_batch_exact,
    zeropower_via_newtonschulz,
    zeropower_via_newtonschulz_batched,
)

__all__ = [
    "Int8Momentum",
    "MuonBlock",
    "muon_apply_",
    "muon_apply_foreach_",
    "muon_lr_runs",
    "muon_momentum_",
    "muon_momentum_foreach_",
    "muon_orthogonalize",
    "muon_orthogonalize_batched",
    "muon_step_",
]

#: ``(flat offset, rows, cols)`` of one separately orthogonalized block of a flat tensor
MuonBlock = tuple[int, int, int]


class Int8Momentum(NamedTuple):
    """Muon's momentum kept in 8 bits (see vefsdp_optim/_math/_muon_int8.py), updated in place."""

    codes: Tensor  # uint8, one per element
    absmax: Tensor  # float32, one per MOMENTUM_BLOCK elements
    code: Tensor  # the signed dynamic code map (256 float32 values)
    # int64 0-dim tensor: the momentum steps taken (the rounding's dither phase,
    # vefsdp_optim/_math/_muon_int8.py); incremented in place, as torch's functional
    # optimizers do with their state_steps; read where it lives (on the host, or on the
    # device when capturable)
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
            raise TypeError("Int8Momentum.step must be a 0-dim int64 tensor (the momentum "
                            f"steps taken), got {step!r}")
        out = muon_momentum_int8_(grad, codes, absmax, momentum=momentum, nesterov=nesterov,
                                  code=code, step=step, offset=offset).to(torch.bfloat16)
        step.add_(1)
        return out
    momentum_buffer.lerp_(grad, 1 - momentum)
    return _ns_input(grad, momentum_buffer, momentum, nesterov)


def _ns_input(grad: Tensor, momentum_buffer: Tensor, momentum: float, nesterov: bool) -> Tensor:
    """Newton-Schulz's bfloat16 input from a float momentum already stepped (see
    :func:`muon_momentum_`)."""
    if not nesterov:
        return momentum_buffer.to(torch.bfloat16)
    return torch.lerp(grad, momentum_buffer, momentum,
                      out=torch.empty(grad.shape, dtype=torch.bfloat16, device=grad.device))


def muon_momentum_foreach_(grads: list[Tensor], momentum_buffers: list[Tensor], *, momentum: float,
                           nesterov: bool) -> list[Tensor]:
    """:func:`muon_momentum_` of float momentum buffers, over lists (see ``Muon._gather_bucket`` in
    vefsdp_optim/_muon.py): the buffers' ``lerp_`` in one foreach op, then each Newton-Schulz input;
    the bits of :func:`muon_momentum_` on each pair."""
    foreach_lerp_(momentum_buffers, grads, 1 - momentum)
    return [_ns_input(g, b, momentum, nesterov)
            for g, b in zip(grads, momentum_buffers, strict=True)]


def muon_orthogonalize(
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
        ortho = zeropower_via_newtonschulz(update[a:a + n].view(rows, cols), ns_coefficients,
                                           ns_steps, eps)
        if a == 0 and n == update.numel():  # one block: a view when wide
            return ortho.reshape(-1)
        if out is None:
            out = torch.empty(update.numel(), dtype=torch.bfloat16, device=update.device)
        out[a:a + n].view(rows, cols).copy_(ortho)
    if out is None:
        return torch.empty(update.numel(), dtype=torch.bfloat16, device=update.device)
    return out


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


def muon_apply_foreach_(params: list[Tensor], updates: list[Tensor],
                        adjusted_lrs: Sequence[float | Sequence[tuple[int, int, float]]], *,
                        lr: float, weight_decay: float) -> None:
    """:func:`muon_apply_` over lists (see ``Muon._gather_bucket`` in
    vefsdp_optim/_muon.py), ``adjusted_lrs[i]`` each parameter's ``adjusted_lr`` (one
    learning rate, or its runs ``(lo, hi, lr)``): the decay of every parameter in one
    foreach op, then the steps, one foreach op per adjusted learning rate; the bits of
    :func:`muon_apply_` on each."""
    foreach_mul_(params, 1 - lr * weight_decay)
    by_lr: dict[float, tuple[list[Tensor], list[Tensor]]] = {}

    def add(p: Tensor, u: Tensor, a_lr: float) -> None:
        if u.dtype != p.dtype and p.numel() > _ADD_PIECE and p.device.type == "cpu":
            _add_(p, u, -a_lr)  # in pieces (see _add_)
            return
        ps, us = by_lr.setdefault(a_lr, ([], []))
        ps.append(p)
        us.append(u)

    for p, u, a_lr in zip(params, updates, adjusted_lrs, strict=True):
        if isinstance(a_lr, (list, tuple)):
            for lo, hi, run_lr in a_lr:
                add(p[lo:hi], u[lo:hi], run_lr)
        else:
            add(p, u, a_lr)
    for a_lr, (ps, us) in by_lr.items():
        foreach_add_(ps, us, alpha=-a_lr)


def muon_lr_runs(blocks: Sequence[MuonBlock], lr: float,
                 adjust_lr_fn: str | None) -> list[tuple[int, int, float]]:
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
        raise ValueError(f"grad must have the parameter's shape {tuple(param.shape)}, got "
                         f"{tuple(grad.shape)}")
    n = (momentum_buffer.codes if isinstance(momentum_buffer, Int8Momentum)
         else momentum_buffer).numel()
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
            or an :class:`Int8Momentum` (see vefsdp_optim/_math/_muon_int8.py).
        ns_coefficients: ``(a, b, c)`` of the quintic, or ``"polar_express"``
            (see vefsdp_optim/_math/_polar_express.py).
    """
    _check_step(param, grad, momentum_buffer)
    blocks = muon_blocks(param.shape, flatten, split_sizes)
    update = muon_momentum_(grad.view(-1), _flat(momentum_buffer), momentum=momentum,
                            nesterov=nesterov)
    ortho = muon_orthogonalize(update, blocks, ns_coefficients, ns_steps, eps)
    _apply_whole_(param, ortho, blocks, lr=lr, weight_decay=weight_decay, adjust_lr_fn=adjust_lr_fn)


def _flat(momentum_buffer: Tensor | Int8Momentum) -> Tensor | Int8Momentum:
    return (momentum_buffer if isinstance(momentum_buffer, Int8Momentum)
            else momentum_buffer.view(-1))


def _apply_whole_(param: Tensor, ortho: Tensor, blocks: Sequence[MuonBlock], *, lr: float,
                  weight_decay: float, adjust_lr_fn: str | None) -> None:
    shapes = {(rows, cols) for _, rows, cols in blocks}
    adjusted: float | list[tuple[int, int, float]] = (
        muon_adjust_lr(lr, adjust_lr_fn, next(iter(shapes))) if len(shapes) == 1
        else muon_lr_runs(blocks, lr, adjust_lr_fn))
    muon_apply_(param.view(-1), ortho, lr=lr, weight_decay=weight_decay, adjusted_lr=adjusted)


class _ShapeBatch(NamedTuple):
    """Newton-Schulz of every block of one shape in a bucket's inputs (see
    ``newtonschulz_batch_exact`` in vefsdp_optim/_math/_newton_schulz.py)."""

    rows: int
    cols: int
    members: list[tuple[int, int, int]]  # (input, its block index, flat offset) of each block
    ortho: torch.Tensor | list[torch.Tensor]  # (k, rows, cols) bf16 batch, or each block's result
    covers: str  # "input": the blocks are one input, in order; "each": each block a whole input; ""


def _consecutive(ts: list[torch.Tensor]) -> bool:
    """Whether the 1-D tensors ``ts``, of one length, are views of one base lying one
    after the other from a 64-byte aligned start (the step loop's exchange assembles equal
    blocks so, ``_JOIN_ALIGN`` in comm/_redistribute.py): then their stack is a
    view, as aligned as a fresh tensor (see ``aligned`` in vefsdp_optim/_step_loop.py)."""
    first = ts[0]
    base, start, n = view_base(first), first.storage_offset(), first.numel()
    if base is None or (start * first.element_size()) % 64:
        return False
    # metadata only (views of one base, their offsets): a fake tensor has no addresses
    return all(view_base(t) is base and t.dim() == 1 and t.stride(0) == 1
               and t.storage_offset() == start + j * n
               for j, t in enumerate(ts))


def _newton_schulz_by_shape(
    updates: Sequence[torch.Tensor], blocks: Sequence[Sequence[tuple[int, int, int]]],
    ns_coefficients: NsCoefficients, ns_steps: int, eps: float,
) -> list[_ShapeBatch]:
    """Newton-Schulz of every block of ``updates`` (1-D; ``blocks[i]`` covers
    ``updates[i]``), one batch per block shape where :func:`newtonschulz_batch_exact`
    says it gives the per-block bits, per block elsewhere."""
    by_shape: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for i, bs in enumerate(blocks):
        for j, (a, rows, cols) in enumerate(bs):
            by_shape.setdefault((rows, cols), []).append((i, j, a))
    out = []
    for (rows, cols), members in by_shape.items():
        n, k = rows * cols, len(members)
        first = updates[members[0][0]]
        prefix = all(i == members[0][0] and a == j * n for j, (i, _, a) in enumerate(members))
        if prefix and first.numel() == k * n:
            covers = "input"
        elif all(a == 0 and n == updates[i].numel() for i, _, a in members) and \
                len({i for i, _, _ in members}) == k:
            covers = "each"
        else:
            covers = ""
        if k == 1 or not newtonschulz_batch_exact(k, rows, cols, first.device, ns_coefficients,
                                                  ns_steps, eps, torch.get_num_threads()):
            orthos = [zeropower_via_newtonschulz(updates[i][a:a + n].view(rows, cols),
                                                 ns_coefficients,
                                                 ns_steps, eps) for i, _, a in members]
            out.append(_ShapeBatch(rows, cols, members, orthos, covers))
            continue
        if prefix:  # the first blocks of one input: a view
            batch = first[:k * n].view(k, rows, cols)
        elif covers == "each" and _consecutive([updates[i] for i, _, _ in members]):
            batch = first.as_strided((k, rows, cols), (n, cols, 1))  # the exchange's joined outputs
        else:
            batch = torch.stack([updates[i][a:a + n].view(rows, cols) for i, _, a in members])
        out.append(_ShapeBatch(rows, cols, members,
                               zeropower_via_newtonschulz_batched(batch, ns_coefficients, ns_steps,
                                                                  eps), covers))
    return out


def muon_orthogonalize_batched(
    updates: Sequence[torch.Tensor], blocks: Sequence[Sequence[tuple[int, int, int]]],
    ns_coefficients: NsCoefficients = NS_COEFFICIENTS, ns_steps: int = NS_STEPS,
    eps: float = NS_EPS,
) -> list[torch.Tensor]:
    """The batched form of ``_math.muon_orthogonalize`` (see the module docstring):
    ``[muon_orthogonalize(x, b, ...) for x, b in zip(updates, blocks)]``, bit for bit, with
    one batched Newton-Schulz per block shape across all the inputs where
    :func:`newtonschulz_batch_exact` says it gives the per-block bits (see
    ``newtonschulz_batch_exact`` in vefsdp_optim/_math/_newton_schulz.py); per block
    elsewhere. Each ``blocks[i]`` covers ``updates[i]`` (1-D). The step loop runs it on the
    whole blocks a rank computes in a bucket."""
    results: list[torch.Tensor | None] = [None] * len(updates)
    for sb in _newton_schulz_by_shape(updates, blocks, ns_coefficients, ns_steps, eps):
        n = sb.rows * sb.cols
        if isinstance(sb.ortho, list):
            for (i, _, a), ortho in zip(sb.members, sb.ortho, strict=True):
                if a == 0 and n == updates[i].numel():  # a whole input: a view when wide
                    results[i] = ortho.reshape(-1)
                else:
                    _result(results, i, updates[i])[a:a + n].view(sb.rows, sb.cols).copy_(ortho)
        elif sb.covers == "input":
            results[sb.members[0][0]] = _flat_copy(sb.ortho)  # the whole input: a view when wide
        elif sb.covers == "each":  # whole inputs: views of one copy
            flat = _flat_copy(sb.ortho).view(len(sb.members), n)
            for (i, _, _), o in zip(sb.members, flat.unbind(0), strict=True):
                results[i] = o
        else:
            for j, (i, _, a) in enumerate(sb.members):
                _result(results, i, updates[i])[a:a + n].view(sb.rows, sb.cols).copy_(sb.ortho[j])
    for i, r in enumerate(results):
        if r is None:  # no blocks
            results[i] = torch.empty(0, dtype=torch.bfloat16, device=updates[i].device)
    return results  # type: ignore[return-value]


def _result(results: list[torch.Tensor | None], i: int, x: torch.Tensor,
            dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Input ``i``'s result (1-D, the length of ``x``; bfloat16: Newton-Schulz's)."""
    res = results[i]
    if res is None:
        res = results[i] = torch.empty(x.numel(), dtype=dtype, device=x.device)
    return res


def _flat_copy(batch: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``batch`` (k, rows, cols) in flat row-major order, into ``out`` (1-D) when given.
    A tall batch's Newton-Schulz result is a transposed view: on the CPU, torch copies
    it faster one matrix at a time than as one strided batch (docs/performance.md), so
    it is copied per matrix there; the bits are the same."""
    if out is None:
        if batch.is_contiguous():
            return batch.reshape(-1)
        out = torch.empty(batch.numel(), dtype=batch.dtype, device=batch.device)
    dst = out.view(batch.shape)
    if batch.device.type == "cpu" and not batch.is_contiguous():
        for i in range(batch.shape[0]):
            dst[i].copy_(batch[i])
    else:
        dst.copy_(batch)
    return out
