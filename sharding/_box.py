"""BoxShard: each rank holds a box of the tensor (N-D DTensor placements), or a run of one.

See [Note: boxes in flat order].
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ._ragged import RaggedShard
from ._requirement import Requirement, check_shape

__all__ = ["BoxShard", "Box", "flat_range_boxes"]

# [Note: boxes in flat order]
# Tensor parallelism shards a parameter on several tensor dims over several mesh axes.
# FSDP2 + TP gives ``(_StridedShard(0, sf=2), Shard(0))`` for a colwise weight and
# ``(Shard(0), Shard(1))`` for a rowwise one. Each rank then holds a *box*: one
# contiguous index range per tensor dim. Nested torch.chunk splits of a range are
# ranges, so the local tensor is ``full[o0:o0+s0, o1:o1+s1, ...]``.
# The key fact: a box's elements, in its own row-major order, come in increasing order
# of their global row-major flat index. Two things follow.
#   - The box elements below a flat index x are a prefix of the local data. Its length
#     is counted in O(ndim) by ``count_below``. So the elements a box holds of a flat
#     range [lo, hi) are one contiguous run of the local data.
#   - A rank that holds a contiguous range, a RaggedShard slice, holds any box's part
#     of it at the flat indices ``flat_indices`` returns, also in increasing order.
# Redistributing between a BoxShard (the storage) and a RaggedShard (a compute layout
# with whole blocks) therefore needs no sort. One side of every piece is a contiguous
# run, the other an index gather or scatter. fully_shard over a TP-local tensor cuts
# that box's row-major order into runs, one per data-parallel rank. A ``Box`` carries an
# optional run ``[start, start + length)`` of its row-major order, which keeps the fact.


@dataclass(frozen=True, slots=True)
class Box:
    """One rank's part of a tensor: the run ``[start, start + length)`` of the row-major
    order of the box ``offsets`` / ``sizes`` (the whole box when ``length`` is the box's
    numel and ``start`` is 0)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    start: int
    length: int

    @property
    def box_numel(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True, slots=True)
