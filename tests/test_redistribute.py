"""redistribute / transfer_sizes / check_same_on_all_ranks (gloo) and assign_owners (pure).

Every rank builds the same full reference tensors from a seeded generator; results are
compared with slices of those tensors, never with numbers the code printed.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from hypothesis import given, settings
from hypothesis import strategies as st

from vefsdp_optim._math import muon_cost
from vefsdp_optim.comm import (
    OwnerAssignment,
    RedistributeHandle,
    Route,
    assign_owners,
    check_same_on_all_ranks,
    redistribute,
    transfer_sizes,
)
from vefsdp_optim.sharding import RaggedShard

# -- helpers shared by the rank functions ---------------------------------------------


def _random_layout(rng: random.Random, numel: int, w: int) -> RaggedShard:
    kind = rng.random()
    if kind < 0.15:
        return RaggedShard.whole(numel, w, rng.randrange(w))
    if kind < 0.3:
        # many empty shards
        cuts = sorted(rng.choice([0, numel, rng.randint(0, numel)]) for _ in range(w - 1))
    else:
        cuts = sorted(rng.randint(0, numel) for _ in range(w - 1))
    return RaggedShard.from_boundaries([0, *cuts, numel])


def _random_dst(rng: random.Random, src: RaggedShard, shape: tuple[int, ...]) -> tuple[RaggedShard, int]:
    """A destination layout and, for snapped ones, the unit (else 0)."""
    w, n = src.world_size, src.numel
    kind = rng.randrange(5)
    if kind == 0 and n:
        unit = rng.choice([1, 2, 3, 7, 16, max(1, n // 2), n])
        return src.snapped(unit), unit
    if kind == 1:
        return RaggedShard.whole(n, w, rng.randrange(w)), 0
    if kind == 2:
        return RaggedShard.shard0(shape, w), 0
    if kind == 3:
        return src, 0
    return _random_layout(rng, n, w), 0


def _owner_array(layout: RaggedShard) -> torch.Tensor:
    """Owner rank of every flat element (independent of the code under test)."""
    own = torch.empty(layout.numel, dtype=torch.long)
    for r, (s, n) in enumerate(layout.extents):
        own[s : s + n] = r
    return own


class _CountA2A:
    """Counts torch.distributed.all_to_all_single calls while active."""

    def __enter__(self):
        self.calls = 0
        self._orig = dist.all_to_all_single

        def wrapped(*a, **k):
            self.calls += 1
            return self._orig(*a, **k)

        dist.all_to_all_single = wrapped
        return self

    def __exit__(self, *exc):
        dist.all_to_all_single = self._orig


def _redistribute_cases(n_cases: int, seed: int) -> dict:
    w, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    stats = {"cases": 0, "collective_cases": 0, "transfers": [], "snapped": 0}
    for case in range(n_cases):
        k = rng.randint(1, 5)
        shapes, fulls, src, dst, units = [], [], [], [], []
        for _ in range(k):
            shape = (rng.randint(0, 13), rng.randint(1, 9)) if rng.random() < 0.8 else (rng.randint(0, 40),)
            full = torch.randn(shape, generator=gen).reshape(-1)
            s = _random_layout(rng, full.numel(), w)
            d, unit = _random_dst(rng, s, shape)
            shapes.append(shape)
            fulls.append(full)
            src.append(s)
            dst.append(d)
            units.append(unit)
        dtype = rng.choice([torch.float32, torch.float64, torch.bfloat16])
        fulls = [f.to(dtype) for f in fulls]
        locals_ = [f[s.local(rank)[0] : sum(s.local(rank))].clone() for f, s in zip(fulls, src, strict=True)]
        use_async = rng.random() < 0.3
        with _CountA2A() as cnt:
            res = redistribute(locals_, src, dst, group, async_op=use_async)
            if use_async:
                assert isinstance(res, RedistributeHandle)
                res = res.wait()
        moves = any(s != d for s, d in zip(src, dst, strict=True)) and w > 1
        assert cnt.calls == (1 if moves else 0), (case, cnt.calls, moves)
        assert len(res) == k
        joined_at: dict[str, int] = {}
        for i, (f, d) in enumerate(zip(fulls, dst, strict=True)):
            a, n = d.local(rank)
            assert res[i].dtype == dtype and res[i].shape == (n,), (case, i, res[i].shape, n)
            assert torch.equal(res[i], f[a : a + n]), (case, i)
            # pieces that stay: an output lying inside this rank's src slice aliases the input
            sa, sn = src[i].local(rank)
            if n > 0 and sa <= a and a + n <= sa + sn:
                assert res[i].untyped_storage().data_ptr() == locals_[i].untyped_storage().data_ptr(), (case, i)
            # an output from a single remote source is a view of the receive buffer (no copy)
            srcs = {r for r, (x, m) in enumerate(src[i].extents) if m and x < a + n and a < x + m}
            if n > 0 and len(srcs) == 1 and srcs != {rank}:
                assert res[i]._is_view(), (case, i)
            elif len(srcs) > 1:  # copied into the one buffer of joined outputs, aligned
                joined = res[i].untyped_storage().data_ptr()
                assert joined not in {t.untyped_storage().data_ptr() for t in locals_}, (case, i)
                assert (res[i].storage_offset() * res[i].element_size()) % 64 == 0, (case, i)
                assert joined_at.setdefault("ptr", joined) == joined, (case, i)  # one buffer for all
        # a Route between the same layouts (built once, launched as often) gives the same
        route = Route(src, dst, group)
        for _ in range(2):
            got = route.launch(locals_, async_op=use_async)
            got = got.wait() if use_async else got
            assert len(got) == k and all(torch.equal(a, b) for a, b in zip(got, res, strict=True)), case
        # round trip is exact
        with _CountA2A() as cnt2:
            back = redistribute(res, dst, src, group)
        assert cnt2.calls == (1 if moves else 0)
        for i in range(k):
            assert torch.equal(back[i], locals_[i]), (case, i)
        # transfer sizes against element owners
        sc, rc = transfer_sizes(src, dst, rank)
        ref_send = [0] * w
        ref_recv = [0] * w
        for s, d in zip(src, dst, strict=True):
            so, do = _owner_array(s), _owner_array(d)
            for p in range(w):
                if p != rank:
                    ref_send[p] += int(((so == rank) & (do == p)).sum())
                    ref_recv[p] += int(((so == p) & (do == rank)).sum())
        assert sc == ref_send and rc == ref_recv, (case, sc, ref_send, rc, ref_recv)
        stats["transfers"].append((sc, rc))
        # snapped (aligned) layouts move at most half a unit per interior boundary
        for s, d, unit in zip(src, dst, units, strict=True):
            if unit:
                moved = int((_owner_array(s) != _owner_array(d)).sum())
                assert moved <= (w - 1) * unit / 2, (moved, unit, s, d)
                assert moved <= sum(abs(x - y) for x, y in zip(s.boundaries, d.boundaries, strict=True))
                stats["snapped"] += 1
        stats["cases"] += 1
        stats["collective_cases"] += int(moves)
    return stats


def _mismatch_checks() -> list[str]:
    rank, w = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    out = []
    check_same_on_all_ranks("plan-abc", group)  # all equal: no error
    try:
        check_same_on_all_ranks("plan-abc" if rank != w - 1 else "plan-xyz", group)
        out.append("no error")
    except ValueError as e:
        out.append(str(e))
    # unequal layouts in one batch still need one collective; empty batch: none
    with _CountA2A() as cnt:
        assert redistribute([], [], [], group) == []
        assert redistribute([], [], [], group, async_op=True).wait() == []
    assert cnt.calls == 0
    # wrong group size
    try:
        redistribute([torch.zeros(0)], [RaggedShard.whole(0, w + 1, 0)], [RaggedShard.whole(0, w + 1, 0)], group)
        out.append("no error")
    except ValueError as e:
        out.append(str(e))
    return out


def _first_differences() -> list:
    from vefsdp_optim.comm._collectives import first_difference

    rank, w, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    base = [11, 22, 33, 44, 2**63 - 5, -7]  # any ints: hashes, negative ones included
    out = []
    keys = list(base)
    if rank == w - 1:
        keys[2] = 99  # the last rank differs at position 2 (and later at 4)
        keys[4] = 0
    out.append(first_difference(keys, [r == rank for r in range(6)], group))
    keys = list(base)
    if rank == 0:
        keys[1] = 0  # rank 0 differs: every other rank differs from it
    out.append(first_difference(keys, [rank % 2 == 0] * 6, group))
    out.append(first_difference(base + ([5] if rank == 1 else []), [False] * 7, group))
    return out


def _two_tensors_to_one_owner() -> list[bool]:
    """Rank 0 gathers two row-sharded tensors whole: every peer sends it a piece of each,
    so each tensor's pieces lie every other piece of its receive buffer (one strided view
    where two or more peers sent equal pieces). Per shape: whether a strided view was
    planned, then each tensor's equality with the whole."""
    from vefsdp_optim.comm._redistribute import _ragged_plan

    rank, w = dist.get_rank(), dist.get_world_size()
    out = []
    for rows in ((6 * w, 5), (4 * w + 1, 3)):
        full = [torch.arange(rows[0] * rows[1], dtype=torch.float32) * k for k in (1.0, -2.0)]
        src = tuple(RaggedShard.shard0(rows, w) for _ in full)
        dst = tuple(RaggedShard.whole(rows[0] * rows[1], w, 0) for _ in full)
        locals_ = [f[slice(*src[0].flat_span(rank))].clone() for f in full]
        got = redistribute(locals_, list(src), list(dst), dist.group.WORLD)
        if rank == 0:
            plan = _ragged_plan(src, dst, 0)
            out.append(any(ps[3] > 1 for ps in plan.joined_pieces))  # the strided path ran
            out.extend(torch.equal(g, f) for g, f in zip(got, full, strict=True))
    return out


