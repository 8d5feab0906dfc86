"""The fused 8-bit Adam step as a Triton kernel (CUDA; on CPU tensors under Triton's
interpreter, ``TRITON_INTERPRET=1``).

[Note: Triton 8-bit step]
The same step as the C++ kernel ([Note: fused 8-bit step] in ``_quant8_fused.py``), in
the same fixed sequence of correctly rounded float32 operations ([Note: 8-bit Adam op
order] in ``_quant8.py``), so the three backends give the same bits:

- a program takes ``ROWS`` whole quantization blocks as a ``(ROWS, BLOCK)`` tile
  (``BLOCK``: the block size rounded up to a power of two, the padding masked off; about
  2048 elements a program, as bitsandbytes' 8-bit kernels take 8 blocks of 256), so
  blocks of 1 or 7 elements do not waste a program each; a block never spans programs;
- dequantize both moments through the 256-value code maps (a gather and one multiply),
  the Adam / AdamW update, a non-finite moment stored as 0 ([Note: non-finite moments]),
  the block's absmax as the max of ``|x|``'s bits (the C++ kernel's), then
  requantization by the packed bucket table ([Note: packed bucket table]), so each code is
  ``searchsorted``'s, as the eager path's;
- every multiply and add stays apart: the kernel is compiled with
  ``enable_fp_fusion=False`` (no contraction into FMA; ptxas runs with ``--fmad=false``);
  division and square root are ``tl.div_rn`` and ``tl.sqrt_rn`` (IEEE round to nearest;
  Triton's ``/`` and ``tl.sqrt`` on fp32 are approximate on NVIDIA GPUs). The interpreter
  runs each op as one numpy float32 op, which is IEEE's too.

Blocks of more than ``MAX_BLOCK`` elements do not fit a tile; ``triton_unavailable_reason``
says so and those tensors take another backend. The kernel is wrapped by ``triton.jit``
on first use, separately for the interpreter and for the GPU (the interpreter is chosen
by ``TRITON_INTERPRET`` when the function is wrapped), so a test can turn it on.
"""

from __future__ import annotations

import threading
from typing import Any

from torch import Tensor

try:  # the kernel's body reads ``tl`` as a global, as Triton requires
    import triton.language as tl
except Exception:  # noqa: BLE001 - reported by triton_unavailable_reason
    tl = None

__all__ = ["MAX_BLOCK", "interpreting", "run_triton_step_", "triton_unavailable_reason"]

MAX_BLOCK = 4096  # largest (power-of-two padded) block one program holds
# elements a program takes at least, as whole blocks, and elements a thread holds: ~4 a
# thread keeps the registers at ~61 (one 256-block a program, 2 warps); the old tile of
# 2048 on 4 warps held 16 a thread, 164 registers and 18% occupancy (Nsight Compute on an
# H100, one 4096 x 3072 tensor: 110 against 143 us)
_TILE = 256
_PER_THREAD = 4
_FLT_MAX = 3.4028234663852886e38
_OFF32_LIMIT = 1 << 30  # tensors below it index in int32 (the grid's padding is < 2**14)

_lock = threading.Lock()
_jitted: dict[bool, Any] = {}  # interpreter or not -> triton.jit of the kernel
_import_error: str | None = None


def interpreting() -> bool:
    """Whether Triton's interpreter runs kernels wrapped now (``TRITON_INTERPRET=1``, read
    as Triton reads it)."""
    triton = _triton()
    if triton is None:
        return False
    return bool(triton.knobs.runtime.interpret)


def _triton() -> Any:
    global _import_error
    try:
        import triton

        return triton
    except Exception as e:  # noqa: BLE001 - any import failure: the backend is unavailable
        _import_error = f"triton is not importable ({type(e).__name__}: {e}); " \
                        "pip install 'vefsdp-optim[triton]'"
        return None


def triton_unavailable_reason(device_type: str, block_size: int) -> str | None:
    """Why the Triton kernel cannot step tensors on ``device_type`` in blocks of
    ``block_size`` (None if it can)."""
    if _triton() is None:
        return _import_error
    if device_type == "cpu" and not interpreting():
        return "the Triton kernel runs on CPU tensors only under Triton's interpreter " \
               "(TRITON_INTERPRET=1)"
    if device_type not in ("cpu", "cuda"):
        return f"the Triton kernel runs on CUDA tensors, got {device_type}"
    if _block(block_size) > MAX_BLOCK:
        return f"the Triton kernel takes block_size <= {MAX_BLOCK}, got {block_size}"
    return None


def _block(block_size: int) -> int:
    return 1 << max(0, block_size - 1).bit_length()  # next power of two


