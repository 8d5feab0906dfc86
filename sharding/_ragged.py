"""RaggedShard: where each rank's contiguous slice of one tensor lies in flat space."""

from __future__ import annotations

import functools
import itertools
import math
import operator
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field

from ._requirement import Requirement, check_shape, is_legal_cut

__all__ = ["RaggedShard"]


def _as_int(name: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {v!r}")
    return int(v)


@dataclass(frozen=True, slots=True)
class RaggedShard:
    """Layout of one tensor over W ranks.

    ``extents[r] = (start, length)`` is rank r's slice of the tensor's row-major flat
    element space. Slices are contiguous and in rank order: ``extents[0][0] == 0`` and
    each start is the previous end, so the extents tile ``[0, numel)`` exactly. Lengths
    may be 0 (an empty shard starts where the previous one ended). FSDP2's ``Shard(0)``
    and "whole tensor on rank r" are special cases.
    """

    extents: tuple[tuple[int, int], ...]
    # hash(extents), computed once: every optimizer step looks layouts up in caches
    _hash: int = field(init=False, repr=False, compare=False)
    # the W + 1 boundaries, built on first use (None until then): a plan asks for them
    # once per (parameter, peer range), and building them is O(W)
    _bounds: tuple[int, ...] | None = field(init=False, repr=False, compare=False)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        # identity first: the step loop compares each parameter's layout with itself
        if self is other:
            return True
        if type(other) is not RaggedShard:
            return NotImplemented
        return self.extents == other.extents

    def __post_init__(self) -> None:
        object.__setattr__(self, "_bounds", None)
        if _tile_exactly(self.extents):  # the checks below, in C: O(W) at W in the thousands
            object.__setattr__(self, "_hash", hash(self.extents))
            return
        ext = tuple(
            (_as_int("extent start", s), _as_int("extent length", n)) for s, n in self.extents
        )
        if not ext:
            raise ValueError("RaggedShard needs one extent per rank, got none")
        expected = 0
        for r, (s, n) in enumerate(ext):
            if n < 0:
                raise ValueError(f"extent of rank {r} has negative length {n}: {ext}")
            if s != expected:
                raise ValueError(
                    f"extents must tile the tensor in rank order; rank {r} starts at {s}, "
                    f"expected {expected}: {ext}"
                )
            expected = s + n
        object.__setattr__(self, "extents", ext)
        object.__setattr__(self, "_hash", hash(ext))

    # -- constructors -------------------------------------------------------------

    @classmethod
    def _trusted(cls, extents: tuple[tuple[int, int], ...]) -> RaggedShard:
        """From extents the caller built valid (ints that tile ``[0, numel)``), without the
        O(W) Python checks of the constructor: for the layouts every rank builds for every
        tensor (a whole tensor on one rank) at W in the thousands."""
        self = object.__new__(cls)
        object.__setattr__(self, "extents", extents)
        object.__setattr__(self, "_hash", hash(extents))
        object.__setattr__(self, "_bounds", None)
        return self

    @classmethod
    def from_boundaries(cls, boundaries: Sequence[int]) -> RaggedShard:
        """From W + 1 nondecreasing cut points ``0 = b_0 <= ... <= b_W = numel``."""
        b = list(boundaries)
        if set(map(type, b)) != {int}:
            b = [_as_int("boundary", x) for x in b]
        if len(b) < 2 or b[0] != 0:
            raise ValueError(f"boundaries must start at 0 and have W + 1 >= 2 entries, got {b}")
        if not all(map(operator.le, b, b[1:])):
            raise ValueError(f"boundaries must be nondecreasing, got {b}")
        # checked ints that tile [0, b_W]: the constructor's checks would find nothing
        self = cls._trusted(tuple(zip(b, map(operator.sub, b[1:], b), strict=False)))
        object.__setattr__(self, "_bounds", tuple(b))
        return self

    @classmethod
    def shard0(cls, shape: Sequence[int], world_size: int) -> RaggedShard:
        """FSDP2's ``Shard(0)``: torch.chunk on dim 0, empty trailing shards included."""
        shape = check_shape(shape)
        w = _check_world(world_size)
        rows = shape[0] if shape else 1
        row = math.prod(shape[1:]) if shape else 1
        chunk = -(-rows // w) if rows else 0
        bounds = [min(r * chunk, rows) * row for r in range(w + 1)]
        bounds[-1] = rows * row
        return cls.from_boundaries(bounds)

    @classmethod
    def whole(cls, numel: int, world_size: int, rank: int) -> RaggedShard:
        """The whole tensor on ``rank``, empty slices elsewhere."""
        w = _check_world(world_size)
        numel = _as_int("numel", numel)
        rank = _as_int("rank", rank)
        if not 0 <= rank < w:
            raise ValueError(f"rank must be in [0, {w}), got {rank}")
        if numel < 0:
            raise ValueError(f"numel must be >= 0, got {numel}")
        if cls is RaggedShard:  # immutable: every optimizer step asks for the same few
            return _whole(numel, w, rank)
        return cls.from_boundaries([0] * (rank + 1) + [numel] * (w - rank))

    # -- queries ------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return len(self.extents)

    @property
    def numel(self) -> int:
        s, n = self.extents[-1]
        return s + n

    @property
    def boundaries(self) -> tuple[int, ...]:
        """W + 1 cut points: rank r holds ``[b[r], b[r + 1])``."""
        if self._bounds is None:
            object.__setattr__(self, "_bounds",
                               (0, *itertools.accumulate(map(_LENGTH, self.extents))))
        return self._bounds

    def local(self, rank: int) -> tuple[int, int]:
        """``(start, length)`` of ``rank``'s slice."""
        return self.extents[rank]

    def flat_span(self, rank: int) -> tuple[int, int]:
        """``[lo, hi)``: the flat range of rank's slice (as ``BoxShard.flat_span``)."""
        s, n = self.extents[rank]
        return (s, s + n)

    def holders(self, lo: int, hi: int) -> range:
        """The ranks, in increasing order, whose slice may meet ``[lo, hi)`` (as
        ``BoxShard.holders``): a bisection on the boundaries, empty slices at its ends
        included."""
        if lo >= hi:
            return range(0)
        return holders_between(self.boundaries, lo, hi)

    def local_index(self, rank: int, device: object = "cpu") -> slice:
        """Index of ``rank``'s elements in the flat tensor (as BoxShard's): a slice."""
        s, n = self.extents[rank]
        return slice(s, s + n)

    def count_below(self, rank: int, x: int) -> int:
        """How many of ``rank``'s elements have a flat index below ``x`` (as BoxShard's)."""
        s, n = self.extents[rank]
        return min(max(x - s, 0), n)

    def local_numel(self, rank: int) -> int:
        """Elements of ``rank``'s slice (as for every layout kind, BoxShard included)."""
        return self.extents[rank][1]

    def satisfies(self, requirement: Requirement | int, shape: Sequence[int] | None = None) -> bool:
        """Whether every interior cut is legal for ``requirement`` (a Requirement or a unit).
        A tensor with no elements has no cut to check: it satisfies every requirement."""
        n = self.numel
        if n == 0:
            if shape is not None and math.prod(check_shape(shape)) != 0:
                raise ValueError(f"shape {tuple(shape)} has {math.prod(shape)} elements, "
                                 "layout has 0")
            return True
        unit = self._unit(requirement, shape)
        return all(is_legal_cut(b, n, unit) for b in self.boundaries[1:-1])

    def snapped(self, requirement: Requirement | int,
                shape: Sequence[int] | None = None) -> RaggedShard:
        """The nearest layout that satisfies ``requirement``: each boundary moves to the
        nearest legal cut (ties go down), so only the pieces at boundaries change rank."""
        unit = self._unit(requirement, shape)
        n = self.numel
        out = []
        for b in self.boundaries:
            lo = (b // unit) * unit
            hi = min(lo + unit, n) if lo != b else b
            out.append(lo if b - lo <= hi - b else hi)
        out[0], out[-1] = 0, n
        return RaggedShard.from_boundaries(out)

    def _unit(self, requirement: Requirement | int, shape: Sequence[int] | None) -> int:
        if isinstance(requirement, Requirement):
            if shape is None:
                raise TypeError("a Requirement needs the tensor's shape to resolve its unit")
            shape = check_shape(shape)
            if math.prod(shape) != self.numel:
                raise ValueError(f"shape {shape} has {math.prod(shape)} elements, layout has "
                                 f"{self.numel}")
            return requirement.unit(shape)
        unit = _as_int("unit", requirement)
        if unit < 1:
            raise ValueError(f"unit must be >= 1, got {unit}")
        return unit


_START, _LENGTH = operator.itemgetter(0), operator.itemgetter(1)


def _tile_exactly(extents: object) -> bool:
    """Whether ``extents`` is a non-empty tuple of (int, int) tuples (ints, not bools)
    with lengths >= 0 and each start the previous end, from 0: the constructor's checks
    in one pass per field in C. False sends it to the checks that name what is wrong."""
    if type(extents) is not tuple or not extents or set(map(type, extents)) != {tuple}:
        return False
    if set(map(len, extents)) != {2}:
        return False
    starts, lengths = tuple(map(_START, extents)), tuple(map(_LENGTH, extents))
    if set(map(type, starts)) != {int} or set(map(type, lengths)) != {int} or min(lengths) < 0:
        return False
    return starts == tuple(itertools.accumulate(lengths[:-1], initial=0))


def _check_world(world_size: object) -> int:
    w = _as_int("world_size", world_size)
    if w < 1:
        raise ValueError(f"world_size must be >= 1, got {w}")
    return w


@functools.lru_cache(maxsize=4096)
def _whole(numel: int, world_size: int, rank: int) -> RaggedShard:
    """``RaggedShard.whole`` of checked ints, built once (by tuple repetition: C speed)."""
    return RaggedShard._trusted(((0, 0),) * rank + ((0,
                                                     numel),) + ((numel,
                                                                  0),) * (world_size - rank - 1))


def holders_between(boundaries: Sequence[int], lo: int, hi: int) -> range:
    """:meth:`RaggedShard.holders` of ``[lo, hi)`` (``lo < hi``) from the layout's
    ``boundaries``, for a caller that asks for many ranges of one layout (its W + 1
    boundaries built once)."""
    w = len(boundaries) - 1
    return range(max(bisect_right(boundaries, lo) - 1, 0),
                 min(bisect_left(boundaries, hi) - 1, w - 1) + 1)
