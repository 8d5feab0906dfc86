"""NorMuon's neuron-wise normalization (Li et al., arXiv 2510.05491), as Dion computes it.

After Newton-Schulz, each row (output neuron) of the
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

``normuon_normalize_batched_`` normalizes k matrices of one shape with the ops of
``normuon_normalize_`` on the (k, rows, cols) stack, about 12 ops in all in place of 12
per matrix (the step loop's owner normalizes a bucket's same-shape blocks so). Each op
gives every matrix the bits it gets alone: the cast, the squares, divisions, square roots,
the broadcast product and the clamp are elementwise with one IEEE rounding per element,
wherever it sits in a vector loop; the running average is ``lerp`` on each moment tensor
itself (``_foreach_lerp_``: per tensor on the CPU, the per-tensor kernels' place of every
element in the vector loop kept); what remains are the reductions along the last dim of
contiguous tensors (the row norms of (k, rows, cols), the norms of the (k, rows) row-norm
vectors), which the CPU's last-dim kernel reduces one row at a time (measured at 1 and 2
threads: tests/ test_normuon.py); on another device a kernel may split a row differently
for another number of rows. A tall Newton-Schulz batch is a transposed view: it is
transposed one matrix at a time in bfloat16 (torch's fast transpose needs one dtype), then
cast, which costs about half of a direct cast-and-transpose. So, as for Newton-Schulz (see
``newtonschulz_batch_exact`` in vefsdp_optim/_math/_newton_schulz.py), the bits are
checked, not assumed: ``normuon_batch_exact`` compares the two on a random stack once per
(batch, shape, dtype, device, beta2, threads), on full-precision values (the squares of
bfloat16 values, Newton-Schulz's, often sum exactly in float32 whatever the order, and
would hide one), and refuses blocks with a side below ``BATCH_MIN_DIM`` (a sum of fewer
terms may round alike in two orders on the probe and not on the data). Off the CPU, as for
Newton-Schulz, the answer comes back without a host sync, the per-matrix path running
until it does (see vefsdp_optim/_math/_batch_probe.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .._torch_compat import foreach_lerp_
from ._batch_probe import batch_probe
from ._muon import (
    Int8Momentum,
    MuonBlock,
    _apply_whole_,
    _check_step,
    _flat,
    _newton_schulz_by_shape,
    _result,
    muon_momentum_,
    muon_orthogonalize,
)
from ._muon_blocks import muon_blocks
from ._newton_schulz import BATCH_MIN_DIM, NS_COEFFICIENTS, NS_EPS, NS_STEPS, NsCoefficients

__all__ = [
    "NORMUON_EPS",
    "normuon_batch_exact",
    "normuon_normalize_",
    "normuon_normalize_batched_",
    "normuon_normalize_blocks",
    "normuon_orthogonalize_batched",
    "normuon_step_",
]

NORMUON_EPS = 1e-8  # Dion's constant, in the denominator and the norm's clamp


def normuon_normalize_(
    ortho: Tensor, variance: Tensor, beta2: float, eps: float = NORMUON_EPS,
    out: Tensor | None = None,
) -> Tensor:
    """NorMuon's normalization of one orthogonalized matrix (see the module docstring).

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
        raise ValueError(f"variance must have shape ({rows},) for a matrix of shape "
                         f"{tuple(ortho.shape)}, got {tuple(variance.shape)}")
    if not variance.is_floating_point() or variance.dtype.itemsize < 4:
        raise ValueError(f"variance must be float32 or wider, got {variance.dtype}")
    if not 0.0 <= beta2 <= 1.0:
        raise ValueError(f"beta2 must be in [0, 1], got {beta2}")
    if out is None:
        # (rows, cols)
        u = ortho.to(variance.dtype, memory_format=torch.contiguous_format, copy=True)
    else:
        if out.shape != ortho.shape or out.dtype != variance.dtype or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous {variance.dtype} tensor of shape "
                             f"{tuple(ortho.shape)}, got {out.dtype} {tuple(out.shape)} "
                             f"(contiguous: {out.is_contiguous()})")
        u = out.copy_(ortho)
    row = torch.linalg.vector_norm(u, dim=-1)  # (rows,): ||O_i.||
    variance.lerp_(row.square() / u.shape[-1], 1 - beta2)  # mean_j O_ij^2
    denom = variance.sqrt().add_(eps)  # (rows,)
    new_norm = torch.linalg.vector_norm(row / denom).clamp_(min=eps)  # ||O / denom||_F
    u.mul_((torch.linalg.vector_norm(row) / new_norm / denom).unsqueeze(-1))
    return u


