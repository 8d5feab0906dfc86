"""Muon's momentum kept in 8 bits: block-wise quantized with 8-bit Adam's signed code map.

``Muon(..., momentum_dtype=torch.int8)`` keeps the momentum
as one uint8 code per element and one float32 absmax per block of 256 elements of the
parameter's flat order (1.016 bytes per element against 4), with the signed dynamic code
map of 8-bit Adam (see vefsdp_optim/_math/_quant8.py). Each step dequantizes the momentum, applies
Muon's update in float32 (torch.optim.Muon's ``lerp`` order), and quantizes it back
(see "No dead zone" below); the Newton-Schulz input is the float32 update, as with a float32
momentum. Blocks never straddle ranks: the compute layout keeps whole 256-blocks (or the
whole tensor) on one rank, and the rounding depends only on an element's value, its
flat index in the whole parameter and the step count, so the result is the same at
every world size.

No dead zone. Rounding to the nearest code would lose every step whose increment ``(1 - momentum)
(g - m)`` is below half a code spacing: the momentum would come back to its old code and
stay there while the gradient drifts (the increment is 0.05 of ``g - m``; code spacings
are 1.4% of the block's absmax in the top decade, up to 14% of the value). So an element
whose nearest code is the code it already had is rounded to one of the two codes around
it by a dither instead: to the upper one where ``u < (x - lo) / (hi - lo)``, ``x`` its
normalized value; every other element takes its nearest code. ``u`` (``_dither``) is a
hash of the element's flat index in the whole parameter, rotated at every step by
2**32 / golden ratio (mod 2**32): over one step the draws spread over the elements like
independent ones, and over the steps each element's draws are a low-discrepancy
sequence, so the average of its roundings over K steps follows its value with an error
of order 1 / K instead of the 1 / sqrt(K) of independent draws; the momentum is such an
average (over ~1 / (1 - momentum) = 20 steps). Integer arithmetic, deterministic and the
same at any sharding; the step count is the state entry ``momentum_step`` (REPLICATED,
like Adam's ``step``; an int64 0-d tensor on the host, or on the parameters' device with
``capturable=True``; the hash reads it where it lives, so either way no host sync).
Every element's dithered code is computed and taken where its nearest code is stuck:
finding the stuck ones first would be a host sync. What each
rounding rule cost on the toy tasks, and why 8-bit NorMuon stays above float32 momentum
on mlp (the code map's resolution, not a bias): docs/decisions.md.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._quant8 import dequantize_blockwise, quantize_blockwise

__all__ = ["MOMENTUM_BLOCK", "muon_momentum_int8_", "requantize_momentum_"]

#: elements per quantization block of the 8-bit momentum
MOMENTUM_BLOCK = 256

_MASK32 = 0xFFFFFFFF
_GOLDEN32 = 0x9E3779B9  # 2**32 / golden ratio, odd


def _dither(index: Tensor, step: int | Tensor) -> Tensor:
    """A float32 in [0, 1) per element from its int64 flat ``index`` and the momentum's
    ``step`` count (see the module docstring): a hash of the index, rotated by ``step`` times
    2**32 / golden ratio (mod 2**32), so each element's draws over the steps are a
    low-discrepancy sequence and the draws of one step are spread over the elements.
    Integer arithmetic only: the same bits on every device; every product stays below
    2**63 (``step`` below 2**31). ``step``: an int, or a 0-d int64 tensor (the state's
    count, on the host or, capturable, on ``index``'s device: read there, not on the host)
    with the same bits."""
    h = index >> 32  # in place from here: ~20 integer passes over every element of a step
    h ^= index
    h &= _MASK32
    h *= 0x61C88647
    h &= _MASK32
    for _ in range(2):
        h ^= h >> 16
        h *= 0x45D9F3B
        h &= _MASK32
    h ^= h >> 16
    h += step * _GOLDEN32 & _MASK32
    h &= _MASK32
    h >>= 8
    return h.to(torch.float32).mul_(1.0 / (1 << 24))


def requantize_momentum_(m: Tensor, codes: Tensor, absmax: Tensor, *, code: Tensor, offset: int,
                         step: int | Tensor) -> None:
    """Quantize the float32 momentum ``m`` (1-D, whole blocks) into ``codes`` and
    ``absmax`` in place, which hold its previous value (see the module docstring); ``offset``:
    the flat index of ``m[0]`` in the whole parameter; ``step``: the number of momentum
    steps before this one (the dither's phase). The dithered code is computed for every
    element and selected where the nearest one is stuck: elementwise ops, so each
    element gets the bits it would get alone, and no host sync to find the stuck ones."""
    new_codes, new_absmax = quantize_blockwise(m, code, MOMENTUM_BLOCK)
    stuck = new_codes == codes  # (n,) bool
    scale = torch.where(new_absmax > 0, new_absmax, torch.ones_like(new_absmax))
    # quantize_blockwise's normalized values
    x = ((m.view(-1, MOMENTUM_BLOCK) / scale[:, None]).view(-1) if m.numel() % MOMENTUM_BLOCK == 0
         else m / scale.repeat_interleave(MOMENTUM_BLOCK)[:m.numel()])
    # code[lo] <= x < code[lo + 1], lo in [0, 254]: the nearest code or the one below it
    # (searchsorted(code, x, right=True) - 1, clamped, without a second search)
    nearest = new_codes.to(torch.int32)
    lo = nearest.sub_((x < code.index_select(0,
                                             nearest)).to(torch.int32)).clamp_(0, code.numel() - 2)
    c_lo, c_hi = code.index_select(0, lo), code.index_select(0, lo + 1)
    index = torch.arange(offset, offset + m.numel(), dtype=torch.int64, device=m.device)
    up = _dither(index, step) < (x - c_lo) / (c_hi - c_lo)
    codes.copy_(torch.where(stuck, (lo + up).to(torch.uint8), new_codes))
    absmax.copy_(new_absmax)


def muon_momentum_int8_(grad: Tensor, codes: Tensor, absmax: Tensor, *, momentum: float,
                        nesterov: bool,
                        code: Tensor, step: int | Tensor, offset: int = 0) -> Tensor:
    """One momentum step on a run of whole blocks (1-D ``grad``), in place on ``codes``
    (uint8, one per element) and ``absmax`` (float32, one per block); returns the float32
    update Newton-Schulz orthogonalizes. ``step``: the number of momentum steps before
    this one (an int, or a 0-d int64 tensor read where it lives: no host sync);
    ``offset``: the flat index of ``grad[0]`` in the whole parameter (a multiple of
    MOMENTUM_BLOCK)."""
    if codes.numel() != grad.numel():
        raise ValueError(f"8-bit momentum holds {codes.numel()} codes for a gradient of "
                         f"{grad.numel()} elements")
    if isinstance(step, Tensor):
        if step.dtype != torch.int64 or step.dim() != 0:
            raise TypeError("8-bit momentum step must be an int or a 0-d int64 tensor, "
                            f"got {step!r}")
    elif isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError("8-bit momentum step must be an int >= 0 (the steps taken before), "
                         f"got {step!r}")
    if offset % MOMENTUM_BLOCK:
        raise ValueError(f"8-bit momentum offset must be a multiple of {MOMENTUM_BLOCK}, "
                         f"got {offset}")
    g = grad.float()
    m = dequantize_blockwise(codes, absmax, code, MOMENTUM_BLOCK)
    m.lerp_(g, 1 - momentum)
    update = g.lerp(m, momentum) if nesterov else m.clone()
    requantize_momentum_(m, codes, absmax, code=code, offset=offset, step=step)
    return update


def empty_momentum(n: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Zero 8-bit momentum of ``n`` elements: (codes, absmax)."""
    from ._quant8 import dynamic_code_map

    return quantize_blockwise(torch.zeros(n, dtype=torch.float32, device=device),
                              dynamic_code_map(True).to(device, non_blocking=True), MOMENTUM_BLOCK)
