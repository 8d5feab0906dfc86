"""AdamW with torch.optim.AdamW's signature, defaults and results, on sharded parameters."""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from vefsdp_optim.sharding import Elementwise, Requirement

from ._adam_state import adam_bucket_, adam_state_spec
from ._block_optimizer import BlockOptimizer
from ._math import adamw_step_, check_adam_hparams
from ._registry import register_optimizer
from ._step_loop import StepItem

__all__ = ["AdamW"]


# [Note: fused buckets]
# A fully_shard bucket keeps this rank's shard of every parameter of one dtype in one
# flat buffer (master.local, m elements), and after the reduce-scatter every .grad is
# a view of one flat gradient buffer (master.local_grad) at the same offsets. When the
# whole bucket steps together (every parameter present with such a grad, one param
# group, one step count), AdamW runs ONCE on the flat buffers: about ten elementwise
# ops per bucket whatever the number of parameters, in torch.optim.AdamW's op order
# (adamw_step_), so each element gets the same bits as torch gives it. Padding stays
# zero: zero param, zero grad -> zero moments, and 0 / (0 + eps) = 0.
# The state is the flat _FlatState; each parameter's self.state[p] holds 1-D views of
# it (and a 0-d view of a float32 step vector), so state_dict(), schedulers and users
# see torch's per-parameter keys. The fallback (adam_bucket_ on per-parameter slices)
# updates those views in place, so both paths share one state. If a state entry is not
# the view handed out (load_state_dict replaced it), the flat state is rebuilt by
# copying the entries in, once.


@dataclass(slots=True)
class _FlatState:
    """Adam state of one fully_shard bucket, flat over its local shard."""

    local: torch.Tensor  # the master.local this state was built for (1-D, m elems)
    local_grad: torch.Tensor  # the master.local_grad it was checked against (1-D, m elems)
    exp_avg: torch.Tensor  # 1-D, m elems
    exp_avg_sq: torch.Tensor  # 1-D, m elems
    max_exp_avg_sq: torch.Tensor | None  # 1-D, m elems; amsgrad only
    steps: torch.Tensor  # 1-D float32 on CPU, one per param: state[p]["step"] is steps[i]
    handed: list[tuple[torch.Tensor, ...]]  # per param: the state tensors given to self.state
    expect: list[tuple[Any, int, int, int]]  # per param: (param, local data_ptr, grad data_ptr, numel)

    def grads_in_place(self, bucket: Any) -> bool:
        """Every param's local data and grad are still the checked views (a few
        attribute reads per param, no tensor op)."""
        if self.local is not bucket.master.local or self.local_grad is not bucket.master.local_grad:
            return False
        for p, pp, gp, n in self.expect:
            gl = getattr(p.grad, "_local", None)
            if gl is None or gl.numel() != n or (n and (gl.data_ptr() != gp or p._local.data_ptr() != pp)):
                return False
        return True


_STATE_KEYS = ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def _flat_offset(view: torch.Tensor, flat: torch.Tensor) -> int | None:
    """Offset of 1-D ``view`` inside 1-D ``flat``, or None when it is not a dense slice."""
    n = view.numel()
    if view.dtype != flat.dtype or view.device != flat.device or view.dim() != 1:
        return None
    if n and view.stride(0) != 1:
        return None
    es = flat.element_size()
    delta = view.data_ptr() - flat.data_ptr()
    if delta % es or not 0 <= delta // es <= flat.numel() - n:
        return None
    return delta // es


def _bucket_layout(bucket: Any) -> list[tuple[Any, int, int]] | None:
    """``(param, offset, numel)`` per param of a fully_shard bucket, when each param's
    local data and grad are dense views at one offset of master.local / local_grad."""
    local, local_grad = bucket.master.local, bucket.master.local_grad
    if local.is_complex() or local.is_sparse:
        return None
    out = []
    for mp in bucket.params:
        p = mp.sharded
        pl, gl = p._local, getattr(p.grad, "_local", None)
        if gl is None or gl.numel() != pl.numel():
            return None
        if not pl.numel():  # nothing of it on this rank
            out.append((p, 0, 0))
            continue
        off = _flat_offset(pl, local)
        if off is None or _flat_offset(gl, local_grad) != off:
            return None
        out.append((p, off, pl.numel()))
    return out


