"""Muon's blocks: the matrices a parameter is orthogonalized as, their costs and the
learning-rate adjustment of each ([Note: Muon blocks])."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

__all__ = [
    "muon_adjust_lr",
    "muon_batch_view",
    "muon_block_unit",
    "muon_blocks",
    "muon_blocks_cost",
    "muon_cost",
    "muon_matrix_view",
]


def muon_matrix_view(shape: Sequence[int]) -> tuple[int, int]:
    """The (rows, cols) matrix Muon orthogonalizes for a parameter of ``shape``.

    A 2-D shape is itself; a tensor of more dims is viewed as (dim 0, product of the
    rest), e.g. a conv weight (out, in, kh, kw) -> (out, in * kh * kw). This is the
    row-major reshape, so the flat storage is unchanged.
    """
    dims = tuple(shape)
    if len(dims) < 2:
        raise ValueError(
            f"Muon needs a tensor of at least 2 dims, got shape {dims}; "
            "optimize 0-D and 1-D parameters with an elementwise optimizer"
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
    ``"match_rms_adamw"``: ``lr * 0.2 * sqrt(max(rows, cols))`` (Moonshot's);
    ``"spectral_unclamped"``: ``lr * sqrt(rows / cols)`` (Bernstein's; torch >= 2.14). For a
    2-D shape this equals torch's ``_adjust_lr``; a shape of more dims uses its
    ``muon_matrix_view`` (the matrix actually orthogonalized), not its first two dims.
    Dion's names: ``"spectral_norm"``: the same as ``"spectral_unclamped"``;
    ``"rms_norm"``: the same as ``"match_rms_adamw"``.
    """
    try:
        return lr * _adjust_ratio(adjust_lr_fn, tuple(shape))
    except TypeError:  # an unhashable argument: the uncached ratio names what is wrong
        return lr * _adjust_ratio.__wrapped__(adjust_lr_fn, shape)


@functools.lru_cache(maxsize=1024)
def _adjust_ratio(adjust_lr_fn: str | None, shape: Sequence[int]) -> float:
    """``muon_adjust_lr``'s ratio (``lr`` times it is torch's adjusted lr, in torch's order):
    once per shape, not once per parameter and step."""
    rows, cols = muon_matrix_view(shape)
    if rows == 0 or cols == 0:
        raise ValueError(f"Muon needs a non-empty matrix, got shape {tuple(shape)}")
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    elif adjust_lr_fn in ("match_rms_adamw", "rms_norm"):
        ratio = 0.2 * math.sqrt(max(rows, cols))
    elif adjust_lr_fn in ("spectral_unclamped", "spectral_norm"):
        ratio = math.sqrt(rows / cols)
    else:
        raise ValueError(
            f"adjust_lr_fn must be None, 'original', 'match_rms_adamw', 'spectral_unclamped', "
            f"'spectral_norm' or 'rms_norm', got {adjust_lr_fn!r}"
        )
    return ratio


# [Note: Muon blocks]
# A Muon parameter is orthogonalized as one or more separate matrices, its "blocks".
# Each block is updated exactly as a separate 2-D parameter of its shape would be:
# Newton-Schulz and the lr adjustment see the block alone.
#   - ``flatten=True``, or a 2-D parameter: one (dim 0, rest) matrix.
#   - ``flatten=False``: a batch of matrices over the leading dims. Each [..., m, n]
#     slice is one matrix, as for the experts of a mixture of experts.
#   - ``split_sizes``: each matrix is further cut into row blocks of these sizes, as for
#     a fused QKV projection.
# Blocks are consecutive in row-major flat order, so each block is a contiguous range
# of the flat parameter.


def _check_split_sizes(split_sizes: Sequence[int] | None, rows: int,
                       shape: tuple[int, ...]) -> tuple[int, ...]:
    if split_sizes is None:
        return (rows,)
    sizes = tuple(split_sizes)
    if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
        raise ValueError("split_sizes must be a non-empty sequence of positive ints, got "
                         f"{split_sizes!r}")
    if sum(sizes) != rows:
        raise ValueError(
            f"split_sizes {list(sizes)} sum to {sum(sizes)}, but the matrix of a "
            f"parameter of shape {shape} has {rows} rows; split_sizes must sum to the rows "
            "of each matrix")
    return sizes


def muon_batch_view(shape: Sequence[int], flatten: bool = True) -> tuple[int, int, int]:
    """``(batch, rows, cols)``: the matrices Muon orthogonalizes for a parameter of ``shape``.

    ``flatten=True`` (or 2 dims): one ``muon_matrix_view`` matrix. ``flatten=False``:
    ``prod(shape[:-2])`` matrices of ``shape[-2:]`` (see [Note: Muon blocks]).
    """
    dims = tuple(shape)
    rows, cols = muon_matrix_view(dims)  # validates
    if flatten or len(dims) == 2:
        return 1, rows, cols
    return math.prod(dims[:-2]), dims[-2], dims[-1]


def muon_blocks(
    shape: Sequence[int], flatten: bool = True, split_sizes: Sequence[int] | None = None,
) -> list[tuple[int, int, int]]:
    """The blocks ``(flat offset, rows, cols)`` Muon orthogonalizes separately, in flat
    order (see [Note: Muon blocks]). Raises ValueError when ``split_sizes`` do not sum
    to the rows of each matrix."""
    dims = tuple(shape)
    batch, rows, cols = muon_batch_view(dims, flatten)
    sizes = _check_split_sizes(split_sizes, rows, dims)
    out, off = [], 0
    for _ in range(batch):
        for s in sizes:
            out.append((off, s, cols))
            off += s * cols
    return out


def muon_block_unit(
    shape: Sequence[int], flatten: bool = True, split_sizes: Sequence[int] | None = None,
) -> int:
    """The coarsest flat unit whose multiples fall only between blocks: one block when
    all blocks have the same size, else one matrix (a whole expert, or the whole
    parameter). Equals ``prod(shape)`` when the parameter must lie whole on one rank."""
    dims = tuple(shape)
    batch, rows, cols = muon_batch_view(dims, flatten)
    sizes = _check_split_sizes(split_sizes, rows, dims)
    if all(s == sizes[0] for s in sizes):
        return sizes[0] * cols
    return rows * cols


def muon_blocks_cost(
    shape: Sequence[int], flatten: bool = True, split_sizes: Sequence[int] | None = None,
) -> float:
    """Relative Newton-Schulz cost of all of a parameter's blocks (``muon_cost`` each)."""
    dims = tuple(shape)
    batch, rows, cols = muon_batch_view(dims, flatten)
    sizes = _check_split_sizes(split_sizes, rows, dims)
    return float(batch) * sum(float(s) * cols * min(s, cols) for s in sizes)
