"""RaggedShard tests: constructors against torch, satisfies / snapped against definitions."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vefsdp_optim.sharding import (
    Elementwise,
    FlatBlocks,
    RaggedShard,
    RowBlocks,
    WholeTensor,
    is_legal_cut,
)


@st.composite
def _layouts(draw, max_numel: int = 200, max_world: int = 12):
    """A random RaggedShard: W + 1 sorted cut points in [0, numel]."""
    numel = draw(st.integers(0, max_numel))
    w = draw(st.integers(1, max_world))
    cuts = sorted(draw(st.lists(st.integers(0, numel), min_size=w - 1, max_size=w - 1)))
    return RaggedShard.from_boundaries([0, *cuts, numel])


def _independent_satisfies(bounds: tuple[int, ...], unit: int) -> bool:
    n = bounds[-1]
    return all(b in (0, n) or b % unit == 0 for b in bounds)


@settings(max_examples=200, deadline=None)
@given(shape=st.lists(st.integers(0, 9), min_size=0, max_size=3), w=st.integers(1, 20))
def test_shard0_matches_torch_chunk(shape, w):
    t = torch.arange(math.prod(shape)).reshape(shape) if shape else torch.tensor(7)
    lay = RaggedShard.shard0(shape, w)
    assert lay.world_size == w and lay.numel == t.numel()
    chunks = torch.chunk(t if t.dim() else t.reshape(1), w, dim=0)
    lengths = [c.numel() for c in chunks] + [0] * (w - len(chunks))
    assert [n for _, n in lay.extents] == lengths
    flat = t.reshape(-1)
    start = 0
    for r, c in enumerate(chunks):
        a, n = lay.local(r)
        assert a == start
        assert torch.equal(flat[a:a + n], c.reshape(-1))
        start += n


@settings(max_examples=300, deadline=None)
@given(lay=_layouts(), unit=st.integers(1, 250))
def test_satisfies_and_snapped(lay, unit):
    bounds = lay.boundaries
    assert lay.satisfies(unit) == _independent_satisfies(bounds, unit)
    if lay.numel == 0:
        return
    snap = lay.snapped(unit)
    assert snap.world_size == lay.world_size and snap.numel == lay.numel
    assert _independent_satisfies(snap.boundaries, unit)
    assert snap.satisfies(unit)
    for b, s in zip(bounds, snap.boundaries, strict=True):
        assert abs(b - s) < unit
        assert s in (0, lay.numel) or s % unit == 0
    if lay.satisfies(unit):
        assert snap == lay


@settings(max_examples=100, deadline=None)
@given(rows=st.integers(1, 12), cols=st.integers(1, 6), w=st.integers(1, 8),
       k=st.integers(1, 5), block=st.integers(1, 20))
def test_requirements_resolve_units(rows, cols, w, k, block):
    shape = (rows, cols)
    numel = rows * cols
    assert Elementwise().unit(shape) == 1
    assert RowBlocks(k).unit(shape) == min(k * cols, numel)
    assert FlatBlocks(block).unit(shape) == min(block, numel)
    assert WholeTensor().unit(shape) == numel and WholeTensor().needs_whole
    assert not RowBlocks(k).needs_whole
    lay = RaggedShard.shard0(shape, w)
    # Shard(0) cuts only between rows: always whole rows, bands only when chunks align.
    assert lay.satisfies(RowBlocks(1), shape)
    chunk = -(-rows // w)
    assert lay.satisfies(RowBlocks(k), shape) == _independent_satisfies(
        lay.boundaries, min(k * cols, numel)) == (chunk % k == 0 or chunk >= rows)
    for r in range(w):
        whole = RaggedShard.whole(numel, w, r)
        assert _owner(whole) == r and whole.satisfies(WholeTensor(), shape)
        assert whole.local(r) == (0, numel)
    assert _owner(lay.snapped(WholeTensor(), shape)) is not None


def test_is_legal_cut():
    assert is_legal_cut(0, 10, 4) and is_legal_cut(8, 10, 4) and is_legal_cut(10, 10, 4)
    assert not is_legal_cut(6, 10, 4) and not is_legal_cut(11, 10, 4) and not is_legal_cut(-4, 10, 4)


def test_examples():
    lay = RaggedShard(((0, 3), (3, 0), (3, 5)))
    assert lay.boundaries == (0, 3, 3, 8) and lay.numel == 8 and _owner(lay) is None
    assert RaggedShard.shard0((5, 2), 4).extents == ((0, 4), (4, 4), (8, 2), (10, 0))
    assert RaggedShard.whole(6, 1, 0).extents == ((0, 6),)
    assert RaggedShard.whole(6, 3, 1).extents == ((0, 0), (0, 6), (6, 0))
    # ties snap down: boundary 6 with unit 4 is 2 from 4 and 2 from 8
    assert RaggedShard.from_boundaries([0, 6, 10]).snapped(4).boundaries == (0, 4, 10)
    assert RaggedShard.from_boundaries([0, 7, 10]).snapped(4).boundaries == (0, 8, 10)
    # the last block may be short: a cut at numel is always legal
    assert RaggedShard.from_boundaries([0, 9, 9]).snapped(4).boundaries == (0, 9, 9)
    assert RaggedShard.from_boundaries([0, 9, 10]).snapped(4).boundaries == (0, 8, 10)
    assert RaggedShard.from_boundaries([0, 10, 11]).snapped(4).boundaries == (0, 11, 11)
    with pytest.raises(AttributeError):
        lay.extents = ()  # type: ignore[misc]


def test_bad_input():
    with pytest.raises(ValueError, match="none"):
        RaggedShard(())
    with pytest.raises(ValueError, match="-1"):
        RaggedShard(((0, 3), (3, -1)))
    with pytest.raises(ValueError, match="starts at 4"):
        RaggedShard(((0, 3), (4, 1)))
    with pytest.raises(TypeError, match="1.5"):
        RaggedShard(((0, 1.5),))
    with pytest.raises(ValueError, match="nondecreasing"):
        RaggedShard.from_boundaries([0, 5, 3])
    with pytest.raises(ValueError, match="start at 0"):
        RaggedShard.from_boundaries([1, 5])
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        RaggedShard.shard0((4,), 0)
    with pytest.raises(TypeError, match="True"):
        RaggedShard.shard0((4,), True)
    with pytest.raises(ValueError, match="rank must be in \\[0, 2\\), got 2"):
        RaggedShard.whole(4, 2, 2)
    with pytest.raises(ValueError, match="-1"):
        RaggedShard.whole(-1, 2, 0)
    lay = RaggedShard.shard0((4, 3), 2)
    with pytest.raises(TypeError, match="shape"):
        lay.satisfies(RowBlocks(1))
    with pytest.raises(ValueError, match="13"):
        lay.satisfies(RowBlocks(1), (13,))
    with pytest.raises(ValueError, match="unit must be >= 1, got 0"):
        lay.satisfies(0)
    with pytest.raises(ValueError, match="no elements"):
        Elementwise().unit((0, 3))
    empty = RaggedShard.from_boundaries([0, 0, 0])  # no elements, so no cut to check
    assert empty.satisfies(RowBlocks(4), (0, 3)) and empty.satisfies(5)
    with pytest.raises(ValueError, match="has 6 elements, layout has 0"):
        empty.satisfies(RowBlocks(1), (2, 3))
    with pytest.raises(ValueError, match="rows must be >= 1, got 0"):
        RowBlocks(0)
    with pytest.raises(TypeError, match="True"):
        FlatBlocks(True)
    with pytest.raises(TypeError, match="2.0"):
        RowBlocks(2.0)


def _owner(layout: RaggedShard) -> int | None:
    """The rank holding the whole tensor, if one does (None if it is split)."""
    return next((r for r, (_, n) in enumerate(layout.extents) if n == layout.numel), None)


@settings(max_examples=200, deadline=None)
@given(numel=st.integers(0, 50), w=st.integers(1, 300), data=st.data())
def test_whole_equals_its_boundaries(numel: int, w: int, data: st.DataObject) -> None:
    """whole() (built by tuple repetition, unchecked) equals the checked constructor's
    layout of the same boundaries, hash and all."""
    rank = data.draw(st.integers(0, w - 1))
    fast = RaggedShard.whole(numel, w, rank)
    checked = RaggedShard.from_boundaries([0] * (rank + 1) + [numel] * (w - rank))
    assert fast == checked and hash(fast) == hash(checked) and fast.extents == checked.extents
    assert fast.local(rank) == (0, numel) and fast.world_size == w


def test_one_pass_extent_check_equals_the_rank_by_rank_checks():
    """RaggedShard's constructor checks its extents in one pass per field in C
    (_tile_exactly) and falls back to the rank-by-rank checks only to name what is
    wrong: on 500 random extents, most broken in one place (a gap, an overlap, a
    negative length, a bool or float, a list for a tuple, a 3-tuple), the one-pass check
    accepts exactly what the rank-by-rank checks accept; boundaries equal the running
    sums, built once."""
    import random

    from vefsdp_optim.sharding._ragged import _tile_exactly

    def by_rank(ext):  # noqa: ANN001, ANN202 - the definition
        if type(ext) is not tuple or not ext:
            return False
        expected = 0
        for e in ext:
            if type(e) is not tuple or len(e) != 2 or any(type(x) is not int for x in e):
                return False
            s, n = e
            if n < 0 or s != expected:
                return False
            expected = s + n
        return True

    rng = random.Random(0)
    for _ in range(500):
        lens = [rng.randint(0, 4) for _ in range(rng.randint(1, 6))]
        ext = [(sum(lens[:i]), n) for i, n in enumerate(lens)]
        r, what = rng.randrange(len(ext)), rng.choice(["none", "gap", "neg", "bool", "float", "list", "three"])
        s, n = ext[r]
        ext[r] = {"none": (s, n), "gap": (s + 1, n), "neg": (s, -1), "bool": (s, bool(n % 2)),
                  "float": (float(s), n), "list": [s, n], "three": (s, n, 0)}[what]
        ext = tuple(ext)
        assert _tile_exactly(ext) == by_rank(ext), (what, ext)
        if _tile_exactly(ext):
            layout = RaggedShard(ext)
            assert layout.boundaries == (0, *[s + n for s, n in ext])
            assert layout.boundaries is layout.boundaries
            assert RaggedShard.from_boundaries(list(layout.boundaries)) == layout
