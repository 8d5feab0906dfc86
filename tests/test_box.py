"""BoxShard, pure (one process): the boxes of nested torch.chunk splits, counted and cut
in flat order, against plain tensor indexing of an arange ([Note: boxes in flat order])."""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vefsdp_optim.sharding import Box, BoxShard, RaggedShard


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


# -- the exchange between boxes and ragged slices, planned from flat spans ------------------


@st.composite
def _exchange(draw: st.DrawFn) -> tuple[list, list]:
    """A batch of 1-4 tensors over one W: each a BoxShard and a random RaggedShard of it
    (in either direction), or two RaggedShards, or the same BoxShard twice."""
    from vefsdp_optim.sharding import RaggedShard

    first = draw(_layouts())
    w = first.world_size
    src, dst = [], []
    for _ in range(draw(st.integers(1, 4))):
        box = first
        cuts = sorted(draw(st.lists(st.integers(0, box.numel), min_size=w - 1, max_size=w - 1)))
        ragged = RaggedShard.from_boundaries([0, *cuts, box.numel])
        kind = draw(st.sampled_from(["box->ragged", "ragged->box", "ragged->ragged", "box->box"]))
        if kind == "box->ragged":
            src.append(box), dst.append(ragged)
        elif kind == "ragged->box":
            src.append(ragged), dst.append(box)
        elif kind == "ragged->ragged":
            cuts2 = sorted(draw(st.lists(st.integers(0, box.numel), min_size=w - 1, max_size=w - 1)))
            src.append(ragged), dst.append(RaggedShard.from_boundaries([0, *cuts2, box.numel]))
        else:
            src.append(box), dst.append(box)
    return src, dst


@settings(max_examples=150, deadline=None)
@given(batch=_exchange(), data=st.data())
def test_box_plan_equals_a_scan_of_every_peer(batch, data) -> None:
    """The plan found from flat spans against the definition (every (peer, tensor) pair's
    count), and BoxShard.holders against a scan of the ranks."""
    from vefsdp_optim.comm._box_exchange import _count, box_plan

    src, dst = batch
    w = src[0].world_size
    for rank in range(w):
        plan = box_plan(tuple(src), tuple(dst), rank, w)
        sends = [(p, i) for p in range(w) if p != rank for i in range(len(src)) if _count(src[i], dst[i], rank, p)]
        recvs = [(p, i, n) for p in range(w) for i in range(len(src)) if (n := _count(src[i], dst[i], p, rank))]
        assert list(plan.sends) == sends
        assert list(plan.recvs) == recvs
        assert list(plan.send_counts) == [sum(_count(s, d, rank, p) for s, d in zip(src, dst, strict=True))
                                          if p != rank else 0 for p in range(w)]
        assert list(plan.recv_counts) == [sum(_count(s, d, p, rank) for s, d in zip(src, dst, strict=True))
                                          if p != rank else 0 for p in range(w)]
    box = next((x for x in (*src, *dst) if isinstance(x, BoxShard)), None)
    if box is not None:
        lo = data.draw(st.integers(0, box.numel))
        hi = data.draw(st.integers(lo, box.numel))
        holding = [r for r in range(w) if box.count_below(r, hi) - box.count_below(r, lo)]
        assert set(holding) <= set(box.holders(lo, hi)), (holding, box.holders(lo, hi))


