"""Each optimizer's mathematics as one pure function on a whole tensor (``vefsdp_optim._math``),
against an independent reference, and each batched form the step loop runs against the
pure function applied block by block, bit for bit.

The references: torch's functional optimizers (``torch.optim.adamw.adamw``,
``torch.optim._muon._single_tensor_muon``) where torch has the algorithm; elsewhere the
algorithm written out here from its paper's formulas, in the library's documented op
order (8-bit Adam), or in float64 (Shampoo, SOAP).
"""

from __future__ import annotations

import pytest
import torch
from torch.optim.adamw import adamw as torch_adamw

from vefsdp_optim._math import (
    adam8bit_block_step_,
    adam_foreach_,
    adamw_step_,
    dequantize_blockwise,
    dynamic_code_map,
    num_blocks,
    quantize_blockwise,
)

SIGNED, UNSIGNED = dynamic_code_map(True), dynamic_code_map(False)

# ----------------------------------------------------------------------------- AdamW


def _adam_state(shape: tuple[int, ...]) -> list[torch.Tensor]:
    return [torch.zeros(shape), torch.zeros(shape), torch.zeros(shape)]


@pytest.mark.parametrize("amsgrad,maximize", [(False, False), (True, True)])
def test_adamw_step_equals_torch_functional_adamw(amsgrad: bool, maximize: bool) -> None:
    """adamw_step_ on one whole tensor: torch.optim.adamw.adamw's bits (its CPU default,
    the single-tensor form)."""
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(37, 11, generator=gen)
    p_ref = p.clone()
    m, v, vmax = _adam_state(p.shape)
    m_ref, v_ref, vmax_ref = _adam_state(p.shape)
    step_ref = torch.tensor(0.0)
    hp = dict(lr=3e-3, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.05, amsgrad=amsgrad,
              maximize=maximize)
    for t in range(1, 6):
        g = torch.randn(p.shape, generator=gen)
        adamw_step_(p, g, m, v, vmax if amsgrad else None, step=t, **hp)
        torch_adamw([p_ref], [g], [m_ref], [v_ref], [vmax_ref] if amsgrad else [], [step_ref],
                    foreach=False, **hp)
    for a, b in [(p, p_ref), (m, m_ref), (v, v_ref)] + ([(vmax, vmax_ref)] if amsgrad else []):
        assert torch.equal(a, b)


def test_adamw_batched_forms_equal_the_pure_function_per_tensor() -> None:
    """The two batched forms of adamw_step_ the step loop runs: adam_foreach_ (torch's
    multi-tensor Adam over a bucket of slices) and adamw_step_ on one flat store holding
    several parameters end to end ([Note: fused buckets]): each is adamw_step_ on every
    tensor alone, bit for bit."""
    gen = torch.Generator().manual_seed(1)
    shapes = [(64, 33), (7,), (1, 129), (300,)]
    params = [torch.randn(s, generator=gen) for s in shapes]
    alone = [p.clone() for p in params]
    foreach = [p.clone() for p in params]
    flat = torch.cat([p.reshape(-1) for p in params])
    s_alone = [_adam_state(s) for s in shapes]
    s_foreach = [_adam_state(s) for s in shapes]
    s_flat = _adam_state(flat.shape)
    steps = [torch.tensor(0.0) for _ in shapes]
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, amsgrad=False,
              maximize=False, decoupled=True)
    for t in range(1, 5):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        for p, g, (m, v, _) in zip(alone, grads, s_alone, strict=True):
            adamw_step_(p, g, m, v, None, step=t, **hp)
        adam_foreach_(foreach, grads, [s[0] for s in s_foreach], [s[1] for s in s_foreach], [], steps,
                      foreach=True, **hp)
        adamw_step_(flat, torch.cat([g.reshape(-1) for g in grads]), s_flat[0], s_flat[1], None, step=t,
                    **hp)
    offsets = torch.tensor([0] + [p.numel() for p in params]).cumsum(0).tolist()
    for i, p in enumerate(alone):
        lo, hi = offsets[i], offsets[i + 1]
        assert torch.equal(foreach[i], p) and torch.equal(flat[lo:hi], p.reshape(-1))
        assert torch.equal(s_foreach[i][0], s_alone[i][0]) and torch.equal(s_flat[1][lo:hi],
                                                                             s_alone[i][1].reshape(-1))


# ----------------------------------------------------------------------------- 8-bit Adam


def _adam8bit_reference(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *, step: int,
                        lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                        decoupled: bool, block_size: int) -> tuple[torch.Tensor, ...]:
    """One 8-bit Adam(W) step written from [Note: 8-bit Adam op order] with the reference
    quantizer (quantize_blockwise's binary search): new (p, m codes, m absmax, v codes,
    v absmax). ``m`` and ``v`` are the dequantized float32 moments."""
    f32 = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731 - one rounding to float32
    bc1, bc2 = 1 - beta1**step, 1 - beta2**step
    p, g, m, v = p.clone(), g.clone(), m.clone(), v.clone()
    if weight_decay:
        if decoupled:
            p = p * f32(1 - lr * weight_decay)
        else:
            g = g + p * f32(weight_decay)
    m = m + (g - m) * f32(1 - beta1)
    v = v * f32(beta2) + (g * g) * f32(1 - beta2)
    denom = v.double().sqrt().float() / f32(bc2**0.5) + f32(eps)
    p = p + (m * f32(-(lr / bc1))) / denom
    return (p, *quantize_blockwise(m, SIGNED, block_size), *quantize_blockwise(v, UNSIGNED, block_size))


@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("fused", [False, None])
def test_adam8bit_step_equals_reference(decoupled: bool, fused: bool | None) -> None:
    """adam8bit_block_step_ on one whole tensor (eager ops, or the fused kernel the
    optimizer runs on this machine): the reference's bits, step after step."""
    gen = torch.Generator().manual_seed(2)
    numel, block_size = 1000, 64  # 16 blocks, the last one 40 elements
    p = torch.randn(numel, generator=gen)
    state = [*quantize_blockwise(torch.zeros(numel), SIGNED, block_size),
             *quantize_blockwise(torch.zeros(numel), UNSIGNED, block_size)]
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, decoupled=decoupled,
              block_size=block_size)
    for t in range(1, 6):
        g = torch.randn(numel, generator=gen)
        m = dequantize_blockwise(state[0], state[1], SIGNED, block_size)
        v = dequantize_blockwise(state[2], state[3], UNSIGNED, block_size)
        want = _adam8bit_reference(p, g, m, v, step=t, **hp)
        adam8bit_block_step_(p, g, *state, step=t, signed_code=SIGNED, unsigned_code=UNSIGNED,
                             fused=fused, **hp)
        for got, ref in zip((p, *state), want, strict=True):
            assert torch.equal(got, ref), t
    assert state[1].numel() == num_blocks(numel, block_size) and bool((state[1] > 0).all())
