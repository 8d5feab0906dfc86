"""Meta-device initialization, as large runs start: build under torch.device("meta"),
fully_shard, to_empty, then initialize (reset_parameters) or load a full state dict.
No full parameter is materialized by sharding; the results equal one device and FSDP2.
"""

from __future__ import annotations

import copy

import pytest
import torch
from dist_utils import run_distributed
from torch import nn

import vefsdp_optim


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(7, 23), nn.LayerNorm(23), nn.Linear(23, 5))


def _reset(model: nn.Module, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()


def _full(model: nn.Module) -> list[torch.Tensor]:
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in model.parameters()]


def _meta(shard) -> nn.Module:  # noqa: ANN001
    with torch.device("meta"):
        model = _net()
    shard(model[0])
    shard(model)
    model.to_empty(device="cpu")
    return model


def _meta_init() -> dict[str, object]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import fully_shard as fsdp2

    out: dict[str, object] = {}
    single = _net()
    _reset(single, 3)
    ours = _meta(vefsdp_optim.fully_shard)
    out["on_cpu"] = all(p.device.type == "cpu" for p in ours.parameters())
    out["managed"] = all(isinstance(p, vefsdp_optim.ShardedParameter) for p in ours.parameters())
    _reset(ours, 3)  # reset_parameters on the sharded parameters: the single device's values
    out["reset_equal"] = all(torch.equal(a, b) for a, b in zip(_full(ours), _full(single), strict=True))
    # a full state dict loaded after to_empty, as frameworks do
    ref = _net()
    _reset(ref, 5)
    full = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    models = {"ours": _meta(vefsdp_optim.fully_shard), "fsdp2": _meta(fsdp2)}
    for m in models.values():
        set_model_state_dict(m, full, options=StateDictOptions(full_state_dict=True))
    out["load_equal"] = all(torch.equal(a, b) for a, b in zip(_full(models["ours"]), _full(ref), strict=True))
    # and then training goes as with FSDP2
    x = torch.randn(6, 7, generator=torch.Generator().manual_seed(1))
    opts = {k: vefsdp_optim.AdamW(m.parameters(), lr=1e-2) for k, m in models.items()}
    for _ in range(3):
        for k, m in models.items():
            opts[k].zero_grad()
            m(x).square().mean().backward()
            opts[k].step()
    out["train_vs_fsdp2"] = max(float((a - b).abs().max())
                                for a, b in zip(_full(models["ours"]), _full(models["fsdp2"]), strict=True))
    try:
        copy.deepcopy(single).half()  # a plain module converts; a fully_shard'd one refuses
        models["ours"].half()
        out["dtype_refused"] = False
    except NotImplementedError as e:
        out["dtype_refused"] = "MixedPrecisionPolicy" in str(e)
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_meta_device_init_then_reset_or_full_load(world_size: int) -> None:
    for res in run_distributed(_meta_init, world_size):
        assert res["on_cpu"] and res["managed"] and res["reset_equal"] and res["load_equal"], res
        assert res["train_vs_fsdp2"] < 1e-6 and res["dtype_refused"], res
