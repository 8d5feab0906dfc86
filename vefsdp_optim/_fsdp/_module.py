"""FSDPModule: the methods fully_shard adds to a module's class, and UnshardHandle."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from ._group import ShardGroup

if TYPE_CHECKING:
    from ._state import FSDPState

__all__ = ["FSDPModule", "UnshardHandle", "state_of"]


class UnshardHandle:
    """A pending :meth:`FSDPModule.unshard` (FSDP2's ``UnshardHandle``).

    ``wait()`` completes the all-gather and registers the unsharded parameters on the
    module; calling it again does nothing. Forward waits by itself when not called.
    """

    def __init__(self, group: ShardGroup | None) -> None:
        self._group = group

    def wait(self) -> None:
        g, self._group = self._group, None
        if g is not None:
            g.wait_unshard()
            g.register(sharded=False)


class FSDPModule:
    """Mixin added to a fully_shard'd module's class, mirroring FSDP2's FSDPModule."""

    _vefsdp_state: FSDPState

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters and register the unsharded ones.

        Not recursive. ``async_op=True`` returns an :class:`UnshardHandle` whose
        ``wait()`` completes it (forward also waits); otherwise returns None, done.
        """
        if not isinstance(async_op, bool):
            raise TypeError(f"async_op must be a bool, got {async_op!r}")
        handle = UnshardHandle(self._vefsdp_state.group)
        g = self._vefsdp_state.group
        if g is not None:
            g.unshard(async_op=async_op)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free the all-gathered parameters and register the sharded ones."""
        g = self._vefsdp_state.group
        if g is not None:
            g.reshard()

    def _states(self, recurse: bool) -> Iterable[FSDPState]:
        mods = self.modules() if recurse else [self]  # type: ignore[attr-defined]
        return [m._vefsdp_state for m in mods if isinstance(m, FSDPModule)]

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Off: backward accumulates unreduced gradients; the next synced backward reduces."""
        if not isinstance(requires_gradient_sync, bool):
            raise TypeError(f"requires_gradient_sync must be a bool, got {requires_gradient_sync!r}")
        for s in self._states(recurse):
            if s.group is not None:
                s.group.requires_gradient_sync = requires_gradient_sync

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        if not isinstance(reshard_after_forward, bool):
            raise TypeError(f"reshard_after_forward must be a bool, got {reshard_after_forward!r}")
        for s in self._states(recurse):
            s.reshard_after_forward = reshard_after_forward

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these modules' groups (async) at this module's forward start."""
        self._vefsdp_state.fwd_prefetch = [state_of(m) for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these modules' groups (async) at this module's backward start."""
        self._vefsdp_state.bwd_prefetch = [state_of(m) for m in modules]


def state_of(m: object) -> FSDPState:
    if not isinstance(m, FSDPModule):
        raise ValueError(f"expected a fully_shard'd module, got {type(m).__name__}")
    return m._vefsdp_state
