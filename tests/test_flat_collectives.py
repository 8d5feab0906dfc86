"""The flat collectives on gloo ([Note: gloo flat collectives] in comm/_collectives.py):
point-to-point sends whose results are checked against sums written here, on random
floats (where the summation order shows in the bits), at W = 2, 3 and 4."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed

from vefsdp_optim.comm import all_gather_flat, reduce_scatter_flat

M = 1000  # elements per rank: not a multiple of any vector length


def _contributions(w: int) -> list[torch.Tensor]:
    """Every rank's W * M input, known to every rank (random floats, several magnitudes)."""
    g = torch.Generator().manual_seed(5)
    return [torch.randn(w * M, generator=g) * 10.0 ** torch.randint(-3, 4, (w * M,), generator=g)
            for _ in range(w)]


def _rank_order_sum(xs: list[torch.Tensor]) -> torch.Tensor:
    total = xs[0].clone()
    for x in xs[1:]:
        total = total + x
    return total


def _checks() -> None:
    w, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    xs = _contributions(w)
    mine = slice(rank * M, (rank + 1) * M)
    want = _rank_order_sum([x[mine] for x in xs])

    for op, scale in (("sum", 1), ("avg", w)):
        for async_op in (False, True):
            out = torch.full((M,), float("nan"))
            work = reduce_scatter_flat(out, xs[rank].clone(), group, op=op, async_op=async_op)
            if work is not None:
                work.wait()
            expected = want if scale == 1 else want / scale
            assert torch.equal(out, expected), (op, async_op, (out - expected).abs().max())

    # the output a view of the input's own chunk (in place): the same bits
    inp = xs[rank].clone()
    reduce_scatter_flat(inp[mine], inp, group, op="sum")
    assert torch.equal(inp[mine], want)

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
    assert torch.equal(outs[0], want)
    assert torch.equal(outs[1], _rank_order_sum([2 * x[mine] for x in xs]))
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


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_gloo_flat_collectives_bits(world_size: int) -> None:
    run_distributed(_checks, world_size)
