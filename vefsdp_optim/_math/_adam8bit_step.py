"""The 8-bit Adam / AdamW step on block-wise quantized moments (_quant8.py).

``adam8bit_block_step_`` is the whole algorithm of :class:`vefsdp_optim.AdamW8bit` on
one run of whole quantization blocks; ``adam8bit_multi_tensor_step_`` runs it on many
tensors at once, as torch.optim's multi-tensor steps are split: the checks, then one
dispatcher over the kernels (``_kernels/``) and the eager torch ops, which give the same
bits (see the op order in the comment after the imports).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import torch
from torch import Tensor

from .._torch_compat import FakeTensor
from ._quant8 import TableQuantizer, _check_block_size, dequantize_table, num_blocks

__all__ = ["adam8bit_block_step_", "adam8bit_capturable_step_", "adam8bit_device_hparams",
           "adam8bit_hparams",
           "adam8bit_multi_tensor_step_", "select_capturable_backend"]


# The 8-bit step is its own sequence of float32 operations, each one correctly rounded
# IEEE op (no fused multiply-add), so that the eager torch ops below and the fused C
# kernel (see vefsdp_optim/_kernels/_native.py) give the same bits, vectorized or not:
#     g = -g (maximize);  p = p * (1 - lr * wd) (AdamW)  or  g = g + p * wd (Adam)
#     m = m + (g - m) * (1 - beta1)
#     v = v * beta2 + (g * g) * (1 - beta2)
#     p = p + (m * -step_size) / (sqrt(v) / sqrt(bias_correction2) + eps)
# with torch.optim's bias corrections computed in float64 and every coefficient rounded
# once to float32, and sqrt correctly rounded (torch's own float32 sqrt is not, on
# AVX512). torch's own lerp_ / addcmul_ round once per fused multiply-add on the CPU (a
# compiler without fma cannot reproduce them), so this step differs from
# ``adamw_step_`` in the last bit of some elements; it is as close to torch.optim.AdamW
# (tests/test_adam8bit.py) and the same on every rank at every world size.


def adam8bit_hparams(*, step: int, lr: float, beta1: float, beta2: float, eps: float,
                     weight_decay: float) -> tuple[float, ...]:
    """The 8 coefficients of one step, each rounded once to float32, in the fused kernel's
    order: 1 - lr * wd, wd, 1 - beta1, beta2, 1 - beta2, sqrt(bias_correction2), eps,
    -step_size."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be an int >= 1 (the count after this update), got {step!r}")
    t = float(step)  # torch reads the step back from a float tensor
    bc1, bc2 = 1 - beta1**t, 1 - beta2**t
    return struct.unpack("8f", struct.pack("8f", 1 - lr * weight_decay, weight_decay, 1 - beta1,
                                           beta2, 1 - beta2, bc2**0.5, eps, -(lr / bc1)))


def _adam_eager_(p: Tensor, g: Tensor, m: Tensor, v: Tensor, hp: tuple[float, ...], *,
                 maximize: bool, wd_on: bool, decoupled: bool) -> None:
    """The op order of the comment at the top of this file, with torch ops, in place on 1-D float32
    ``p``, ``m``, ``v``."""
    c_wd, wd, w1, beta2, w2, bc2_sqrt, eps, neg_step = hp
    if maximize:
        g = -g
    if wd_on:
        if decoupled:
            p.mul_(c_wd)
        else:
            g = g + p * wd
    d = g - m
    m.add_(d.mul_(w1))
    gg = g * g
    v.mul_(beta2).add_(gg.mul_(w2))
    # torch's vectorized float32 sqrt is not correctly rounded on every CPU (measured on
    # AVX512: ~16% of elements one ulp off); the float64 root rounded to float32 is.
    # CUDA's division by a Python (or CPU) scalar multiplies by its reciprocal, which is
    # not the correctly rounded quotient (measured on an H200: the eager step then left
    # the kernels' bits in 1-24 of 5000 elements); a 0-dim tensor on the device divides.
    # (torch.full, not torch.tensor: a fill on the device, no copy from the host)
    divisor = bc2_sqrt if v.device.type == "cpu" or isinstance(bc2_sqrt, Tensor) else torch.full(
        (), bc2_sqrt, dtype=torch.float32, device=v.device)
    denom = v.double().sqrt_().float().div_(divisor).add_(eps)
    p.add_((m * neg_step).div_(denom))


