"""Muon's momentum kept in 8 bits: block-wise quantized with 8-bit Adam's signed code map.

[Note: 8-bit Muon momentum] ``Muon(..., momentum_dtype=torch.int8)`` keeps the momentum
as one uint8 code per element and one float32 absmax per block of 256 elements of the
parameter's flat order (1.016 bytes per element against 4), with the signed dynamic code
map of 8-bit Adam ([Note: dynamic code map]). Each step dequantizes the momentum, applies
Muon's update in float32 (torch.optim.Muon's ``lerp`` order), and quantizes it back; the
Newton-Schulz input is the float32 update, as with a float32 momentum. Blocks never
straddle ranks: the compute layout keeps whole 256-blocks (or the whole tensor) on one
rank, so the result is the same at every world size.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._quant8 import dequantize_blockwise, quantize_blockwise

__all__ = ["MOMENTUM_BLOCK", "muon_momentum_int8_"]

#: elements per quantization block of the 8-bit momentum
MOMENTUM_BLOCK = 256


def muon_momentum_int8_(grad: Tensor, codes: Tensor, absmax: Tensor, *, momentum: float, nesterov: bool,
                        code: Tensor) -> Tensor:
    """One momentum step on a run of whole blocks (1-D ``grad``), in place on ``codes``
    (uint8, one per element) and ``absmax`` (float32, one per block); returns the float32
    update Newton-Schulz orthogonalizes."""
    if codes.numel() != grad.numel():
        raise ValueError(f"8-bit momentum holds {codes.numel()} codes for a gradient of {grad.numel()} elements")
    g = grad.float()
    m = dequantize_blockwise(codes, absmax, code, MOMENTUM_BLOCK)
    m.lerp_(g, 1 - momentum)
    update = g.lerp(m, momentum) if nesterov else m.clone()
    new_codes, new_absmax = quantize_blockwise(m, code, MOMENTUM_BLOCK)
    codes.copy_(new_codes)
    absmax.copy_(new_absmax)
    return update


def empty_momentum(n: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Zero 8-bit momentum of ``n`` elements: (codes, absmax)."""
    from ._quant8 import dynamic_code_map

    return quantize_blockwise(torch.zeros(n, dtype=torch.float32, device=device),
                              dynamic_code_map(True).to(device), MOMENTUM_BLOCK)
