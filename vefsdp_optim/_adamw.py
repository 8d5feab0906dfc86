"""AdamW with torch.optim.AdamW's signature, defaults and results, on sharded parameters."""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from vefsdp_optim.comm import sharded_view
from vefsdp_optim.sharding import Elementwise, RaggedShard, Requirement

from ._adam_state import adam_bucket_, adam_state_spec
from ._block_optimizer import BlockOptimizer
from ._flat_store import FlatStore, flat_store
from ._math import adam_foreach_, adamw_step_, check_adam_hparams
from ._math._adam import FUSED_BLOCK, FusedPieces, LocalSlice, adam_fused_pieces_, fused_pieces
from ._registry import register_optimizer
from ._step_loop import StepItem
from ._torch_compat import FakeTensor, device_dtype_check_for_fused, to_scalar

__all__ = ["AdamW"]


# A fully_shard store ([Note: flat store contract]) keeps this rank's shard of every
# parameter of one shard group and dtype in one flat buffer. When the whole store steps
# together (every member in one param group, grads in place, one step count), AdamW runs
# ONCE on the flat buffers: about ten elementwise ops per store whatever the number of
# parameters, in torch.optim.AdamW's op order (adamw_step_), so each element gets the same
# bits as torch gives it. Padding stays zero: zero param, zero grad -> zero moments, and 0
# / (0 + eps) = 0. The state is the flat _FlatState; each parameter's self.state[p] holds
# 1-D views of it (and a 0-d view of a float32 step vector), so state_dict(), schedulers
# and users see torch's per-parameter keys. The fallback (adam_bucket_ on per-parameter
# slices) updates those views in place, so both paths share one state. If a state entry is
# not the view handed out (load_state_dict replaced it), the flat state is rebuilt by
# copying the entries in, once. With ``fused=True`` the flat buffers are stepped in the
# pieces of ``FUSED_BLOCK`` in vefsdp_optim/_math/_adam.py (torch's fused CPU kernel rounds
# an element by its position in its tensor), so each element still gets one device's bits.


@dataclass(slots=True)
class _FlatState:
    """Adam state of one fully_shard store, flat over its local shard."""

    flat_param: torch.Tensor  # the store's flat_param() this state was built for (1-D, m elems)
    exp_avg: torch.Tensor  # 1-D, m elems
    exp_avg_sq: torch.Tensor  # 1-D, m elems
    max_exp_avg_sq: torch.Tensor | None  # 1-D, m elems; amsgrad only
    steps: torch.Tensor  # 1-D float32 on CPU, one per member: state[p]["step"] is steps[i]
    members: list[torch.Tensor]  # the store's members, in this order
    handed: list[tuple[torch.Tensor, ...]]  # per member: the state tensors given to self.state
    pieces: FusedPieces | None = None  # fused=True on the CPU: built on first use


_STATE_KEYS = ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")