def adam8bit_block_step_(
    param: Tensor,
    grad: Tensor,
    exp_avg_codes: Tensor,
    exp_avg_absmax: Tensor,
    exp_avg_sq_codes: Tensor,
    exp_avg_sq_absmax: Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    block_size: int,
    signed_code: Tensor,
    unsigned_code: Tensor,
    quantizers: tuple[TableQuantizer, TableQuantizer] | None = None,
    maximize: bool = False,
    fused: bool | None = None,
) -> None:
    """One 8-bit Adam / AdamW step on a run of whole quantization blocks, in place.

    Dequantizes both moments (``exp_avg`` with ``signed_code``, ``exp_avg_sq`` with
    ``unsigned_code``), applies the Adam (``decoupled=False``: L2) or AdamW update in the
    op order of the comment at the top of this file, in float32, updates ``param``, then
    requantizes both moments into the given code and absmax tensors.

    ``param`` and ``grad`` have ``numel`` elements (any shape; a non-float32 ``param``
    is updated through a float32 copy); the codes are uint8 (numel,), the absmax
    float32 (ceil(numel / block_size),). Blocks start at ``param``'s element 0, so
    callers pass slices that start on a block boundary of the full parameter; then
    each slice's result is bit-identical to that part of the whole-tensor result.

    ``fused``: None runs the best kernel available for the tensors' device, or the one
    ``VEFSDP_ADAM8BIT_BACKEND`` forces (``triton``, ``c`` or ``eager``;
    vefsdp_optim/_kernels/_backend.py): the Triton kernel on CUDA (see
    vefsdp_optim/_kernels/_quant8_triton.py), the C++ kernel on the CPU (see
    vefsdp_optim/_kernels/_native.py), the eager torch ops where neither can run; True requires a
    kernel (RuntimeError naming why none can run); False runs the eager ops. All of them give the
    same bits. ``quantizers`` (``TableQuantizer`` of ``signed_code`` and of ``unsigned_code``) lets
    callers build the tables once; they give ``quantize_blockwise``'s codes and ``dequantize_table``
    gives ``dequantize_blockwise``'s values, bit for bit (see ``TableQuantizer`` in
    vefsdp_optim/_math/_quant8.py). Many tensors at once: :func:`adam8bit_multi_tensor_step_`.
    """
    adam8bit_multi_tensor_step_(
        [param], [grad], [(exp_avg_codes, exp_avg_absmax, exp_avg_sq_codes, exp_avg_sq_absmax)],
        steps=[step], lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
        decoupled=decoupled, block_size=block_size, signed_code=signed_code,
        unsigned_code=unsigned_code, quantizers=quantizers, maximize=maximize, fused=fused)


def _flat_float32(t: Tensor) -> Tensor:
    """``t`` as a contiguous 1-D float32 tensor: ``t`` itself where it is one (no view or
    copy: ~4 us a tensor on a CPU, which a step over many small tensors notices)."""
    if t.dim() != 1:
        t = t.reshape(-1)
    if t.dtype != torch.float32:
        t = t.float()
    return t if t.is_contiguous() else t.contiguous()


def adam8bit_multi_tensor_step_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    states: Sequence[Sequence[Tensor]],
    *,
    steps: Sequence[int],
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    block_size: int,
    signed_code: Tensor,
    unsigned_code: Tensor,
    quantizers: tuple[TableQuantizer, TableQuantizer] | None = None,
    maximize: bool = False,
    fused: bool | None = None,
) -> None:
    """:func:`adam8bit_block_step_` on each ``(params[i], grads[i], *states[i])`` with
    ``step=steps[i]`` (``states[i]``: the exp_avg codes and absmax, then the exp_avg_sq
    codes and absmax), the same bits as one call per tensor. The shared arguments are
    checked and the backend chosen once, and on the C++ kernel all tensors go in one
    call (see ``adam8bit_steps_cpu`` in vefsdp_optim/_kernels/csrc/quant8_adam_op.cpp): an
    optimizer's per-tensor overhead is then a few checks."""
    _check_multi_tensor_args(params, grads, states, steps, block_size, fused)
    if quantizers is None:
        quantizers = (TableQuantizer(signed_code), TableQuantizer(unsigned_code))
    hps = _hparams_per_tensor(steps, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                              weight_decay=weight_decay)
    if not params:
        return
    from .._kernels import select_backend

    device_type = _device_type(params, grads, states)
    backend = select_backend(device_type, block_size, max(q.k for q in quantizers), fused)
    p32s = [_flat_float32(param) for param in params]
    if backend != "eager":
        flags = (1 if maximize else 0) | (2 if weight_decay != 0 else 0) | (4 if decoupled else 0)
        _kernel_step_(backend, p32s, grads, states, hps, flags, block_size, signed_code,
                      unsigned_code, quantizers)
    else:
        _eager_step_(p32s, grads, states, hps, block_size, signed_code, unsigned_code, quantizers,
                     maximize=maximize, wd_on=weight_decay != 0, decoupled=decoupled)
    for param, p32 in zip(params, p32s, strict=True):
        if param.dtype != torch.float32 or not param.is_contiguous():  # p32 is a copy
            param.copy_(p32.view(param.shape))


