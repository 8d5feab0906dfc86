"""The native library: the C++ kernels, built once by torch's extension machinery, and
the fused 8-bit Adam step on the CPU that calls one of them.

The sources are in ``csrc/`` here (``quant8_adam.cpp``: the 8-bit step on plain
pointers; ``quant8_adam_op.cpp``: the torch operator around it; ``bf16_matmul.cpp``:
the bfloat16 products of ``_bf16_matmul.py``), one library built on first use by
``torch.utils.cpp_extension`` (ninja, ``$CXX`` or ``c++``) with ``-march=native`` and
``-fopenmp`` (torch's at::parallel_for threads only with it; each dropped where the
compiler refuses it) and cached on disk (``$XDG_CACHE_HOME`` or ``~/.cache``,
``vefsdp_optim/``) by the hash of the sources, flags, compiler, torch version, CPU and
cache path, so ranks and test processes load it in milliseconds.

Where it cannot be built (no compiler, no ninja, a failed build) the eager path runs,
with the same bits, and the reason is logged once. CUDA tensors take the Triton kernel
(``_quant8_triton.py``) or the eager path; ``_backend.py`` picks the backend
(``VEFSDP_ADAM8BIT_BACKEND``; ``eager``, or ``fused=False`` on the optimizer, turns the
kernels off).

``adam8bit_block_step_`` (``_math/_adam8bit_step.py``) is memory-bound: per element it reads the
parameter, the gradient and two one-byte codes and writes the parameter and the codes (16 bytes),
but the eager form runs ~15 tensor passes with float32 temporaries. The kernel does the whole
step block by block and reads and writes the data once: dequantize both moments through the
256-value code maps, the Adam / AdamW update with the block's absmax in registers, and the
requantization through the packed bucket table (see ``_pack_buckets`` in
vefsdp_optim/_math/_quant8.py; ``QPlan`` and the AVX2 ``qvec`` in ``quant8_adam.cpp``), one block
behind the update so that the two overlap (``run_blocks`` there), in a cache-resident scratch of
~4 * block_size floats. Runs of whole blocks go to torch's intra-op threads
(``adam8bit_steps_cpu`` in ``quant8_adam_op.cpp``), the same bits at any count.

The kernel computes exactly the float32 operations that the eager path runs as torch
ops (see vefsdp_optim/_math/_adam8bit_step.py), each one correctly rounded IEEE
add, sub, mul, div or sqrt, compiled with ``-ffp-contract=off`` and without fast-math:
a vectorized and a scalar loop give the same bits, and so do the kernel and the eager
fallback. Blocks never interact, so a run of whole blocks gives the bits of that part
of the whole-tensor step at any world size. ``tests/test_adam8bit_fused.py`` checks
both. Why a C++ kernel and not torch.compile, its lookups and what was tried and
dropped: docs/decisions.md; its speed: benchmarks/REPORT.md (``adam8bit``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["fused_kernel", "fused_unavailable_reason", "native_ops", "run_fused_steps_"]

logger = logging.getLogger(__name__)

_CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
_SOURCES = ("quant8_adam.cpp", "quant8_adam_op.cpp", "bf16_matmul.cpp")  # one library
_HEADERS = ("quant8_adam.h",)

# -ffp-contract=off and no fast-math keep every op one correctly rounded IEEE op, so the
# instruction set chosen by -march=native changes the speed, never the bits
_FLAGS = ["-O3", "-funroll-loops", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math"]
_NATIVE = "-march=native"  # dropped if the compiler refuses it
#: at::parallel_for's threads (see ``adam8bit_steps_cpu`` in csrc/quant8_adam_op.cpp); dropped if
#: refused
_OPENMP = "-fopenmp"

_lock = threading.Lock()
_kernel: Any = None  # the library's operators (torch.ops.<build name>) once built
_reason: str | None = None  # why the kernel is unavailable, once a build was tried
_tried = False


def _compiler() -> str | None:
    """The C++ compiler cpp_extension will run: ``$CXX``, else ``c++``, ``g++``, ``clang++``."""
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _ninja_dir() -> str | None:
    """A directory holding ``ninja`` (cpp_extension runs it from PATH): PATH's own, or
    the pip package's, which a venv's python run by its path does not put on PATH."""
    if shutil.which("ninja"):
        return None
    try:
        import ninja
    except ImportError:
        raise RuntimeError("ninja not found (pip install ninja)") from None
    return ninja.BIN_DIR


def _cpu_id() -> str:
    """The CPU's model and feature flags (the cache key: a -march=native build must not be
    loaded on another CPU sharing the cache directory)."""
    try:
        with open("/proc/cpuinfo") as f:
            return "".join(sorted({ln for ln in f
                                   if ln.startswith(("model name", "flags", "Features"))}))
    except OSError:
        import platform

        return platform.processor() + platform.machine()


def _cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "vefsdp_optim")


def _compile(name: str, flags: list[str], build_dir: str, cxx: str) -> None:
    """Build and load ``name`` from the sources in ``build_dir`` (cpp_extension, ninja)."""
    from torch.utils import cpp_extension

    saved = {k: os.environ.get(k) for k in ("PATH", "CXX")}
    ninja_dir = _ninja_dir()
    if ninja_dir is not None:
        os.environ["PATH"] = ninja_dir + os.pathsep + os.environ.get("PATH", "")
    os.environ["CXX"] = cxx  # cpp_extension runs $CXX, else c++
    try:
        cpp_extension.load(name, [os.path.join(_CSRC, f) for f in _SOURCES], extra_cflags=flags,
                           extra_ldflags=[f for f in flags if f == _OPENMP],
                           extra_include_paths=[_CSRC], build_directory=build_dir,
                           is_python_module=False, verbose=False)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _build() -> Any:
    """Build (or load from the on-disk cache) the library; returns its operators'
    namespace (``adam8bit_steps_``, and ``bf16_addmm_out_`` / ``bf16_mm_nt_out_`` of
    _bf16_matmul.py)."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found ($CXX, c++, g++, clang++)")
    ver = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    source = b"".join(open(os.path.join(_CSRC, f), "rb").read() for f in _SOURCES + _HEADERS)
    cache = _cache_dir()
    try:
        os.makedirs(cache, exist_ok=True)
    except OSError:  # an unwritable home: build in this process's temporary directory
        cache = tempfile.mkdtemp(prefix="vefsdp_optim_")
    err = None
    for variant in ((_NATIVE, _OPENMP), (_OPENMP,), (_NATIVE,), ()):  # the first that builds
        flags = [*variant, *_FLAGS]
        # the name is the operator's namespace: unique per sources, flags, compiler, CPU,
        # torch and cache path, so two builds (native, portable) load side by side
        key = hashlib.sha256("\0".join([source.hex(), " ".join(flags), ver, _cpu_id(), sys.platform,
                                        torch.__version__, cache]).encode()).hexdigest()[:16]
        name = f"adam8bit_{key}"
        path = os.path.join(cache, f"{name}.so")
        if os.path.exists(path):
            torch.ops.load_library(path)
            return getattr(torch.ops, name)
        # each process builds in its own directory and renames the result into place
        # (atomic), so ranks racing for a cold cache never load a half-written library
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            try:
                _compile(name, flags, tmp, cxx)
            # retried without -march=native / OpenMP, then raised
            except Exception as e:  # noqa: BLE001
                err = e
                continue
            os.replace(os.path.join(tmp, f"{name}.so"), path)
        return getattr(torch.ops, name)
    raise RuntimeError(f"{cxx} failed: {str(err).strip()[-500:]}") from err