def test_strided_runs_cover_their_pieces() -> None:
    """_strided's runs, expanded, are the coalesced pieces and their destinations (random
    pieces of a few buffers, some stepping evenly)."""
    from vefsdp_optim.comm._redistribute import _strided

    rng = random.Random(0)
    for _ in range(300):
        pieces, dst, at = [], [], 0
        for _ in range(rng.randint(1, 12)):
            b, n = rng.choice([-1, 0, 1]), rng.choice([0, 3, 4])
            lo = rng.choice([0, 5, 9, 20]) if not pieces or rng.random() < 0.3 else pieces[-1][1] + rng.choice([7, 8])
            pieces.append((b, lo, lo + n))
            d = at + rng.choice([0, 0, 2])
            dst.append((d, d + n))
            at = d + n
        runs, ranges = _strided(tuple(pieces), tuple(dst))
        back, back_dst = [], []
        for (b, lo, hi, count, stride), (d0, d1) in zip(runs, ranges, strict=True):
            n = hi - lo
            assert d1 - d0 == count * n
            for k in range(count):
                back.append((b, lo + k * stride, lo + k * stride + n))
                back_dst.append((d0 + k * n, d0 + (k + 1) * n))
        assert back == pieces and back_dst == dst, (pieces, runs)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_strided_pieces_equal_the_whole_tensor(world_size: int) -> None:
    res = run_distributed(_two_tensors_to_one_owner, world_size)[0]
    assert res[1:3] == [True, True] and res[4:] == [True, True], res  # bit for bit the whole tensors
    # two or more peers sent equal pieces of the first shape: they were one strided view
    assert res[0] == (world_size >= 3), res