@settings(max_examples=60, deadline=None)
@given(batch=_exchange())
def test_box_exchange_moves_every_element(batch) -> None:
    """All W ranks' launches and unpacks, with the all-to-all played in this process:
    every rank ends with exactly its slices under dst of each tensor."""
    from vefsdp_optim.comm._box_exchange import box_plan, launch_boxes

    src, dst = batch
    w = src[0].world_size
    full = [torch.arange(s.numel, dtype=torch.float64) + 1000 * i for i, s in enumerate(src)]
    launched = []
    with mock.patch.object(torch.distributed, "all_to_all_single", lambda *a, **k: None):
        for rank in range(w):
            locals_ = [f[s.local_index(rank)] for f, s in zip(full, src, strict=True)]
            plan = box_plan(tuple(src), tuple(dst), rank, w)
            _, (send, recv), finish = launch_boxes(locals_, src, dst, plan, None, rank, False)
            launched.append((plan, send, recv, finish))
    for q, (plan_q, _, recv, _) in enumerate(launched):  # the all-to-all
        parts = []
        for plan_p, send, _, _ in launched:
            at = sum(plan_p.send_counts[:q])
            parts.append(send[at:at + plan_p.send_counts[q]])
        assert [x.numel() for x in parts] == list(plan_q.recv_counts)
        recv.copy_(torch.cat(parts))
    for rank, (_, _, _, finish) in enumerate(launched):
        for i, (out, d) in enumerate(zip(finish(), dst, strict=True)):
            assert torch.equal(out, full[i][d.local_index(rank)]), (rank, i)


def test_runs_in_boxes_equals_the_checked_constructor() -> None:
    """The dp x tp layout built from checked tp boxes and dp runs equals the one the
    constructor builds (and checks) box by box; a run that does not tile its box is refused."""
    tp = BoxShard.nested_chunks((7, 10), (3,), [[], [0]])  # columns over tp 3: 4, 4, 2
    runs = [RaggedShard.from_boundaries([0, 5, 5, 28]), RaggedShard.shard0((7, 4), 3),
            RaggedShard.whole(14, 3, 1)]
    got = BoxShard.runs_in_boxes(tp, runs)
    boxes = [Box(tp.boxes[j].offsets, tp.boxes[j].sizes, *runs[j].local(i)) for i in range(3) for j in range(3)]
    want = BoxShard((7, 10), tuple(boxes))
    assert got == want and hash(got) == hash(want) and got.world_size == 9
    with pytest.raises(ValueError, match="must tile a whole box"):
        BoxShard.runs_in_boxes(tp, [runs[0], runs[1], runs[0]])  # 28 elements for a box of 14
    with pytest.raises(ValueError, match="one run layout per box"):
        BoxShard.runs_in_boxes(tp, runs[:2])


def test_merged_box_pieces_are_the_same_elements_in_order() -> None:
    """Batched box pieces (``Views`` in comm/_box_exchange.py): the merged places read the same elements in the same
    order as the pieces one by one; an owner's W - 1 received pieces of an evenly cut
    dp x tp grid are two views (its own piece stays out of the run), W = 512 included, and
    an uneven cut only a few."""
    from vefsdp_optim.comm._box_exchange import _merged, box_plan

    for rows, dp, tp, want in [(8, 4, 2, 2), (12, 4, 3, 2), (11, 4, 2, 4), (13, 5, 3, 5), (128, 64, 8, 2)]:
        grid = BoxShard.nested_chunks((rows, 6), (dp, tp), [[0], [1]])
        whole = RaggedShard.whole(rows * 6, dp * tp, 0)
        plan = box_plan((grid,), (whole,), 0, dp * tp)  # rank 0 owns the matrix
        assert len(plan.recv_to.views) <= want, (rows, dp, tp, plan.recv_to.views)
        out = torch.arange(rows * 6.0)
        got = torch.cat([v.reshape(-1) for v in plan.recv_to.of([out])])
        # the pieces one by one, as each peer's box in the owner's flat tensor
        ones = [out.view(rows, 6)[b.offsets[0]:b.offsets[0] + b.sizes[0], b.offsets[1]:b.offsets[1] + b.sizes[1]]
                for b in grid.boxes[1:] if b.length]
        assert torch.equal(got, torch.cat([v.reshape(-1) for v in ones]))
    # a run ends where the offsets stop stepping evenly; a backward step starts none
    places = [(0, (2,), (1,), 0), (0, (2,), (1,), 4), (0, (2,), (1,), 6), (0, (2,), (1,), 2)]
    assert _merged(places) == [(0, (2, 2), (4, 1), 0), places[2], places[3]]
