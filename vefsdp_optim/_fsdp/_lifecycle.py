"""Where a fully_shard group is in its step: explicit states with checked transitions.

As FSDP2's ``TrainingState``: each piece of lifecycle is one enum value, and every
change goes through :func:`advance`, which raises AssertionError (a broken internal
invariant, naming both states) on a transition the table does not allow, instead of
letting a combination of flags drift into a state nobody designed.
"""

from __future__ import annotations

from enum import Enum, auto

__all__ = ["GatherState", "GradState", "TrainingState", "Role", "advance"]


class GatherState(Enum):
    """The unsharded parameters of a shard group."""

    SHARDED = auto()  # only the local shards; the global buffers are freed
    GATHERING = auto()  # an async all-gather was launched and not waited for
    GATHERED = auto()  # the global buffers hold the unsharded parameters


class GradState(Enum):
    """The gradient buffers of a shard group."""

    IDLE = auto()  # no unreduced gradients: the sharded .grad (if any) are final
    ACCUMULATING = auto()  # the gradient buffer holds gradients not yet reduced
    REDUCING = auto()  # a reduce-scatter was launched and not waited for


class TrainingState(Enum):
    """One fully_shard'd module between its pre-backward and its post-backward."""

    IDLE = auto()
    BACKWARD = auto()  # pre-backward ran (grads attached), post-backward not yet


class Role(Enum):
    """Decided at the first forward (lazy init), as FSDP2's ``_is_root``."""

    UNSET = auto()
    ROOT = auto()
    NON_ROOT = auto()


_ALLOWED: dict[type[Enum], set[tuple[Enum, Enum]]] = {
    GatherState: {
        (GatherState.SHARDED, GatherState.GATHERING), (GatherState.SHARDED, GatherState.GATHERED),
        (GatherState.GATHERING, GatherState.GATHERED),
        (GatherState.GATHERED, GatherState.GATHERING), (GatherState.GATHERED, GatherState.GATHERED),
        (GatherState.GATHERED, GatherState.SHARDED), (GatherState.SHARDED, GatherState.SHARDED),
    },
    GradState: {
        (GradState.IDLE, GradState.ACCUMULATING), (GradState.ACCUMULATING, GradState.ACCUMULATING),
        (GradState.ACCUMULATING, GradState.REDUCING), (GradState.ACCUMULATING, GradState.IDLE),
        (GradState.REDUCING, GradState.IDLE),
    },
    TrainingState: {(TrainingState.IDLE, TrainingState.BACKWARD),
                    (TrainingState.BACKWARD, TrainingState.IDLE)},
    Role: {(Role.UNSET, Role.ROOT), (Role.UNSET, Role.NON_ROOT)},
}


def advance(current: Enum, new: Enum, what: str) -> Enum:
    """``new`` if ``current -> new`` is a legal transition of its enum; else AssertionError."""
    if type(current) is not type(new) or (current, new) not in _ALLOWED[type(new)]:
        raise AssertionError(f"{what}: illegal transition {current} -> {new}")
    return new