class BoxShard:
    """Layout of one tensor of global ``shape`` over W ranks, rank r holding ``boxes[r]``.

    The boxes' runs partition the tensor's elements (every element on exactly one
    rank), which the constructor checks (count, bounds, no overlap); a rank's local data is
    its run, 1-D, in the box's row-major order ([Note: boxes in flat order]).
    """

    shape: tuple[int, ...]
    boxes: tuple[Box, ...]
    # computed once: a step hashes every layout it looks up, and W boxes are W tuples
    _hash: int = field(init=False, repr=False, compare=False)
    # built on first use by holders(): (runs' first flat index, sorted; their ranks; the
    # running max of their ends), a sweep index over the ranks' flat spans
    _spans: tuple | None = field(init=False, repr=False, compare=False, default=None)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if type(other) is not BoxShard:
            return NotImplemented
        return self._hash == other._hash and self.shape == other.shape and self.boxes == other.boxes

    def __post_init__(self) -> None:
        shape = check_shape(self.shape)
        object.__setattr__(self, "shape", shape)
        if not self.boxes:
            raise ValueError("BoxShard needs one box per rank, got none")
        total = 0
        for r, b in enumerate(self.boxes):
            if not isinstance(b, Box):
                raise TypeError(f"BoxShard.boxes[{r}] must be a Box, got {type(b).__name__}")
            if len(b.offsets) != len(shape) or len(b.sizes) != len(shape):
                raise ValueError(f"box of rank {r} has {len(b.offsets)}-D offsets and "
                                 f"{len(b.sizes)}-D sizes for a tensor of shape {shape}")
            for d, (o, s, n) in enumerate(zip(b.offsets, b.sizes, shape, strict=True)):
                if s < 0 or o < 0 or o + s > n:
                    raise ValueError(f"box of rank {r} spans [{o}, {o + s}) on dim {d} of size {n}")
            if not 0 <= b.start <= b.start + b.length <= b.box_numel:
                raise ValueError(f"run [{b.start}, {b.start + b.length}) of rank {r} is "
                                 f"not inside its box of {b.box_numel} elements")
            total += b.length
        if total != math.prod(shape):
            raise ValueError(f"the boxes hold {total} elements, the tensor of shape {shape} "
                             f"{math.prod(shape)}: they must partition it")
        _check_disjoint(self)
        object.__setattr__(self, "_hash", hash((shape, self.boxes)))
        object.__setattr__(self, "_spans", None)

    # -- constructors -------------------------------------------------------------

    @classmethod
    def runs_in_boxes(cls, boxes: BoxShard, runs: Sequence[RaggedShard]) -> BoxShard:
        """The layout over ``len(runs[0])`` x ``len(boxes)`` ranks (row-major: rank
        ``i * T + j``) where rank (i, j) holds run ``runs[j].local(i)`` of box j: a dp
        layout of each tp box (FSDP2's Shard(0) of a TP shard, our fully_shard's ragged
        slices). A partition whenever ``boxes`` is one and each ``runs[j]`` tiles box j's
        elements, which is checked in O(T), so the O(W log W) overlap sweep of the
        constructor is not run again."""
        if not isinstance(boxes, BoxShard):
            raise TypeError(f"boxes must be a BoxShard, got {type(boxes).__name__}")
        runs = tuple(runs)
        if len(runs) != boxes.world_size or not runs:
            raise ValueError(f"need one run layout per box ({boxes.world_size}), got {len(runs)}")
        dp = runs[0].world_size
        for j, (b, run) in enumerate(zip(boxes.boxes, runs, strict=True)):
            if not isinstance(run, RaggedShard) or run.world_size != dp:
                raise ValueError(f"runs[{j}] must be a RaggedShard over {dp} ranks, got {run!r}")
            if b.start or b.length != b.box_numel or run.numel != b.box_numel:
                raise ValueError(f"runs[{j}] holds {run.numel} elements; box {j} is a run of "
                                 f"{b.length} of {b.box_numel}: each run layout must "
                                 "tile a whole box")
        out = tuple(Box(boxes.boxes[j].offsets, boxes.boxes[j].sizes, *runs[j].local(i))
                    for i in range(dp) for j in range(len(runs)))
        self = object.__new__(cls)
        object.__setattr__(self, "shape", boxes.shape)
        object.__setattr__(self, "boxes", out)
        object.__setattr__(self, "_hash", hash((boxes.shape, out)))
        object.__setattr__(self, "_spans", None)
        return self

    @classmethod
    def nested_chunks(cls, shape: Sequence[int], mesh_sizes: Sequence[int],
                      splits: Sequence[Sequence[int]]) -> BoxShard:
        """The boxes of torch.chunk splits nested over mesh axes.

        ``mesh_sizes`` are the sizes of the sharding mesh axes; ranks are their
        coordinates in row-major order. ``splits[d]`` lists the axes (indices into
        ``mesh_sizes``) that split tensor dim d, outermost first: each splits the range
        the previous ones left with torch.chunk semantics (ceil-sized chunks, trailing
        ones possibly empty), as DTensor's ``Shard`` and FSDP2 do.
        """
        shape = check_shape(shape)
        sizes = tuple(int(s) for s in mesh_sizes)
        if len(splits) != len(shape):
            raise ValueError(f"splits must name the axes of each of the {len(shape)} dims, got "
                             f"{len(splits)}")
        used = [a for axes in splits for a in axes]
        if sorted(used) != list(range(len(sizes))):
            raise ValueError("each mesh axis must split exactly one dim once, got splits "
                             f"{splits} for {len(sizes)} axes")
        boxes = []
        for coord in _coords(sizes):
            offs, lens = [], []
            for d, axes in enumerate(splits):
                lo, hi = 0, shape[d]
                for a in axes:
                    chunk = -(-(hi - lo) // sizes[a])
                    lo, hi = min(lo + coord[a] * chunk, hi), min(lo + (coord[a] + 1) * chunk, hi)
                offs.append(lo)
                lens.append(hi - lo)
            n = math.prod(lens)
            boxes.append(Box(tuple(offs), tuple(lens), 0, n))
        return cls(shape, tuple(boxes))

    # -- queries ------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return len(self.boxes)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def local_numel(self, rank: int) -> int:
        return self.boxes[rank].length

    def local_shape(self, rank: int) -> tuple[int, ...]:
        """The shape of rank's local tensor (its box; the run must be the whole box)."""
        b = self.boxes[rank]
        if b.start or b.length != b.box_numel:
            raise ValueError(f"rank {rank} holds a run of {b.length} of its box "
                             f"{b.sizes}, not a box")
        return b.sizes

    def count_below(self, rank: int, x: int) -> int:
        """How many of rank's local elements have a flat index below ``x``."""
        b = self.boxes[rank]
        return min(max(_box_count_below(b.offsets, b.sizes, self.shape, x) - b.start, 0), b.length)

    def flat_indices(self, rank: int, lo: int, hi: int,
                     device: torch.device | str = "cpu") -> torch.Tensor:
        """The global flat indices (int64, increasing) of rank's local elements ``lo:hi``."""
        b = self.boxes[rank]
        pos = torch.arange(b.start + lo, b.start + hi, dtype=torch.int64, device=device)
        if hi <= lo:
            return pos
        flat = torch.zeros_like(pos)
        stride = 1
        for d in range(len(self.shape) - 1, -1, -1):
            s = b.sizes[d]
            flat += (pos % s + b.offsets[d]) * stride
            pos = pos // s
            stride *= self.shape[d]
        return flat

    def sub_boxes(self, rank: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """Rank's part as whole boxes ``(global offsets, sizes)`` in flat order: its box, or
        the at most 2 * ndim - 1 boxes of its run (see :func:`flat_range_boxes`)."""
        b = self.boxes[rank]
        if self.is_whole_box(rank):
            return [(b.offsets, b.sizes)] if b.length else []
        return [(tuple(o + a for o, a in zip(offsets, b.offsets, strict=True)), tuple(sizes))
                for offsets, sizes, _ in flat_range_boxes(b.sizes, b.start, b.length)]

    def range_parts(self, rank: int, lo: int,
                    hi: int) -> list[tuple[int, tuple[int, ...], tuple[slice, ...],
                                                                     tuple[int, ...]]]:
        """Rank's part intersected with the flat range ``[lo, hi)``, as strided pieces
        (see comm/_box_exchange.py): per box of the range (:func:`flat_range_boxes`) and
        sub-box of the rank that meet, ``(the range box's flat offset in the
        range, its sizes, the slices of the intersection inside it, the intersection's
        sizes)``. In this order the intersections' elements are the rank's local elements
        in ``[lo, hi)``, in order."""
        out = []
        ranges = flat_range_boxes(self.shape, lo, hi - lo)
        for p_off, p_size in self.sub_boxes(rank):
            for offsets, sizes, f in ranges:
                ilo = [max(o, bo) for o, bo in zip(offsets, p_off, strict=True)]
                ihi = [min(o + s, bo + bs)
                       for o, s, bo, bs in zip(offsets, sizes, p_off, p_size, strict=True)]
                if any(y <= x for x, y in zip(ilo, ihi, strict=True)):
                    continue
                out.append((f, tuple(sizes),
                            tuple(slice(x - o, y - o)
                                  for x, y, o in zip(ilo, ihi, offsets, strict=True)),
                            tuple(y - x for x, y in zip(ilo, ihi, strict=True))))
        return out

    def local_index(self, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Index of rank's elements in the flat tensor (as RaggedShard's): ``flat[index]``
        is its local data."""
        return self.flat_indices(rank, 0, self.local_numel(rank), device)

    def slices(self, rank: int) -> tuple[slice, ...]:
        """Index of rank's box in the full tensor (the run must be the whole box)."""
        b = self.boxes[rank]
        return tuple(slice(o, o + s) for o, s in zip(b.offsets, b.sizes, strict=True))

    def is_whole_box(self, rank: int) -> bool:
        b = self.boxes[rank]
        return b.start == 0 and b.length == b.box_numel

    def satisfies(self, requirement: Requirement | int, shape: Sequence[int] | None = None) -> bool:
        """Boxes keep only elementwise requirements (unit 1, not whole): a box cuts rows
        and blocks anywhere. Use ``RaggedShard.as_ragged`` first for contiguous ones."""
        if isinstance(requirement, Requirement):
            return not requirement.needs_whole and requirement.unit(self.shape) == 1
        return int(requirement) == 1

    def as_ragged(self) -> RaggedShard | None:
        """The same layout as a RaggedShard when every rank holds a contiguous flat range
        and the ranges are in rank order (e.g. ``(Replicate(), Shard(0))``), else None."""
        bounds = [0]
        for b in self.boxes:
            if b.length == 0:
                bounds.append(bounds[-1])
                continue
            start = _contiguous_start(b, self.shape)
            if start is None or start != bounds[-1]:
                return None
            bounds.append(start + b.length)
        return RaggedShard.from_boundaries(bounds)

    def flat_span(self, rank: int) -> tuple[int, int]:
        """``[lo, hi)``: the global flat indices of rank's first and (one past) last local
        element; every local element lies in it ([Note: boxes in flat order]); (0, 0)
        when rank holds none."""
        b = self.boxes[rank]
        if not b.length:
            return (0, 0)
        return (_flat_of(b, b.start, self.shape),
                _flat_of(b, b.start + b.length - 1, self.shape) + 1)

    def holders(self, lo: int, hi: int) -> list[int]:
        """The ranks, in increasing order, whose flat span meets ``[lo, hi)``: every rank
        holding an element there (and perhaps a few whose span only straddles it), found
        with a sweep index built once per layout, not a scan of the W boxes."""
        if lo >= hi:
            return []
        if self._spans is None:
            spans = sorted((*self.flat_span(r), r) for r in range(self.world_size)
                           if self.boxes[r].length)
            firsts = [a for a, _, _ in spans]
            ends, top = [], 0
            for _, b, _ in spans:
                top = max(top, b)
                ends.append(top)
            object.__setattr__(self, "_spans", (firsts, [r for _, _, r in spans], ends))
        firsts, ranks, ends = self._spans
        j0, j1 = bisect_right(ends, lo), bisect_left(firsts, hi)
        return sorted(ranks[j0:j1])

    def even_split(self) -> RaggedShard:
        """The RaggedShard of equal element counts (the remainder to the first ranks):
        the compute layout a block requirement snaps, for boxes that cut its blocks."""
        n, w = self.numel, self.world_size
        return RaggedShard.from_boundaries([r * n // w for r in range(w + 1)])


def _check_disjoint(layout: BoxShard) -> None:
    """ValueError when two ranks' parts overlap (a sweep over dim 0 of their sub-boxes)."""
    if not layout.shape:
        return
    parts = sorted((off, size, r) for r in range(layout.world_size)
                   for off, size in layout.sub_boxes(r))
    for i, (off, size, r) in enumerate(parts):
        for off2, size2, r2 in parts[i + 1:]:
            if off2[0] >= off[0] + size[0]:
                break
            if all(a < b + z2 and b < a + z
                   for a, z, b, z2 in zip(off, size, off2, size2, strict=True)):
                raise ValueError(f"the parts of ranks {r} and {r2} overlap (boxes at {off} of "
                                 f"{size} and at {off2} of {size2}): the boxes must "
                                 "partition the tensor")


def _coords(sizes: tuple[int, ...]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for s in sizes:
        out = [c + (i,) for c in out for i in range(s)]
    return out


def _box_count_below(offsets: tuple[int, ...], sizes: tuple[int, ...], shape: tuple[int, ...],
                     x: int) -> int:
    """Elements of the box whose global flat index is below ``x`` ([Note: boxes in flat order])."""
    n = math.prod(shape)
    if x >= n:
        return math.prod(sizes)
    if x <= 0 or not n:
        return 0
    idx = []
    for s in reversed(shape):
        idx.append(x % s)
        x //= s
    idx.reverse()
    count = 0
    for d, (o, s) in enumerate(zip(offsets, sizes, strict=True)):
        count += min(max(idx[d] - o, 0), s) * math.prod(sizes[d + 1:])
        if not o <= idx[d] < o + s:
            break
    return count


def _contiguous_start(b: Box, shape: tuple[int, ...]) -> int | None:
    """The flat start of a nonempty run that is one contiguous flat range, else None."""
    # the run is contiguous iff the flat indices of its first and last element are
    # `length - 1` apart (they are increasing)
    first = _flat_of(b, b.start, shape)
    last = _flat_of(b, b.start + b.length - 1, shape)
    return first if last - first == b.length - 1 else None


def _flat_of(b: Box, pos: int, shape: tuple[int, ...]) -> int:
    flat, stride = 0, 1
    for d in range(len(shape) - 1, -1, -1):
        flat += (pos % b.sizes[d] + b.offsets[d]) * stride
        pos //= b.sizes[d]
        stride *= shape[d]
    return flat


def flat_range_boxes(shape: Sequence[int], start: int,
                     length: int) -> list[tuple[torch.Size, torch.Size, int]]:
    """Boxes ``(offsets, sizes, flat offset in the range)`` covering the flat range
    ``[start, start + length)`` of a row-major tensor of ``shape``, in flat order.

    DCP (torch.distributed.checkpoint) describes a rank's part of a tensor as boxes
    (offsets, sizes) in the global shape. A rank's ragged slice is a contiguous flat range,
    the union of at most 2 * (ndim - 1) + 1 boxes: a partial leading row, itself split
    recursively over the inner dims, a run of whole rows, and a partial trailing row. Each
    box is contiguous in flat order, so it is a plain view of the local data. DCP then
    reshards between these boxes and any other layout by itself: FSDP2's Shard(0), a plain
    tensor, another world size."""
    shape = tuple(shape)
    numel = math.prod(shape)
    if start < 0 or length < 0 or start + length > numel:
        raise ValueError(f"flat range [{start}, {start + length}) is not inside a tensor of "
                         f"{numel} elements")
    if length == 0:
        return []
    if not shape:
        return [(torch.Size(()), torch.Size(()), 0)]
    out: list[tuple[torch.Size, torch.Size, int]] = []

    def rec(dims: tuple[int, ...], prefix: tuple[int, ...], s: int, e: int, base: int) -> None:
        # [s, e) is a flat range inside the sub-tensor at index `prefix`, of shape `dims`
        lead = len(prefix)
        pad = (1,) * lead
        if len(dims) == 1:
            out.append((torch.Size(prefix + (s,)), torch.Size(pad + (e - s,)), base))
            return
        inner = math.prod(dims[1:])
        r0, r1 = s // inner, e // inner
        if s % inner:
            stop = min(e, (r0 + 1) * inner)
            rec(dims[1:], prefix + (r0,), s - r0 * inner, stop - r0 * inner, base)
            base += stop - s
            s, r0 = stop, r0 + 1
        if s >= e:
            return
        if r1 > r0:
            out.append((torch.Size(prefix + (r0,) + (0,) * (len(dims) - 1)),
                        torch.Size(pad + (r1 - r0,) + tuple(dims[1:])), base))
            base += (r1 - r0) * inner
        if e % inner:
            rec(dims[1:], prefix + (r1,), 0, e - r1 * inner, base)

    rec(shape, (), start, start + length, 0)
    return out
