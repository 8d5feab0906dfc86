"""BoxShard, pure (one process): the boxes of nested torch.chunk splits, counted and cut
in flat order, against plain tensor indexing of an arange ([Note: boxes in flat order])."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vefsdp_optim.sharding import Box, BoxShard


@st.composite
def _layouts(draw: st.DrawFn) -> BoxShard:
    """Nested chunk splits of a random shape over 1-3 mesh axes, optionally each box cut
    into two runs (fully_shard over a tensor-parallel box)."""
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=3)))
    sizes = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    splits: list[list[int]] = [[] for _ in shape]
    for a in draw(st.permutations(range(len(sizes)))):
        splits[draw(st.integers(0, len(shape) - 1))].append(a)
    layout = BoxShard.nested_chunks(shape, sizes, splits)
    if not draw(st.booleans()):
        return layout
    boxes = []
    for b in layout.boxes:
        cut = draw(st.integers(0, b.length))
        boxes += [Box(b.offsets, b.sizes, 0, cut), Box(b.offsets, b.sizes, cut, b.length - cut)]
    return BoxShard(shape, tuple(boxes))


@settings(max_examples=150, deadline=None)
@given(layout=_layouts(), data=st.data())
def test_boxes_partition_and_cut_in_flat_order(layout: BoxShard, data: st.DataObject) -> None:
    full = torch.arange(layout.numel).view(layout.shape)
    flat = full.reshape(-1)
    seen = torch.zeros(layout.numel, dtype=torch.int64)
    for r in range(layout.world_size):
        local = flat[layout.local_index(r)]
        assert local.numel() == layout.local_numel(r)
        assert bool((local[1:] > local[:-1]).all())  # increasing flat indices
        seen[local] += 1
        pieces = [full[tuple(slice(o, o + z) for o, z in zip(off, size, strict=True))].reshape(-1)
                  for off, size in layout.sub_boxes(r)]
        assert torch.equal(torch.cat(pieces) if pieces else local, local)
        x = data.draw(st.integers(0, layout.numel))
        assert layout.count_below(r, x) == int((local < x).sum())
        lo = data.draw(st.integers(0, layout.numel))
        hi = data.draw(st.integers(lo, layout.numel))
        seg = flat[lo:hi]
        got = [seg[f:f + math.prod(sz)].view(sz)[sl].reshape(-1) for f, sz, sl, _ in layout.range_parts(r, lo, hi)]
        assert torch.equal(torch.cat(got) if got else local[:0], local[(local >= lo) & (local < hi)])
        if layout.is_whole_box(r):
            assert torch.equal(full[layout.slices(r)].reshape(-1), local)
    assert bool((seen == 1).all())  # every element on exactly one rank
    ragged = layout.as_ragged()
    if ragged is not None:
        for r in range(layout.world_size):
            assert torch.equal(flat[ragged.local_index(r)], flat[layout.local_index(r)])


def test_fsdp2_tp_strided_rows() -> None:
    """(_StridedShard(0, sf=2), Shard(0)) on dp 3 x tp 2: tp splits 7 rows first (4 / 3),
    then dp chunks each (2 / 2 / 0 and 1 / 1 / 1); ranks in (dp, tp) row-major order."""
    layout = BoxShard.nested_chunks((7, 5), [3, 2], [[1, 0], []])
    rows = [(b.offsets[0], b.sizes[0]) for b in layout.boxes]
    assert rows == [(0, 2), (4, 1), (2, 2), (5, 1), (4, 0), (6, 1)]
    assert layout.as_ragged() is None


def test_bad_boxes_are_refused() -> None:
    with pytest.raises(ValueError, match="overlap"):
        BoxShard((4,), (Box((0,), (2,), 0, 2), Box((0,), (2,), 0, 2)))
    with pytest.raises(ValueError, match="dim 0"):
        BoxShard((4,), (Box((3,), (2,), 0, 2), Box((0,), (2,), 0, 2)))
    with pytest.raises(ValueError, match="exactly one dim"):
        BoxShard.nested_chunks((4, 4), [2, 2], [[0], [0]])