def normuon_normalize_batched_(
    ortho: Tensor | Sequence[Tensor], variances: Sequence[Tensor], beta2: float,
    eps: float = NORMUON_EPS, out: Tensor | None = None,
) -> Tensor:
    """:func:`normuon_normalize_` of each ``ortho[i]`` with ``variances[i]``, in batched
    ops (see the module docstring): the same bits where
    :func:`normuon_batch_exact` says so.

    Args:
        ortho: (k, rows, cols), any float dtype and strides (a tall Newton-Schulz batch is
            a transposed view), or k (rows, cols) matrices of one dtype (Newton-Schulz's
            results one by one, cast into ``out`` one by one); not modified.
        variances: k (rows,) row second moments of one dtype, float32 or wider: updated in
            place.
        out: a contiguous (k, rows, cols) tensor of the variances' dtype; a new one when None.

    Returns:
        ``out`` (or the new tensor): the normalized updates.
    """
    mats = None if isinstance(ortho, Tensor) else list(ortho)
    if mats is not None:
        if not mats or any(m.ndim != 2 or m.shape != mats[0].shape or m.dtype != mats[0].dtype
                           for m in mats):
            raise ValueError("ortho must be a (k, rows, cols) batch or k > 0 matrices of one shape "
                             f"and dtype, got {[(tuple(m.shape), m.dtype) for m in mats][:4]}")
        k, (rows, cols), device = len(mats), mats[0].shape, mats[0].device
    elif ortho.ndim != 3:
        raise ValueError(f"ortho must be a (k, rows, cols) batch, got shape {tuple(ortho.shape)}")
    else:
        (k, rows, cols), device = ortho.shape, ortho.device
    if len(variances) != k:
        raise ValueError(f"{len(variances)} row second moments for a batch of {k} matrices")
    dtype = variances[0].dtype if variances else torch.float32
    bad = [tuple(v.shape) for v in variances if v.shape != (rows,) or v.dtype != dtype]
    if bad or not dtype.is_floating_point or dtype.itemsize < 4:
        raise ValueError(f"variances must be ({rows},) tensors of one float dtype, float32 "
                         f"or wider, got {dtype} and shapes {bad[:4]}")
    if not 0.0 <= beta2 <= 1.0:
        raise ValueError(f"beta2 must be in [0, 1], got {beta2}")
    if out is None:
        out = torch.empty((k, rows, cols), dtype=dtype, device=device)
    elif out.shape != (k, rows, cols) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {dtype} tensor of shape {(k, rows, cols)}, "
                         f"got {out.dtype} {tuple(out.shape)} (contiguous: {out.is_contiguous()})")
    if k == 0:
        return out
    if mats is not None:  # the cast of each, as normuon_normalize_'s copy into ``out``
        for i, m in enumerate(mats):
            out[i].copy_(m)
    elif ortho.device.type == "cpu" and not ortho.is_contiguous():
        # a tall batch (transposed): torch's CPU copy transposes fast only one matrix at a
        # time and within one dtype, so transpose each in its dtype first, then cast all
        src = ortho if ortho.dtype == dtype else torch.empty(ortho.shape, dtype=ortho.dtype,
                                                             device=ortho.device)
        dst = out if ortho.dtype == dtype else src
        for i in range(k):
            dst[i].copy_(ortho[i])
        if dst is not out:
            out.copy_(dst)
    else:
        out.copy_(ortho)
    row = torch.linalg.vector_norm(out, dim=-1)  # (k, rows): ||O_i.|| of each matrix
    foreach_lerp_(list(variances), list((row.square() / cols).unbind(0)), 1 - beta2)
    denom = torch.stack(list(variances)).sqrt_().add_(eps)  # (k, rows)
    new_norm = torch.linalg.vector_norm(row / denom, dim=-1, keepdim=True).clamp_(min=eps)  # (k, 1)
    out.mul_((torch.linalg.vector_norm(row, dim=-1, keepdim=True) / new_norm / denom).unsqueeze(-1))
    return out


def normuon_batch_exact(batch: int, rows: int, cols: int, dtype: torch.dtype, device: torch.device,
                        beta2: float, threads: int) -> bool:
    """Whether :func:`normuon_normalize_batched_` gives, for ``batch`` matrices of ``rows x
    cols`` normalized in ``dtype`` on ``device`` with ``threads`` intra-op threads, the
    bits of :func:`normuon_normalize_` on each (see ``normuon_normalize_batched_``):
    checked once on a fixed random stack (off the CPU, answered when the queued probe
    has finished: vefsdp_optim/_math/_batch_probe.py); never below ``BATCH_MIN_DIM``."""
    if batch < 2 or min(rows, cols) < BATCH_MIN_DIM:
        return False
    device = torch.device(device)

    def run() -> Tensor:
        g = torch.Generator(device=device).manual_seed(rows * 1_000_003 + cols * 7 + batch)
        # full-precision values: the squares of bfloat16 ones sum exactly in float32 in any
        # order (short mantissas), so a bfloat16 probe would not show a summation order
        probe = torch.randn(batch, rows, cols, generator=g, dtype=torch.float64,
                            device=device).to(dtype)
        start = torch.rand(batch, rows, generator=g, device=device).to(dtype)
        want_v = [v.clone() for v in start]
        want = torch.stack([normuon_normalize_(m, v, beta2)
                            for m, v in zip(probe, want_v, strict=True)])
        got_v = [v.clone() for v in start]
        got = normuon_normalize_batched_(probe, got_v, beta2)
        return torch.stack([torch.eq(got, want).all(),
                            torch.eq(torch.stack(got_v), torch.stack(want_v)).all()]).all()

    return batch_probe(("normuon", batch, rows, cols, dtype, device, beta2, threads), device, run)