@register_optimizer("adamw")
class AdamW(BlockOptimizer):
    """``torch.optim.AdamW`` on plain, FSDP2 and fully_shard parameters.

    Same signature, defaults and results (elementwise math on each rank's slice). On
    fully_shard parameters each store's whole local buffer is updated in one set of
    fused ops (see ``_FlatState``); elsewhere each step-loop bucket's slices are
    updated in one foreach call. No communication either way.
    """

    decoupled = True
    checks_capturable = False  # torch's own error at the first step, as torch.optim.AdamW
    step_count_keys = ("step",)
    #: update whole fully_shard stores in fused ops where possible
    fuse_stores: bool = True

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float | torch.Tensor, float | torch.Tensor] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
    ) -> None:
        check_adam_hparams(lr, betas, eps, weight_decay, foreach=foreach, capturable=capturable)
        if differentiable:
            raise NotImplementedError(
                f"{type(self).__name__}(differentiable=True) is not supported: the step runs on "
                "sharded slices under torch.no_grad(); use torch.optim.AdamW(differentiable=True) "
                "to backpropagate through an optimizer step")
        if fused and foreach:
            raise RuntimeError("`fused` and `foreach` cannot be `True` together.")
        defaults = dict(lr=lr, betas=tuple(to_scalar(b) for b in betas), eps=eps,
                        weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                        foreach=foreach, capturable=capturable, differentiable=differentiable,
                        fused=fused)
        super().__init__(params, defaults)
        if fused:  # torch's own device and dtype check for its fused kernel
            for group in self.param_groups:
                for p in group["params"]:
                    device_dtype_check_for_fused(sharded_view(p).local)
        self._flat: weakref.WeakKeyDictionary[Any, _FlatState] = weakref.WeakKeyDictionary()
        #: fully_shard stores updated by the fused path so far (one per store per step)
        self.fused_updates = 0

    def requirement(self, shape: torch.Size, group: dict[str, Any]) -> Requirement:
        return Elementwise()

    def updates_elementwise(self, group: dict[str, Any]) -> bool:
        return True

    structural_keys = ("amsgrad",)

    def checkpoint_spec(self, shape: torch.Size, group: dict[str, Any]) -> dict[str, str | int]:
        return adam_state_spec(group["amsgrad"])

    def compute_bucket(self, items: list[StepItem],
                       inputs: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        group = items[0].group  # one param group per bucket
        adam_bucket_([self.state[it.param] for it in items], [ins[0] for ins in inputs],
                     [ins[1] for ins in inputs], group=group, amsgrad=group["amsgrad"],
                     maximize=group["maximize"], decoupled=self.decoupled)
        return [[ins[0]] for ins in inputs]

    def step_counts_on_device(self, group: dict[str, Any]) -> bool:
        """torch's Adam keeps ``step`` on the device when capturable or fused."""
        return bool(group.get("capturable", False) or group.get("fused", False))

    # -- fused fully_shard stores (see ``_FlatState``) ---------------------------------

    def claim_params(self, group: dict[str, Any]) -> list[Any]:
        """Update the whole fully_shard stores of ``group`` fused; the rest go to the loop."""
        params = group["params"]
        kinds = set(map(type, params))
        if not self.fuse_stores or not any(callable(getattr(kind, "flat_store", None))
                                           for kind in kinds):
            return params  # (no parameter kind has a store: flat_store() of each is None)
        by_store: dict[int, tuple[FlatStore, list[Any]]] = {}
        for p in params:
            store = flat_store(p)
            if store is not None:
                by_store.setdefault(id(store), (store, []))[1].append(p)
        done: set[int] = set()
        for store, ps in by_store.values():
            members = store.members()
            if len(ps) == len(members) and {id(p) for p in ps} == {id(m) for m in members} \
                    and self._fused_store_(store, group):
                done.update(id(p) for p in ps)
        return [p for p in params if id(p) not in done] if done else params

    def _fused_store_(self, store: FlatStore, group: dict[str, Any]) -> bool:
        """The fused update of one fully_shard store; False (nothing done) if it does not apply."""
        if group["capturable"] or group["differentiable"] or any(
                isinstance(group[k], torch.Tensor) for k in ("lr", "eps", "weight_decay")) or any(
                isinstance(b, torch.Tensor) for b in group["betas"]):
            return False
        if not store.grads_in_place() or isinstance(store.flat_param(), FakeTensor):
            # FakeTensorMode (a memory estimate): the flat state's host step counts would
            # have no values to read; the per-parameter path keeps the same state bytes
            return False
        amsgrad = group["amsgrad"]
        flat = self._flat.get(store)
        if (flat is None or flat.flat_param is not store.flat_param()
                or not self._state_intact(flat, amsgrad)):
            flat = self._build_flat(store, amsgrad)
            if flat is None:
                return False
        steps = flat.steps.tolist()
        if any(s != steps[0] for s in steps) or steps[0] != int(steps[0]):
            return False  # parameters that skipped steps: per-parameter bias corrections
        beta1, beta2 = group["betas"]
        hp = dict(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                  weight_decay=group["weight_decay"], amsgrad=amsgrad,
                  maximize=group["maximize"], decoupled=self.decoupled)
        if group["fused"] and flat.flat_param.device.type == "cpu":
            # torch's fused kernel, in pieces (``FUSED_BLOCK``, _math/_adam.py)
            if flat.pieces is None:
                flat.pieces = fused_pieces([_local_slice(p, *store.segment(p))
                                            for p in flat.members])
            adam_fused_pieces_(flat.pieces, flat.flat_param, store.flat_grad(), flat.exp_avg,
                               flat.exp_avg_sq, flat.max_exp_avg_sq, step=steps[0], **hp)
        elif group["fused"] or group["foreach"]:  # torch's fused or multi-tensor implementation
            param = flat.flat_param
            # incremented by torch; a fill, not a copy from the host, on the device
            step = torch.full((), steps[0], dtype=torch.float32,
                              device=param.device if group["fused"] else None)
            adam_foreach_([param], [store.flat_grad()], [flat.exp_avg], [flat.exp_avg_sq],
                          [flat.max_exp_avg_sq] if amsgrad else [], [step],
                          foreach=group["foreach"], fused=group["fused"], **hp)
        else:  # torch's single-tensor implementation, op for op (its default on the CPU)
            adamw_step_(flat.flat_param, store.flat_grad(), flat.exp_avg, flat.exp_avg_sq,
                        flat.max_exp_avg_sq, step=int(steps[0]) + 1, **hp)
        flat.steps.add_(1)
        self.fused_updates += 1
        return True

    def _state_intact(self, flat: _FlatState, amsgrad: bool) -> bool:
        """Each member's state entries are still the views of ``flat`` handed out."""
        if amsgrad and flat.max_exp_avg_sq is None:
            return False
        for p, handed in zip(flat.members, flat.handed, strict=True):
            state = self.state.get(p)
            if state is None or any(state.get(k) is not t
                                    for k, t in zip(_STATE_KEYS, handed, strict=False)):
                return False
        return True

    def _build_flat(self, store: FlatStore, amsgrad: bool) -> _FlatState | None:
        """(Re)build the store's flat state, copying the per-parameter state in (zeros
        where there is none yet); None if that state is not in the per-slice layout."""
        members = list(store.members())
        has_max = amsgrad
        for p in members:
            state = self.state.get(p)
            n = store.segment(p)[1]
            if state:
                has_max = has_max or "max_exp_avg_sq" in state
                keys = [k for k in _STATE_KEYS[1:]
                        if k in state or k != "max_exp_avg_sq" or amsgrad]
                if "step" not in state or any(
                        not isinstance(state.get(k), torch.Tensor) or state[k].numel() != n
                        for k in keys):
                    return None  # the per-slice fallback reports it
        local = store.flat_param()
        mk = lambda: torch.zeros_like(local)  # noqa: E731
        new = _FlatState(local, mk(), mk(), mk() if has_max else None,
                         torch.zeros(len(members), dtype=torch.float32), members, [])
        for i, p in enumerate(members):
            off, n = store.segment(p)
            state = self.state[p]
            views = [new.steps[i], new.exp_avg[off:off + n], new.exp_avg_sq[off:off + n]]
            if has_max:
                views.append(new.max_exp_avg_sq[off:off + n])
            if state:
                new.steps[i] = float(state["step"])
                for k, v in zip(_STATE_KEYS[1:], views[1:], strict=False):
                    if k in state:
                        v.copy_(state[k].reshape(-1))
            state.update(zip(_STATE_KEYS, views, strict=False))
            new.handed.append(tuple(views))
        self._flat[store] = new
        return new


def _local_slice(p: torch.Tensor, offset: int, length: int) -> LocalSlice:
    """Member ``p``'s segment of its flat buffer as a LocalSlice (see ``FUSED_BLOCK`` in
    vefsdp_optim/_math/_adam.py)."""
    view = sharded_view(p)
    layout, numel = view.layout, view.layout.numel
    first = numel - numel % FUSED_BLOCK  # the parameter's last partial block starts here
    if isinstance(layout, RaggedShard):
        start = layout.local(view.rank)[0]
        last = tuple(range(max(start, first), start + length))
    else:  # BoxShard: local elements in increasing global order, so the block's are last
        k = min(length, FUSED_BLOCK - 1)
        last = tuple(i for i in layout.flat_indices(view.rank, length - k, length).tolist()
                     if i >= first)
    return LocalSlice(offset, length, numel, last)
