"""vefsdp-optim: structure-aware sharded optimizers on RaggedShard FSDP.

Drop-in replacements for ``torch.optim`` optimizers that work on plain tensors,
FSDP2 DTensors and this library's own sharded parameters, and give the result of a
single device at any world size.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Importing a submodule runs this file first, so it imports nothing of the library
# itself. Each public name is loaded from the module _LAZY gives for it the first time it
# is asked for (PEP 562 ``__getattr__``, as torch does for its heavy submodules), then
# cached in this module's globals. So ``vefsdp_optim.sharding``, ``vefsdp_optim.comm``
# and ``vefsdp_optim._math`` import without fully_shard, the checkpoints or any
# optimizer, and each layer can be used and tested alone (tests/test_lazy_import.py
# checks sys.modules in a fresh interpreter). The ``TYPE_CHECKING`` block below names
# the same objects for type checkers and IDEs, which do not run ``__getattr__``; the test
# checks that it, _LAZY and ``__all__`` agree. Built-in optimizers register their names
# when their module is imported; _registry.py imports them on the first lookup
# (see ``_BUILTINS`` in vefsdp_optim/_registry.py).

if TYPE_CHECKING:
    from ._adam8bit import Adam8bit, AdamW8bit
    from ._adamw import AdamW
    from ._block_optimizer import BlockContext, BlockOptimizer
    from ._checkpoint import (
        ELEMENTWISE,
        LOCAL,
        REPLICATED,
        WHOLE,
        export_full,
        import_full,
        load,
        save,
    )
    from ._flat_store import ReplanReport, apply_requirements
    from ._fsdp import ShardedParameter, fully_shard
    from ._muon import Muon
    from ._normuon import NorMuon
    from ._param_groups import ParamChoice, muon_param_groups, muon_param_report
    from ._registry import get_optimizer, list_optimizers, register_optimizer
    from ._shampoo import Shampoo
    from ._soap import SOAP
    from ._teardown import exit_rank

# public name -> the module (relative to this package) that defines it
_LAZY: dict[str, str] = {
    "AdamW": "._adamw",
    "AdamW8bit": "._adam8bit",
    "Adam8bit": "._adam8bit",
    "Muon": "._muon",
    "muon_param_groups": "._param_groups",
    "muon_param_report": "._param_groups",
    "ParamChoice": "._param_groups",
    "NorMuon": "._normuon",
    "Shampoo": "._shampoo",
    "SOAP": "._soap",
    "BlockOptimizer": "._block_optimizer",
    "BlockContext": "._block_optimizer",
    "REPLICATED": "._checkpoint",
    "ELEMENTWISE": "._checkpoint",
    "WHOLE": "._checkpoint",
    "LOCAL": "._checkpoint",
    "register_optimizer": "._registry",
    "get_optimizer": "._registry",
    "list_optimizers": "._registry",
    "fully_shard": "._fsdp",
    "ShardedParameter": "._fsdp",
    "apply_requirements": "._flat_store",
    "ReplanReport": "._flat_store",
    "save": "._checkpoint",
    "load": "._checkpoint",
    "export_full": "._checkpoint",
    "import_full": "._checkpoint",
    "exit_rank": "._teardown",
}

__all__ = [
    "AdamW",
    "AdamW8bit",
    "Adam8bit",
    "Muon",
    "NorMuon",
    "muon_param_groups",
    "muon_param_report",
    "ParamChoice",
    "Shampoo",
    "SOAP",
    "BlockOptimizer",
    "BlockContext",
    "REPLICATED",
    "ELEMENTWISE",
    "WHOLE",
    "LOCAL",
    "register_optimizer",
    "get_optimizer",
    "list_optimizers",
    "fully_shard",
    "ShardedParameter",
    "apply_requirements",
    "ReplanReport",
    "save",
    "load",
    "export_full",
    "import_full",
    "exit_rank",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use (the comment at the top)."""
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
