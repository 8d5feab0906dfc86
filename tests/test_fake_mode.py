"""Every optimizer builds, steps and gives its state dict under FakeTensorMode, as a
memory estimate runs it (torchtitan's estimator: a model on fake tensors, torch's fake
process group): on one device on fake CUDA tensors, and as one rank of a W = 8 and a
W = 1,024 job sharded by FSDP2 or by our fully_shard. The reference is the same run on
real tensors: each parameter's state has the same keys, shapes, dtypes and bytes, and
the state dict the same keys; every state tensor of the fake run is a fake.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from fake_mode_job import OPTIMIZERS, STEPS, Model, signature

import vefsdp_optim

HERE = os.path.dirname(os.path.abspath(__file__))
# (W, rank): ranks that hold state of every optimizer at W = 8 under both shardings
# (Shampoo on fully_shard puts both matrices on rank 3 and the vectors on rank 7), and
# the two ends of a W = 1,024 job
RANKS = ((8, 3), (8, 7), (8, 0), (1024, 0), (1024, 1023))


def _plain(name: str, fake: bool) -> tuple[list[dict], list[tuple[str, type, str]]]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch.manual_seed(0)
    device = "cuda" if fake else "cpu"
    mode = FakeTensorMode() if fake else None  # refuses real tensors: a host constant must not leak in
    with mode if fake else torch.device("cpu"):
        with torch.device(device):
            model = Model()
        opt = getattr(vefsdp_optim, name)(model.parameters(), lr=0.01)
        for _ in range(STEPS):
            for p in model.parameters():  # (a backward on fake CUDA tensors needs a CUDA driver)
                p.grad = torch.randn_like(p)
            opt.step()
            opt.zero_grad()
        sd = opt.state_dict()
    params = [p for g in opt.param_groups for p in g["params"]]
    state = [{k: signature(v) for k, v in sorted(opt.state.get(p, {}).items())} for p in params]
    kinds = [(k, type(v), v.device.type) for st in sd["state"].values() for k, v in st.items()
             if isinstance(v, torch.Tensor)]
    return state, kinds


@pytest.mark.skipif(not torch.backends.cuda.is_built(), reason="fake CUDA tensors need a CUDA build of torch "
                    "(the -lo / -hi venvs)")
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_one_device_on_fake_cuda(name: str) -> None:
    from torch._subclasses.fake_tensor import FakeTensor

    fake, kinds = _plain(name, fake=True)
    real, _ = _plain(name, fake=False)
    assert fake == real, f"{name}: the state on fake CUDA tensors differs from a real run's"
    assert any(real), f"{name} left no state: nothing was compared"
    # every state tensor a fake, on the parameters' device but the step counts (on the
    # host, as torch.optim keeps them without capturable)
    assert kinds and all(issubclass(t, FakeTensor) and d == ("cpu" if k == "step" else "cuda")
                         for k, t, d in kinds), kinds


@pytest.mark.parametrize("world", [
    8,
    # one rank of a 1,024-rank job: ~15-35 s a sharding on 2 cores, the same code as W = 8
    # with longer layouts (the quick tier runs W = 8)
    pytest.param(1024, marks=pytest.mark.slow),
])
@pytest.mark.parametrize("sharding", [
    # FSDP2 under the fake group: 9-12 s of subprocess on 2 cores; the quick tier keeps ours
    # here and FSDP2 in test_estimate's Shampoo-fsdp2 case ([The suite's own cost])
    pytest.param("fsdp2", marks=pytest.mark.slow),
    "ours",
])
def test_one_rank_of_a_large_job(sharding: str, world: int) -> None:
    """One process plays each (W, rank) of RANKS at ``world`` under torch's fake process
    group, each optimizer on fake and on real CPU tensors (tests/fake_mode_job.py)."""
    args = [str(x) for w, r in RANKS if w == world for x in (w, r)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, os.path.join(HERE, "fake_mode_job.py"), sharding, *args],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout)
    held: dict[str, int] = {}
    for case, runs in out.items():
        fake, real = runs["fake"], runs["real"]
        for key in ("state", "state_dict_keys", "tensors"):
            assert fake[key] == real[key], f"{sharding} {case}: {key} differs, fake {fake[key]} real {real[key]}"
        assert fake["fake_tensors"] == fake["tensors"], f"{sharding} {case}: a real tensor in the fake run's state"
        assert real["fake_tensors"] == 0, f"{sharding} {case}"
        name = case.split()[0]
        held[name] = held.get(name, 0) + real["tensors"]
    assert len(out) == len(OPTIMIZERS) * sum(w == world for w, _ in RANKS), sorted(out)
    assert sorted(held) == sorted(OPTIMIZERS) and all(held.values()), f"{sharding}: state tensors seen {held}"
