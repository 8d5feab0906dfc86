"""Kernels: the compiled and Triton code behind a few of ``_math``'s functions, and the
choice of which one runs. Each kernel gives the bits of the eager torch ops it replaces;
``_math`` holds the definitions and calls the kernels only through this package.

    csrc/              the C++ sources: the 8-bit Adam step (``quant8_adam.cpp``, its
                       torch operator ``quant8_adam_op.cpp``) and bfloat16 matrix
                       products (``bf16_matmul.cpp``), one library
    _native.py         its one build module (torch.utils.cpp_extension, cached on disk;
                       vefsdp_optim/_kernels/_native.py), and the CPU 8-bit step's entry
    _quant8_triton.py  the 8-bit step as a Triton kernel (CUDA, or Triton's interpreter)
    _backend.py        which 8-bit step runs: ``VEFSDP_ADAM8BIT_BACKEND`` (``triton``,
                       ``c``, ``eager``) or the best available (see
                       vefsdp_optim/_kernels/_backend.py)
    _bf16_matmul.py    ``addmm`` / ``mm_nt`` with torch's bits, on the C++ products where
                       they equal torch's here ([Note: fast bfloat16 addmm])

Nothing is built or imported from Triton until a kernel is first wanted; a kernel that
cannot run (no compiler, no triton, another CPU) leaves torch's ops to run, with a
logged reason. This package imports nothing else of ``vefsdp_optim``.
"""

from ._backend import (
    BACKEND_ENV,
    BACKENDS,
    requested_backend,
    run_adam8bit_kernel_,
    select_backend,
)
from ._bf16_matmul import addmm, fast_addmm_available, fast_mm_nt_available, mm_nt
from ._native import fused_kernel, fused_unavailable_reason, native_ops

__all__ = [
    "BACKENDS",
    "BACKEND_ENV",
    "addmm",
    "fast_addmm_available",
    "fast_mm_nt_available",
    "fused_kernel",
    "fused_unavailable_reason",
    "mm_nt",
    "native_ops",
    "requested_backend",
    "run_adam8bit_kernel_",
    "select_backend",
]
