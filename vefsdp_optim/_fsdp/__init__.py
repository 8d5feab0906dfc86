"""fully_shard on RaggedShard: FSDP2's API with structure-aware sharded parameters."""

from ._fully_shard import FSDPModule, fully_shard
from ._replan import ReplanReport, request_requirements
from ._sharded_tensor import ShardedParameter

__all__ = ["fully_shard", "FSDPModule", "ShardedParameter", "ReplanReport", "request_requirements"]
