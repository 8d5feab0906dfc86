"""A user-defined block optimizer (examples/custom_tile_sgd.py): sharded == single device."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_utils import load_example, run_distributed
from torch import nn

import vefsdp_optim

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_tile_sgd.py"
SHAPES = [(10, 3), (7, 5), (1, 4), (2, 3, 2), (6,)]


def _example():
    return load_example("custom_tile_sgd.py")


def _tensors(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _single_device():
    cls = _example().TileNormalizedSGD
    ps = [nn.Parameter(t) for t in _tensors(0)]
    opt = cls(ps, lr=0.1, tile_rows=3)
    for step in range(3):
        for p, g in zip(ps, _tensors(100 + step), strict=True):
            p.grad = g
        opt.step()
    return [p.detach() for p in ps]


def _sharded():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    _example()  # registers "tile_sgd"
    cls = vefsdp_optim.get_optimizer("tile_sgd")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = nn.ParameterList([nn.Parameter(t) for t in _tensors(0)])
    fully_shard(model, mesh=mesh)
    ps = list(model)
    opt = cls(ps, lr=0.1, tile_rows=3)
    for step in range(3):
        for p, g in zip(ps, _tensors(100 + step), strict=True):
            p.grad = distribute_tensor(g, mesh, p.placements)
        opt.step()
    return [p.full_tensor().detach() for p in ps]


def test_registered_by_name():
    cls = _example().TileNormalizedSGD
    assert vefsdp_optim.get_optimizer("tile_sgd") is cls
    assert vefsdp_optim.get_optimizer("TILE_SGD") is cls
    with pytest.raises(ValueError, match="already registered"):
        vefsdp_optim.register_optimizer("tile_sgd", type("Other", (torch.optim.Optimizer,), {}))
    for not_an_optimizer in (int, type("Plain", (), {}), 3):
        with pytest.raises(TypeError, match="torch.optim.Optimizer subclass"):
            vefsdp_optim.register_optimizer("not_an_optimizer", not_an_optimizer)
    assert "not_an_optimizer" not in vefsdp_optim.list_optimizers()
    with pytest.raises(TypeError, match="torch.optim.Optimizer subclass"):
        vefsdp_optim.get_optimizer("collections:OrderedDict")
    with pytest.raises(ValueError, match="unknown optimizer"):
        vefsdp_optim.get_optimizer("no_such_optimizer")
    assert vefsdp_optim.get_optimizer(f"{cls.__module__}:TileNormalizedSGD") is cls


def test_same_definition_imported_twice_replaces_entry():
    # a script run as __main__ (or loaded under another module name) and imported as a
    # module defines the class twice from one source: that is not a name clash
    first = _example().TileNormalizedSGD
    path = Path(__file__).resolve().parents[1] / "examples" / "custom_tile_sgd.py"
    spec = importlib.util.spec_from_file_location("custom_tile_sgd_again", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # as an import does
    spec.loader.exec_module(mod)
    try:
        assert mod.TileNormalizedSGD is not first
        assert vefsdp_optim.get_optimizer("tile_sgd") is mod.TileNormalizedSGD
        same_name_other_source = type("TileNormalizedSGD", (torch.optim.Optimizer,), {})
        with pytest.raises(ValueError, match="overwrite=True"):
            vefsdp_optim.register_optimizer("tile_sgd", same_name_other_source)
    finally:
        vefsdp_optim.register_optimizer("tile_sgd", first, overwrite=True)
        del sys.modules[spec.name]


def test_single_device_differs_from_plain_sgd():
    # the band norm matters: a wrong band split would change the result
    got = _single_device()
    ps = [nn.Parameter(t) for t in _tensors(0)]
    sgd = torch.optim.SGD(ps, lr=0.1)
    for step in range(3):
        for p, g in zip(ps, _tensors(100 + step), strict=True):
            p.grad = g
        sgd.step()
    assert not torch.allclose(got[0], ps[0])


@pytest.mark.parametrize("world_size", [2, 3])
def test_sharded_equals_single_device(world_size):
    want = _single_device()
    for got in run_distributed(_sharded, world_size):
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
