"""Muon with torch.optim.Muon's numerics; Newton-Schulz once per matrix, on an owner."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from vefsdp_optim._math import (
    NS_COEFFICIENTS,
    check_adam_hparams,
    muon_adjust_lr,
    muon_cost,
    muon_matrix_view,
    zeropower_via_newtonschulz,
)
from vefsdp_optim.comm import ShardedView
from vefsdp_optim.sharding import Elementwise, RaggedShard, Requirement, WholeTensor

from ._adam_state import adam_bucket_, adam_state_spec
from ._block_optimizer import BlockOptimizer
from ._registry import register_optimizer
from ._state_format import ELEMENTWISE
from ._step_loop import StepItem

__all__ = ["Muon"]


@register_optimizer("muon")
class Muon(BlockOptimizer):
    """``torch.optim.Muon`` for whole models, on plain, FSDP2 and fully_shard parameters.

    For a parameter with 2 or more dims (viewed as ``(dim 0, rest)``) the update is
    torch.optim.Muon's: momentum (kept sharded, elementwise), Newton-Schulz on the
    whole matrix, decoupled weight decay. Newton-Schulz runs exactly once per matrix
    in the world, on an owner rank chosen to balance ``m * n * min(m, n)``, on exactly
    the full matrix a single device would see; only the momentum-combined update goes
    to the owner and only the orthogonalized update (bfloat16) comes back.

    1-D parameters, and every parameter of a group with ``use_muon=False`` (embeddings,
    output heads), are updated by AdamW inside the same optimizer, with the group keys
    ``betas`` (default (0.9, 0.95)) and ``adamw_eps`` (default 1e-8; in a group with
    ``use_muon=False`` an explicit ``eps`` means AdamW's eps), and the group's ``lr``
    and ``weight_decay``.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        *,
        betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
    ) -> None:
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not 0.0 <= lr:
            raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
        if not 0.0 <= momentum:
            raise ValueError(f"momentum should be >= 0 but is: {momentum}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"weight decay should be >= 0 but is: {weight_decay}")
        if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
            raise ValueError(
                f"Adjust learning rate function {adjust_lr_fn} is not supported; "
                "use None, 'original' or 'match_rms_adamw'")
        if not (isinstance(ns_steps, int) and 0 < ns_steps < 100):
            raise ValueError(f"ns_steps must be an int in [1, 100), got {ns_steps!r}")
        if len(ns_coefficients) != 3:
            raise ValueError(f"ns_coefficients must be 3 floats, got {ns_coefficients!r}")
        check_adam_hparams(lr, betas, adamw_eps, weight_decay)
        defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
            ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn, use_muon=True, betas=tuple(betas), adamw_eps=adamw_eps,
        )
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if param_group.get("use_muon", True) is False and "eps" in param_group:
            param_group.setdefault("adamw_eps", param_group["eps"])
        use = param_group.get("use_muon", True)
        if not isinstance(use, bool):
            raise TypeError(f"use_muon must be a bool, got {use!r}")
        super().add_param_group(param_group)

    @staticmethod
    def _is_muon(shape: torch.Size, group: dict[str, Any]) -> bool:
        return bool(group["use_muon"]) and len(shape) >= 2

    def requirement(self, shape: torch.Size, group: dict[str, Any]) -> Requirement:
        return WholeTensor() if self._is_muon(shape, group) else Elementwise()

    structural_keys = ("use_muon",)

    def checkpoint_spec(self, shape: torch.Size, group: dict[str, Any]) -> dict[str, str | int]:
        return {"momentum_buffer": ELEMENTWISE} if self._is_muon(shape, group) else adam_state_spec()

    def state_layout(self, view: ShardedView, group: dict[str, Any]) -> RaggedShard:
        return view.layout  # momentum stays sharded like the parameter

    def cost(self, shape: torch.Size) -> float:
        return muon_cost(shape)

    # hooks: momentum on the local shard, Newton-Schulz on the owner, apply locally

    def gather_inputs(self, item: StepItem) -> list[torch.Tensor]:
        if not self._is_muon(item.view.shape, item.group):
            return super().gather_inputs(item)
        g, group = item.grad, item.group
        state = self.state[item.param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(g, memory_format=torch.preserve_format)
        buf = state["momentum_buffer"]
        momentum = group["momentum"]
        buf.lerp_(g, 1 - momentum)
        update = g.lerp(buf, momentum) if group["nesterov"] else buf
        return [update]

    def compute_bucket(self, items: list[StepItem], inputs: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        out: list[list[torch.Tensor]] = [[] for _ in items]
        adam_idx = [i for i, it in enumerate(items) if not self._is_muon(it.view.shape, it.group)]
        if adam_idx:  # one param group per bucket: its lr, betas, adamw_eps, weight_decay
            adam_bucket_([self.state[items[i].param] for i in adam_idx], [inputs[i][0] for i in adam_idx],
                         [inputs[i][1] for i in adam_idx], group=items[0].group, eps_key="adamw_eps")
            for i in adam_idx:
                out[i] = [inputs[i][0]]
        for i, it in enumerate(items):
            if i in adam_idx:
                continue
            (x,) = inputs[i]
            if x.numel() == 0:  # not the owner of this matrix
                out[i] = [x.to(torch.bfloat16)]
                continue
            group = it.group
            ortho = zeropower_via_newtonschulz(
                x.view(muon_matrix_view(it.view.shape)), group["ns_coefficients"],
                group["ns_steps"], group["eps"])
            out[i] = [ortho.reshape(-1)]
        return out

    def apply_results(self, item: StepItem, outputs: list[torch.Tensor]) -> None:
        if not self._is_muon(item.view.shape, item.group):
            return super().apply_results(item, outputs)
        (ortho,) = outputs
        p, group = item.view.local, item.group
        lr = group["lr"]
        adjusted_lr = muon_adjust_lr(lr, group["adjust_lr_fn"], muon_matrix_view(item.view.shape))
        p.mul_(1 - lr * group["weight_decay"])
        p.add_(ortho, alpha=-adjusted_lr)
