"""The repository's ``benchmarks`` and ``tools`` folders as importable packages, for
tests, without putting the repository root on sys.path (which would expose ``comm``
and ``sharding`` as top-level packages beside the installed ``vefsdp_optim``)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

__all__ = ["ROOT", "register_package"]

ROOT = Path(__file__).resolve().parents[1]


def register_package(name: str) -> None:
    """Import ``ROOT / name`` as the package ``name`` (once; its submodules import
    relative to it)."""
    if name not in {"benchmarks", "tools"}:
        raise ValueError(f"package {name!r}: expected 'benchmarks' or 'tools'")
    if name in sys.modules:
        return
    root = ROOT / name
    spec = importlib.util.spec_from_file_location(
        name, root / "__init__.py", submodule_search_locations=[str(root)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
