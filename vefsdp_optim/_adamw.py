"""AdamW with torch.optim.AdamW's signature, defaults and results, on sharded parameters."""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.adam import adam as _adam_functional

from vefsdp_optim.sharding import Elementwise, Requirement

from ._block_optimizer import BlockOptimizer, _Item, adam_state_spec
from ._math import adamw_step_
from ._registry import register_optimizer

__all__ = ["AdamW", "check_adam_hparams", "adam_bucket_"]


def check_adam_hparams(lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """torch.optim.Adam's argument checks, with the same messages."""
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"betas must be a pair of floats, got {betas!r}")
    if not 0.0 <= betas[0] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
    if not 0.0 <= betas[1] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


def adam_bucket_(
    opt: BlockOptimizer, items: list[_Item], params: list[torch.Tensor], grads: list[torch.Tensor],
    *, lr: float, betas: tuple[float, float], eps: float, weight_decay: float, amsgrad: bool,
    maximize: bool, decoupled: bool,
) -> None:
    """Adam(W) on local 1-D slices of a bucket in one fused (foreach) call.

    Elementwise, so each slice gets exactly the values the full tensor would
    ([Note: one step loop]); the state holds local slices only.
    """
    exp_avgs, exp_avg_sqs, max_sqs, steps = [], [], [], []
    for it, p in zip(items, params, strict=True):
        state = opt.state[it.param]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if amsgrad:
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        exp_avgs.append(state["exp_avg"])
        exp_avg_sqs.append(state["exp_avg_sq"])
        if amsgrad:
            max_sqs.append(state["max_exp_avg_sq"])
        steps.append(state["step"])
    if not params:
        return
    same_device = len({p.device for p in params}) == 1
    _adam_functional(
        params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps,
        foreach=same_device, amsgrad=amsgrad, beta1=betas[0], beta2=betas[1], lr=lr,
        weight_decay=weight_decay, eps=eps, maximize=maximize,
        decoupled_weight_decay=decoupled,
    )


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
    exp_avg: torch.Tensor  # 1-D, m elems
    exp_avg_sq: torch.Tensor  # 1-D, m elems
    max_exp_avg_sq: torch.Tensor | None  # 1-D, m elems; amsgrad only
    steps: torch.Tensor  # 1-D float32 on CPU, one per param: state[p]["step"] is steps[i]
    handed: list[tuple[torch.Tensor, ...]]  # per param: the state tensors given to self.state


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

    def compute_bucket(self, items: list[_Item], inputs: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        done = self._fused_buckets_(items) if self.fuse_buckets else set()
        # a step-loop bucket may mix param groups: one foreach call per group
        by_group: dict[int, list[int]] = {}
        for i, it in enumerate(items):
            if i not in done:
                by_group.setdefault(id(it.group), []).append(i)
        for idx in by_group.values():
            group = items[idx[0]].group
            adam_bucket_(
                self, [items[i] for i in idx], [inputs[i][0] for i in idx], [inputs[i][1] for i in idx],
                lr=group["lr"], betas=group["betas"], eps=group["eps"],
                weight_decay=group["weight_decay"], amsgrad=group["amsgrad"],
                maximize=group["maximize"], decoupled=self.decoupled,
            )
        return [[ins[0]] for ins in inputs]

    # -- fused fully_shard buckets ([Note: fused buckets]) ---------------------------------

    def _fused_buckets_(self, items: list[_Item]) -> set[int]:
        """Run the fused update on every whole fully_shard bucket; the items it covered."""
        by_bucket: dict[int, list[int]] = {}
        for i, it in enumerate(items):
            if it.moves:
                raise AssertionError(f"AdamW is elementwise but an item moves: {it.view.layout} -> {it.compute}")
            b = getattr(it.param, "_vefsdp_bucket", None)
            if b is not None:
                by_bucket.setdefault(id(b), []).append(i)
        done: set[int] = set()
        for idx in by_bucket.values():
            if self._fused_bucket_(items[idx[0]].param._vefsdp_bucket, [items[i] for i in idx]):
                done.update(idx)
        return done

    def _fused_bucket_(self, bucket: Any, its: list[_Item]) -> bool:
        """The fused update of one fully_shard bucket; False (nothing done) if it does not apply."""
        group = its[0].group
        if any(it.group is not group for it in its) or len(its) != len(bucket.params):
            return False
        if any(isinstance(group[k], torch.Tensor) for k in ("lr", "eps", "weight_decay")) or any(
                isinstance(b, torch.Tensor) for b in group["betas"]):
            return False
        master = bucket.master
        local, local_grad = master.local, master.local_grad
        by_param = {id(it.param): it for it in its}
        ordered: list[tuple[_Item, int]] = []  # (item, offset in the flat buffers), bucket order
        for mp in bucket.params:
            it = by_param.get(id(mp.sharded))
            if it is None:
                return False
            if it.grad.numel() != it.view.local.numel():
                return False
            if not it.view.local.numel():  # nothing of it on this rank
                ordered.append((it, 0))
                continue
            off = _flat_offset(it.view.local, local)
            if off is None or _flat_offset(it.grad, local_grad) != off:
                return False
            ordered.append((it, off))
        flat = self._flat_state(bucket, ordered, group["amsgrad"])
        if flat is None:
            return False
        steps = flat.steps.tolist()
        if any(s != steps[0] for s in steps) or steps[0] != int(steps[0]):
            return False  # parameters that skipped steps: per-parameter bias corrections
        flat.steps.add_(1)
        beta1, beta2 = group["betas"]
        adamw_step_(
            local, local_grad, flat.exp_avg, flat.exp_avg_sq, flat.max_exp_avg_sq,
            step=int(steps[0]) + 1, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
            weight_decay=group["weight_decay"], amsgrad=group["amsgrad"],
            maximize=group["maximize"], decoupled=self.decoupled,
        )
        self.fused_updates += 1
        return True

    def _flat_state(self, bucket: Any, ordered: list[tuple[_Item, int]], amsgrad: bool) -> _FlatState | None:
        """The bucket's flat state, (re)built from the per-parameter state if needed."""
        flat = self._flat.get(bucket)
        local = bucket.master.local
        if flat is not None and flat.local is local and (flat.max_exp_avg_sq is not None or not amsgrad) \
                and len(flat.handed) == len(ordered):
            intact = True
            for (it, _), handed in zip(ordered, flat.handed, strict=True):
                state = self.state.get(it.param)
                if state is None or any(state.get(k) is not t for k, t in zip(_STATE_KEYS, handed, strict=False)):
                    intact = False
                    break
            if intact:
                return flat
        # (re)build: copy the per-parameter state in (zeros where there is none yet)
        for it, _ in ordered:
            state = self.state.get(it.param)
            if state:
                n = it.view.local.numel()
                keys = _STATE_KEYS[1:] if amsgrad or "max_exp_avg_sq" in state else _STATE_KEYS[1:3]
                if "step" not in state or any(
                        not isinstance(state.get(k), torch.Tensor) or state[k].numel() != n for k in keys):
                    return None  # not the per-slice layout: the fallback reports it
        mk = lambda: torch.zeros_like(local)  # noqa: E731
        has_max = amsgrad or any("max_exp_avg_sq" in self.state.get(it.param, {}) for it, _ in ordered)
        new = _FlatState(local, mk(), mk(), mk() if has_max else None,
                         torch.zeros(len(ordered), dtype=torch.float32), [])
        for i, (it, off) in enumerate(ordered):
            n = it.view.local.numel()
            state = self.state[it.param]
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
        self._flat[bucket] = new
        return new
