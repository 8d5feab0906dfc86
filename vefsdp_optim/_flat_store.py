"""The one contract between fully_shard and the optimizers: parameters in a flat store.

See [Note: flat store contract]. fully_shard's sharded parameters implement
:class:`FlatBacked`; the store behind them implements :class:`FlatStore`. The
optimizers use only what is declared here (through :func:`flat_store` and
:func:`apply_requirements`); FSDP2 DTensors and plain tensors implement neither and take
the general path of the step loop.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from vefsdp_optim._torch_compat import FakeTensor, storage_id
from vefsdp_optim.sharding import Requirement

__all__ = ["FlatStore", "FlatBacked", "ReplanReport", "StoreReplan", "flat_store",
           "apply_requirements"]

logger = logging.getLogger("vefsdp_optim")

# [Note: flat store contract]
# fully_shard keeps this rank's shard of every parameter of one group and dtype in one
# flat buffer of m elements. Each parameter's local data is the dense segment
# [offset, offset + numel) of ``flat_param()``. After the reduce-scatter, each
# ``.grad``'s local data is the same segment of ``flat_grad()``. Parameters in one store
# share it, and the padding between segments stays zero. Two things follow.
#   - An elementwise optimizer may update every member at once with a few ops on the two
#     flat tensors, as AdamW's fused path does. It may do so when ``grads_in_place()``
#     says that every member's .grad still is its segment.
#   - An optimizer may ask the store for a new plan in which its blocks are whole on
#     single ranks, with ``replan(units)``. The re-plan is a collective over the store's
#     process group. The constructor of every BlockOptimizer asks once, through
#     ``apply_requirements``. Users may call it themselves, after add_param_group.
# A re-plan moves the parameters' data and their reduced gradients, never optimizer
# state. So it refuses to move a parameter for which a registered state holder already
# has state, before any communication. A state holder is an optimizer, or anything
# given to ``add_state_holder``.


@dataclass(frozen=True, slots=True)
class StoreReplan:
    """What one store's re-plan changed: names of moved members, requirements kept out
    by the padding rule as ``(name, unit)``, padding (elements) before and after, and
    whether the plan changed at all (False: only refusals to report)."""

    changed: tuple[str, ...]
    kept: tuple[tuple[str, int], ...]
    padding_before: int
    padding_after: int
    replanned: bool = True


@dataclass(frozen=True, slots=True)
class ReplanReport:
    """What ``apply_requirements`` changed.

    ``changed``: parameters (by name within their group) whose layout moved.
    ``kept``: ``(name, unit)`` requirements not applied because the padding rule refused
    them; their old unit stays (the step loop still computes them exactly, through its
    exchange). ``padding_before``/``padding_after``: total padding (elements) of the
    re-planned stores. ``groups``: how many stores were re-planned.
    """

    changed: tuple[str, ...] = ()
    kept: tuple[tuple[str, int], ...] = ()
    padding_before: int = 0
    padding_after: int = 0
    groups: int = 0

    def __post_init__(self) -> None:
        if self.padding_before < 0 or self.padding_after < 0 or self.groups < 0:
            raise ValueError(f"ReplanReport counts must be >= 0, got {self}")


@runtime_checkable
class FlatStore(Protocol):
    """Parameters whose local data are dense segments of one flat buffer (see the Note)."""

    def members(self) -> Sequence[torch.Tensor]:
        """The parameters stored here, each once, in buffer order."""
        ...

    def flat_param(self) -> torch.Tensor:
        """This rank's flat buffer (1-D, m elements); the same object until a re-plan."""
        ...

    def flat_grad(self) -> torch.Tensor:
        """The flat reduced-gradient buffer (1-D, m elements), at the same offsets."""
        ...

    def segment(self, p: torch.Tensor) -> tuple[int, int]:
        """``(offset, numel)`` of member ``p``'s local data in ``flat_param()``."""
        ...

    def grads_in_place(self) -> bool:
        """Every member has a ``.grad`` whose local data is its segment of ``flat_grad()``."""
        ...

    def add_state_holder(self, holder: torch.optim.Optimizer) -> None:
        """Register an optimizer whose state of the members a re-plan must not invalidate."""
        ...

    def replan(self, units: Mapping[torch.Tensor, int]) -> StoreReplan | None:
        """Re-plan for the cut units of some members (collective over the store's process
        group); None when nothing changed. Raises ValueError before any communication
        when a moved member has state in a registered holder."""
        ...


