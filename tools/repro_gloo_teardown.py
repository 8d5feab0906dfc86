"""Minimal reproduction, pure torch (no vefsdp_optim): gloo aborts a process at exit.

"terminate called without an active exception" (SIGABRT) when a gloo worker thread
(ProcessGroupGloo::runLoop) releases a collective (its AsyncWork) just as the Python
interpreter starts to finalize. The work holds tensors whose Python objects Python
dropped and torch preserved; their last release decrefs them
(TensorImpl::decref_pyobject -> ConcretePyInterpreterVTable::decref), which checks
Py_IsInitialized() and then takes the GIL. If finalization starts in between, CPython's
take_gil ends the thread with pthread_exit(); the forced unwind meets the noexcept
~AsyncWork and libstdc++ calls std::terminate(). A race: about 1 run in 5 here.
destroy_process_group() joins the worker threads only when nothing else holds the
group (a DeviceMesh does: FSDP2 keeps one), see tools/STRESS.md.

Usage: python tools/repro_gloo_teardown.py [--world 2] [--reps 10] [--mode MODE]

  --mode pending   (default) every rank launches an async all_reduce, drops the tensor
                   and the handle, and exits: the work is still in the gloo queue or
                   running when the interpreter finalizes -> aborts almost every run.
  --mode waited    same, but work.wait() first (no destroy_process_group): only the
                   worker's release of the finished work can race the exit; rare.
  --mode fixed     work.wait(), barrier, destroy_process_group() with no other
                   reference left to the group -> the worker threads are joined before
                   the interpreter finalizes: never aborts.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

N = 1 << 22  # 16 MiB of float32: long enough on gloo that the work outlives the exit


def _rank(rank: int, world: int, init_file: str, mode: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    t = torch.ones(N)
    work = dist.all_reduce(t, async_op=True)
    if mode in ("waited", "fixed"):
        work.wait()
    del t, work  # Python lets go; gloo's AsyncWork still references the tensor
    if mode == "fixed":
        dist.barrier()
        dist.destroy_process_group()  # joins gloo's worker threads (no other owner of the group)
    # interpreter finalization follows


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--mode", choices=["pending", "waited", "fixed"], default="pending")
    p.add_argument("--rank", type=int, default=None)
    p.add_argument("--init-file", default=None)
    a = p.parse_args()
    if a.rank is not None:
        _rank(a.rank, a.world, a.init_file, a.mode)
        return 0
    aborted = 0
    for i in range(a.reps):
        fd, init_file = tempfile.mkstemp(prefix="repro_pg_")
        os.close(fd)
        os.unlink(init_file)
        procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--world", str(a.world),
                                   "--init-file", init_file, "--mode", a.mode],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  env=dict(os.environ, OMP_NUM_THREADS="1"))
                 for r in range(a.world)]
        outs = [(p.communicate(timeout=120)[0].decode(errors="replace"), p.returncode) for p in procs]
        if os.path.exists(init_file):
            os.unlink(init_file)
        bad = [(r, rc, out) for r, (out, rc) in enumerate(outs) if rc != 0]
        if bad:
            aborted += 1
            for r, rc, out in bad:
                print(f"run {i} rank {r}: returncode {rc}: {out.strip()[-300:]}")
    print(f"mode={a.mode} W={a.world}: {aborted}/{a.reps} runs aborted")
    return 1 if aborted else 0


if __name__ == "__main__":
    sys.exit(main())
