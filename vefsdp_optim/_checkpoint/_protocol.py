"""What the checkpoint format needs of an optimizer: :class:`CheckpointedOptimizer`.

A protocol, so ``_checkpoint`` imports no optimizer; ``BlockOptimizer`` implements it,
and tests/test_checkpoint_protocol.py implements it on torch's ``Optimizer`` alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import torch

from vefsdp_optim.comm import ShardedView
from vefsdp_optim.sharding import BoxShard, RaggedShard, Requirement

__all__ = ["CheckpointedOptimizer"]


class CheckpointedOptimizer(Protocol):
    """What this format needs of an optimizer (``BlockOptimizer`` is one): its torch
    ``state`` and ``param_groups``, the declaration of each parameter's state, where
    that state lives, and three actions of a load. Nothing here imports an optimizer."""

    state: Any  # torch.optim.Optimizer.state: parameter -> {key: value}
    param_groups: list[dict[str, Any]]
    structural_keys: tuple[str, ...]  # group keys a checkpoint must agree on
    extra_state_prefixes: tuple[str, ...]  # state keys of export/import_extra_state

    def requirement(self, shape: torch.Size, group: dict[str, Any]) -> Requirement: ...

    def checkpoint_spec(self, shape: torch.Size,
                        group: dict[str, Any]) -> dict[str, str | int] | None: ...

    def checkpoint_layout(self, p: torch.Tensor, view: ShardedView,
                          group: dict[str, Any]) -> RaggedShard | BoxShard | None:
        """Where ``p``'s state lives: a layout of its elements, or None for the state of a
        whole-tensor requirement, kept whole by the rank that computes it."""

    def export_extra_state(self, state: dict[str, Any], view: ShardedView, layout: Any,
                           group: dict[str, Any]) -> dict[str, Any]: ...

    def import_extra_state(self, state: dict[str, Any], saved: dict[str, Any], view: ShardedView,
                           layout: Any, group: dict[str, Any], name: object) -> None: ...

    def materialize_state(self, params: Iterable[torch.Tensor]) -> None:
        """Create the state of ``params`` with the optimizer's own code, changing no
        parameter (see ``_to_create`` in vefsdp_optim/_checkpoint/_format.py); collective."""

    def forget_state(self, p: torch.Tensor) -> None:
        """Empty ``p``'s state (see ``load_state`` in vefsdp_optim/_checkpoint/_format.py)."""

    def pin_owner(self, p: torch.Tensor, layout: RaggedShard | BoxShard, rank: int) -> None:
        """The rank of ``p``'s ``layout`` that computes its whole tensor from now on
        ([Note: owners stay])."""
