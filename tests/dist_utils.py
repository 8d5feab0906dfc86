"""Run a function on W gloo ranks on the CPU, for tests.

``run_distributed(fn, world_size, *args)`` calls ``fn(*args)`` on every rank of a gloo
process group of ``world_size`` ranks and returns the list of per-rank results. A
rank's exception becomes a test failure carrying that rank's traceback; a rank that
does not finish within ``timeout`` seconds fails the test instead of hanging it.

Workers are kept alive between calls (one pool per world size), since spawning a
process and importing torch costs seconds; a pool that failed or timed out is torn
down and the next call starts a fresh one. ``fn`` and its arguments must pickle
(module-level functions). Inside ``fn``, ``torch.distributed`` is initialized with the
default group covering all W ranks.
"""

from __future__ import annotations

import atexit
import os
import sys
import tempfile
import traceback
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch.multiprocessing as mp

DEFAULT_TIMEOUT = float(os.environ.get("VEFSDP_TEST_TIMEOUT", "120"))


class DistributedTestError(AssertionError):
    """A rank raised, or the ranks did not finish in time."""


def _worker(rank: int, world_size: int, init_file: str, inbox, outbox) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    while True:
        job = inbox.get()
        if job is None:
            break
        fn, args, kwargs = job
        try:
            torch.manual_seed(0)
            result = fn(*args, **kwargs)
            ForkingPickler.dumps(result)  # fail here, with a message, rather than in the queue's thread
            outbox.put((rank, True, result))
        except BaseException as e:  # noqa: BLE001 - report every failure to the parent
            outbox.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    _teardown_and_exit(outbox)


def _teardown_and_exit(outbox) -> None:
    """End a worker without finalizing the interpreter while gloo's threads live
    ([Note: gloo teardown] in vefsdp_optim/_teardown.py): ``exit_rank``'s barrier,
    destroy and ``os._exit(0)``, with the result queue flushed to the parent first
    (the parent only reads the queue and the exit code).
    """
    import torch.distributed as dist

    try:
        if dist.is_initialized():
            dist.barrier()  # gloo's barrier also waits for this rank's earlier works
            dist.destroy_process_group()
    finally:
        outbox.close()
        outbox.join_thread()  # the queue's feeder thread has written every result
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


class _Pool:
    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        fd, self.init_file = tempfile.mkstemp(prefix="vefsdp_pg_")
        os.close(fd)
        os.unlink(self.init_file)
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(world_size)]
        self.procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, self.init_file, self.inboxes[r], self.outbox),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn: Callable[..., Any], args: tuple, kwargs: dict, timeout: float) -> list[Any]:
        import queue
        import time

        for q in self.inboxes:
            q.put((fn, args, kwargs))
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(results) + len(errors) < self.world_size:
            left = deadline - time.monotonic()
            dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
            if left <= 0 or (dead and not errors):
                if dead and left > 0:
                    # a rank died without reporting (crash); give the rest a moment
                    try:
                        rank, ok, payload = self.outbox.get(timeout=1.0)
                        (results if ok else errors)[rank] = payload
                        continue
                    except queue.Empty:
                        pass
                missing = sorted(set(range(self.world_size)) - set(results) - set(errors))
                detail = "".join(f"\n--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
                why = f"ranks {dead} died" if dead and left > 0 else f"timed out after {timeout:.0f}s"
                raise DistributedTestError(
                    f"{fn.__name__} on {self.world_size} ranks: {why}; no result from ranks {missing}{detail}"
                )
            if errors and left > 0:
                # one rank failed: the others may be stuck in a collective; wait briefly
                left = min(left, 5.0)
                deadline = min(deadline, time.monotonic() + 5.0)
            try:
                rank, ok, payload = self.outbox.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            (results if ok else errors)[rank] = payload
        if errors:
            detail = "".join(f"\n--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
            raise DistributedTestError(f"{fn.__name__} failed on ranks {sorted(errors)}:{detail}")
        return [results[r] for r in range(self.world_size)]

    def close(self, force: bool = False) -> None:
        if not force:
            for q in self.inboxes:
                try:
                    q.put(None)
                except Exception:  # noqa: BLE001
                    pass
            for p in self.procs:
                p.join(timeout=5)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        if os.path.exists(self.init_file):
            os.unlink(self.init_file)


_pools: dict[int, _Pool] = {}


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; per-rank results."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    pool = _pools.get(world_size)
    if pool is None or not all(p.is_alive() for p in pool.procs):
        if pool is not None:
            pool.close(force=True)
        pool = _pools[world_size] = _Pool(world_size)
    try:
        return pool.run(fn, args, kwargs, timeout)
    except BaseException:
        # a failed job may leave ranks mid-collective: never reuse that pool
        _pools.pop(world_size, None)
        pool.close(force=True)
        raise


def shutdown_pools() -> None:
    for w in list(_pools):
        _pools.pop(w).close()


atexit.register(shutdown_pools)


def load_example(filename: str) -> Any:
    """The module ``examples/<filename>``, imported once by path (examples are scripts,
    not a package); spawned ranks import it again by the same name."""
    import importlib.util

    name = "vefsdp_example_" + filename.removesuffix(".py")
    if name not in sys.modules:
        path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", filename)
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def average_like_ranks(g: Any, world_size: int) -> Any:
    """What ``world_size`` ranks' average of the same gradient ``g`` gives: the sum of W
    copies over W (the one-device reference of a sharded run is fed this)."""
    s = g
    for _ in range(world_size - 1):
        s = s + g
    return s / world_size if world_size > 1 else g
