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

After each job a worker destroys every process group the job created (meshes,
``new_group``s; the default group stays) and checks that each one was freed and that its
threads are back at what the default group needs; a job that leaves one behind fails,
named by its test (``LeakedGroupError``). As torch's ``MultiProcContinuousTest`` does, a
worker serves many tests, so a group one test leaks would cost every later test.
"""

from __future__ import annotations

import atexit
import os
import sys
import tempfile
import time
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
    dist.barrier()  # the default group's gloo threads exist from here on
    baseline = _thread_counts()
    # torch's ~300,000 objects outlive every job: a collection after a job (and every
    # automatic one during it) scans only what the jobs made ([Note: job cleanup cost])
    import gc

    gc.freeze()
    while True:
        job = inbox.get()
        if job is None:
            break
        fn, args, kwargs, test = job
        del job
        try:
            torch.manual_seed(0)
            result = fn(*args, **kwargs)
            ForkingPickler.dumps(result)  # fail here, with a message, rather than in the queue's thread
            del args, kwargs
            threads, recycle = _release_job_groups(fn.__name__, test, baseline)
            outbox.put((rank, True, (result, threads, recycle)))
        except BaseException as e:  # noqa: BLE001 - report every failure to the parent
            outbox.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    _teardown_and_exit(outbox)


class LeakedGroupError(AssertionError):
    """A job left a process group, or gloo threads, behind in its worker."""


# Threads a gloo process group starts: the transport's event loop and the group's
# collective runners (2 per group by default).
_GLOO_THREADS = ("gloo_tcp_loop", "pt_gloo_runloop")
# Threads a job may leave beyond the worker's own (a multiprocessing queue's feeder, a
# thread pool torch starts once); more than this is a thread that grows per job.
THREAD_SLACK = int(os.environ.get("VEFSDP_TEST_THREAD_SLACK", "16"))
# Seconds a job's freed groups get for their gloo loop threads to end (they end when the
# last pair holding the device closes, which may trail destroy_process_group briefly).
GLOO_THREAD_GRACE = float(os.environ.get("VEFSDP_TEST_GLOO_GRACE", "10"))
# Threads torch starts once per process and keeps, which the slack does not count: the
# autograd engine's device threads (``pt_autograd_<device>``, one per device index of a
# CUDA build's device types, started by the first backward that needs them: 8 seen)
_ONCE_PER_PROCESS = ("pt_autograd_",)


def _thread_counts() -> dict[str, int]:
    """This process's OS threads by name (``/proc/self/task/*/comm``), with the total."""
    counts: dict[str, int] = {"total": 0}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread ended while we listed
            continue
        counts["total"] += 1
        counts[name] = counts.get(name, 0) + 1
    return counts


def _clear_torch_group_caches() -> None:
    """Drop what torch caches across jobs that holds a DeviceMesh (and so its process
    groups): every ``functools`` cache of ``torch.distributed``'s modules and of their
    classes (DTensor's transform infos and mesh topologies are keyed by specs or meshes),
    DTensor's sharding-propagation caches (the C++ fast path's too), its redistribute
    planners and DeviceMesh's context stack. Found by walking the loaded modules, since
    the names move between torch releases."""
    import types

    for name, module in list(sys.modules.items()):
        if not name.startswith("torch.distributed") or not isinstance(module, types.ModuleType):
            continue
        for value in list(vars(module).values()):
            if isinstance(value, type) and value.__module__ == name:
                for attr in list(vars(value)):
                    inner = getattr(value, attr, None)
                    if hasattr(inner, "cache_clear"):
                        inner.cache_clear()
            elif hasattr(value, "cache_clear") and callable(value.cache_clear):
                value.cache_clear()
    if "torch.distributed.tensor" in sys.modules:  # DTensor was used: its C++ cache too
        from torch.distributed.tensor import debug

        if hasattr(debug, "_clear_sharding_prop_cache"):
            debug._clear_sharding_prop_cache()
    redistribute = sys.modules.get("torch.distributed.tensor._redistribute")
    if redistribute is not None and hasattr(redistribute, "clear_redistribute_planner_cache"):
        redistribute.clear_redistribute_planner_cache()
    device_mesh = sys.modules.get("torch.distributed.device_mesh")
    resources = getattr(device_mesh, "_mesh_resources", None)
    for name in ("mesh_stack", "child_to_root_mapping", "root_to_flatten_mapping",
                 "flatten_name_to_root_dims"):
        cache = getattr(resources, name, None)
        if hasattr(cache, "clear"):
            cache.clear()