def _adam8bit_step_kernel(p_ptr, g_ptr, mc_ptr, ma_ptr, vc_ptr, va_ptr, scode_ptr, ucode_ptr,
                          stab_ptr, utab_ptr, n, bs, nb, c_wd, wd, w1, beta2, w2, bc2, eps,
                          neg_step, FLT_MAX, MAXIMIZE: tl.constexpr, WD_MODE: tl.constexpr,
                          ROWS: tl.constexpr, BLOCK: tl.constexpr, OFF64: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # (ROWS,) block indices
    cols = tl.arange(0, BLOCK)  # (BLOCK,)
    row_ok = rows < nb
    if OFF64:
        offs = rows.to(tl.int64)[:, None] * bs + cols[None, :]  # (ROWS, BLOCK)
    else:  # n < 2**30: every offset of the grid, padding included, fits int32
        offs = rows[:, None] * bs + cols[None, :]
    mask = row_ok[:, None] & (cols[None, :] < bs) & (offs < n)
    am = tl.load(ma_ptr + rows, mask=row_ok, other=0.0)  # (ROWS,)
    av = tl.load(va_ptr + rows, mask=row_ok, other=0.0)
    mi = tl.load(mc_ptr + offs, mask=mask, other=0).to(tl.int32)
    vi = tl.load(vc_ptr + offs, mask=mask, other=0).to(tl.int32)
    m = tl.load(scode_ptr + mi) * am[:, None]
    v = tl.load(ucode_ptr + vi) * av[:, None]
    gi = tl.load(g_ptr + offs, mask=mask, other=0.0)
    pi = tl.load(p_ptr + offs, mask=mask, other=0.0)
    if MAXIMIZE:
        gi = -gi
    if WD_MODE == 1:  # AdamW: decoupled decay
        pi = pi * c_wd
    elif WD_MODE == 2:  # Adam: L2 term in the gradient
        gi = gi + pi * wd
    m = m + (gi - m) * w1
    v = v * beta2 + (gi * gi) * w2
    denom = tl.div_rn(tl.sqrt_rn(v), bc2) + eps
    tl.store(p_ptr + offs, pi + tl.div_rn(m * neg_step, denom), mask=mask)
    m = tl.where(tl.abs(m) <= FLT_MAX, m, 0.0)  # NaN and inf moments: 0
    v = tl.where(tl.abs(v) <= FLT_MAX, v, 0.0)
    # absmax on the bits: for |x| the uint32 order is the float order (an exact max).
    # tl.reduce with tl.max's own combine function: tl.max is itself a jit function,
    # which the interpreter cannot call when triton was imported without TRITON_INTERPRET
    um = tl.reduce(tl.where(mask, m.to(tl.uint32, bitcast=True) & 0x7FFFFFFF, 0), 1,
                   tl.standard._elementwise_max)
    uv = tl.reduce(tl.where(mask, v.to(tl.uint32, bitcast=True) & 0x7FFFFFFF, 0), 1,
                   tl.standard._elementwise_max)
    amax_m = um.to(tl.float32, bitcast=True)  # (ROWS,)
    amax_v = uv.to(tl.float32, bitcast=True)
    # codes: [Note: packed bucket table]
    u = tl.div_rn(m, tl.where(amax_m > 0.0, amax_m, 1.0)[:, None]).to(tl.uint32, bitcast=True)
    e = tl.load(stab_ptr + (u >> 16).to(tl.int32), mask=mask, other=0).to(tl.uint32, bitcast=True)
    up = tl.where((u >> 31) != 0, (u & 0xFFFF) < (e & 0xFFFF), (u & 0xFFFF) > (e & 0xFFFF))
    tl.store(mc_ptr + offs, ((e >> 16) + up.to(tl.uint32)).to(tl.uint8), mask=mask)
    u = tl.div_rn(v, tl.where(amax_v > 0.0, amax_v, 1.0)[:, None]).to(tl.uint32, bitcast=True)
    e = tl.load(utab_ptr + (u >> 16).to(tl.int32), mask=mask, other=0).to(tl.uint32, bitcast=True)
    up = tl.where((u >> 31) != 0, (u & 0xFFFF) < (e & 0xFFFF), (u & 0xFFFF) > (e & 0xFFFF))
    tl.store(vc_ptr + offs, ((e >> 16) + up.to(tl.uint32)).to(tl.uint8), mask=mask)
    tl.store(ma_ptr + rows, amax_m, mask=row_ok)
    tl.store(va_ptr + rows, amax_v, mask=row_ok)


def _kernel() -> Any:
    mode = interpreting()
    k = _jitted.get(mode)
    if k is None:
        with _lock:
            k = _jitted.get(mode)
            if k is None:
                k = _jitted[mode] = _triton().jit(_adam8bit_step_kernel)
    return k


def launch_config(block_size: int) -> dict[str, int]:
    """The tile of one program: ``ROWS`` blocks of ``BLOCK`` (padded) elements (at least
    ``_TILE`` elements), and its warps (~``_PER_THREAD`` elements a thread, 1 to 8 warps)."""
    block = _block(block_size)
    rows = max(1, _TILE // block)
    warps = min(8, max(1, rows * block // (32 * _PER_THREAD)))
    return dict(ROWS=rows, BLOCK=block, num_warps=warps)


def run_triton_step_(
    p: Tensor, g: Tensor, mc: Tensor, ma: Tensor, vc: Tensor, va: Tensor,
    hp: tuple[float, ...], flags: int, block_size: int, tables: tuple[Tensor, ...],
) -> None:
    """The Triton kernel in place, with ``run_fused_step_``'s arguments (contiguous
    tensors on one device; ``tables`` on that device too). The caller checks that
    ``triton_unavailable_reason`` is None."""
    n = p.numel()
    if n == 0:
        return
    nb = ma.numel()
    cfg = launch_config(block_size)
    c_wd, wd, w1, beta2, w2, bc2, eps, neg_step = hp
    wd_mode = 0 if not flags & 2 else (1 if flags & 4 else 2)
    grid = (-(-nb // cfg["ROWS"]),)
    _kernel()[grid](p, g, mc, ma, vc, va, *tables, n, block_size, nb, c_wd, wd, w1, beta2, w2,
                    bc2, eps, neg_step, _FLT_MAX, MAXIMIZE=bool(flags & 1), WD_MODE=wd_mode,
                    ROWS=cfg["ROWS"], BLOCK=cfg["BLOCK"], OFF64=n >= _OFF32_LIMIT,
                    num_warps=cfg["num_warps"],
                    enable_fp_fusion=False)