@pytest.mark.parametrize("world_size", [2, 3])
def test_first_difference_names_the_position_and_ranks(world_size: int) -> None:
    """The error path of the step's consistency check: the first position where the ranks'
    keys differ and the ranks that differ from rank 0, the same on every rank, from O(P + W)
    int64 per rank (not every rank's keys), checked against the definition."""
    w = world_size
    for res in run_distributed(_first_differences, world_size):
        assert res[0] == (2, [w - 1], [2] if w > 2 else []), res
        assert res[1] == (1, list(range(1, w)), list(range(0, w, 2))), res
        assert res[2] == (-1, [1], []), res


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_redistribute_random_cases(world_size: int) -> None:
    results = run_distributed(_redistribute_cases, world_size, 150, 1234 + world_size)
    assert all(r["cases"] == 150 for r in results)
    if world_size > 1:
        assert results[0]["collective_cases"] > 10  # the test does exercise the exchange
        # what rank r sends to p is what p receives from r
        for c in range(150):
            for r in range(world_size):
                for p in range(world_size):
                    assert results[r]["transfers"][c][0][p] == results[p]["transfers"][c][1][r]
    assert results[0]["snapped"] > 0


@pytest.mark.parametrize("world_size", [3])
def test_fingerprint_mismatch_and_group_checks(world_size: int) -> None:
    results = run_distributed(_mismatch_checks, world_size)
    for msgs in results:
        assert "ranks [0, 1]" in msgs[0] and "ranks [2]" in msgs[0] and "plan-xyz" in msgs[0]
        assert "group has 3" in msgs[1]


