"""Checkpoints: the world-size-free optimizer state and the files that hold it.

- ``_protocol.py``: ``CheckpointedOptimizer``, what the format needs of an optimizer;
- ``_format.py``: what each optimizer state entry is (``checkpoint_spec`` kinds) and
  the world-size-free form of the state (``BlockOptimizer.state_dict`` /
  ``load_state_dict`` delegate to it);
- ``_save_load.py``: ``save`` / ``load``, DCP written aside then renamed, read safely;
- ``_commit.py``: the commit protocol (generations, markers, checksums);
- ``_safe_load.py``: restricted metadata and confined storage on load;
- ``_full_export.py``: ``export_full`` / ``import_full``, one unsharded file.

Depends on ``comm`` and ``sharding`` only (``_fsdp`` inside the functions that build
or read a ``ShardedParameter``), never on an optimizer: it reads and changes one through
``CheckpointedOptimizer``, the protocol ``BlockOptimizer`` implements.
"""

from ._format import (
    CLASS_KEY,
    ELEMENTWISE,
    LOCAL,
    REPLICATED,
    WHOLE,
    export_state,
    load_state,
    validate_state,
)
from ._full_export import export_full, import_full
from ._protocol import CheckpointedOptimizer
from ._save_load import load, save

__all__ = [
    "REPLICATED",
    "ELEMENTWISE",
    "WHOLE",
    "LOCAL",
    "CLASS_KEY",
    "CheckpointedOptimizer",
    "export_state",
    "load_state",
    "validate_state",
    "save",
    "load",
    "export_full",
    "import_full",
]