def fused_kernel() -> Any:
    """The built kernel (a torch operator), or None (then ``fused_unavailable_reason()``
    says why). Builds on the first call; never raises."""
    ops = native_ops()
    return None if ops is None else ops.adam8bit_steps_


def native_ops() -> Any:
    """The built library's operators (``torch.ops.<build name>``), or None (then
    ``fused_unavailable_reason()`` says why). Builds on the first call; never raises."""
    global _kernel, _reason, _tried
    if _tried:
        return _kernel
    with _lock:
        if not _tried:
            try:
                _kernel = _build()
            except Exception as e:  # noqa: BLE001 - any failure means: use the eager path
                _reason = f"fused 8-bit Adam kernel unavailable ({type(e).__name__}: {e}); " \
                          "using the eager path (same bits); also torch's own bfloat16 CPU matmuls"
                logger.warning(_reason)
            _tried = True
    return _kernel


def fused_unavailable_reason() -> str | None:
    """Why the kernel cannot be used (None if it can or was never tried)."""
    return _reason


def run_fused_steps_(
    p: Sequence[Tensor], g: Sequence[Tensor], mc: Sequence[Tensor], ma: Sequence[Tensor],
    vc: Sequence[Tensor], va: Sequence[Tensor], hp: Sequence[tuple[float, ...]],
    flags: Sequence[int], block_size: int, tables: tuple[Tensor, ...],
) -> None:
    """Run the kernel in place on lists of contiguous CPU tensors, one entry per tensor (see
    ``adam8bit_steps_cpu`` in vefsdp_optim/_kernels/csrc/quant8_adam_op.cpp): ``p``, ``g``
    float32 (n,), ``mc``, ``vc`` uint8 (n,), ``ma``, ``va`` float32 (ceil(n / block_size),);
    ``hp``: each tensor's ``adam8bit_hparams``; ``flags``: each tensor's bits (1 maximize, 2
    weight decay, 4 decoupled); ``tables``: the signed code, the unsigned code, and the
    ``packed`` tables of their ``TableQuantizer``. The caller checks them, and that
    ``fused_kernel()`` is not None (the operator checks them again)."""
    op = fused_kernel()
    if op is None:
        raise AssertionError(f"run_fused_steps_ called without a kernel: {_reason}")
    op(list(p), list(g), list(mc), list(ma), list(vc), list(va), block_size,
       [c for h in hp for c in h], list(flags), *tables)
