"""A rank must not abort at exit ("terminate called without an active exception").

The cause (tools/STRESS.md, [Note: gloo teardown] in vefsdp_optim/_teardown.py): a gloo worker
thread that releases a finished collective whose tensors' Python objects torch
preserved must take the GIL; if the interpreter starts to finalize in the meantime,
CPython ends that thread with pthread_exit() and the forced unwind calls
std::terminate(). destroy_process_group() does not join gloo's threads while anything
else holds the group (FSDP2's DeviceMesh and DTensor's caches do), so the trigger is
*interpreter finalization with gloo worker threads alive*. The race itself is rare
(a few per hundred runs, tools/stress_abort.py); these tests check the trigger,
deterministically.
"""

import atexit
import os

import pytest
import torch
import torch.distributed as dist
from dist_utils import _Pool

_KEEP = []


def _record_threads_at_exit(path: str) -> None:
    # an atexit handler runs at the start of interpreter finalization
    with open(path, "w") as f:
        f.write(str(len(os.listdir("/proc/self/task"))))


def _fsdp2_step_then_watch_exit(out_dir: str):
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    t = torch.ones(1 << 20)
    for _ in range(8):  # queued collectives whose handles and tensor Python drops
        dist.all_reduce(t, async_op=True)
    del t
    _KEEP.append(model)  # as a user's script keeps its model until the interpreter ends
    atexit.register(_record_threads_at_exit, os.path.join(out_dir, f"{dist.get_rank()}.txt"))
    return dist.get_rank()


@pytest.mark.parametrize("world_size", [2, 3])
def test_no_interpreter_finalization_with_gloo_threads_alive(tmp_path, world_size):
    pool = _Pool(world_size)
    try:
        assert pool.run(_fsdp2_step_then_watch_exit, (str(tmp_path),), {}, timeout=60) == list(
            range(world_size))
    finally:
        pool.close()
    codes = [p.exitcode for p in pool.procs]
    assert codes == [0] * world_size, f"rank exit codes {codes} (negative: killed by that signal)"
    for r in range(world_size):
        path = tmp_path / f"{r}.txt"
        if path.exists():  # the rank finalized its interpreter: only its main thread may be left
            threads = int(path.read_text())
            assert threads == 1, (
                f"rank {r} finalized its interpreter with {threads} OS threads alive "
                "(gloo's worker threads): the exit race of [Note: gloo teardown]")
