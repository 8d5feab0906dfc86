"""One process playing one rank of a W-rank job (torch's fake process group), each
optimizer built, stepped and its state dict taken on fake tensors (FakeTensorMode) and
on real ones: the per-parameter state each leaves, as JSON on stdout, for
tests/test_fake_mode.py to compare.

    python tests/fake_mode_job.py SHARDING WORLD RANK [WORLD RANK ...]

SHARDING: ``fsdp2`` (torch's fully_shard) or ``ours`` (vefsdp_optim.fully_shard). The
tensors are CPU tensors: a mesh on fake CUDA tensors needs a CUDA driver for its current
device and streams (torch's FSDP2 asks for them), and a fake tensor's bytes do not
depend on its device.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

OPTIMIZERS = ("AdamW", "AdamW8bit", "Muon", "NorMuon", "Shampoo", "SOAP")
STEPS = 2


class Model(nn.Module):
    """Uneven shapes: a matrix whose rows do not divide by W, a bias, a norm, and a vector
    long enough for 8-bit state (min_8bit_size 4096)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(96, 650)
        self.out = nn.Linear(650, 96, bias=False)
        self.norm = nn.RMSNorm(96)
        self.scale = nn.Parameter(torch.ones(5000))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.out(self.inp(self.norm(x)))
        return h.float().square().sum() + self.scale.sum()


def signature(value: object) -> object:
    """A state value as what it holds: (shape, dtype, bytes) of a tensor (a DTensor's local
    one), the type name of anything else."""
    if hasattr(value, "to_local"):
        value = value.to_local()
    if isinstance(value, torch.Tensor):
        return [list(value.shape), str(value.dtype), value.numel() * value.element_size()]
    return type(value).__name__


def run(sharding: str, name: str, mesh: object, fake: bool) -> dict[str, object]:
    """The optimizer's per-parameter state and its state dict's keys after STEPS steps."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    import vefsdp_optim

    if sharding == "ours":
        shard = vefsdp_optim.fully_shard
    else:
        from torch.distributed.fsdp import fully_shard as shard
    torch.manual_seed(0)
    with FakeTensorMode() if fake else contextlib.nullcontext():
        model = Model()
        shard(model.inp, mesh=mesh)
        shard(model, mesh=mesh)
        opt = getattr(vefsdp_optim, name)(model.parameters(), lr=0.01)
        for _ in range(STEPS):
            model(torch.randn(4, 96)).backward()
            opt.step()
            opt.zero_grad()
        sd = get_optimizer_state_dict(model, opt)
    params = [p for group in opt.param_groups for p in group["params"]]
    state = [{k: signature(v) for k, v in sorted(opt.state.get(p, {}).items())} for p in params]
    tensors = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    fakes = sum(isinstance(v.to_local() if hasattr(v, "to_local") else v, FakeTensor) for v in tensors)
    return {"state": state, "state_dict_keys": sorted(f"{k}.{s}" for k, v in sd["state"].items() for s in v),
            "fake_tensors": fakes, "tensors": len(tensors)}


def main(argv: list[str]) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from dist_utils import _clear_torch_group_caches

    torch.set_num_threads(1)
    sharding, rest = argv[0], [int(a) for a in argv[1:]]
    if sharding not in ("fsdp2", "ours") or not rest or len(rest) % 2:
        raise SystemExit(f"usage: fake_mode_job.py fsdp2|ours WORLD RANK [WORLD RANK ...], got {argv}")
    from vefsdp_optim.estimate import real_tensors_on_the_fake_group

    real_tensors_on_the_fake_group()  # the real runs: a rank that only receives
    out = {}
    for world, rank in zip(rest[::2], rest[1::2], strict=True):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        mesh = init_device_mesh("cpu", (world,))  # outside the fake mode: its rank tensor is real
        for name in OPTIMIZERS:
            out[f"{name} W={world} rank={rank}"] = {kind: run(sharding, name, mesh, kind == "fake")
                                                    for kind in ("fake", "real")}
        dist.destroy_process_group()
        # torch keeps DTensor specs whose mesh equals a later one by value: the next world's
        # parameters would get this world's mesh and groups (tests/dist_utils.py)
        _clear_torch_group_caches()
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
