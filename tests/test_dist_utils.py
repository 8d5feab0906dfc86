"""The multi-process helper itself: results, exceptions, timeouts."""

import time

import pytest
import torch
import torch.distributed as dist
from dist_utils import DistributedTestError, run_distributed


def _sum_ranks():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item()


def _raise_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    return dist.get_rank()


def _hang_on_rank_zero():
    if dist.get_rank() == 0:
        t = torch.zeros(1)
        dist.all_reduce(t)  # the other ranks never join this one
    return dist.get_rank()


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_results_per_rank(world_size):
    out = run_distributed(_sum_ranks, world_size)
    total = world_size * (world_size + 1) / 2
    assert out == [(r, world_size, total) for r in range(world_size)]


def test_rank_exception_fails_the_test():
    with pytest.raises(DistributedTestError, match="boom on rank 1"):
        run_distributed(_raise_on_rank_one, 3)
    # a fresh pool serves the next call
    assert run_distributed(_raise_on_rank_one, 1) == [0]


def test_hang_times_out():
    t0 = time.monotonic()
    with pytest.raises(DistributedTestError, match="timed out"):
        run_distributed(_hang_on_rank_zero, 2, timeout=5)
    assert time.monotonic() - t0 < 30
