"""Block-wise 8-bit quantization with a dynamic code map, and the 8-bit Adam step.

Dettmers et al., "8-bit Optimizers via Block-wise Quantization" (ICLR 2022): a tensor
is cut into blocks of ``block_size`` consecutive elements, counted from element 0 (the
last block may be shorter); each block is divided by its absolute maximum and every
element is stored as the uint8 index of the nearest value of a fixed, non-linear code
map of 256 values. Blocks never interact, so quantizing a run of whole blocks gives the
same bits as quantizing the whole tensor (the property sharding relies on).

The map is built from a "dynamic tree" bit layout. Unsigned (8 magnitude bits): the
number ``e`` of leading zero bits is a decimal exponent, the next bit (the first 1) is
an indicator, and the remaining ``f = 7 - e`` bits are a linear fraction, giving the
``2**f`` magnitudes

    10**-e * (0.1 + 0.9 * (k + 1) / 2**f),   k = 0 .. 2**f - 1,   e = 0 .. 7

(so each decade ``(10**-(e+1), 10**-e]`` is cut into equal steps and its top value is
exactly ``10**-e``; 1.0 is a code value) plus the all-zero byte, which is 0.0: 256
values in [0, 1], smallest positive 1e-7. Signed: the first bit is the sign and the
seven others the same tree with ``e = 0 .. 6`` (127 magnitudes in [1e-6, 1], 1.0
included); the byte with only the sign bit set, which would be a second zero, is the
tree's next tier, ``-1e-7``. 256 values in [-1, 1], +-1.0 and 0.0 included. The values
are computed in float64 and rounded once to float32, so the map is deterministic and
identical on every device. Each decade's steps are equal and continue across the
decade boundary, so the largest gap between neighbours is ``0.9 / 2**f`` of the top
decade: 0.9/128 unsigned, 0.9/64 signed.
"""

from __future__ import annotations

import functools
import struct

import torch
from torch import Tensor

from .._torch_compat import FakeTensor, host_constants, to_device

__all__ = [
    "TableQuantizer",
    "dequantize_blockwise",
    "dequantize_table",
    "dynamic_code_map",
    "host_table_quantizers",
    "num_blocks",
    "quantize_blockwise",
]


def _tree_magnitudes(magnitude_bits: int) -> list[float]:
    """The positive magnitudes of the dynamic tree on ``magnitude_bits`` bits (ascending)."""
    out: list[float] = []
    for e in range(magnitude_bits):
        n = 2 ** (magnitude_bits - 1 - e)
        out.extend(10.0**-e * (0.1 + 0.9 * (k + 1) / n) for k in range(n))
    return sorted(out)


def dynamic_code_map(signed: bool) -> Tensor:
    """The 256 sorted float32 values of the dynamic code map (see the module docstring).

    ``signed=True``: values in [-1, 1] (for Adam's first moment); ``signed=False``:
    values in [0, 1] (for the second moment). Both contain 0.0 and 1.0 exactly, the
    signed one -1.0 as well. Returned on the CPU (a new tensor); move it once with
    ``.to(device)``.
    """
    if not isinstance(signed, bool):
        raise TypeError(f"signed must be a bool, got {type(signed).__name__}")
    return torch.tensor(_code_values(signed), dtype=torch.float32)


@functools.cache
def _code_values(signed: bool) -> tuple[float, ...]:
    """The map's values rounded once to float32, checked on the host (no tensor: the map
    may be built where tensors are fakes, e.g. under FakeTensorMode)."""
    if signed:
        mags = _tree_magnitudes(7)
        values = [-m for m in mags] + [-1e-7, 0.0] + mags
    else:
        values = [0.0] + _tree_magnitudes(8)
    code = struct.unpack(f"{len(values)}f", struct.pack(f"{len(values)}f", *sorted(values)))
    if len(code) != 256 or not all(a < b for a, b in zip(code, code[1:], strict=False)):
        raise AssertionError(f"dynamic code map must be 256 strictly increasing values: {code}")
    return code