def _holders(obj: object, depth: int = 6, width: int = 3) -> str:
    """Where ``obj`` is referenced from, as referrer chains up to ``depth`` links (the
    first ``width`` at each link), for a leak report: the types and, for dicts, keys."""
    import gc
    import types

    seen = {id(obj)}
    frames = (types.FrameType,)
    lines: list[str] = []

    def walk(o: object, path: list[str], d: int) -> None:
        refs = [r for r in gc.get_referrers(o)
                if id(r) not in seen and not isinstance(r, frames) and r is not lines]
        seen.add(id(refs))
        if not refs or d == 0:
            lines.append(" <- ".join(path) + (" <- (nothing gc tracks)" if not refs else ""))
            return
        first = refs[:width]
        seen.add(id(first))
        for r in first:
            seen.add(id(r))
            if isinstance(r, dict):
                label = "dict[" + ", ".join(str(k)[:30] for k in list(r)[:4]) + "]"
            elif isinstance(r, types.ModuleType):
                label = f"module {r.__name__}"
            else:
                label = type(r).__qualname__
            walk(r, path + [label], d - 1)

    walk(obj, [type(obj).__qualname__], depth)
    return "; ".join(lines[:4])


def _holder_outside_torch(obj: object, limit: int = 2000) -> str | None:
    """The first object outside torch that (transitively, through gc-tracked referrers)
    holds ``obj``: a module other than torch's, or an instance, function or class defined
    outside torch; None when only torch's objects (or C++) hold it. Modules end the walk
    (sys.modules holds every one)."""
    import gc
    import types

    seen, frontier, visited = {id(obj)}, [obj], 0
    ours = (types.FrameType, types.GeneratorType)
    while frontier and visited < limit:
        nxt = []
        for o in frontier:
            refs = gc.get_referrers(o)
            seen.add(id(refs))
            for r in refs:
                if id(r) in seen or isinstance(r, ours) or r is frontier or r is nxt:
                    continue
                seen.add(id(r))
                visited += 1
                if isinstance(r, types.ModuleType):  # a root (sys.modules holds it): stop here
                    if not r.__name__.startswith("torch"):
                        return f"module {r.__name__}"
                    continue
                if isinstance(r, dict) and isinstance(r.get("__name__"), str) and getattr(
                        sys.modules.get(r["__name__"]), "__dict__", None) is r:  # a module's globals
                    if not r["__name__"].startswith("torch"):
                        return f"module {r['__name__']}"
                    continue
                if isinstance(r, (types.FunctionType, type)):
                    name = r.__module__ or ""
                elif isinstance(r, (dict, list, tuple, set, frozenset, types.CellType, types.MethodType)):
                    nxt.append(r)
                    continue
                else:
                    name = type(r).__module__ or ""
                if name == "builtins":  # a container of the interpreter's own: look further up
                    nxt.append(r)
                    continue
                if not name.startswith("torch"):
                    return f"{name}.{getattr(r, '__qualname__', type(r).__qualname__)}"
                nxt.append(r)
        frontier = nxt
    return None


