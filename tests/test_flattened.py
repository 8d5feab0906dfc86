"""Parameters another sharding flattened into 1-D shards (see vefsdp_optim/_flattened.py):
a real FSDP1 (FullyShardedDataParallel on gloo, CPU tensors) at W = 2 and 3, both
``use_orig_params`` settings, is refused by every optimizer with a block requirement, by
name and before any step, and trained by AdamW bit for bit as torch.optim.AdamW trains it;
and the marks FSDP1 and DeepSpeed's ZeRO-3 set, on their own."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dist_utils import run_distributed
from torch import nn

import vefsdp_optim

# block requirements on these shapes: Muon's matrix, Shampoo's and SOAP's tiles, 8-bit
# blocks (min_8bit_size 1: every parameter is 8-bit)
BLOCKY = {
    "Muon": (vefsdp_optim.Muon, dict(lr=0.02)),
    "NorMuon": (vefsdp_optim.NorMuon, dict(lr=0.02)),
    "Shampoo": (vefsdp_optim.Shampoo, dict(lr=0.01)),
    "SOAP": (vefsdp_optim.SOAP, dict(lr=0.01)),
    "AdamW8bit": (vefsdp_optim.AdamW8bit, dict(lr=0.01, min_8bit_size=1, block_size=8)),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 3))  # uneven: 58 elements


def _fsdp1(use_orig_params: bool, device: torch.device) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel(_model(), use_orig_params=use_orig_params, device_id=device)


def on_fsdp1(device: str = "cpu") -> dict[str, Any]:
    """On each rank of the default group: FSDP1 with ``use_orig_params`` False and True;
    per setting the parameters' shapes, each block optimizer's ValueError (None where it
    accepted them), and whether AdamW equals torch.optim.AdamW on the same FSDP1 module
    after three steps. JSON-ready (make gpu-check's ``fsdp1`` part runs it on CUDA)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    dev = torch.device(device, rank) if device == "cuda" else torch.device(device)
    out: dict[str, Any] = {"world": dist.get_world_size()}
    for uop in ("False", "True"):
        m = _fsdp1(uop == "True", dev)
        out[f"{uop}/shapes"] = sorted({tuple(p.shape) for p in m.parameters()})
        for name, (cls, kw) in BLOCKY.items():
            try:
                cls(m.named_parameters(), **kw)
                out[f"{uop}/{name}"] = None
            except ValueError as e:
                out[f"{uop}/{name}"] = str(e)
        # Muon's element-wise (AdamW) groups take them
        vefsdp_optim.Muon([{"params": list(m.parameters()), "use_muon": False}], lr=0.02)
        # AdamW on FSDP1 against torch.optim.AdamW on the same FSDP1 module, three steps
        ref = _fsdp1(uop == "True", dev)
        opts = [vefsdp_optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1),
                torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)]
        x = torch.randn(4, 7, generator=torch.Generator().manual_seed(rank)).to(dev)
        for _ in range(3):
            for mod, opt in zip((m, ref), opts, strict=True):
                opt.zero_grad()
                mod(x).square().sum().backward()
                opt.step()
        out[f"{uop}/adamw_equal"] = all(torch.equal(a, b)
                                        for a, b in zip(m.parameters(), ref.parameters(), strict=True))
    return out


def fsdp1_findings(res: dict[str, Any]) -> list[str]:
    """What is wrong in one rank's ``on_fsdp1`` result (empty: all as it should be). At
    W = 1 FSDP1 keeps ``use_orig_params=True`` parameters whole (its NO_SHARD): nothing to
    refuse there."""
    bad = []
    for uop in ("False", "True"):
        flat = uop == "False" or res["world"] > 1
        if flat and not all(len(s) <= 1 for s in res[f"{uop}/shapes"]):
            bad.append(f"use_orig_params={uop}: not flattened: {res[f'{uop}/shapes']}")
        for name in BLOCKY:
            msg = res[f"{uop}/{name}"]
            if not flat:
                continue
            if msg is None:
                bad.append(f"use_orig_params={uop}: {name} accepted a flattened parameter")
            elif not (msg.startswith(f"{name}: param group 0 parameter ") and "FSDP1" in msg
                      and "fully_shard" in msg and "differ from one device" in msg):
                bad.append(f"use_orig_params={uop}: {name}: {msg}")
            elif uop == "True" and not ("use_orig_params=True" in msg and "0.weight'" in msg):  # by its name
                bad.append(f"use_orig_params={uop}: {name}: {msg}")
            elif uop == "False" and not ("use_orig_params=False" in msg and "'2.weight'" in msg
                                         and "(5, 7)" in msg):  # what the FlatParameter holds
                bad.append(f"use_orig_params={uop}: {name}: {msg}")
        if not res[f"{uop}/adamw_equal"]:
            bad.append(f"use_orig_params={uop}: AdamW differs from torch.optim.AdamW")
    return bad


@pytest.mark.parametrize("world_size", [2, 3])
def test_fsdp1_refused_by_block_optimizers_and_trained_by_adamw(world_size: int) -> None:
    for res in run_distributed(on_fsdp1, world_size):
        assert res["world"] == world_size
        assert not fsdp1_findings(res), fsdp1_findings(res)


def test_the_marks_alone() -> None:
    """Without a sharding: FSDP1's ``_fsdp_flattened`` on a 1-D parameter (refused by
    Muon, taken by AdamW and by Muon's AdamW groups), the same mark on a parameter that
    kept its shape (FSDP1's NO_SHARD: taken), and ZeRO-3's ``ds_shape`` / ``ds_id``
    (DeepSpeed is not installed here: its attributes alone), refused where the recorded
    shape needs blocks and taken where it does not."""
    vec = nn.Parameter(torch.zeros(12))
    vec._fsdp_flattened = True
    with pytest.raises(ValueError, match=r"Muon: param group 0 parameter 0 \(shape \(12,\)\) is a 1-D view of an "
                                         r"FSDP1 flat shard"):
        vefsdp_optim.Muon([vec], lr=0.02)
    vefsdp_optim.AdamW([vec])
    vefsdp_optim.Muon([{"params": [vec], "use_muon": False}], lr=0.02)
    kept = nn.Parameter(torch.zeros(3, 4))
    kept._fsdp_flattened = True
    vefsdp_optim.Muon([kept], lr=0.02)

    part = nn.Parameter(torch.zeros(0))
    part.ds_id, part.ds_shape = 7, torch.Size([6, 4])
    with pytest.raises(ValueError, match=r"DeepSpeed ZeRO-3 partition; its original shapes \[\(6, 4\)\]"):
        vefsdp_optim.Shampoo([part], lr=0.01)
    bias = nn.Parameter(torch.zeros(0))
    bias.ds_id, bias.ds_shape = 8, torch.Size([6])
    vefsdp_optim.Shampoo([bias], lr=0.01)  # a vector: element-wise on one device too

    muon = vefsdp_optim.Muon([nn.Parameter(torch.zeros(2, 2))], lr=0.02)
    with pytest.raises(ValueError, match="FSDP1"):
        muon.add_param_group({"params": [vec]})
    assert len(muon.param_groups) == 1  # the refused group is not kept
    opt = vefsdp_optim.AdamW([nn.Parameter(torch.zeros(2, 2))])
    opt.add_param_group({"params": [vec]})  # AdamW: element-wise
    assert len(opt.param_groups) == 2
