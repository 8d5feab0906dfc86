"""The math layer of vefsdp_optim (``vefsdp_optim._math``) without the package's
``__init__``: for ``make gpu-check`` on a machine whose only CUDA torch is older than the
declared range (no package index there to install one), where the FSDP layer cannot
import but the 8-bit kernels, which need nothing of it, can still be checked on the GPU.

Imported (or loaded as a pytest plugin with ``-p benchmarks._math_only``), it registers
an empty ``vefsdp_optim`` package whose submodules load from the checkout; anything
beyond ``vefsdp_optim._math`` then fails to import, so only tests of the math layer can
run under it (gpu_check selects them).
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "vefsdp_optim"


def install() -> None:
    if "vefsdp_optim" in sys.modules:
        return
    pkg = types.ModuleType("vefsdp_optim", "the math layer only (benchmarks/_math_only.py)")
    pkg.__path__ = [str(PACKAGE)]
    pkg.__file__ = str(PACKAGE / "__init__.py")
    sys.modules["vefsdp_optim"] = pkg


install()