def normuon_normalize_blocks(ortho: Tensor, blocks: Sequence[MuonBlock],
                             variances: Sequence[Tensor],
                             beta2: float, dtype: torch.dtype) -> Tensor:
    """NorMuon's normalization (:func:`normuon_normalize_`) of each block of the 1-D
    Newton-Schulz result ``ortho``, with ``variances[k]`` (rows of block k, updated in
    place) the row second moment of ``blocks[k]``; returns a new 1-D ``dtype`` tensor."""
    out = torch.empty(ortho.numel(), dtype=dtype, device=ortho.device)
    for (a, rows, cols), v in zip(blocks, variances, strict=True):
        n = rows * cols
        normuon_normalize_(ortho[a:a + n].view(rows, cols), v, beta2,
                           out=out[a:a + n].view(rows, cols))
    return out


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
    block's Newton-Schulz result normalized row by row before the step (see the
    module docstring). ``variances[k]``: block k's row second moment (its rows,
    float32 for a float32 or bfloat16 parameter: ``promote_types(param.dtype,
    float32)``), updated in place; the step's update is in that dtype."""
    _check_step(param, grad, momentum_buffer)
    blocks = muon_blocks(param.shape, flatten, split_sizes)
    if len(variances) != len(blocks):
        raise ValueError(f"{len(variances)} row second moments for a parameter of "
                         f"{len(blocks)} blocks")
    update = muon_momentum_(grad.view(-1), _flat(momentum_buffer), momentum=momentum,
                            nesterov=nesterov)
    ortho = muon_orthogonalize(update, blocks, ns_coefficients, ns_steps, eps)
    ortho = normuon_normalize_blocks(ortho, blocks, variances, muon_beta2,
                                     torch.promote_types(param.dtype, torch.float32))
    _apply_whole_(param, ortho, blocks, lr=lr, weight_decay=weight_decay, adjust_lr_fn=adjust_lr_fn)


def normuon_orthogonalize_batched(
    updates: Sequence[torch.Tensor], blocks: Sequence[Sequence[tuple[int, int, int]]],
    variances: Sequence[Sequence[torch.Tensor]], beta2: float, dtype: torch.dtype,
    ns_coefficients: NsCoefficients = NS_COEFFICIENTS, ns_steps: int = NS_STEPS,
    eps: float = NS_EPS,
) -> list[torch.Tensor]:
    """NorMuon's orthogonalization of a bucket: :func:`muon_orthogonalize_batched`, then
    ``_math.normuon_normalize_blocks`` of each input with ``variances[i]`` (one per block
    of ``blocks[i]``, updated in place), bit for bit; returns 1-D ``dtype`` tensors. The
    blocks of one shape are normalized in one batch where :func:`normuon_batch_exact`
    says it gives the per-block bits (see ``normuon_normalize_batched_``), straight
    from Newton-Schulz's batch (or its per-block results) into the results (no bfloat16
    copy in between)."""
    results: list[torch.Tensor | None] = [None] * len(updates)
    threads = torch.get_num_threads()
    for sb in _newton_schulz_by_shape(updates, blocks, ns_coefficients, ns_steps, eps):
        rows, cols, k = sb.rows, sb.cols, len(sb.members)
        n = rows * cols
        vs = [variances[i][j] for i, j, _ in sb.members]
        device = updates[sb.members[0][0]].device
        # batched even where Newton-Schulz was not (its results one by one into the batch)
        if not normuon_batch_exact(k, rows, cols, dtype, device, beta2, threads):
            for m, ((i, _, a), v) in enumerate(zip(sb.members, vs, strict=True)):
                dst = _result(results, i, updates[i], dtype)[a:a + n].view(rows, cols)
                normuon_normalize_(sb.ortho[m], v, beta2, out=dst)
            continue
        if sb.covers == "input":
            i = sb.members[0][0]
            dst = results[i] = torch.empty(k * n, dtype=dtype, device=device)
            normuon_normalize_batched_(sb.ortho, vs, beta2, out=dst.view(k, rows, cols))
        elif sb.covers == "each":  # whole inputs: views of one buffer
            dst = torch.empty(k, n, dtype=dtype, device=device)
            normuon_normalize_batched_(sb.ortho, vs, beta2, out=dst.view(k, rows, cols))
            for (i, _, _), o in zip(sb.members, dst.unbind(0), strict=True):
                results[i] = o
        else:
            dst = normuon_normalize_batched_(sb.ortho, vs, beta2)
            for m, (i, _, a) in enumerate(sb.members):
                _result(results, i, updates[i], dtype)[a:a + n].view(rows, cols).copy_(dst[m])
    for i, r in enumerate(results):
        if r is None:  # no blocks
            results[i] = torch.empty(0, dtype=dtype, device=updates[i].device)
    return results  # type: ignore[return-value]