def _check_multi_tensor_args(params: Sequence[Tensor], grads: Sequence[Tensor],
                             states: Sequence[Sequence[Tensor]], steps: Sequence[int],
                             block_size: int, fused: bool | None) -> None:
    """Raise ValueError unless every tensor has one grad, 4 state tensors and one step, of
    matching sizes (the steps themselves: ``adam8bit_hparams``)."""
    n = len(params)
    if len(grads) != n or len(states) != n or len(steps) != n:
        raise ValueError(f"params, grads, states and steps must have one entry per tensor, got "
                         f"{n}, {len(grads)}, {len(states)} and {len(steps)}")
    if fused is not None and not isinstance(fused, bool):
        raise ValueError(f"fused must be None, True or False, got {fused!r}")
    _check_block_size(block_size)
    for param, grad, state in zip(params, grads, states, strict=True):
        if len(state) != 4:
            raise ValueError("each state must hold 4 tensors (exp_avg codes and absmax, exp_avg_sq "
                             f"codes and absmax), got {len(state)}")
        numel = param.numel()
        if grad.numel() != numel:
            raise ValueError(f"grad must have the parameter's {numel} elements, got {grad.numel()}")
        if state[0].numel() != numel or state[2].numel() != numel:
            raise ValueError(
                f"moment codes must have the parameter's {numel} elements, got "
                f"{state[0].numel()} and {state[2].numel()}")
        nb = num_blocks(numel, block_size)
        if state[1].numel() != nb or state[3].numel() != nb:
            raise ValueError(
                f"absmax must have ceil({numel} / {block_size}) = {nb} elements, got "
                f"{state[1].numel()} and {state[3].numel()}")


def _hparams_per_tensor(steps: Sequence[int], **hparams: float) -> list[tuple[float, ...]]:
    """``adam8bit_hparams`` of each tensor's step, computed once per distinct step."""
    by_step: dict[int, tuple[float, ...]] = {}
    for step in steps:
        # adam8bit_hparams rejects bools, floats, < 1
        if type(step) is not int or step not in by_step:
            by_step[step] = adam8bit_hparams(step=step, **hparams)
    return [by_step[step] for step in steps]


def _device_type(params: Sequence[Tensor], grads: Sequence[Tensor],
                 states: Sequence[Sequence[Tensor]]) -> str:
    """"cpu", "cuda", ...; tensors on several devices give "cpu+cuda" (the eager ops)."""
    if all(t.is_cpu for param, grad, state in zip(params, grads, states, strict=True)
           for t in (param, grad, *state)):
        return "cpu"  # the common case without a torch.device per tensor (~1 us each)
    return "+".join(sorted({t.device.type
                            for param, grad, state in zip(params, grads, states, strict=True)
                            for t in (param, grad, *state)}))


