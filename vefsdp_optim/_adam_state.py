"""fp32 Adam(W) state of elementwise parameters, shared by every optimizer that keeps it.

AdamW, Muon's AdamW path (1-D parameters and ``use_muon=False`` groups) and the 8-bit
optimizers' small tensors keep torch's per-parameter Adam state (``step``, ``exp_avg``,
``exp_avg_sq``, ``max_exp_avg_sq``) on each rank's slice and update a bucket of slices
with ``_math.adam_foreach_``, torch's own functional Adam(W).
"""

from __future__ import annotations

from typing import Any

import torch

from ._checkpoint import ELEMENTWISE, REPLICATED
from ._math import adam_foreach_

__all__ = ["adam_state_spec", "adam_bucket_"]


def adam_state_spec(amsgrad: bool = False) -> dict[str, str | int]:
    """The checkpoint spec of torch's Adam(W) state (``step``, ``exp_avg``, ...)."""
    spec: dict[str, str | int] = {"step": REPLICATED, "exp_avg": ELEMENTWISE,
                                  "exp_avg_sq": ELEMENTWISE}
    if amsgrad:
        spec["max_exp_avg_sq"] = ELEMENTWISE
    return spec


def adam_bucket_(
    states: list[dict[str, Any]], params: list[torch.Tensor], grads: list[torch.Tensor], *,
    group: dict[str, Any], eps_key: str = "eps", amsgrad: bool = False, maximize: bool = False,
    decoupled: bool = True,
) -> None:
    """Adam(W) with ``group``'s hyperparameters and implementation flags (``foreach``,
    ``fused``, ``capturable``, ``differentiable`` where the group has them) on local 1-D
    slices of one step-loop bucket (one device and dtype), one state dict per slice
    (created, as torch creates it, on first use, like its slice)."""
    exp_avgs, exp_avg_sqs, max_sqs, steps = [], [], [], []
    on_device = group.get("capturable", False) or group.get("fused", False)
    for state, p in zip(states, params, strict=True):
        # torch keeps the step on the CPU unless capturable or fused (and makes it so)
        if not state:
            state["step"] = (torch.zeros((), dtype=torch.float32, device=p.device) if on_device
                             else torch.tensor(0.0, dtype=torch.float32))
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if amsgrad:
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        exp_avgs.append(state["exp_avg"])
        exp_avg_sqs.append(state["exp_avg_sq"])
        if amsgrad:
            max_sqs.append(state["max_exp_avg_sq"])
        steps.append(state["step"])
    beta1, beta2 = group["betas"]
    adam_foreach_(params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps, lr=group["lr"],
                  beta1=beta1, beta2=beta2, eps=group[eps_key], weight_decay=group["weight_decay"],
                  amsgrad=amsgrad, maximize=maximize, decoupled=decoupled,
                  foreach=group.get("foreach"), fused=group.get("fused"),
                  capturable=group.get("capturable", False),
                  differentiable=group.get("differentiable", False), uniform=True)
