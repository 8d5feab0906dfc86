"""The fused 8-bit Adam step as a Triton kernel (CUDA; on CPU tensors under Triton's
interpreter, ``TRITON_INTERPRET=1``).

The same step as the C++ kernel (see vefsdp_optim/_kernels/_native.py), in
the same fixed sequence of correctly rounded float32 operations (see
vefsdp_optim/_math/_adam8bit_step.py), so the three backends give the same
bits:

- a program takes ``ROWS`` whole quantization blocks as a ``(ROWS, BLOCK)`` tile
  (``BLOCK``: the block size rounded up to a power of two, the padding masked off; about
  2048 elements a program, as bitsandbytes' 8-bit kernels take 8 blocks of 256), so
  blocks of 1 or 7 elements do not waste a program each; a block never spans programs;
- dequantize both moments through the 256-value code maps (a gather and one multiply),
  the Adam / AdamW update, a non-finite moment stored as 0 (see
  ``TableQuantizer.__call__`` in vefsdp_optim/_math/_quant8.py), the block's absmax as
  the max of ``|x|``'s bits (the C++ kernel's), then requantization by the packed
  bucket table (see ``_pack_buckets`` in vefsdp_optim/_math/_quant8.py), so each code
  is ``searchsorted``'s, as the eager path's;
- every multiply and add stays apart: the kernel is compiled with
  ``enable_fp_fusion=False`` (no contraction into FMA; ptxas runs with ``--fmad=false``);
  division and square root are ``tl.div_rn`` and ``tl.sqrt_rn`` (IEEE round to nearest;
  Triton's ``/`` and ``tl.sqrt`` on fp32 are approximate on NVIDIA GPUs). The interpreter
  runs each op as one numpy float32 op, which is IEEE's too.

``run_triton_steps_`` steps a list of tensors in one launch, as the C++ operator takes
them in one call (``adam8bit_steps_cpu`` in ``csrc/quant8_adam_op.cpp``): on a GPU a
launch costs host time and an idle tail (figures in docs/decisions.md), which a bucket
of many small tensors would pay once each. The blocks of all the tensors are numbered
one after the other; program ``j`` takes joint blocks ``[j * ROWS, (j + 1) * ROWS)``,
and each row finds its tensor by a binary search (``LOG_T`` steps) in the table of first
joint blocks, then its tensors' addresses in a table of ``data_ptr``s (6 x T int64, cast
to pointers). A tile may hold the last blocks of one tensor and the first of the next;
each block is still its own tensor's, with its tensor's numel masking the tail, so the
bits are those of one launch per tensor. The scalars (the step's ``hp``, the flags) are
the launch's: tensors with different step counts take one launch each (the capturable
launch reads each tensor's coefficients from a device table, see
``_adam8bit_step_kernel``). The tables live on the tensors' device, built once per list
of addresses and numels (a small cache, the oldest dropped) and copied from pinned
memory without a host sync (the pinned copy kept with them, which a copy captured in a
CUDA graph reads at each replay); a steady-state step, whose tensors keep their storage,
reuses them and copies nothing.

Blocks of more than ``MAX_BLOCK`` elements do not fit a tile; ``triton_unavailable_reason``
says so and those tensors take another backend. The kernel is wrapped by ``triton.jit``
on first use, separately for the interpreter and for the GPU (the interpreter is chosen
by ``TRITON_INTERPRET`` when the function is wrapped), so a test can turn it on.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from vefsdp_optim._math._batch_probe import stream_capturing

try:  # the kernel's body reads ``tl`` as a global, as Triton requires
    import triton.language as tl
except Exception:  # noqa: BLE001 - reported by triton_unavailable_reason
    tl = None

__all__ = ["MAX_BLOCK", "interpreting", "run_triton_capturable_steps_", "run_triton_steps_",
           "triton_unavailable_reason"]

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
_tables: dict[tuple, tuple[Tensor, Tensor, Tensor, int, Tensor]] = {}  # _tensor_table's, by key
_MAX_TABLES = 64  # the oldest dropped beyond it
# the tables a CUDA graph capture read: a graph replays their addresses, so never dropped
_captured: dict[tuple, tuple[Tensor, Tensor, Tensor, int, Tensor]] = {}
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


# A capturable step ([Note: capturable steps]) keeps each tensor's step count on the
# device, so its 8 coefficients are computed there (``adam8bit_device_hparams``: an
# (n, 8) float32 table, one row per tensor) and a CUDA graph replays them fresh; host
# scalars in the launch would be frozen at capture. With ``HP_ON_DEVICE`` each row of the
# tile loads its tensor's row of that table (its ``t``, found by the search) in place of
# the scalar arguments (then unused), and the step runs the same float32 ops in the same
# order on the same values: the bits of the host-scalar launch given the same float32
# coefficients, and of the eager capturable step given the same table. As the
# coefficients are per tensor, every tensor of one (flags) group takes one launch
# whatever its step count.
#
# A row's addresses and numel are loaded from the tables, so the compiler knows nothing of
# their alignment and steps each element alone with scalar loads and stores, where a
# tensor's own launch, whose arguments Triton specializes, vectorizes (figures in
# docs/decisions.md). Where every address of the launch is a multiple of 16 bytes, every
# numel of 16 elements (checked on the host when the table is built) and the block size
# of 16, every block starts 16-byte aligned and its mask is constant over runs of 16
# elements: ``ALIGNED`` says so to the compiler (``tl.multiple_of`` /
# ``tl.max_contiguous`` on the addresses), and the loads and stores of whole rows
# vectorize (tests/test_adam8bit_triton.py reads the PTX). The arithmetic, so the bits,
# are the same either way.
def _adam8bit_step_kernel(ptrs, starts, numels, scode_ptr, ucode_ptr, stab_ptr, utab_ptr, hp_ptr, T,
                          nb, bs, c_wd, wd, w1, beta2, w2, bc2, eps, neg_step, FLT_MAX,
                          MAXIMIZE: tl.constexpr, WD_MODE: tl.constexpr, ROWS: tl.constexpr,
                          BLOCK: tl.constexpr, OFF64: tl.constexpr, LOG_T: tl.constexpr,
                          ALIGNED: tl.constexpr, HP_ON_DEVICE: tl.constexpr):
    # one launch for many tensors (module docstring): ``rows`` are block numbers over all the
    # tensors
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # (ROWS,) joint block numbers
    row_ok = rows < nb
    t = rows * 0  # each row's tensor (not tl.zeros_like: a jit function, see below)
    for i in tl.static_range(LOG_T):
        cand = t + (1 << (LOG_T - 1 - i))
        take = (cand < T) & (tl.load(starts + cand, mask=cand < T, other=0) <= rows)
        t = tl.where(take, cand, t)
    n = tl.load(numels + t)  # (ROWS,) int64: the row's tensor's elements
    if HP_ON_DEVICE:  # the comment above this kernel: each row its tensor's 8, as (ROWS, 1)
        hrow = hp_ptr + t * 8
        c_wd = tl.load(hrow)[:, None]
        wd = tl.load(hrow + 1)[:, None]
        w1 = tl.load(hrow + 2)[:, None]
        beta2 = tl.load(hrow + 3)[:, None]
        w2 = tl.load(hrow + 4)[:, None]
        # div_rn does not broadcast
        bc2 = tl.broadcast_to(tl.load(hrow + 5)[:, None], (ROWS, BLOCK))
        eps = tl.load(hrow + 6)[:, None]
        neg_step = tl.load(hrow + 7)[:, None]
    rows = rows - tl.load(starts + t)  # block index within its tensor
    p_ptr = tl.load(ptrs + t)  # (ROWS,) each row's tensors' addresses
    g_ptr = tl.load(ptrs + T + t)
    mc_ptr = tl.load(ptrs + 2 * T + t)
    vc_ptr = tl.load(ptrs + 4 * T + t)
    if ALIGNED:  # the comment above this kernel
        n = tl.multiple_of(n, 16)
        p_ptr = tl.multiple_of(p_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
        mc_ptr = tl.multiple_of(mc_ptr, 16)
        vc_ptr = tl.multiple_of(vc_ptr, 16)
    p_ptr = p_ptr.to(tl.pointer_type(tl.float32))
    g_ptr = g_ptr.to(tl.pointer_type(tl.float32))
    mc_ptr = mc_ptr.to(tl.pointer_type(tl.uint8))
    ma_ptr = tl.load(ptrs + 3 * T + t).to(tl.pointer_type(tl.float32))
    vc_ptr = vc_ptr.to(tl.pointer_type(tl.uint8))
    va_ptr = tl.load(ptrs + 5 * T + t).to(tl.pointer_type(tl.float32))
    cols = tl.arange(0, BLOCK)  # (BLOCK,)
    if OFF64:
        offs = rows.to(tl.int64)[:, None] * bs + cols[None, :]  # (ROWS, BLOCK)
    else:  # every tensor has < 2**30 elements: every offset of the grid fits int32
        offs = rows.to(tl.int32)[:, None] * bs + cols[None, :]
    mask = row_ok[:, None] & (cols[None, :] < bs) & (offs < n[:, None])
    p_ptr = p_ptr[:, None] + offs  # (ROWS, BLOCK) addresses
    g_ptr = g_ptr[:, None] + offs
    mc_ptr = mc_ptr[:, None] + offs
    vc_ptr = vc_ptr[:, None] + offs
    if ALIGNED:
        p_ptr = tl.max_contiguous(tl.multiple_of(p_ptr, [1, 16]), [1, 16])
        g_ptr = tl.max_contiguous(tl.multiple_of(g_ptr, [1, 16]), [1, 16])
        mc_ptr = tl.max_contiguous(tl.multiple_of(mc_ptr, [1, 16]), [1, 16])
        vc_ptr = tl.max_contiguous(tl.multiple_of(vc_ptr, [1, 16]), [1, 16])
    ma_ptr = ma_ptr + rows  # (ROWS,)
    va_ptr = va_ptr + rows
    am = tl.load(ma_ptr, mask=row_ok, other=0.0)  # (ROWS,)
    av = tl.load(va_ptr, mask=row_ok, other=0.0)
    mi = tl.load(mc_ptr, mask=mask, other=0).to(tl.int32)
    vi = tl.load(vc_ptr, mask=mask, other=0).to(tl.int32)
    m = tl.load(scode_ptr + mi) * am[:, None]
    v = tl.load(ucode_ptr + vi) * av[:, None]
    gi = tl.load(g_ptr, mask=mask, other=0.0)
    pi = tl.load(p_ptr, mask=mask, other=0.0)
    if MAXIMIZE:
        gi = -gi
    if WD_MODE == 1:  # AdamW: decoupled decay
        pi = pi * c_wd
    elif WD_MODE == 2:  # Adam: L2 term in the gradient
        gi = gi + pi * wd
    m = m + (gi - m) * w1
    v = v * beta2 + (gi * gi) * w2
    denom = tl.div_rn(tl.sqrt_rn(v), bc2) + eps
    tl.store(p_ptr, pi + tl.div_rn(m * neg_step, denom), mask=mask)
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
    # codes: ``_pack_buckets`` in vefsdp_optim/_math/_quant8.py
    u = tl.div_rn(m, tl.where(amax_m > 0.0, amax_m, 1.0)[:, None]).to(tl.uint32, bitcast=True)
    e = tl.load(stab_ptr + (u >> 16).to(tl.int32), mask=mask, other=0).to(tl.uint32, bitcast=True)
    up = tl.where((u >> 31) != 0, (u & 0xFFFF) < (e & 0xFFFF), (u & 0xFFFF) > (e & 0xFFFF))
    tl.store(mc_ptr, ((e >> 16) + up.to(tl.uint32)).to(tl.uint8), mask=mask)
    u = tl.div_rn(v, tl.where(amax_v > 0.0, amax_v, 1.0)[:, None]).to(tl.uint32, bitcast=True)
    e = tl.load(utab_ptr + (u >> 16).to(tl.int32), mask=mask, other=0).to(tl.uint32, bitcast=True)
    up = tl.where((u >> 31) != 0, (u & 0xFFFF) < (e & 0xFFFF), (u & 0xFFFF) > (e & 0xFFFF))
    tl.store(vc_ptr, ((e >> 16) + up.to(tl.uint32)).to(tl.uint8), mask=mask)
    tl.store(ma_ptr, amax_m, mask=row_ok)
    tl.store(va_ptr, amax_v, mask=row_ok)


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


def run_triton_steps_(
    p: Sequence[Tensor], g: Sequence[Tensor], mc: Sequence[Tensor], ma: Sequence[Tensor],
    vc: Sequence[Tensor], va: Sequence[Tensor], hp: Sequence[tuple[float, ...]],
    flags: Sequence[int], block_size: int, tables: tuple[Tensor, ...],
) -> None:
    """The Triton kernel in place, with ``run_fused_steps_``'s arguments (lists of
    contiguous tensors on one device; ``tables`` on that device too): one launch for all
    the tensors of one ``(hp, flags)`` (see the module docstring), so one a
    bucket where its tensors share their step. The caller checks that
    ``triton_unavailable_reason`` is None."""
    runs: dict[tuple[tuple[float, ...], int], list[int]] = {}
    for i, (h, f) in enumerate(zip(hp, flags, strict=True)):
        if p[i].numel():
            runs.setdefault((tuple(h), f), []).append(i)
    for (h, f), idx in runs.items():
        _launch([(p[i], g[i], mc[i], ma[i], vc[i], va[i]) for i in idx], h, tables[0], f,
                block_size, tables, on_device=False)


def run_triton_capturable_steps_(
    p: Sequence[Tensor], g: Sequence[Tensor], mc: Sequence[Tensor], ma: Sequence[Tensor],
    vc: Sequence[Tensor], va: Sequence[Tensor], hp: Tensor, flags: int, block_size: int,
    tables: tuple[Tensor, ...],
) -> None:
    """:func:`run_triton_steps_` with the coefficients on the device (see
    ``_adam8bit_step_kernel``): ``hp`` a contiguous ``(len(p), 8)`` float32 tensor on the
    tensors' device (``adam8bit_device_hparams``'s rows, one per tensor), ``flags`` those
    of every tensor, every tensor non-empty. One launch for all of them, whatever their
    steps; no value is read back, and after the first call with these tensors no host
    tensor goes in (the address tables are cached)."""
    if hp.dtype != torch.float32 or tuple(hp.shape) != (len(p), 8) or not hp.is_contiguous():
        raise ValueError(f"hp must be a contiguous ({len(p)}, 8) float32 tensor, got {hp.dtype} "
                         f"{tuple(hp.shape)}")
    if not p:
        return
    if any(t.numel() == 0 for t in p):
        raise ValueError("run_triton_capturable_steps_ takes non-empty tensors (their rows of "
                         f"hp), got numels {[t.numel() for t in p]}")
    _launch(list(zip(p, g, mc, ma, vc, va, strict=True)), (0.0,) * 8, hp, flags, block_size, tables,
            on_device=True)


def _launch(tensors: list[tuple[Tensor, ...]], h: tuple[float, ...], hp: Tensor, flags: int,
            block_size: int, tables: tuple[Tensor, ...], *, on_device: bool) -> None:
    """One launch of the kernel over ``tensors`` (each ``(p, g, mc, ma, vc, va)``, non-empty)
    with the coefficients ``h`` (host floats) or, ``on_device``, the rows of ``hp``."""
    cfg = launch_config(block_size)
    ptrs, starts, numels, nb, big, aligned = _tensor_table(tensors)
    c_wd, wd, w1, beta2, w2, bc2, eps, neg_step = h
    wd_mode = 0 if not flags & 2 else (1 if flags & 4 else 2)
    grid = (-(-nb // cfg["ROWS"]),)
    t = len(tensors)
    _kernel()[grid](ptrs, starts, numels, *tables, hp, t, nb, block_size, c_wd, wd, w1, beta2,
                    w2, bc2, eps, neg_step, _FLT_MAX, MAXIMIZE=bool(flags & 1), WD_MODE=wd_mode,
                    ROWS=cfg["ROWS"], BLOCK=cfg["BLOCK"], OFF64=big,
                    LOG_T=max(1, (t - 1).bit_length()), ALIGNED=aligned and block_size % 16 == 0,
                    HP_ON_DEVICE=on_device, num_warps=cfg["num_warps"], enable_fp_fusion=False)


def _tensor_table(tensors: list[tuple[Tensor, ...]]) -> tuple[Tensor, Tensor, Tensor, int, bool,
                                                              bool]:
    """The device tables of one launch (see the module docstring): the addresses (6 * T
    int64: every p, then every g, mc, ma, vc, va), the first joint block of each tensor (T
    + 1 int64, the total last), the numels (T int64); the total block count, whether some
    tensor needs int64 offsets, and whether the launch is aligned (the comment above
    ``_adam8bit_step_kernel``). Cached by the addresses and numels, so a steady-state step
    copies nothing to the device; a table a CUDA graph capture reads is kept for good (the
    graph replays its address), and one missing at a capture is a RuntimeError."""
    numel = [ts[0].numel() for ts in tensors]
    addresses = [t.data_ptr() for col in zip(*tensors, strict=True) for t in col]
    key = (tensors[0][0].device, *addresses, *numel, *(ts[3].numel() for ts in tensors))
    big = max(numel) >= _OFF32_LIMIT
    aligned = all(a % 16 == 0 for a in addresses) and all(n % 16 == 0 for n in numel)
    device = tensors[0][0].device
    capturing = stream_capturing(device)
    hit = _captured.get(key) or _tables.get(key)
    if hit is not None:
        if capturing:  # a graph reads this table at every replay: keep it
            with _lock:
                _captured[key] = hit
        return (*hit[:4], big, aligned)
    if capturing:
        raise RuntimeError(
            "the 8-bit Adam step's table of tensor addresses was not built before this CUDA graph "
            "capture: capture the step after eager warm-up steps on the same "
            "parameters, states and .grad tensors (a graph replays fixed addresses; the table is "
            "built on the host)")
    starts = [0]
    for ts in tensors:
        starts.append(starts[-1] + ts[3].numel())
    host = torch.tensor(addresses + starts + numel, dtype=torch.int64)
    table = host
    if device.type != "cpu":  # pinned: an asynchronous copy, no host sync
        host = host.pin_memory()  # kept with the entry: a captured graph's copy reads it again
        table = host.to(device, non_blocking=True)
    t = len(tensors)
    entry = (table[:6 * t], table[6 * t:7 * t + 1], table[7 * t + 1:], starts[-1], host)
    with _lock:
        if len(_tables) >= _MAX_TABLES:
            _tables.pop(next(iter(_tables)))
        _tables[key] = entry
    return (*entry[:4], big, aligned)