@runtime_checkable
class FlatBacked(Protocol):
    """A tensor stored in a :class:`FlatStore` (fully_shard's ShardedParameter)."""

    def flat_store(self) -> FlatStore | None: ...


def flat_store(t: object) -> FlatStore | None:
    """The store ``t`` lives in, or None (FSDP2 DTensors, plain tensors, state tensors)."""
    # what isinstance(t, FlatBacked) checks, without a runtime Protocol check's cost
    # (paid on every parameter of every optimizer step)
    return t.flat_store() if callable(getattr(type(t), "flat_store", None)) else None


def dense_offset(view: torch.Tensor, flat: torch.Tensor) -> int | None:
    """Element offset of 1-D ``view`` inside 1-D ``flat``; None when it is not a dense
    slice of it."""
    n = view.numel()
    if view.dtype != flat.dtype or view.device != flat.device or view.dim() != 1:
        return None
    if n and view.stride(0) != 1:
        return None
    es = flat.element_size()
    if isinstance(view, FakeTensor) or isinstance(flat, FakeTensor):  # no memory: by storage
        if storage_id(view) != storage_id(flat):
            return None
        delta = (view.storage_offset() - flat.storage_offset()) * es
    else:
        delta = view.data_ptr() - flat.data_ptr()
    if delta % es or not 0 <= delta // es <= flat.numel() - n:
        return None
    return delta // es


def apply_requirements(requirements: Mapping[torch.Tensor, Requirement], *,
                       holder: torch.optim.Optimizer | None = None) -> ReplanReport:
    """The re-plan step ([Note: flat store contract]): re-plan every store holding one of
    the tensors so that each requirement's blocks are whole on single ranks, where the
    padding rule allows it. Tensors in no store are ignored.

    Collective: every rank of each affected store's process group calls it with the
    same requirements in the same order. ``holder`` (an optimizer) is registered with
    each store first, so that later re-plans protect its state. Logs what changed
    (logger ``vefsdp_optim``, INFO) and returns it.
    """
    if not isinstance(requirements, Mapping):
        raise TypeError(f"requirements must be a Mapping[Tensor, Requirement], got "
                        f"{type(requirements).__name__}")
    stores: dict[int, tuple[FlatStore, dict[torch.Tensor, int]]] = {}
    for t, req in requirements.items():
        if not isinstance(req, Requirement):
            raise TypeError(f"requirement must be a Requirement, got {type(req).__name__} for a "
                            f"tensor of shape {tuple(t.shape)}")
        store = flat_store(t)
        if store is None:
            continue
        stores.setdefault(id(store), (store, {}))[1][t] = req.unit(tuple(t.shape) or (1,))
    if holder is not None:
        for store, _ in stores.values():
            store.add_state_holder(holder)
    parts = [r for store, units in stores.values() if (r := store.replan(units)) is not None]
    done = [r for r in parts if r.replanned]
    report = ReplanReport(
        tuple(n for r in parts for n in r.changed), tuple(k for r in parts for k in r.kept),
        sum(r.padding_before for r in done), sum(r.padding_after for r in done), len(done))
    if parts:
        logger.info("re-planned %d store(s) for %s: moved %s; kept (padding rule) %s; "
                    "padding %d -> %d",
                    report.groups, type(holder).__name__ if holder is not None else "requirements",
                    list(report.changed), list(report.kept), report.padding_before,
                    report.padding_after)
    return report


def state_holders_with(holders: Any, members: Sequence[torch.Tensor]) -> list[str]:
    """Class names of the optimizers in ``holders`` that hold state of any of ``members``."""
    ids = {id(p) for p in members}
    return sorted({type(h).__name__ for h in list(holders)
                   if any(id(p) in ids for p in h.state)})
