"""Which implementation runs the 8-bit Adam step: the Triton kernel, the C++ kernel or
the eager torch ops. All three give the same bits (see vefsdp_optim/_math/_adam8bit_step.py).

``VEFSDP_ADAM8BIT_BACKEND`` forces one: ``triton`` (see
vefsdp_optim/_kernels/_quant8_triton.py; CUDA tensors, or CPU tensors under
``TRITON_INTERPRET=1``), ``c`` (the C++ kernel, vefsdp_optim/_kernels/_native.py; CPU
tensors) or ``eager``; a forced kernel that cannot run raises, naming why. Unset (or
empty), the best available runs: Triton on CUDA, the C++ kernel on the CPU, else the
eager ops, the choice logged once per device type (a warning with the reasons where a
kernel was wanted and could not run). The optimizer's ``fused`` argument wins over the
environment: ``False`` runs the eager ops, ``True`` requires a kernel (the forced one if
the variable names a kernel, else the best one) and raises where none can run. This
variable is the one switch: an unknown value raises ValueError naming the accepted ones,
at the optimizer's construction and at each step.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

from torch import Tensor

__all__ = ["BACKENDS", "BACKEND_ENV", "requested_backend", "run_adam8bit_kernel_", "select_backend"]

logger = logging.getLogger(__name__)

BACKEND_ENV = "VEFSDP_ADAM8BIT_BACKEND"
BACKENDS = ("triton", "c", "eager")

_logged: set[tuple[str, str]] = set()  # (device type, backend) choices already logged


def requested_backend() -> str | None:
    """The backend ``VEFSDP_ADAM8BIT_BACKEND`` forces, or None (unset or empty)."""
    raw = os.environ.get(BACKEND_ENV, "")
    value = raw.strip().lower()
    if not value:
        return None
    if value not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV} must be one of {', '.join(map(repr, BACKENDS))} "
                         f"(or unset: the best available), got {raw!r}")
    return value


def _unavailable(backend: str, device_type: str, block_size: int, max_k: int) -> str | None:
    """Why ``backend`` cannot step these tensors (None if it can)."""
    if backend == "eager":
        return None
    if max_k > 1:
        return "the fused kernels need code maps with at most one midpoint per bucket"
    if backend == "c":
        if device_type != "cpu":
            return f"the C++ kernel runs on CPU tensors, got {device_type} tensors"
        from ._native import fused_kernel, fused_unavailable_reason

        return None if fused_kernel() is not None else fused_unavailable_reason()
    from ._quant8_triton import triton_unavailable_reason

    return triton_unavailable_reason(device_type, block_size)


def _log_once(device_type: str, backend: str, why: str, level: int = logging.INFO) -> None:
    if (device_type, backend) not in _logged:
        _logged.add((device_type, backend))
        logger.log(level, "8-bit Adam on %s tensors: %s backend (%s)", device_type, backend, why)


def select_backend(device_type: str, block_size: int, max_k: int = 1,
                   fused: bool | None = None) -> str:
    """``"triton"``, ``"c"`` or ``"eager"`` for a step of tensors on ``device_type`` in
    blocks of ``block_size`` with code maps of at most ``max_k`` midpoints per bucket
    (see the module docstring). Raises ValueError for a bad
    ``VEFSDP_ADAM8BIT_BACKEND``, RuntimeError where a required kernel cannot run."""
    if fused is False:
        return "eager"
    forced = requested_backend()
    if fused is None and forced == "eager":
        return "eager"
    if forced in ("triton", "c"):
        why = _unavailable(forced, device_type, block_size, max_k)
        if why is not None:
            raise RuntimeError(f"{BACKEND_ENV}={forced} but {why}")
        _log_once(device_type, forced, f"{BACKEND_ENV}={forced}")
        return forced
    order: Sequence[str] = ("triton", "c") if device_type == "cuda" else ("c",)
    reasons = []
    for backend in order:
        why = _unavailable(backend, device_type, block_size, max_k)
        if why is None:
            _log_once(device_type, backend, "the best available")
            return backend
        reasons.append(f"{backend}: {why}")
    if fused:
        raise RuntimeError(f"fused=True but {'; '.join(reasons)}")
    _log_once(device_type, "eager", "; ".join(reasons), logging.WARNING)
    return "eager"


def run_adam8bit_kernel_(
    backend: str, p: Sequence[Tensor], g: Sequence[Tensor], mc: Sequence[Tensor],
    ma: Sequence[Tensor], vc: Sequence[Tensor], va: Sequence[Tensor],
    hp: Sequence[tuple[float, ...]], flags: Sequence[int], block_size: int,
    tables: tuple[Tensor, ...],
) -> None:
    """The 8-bit Adam step in place on lists of contiguous tensors, by ``backend``
    (``"c"`` or ``"triton"``, as :func:`select_backend` chose): the arguments of
    ``run_fused_steps_`` (``_native.py``) and ``run_triton_steps_`` (``_quant8_triton.py``),
    which are the same. The eager path is ``_math/_adam8bit_step.py``'s own."""
    if backend == "c":
        from . import _native

        _native.run_fused_steps_(p, g, mc, ma, vc, va, hp, flags, block_size, tables)
    elif backend == "triton":
        from . import _quant8_triton

        _quant8_triton.run_triton_steps_(p, g, mc, ma, vc, va, hp, flags, block_size, tables)
    else:
        raise AssertionError(f"run_adam8bit_kernel_ takes backend 'c' or 'triton', got {backend!r}")
