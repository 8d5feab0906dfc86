"""The flat collectives on gloo ([Note: gloo flat collectives] in comm/_collectives.py):
point-to-point sends (all-gathers at W >= 3 and large shards at W = 2, reduce-scatters of
large shards at W = 2) and gloo's own collectives elsewhere, checked against sums written
here on random floats (where the summation order shows in the bits), at W = 2, 3 and 4."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from torch.utils._python_dispatch import TorchDispatchMode

from vefsdp_optim.comm import all_gather_flat, reduce_scatter_flat
from vefsdp_optim.comm._collectives import P2P_MIN_SHARD_BYTES_W2

SMALL = 1000  # elements per rank: not a multiple of any vector length
LARGE = P2P_MIN_SHARD_BYTES_W2 // 4 + 7  # float32 shards above the W = 2 threshold


def _contributions(w: int, M: int) -> list[torch.Tensor]:  # noqa: N803
    """Every rank's W * M input, known to every rank (random floats, several magnitudes)."""
    g = torch.Generator().manual_seed(5)
    return [torch.randn(w * M, generator=g) * 10.0 ** torch.randint(-3, 4, (w * M,), generator=g)
            for _ in range(w)]


class _C10dOps(TorchDispatchMode):
    """The c10d ops called (point-to-point: send / recv_; gloo's own: the collective)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        if func.namespace == "c10d":
            self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _rank_order_sum(xs: list[torch.Tensor]) -> torch.Tensor:
    total = xs[0].clone()
    for x in xs[1:]:
        total = total + x
    return total


def _checks(M: int) -> None:  # noqa: N803
    w, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    xs = _contributions(w, M)
    mine = slice(rank * M, (rank + 1) * M)
    want = _rank_order_sum([x[mine] for x in xs])

    big = M * 4 >= P2P_MIN_SHARD_BYTES_W2
    p2p = w == 2 and big  # a reduce-scatter: point to point at W = 2 only
    for op, scale in (("sum", 1), ("avg", w)):
        for async_op in (False, True):
            out = torch.full((M,), float("nan"))
            with _C10dOps() as ops:
                work = reduce_scatter_flat(out, xs[rank].clone(), group, op=op, async_op=async_op)
                if work is not None:
                    work.wait()
            assert ("send" in ops.names) == p2p and ("recv_" in ops.names) == p2p, ops.names
            expected = want if scale == 1 else want / scale
            if w == 2:  # two terms: any order gives the rank-order bits
                assert torch.equal(out, expected), (op, async_op, (out - expected).abs().max())
            else:  # gloo's collective sums in its own order: within a few roundings of the terms
                bound = 4 * torch.finfo(torch.float32).eps * sum(x[mine].abs() for x in xs) / scale
                assert bool(((out - expected).abs() <= bound).all()), (op, async_op)

    # the output a view of the input's own chunk (in place: gloo's collective)
    inp = xs[rank].clone()
    out = torch.empty(M)
    reduce_scatter_flat(out, inp.clone(), group, op="sum")
    reduce_scatter_flat(inp[mine], inp, group, op="sum")
    assert torch.equal(inp[mine], out)

    with _C10dOps() as ops:
        all_gather_flat(torch.empty(w * M), torch.zeros(M), group)
    assert ("send" in ops.names) == (w > 2 or big), ops.names

    # several in flight at once, launched in the same order on every rank (two stores'
    # reduce-scatters overlapping the next group's all-gather): each pairs with its own
    ins = [xs[rank].clone(), (2 * xs[rank]).clone()]
    outs = [torch.empty(M), torch.empty(M)]
    full = torch.full((w * M,), float("nan"))
    full[mine] = xs[rank][:M]
    works = [reduce_scatter_flat(outs[0], ins[0], group, op="sum", async_op=True),
             all_gather_flat(full, full[mine], group, async_op=True),
             reduce_scatter_flat(outs[1], ins[1], group, op="sum", async_op=True)]
    for work in reversed(works):
        work.wait()
    if w == 2:
        assert torch.equal(outs[0], want)
        assert torch.equal(outs[1], _rank_order_sum([2 * x[mine] for x in xs]))
    else:
        assert torch.allclose(outs[0], want, rtol=1e-5, atol=1e-2)
    assert torch.equal(full, torch.cat([x[:M] for x in xs]))

    # all-gather from a separate input: copied into its place, the rest received
    full = torch.full((w * M,), float("nan"))
    all_gather_flat(full, xs[rank][:M].clone(), group)
    assert torch.equal(full, torch.cat([x[:M] for x in xs]))

    # integers: the sum is exact whatever the order; avg is refused before any send
    ints = [torch.arange(w * M, dtype=torch.int64) * (r + 1) for r in range(w)]
    out = torch.empty(M, dtype=torch.int64)
    reduce_scatter_flat(out, ints[rank], group, op="sum")
    assert torch.equal(out, sum(i[mine] for i in ints))
    with pytest.raises(NotImplementedError, match="floating"):
        reduce_scatter_flat(out, ints[rank], group, op="avg")


@pytest.mark.parametrize("world_size,m", [(2, SMALL), (2, LARGE), (3, SMALL), (4, SMALL)])
def test_gloo_flat_collectives_bits(world_size: int, m: int) -> None:
    """Both paths, the point-to-point one and gloo's own, give the reference bits."""
    run_distributed(_checks, world_size, m)