# -- single-process input checks -------------------------------------------------------


def test_single_rank_returns_views_without_collective() -> None:
    x = torch.arange(6.0)
    lay = RaggedShard.whole(6, 1, 0)
    with _CountA2A() as cnt:
        (y,) = redistribute([x], [lay], [lay], None)
    assert cnt.calls == 0
    assert y.data_ptr() == x.data_ptr() and torch.equal(y, x)
    h = redistribute([x], [lay], [lay], None, async_op=True)
    assert h.is_completed() and h.wait()[0].data_ptr() == x.data_ptr()


def test_bad_inputs() -> None:
    lay = RaggedShard.whole(4, 1, 0)
    with pytest.raises(ValueError, match=r"torch.float16.*torch.float32|torch.float32.*torch.float16"):
        redistribute([torch.zeros(4), torch.zeros(4, dtype=torch.float16)], [lay, lay], [lay, lay], None)
    with pytest.raises(ValueError, match="src has 4 elements, dst has 5"):
        redistribute([torch.zeros(4)], [lay], [RaggedShard.whole(5, 1, 0)], None)
    with pytest.raises(ValueError, match="locals\\[0\\] has 3 elements"):
        redistribute([torch.zeros(3)], [lay], [lay], None)
    with pytest.raises(ValueError, match="1-D"):
        redistribute([torch.zeros(2, 2)], [lay], [lay], None)
    with pytest.raises(ValueError, match="need a process group"):
        two = RaggedShard.whole(4, 2, 0)
        redistribute([torch.zeros(4)], [two], [two], None)
    with pytest.raises(ValueError, match="one world size"):
        transfer_sizes([lay], [RaggedShard.whole(4, 2, 0)], 0)
    # a Route checks its layouts once, and what each launch passes as redistribute does
    with pytest.raises(ValueError, match="src has 4 elements, dst has 5"):
        Route([lay], [RaggedShard.whole(5, 1, 0)], None)
    with pytest.raises(ValueError, match="need a process group"):
        Route([RaggedShard.whole(4, 2, 0)], [RaggedShard.whole(4, 2, 0)], None)
    route = Route([lay, lay], [lay, lay], None)
    with pytest.raises(ValueError, match=r"torch.float16.*torch.float32|torch.float32.*torch.float16"):
        route.launch([torch.zeros(4), torch.zeros(4, dtype=torch.float16)])
    with pytest.raises(ValueError, match="locals\\[1\\] has 3 elements"):
        route.launch([torch.zeros(4), torch.zeros(3)])
    with pytest.raises(ValueError, match="1-D"):
        route.launch([torch.zeros(4), torch.zeros(2, 2)])
    with pytest.raises(ValueError, match="got 1 local tensors for 2 layouts"):
        route.launch([torch.zeros(4)])
    x = torch.arange(4.0)
    assert route.launch([x, x])[1].data_ptr() == x.data_ptr()
    with pytest.raises(ValueError, match="same tensors"):
        transfer_sizes([lay], [], 0)
    with pytest.raises(TypeError, match="RaggedShard"):
        transfer_sizes([lay], ["x"], 0)
    with pytest.raises(ValueError, match="rank must be"):
        transfer_sizes([lay], [lay], 1)
    with pytest.raises(TypeError):
        check_same_on_all_ranks(3, None)
    check_same_on_all_ranks("x", None)


