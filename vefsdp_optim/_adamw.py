"""AdamW with torch.optim.AdamW's signature, defaults and results, on sharded parameters."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.adam import adam as _adam_functional

from vefsdp_optim.sharding import Elementwise, Requirement

from ._block_optimizer import BlockOptimizer, _Item
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


@register_optimizer("adamw")
class AdamW(BlockOptimizer):
    """``torch.optim.AdamW`` on plain, FSDP2 and fully_shard parameters.

    Same signature, defaults and results (elementwise math on each rank's slice);
    each bucket's slices are updated in one fused call, with no communication.
    """

    decoupled = True

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

    def requirement(self, shape: torch.Size, group: dict[str, Any]) -> Requirement:
        return Elementwise()

    def compute_bucket(self, items: list[_Item], inputs: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        group = items[0].group
        adam_bucket_(
            self, items, [ins[0] for ins in inputs], [ins[1] for ins in inputs],
            lr=group["lr"], betas=group["betas"], eps=group["eps"],
            weight_decay=group["weight_decay"], amsgrad=group["amsgrad"],
            maximize=group["maximize"], decoupled=self.decoupled,
        )
        return [[ins[0]] for ins in inputs]
