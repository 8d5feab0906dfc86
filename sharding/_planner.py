"""Structure-aware planner: place a set of tensors in one flat W * m buffer.

Every rank holds ``m`` consecutive elements of the buffer (``m`` a multiple of
``align``, equal on every rank). Each rank boundary ``k * m`` that falls strictly inside
a tensor must be a legal cut of that tensor (see sharding/_requirement.py). Padding is
``W * m - N``. Minimizing it contains multiprocessor scheduling (NP-hard), so the
planner is a polynomial heuristic; see :func:`plan_buffer`.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from ._ragged import RaggedShard, _check_world
from ._requirement import _check_positive_int, check_shape, is_legal_cut

__all__ = ["TensorSpec", "BufferPlan", "plan_buffer", "padding_lower_bound", "fsdp2_row_padding"]


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor of a buffer plan: a unique name, its shape and its unit (>= 1).

    A unit larger than numel means "the whole tensor" and is clamped to numel. A 0-d
    tensor is planned as shape ``(1,)``; shapes with zero elements are rejected.
    """

    name: str
    shape: tuple[int, ...]
    unit: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"TensorSpec name must be a non-empty str, got {self.name!r}")
        shape = check_shape(self.shape)
        if not shape:
            raise ValueError(f"TensorSpec {self.name!r}: shape () is empty; plan a 0-d "
                             "tensor as (1,)")
        if math.prod(shape) == 0:
            raise ValueError(f"TensorSpec {self.name!r}: shape {shape} has no elements")
        _check_positive_int(f"TensorSpec {self.name!r} unit", self.unit)
        object.__setattr__(self, "shape", shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def effective_unit(self) -> int:
        return min(self.unit, self.numel)


@lru_cache(maxsize=65536)
def _plan_layout(world_size: int, m: int, off: int, n: int) -> RaggedShard:
    """The layout of a tensor of ``n`` elements at flat offset ``off`` of a buffer of
    ``world_size`` shards of ``m``: empty slices before and after the ranks it spans, built
    by tuple repetition, so O(ranks spanned) and not O(W) Python per tensor."""
    if n == 0 or m == 0:
        return RaggedShard._trusted(((0, 0),) * world_size)
    first, last = off // m, (off + n - 1) // m
    spanned = tuple((max(r * m - off, 0), min((r + 1) * m - off, n) - max(r * m - off, 0))
                    for r in range(first, last + 1))
    return RaggedShard._trusted(((0, 0),) * first + spanned + ((n, 0),) * (world_size - last - 1))


@dataclass(frozen=True, slots=True)
class BufferPlan:
    """Where each tensor lives in one flat W * m buffer (a fully_shard store's)."""

    world_size: int
    shard_size: int  # m: elements per rank, a multiple of align
    align: int
    specs: tuple[TensorSpec, ...]
    offset_list: tuple[int, ...]  # same order as specs

    def __post_init__(self) -> None:
        self.validate()

    @property
    def offsets(self) -> dict[str, int]:
        """``{name: flat offset of the tensor's first element in the W * m buffer}``."""
        return {s.name: o for s, o in zip(self.specs, self.offset_list, strict=True)}

    @property
    def total_numel(self) -> int:
        return sum(s.numel for s in self.specs)

    @property
    def global_size(self) -> int:
        return self.world_size * self.shard_size

    @property
    def padding(self) -> int:
        return self.global_size - self.total_numel

    @property
    def lower_bound(self) -> int:
        return padding_lower_bound(self.specs, self.world_size, self.align)

    def spec(self, name: str) -> TensorSpec:
        for s in self.specs:
            if s.name == name:
                return s
        raise KeyError(f"no tensor named {name!r} in this plan; names: "
                       f"{[s.name for s in self.specs]}")

    def layout(self, name: str) -> RaggedShard:
        """The RaggedShard of tensor ``name`` implied by the plan."""
        for s, off in zip(self.specs, self.offset_list, strict=True):
            if s.name == name:
                return _plan_layout(self.world_size, self.shard_size, off, s.numel)
        raise KeyError(f"no tensor named {name!r} in this plan; names: "
                       f"{[s.name for s in self.specs]}")

    def local_slices(self, rank: int) -> list[tuple[str, int, int, int]]:
        """Tensors overlapping ``rank``'s shard: ``(name, start_in_tensor, start_in_shard,
        length)``."""
        m = self.shard_size
        lo, hi = rank * m, (rank + 1) * m
        out = []
        for s, off in zip(self.specs, self.offset_list, strict=True):
            a, b = max(lo, off), min(hi, off + s.numel)
            if a < b:
                out.append((s.name, a - off, a - lo, b - a))
        return out

    def fingerprint(self) -> str:
        """A stable hash of the plan, equal on every rank iff the plans are equal."""
        text = repr((self.world_size, self.shard_size, self.align, tuple(
            (s.name, s.shape, s.unit, o)
            for s, o in zip(self.specs, self.offset_list, strict=True))))
        return hashlib.sha256(text.encode()).hexdigest()

    def validate(self) -> None:
        """Check the plan's invariants; raises AssertionError naming the broken one."""
        w, m = self.world_size, self.shard_size
        if m < 0 or m % self.align:
            raise AssertionError(f"shard_size {m} is not a non-negative multiple of align "
                                 f"{self.align}")
        if len(self.offset_list) != len(self.specs):
            raise AssertionError(f"{len(self.offset_list)} offsets for {len(self.specs)} tensors")
        spans = sorted((o, o + s.numel, s)
                       for s, o in zip(self.specs, self.offset_list, strict=True))
        prev_end = 0
        for start, end, s in spans:
            if start < prev_end or end > w * m:
                raise AssertionError(f"tensor {s.name!r} at [{start}, {end}) overlaps or "
                                     f"exceeds W*m={w * m}")
            prev_end = end
            # Interior boundaries are b, b + m, ...: all legal iff the first is and,
            # when there are two or more, m is a multiple of the unit.
            b = (start // m + 1) * m if m else end
            u = s.effective_unit
            if b < end and (not is_legal_cut(b - start, s.numel, u) or (b + m < end and m % u)):
                raise AssertionError(
                    f"a rank boundary (m={m}) cuts tensor {s.name!r} at offset {start} off its "
                    f"unit {u}")


def _check_specs(specs: Iterable[TensorSpec]) -> tuple[TensorSpec, ...]:
    specs = tuple(specs)
    seen: set[str] = set()
    for s in specs:
        if not isinstance(s, TensorSpec):
            raise TypeError(f"plan_buffer takes TensorSpec objects, got {s!r}")
        if s.name in seen:
            raise ValueError(f"duplicate tensor name {s.name!r} in one buffer plan")
        seen.add(s.name)
    return specs


def _round_up(x: int, a: int) -> int:
    return -(-x // a) * a


def padding_lower_bound(specs: Sequence[TensorSpec], world_size: int, align: int = 1) -> int:
    """``W * max(ceil(N / W), largest unit), rounded up to align`` minus N.

    No plan pads less: every rank holds m >= ceil(N / W) elements, and a whole unit
    (a block, or a whole tensor) can never be split, so m >= the largest unit.
    """
    specs = _check_specs(specs)
    w = _check_world(world_size)
    _check_positive_int("align", align)
    n = sum(s.numel for s in specs)
    if not specs:
        return 0
    m = max(_round_up(-(-n // w), align), _round_up(max(s.effective_unit for s in specs), align))
    return w * m - n


def fsdp2_row_padding(shapes: Iterable[Sequence[int]], world_size: int) -> int:
    """Elements FSDP2 pads for the same tensors: each pads dim 0 to a multiple of W."""
    w = _check_world(world_size)
    total = 0
    for shape in shapes:
        shape = check_shape(shape) or (1,)
        rows, row = shape[0], math.prod(shape[1:])
        total += (_round_up(rows, w) - rows) * row
    return total


_ROTATE_MAX = 16
_GREEDY_MAX = 64


def _first_fit(pos: int, n: int, u: int, m: int) -> int | None:
    """Earliest offset >= pos at which a tensor of numel n, unit u is legally placed."""
    for start in (pos, (pos // m + 1) * m) if pos % m else (pos,):
        b = (start // m + 1) * m  # first rank boundary after start
        if start + n <= b:
            return start
        o = start + (b - start) % u
        if o >= b:
            continue  # cannot reach a legal cut before b from this rank
        if o + n <= b + m or m % u == 0:
            return o
    return None


def _placeable(n: int, u: int, m: int) -> bool:
    """Whether a tensor of numel n, unit u has any legal offset for shard size m: it fits
    in one rank, or m % u == 0, or it crosses one boundary with a multiple of u before it
    and at most m elements on each side."""
    return n <= m or m % u == 0 or _round_up(n - m, u) <= m


def _place(order: Sequence[int], sizes: Sequence[int], units: Sequence[int], m: int,
           cap: int) -> list[int] | None:
    offsets = [0] * len(sizes)
    remaining = list(order)
    placed = [False] * len(sizes)
    by_size = sorted(order, key=sizes.__getitem__)  # for the smallest remaining size
    small = 0
    pos = 0
    while remaining:
        i = remaining[0]
        o = _first_fit(pos, sizes[i], units[i], m)
        if o is None:
            return None
        if o > pos:
            while placed[by_size[small]]:
                small += 1
            if o - pos >= sizes[by_size[small]]:
                pos = _fill_gap(pos, o, remaining, sizes, units, m, offsets, placed)
                o = _first_fit(pos, sizes[i], units[i], m)
                if o is None:  # pragma: no cover - filling never makes a legal offset illegal
                    return None
        offsets[i] = o
        placed[i] = True
        pos = o + sizes[i]
        remaining.remove(i)
        if pos > cap:
            return None
    return offsets


def _fill_gap(pos: int, limit: int, remaining: list[int], sizes, units, m, offsets, placed) -> int:
    """Place remaining tensors (not remaining[0]) into [pos, limit), largest first."""
    head = remaining[0]
    while True:
        best, best_o = None, None
        for j in remaining:
            if j == head or sizes[j] > limit - pos:
                continue
            o = _first_fit(pos, sizes[j], units[j], m)
            if o is not None and o + sizes[j] <= limit and (best is None or sizes[j] > sizes[best]):
                best, best_o = j, o
        if best is None:
            return pos
        offsets[best] = best_o
        placed[best] = True
        pos = best_o + sizes[best]
        remaining.remove(best)


def _place_dynamic(sizes: Sequence[int], units: Sequence[int], key: Sequence[tuple[int, ...]],
                   m: int, cap: int) -> list[int] | None:
    """Step 4 of :func:`plan_buffer`'s heuristic: least waste next, ties by ``key``."""
    offsets = [0] * len(sizes)
    remaining = list(range(len(sizes)))
    pos = 0
    while remaining:
        best, best_o, best_k = -1, 0, None
        for j in remaining:
            o = _first_fit(pos, sizes[j], units[j], m)
            if o is None or o + sizes[j] > cap:
                continue
            k = (o - pos, key[j])
            if best_k is None or k < best_k:
                best, best_o, best_k = j, o, k
        if best_k is None:
            return None
        offsets[best] = best_o
        pos = best_o + sizes[best]
        remaining.remove(best)
    return offsets


def _candidate_ms(m0: int, align: int, units: Sequence[int], linear: int = 64) -> Iterable[int]:
    seen: set[int] = set()
    extra = sorted({_round_up(m0, math.lcm(u, align)) for u in set(units) if u > 1})
    queue = sorted({m0 + k * align for k in range(linear)} | set(extra))
    for m in queue:
        seen.add(m)
        yield m
    m = queue[-1]
    while True:
        m = _round_up(max(m + align, int(m * 1.02)), align)
        for mm in sorted({m} | {_round_up(m, math.lcm(u, align)) for u in set(units) if u > 1}):
            if mm not in seen:
                seen.add(mm)
                yield mm


def plan_buffer(specs: Iterable[TensorSpec], world_size: int, align: int = 1) -> BufferPlan:
    """Plan one buffer: order and offsets of its tensors in a W * m buffer.

    Deterministic: the same arguments give the same plan on every rank and every run.

    For a fixed tensor order and a fixed m, placing each tensor at its earliest legal
    offset minimizes every later position, since a legal offset stays legal whatever came
    before. So an order and an m define one placement. The heuristic:

    1. scans m upward from the lower bound, in steps of align, then geometrically, adding
       the multiples of each unit, since m % u == 0 lets a tensor of unit u span any
       number of ranks;
    2. for each m tries a few orders: coarse units first, so that fine tensors fill the
       tail; largest first; and the given order, so it is never worse than that. For few
       tensors it also tries each of those with one tensor moved to the front;
    3. when a tensor must be pushed forward to reach a legal cut, first fills the gap with
       the largest remaining tensors that fit it, usually fine-grained ones;
    4. then tries a dynamic order: at each position, the remaining tensor that wastes the
       least (earliest legal offset minus position), coarse or large ones on ties. It packs
       whole tensors next to the pieces of splittable ones that fill a rank.

    The first m with a placement wins, since padding W * m - N grows with m. Work per m is
    O(k^3) for k tensors in a small plan, O(k^2) beyond _ROTATE_MAX, and the dynamic order
    is skipped beyond _GREEDY_MAX tensors, so big plans stay fast.
    """
    specs = _check_specs(specs)
    w = _check_world(world_size)
    _check_positive_int("align", align)
    return _plan_cached(specs, w, align)


@lru_cache(maxsize=4096)
def _plan_cached(specs: tuple[TensorSpec, ...], w: int, align: int) -> BufferPlan:
    if not specs:
        return BufferPlan(w, 0, align, (), ())
    sizes = [s.numel for s in specs]
    units = [s.effective_unit for s in specs]
    n = sum(sizes)
    m0 = max(_round_up(-(-n // w), align), _round_up(max(units), align))
    k = len(specs)
    keys = [[(-units[i], -sizes[i], i) for i in range(k)], [(-sizes[i], i) for i in range(k)]]
    orders: list[list[int]] = []
    for o in (*(sorted(range(k), key=key.__getitem__) for key in keys), list(range(k))):
        if o not in orders:
            orders.append(o)
    if k <= _ROTATE_MAX:
        for base in orders[:2]:
            for i in range(1, k):
                o = [base[i], *base[:i], *base[i + 1:]]
                if o not in orders:
                    orders.append(o)
    kinds = sorted(set(zip(sizes, units, strict=True)), reverse=True)
    for m in _candidate_ms(m0, align, units):
        if not all(_placeable(n, u, m) for n, u in kinds):
            continue
        for order in orders:
            offsets = _place(order, sizes, units, m, w * m)
            if offsets is not None:
                return BufferPlan(w, m, align, specs, tuple(offsets))
        if k <= _GREEDY_MAX:
            for key in keys:
                offsets = _place_dynamic(sizes, units, key, m, w * m)
                if offsets is not None:
                    return BufferPlan(w, m, align, specs, tuple(offsets))
    raise AssertionError("unreachable: m >= N always admits a plan")  # pragma: no cover
