"""sharded_view on plain tensors, FSDP2 DTensors (1-D and HSDP meshes) and the protocol.

References: the unsharded module (same seed, same input) and slices of its parameters'
and gradients' flat storage.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from torch import nn

from vefsdp_optim.comm import ShardedView, redistribute, sharded_view
from vefsdp_optim.sharding import RaggedShard


def _model() -> nn.Module:
    torch.manual_seed(0)
    # uneven rows: 7 (W=2: 4+3, W=3: 3+3+1, W=4: 2+2+2+1) and 2 (W=3, 4: empty shards)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))


def _check_module(model: nn.Module, ref: nn.Module, shard_w: int, shard_rank: int, group) -> list[str]:
    """Check views of params and grads against the unsharded reference; return names seen."""
    from torch.distributed.tensor import DTensor

    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(1))
    model(x).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    seen = []
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor)
        full_ref = ref_params[name].detach().reshape(-1)
        v = sharded_view(p)
        assert v.layout == RaggedShard.shard0(tuple(p.shape), shard_w)
        assert v.shape == ref_params[name].shape and v.rank == shard_rank
        assert (v.group is None) == (shard_w == 1)
        if group is not None and shard_w > 1:
            assert dist.get_process_group_ranks(v.group) == dist.get_process_group_ranks(group)
        a, n = v.layout.local(shard_rank)
        assert v.local.numel() == n
        assert torch.equal(v.local, full_ref[a : a + n]), name
        if n:
            assert v.local.data_ptr() == p._local_tensor.data_ptr()
        # gradient: same placements, same layout, aliasing the grad's storage
        g = sharded_view(p.grad)
        assert g.layout == v.layout and g.rank == shard_rank
        gref = ref_params[name].grad.reshape(-1)
        torch.testing.assert_close(g.local, gref[a : a + n])
        if n:
            assert g.local.data_ptr() == p.grad._local_tensor.data_ptr()
        # writing through the view writes the parameter
        v.local.copy_(torch.arange(a, a + n, dtype=v.local.dtype))
        full = p.full_tensor().reshape(-1)
        assert torch.equal(full, torch.arange(full.numel(), dtype=full.dtype)), name
        seen.append(name)
    return seen


def _fsdp_1d() -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    w, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (w,))
    ref, model = _model(), _model()
    fully_shard(model, mesh=mesh)
    seen = _check_module(model, ref, w, rank, mesh.get_group(0))

    # views feed redistribute directly: gather each param to rank 0 and compare
    views = [sharded_view(p) for p in model.parameters()]
    if w > 1:
        dst = [RaggedShard.whole(v.layout.numel, w, 0) for v in views]
        out = redistribute([v.local for v in views], [v.layout for v in views], dst, views[0].group)
        for o, p in zip(out, model.parameters(), strict=True):
            full = p.full_tensor().reshape(-1)  # a collective: every rank calls it
            if rank == 0:
                assert torch.equal(o, full)
            else:
                assert o.numel() == 0
    return seen


def _fsdp_hsdp() -> list[int]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    ref, model = _model(), _model()
    fully_shard(model, mesh=mesh)
    p0 = next(model.parameters())
    assert tuple(p0.placements) == (Replicate(), Shard(0))
    shard_rank = mesh.get_local_rank("shard")
    _check_module(model, ref, 2, shard_rank, mesh.get_group("shard"))
    return [shard_rank, mesh.get_local_rank("replicate")]


def _unsupported_placements() -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    w = dist.get_world_size()
    mesh = init_device_mesh("cpu", (w,))
    t = torch.arange(24.0).reshape(4, 6)
    msgs = []
    cases = [
        distribute_tensor(t, mesh, [Shard(1)]),
        distribute_tensor(t, mesh, [Replicate()]),
        DTensor.from_local(torch.zeros(4, 6), mesh, [Partial()]),
        DTensor.from_local(torch.zeros(4 // w if w in (1, 2, 4) else 2, 6), mesh, [_StridedShard(0, split_factor=2)]),
    ]
    for dt in cases:
        try:
            sharded_view(dt)
            msgs.append("no error")
        except NotImplementedError as e:
            msgs.append(str(e))
    mesh2 = init_device_mesh("cpu", (1, w))
    try:
        sharded_view(distribute_tensor(t, mesh2, [Shard(0), Shard(0)]))
        msgs.append("no error")
    except NotImplementedError as e:
        msgs.append(str(e))
    return msgs


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_sharded_view_fsdp2(world_size: int) -> None:
    results = run_distributed(_fsdp_1d, world_size)
    assert results[0] == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_sharded_view_hsdp_2x2() -> None:
    results = run_distributed(_fsdp_hsdp, 4)
    assert sorted(tuple(r) for r in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]


@pytest.mark.parametrize("world_size", [2])
def test_sharded_view_unsupported_placements(world_size: int) -> None:
    for msgs in run_distributed(_unsupported_placements, world_size):
        assert len(msgs) == 5
        for m, what in zip(msgs, ["Shard(dim=1)", "Replicate()", "Partial", "StridedShard", "2-D mesh"], strict=True):
            assert "not supported" in m and what in m, m
            assert "Shard(dim=0)" in m  # says what is supported


# -- single process --------------------------------------------------------------------


def test_plain_tensor_and_parameter() -> None:
    for t in (torch.arange(12.0).reshape(3, 4), nn.Parameter(torch.randn(2, 3)), torch.tensor(3.0)):
        v = sharded_view(t)
        assert v.layout == RaggedShard.whole(t.numel(), 1, 0) and v.group is None and v.rank == 0
        assert v.shape == t.shape and v.local.shape == (t.numel(),)
        assert v.local.data_ptr() == t.data_ptr()
        with torch.no_grad():
            v.local.add_(1.0)
        assert torch.equal(v.local, t.detach().reshape(-1))
    p = nn.Parameter(torch.zeros(4))
    p.grad = torch.ones(4)
    g = sharded_view(p.grad)
    assert g.local.data_ptr() == p.grad.data_ptr()
    e = sharded_view(torch.zeros(0, 3))
    assert e.local.numel() == 0 and e.layout.numel == 0


class _Custom:
    def __init__(self, local: torch.Tensor) -> None:
        self.local = local

    def __sharded_view__(self) -> ShardedView:
        return ShardedView(self.local, RaggedShard.whole(self.local.numel(), 1, 0), None, torch.Size([2, 3]), 0)


class _BadCustom:
    def __sharded_view__(self):
        return "nope"


def test_protocol() -> None:
    data = torch.arange(6.0)
    v = sharded_view(_Custom(data))
    assert v.local is data and v.shape == (2, 3)
    with pytest.raises(TypeError, match="must return a ShardedView, got str"):
        sharded_view(_BadCustom())


def test_unsupported_local_inputs() -> None:
    with pytest.raises(NotImplementedError, match="non-contiguous"):
        sharded_view(torch.zeros(3, 4).t())
    with pytest.raises(TypeError, match="got list"):
        sharded_view([1, 2])


def test_sharded_view_validation() -> None:
    lay = RaggedShard.from_boundaries([0, 2, 6])
    with pytest.raises(ValueError, match="1-D"):
        ShardedView(torch.zeros(2, 1), RaggedShard.whole(2, 1, 0), None, torch.Size([2]), 0)
    with pytest.raises(ValueError, match="needs a process group"):
        ShardedView(torch.zeros(2), lay, None, torch.Size([6]), 0)
    with pytest.raises(ValueError, match="has 5 elements, layout has 6"):
        ShardedView(torch.zeros(6), RaggedShard.whole(6, 1, 0), None, torch.Size([5]), 0)
    with pytest.raises(ValueError, match="rank must be"):
        ShardedView(torch.zeros(6), RaggedShard.whole(6, 1, 0), None, torch.Size([6]), 1)
    with pytest.raises(ValueError, match="gives rank 0 6"):
        ShardedView(torch.zeros(5), RaggedShard.whole(6, 1, 0), None, torch.Size([6]), 0)
    with pytest.raises(TypeError, match="RaggedShard"):
        ShardedView(torch.zeros(5), (0, 5), None, torch.Size([5]), 0)