def _kernel_step_(backend: str, p32s: list[Tensor], grads: Sequence[Tensor],
                  states: Sequence[Sequence[Tensor]], hps: list[tuple[float, ...]] | Tensor,
                  flags: int, block_size: int, signed_code: Tensor, unsigned_code: Tensor,
                  quantizers: tuple[TableQuantizer, TableQuantizer]) -> None:
    """The step on the C++ or Triton kernel (see vefsdp_optim/_kernels/_backend.py): every tensor in
    one call, on contiguous copies of the states where they are not contiguous. ``hps``: the host
    coefficients of each tensor, or (Triton) their device table (see ``_adam8bit_step_kernel`` in
    vefsdp_optim/_kernels/_quant8_triton.py), one row per tensor, every tensor non-empty."""
    from .._kernels import run_adam8bit_kernel_

    g32s = [_flat_float32(grad) for grad in grads]
    works = [[t if t.is_contiguous() else t.contiguous() for t in state] for state in states]
    tables = (signed_code.contiguous(), unsigned_code.contiguous(), quantizers[0].packed,
              quantizers[1].packed)
    columns = [list(w) for w in zip(*works, strict=True)]
    if isinstance(p32s[0], FakeTensor):
        # fake tensors (FakeTensorMode: a memory estimate) have no memory for a kernel to
        # read or write; the kernel only writes in place, which changes no fake tensor's
        # metadata, so it is not launched: what the step allocates is allocated above
        pass
    elif isinstance(hps, Tensor):
        if backend != "triton":
            raise AssertionError("a device table of coefficients takes the Triton kernel, "
                                 f"got {backend!r}")
        from .._kernels._quant8_triton import run_triton_capturable_steps_

        run_triton_capturable_steps_(p32s, g32s, *columns, hps, flags, block_size, tables)
    else:
        run_adam8bit_kernel_(backend, p32s, g32s, *columns, hps, [flags] * len(p32s), block_size,
                             tables)
    for state, work in zip(states, works, strict=True):
        for t, w in zip(state, work, strict=True):
            if w is not t:  # a contiguous copy
                t.copy_(w)


def _eager_step_(p32s: list[Tensor], grads: Sequence[Tensor], states: Sequence[Sequence[Tensor]],
                 hps: list[tuple[float, ...]], block_size: int, signed_code: Tensor,
                 unsigned_code: Tensor, quantizers: tuple[TableQuantizer, TableQuantizer], *,
                 maximize: bool, wd_on: bool, decoupled: bool) -> None:
    """The step with torch ops, one tensor at a time: dequantize, update, requantize."""
    for p32, grad, state, hp in zip(p32s, grads, states, hps, strict=True):
        codes_m, absmax_m, codes_v, absmax_v = state
        exp_avg = dequantize_table(codes_m, absmax_m, signed_code, block_size)
        exp_avg_sq = dequantize_table(codes_v, absmax_v, unsigned_code, block_size)
        _adam_eager_(p32, grad.reshape(-1).float(), exp_avg, exp_avg_sq, hp, maximize=maximize,
                     wd_on=wd_on, decoupled=decoupled)
        for moment, codes, absmax, quantize in (
                (exp_avg, codes_m, absmax_m, quantizers[0]),
                (exp_avg_sq, codes_v, absmax_v, quantizers[1])):
            absmax.copy_(quantize(moment, block_size, out=codes)[1])


def adam8bit_device_hparams(steps: Tensor, *, lr: float | Tensor, beta1: float, beta2: float,
                            eps: float, weight_decay: float) -> Tensor:
    """``adam8bit_hparams`` of each step count of ``steps`` (float32, 1-D, on the device),
    computed on their device ([Note: capturable steps]): a ``(len(steps), 8)`` float32
    tensor, each coefficient computed in float64 from the float32 ``lr`` (a float is
    first rounded to float32, so a float and a tensor of that value agree) and rounded
    once to float32, as the host computes them; no value is read back."""
    t = steps.double()
    lr64 = (lr.to(device=t.device, dtype=torch.float32) if isinstance(lr, Tensor)
            else torch.full((), lr, dtype=torch.float32, device=t.device)).double()
    bc1 = 1 - torch.pow(beta1, t)
    bc2 = 1 - torch.pow(beta2, t)
    ones = torch.ones_like(t)
    cols = [(1 - lr64 * weight_decay) * ones, ones * weight_decay, ones * (1 - beta1), ones * beta2,
            ones * (1 - beta2), bc2.sqrt(), ones * eps, -(lr64 / bc1)]
    return torch.stack(cols, dim=1).float()


