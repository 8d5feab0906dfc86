"""Memory: the live-bytes tracker of the memory benchmark against known allocations, and
fully_shard's gradient memory (see ``StoreGrads.release_grads`` in
vefsdp_optim/_fsdp/_grads.py, [Note: lazy gradient buffer]) as structure: which storages
hold bytes when, not numbers from an earlier run."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed
from torch import nn


def _memtrack():  # noqa: ANN202
    """benchmarks/_memtrack.py, loaded by path (the repository root is not on sys.path)."""
    name = "vefsdp_test_memtrack"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "benchmarks" / "_memtrack.py"
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


# -- the tracker --------------------------------------------------------------------------


def test_tracker_counts_each_storage_once_while_it_lives() -> None:
    mt = _memtrack()
    older = torch.zeros(1000)  # made before the mode: never counted, not even through views
    with mt.LiveBytes() as m:
        a = torch.zeros(1000)  # 4000 bytes
        v = a[10:20]
        v.add_(1)
        older[1:3].mul_(2)
        _ = older.view(10, 100)
        assert (m.live, m.peak) == (4000, 4000)
        b = torch.empty(0)  # resized through the storage, as the unsharded buffers are
        b.untyped_storage().resize_(800)
        assert m.live == 4800
        b.untyped_storage().resize_(0)
        assert m.live == 4000
        d = torch.ones(250, dtype=torch.float64)  # 2000 bytes
        assert (m.live, m.peak) == (6000, 6000)
        del a
        assert m.live == 6000  # the view keeps the storage alive
        del v
        assert m.live == 2000
        m.reset_peak()
        y = torch.ones(100)
        z = y * 3
        del y, z
        assert (m.live, m.peak) == (2000, 2800)
        x = torch.randn(100, requires_grad=True)
        (x * 2).sum().backward()  # x and x.grad stay; x * 2 and the loss came and went
        assert m.live == 2000 + 400 + 400
        mine = [d]
        m.watch(m.live + 1, lambda: {"mine": mine})
        e = torch.zeros(10)
        assert m.breakdown == {"mine": 2000, "other": m.live - 2000, "total": m.live}
        assert m.tracked(e) and m.tracked(d) and not m.tracked(older)
    d = e = x = None
    mine.clear()
    assert m.live == 0 and b.untyped_storage().nbytes() == 0


# -- fully_shard's gradient memory (W = 2, 3) -------------------------------------------------


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(16, 16) for _ in range(3)])
        self.seen: list[bool] = []  # at each block's pre-backward: its gradient buffer has bytes
        self.track = True  # False: a plain (unsharded) copy, nothing to look at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            y = b(x)
            if y.requires_grad and self.track:  # runs right after the block's pre-backward hook
                y.register_hook(lambda g, b=b: self.seen.append(_store(b).compute.grad_global_allocated))
            x = torch.tanh(y)
        return x


def _store(m: nn.Module):  # noqa: ANN202
    from vefsdp_optim._fsdp._module import state_of

    return state_of(m).shard_group.stores[0]


def _grad_bytes(m: nn.Module) -> int:
    return _store(m).master.local_grad.untyped_storage().nbytes()


def _gradient_memory() -> list[str]:
    import copy

    import vefsdp_optim
    from vefsdp_optim import fully_shard

    torch.manual_seed(0)
    net = _Net()
    ref = copy.deepcopy(net)  # one device, torch's AdamW: the gradient memory changes no result
    ref.track = False
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for b in net.blocks:
        fully_shard(b)
    fully_shard(net)
    opt = vefsdp_optim.AdamW(net.parameters(), lr=1e-2)
    x = torch.randn(4, 16)
    bad = []
    blocks = list(net.blocks)
    if any(_grad_bytes(b) for b in blocks):
        bad.append("the shard gradients hold bytes before any backward")
    for step in range(3):
        net.seen.clear()
        net(x).square().sum().backward()
        if len(net.seen) != 3 or any(net.seen):
            bad.append(f"step {step}: a gradient buffer had bytes before its group's first gradient")
        if any(_store(b).compute.grad_global_allocated for b in blocks):
            bad.append(f"step {step}: a W*m gradient buffer outlived its reduction")
        if blocks[0].weight.grad is None or not _grad_bytes(blocks[0]):
            bad.append(f"step {step}: no shard gradient after backward")
        opt.step()
        ref(x).square().sum().backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        kept = blocks[0].weight.grad.to_local().clone() if step == 1 else None
        held = blocks[0].weight.grad if step == 1 else None
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            net(x)  # the next forward gives back what no .grad refers to
        if held is not None:
            if not _grad_bytes(blocks[0]) or not torch.equal(held.to_local(), kept):
                bad.append("a .grad the user still holds lost its bytes")
            del held
            with torch.no_grad():
                net(x)
        if any(_grad_bytes(b) for b in blocks):
            bad.append(f"step {step}: shard gradients kept their bytes after zero_grad(set_to_none)")
    for (name, p), q in zip(net.named_parameters(), ref.parameters(), strict=True):
        full = p.full_tensor()
        if not torch.allclose(full, q.detach(), rtol=1e-6, atol=1e-7):
            bad.append(f"{name}: differs from one device by {(full - q.detach()).abs().max().item():.3g}")
    return bad


@pytest.mark.parametrize("world_size", [2, 3])
def test_gradient_bytes_live_only_while_used(world_size: int) -> None:
    for bad in run_distributed(_gradient_memory, world_size):
        assert bad == []