@register_optimizer("adamw")
class AdamW(BlockOptimizer):
    """``torch.optim.AdamW`` on plain, FSDP2 and fully_shard parameters.

    Same signature, defaults and results (elementwise math on each rank's slice). On
    fully_shard parameters each bucket's whole local buffer is updated in one set of
    fused ops ([Note: fused buckets]); elsewhere each step-loop bucket's slices are
    updated in one foreach call. No communication either way.
    """

    decoupled = True
    #: update whole fully_shard buckets in fused ops where possible
    fuse_buckets: bool = True

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        maximize: bool = False,
    ) -> None:
        check_adam_hparams(lr, betas, eps, weight_decay)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        amsgrad=amsgrad, maximize=maximize)
        super().__init__(params, defaults)
        self._flat: weakref.WeakKeyDictionary[Any, _FlatState] = weakref.WeakKeyDictionary()
        #: fully_shard buckets updated by the fused path so far (one per bucket per step)
        self.fused_updates = 0

    def requirement(self, shape: torch.Size, group: dict[str, Any]) -> Requirement:
        return Elementwise()

    structural_keys = ("amsgrad",)

    def checkpoint_spec(self, shape: torch.Size, group: dict[str, Any]) -> dict[str, str | int]:
        return adam_state_spec(group["amsgrad"])

    def compute_bucket(self, items: list[StepItem], inputs: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        group = items[0].group  # one param group per bucket
        adam_bucket_([self.state[it.param] for it in items], [ins[0] for ins in inputs],
                     [ins[1] for ins in inputs], group=group, amsgrad=group["amsgrad"],
                     maximize=group["maximize"], decoupled=self.decoupled)
        return [[ins[0]] for ins in inputs]

    # -- fused fully_shard buckets ([Note: fused buckets]) ---------------------------------

    def claim_params(self, group: dict[str, Any]) -> list[Any]:
        """Update the whole fully_shard buckets of ``group`` fused; the rest go to the loop."""
        params = group["params"]
        if not self.fuse_buckets:
            return params
        by_bucket: dict[int, tuple[Any, list[Any]]] = {}
        for p in params:
            b = getattr(p, "_vefsdp_bucket", None)
            if b is not None:
                by_bucket.setdefault(id(b), (b, []))[1].append(p)
        done: set[int] = set()
        for b, ps in by_bucket.values():
            if len(ps) == len(b.params) and {id(p) for p in ps} == {id(mp.sharded) for mp in b.params} \
                    and self._fused_bucket_(b, group):
                done.update(id(p) for p in ps)
        return [p for p in params if id(p) not in done] if done else params

    def _fused_bucket_(self, bucket: Any, group: dict[str, Any]) -> bool:
        """The fused update of one fully_shard bucket; False (nothing done) if it does not apply."""
        if any(isinstance(group[k], torch.Tensor) for k in ("lr", "eps", "weight_decay")) or any(
                isinstance(b, torch.Tensor) for b in group["betas"]):
            return False
        amsgrad = group["amsgrad"]
        flat = self._flat.get(bucket)
        if flat is None or not flat.grads_in_place(bucket) or not self._state_intact(flat, amsgrad):
            ordered = _bucket_layout(bucket)
            if ordered is None:
                return False
            flat = self._build_flat(bucket, ordered, amsgrad)
            if flat is None:
                return False
        steps = flat.steps.tolist()
        if any(s != steps[0] for s in steps) or steps[0] != int(steps[0]):
            return False  # parameters that skipped steps: per-parameter bias corrections
        flat.steps.add_(1)
        beta1, beta2 = group["betas"]
        adamw_step_(
            flat.local, flat.local_grad, flat.exp_avg, flat.exp_avg_sq, flat.max_exp_avg_sq,
            step=int(steps[0]) + 1, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
            weight_decay=group["weight_decay"], amsgrad=amsgrad,
            maximize=group["maximize"], decoupled=self.decoupled,
        )
        self.fused_updates += 1
        return True

    def _state_intact(self, flat: _FlatState, amsgrad: bool) -> bool:
        """Each param's state entries are still the views of ``flat`` handed out."""
        if amsgrad and flat.max_exp_avg_sq is None:
            return False
        for (p, _, _, _), handed in zip(flat.expect, flat.handed, strict=True):
            state = self.state.get(p)
            if state is None or any(state.get(k) is not t for k, t in zip(_STATE_KEYS, handed, strict=False)):
                return False
        return True

    def _build_flat(self, bucket: Any, ordered: list[tuple[Any, int, int]], amsgrad: bool) -> _FlatState | None:
        """(Re)build the bucket's flat state, copying the per-parameter state in (zeros
        where there is none yet); None if that state is not in the per-slice layout."""
        has_max = amsgrad
        for p, _, n in ordered:
            state = self.state.get(p)
            if state:
                has_max = has_max or "max_exp_avg_sq" in state
                keys = [k for k in _STATE_KEYS[1:] if k in state or k != "max_exp_avg_sq" or amsgrad]
                if "step" not in state or any(
                        not isinstance(state.get(k), torch.Tensor) or state[k].numel() != n for k in keys):
                    return None  # the per-slice fallback reports it
        local = bucket.master.local
        mk = lambda: torch.zeros_like(local)  # noqa: E731
        new = _FlatState(local, bucket.master.local_grad, mk(), mk(), mk() if has_max else None,
                         torch.zeros(len(ordered), dtype=torch.float32), [], [])
        for i, (p, off, n) in enumerate(ordered):
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
            new.expect.append((p, p._local.data_ptr(), p.grad._local.data_ptr(), n))
        self._flat[bucket] = new
        return new
