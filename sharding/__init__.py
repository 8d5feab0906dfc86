"""Pure, communication-free sharding core: requirements, RaggedShard, planner.

Nothing here talks to other ranks: a plan is a deterministic function of its inputs,
so every rank computes the same one on its own.
"""

from ._box import Box, BoxShard
from ._planner import BufferPlan, TensorSpec, fsdp2_row_padding, padding_lower_bound, plan_buffer
from ._ragged import RaggedShard
from ._requirement import (
    Elementwise,
    FlatBlocks,
    Requirement,
    RowBlocks,
    WholeTensor,
    is_legal_cut,
)

__all__ = [
    "Requirement",
    "Elementwise",
    "RowBlocks",
    "FlatBlocks",
    "WholeTensor",
    "is_legal_cut",
    "RaggedShard",
    "BoxShard",
    "Box",
    "TensorSpec",
    "BufferPlan",
    "plan_buffer",
    "padding_lower_bound",
    "fsdp2_row_padding",
]
