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

from vefsdp_optim.comm import redistribute, sharded_view
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
        assert (v.process_group is None) == (shard_w == 1)
        if group is not None and shard_w > 1:
            assert dist.get_process_group_ranks(v.process_group) == dist.get_process_group_ranks(group)
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
        out = redistribute([v.local for v in views], [v.layout for v in views], dst, views[0].process_group)
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


def _placements() -> dict[str, object]:
    """Shard(1), Replicate and nested Shard(0) are views (checked against DTensor's own
    local tensors); Partial and an unmatched _StridedShard raise ValueError."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from vefsdp_optim.sharding import BoxShard, RaggedShard

    w = dist.get_world_size()
    mesh = init_device_mesh("cpu", (w,))
    mesh2 = init_device_mesh("cpu", (1, w), mesh_dim_names=("a", "b"))
    t = torch.arange(35.0).reshape(5, 7)
    out: dict[str, object] = {}
    for label, dt in (("shard1", distribute_tensor(t, mesh, [Shard(1)])),
                      ("replicate", distribute_tensor(t, mesh, [Replicate()])),
                      ("shard0_shard0", distribute_tensor(t, mesh2, [Shard(0), Shard(0)]))):
        view = sharded_view(dt)
        flat = t.reshape(-1)[view.layout.local_index(view.rank)]
        out[label] = (type(view.layout).__name__, torch.equal(flat, dt.to_local().reshape(-1)))
    for label, dt in (("partial", DTensor.from_local(torch.zeros(5, 7), mesh, [Partial()])),
                      ("strided", DTensor.from_local(torch.zeros(3 if w == 2 else 5, 7), mesh,
                                                     [_StridedShard(0, split_factor=2)]))):
        try:
            sharded_view(dt)
            out[label] = "no error"
        except ValueError as e:
            out[label] = str(e)
    del BoxShard, RaggedShard
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_sharded_view_fsdp2(world_size: int) -> None:
    results = run_distributed(_fsdp_1d, world_size)
    assert results[0] == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_sharded_view_hsdp_2x2() -> None:
    results = run_distributed(_fsdp_hsdp, 4)
    assert sorted(tuple(r) for r in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]


@pytest.mark.parametrize("world_size", [2])
def test_sharded_view_placements(world_size: int) -> None:
    for r in run_distributed(_placements, world_size):
        assert r["shard1"] == ("BoxShard", True), r
        assert r["replicate"] == ("RaggedShard", True), r
        assert r["shard0_shard0"] == ("RaggedShard", True), r
        assert "Partial" in r["partial"] or "P(sum)" in r["partial"], r
        assert "not supported" in r["partial"] and "Replicate" in r["partial"], r
        assert "_StridedShard(sf=2)" in r["strided"] and "not matched" in r["strided"], r
