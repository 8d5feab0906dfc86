"""Stress loop for an intermittent SIGABRT / heap corruption in gloo processes.

Not part of the test run. Each *run* spawns W fresh rank processes (this file, in
``--rank`` mode) under ``MALLOC_CHECK_=3`` and Python's fault handler; every rank
builds fresh small 3-layer models, shards them (each layer, then the root) with FSDP2
and/or our ``fully_shard``, and trains a few steps with our optimizers and torch's,
interleaved, over several configurations; then tears down as asked. A run *aborts*
when any rank exits by a signal or with a non-zero status; the script prints aborts
per runs, and for each abort the signal and the tail of that rank's stderr.

Bisect with the options:

    --mode import        only import torch (and the library unless --no-lib), init, teardown
    --mode init          init the process group, one collective, teardown
    --opt ours|torch|both          optimizer kinds
    --shard fsdp2|ours|both        shardings
    --no-lib                       never import vefsdp_optim (pure torch; needs --opt torch --shard fsdp2)
    --teardown destroy|none        destroy_process_group before exit or not
    --barrier / --no-barrier       a final barrier before teardown
    --gdb                          run ranks under gdb -batch, print the backtrace of the abort

Example: ``python tools/stress_abort.py --reps 30 --world 2 3``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.abspath(__file__)


# ----------------------------------------------------------------------------- rank side

def _rank_main(a: argparse.Namespace) -> None:
    import faulthandler

    faulthandler.enable(all_threads=True)
    if a.core_dir:  # keep a core file of an abort, for gdb
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        os.chdir(a.core_dir)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    _threads(a, "before init")
    if a.lib:
        import vefsdp_optim  # noqa: F401

    dist.init_process_group(
        "gloo", init_method=f"file://{a.init_file}", rank=a.rank, world_size=a.world_size
    )
    if a.mode == "import":
        pass
    elif a.mode == "init":
        t = torch.ones(4)
        dist.all_reduce(t)
    else:
        _train_loop(a)
    _threads(a, "after work")
    if a.barrier:
        dist.barrier()
    if a.teardown == "destroy":
        dist.destroy_process_group()
        _threads(a, "after destroy_process_group")
        import gc

        gc.collect()
        _threads(a, "after gc.collect")
    print(f"rank {a.rank} done", flush=True)
    if a.exit == "os_exit":
        os._exit(0)


def _threads(a: argparse.Namespace, when: str) -> None:
    """Print this process's OS thread count (gloo's worker threads are not Python threads)."""
    if a.verbose:
        print(f"rank {a.rank}: {len(os.listdir('/proc/self/task'))} threads {when}", flush=True)


def _configs(kind: str):
    # a small grid: (name, kwargs)
    if kind == "adamw":
        return [
            {"lr": 1e-2},
            {"lr": 1e-2, "weight_decay": 0.1},
            {"lr": 1e-2, "amsgrad": True},
            {"lr": 1e-2, "foreach": True},
            {"lr": 1e-2, "foreach": False},
            {"lr": 1e-2, "fused": True},
            {"lr": 1e-2, "maximize": True, "weight_decay": 0.01},
            {"lr": 1e-3, "betas": (0.8, 0.9), "eps": 1e-6},
        ]
    return [
        {"lr": 1e-2},
        {"lr": 1e-2, "weight_decay": 0.1},
        {"lr": 1e-2, "nesterov": False},
        {"lr": 1e-2, "momentum": 0.9, "ns_steps": 3},
    ]


def _build(shard: str, seed: int, bias: bool):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 24, bias=bias), nn.Linear(24, 24, bias=bias),
                          nn.Linear(24, 8, bias=bias))
    if shard == "fsdp2":
        from torch.distributed.fsdp import fully_shard as fs
    else:
        from vefsdp_optim import fully_shard as fs
    for layer in model:
        fs(layer)
    fs(model)
    return model


def _make_opt(who: str, kind: str, params, cfg: dict):
    import torch

    if who == "ours":
        import vefsdp_optim as vo

        cls = vo.AdamW if kind == "adamw" else vo.Muon
    else:
        cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Muon
    return cls(params, **cfg)


def _train_loop(a: argparse.Namespace) -> None:
    import torch

    whos = ["ours", "torch"] if a.opt == "both" else [a.opt]
    shards = ["fsdp2", "ours"] if a.shard == "both" else [a.shard]
    kinds = ["adamw", "muon"] if a.kind == "both" else [a.kind]
    seed = 0
    for shard in shards:
        for kind in kinds:
            for cfg in _configs(kind):
                for who in whos:
                    seed += 1
                    model = _build(shard, seed, bias=(kind == "adamw"))
                    opt = _make_opt(who, kind, list(model.parameters()), cfg)
                    g = torch.Generator().manual_seed(1000 + seed)
                    for _ in range(a.steps):
                        x = torch.randn(4, 16, generator=g)
                        loss = model(x).square().mean()
                        loss.backward()
                        opt.step()
                        opt.zero_grad()
                    del opt, model


# ----------------------------------------------------------------------------- driver side

def _rank_cmd(a: argparse.Namespace, rank: int, world: int, init_file: str) -> list[str]:
    cmd = [
        sys.executable, "-X", "faulthandler", HERE, "--rank", str(rank),
        "--world-size", str(world), "--init-file", init_file,
        "--mode", a.mode, "--opt", a.opt, "--shard", a.shard, "--kind", a.kind,
        "--steps", str(a.steps), "--teardown", a.teardown,
        "--barrier" if a.barrier else "--no-barrier", "--exit", a.exit,
    ]
    if not a.lib:
        cmd.append("--no-lib")
    if a.core_dir:
        cmd += ["--core-dir", os.path.abspath(a.core_dir)]
    if a.gdb:
        cmd = ["gdb", "-q", "-batch", "-ex", "set pagination off", "-ex", "handle SIGPIPE nostop",
               "-ex", "run", "-ex", "thread apply all bt 30", "--args"] + cmd
    return cmd


def _one_run(a: argparse.Namespace, world: int) -> list[tuple[int, int, str]]:
    """Run W ranks once; return (rank, returncode, stderr tail) for each failed rank."""
    fd, init_file = tempfile.mkstemp(prefix="stress_pg_")
    os.close(fd)
    os.unlink(init_file)
    env = dict(os.environ, MALLOC_CHECK_="3", MALLOC_PERTURB_=str(a.perturb), PYTHONFAULTHANDLER="1",
               OMP_NUM_THREADS="1")
    logs = [tempfile.TemporaryFile() for _ in range(world)]
    procs = [
        subprocess.Popen(_rank_cmd(a, r, world, init_file), env=env,
                         stdout=logs[r], stderr=subprocess.STDOUT)
        for r in range(world)
    ]
    bad = []
    deadline = time.monotonic() + a.timeout
    for r, p in enumerate(procs):
        try:
            rc = p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            rc = "timeout"
        logs[r].seek(0)
        text = logs[r].read().decode(errors="replace")
        gdb_signal = a.gdb and ("received signal SIG" in text)
        if rc != 0 or gdb_signal:
            bad.append((r, rc, text))
    if os.path.exists(init_file):
        os.unlink(init_file)
    return bad


def _describe(rc) -> str:
    if rc == "timeout":
        return "timeout"
    if isinstance(rc, int) and rc < 0:
        return f"signal {signal.Signals(-rc).name}"
    return f"exit {rc}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=10, help="runs per world size")
    p.add_argument("--world", type=int, nargs="+", default=[2, 3])
    p.add_argument("--mode", choices=["train", "import", "init"], default="train")
    p.add_argument("--opt", choices=["ours", "torch", "both"], default="both")
    p.add_argument("--kind", choices=["adamw", "muon", "both"], default="both")
    p.add_argument("--shard", choices=["fsdp2", "ours", "both"], default="both")
    p.add_argument("--no-lib", dest="lib", action="store_false")
    p.add_argument("--teardown", choices=["destroy", "none"], default="destroy")
    p.add_argument("--barrier", dest="barrier", action="store_true", default=True)
    p.add_argument("--no-barrier", dest="barrier", action="store_false")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--exit", choices=["normal", "os_exit"], default="normal",
                   help="os_exit: skip interpreter finalization after teardown")
    p.add_argument("--perturb", type=int, default=165, help="MALLOC_PERTURB_ byte (0: off)")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--gdb", action="store_true")
    p.add_argument("--verbose", action="store_true", help="ranks print their thread counts")
    p.add_argument("--core-dir", default=None, help="ranks dump core there (core_pattern permitting)")
    p.add_argument("--tail", type=int, default=1500, help="stderr characters shown per abort")
    # rank mode
    p.add_argument("--rank", type=int, default=None)
    p.add_argument("--world-size", type=int, default=None)
    p.add_argument("--init-file", default=None)
    a = p.parse_args(argv)
    if a.rank is not None:
        _rank_main(a)
        return 0
    if not a.lib and (a.opt != "torch" or a.shard != "fsdp2") and a.mode == "train":
        p.error("--no-lib needs --opt torch --shard fsdp2")

    desc = (f"mode={a.mode} opt={a.opt} kind={a.kind} shard={a.shard} lib={a.lib} "
            f"teardown={a.teardown} barrier={a.barrier} exit={a.exit} steps={a.steps}")
    print(f"# {desc}", flush=True)
    total_runs = total_aborts = total_errors = 0
    for world in a.world:
        aborts = errors = 0
        t0 = time.monotonic()
        for i in range(a.reps):
            bad = _one_run(a, world)
            total_runs += 1
            # an abort: a rank killed by a signal (or a timeout); an error: a rank that
            # exited with a non-zero status (a Python exception), reported apart
            if any(not (isinstance(rc, int) and rc > 0) for _, rc, _ in bad):
                aborts += 1
                total_aborts += 1
            elif bad:
                errors += 1
                total_errors += 1
            if bad:
                core = os.path.join(a.core_dir or "", "core")
                if a.core_dir and os.path.exists(core):
                    os.rename(core, f"{core}.W{world}.run{i}")
                for r, rc, text in bad:
                    print(f"--- W={world} run {i} rank {r}: {_describe(rc)}\n{text[-a.tail:]}", flush=True)
        dt = time.monotonic() - t0
        print(f"W={world}: {aborts}/{a.reps} runs aborted, {errors} with a Python error "
              f"({dt / max(a.reps, 1):.1f}s per run)", flush=True)
    print(f"TOTAL: {total_aborts}/{total_runs} runs aborted, {total_errors} with a Python error  "
          f"[{desc}]", flush=True)
    return 1 if total_aborts or total_errors else 0


if __name__ == "__main__":
    sys.exit(main())
