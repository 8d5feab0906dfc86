"""A block update gives the same bits wherever its gradient lives in memory
(see ``aligned`` in vefsdp_optim/_step_loop.py): fully_shard's gradients are views into one flat buffer at
any offset, one device's are fresh tensors. Found by tests/test_fuzz_sequences.py
(SOAP on fully_shard at W = 2 differed from one device by 1e-2)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vefsdp_optim

KW = {
    "SOAP": dict(lr=1e-2, precondition_frequency=1),
    "Shampoo": dict(lr=1e-2, max_preconditioner_dim=8, precondition_frequency=1, start_preconditioning_step=1),
    "AdamW8bit": dict(lr=1e-2, block_size=16, min_8bit_size=16),
    "Muon": dict(lr=1e-2),
    "NorMuon": dict(lr=1e-2),
}


def _run(name: str, offset: int, shape=(7, 5), steps: int = 4) -> torch.Tensor:
    n = shape[0] * shape[1]
    p = nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(0)))
    opt = getattr(vefsdp_optim, name)([p], **KW[name])
    buf = torch.zeros(n + 16)
    for k in range(steps):
        buf[offset: offset + n] = torch.randn(n, generator=torch.Generator().manual_seed(k + 1))
        p.grad = buf[offset: offset + n].view(shape)
        opt.step()
    return p.detach()


@pytest.mark.parametrize("name", sorted(KW))
def test_update_does_not_depend_on_the_gradients_address(name: str) -> None:
    torch.set_num_threads(1)
    want = _run(name, 0)
    for offset in (1, 2, 3, 5):
        got = _run(name, offset)
        assert torch.equal(got, want), (name, offset, (got - want).abs().max())
