"""vefsdp-optim: structure-aware sharded optimizers on RaggedShard FSDP.

Drop-in replacements for ``torch.optim`` optimizers that work on plain tensors,
FSDP2 DTensors and this library's own sharded parameters, and give the result of a
single device at any world size.
"""

from ._adam8bit import Adam8bit, AdamW8bit
from ._adamw import AdamW
from ._block_optimizer import BlockContext, BlockOptimizer
from ._checkpoint import export_full, import_full, load, save
from ._flat_store import ReplanReport, apply_requirements
from ._fsdp import ShardedParameter, fully_shard
from ._muon import Muon
from ._normuon import NorMuon
from ._registry import get_optimizer, list_optimizers, register_optimizer
from ._shampoo import Shampoo
from ._soap import SOAP
from ._state_format import ELEMENTWISE, LOCAL, REPLICATED, WHOLE
from ._teardown import exit_rank

__all__ = [
    "AdamW",
    "AdamW8bit",
    "Adam8bit",
    "Muon",
    "NorMuon",
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
