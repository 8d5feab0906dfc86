"""The multi-process helper itself: results, exceptions, timeouts."""

import os
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
        run_distributed(_hang_on_rank_zero, 2, timeout=2)
    assert time.monotonic() - t0 < 30


# -- what a job leaves behind: groups and threads ([The suite's own cost] in conftest.py) ---

_KEPT: list = []


def _make_groups_and_meshes():
    from torch.distributed.device_mesh import init_device_mesh

    w = dist.get_world_size()
    g = dist.new_group(list(range(w)))
    t = torch.ones(3)
    dist.all_reduce(t, group=g)
    mesh = init_device_mesh("cpu", (1, w), mesh_dim_names=("a", "b"))
    dist.all_reduce(t, group=mesh.get_group("b"))
    return len(dist.distributed_c10d._world.pg_map)


def _groups_and_gloo_threads():
    from dist_utils import _GLOO_THREADS, _thread_counts

    counts = _thread_counts()
    return len(dist.distributed_c10d._world.pg_map), {k: counts.get(k, 0) for k in _GLOO_THREADS}


def _keep_a_group():
    g = dist.new_group(list(range(dist.get_world_size())))
    dist.barrier(group=g)
    _KEPT.append(g)  # as a module-level cache would
    return 0


def _start_threads(n: int):
    import threading

    stop = threading.Event()
    threads = [threading.Thread(target=stop.wait, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    _KEPT.append((stop, threads))
    return 0


def _stop_threads():
    while _KEPT:
        stop, threads = _KEPT.pop()
        stop.set()
        for t in threads:
            t.join()
    return 0


@pytest.mark.parametrize("world_size", [2, 3])
def test_groups_a_job_made_are_destroyed(world_size):
    before = run_distributed(_groups_and_gloo_threads, world_size)
    made = run_distributed(_make_groups_and_meshes, world_size)
    assert all(n >= 3 for n in made), made  # the default group, the new group, the mesh's
    after = run_distributed(_groups_and_gloo_threads, world_size)
    assert after == before, (before, after)
    assert all(n == 1 for n, _ in after), after  # only the default group is left


def test_a_kept_group_fails_with_the_test_name():
    with pytest.raises(DistributedTestError, match=r"LeakedGroupError: .*"
                       r"test_a_kept_group_fails_with_the_test_name: 1 of the 1 process groups"):
        run_distributed(_keep_a_group, 2)


def test_threads_that_grow_fail_with_the_test_name():
    from dist_utils import THREAD_SLACK

    with pytest.raises(DistributedTestError, match=r"LeakedGroupError: .*"
                       r"test_threads_that_grow_fail_with_the_test_name: \d+ threads after the job"):
        run_distributed(_start_threads, 2, THREAD_SLACK + 1)
    assert run_distributed(_start_threads, 2, 1) == [0, 0]  # a few are allowed, in a fresh pool
    assert run_distributed(_stop_threads, 2) == [0, 0]


def _keep_a_group_in_torch():
    g = dist.new_group(list(range(dist.get_world_size())))
    dist.barrier(group=g)
    torch.distributed._kept_by_a_test = [g]  # as a cache of torch's own would
    return os.getpid()


def _pid():
    return os.getpid()


def test_a_group_only_torch_keeps_ends_the_workers():
    """A group that only torch's own objects still hold after destroy_process_group (a
    cache some releases keep) is no test's leak: the workers end after the job, and the
    next job runs on fresh ones."""
    import dist_utils

    before = sum(dist_utils.stats.recycled.values())
    pids = run_distributed(_keep_a_group_in_torch, 2)
    assert sum(dist_utils.stats.recycled.values()) == before + 1
    assert set(run_distributed(_pid, 2)).isdisjoint(pids)