def test_transfer_sizes_known_case() -> None:
    # 10 elements, W=3: src [0,4) [4,4) [4,10) -> dst [0,2) [2,8) [8,10)
    src = RaggedShard.from_boundaries([0, 4, 4, 10])
    dst = RaggedShard.from_boundaries([0, 2, 8, 10])
    assert transfer_sizes([src], [dst], 0) == ([0, 2, 0], [0, 0, 0])
    assert transfer_sizes([src], [dst], 1) == ([0, 0, 0], [2, 0, 4])
    assert transfer_sizes([src], [dst], 2) == ([0, 4, 0], [0, 0, 0])


# -- owner assignment (pure) -----------------------------------------------------------


def test_assign_owners_exact_lpt() -> None:
    w = 2
    layouts = [RaggedShard.whole(10, w, 1)] + [RaggedShard.shard0((4, 3), w) for _ in range(4)]
    costs = [5.0, 4.0, 3.0, 3.0, 3.0]
    a = assign_owners(layouts, costs)
    assert isinstance(a, OwnerAssignment)
    # tensor 0 (cost 5): both ranks empty -> rank 1 holds it all. Then 4 -> rank 0 (4 < 5),
    # 3 -> rank 0 (4 < 5) = 7, 3 -> rank 1 (5 < 7) = 8, 3 -> rank 0 (7 < 8) = 10.
    assert a.owners == (1, 0, 0, 1, 0)
    assert a.loads == (10.0, 8.0)
    assert a.max_over_mean == pytest.approx(10 / 9)
    # tensor 0 needs no move; each (4, 3) tensor has 6 of 12 elements on its owner
    assert a.elements_moved == 4 * 6


def test_assign_owners_prefers_holders_and_skips_empty_shards() -> None:
    w = 3
    # 2 rows over 3 ranks: rank 2 holds nothing; equal costs -> never rank 2 first
    layouts = [RaggedShard.shard0((2, 5), w), RaggedShard.whole(7, w, 2), RaggedShard.whole(7, w, 0)]
    a = assign_owners(layouts, [1.0, 1.0, 1.0])
    assert a.owners == (0, 2, 1)
    held = sum(lay.local(o)[1] for lay, o in zip(layouts, a.owners, strict=True))
    assert a.elements_moved == 10 + 7 + 7 - held


def _reference_owners(layouts, costs, tolerance=1e-6):
    """Owner assignment (``assign_owners`` in comm/_owners.py) as plain Python loops over the ranks (the library's
    first implementation): the owners and loads the tensor scans must reproduce."""
    w = layouts[0].world_size
    slack = tolerance * math.fsum(costs) / w
    loads, owners = [0.0] * w, [0] * len(layouts)
    for i in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        low = min(loads)
        held = [layouts[i].local_numel(r) for r in range(w)]
        best = min((r for r in range(w) if loads[r] <= low + slack), key=lambda r: (-held[r], loads[r], r))
        owners[i] = best
        loads[best] += costs[i]
    return tuple(owners), tuple(loads)


