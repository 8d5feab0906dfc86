"""8-bit Muon momentum ([Note: 8-bit Muon momentum]): ``momentum_dtype=torch.int8``.

One device: equal, bit for bit, to torch.optim.Muon whose momentum buffer is replaced
after every step by its block-wise quantized value (quantize, dequantize: 256-element
blocks, 8-bit Adam's signed code map), and about 1.016 bytes of state per element.
Sharded (FSDP2, fully_shard; W = 2 and 3; uneven shapes): equal to one device.
Checkpoints: tests/test_checkpoint.py ("muon8").
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed
from torch import nn

import vefsdp_optim
from vefsdp_optim._math import dequantize_blockwise, dynamic_code_map, quantize_blockwise

SHAPES = {"a": (37, 29), "b": (300, 11), "experts": (3, 70, 5)}
HP = dict(lr=0.02, weight_decay=0.1)
STEPS = 4


def _grad(step: int, name: str) -> torch.Tensor:
    return torch.randn(SHAPES[name], generator=torch.Generator().manual_seed(100 * step + ord(name[0])))


def _init() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}


def _groups(params: dict[str, torch.Tensor], **kw: object) -> list[dict]:
    return [{"params": [params["a"], params["b"]], **kw},
            {"params": [params["experts"]], "flatten": False, **kw}]


def _fake_quant(x: torch.Tensor) -> torch.Tensor:
    code = dynamic_code_map(True)
    flat = x.detach().reshape(-1).float()
    return dequantize_blockwise(*quantize_blockwise(flat, code, 256), code, 256).view(x.shape)


def _reference() -> dict[str, torch.Tensor]:
    """torch.optim.Muon on each matrix (experts one by one), momentum fake-quantized."""
    init = _init()
    mats = {"a": [nn.Parameter(init["a"].clone())], "b": [nn.Parameter(init["b"].clone())],
            "experts": [nn.Parameter(e.clone()) for e in init["experts"]]}
    opt = torch.optim.Muon([p for ps in mats.values() for p in ps], **HP)
    for step in range(STEPS):
        for k, ps in mats.items():
            g = _grad(step, k)
            for p, gi in zip(ps, g if k == "experts" else [g], strict=True):
                p.grad = gi.clone()
        opt.step()
        for k, ps in mats.items():  # the 8-bit state: blocks of the parameter's flat order
            if k == "experts":
                q = _fake_quant(torch.stack([opt.state[p]["momentum_buffer"] for p in ps]))
                for p, qi in zip(ps, q, strict=True):
                    opt.state[p]["momentum_buffer"].copy_(qi)
            else:
                buf = opt.state[ps[0]]["momentum_buffer"]
                buf.copy_(_fake_quant(buf))
    return {k: torch.stack([p.detach() for p in ps]) if k == "experts" else ps[0].detach()
            for k, ps in mats.items()}


def test_int8_momentum_equals_torch_muon_with_quantized_buffer() -> None:
    params = {k: nn.Parameter(v.clone()) for k, v in _init().items()}
    opt = vefsdp_optim.Muon(_groups(params, momentum_dtype=torch.int8), **HP)
    for step in range(STEPS):
        for k, p in params.items():
            p.grad = _grad(step, k)
        opt.step()
    want = _reference()
    for k in SHAPES:
        assert torch.equal(params[k].detach(), want[k]), (k, (params[k] - want[k]).abs().max())
    n = sum(p.numel() for p in params.values())
    state = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values()
                if isinstance(t, torch.Tensor))
    assert state / n <= 1.05, state / n
    fp32 = vefsdp_optim.Muon(_groups({k: nn.Parameter(v.clone()) for k, v in _init().items()}), **HP)
    assert fp32.param_groups[0]["momentum_dtype"] is None


def test_momentum_dtype_errors() -> None:
    p = nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="momentum_dtype must be None .* or torch.int8"):
        vefsdp_optim.Muon([p], momentum_dtype=torch.float16)
    with pytest.raises(ValueError, match="momentum_dtype"):
        vefsdp_optim.Muon([{"params": [p], "momentum_dtype": "int8"}])


def _sharded(kind: str) -> float:
    from vefsdp_optim import ShardedParameter

    one = {k: nn.Parameter(v.clone()) for k, v in _init().items()}
    ref = vefsdp_optim.Muon(_groups(one, momentum_dtype=torch.int8), **HP)
    model = nn.Module()
    for k, v in _init().items():
        model.register_parameter(k, nn.Parameter(v.clone()))
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        from vefsdp_optim import fully_shard
    fully_shard(model)
    named = dict(model.named_parameters())
    opt = vefsdp_optim.Muon(_groups(named, momentum_dtype=torch.int8), **HP)
    w = torch.distributed.get_world_size()
    for step in range(STEPS):
        for k, p in named.items():
            g = _grad(step, k)
            one[k].grad = g.clone()
            if isinstance(p, ShardedParameter):
                p.grad = p.with_local(g.reshape(-1)[p.ragged_layout.local_index(p.shard_rank)].clone())
            else:
                from torch.distributed.tensor import distribute_tensor

                p.grad = distribute_tensor(g, p.device_mesh, p.placements)
        opt.step()
        ref.step()
    del w
    return max(float((p.full_tensor() - one[k].detach()).abs().max()) for k, p in named.items())


def _both() -> dict[str, float]:
    return {kind: _sharded(kind) for kind in ("fsdp2", "fully_shard")}


@pytest.mark.parametrize("world_size", [2, 3])
def test_int8_momentum_sharded_equals_one_device(world_size: int) -> None:
    for r in run_distributed(_both, world_size):
        assert r == {"fsdp2": 0.0, "fully_shard": 0.0}, r
