"""Block requirements: what an optimizer declares per parameter.

A requirement is pure data. For a given tensor shape it resolves to a **unit**: the
distance, in row-major flat elements counted from the tensor's first element, between
two legal cut points. A cut ``c`` (``0 <= c <= numel``) is legal iff ``c % unit == 0``
or ``c == numel`` (the last block may be short).

Every requirement reduces to this one integer u, clamped to numel. A layout satisfies a
requirement iff each interior rank boundary of the tensor falls on a multiple of u or on
numel. Elementwise: u = 1. Bands of k rows: u = k * row size. Flat blocks of n elements:
u = n. Whole tensor: u = numel, so the only legal cuts are 0 and numel and the tensor
lies on one rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "Requirement",
    "Elementwise",
    "RowBlocks",
    "FlatBlocks",
    "WholeTensor",
    "check_shape",
    "is_legal_cut",
]


def _check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} of type {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def check_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """Validate a tensor shape for planning and return it as a tuple of ints."""
    if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence):
        raise TypeError(f"shape must be a sequence of ints, got {shape!r}")
    out = []
    for d in shape:
        if isinstance(d, bool) or not isinstance(d, int):
            raise TypeError(f"shape entries must be ints, got {d!r} in shape {tuple(shape)!r}")
        if d < 0:
            raise ValueError(f"shape entries must be >= 0, got {tuple(shape)!r}")
        out.append(int(d))
    return tuple(out)


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def is_legal_cut(cut: int, numel: int, unit: int) -> bool:
    """Whether flat position ``cut`` is a legal cut point of a tensor (see the module docstring)."""
    return 0 <= cut <= numel and (cut % unit == 0 or cut == numel)


class Requirement:
    """Base of the block requirements. Subclasses are frozen dataclasses."""

    __slots__ = ()

    def unit(self, shape: Sequence[int]) -> int:
        """The unit for a tensor of ``shape``, clamped to ``[1, numel]``."""
        shape = check_shape(shape)
        numel = _numel(shape)
        if numel == 0:
            raise ValueError(f"tensor of shape {shape} has no elements: nothing to shard")
        return max(1, min(self._raw_unit(shape), numel))

    @property
    def needs_whole(self) -> bool:
        """True when the optimizer needs the whole tensor on one rank."""
        return False

    def _raw_unit(self, shape: tuple[int, ...]) -> int:  # pragma: no cover - abstract
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class Elementwise(Requirement):
    """Any cut is legal (AdamW, SGD)."""

    def _raw_unit(self, shape: tuple[int, ...]) -> int:
        return 1


@dataclass(frozen=True, slots=True)
class RowBlocks(Requirement):
    """Bands of ``rows`` consecutive rows along dim 0 (the last band may be short).

    A 0-d or 1-d tensor counts one element per row.
    """

    rows: int

    def __post_init__(self) -> None:
        _check_positive_int("rows", self.rows)

    def _raw_unit(self, shape: tuple[int, ...]) -> int:
        return self.rows * _numel(shape[1:])


@dataclass(frozen=True, slots=True)
class FlatBlocks(Requirement):
    """Blocks of ``block_size`` flat elements from the tensor's first element."""

    block_size: int

    def __post_init__(self) -> None:
        _check_positive_int("block_size", self.block_size)

    def _raw_unit(self, shape: tuple[int, ...]) -> int:
        return self.block_size


@dataclass(frozen=True, slots=True)
class WholeTensor(Requirement):
    """The whole tensor on one rank (Muon's Newton-Schulz)."""

    @property
    def needs_whole(self) -> bool:
        return True

    def _raw_unit(self, shape: tuple[int, ...]) -> int:
        return _numel(shape)
