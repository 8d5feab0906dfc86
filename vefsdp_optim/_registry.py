"""Name -> optimizer class registry, for places that take optimizer names."""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Callable
from typing import TypeVar

import torch

__all__ = ["register_optimizer", "get_optimizer", "list_optimizers"]

_REGISTRY: dict[str, type] = {}
T = TypeVar("T", bound=type)

# The built-in optimizers register their names with @register_optimizer when their
# module is imported, and the package imports its modules only when a name is asked
# for (the comment at the top of __init__.py). So a lookup must not depend on which
# optimizer happens to be loaded: _BUILTINS names each built-in's module and class, and
# get_optimizer and list_optimizers import that module before they read _REGISTRY.
# register_optimizer does the same for a built-in's name, unless the class being
# registered is that built-in itself (its module is being imported), so that taking a
# built-in's name still raises without overwrite=True, whatever was imported before.
# tests/test_lazy_import.py checks that the decorators and this table agree.
_BUILTINS: dict[str, tuple[str, str]] = {
    "adamw": ("vefsdp_optim._adamw", "AdamW"),
    "adamw8bit": ("vefsdp_optim._adam8bit", "AdamW8bit"),
    "adam8bit": ("vefsdp_optim._adam8bit", "Adam8bit"),
    "muon": ("vefsdp_optim._muon", "Muon"),
    "normuon": ("vefsdp_optim._normuon", "NorMuon"),
    "shampoo": ("vefsdp_optim._shampoo", "Shampoo"),
    "soap": ("vefsdp_optim._soap", "SOAP"),
}


def _load_builtin(key: str) -> None:
    """Import the module of the built-in optimizer named ``key``, if it is one
    (see ``_BUILTINS``)."""
    if key in _BUILTINS and key not in _REGISTRY:
        importlib.import_module(_BUILTINS[key][0])


def register_optimizer(name: str, cls: type | None = None, *,
                       overwrite: bool = False) -> Callable[[T], T] | type:
    """Register an optimizer class under ``name`` (case-insensitive).

    Use as a decorator (``@register_optimizer("tile_sgd")``) or a call
    (``register_optimizer("tile_sgd", TileSGD)``). Re-registering a name with a
    different class raises ValueError unless ``overwrite=True``; the same definition
    imported again (same qualified name and source file, e.g. a script loaded both as
    ``__main__`` and as a module) replaces the old entry.
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"optimizer name must be a non-empty str, got {name!r}")
    key = name.strip().lower()

    def deco(c: T) -> T:
        if not (isinstance(c, type) and issubclass(c, torch.optim.Optimizer)):
            raise TypeError(f"register_optimizer takes a torch.optim.Optimizer subclass, got {c!r}")
        if _BUILTINS.get(key, (c.__module__, c.__qualname__)) != (c.__module__, c.__qualname__):
            _load_builtin(key)
        old = _REGISTRY.get(key)
        if old is not None and old is not c and not overwrite and not _same_definition(old, c):
            raise ValueError(
                f"optimizer name {name!r} is already registered to "
                f"{old.__module__}.{old.__qualname__}; pass overwrite=True to replace it with "
                f"{c.__module__}.{c.__qualname__}")
        _REGISTRY[key] = c
        return c

    return deco if cls is None else deco(cls)


def _same_definition(a: type, b: type) -> bool:
    """Whether two classes are one source definition imported twice."""
    if a.__qualname__ != b.__qualname__:
        return False
    try:
        fa, fb = inspect.getsourcefile(a), inspect.getsourcefile(b)
    except TypeError:  # built-in or dynamically created
        return False
    return fa is not None and fb is not None and os.path.samefile(fa, fb)


def get_optimizer(name: str) -> type:
    """The class registered as ``name``, or ``"package.module:Class"`` imported."""
    if not isinstance(name, str):
        raise TypeError(f"optimizer name must be a str, got {name!r}")
    key = name.strip().lower()
    _load_builtin(key)
    if key in _REGISTRY:
        return _REGISTRY[key]
    if ":" in name:
        mod, _, attr = name.partition(":")
        try:
            obj = getattr(importlib.import_module(mod), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"cannot import optimizer {name!r}: {e}") from e
        if not (isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer)):
            raise TypeError(f"{name!r} is not a torch.optim.Optimizer subclass: {obj!r}")
        return obj
    raise ValueError(
        f"unknown optimizer {name!r}; registered: {sorted(_REGISTRY)} "
        "(or give 'package.module:Class')")


def list_optimizers() -> list[str]:
    for key in _BUILTINS:
        _load_builtin(key)
    return sorted(_REGISTRY)