def select_capturable_backend(device_type: str, block_size: int, max_k: int = 1,
                              fused: bool | None = None) -> str:
    """``"triton"`` or ``"eager"`` for a capturable step (see
    ``_adam8bit_step_kernel`` in vefsdp_optim/_kernels/_quant8_triton.py):
    ``select_backend``'s choice (see vefsdp_optim/_kernels/_backend.py), except
    that the C++ kernel, which takes host scalars, is never chosen: where it would
    be (the CPU, or ``VEFSDP_ADAM8BIT_BACKEND=c``) the eager ops run, and
    ``fused=True`` raises RuntimeError naming why."""
    from .._kernels import requested_backend, select_backend

    if fused is False:
        return "eager"
    forced = requested_backend()
    if forced == "c" or (forced is None and device_type != "cuda"):
        if fused:
            why = (f"VEFSDP_ADAM8BIT_BACKEND={forced}" if forced
                   else f"the tensors are on {device_type}")
            raise RuntimeError(
                "fused=True with capturable=True needs the Triton kernel (the C++ "
                f"kernel takes host scalars, which a CUDA graph would keep), but {why}")
        return "eager"
    backend = select_backend(device_type, block_size, max_k, fused)
    if backend not in ("triton", "eager"):
        raise AssertionError(f"select_backend chose {backend!r} for a capturable step on "
                             f"{device_type}")
    return backend


def _stays_put(t: Tensor) -> bool:
    """Whether the kernel steps ``t`` itself (float32, contiguous), not a copy."""
    return t.dtype == torch.float32 and t.is_contiguous()


def adam8bit_capturable_step_(
    params: Sequence[Tensor], grads: Sequence[Tensor], states: Sequence[Sequence[Tensor]], *,
    steps: Sequence[Tensor], lr: float | Tensor, beta1: float, beta2: float, eps: float,
    weight_decay: float,
    decoupled: bool, block_size: int, signed_code: Tensor, unsigned_code: Tensor,
    quantizers: tuple[TableQuantizer, TableQuantizer] | None = None, maximize: bool = False,
    fused: bool | None = None,
) -> None:
    """:func:`adam8bit_multi_tensor_step_` with ``capturable`` ([Note: capturable steps]): ``steps``
    are each tensor's count after this update (float32 0-d tensors on the device), the coefficients
    :func:`adam8bit_device_hparams`, read on the device: by the Triton kernel (one launch for every
    tensor, ``_adam8bit_step_kernel`` in vefsdp_optim/_kernels/_quant8_triton.py) where it runs
    (:func:`select_capturable_backend`: CUDA by default, ``fused`` and ``VEFSDP_ADAM8BIT_BACKEND``
    as for the host-scalar step), else by the eager ops of the op order at the top of this file,
    with them as 0-d device tensors; the same bits either way."""
    if not params:
        return
    _check_multi_tensor_args(params, grads, states, steps, block_size, fused)
    if quantizers is None:
        quantizers = (TableQuantizer(signed_code), TableQuantizer(unsigned_code))
    backend = select_capturable_backend(_device_type(params, grads, states), block_size,
                                        max(q.k for q in quantizers), fused)
    if backend == "triton" and not all(_stays_put(t) for ts in (params, grads) for t in ts):
        # a float32 copy made each step: another address at every eager step than at the
        # capture, so the kernel's address table could not be built before it
        if fused:
            raise ValueError(
                "fused=True with capturable=True needs float32 contiguous parameters and "
                "gradients (the Triton kernel's address table is built before a capture; a copy "
                "made in each step has another address there); use fused=None, which steps these "
                "with the eager ops")
        backend = "eager"
    if backend == "triton":  # the kernel's launch takes the non-empty tensors, one row of hp each
        keep = [i for i, param in enumerate(params) if param.numel()]
        params, grads, states, steps = ([xs[i] for i in keep]
                                        for xs in (params, grads, states, steps))
        if not params:
            return
    table = adam8bit_device_hparams(torch.stack(list(steps)), lr=lr, beta1=beta1, beta2=beta2,
                                    eps=eps, weight_decay=weight_decay)
    p32s = [_flat_float32(param) for param in params]
    if backend == "triton":
        flags = (1 if maximize else 0) | (2 if weight_decay != 0 else 0) | (4 if decoupled else 0)
        _kernel_step_(backend, p32s, grads, states, table, flags, block_size, signed_code,
                      unsigned_code, quantizers)
    else:
        hps = [tuple(row.unbind()) for row in table.unbind()]
        _eager_step_(p32s, grads, states, hps, block_size, signed_code, unsigned_code, quantizers,
                     maximize=maximize, wd_on=weight_decay != 0, decoupled=decoupled)
    for param, p32 in zip(params, p32s, strict=True):
        if param.dtype != torch.float32 or not param.is_contiguous():  # p32 is a copy
            param.copy_(p32.view(param.shape))