def _release_job_groups(fn_name: str, test: str | None,
                        baseline: dict[str, int]) -> tuple[dict[str, int], str | None]:
    """Destroy every process group a job created (the default group stays), check that
    each one is freed (its gloo threads joined) and that the worker's threads are back at
    what the default group needs; the thread counts afterwards and, where only torch
    itself still holds a group (a cache of the release), why the worker must end.

    [Note: job cleanup cost] A full collection in a worker that has imported torch scans
    ~300,000 objects (0.2-0.4 s), and the suite runs about a thousand jobs: the worker
    freezes what it holds after start-up and after each job's collection (``gc.freeze``),
    so that the collection here scans only what the last job left.

    Each group is first waited on by a barrier of its own (gloo's barrier waits for the
    rank's earlier work on that group), in creation order, which every member of a group
    shares, so no two ranks wait on each other's groups in opposite orders.
    """
    import gc
    import weakref

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    where = test or fn_name
    world = c10d.GroupMember.WORLD
    groups = [pg for pg in list(c10d._world.pg_map) if pg is not world]
    named = []
    if groups:
        for group in groups:
            dist.barrier(group=group)
        named = [(weakref.ref(g), c10d._world.pg_names.get(g, "?"), dist.get_process_group_ranks(g))
                 for g in groups]
        for group in groups:
            dist.destroy_process_group(group)
        groups.clear()
        group = None
        _clear_torch_group_caches()
    gc.collect()  # the job's cycles (meshes, modules, hooks): cheap after gc.freeze()
    if named:
        alive = [(name, ranks) for ref, name, ranks in named if ref() is not None]
        if alive:
            first = next(ref for ref, _, _ in named if ref() is not None)()
            gc.unfreeze()  # gc.get_referrers sees no frozen object: the holder may be one
            outside = _holder_outside_torch(first)
            if outside is not None:
                raise LeakedGroupError(
                    f"{where}: {len(alive)} of the {len(named)} process groups it created are still "
                    f"referenced after destroy_process_group (their gloo threads live on), by "
                    f"{outside}: " + ", ".join(f"{n} (ranks {r})" for n, r in alive[:8])
                    + f". Held through: {_holders(first)}")
            # only torch's own objects (caches this release keeps, or C++) hold them: this
            # worker ends after the job and the next one starts fresh
            # ([Note: job cleanup cost], docs/compatibility.md)
            del first
            gc.freeze()
            return _thread_counts(), f"torch kept {len(alive)} of the job's {len(named)} groups"
    gloo_base = {k: baseline.get(k, 0) for k in _GLOO_THREADS}
    # A freed group's gloo device may outlive it for a moment (a peer's pair still closing
    # holds it): its loop thread is joined when the last holder lets go, so wait a bounded
    # time for the count to come back before calling it a leak.
    deadline = time.monotonic() + GLOO_THREAD_GRACE
    while True:
        counts = _thread_counts()
        gloo = {k: counts.get(k, 0) for k in _GLOO_THREADS}
        if all(gloo[k] <= gloo_base[k] for k in _GLOO_THREADS) or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    if any(gloo[k] > gloo_base[k] for k in _GLOO_THREADS):
        # every group the job registered is freed (its weakref is dead), yet a gloo thread
        # stays: a backend that only C++ still holds (seen twice in ~2,500 jobs on torch
        # 2.15: one transport loop, or one runloop at W = 1, past the grace). pybind objects
        # are not tracked by gc, so no Python holder can be looked for: the worker ends after
        # the job, as where torch keeps a registered group, and the summary names the test
        gc.freeze()
        return counts, f"gloo threads {gloo} stayed above the default group's {gloo_base} after {where}"
    once = sum(v for k, v in counts.items() if k.startswith(_ONCE_PER_PROCESS))
    if counts["total"] - once > baseline["total"] + THREAD_SLACK:
        extra = {k: v - baseline.get(k, 0) for k, v in counts.items()
                 if k != "total" and v > baseline.get(k, 0)}
        raise LeakedGroupError(
            f"{where}: {counts['total']} threads after the job, {baseline['total']} at the "
            f"worker's start (VEFSDP_TEST_THREAD_SLACK={THREAD_SLACK} allowed); new: {extra}")
    gc.freeze()  # what outlived the job (modules it imported, caches) is not scanned again
    return counts, None


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