def test_assign_owners_equals_the_loop_over_ranks() -> None:
    """Ragged and box layouts, empty shards, equal and zero costs, several tolerances:
    the same owners and loads, bit for bit, as the loop over every rank."""
    from vefsdp_optim.sharding import BoxShard

    rng = random.Random(11)
    for trial in range(300):
        w = rng.choice([1, 2, 3, 5, 8, 13, 40])
        layouts = []
        for _ in range(rng.randint(1, 30)):
            if rng.random() < 0.3:  # a dp x tp grid of boxes (FSDP2 x TP), empty boxes included
                tp = rng.choice([d for d in range(1, w + 1) if w % d == 0])
                shape = (rng.randint(1, 12), rng.randint(1, 9))
                layouts.append(BoxShard.nested_chunks(shape, (w // tp, tp), [[0], [1]]))
            else:
                layouts.append(_random_layout(rng, rng.randint(1, 200), w))
        kind = trial % 3
        costs = [float(rng.choice([1, 2, 3])) if kind == 0 else 0.0 if kind == 1 and rng.random() < 0.5
                 else rng.random() * 1e3 for _ in layouts]
        tol = rng.choice([0.0, 1e-6, 0.1])
        a = assign_owners(layouts, costs, tolerance=tol)
        assert (a.owners, a.loads) == _reference_owners(layouts, costs, tol), trial


def test_assign_owners_balances_random_costs() -> None:
    rng = random.Random(7)
    for _ in range(200):
        w = rng.randint(1, 9)
        n = rng.randint(1, 60)
        shapes = [(rng.randint(1, 300), rng.randint(1, 300)) for _ in range(n)]
        costs = [muon_cost(s) for s in shapes]
        layouts = [RaggedShard.shard0(s, w) for s in shapes]
        a = assign_owners(layouts, costs)
        assert len(a.owners) == n and all(0 <= o < w for o in a.owners)
        loads = [0.0] * w
        for o, c in zip(a.owners, costs, strict=True):
            loads[o] += c
        assert a.loads == pytest.approx(tuple(loads))
        total = sum(costs)
        mean = total / w
        # Graham's bound for greedy list scheduling (tolerance 1e-6 of the mean)
        assert max(loads) <= mean + (1 - 1 / w) * max(costs) + 1e-6 * mean * n + 1e-6
        lower = max(mean, max(costs))  # no assignment beats this
        assert a.max_over_mean * mean >= lower - 1e-6 * lower
        assert a.max_over_mean == pytest.approx(max(loads) / mean)
        held = sum(lay.local(o)[1] for lay, o in zip(layouts, a.owners, strict=True))
        assert a.elements_moved == sum(math.prod(s) for s in shapes) - held
        assert assign_owners(layouts, costs) == a  # deterministic


def test_assign_owners_bad_inputs() -> None:
    lay = RaggedShard.whole(4, 2, 0)
    with pytest.raises(ValueError, match="2 layouts and 1 costs"):
        assign_owners([lay, lay], [1.0])
    with pytest.raises(ValueError, match="one world size"):
        assign_owners([lay, RaggedShard.whole(4, 3, 0)], [1.0, 1.0])
    with pytest.raises(ValueError, match="finite and >= 0"):
        assign_owners([lay], [-1.0])
    with pytest.raises(ValueError, match="finite and >= 0"):
        assign_owners([lay], [float("nan")])
    with pytest.raises(TypeError, match="RaggedShard"):
        assign_owners([(0, 4)], [1.0])


def test_muon_cost() -> None:
    assert muon_cost((4, 6)) == 4 * 6 * 4
    assert muon_cost((8, 2, 3)) == 8 * 6 * 6
    for not_a_matrix in ((5,), ()):
        with pytest.raises(ValueError, match="at least 2 dims"):
            muon_cost(not_a_matrix)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_transfer_sizes_properties(data) -> None:
    w = data.draw(st.integers(1, 6))
    k = data.draw(st.integers(1, 4))
    src, dst = [], []
    for _ in range(k):
        n = data.draw(st.integers(0, 50))
        for out in (src, dst):
            cuts = sorted(data.draw(st.lists(st.integers(0, n), min_size=w - 1, max_size=w - 1)))
            out.append(RaggedShard.from_boundaries([0, *cuts, n]))
    sizes = [transfer_sizes(src, dst, r) for r in range(w)]
    for r in range(w):
        assert sizes[r][0][r] == 0 and sizes[r][1][r] == 0
        for p in range(w):
            assert sizes[r][0][p] == sizes[p][1][r]  # r sends to p what p receives from r
    moved = sum(int((_owner_array(s) != _owner_array(d)).sum()) for s, d in zip(src, dst, strict=True))
    assert sum(sum(s) for s, _ in sizes) == moved
    assert (moved == 0) == all(s == d for s, d in zip(src, dst, strict=True))