def num_blocks(numel: int, block_size: int) -> int:
    """``ceil(numel / block_size)``: the number of blocks (and absmax values) of a tensor."""
    return -(-numel // block_size)


def _check_code(code: Tensor) -> None:
    if not isinstance(code, Tensor) or code.dtype != torch.float32 or code.shape != (256,):
        got = f"{code.dtype} {tuple(code.shape)}" if isinstance(code, Tensor) else type(code)
        raise ValueError(f"code must be a float32 tensor of 256 sorted values, got {got}")


def _check_block_size(block_size: int) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")


def _blocks(x: Tensor, block_size: int) -> Tensor:
    """``x`` (1-D, numel) zero-padded and viewed as (num_blocks, block_size)."""
    pad = num_blocks(x.numel(), block_size) * block_size - x.numel()
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.view(-1, block_size)


def quantize_blockwise(x: Tensor, code: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """Quantize a 1-D float32 tensor block by block to the nearest code value.

    Each block of ``block_size`` elements (counted from element 0; the last may be
    short) is divided by its absolute maximum and each element becomes the index of the
    nearest value of ``code``; a value exactly halfway between two code values (as the
    float32 midpoint) takes the lower one. A block of zeros has absmax 0 and codes of
    0.0, so it comes back as exact zeros.

    Returns:
        ``(codes, absmax)``: uint8 of shape (numel,), float32 of shape
        (ceil(numel / block_size),), on ``x``'s device.
    """
    if not isinstance(x, Tensor) or x.ndim != 1 or x.dtype != torch.float32:
        got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"x must be a 1-D float32 tensor, got {got}")
    _check_code(code)
    _check_block_size(block_size)
    code = code.to(x.device)
    blocks = _blocks(x, block_size)  # (num_blocks, block_size)
    absmax = blocks.abs().amax(dim=1)  # (num_blocks,)
    scale = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    normed = blocks / scale[:, None]  # (num_blocks, block_size), in [-1, 1]
    midpoints = (code[:-1] + code[1:]) / 2  # (255,)
    idx = torch.searchsorted(midpoints, normed.reshape(-1), out_int32=True)  # (nb * bs,)
    codes = idx[: x.numel()].to(torch.uint8)
    return codes, absmax


def dequantize_blockwise(
    codes: Tensor, absmax: Tensor, code: Tensor, block_size: int
) -> Tensor:
    """Inverse of ``quantize_blockwise``: ``code[codes] * absmax`` of each element's block.

    Returns a new 1-D float32 tensor of ``codes.numel()`` elements.
    """
    if not isinstance(codes, Tensor) or codes.ndim != 1 or codes.dtype != torch.uint8:
        got = f"{codes.dtype} {tuple(codes.shape)}" if isinstance(codes, Tensor) else codes
        raise ValueError(f"codes must be a 1-D uint8 tensor, got {got}")
    _check_code(code)
    _check_block_size(block_size)
    nb = num_blocks(codes.numel(), block_size)
    if not isinstance(absmax, Tensor) or absmax.shape != (nb,) or absmax.dtype != torch.float32:
        got = f"{absmax.dtype} {tuple(absmax.shape)}" if isinstance(absmax, Tensor) else absmax
        raise ValueError(
            f"absmax must be float32 of shape ({nb},) for {codes.numel()} codes in blocks "
            f"of {block_size}, got {got}"
        )
    values = code.to(codes.device)[codes.long()]  # (numel,)
    return (_blocks(values, block_size) * absmax[:, None]).reshape(-1)[: codes.numel()]


# quantize_blockwise (the reference) finds each code with a binary search over the 255
# midpoints of the code map (torch.searchsorted), which on the CPU costs many times an
# AdamW step (docs/performance.md). TableQuantizer gives the same codes, bit for bit,
# with a lookup: the top 16 bits of a float32 (sign, exponent, 7 mantissa bits) name a
# bucket of consecutive floats; ``lo[bucket]`` counts the midpoints below the bucket, and
# the few midpoints inside it (at most ``k``: 1 for both dynamic maps) are compared one
# by one. The code is the number of midpoints strictly below the value, exactly
# searchsorted's answer (a value equal to a midpoint takes the lower code). NaN inputs
# are not supported. With k <= 1 (the dynamic maps) the code is ``lo8[b] + (mid_in[b] <
# x)``: two byte / float lookups on the same bucket, written straight into the uint8
# state, with no int32 temporaries (the profile that led here: docs/decisions.md).


# The fused kernel reads one 32-bit word per element instead of a byte and a float:
# ``packed[b] = lo8[b] << 16 | t``, where ``t`` is the low 16 bits of the bucket's midpoint
# (its high 16 bits are ``b`` itself). For a value ``x`` with bits ``u`` in bucket ``b``,
# ``mid_in[b] < x`` is ``(u & 0xFFFF) > t`` for a positive bucket and ``(u & 0xFFFF) < t``
# for a negative one (larger magnitude bits, smaller value); a bucket without a midpoint
# has ``t = 0xFFFF`` (positive) or 0 (negative), which no value passes.


def _pack_buckets(lo8: Tensor, mid_in: Tensor) -> Tensor:
    """The packed table of host tables ``lo8`` and ``mid_in`` (on the CPU)."""
    b = torch.arange(1 << 16, dtype=torch.int64)
    inside = torch.isfinite(mid_in)
    mbits = mid_in.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    if not bool(((mbits >> 16) == b)[inside].all()):
        raise AssertionError("a bucket's midpoint lies outside the bucket")
    t = torch.where(inside, mbits & 0xFFFF,
                    torch.where(b >= 0x8000, 0, 0xFFFF))
    return ((lo8.to(torch.int64) << 16) | t).to(torch.int32)


class TableQuantizer:
    """Block-wise quantizer equal to ``quantize_blockwise`` for one code map.

    The tables are computed on the host from the code map (a map on a device is copied
    to the host once, here), then placed on ``device`` (default: the code map's) by
    copies that do not wait for the device; :meth:`to` places a built quantizer on
    another device the same way. Quantizing reads nothing back to the host.
    """

    def __init__(self, code: torch.Tensor, device: torch.device | str | None = None) -> None:
        device = code.device if device is None else torch.device(device)
        if isinstance(code, FakeTensor):
            raise ValueError(
                "TableQuantizer needs the code map's values, and a fake tensor (FakeTensorMode) "
                "has none: build the quantizer from a real code map (dynamic_code_map() made "
                "outside the mode) and place it with device=")
        # The tables are constants computed from the code map's values on the host: under
        # FakeTensorMode (a memory estimate on fake CUDA tensors) they are computed on real
        # tensors all the same, and only their placement on ``device`` is faked
        with host_constants():
            self._build(code if code.device.type == "cpu" else code.cpu())
        self._place(device)

    def _build(self, code: torch.Tensor) -> None:
        mid = (code[:-1] + code[1:]) / 2  # (255,) as quantize_blockwise computes them
        bits = torch.arange(1 << 16, dtype=torch.int64) << 16  # first float of each bucket
        first = bits.to(torch.int32).view(torch.float32)
        last = (bits | 0xFFFF).to(torch.int32).view(torch.float32)
        lo_val, hi_val = torch.minimum(first, last), torch.maximum(first, last)
        lo = torch.searchsorted(mid, lo_val)  # midpoints < bucket's smallest float
        hi = torch.searchsorted(mid, hi_val, right=True)  # midpoints <= its largest
        finite = torch.isfinite(lo_val) & torch.isfinite(hi_val)
        self.k = int((hi - lo)[finite].max())
        self.lo = lo.to(torch.int32)  # (65536,)
        pad = torch.full((self.k,), float("inf"))
        self.mid = torch.cat([mid, pad])  # (255 + k,)
        if self.k <= 1:  # one midpoint at most per bucket: the fast path
            inside = finite & (hi > lo)
            mid_in = torch.full((1 << 16,), float("inf"))
            mid_in[inside] = mid[lo[inside]]
            self.mid_in = mid_in  # (65536,) float32, +inf: none inside
            self.lo8 = lo.to(torch.uint8)  # (65536,), lo <= 255
            self.packed = _pack_buckets(self.lo8, self.mid_in)  # (65536,) int32

    _TABLES = ("lo", "mid", "mid_in", "lo8", "packed")

    def _place(self, device: torch.device) -> None:
        for name in self._TABLES:
            if hasattr(self, name):
                setattr(self, name, to_device(getattr(self, name), device, non_blocking=True))

    def to(self, device: torch.device | str) -> TableQuantizer:
        """This quantizer with its tables on ``device`` (itself where they are already there)."""
        device = torch.device(device)
        if self.lo.device == device:
            return self
        other = object.__new__(TableQuantizer)
        other.__dict__.update(self.__dict__)
        other._place(device)
        return other

    def __call__(self, x: torch.Tensor, block_size: int,
                 out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(codes, absmax)`` of 1-D float32 ``x``; codes go into ``out`` (uint8, numel)
        when given."""
        n = x.numel()
        nb = num_blocks(n, block_size)
        pad = nb * block_size - n
        # A NaN / inf element (from a non-finite gradient) would make its whole block's
        # absmax, and so every code of the block, garbage for good. Its parameter element
        # is already non-finite (as torch's AdamW makes it); its moment is stored as 0 and
        # the block's other elements are kept. Every element goes through nan_to_num,
        # which leaves finite values' bits as they are, so no host check of the absmax is
        # needed (no device sync in a step)
        x = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
        blocks = (torch.nn.functional.pad(x, (0, pad)) if pad else x).view(nb, block_size)
        # (nb,) max |x| = max(max x, -min x), exactly, without an |x| temporary; abs_ makes a
        # block of -0.0 give +0.0 as abs().amax() does
        absmax = torch.maximum(blocks.amax(dim=1), blocks.amin(dim=1).neg_()).abs_()
        scale = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
        normed = (blocks / scale[:, None]).reshape(-1)[:n]  # (n,), in [-1, 1]
        bucket = normed.view(torch.int32) >> 16
        bucket &= 0xFFFF  # (n,) int32 in [0, 65536)
        if self.k <= 1:
            codes = torch.index_select(self.lo8, 0, bucket, out=out) if out is not None \
                else self.lo8.index_select(0, bucket)  # (n,) uint8
            codes += self.mid_in.index_select(0, bucket) < normed
            return codes, absmax
        base = self.lo.index_select(0, bucket)  # (n,) int32
        idx = base.clone()
        for j in range(self.k):
            idx += self.mid.index_select(0, base + j) < normed
        if out is None:
            return idx.to(torch.uint8), absmax
        return out.copy_(idx), absmax


@functools.cache
def host_table_quantizers() -> tuple[TableQuantizer, TableQuantizer]:
    """The ``TableQuantizer`` of the signed and of the unsigned dynamic code map, on the
    CPU, built once per process; ``.to(device)`` places them on a device."""
    with host_constants():  # real tables under FakeTensorMode too (see ``TableQuantizer``)
        return TableQuantizer(dynamic_code_map(True)), TableQuantizer(dynamic_code_map(False))


def dequantize_table(codes: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor,
                     bs: int) -> torch.Tensor:
    """``dequantize_blockwise`` (same products, same bits) with an int32 index_select,
    several times faster on the CPU than advanced indexing with int64 indices."""
    n = codes.numel()
    values = code.index_select(0, codes.to(torch.int32))  # (n,)
    full = n // bs * bs
    values[:full].view(-1, bs).mul_(absmax[: n // bs, None])  # in place: same products
    if full < n:
        values[full:].mul_(absmax[-1])
    return values
