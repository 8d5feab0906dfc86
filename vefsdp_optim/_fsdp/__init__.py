"""fully_shard on RaggedShard: FSDP2's API with structure-aware sharded parameters."""

from vefsdp_optim._flat_store import ReplanReport

from ._fully_shard import FSDPModule, fully_shard, replaced_by_fully_shard
from ._sharded_tensor import ShardedParameter

__all__ = ["fully_shard", "FSDPModule", "ShardedParameter", "ReplanReport",
           "replaced_by_fully_shard"]