# [Note: worker preload] What the fork server imports before it forks any worker. A
# worker's first job used to spend ~5 s of its ~5.4 s importing (torch._dynamo ~2.2 s,
# which FSDP2 and DTensor pull in; FSDP2; DTensor's op strategies; sympy; our optimizers),
# and every pool that ends after a job (where torch keeps a job's groups, 53 times in the
# quick tier on torch 2.11) paid it again. Imports only: the server still makes no
# process group and runs no op, and these imports start no thread beyond the one that
# importing torch starts (checked on 2.11), so each forked worker stays as isolated
# as a spawned one. A module that fails to import here is imported by the job instead
# (multiprocessing ignores preload errors), so the list changes no result.
_PRELOAD = (
    "torch", "torch.distributed", "torch._dynamo", "torch.distributed.device_mesh",
    "torch.distributed.tensor", "torch.distributed.tensor.parallel", "torch.distributed.fsdp",
    "torch.distributed.checkpoint", "torch.testing._internal.distributed.fake_pg",
    "vefsdp_optim", "vefsdp_optim._adamw", "vefsdp_optim._fsdp", "vefsdp_optim._checkpoint",
    "hypothesis", "pytest",
)


def _context():
    """Where workers start from: a fork server that has imported torch and the modules
    jobs use once ([Note: worker preload]; a spawned worker would import them again, 2-5 s
    of CPU each, and the suite starts dozens), with ``spawn``'s isolation otherwise: the
    server is a fresh interpreter that has made no process group and run no op, and each
    worker is forked from it, never from pytest. ``VEFSDP_TEST_START=spawn`` starts every
    worker from scratch instead."""
    method = os.environ.get("VEFSDP_TEST_START", "forkserver")
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"VEFSDP_TEST_START={method!r}; accepted: 'forkserver', 'spawn'")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(list(_PRELOAD))
    return ctx


class _Pool:
    def __init__(self, world_size: int) -> None:
        ctx = _context()
        self.world_size = world_size
        self.recycle: str | None = None  # why this pool must end after its job, if it must
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

        test = os.environ.get("PYTEST_CURRENT_TEST", "").removesuffix(" (call)") or None
        for q in self.inboxes:
            q.put((fn, args, kwargs, test))
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
        for _, threads, recycle in results.values():
            stats.record(self.world_size, threads)
            self.recycle = self.recycle or recycle
        return [results[r][0] for r in range(self.world_size)]

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


class _Stats:
    """What the workers reported after their jobs: the job count and, per world size, the
    most OS threads (and gloo threads) one worker held after a job (the suite's summary
    prints them, so a change that leaks again shows in the log)."""

    def __init__(self) -> None:
        self.jobs = 0
        self.peak: dict[int, dict[str, int]] = {}
        self.recycled: dict[str, int] = {}  # why -> how many pools ended after a job

    def record(self, world_size: int, threads: dict[str, int]) -> None:
        self.jobs += 1
        peak = self.peak.setdefault(world_size, {})
        for k, v in threads.items():
            peak[k] = max(peak.get(k, 0), v)

    def summary(self) -> str:
        if not self.jobs:
            return "distributed jobs: none"
        rows = "; ".join(
            f"W={w}: {p.get('total', 0)} threads, "
            + ", ".join(f"{k} {p.get(k, 0)}" for k in _GLOO_THREADS)
            for w, p in sorted(self.peak.items()))
        ended = sum(self.recycled.values())
        return (f"distributed jobs: {self.jobs}; most threads in one worker after a job: {rows}; "
                f"pools ended because torch kept a job's groups: {ended}")


stats = _Stats()
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
        out = pool.run(fn, args, kwargs, timeout)
        if pool.recycle is not None:  # torch kept the job's groups: end these workers
            stats.recycled[pool.recycle] = stats.recycled.get(pool.recycle, 0) + 1
            _pools.pop(world_size, None)
            pool.close()
        return out
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
