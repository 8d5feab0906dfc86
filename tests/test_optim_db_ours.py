"""Our AdamW and Muon under every configuration torch's optimizer test database
(optim_db, through tests/torch_optim_db.py) generates for CPU float32.

Single process: our class equals torch's class bit for bit on the same parameters and
gradients. Sharded (FSDP2 and vefsdp_optim.fully_shard, W = 2 and 3): our class equals
torch's class on one device fed the same averaged gradients, bit for bit (AdamW is
elementwise; Muon's Newton-Schulz runs once per matrix on the full matrix). With
``fused=True`` our AdamW runs torch's fused kernel on each rank's shard, as torch's
AdamW(fused=True) does on FSDP2's DTensors; the CPU kernel's vectorized body and scalar
tail can round an element differently when the shard starts elsewhere, so on FSDP2 the
reference is torch's AdamW(fused=True) on the same FSDP2 model (bit for bit). On
fully_shard the flat store is stepped in pieces that put every element where one
device's tensor has it (see ``FUSED_BLOCK`` in vefsdp_optim/_math/_adam.py): one device, bit for bit.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from torch import nn
from torch_optim_db import OptimConfig, cpu_float32_configs

import vefsdp_optim

STEPS = 3
OURS = {"AdamW": vefsdp_optim.AdamW, "Muon": vefsdp_optim.Muon}


def _configs() -> list[OptimConfig]:
    return [c for c in cpu_float32_configs() if c.optim in OURS and c.skip is None]


def _model(optim: str) -> nn.Module:
    torch.manual_seed(0)  # torch's Muon takes 2-D parameters only
    bias = optim != "Muon"
    return nn.Sequential(nn.Linear(7, 13, bias=bias), nn.Tanh(), nn.Linear(13, 5, bias=bias))


def _kwargs(c: OptimConfig) -> dict:
    return copy.deepcopy(c.kwargs)


def test_configs_cover_adamw_and_muon():
    names = {(c.optim, c.desc) for c in _configs()}
    assert {o for o, _ in names} == {"AdamW", "Muon"}
    assert len(names) >= 12, names


@pytest.mark.parametrize("config", _configs(), ids=lambda c: f"{c.optim}-{c.desc}")
def test_single_process_bitwise(config: OptimConfig) -> None:
    ours_m, ref_m = _model(config.optim), _model(config.optim)
    ours = OURS[config.optim](ours_m.parameters(), **_kwargs(config))
    ref = getattr(torch.optim, config.optim)(ref_m.parameters(), **_kwargs(config))
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(1))
    for _ in range(STEPS):
        for m, o in ((ours_m, ours), (ref_m, ref)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    for a, b in zip(ours_m.parameters(), ref_m.parameters(), strict=True):
        assert torch.equal(a, b)


def _average_like_ranks(model: nn.Module, w: int) -> None:
    for p in model.parameters():
        s = p.grad.clone()
        for _ in range(w - 1):
            s = s + p.grad
        p.grad = s / w


def _sharded(configs: list[OptimConfig]) -> list[tuple[str, str, str, bool]]:
    from torch.distributed.fsdp import fully_shard as fsdp2_shard

    w = dist.get_world_size()
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(1))
    out = []
    for c in configs:
        torch.set_num_threads(1)
        ref_m = _model(c.optim)
        ref = getattr(torch.optim, c.optim)(ref_m.parameters(), **_kwargs(c))
        for _ in range(STEPS):
            ref.zero_grad()
            ref_m(x).square().mean().backward()
            _average_like_ranks(ref_m, w)
            ref.step()
        want = [p.detach() for p in ref_m.parameters()]
        for kind, shard in (("fsdp2", fsdp2_shard), ("fully_shard", vefsdp_optim.fully_shard)):
            runs = [OURS[c.optim]]
            if kind == "fsdp2" and c.kwargs.get("fused"):
                runs.append(getattr(torch.optim, c.optim))  # torch's fused kernel on the shards
            got = []
            for cls in runs:
                m = _model(c.optim)
                shard(m)
                opt = cls(m.parameters(), **_kwargs(c))
                for _ in range(STEPS):
                    opt.zero_grad()
                    m(x).square().mean().backward()
                    opt.step()
                got.append([p.full_tensor() for p in m.parameters()])
            ref_params = got[1] if len(got) > 1 else want
            out.append((c.optim, c.desc, kind,
                        all(torch.equal(a, b) for a, b in zip(got[0], ref_params, strict=True))))
    return out


@pytest.mark.parametrize("world_size", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_sharded_equals_single_device_bitwise(world_size: int) -> None:
    for res in run_distributed(_sharded, world_size, _configs(), timeout=300):
        bad = [r for r in res if not r[3]]
        assert not bad, bad
