"""The Adam / AdamW update on local tensors, in torch.optim's exact op order.

``adamw_step_`` mirrors ``torch.optim.adam._single_tensor_adam`` (the non-capturable,
non-differentiable path) op for op: the same lerp, mul_/addcmul_, Python-float bias
corrections, sqrt / divide / add eps and addcdiv_. Every op is elementwise, so applying
it to any slice of a parameter gives the same bits as applying it to the whole
parameter: this is what makes sharded AdamW bit-identical to the single-device one.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.optim.adam import adam as _torch_adam

__all__ = ["adam_foreach_", "adamw_step_", "check_adam_hparams"]


def _check_same(name: str, t: Tensor, ref: Tensor) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.shape != ref.shape:
        raise ValueError(
            f"{name} must have the parameter's shape {tuple(ref.shape)}, got {tuple(t.shape)}"
        )


def adamw_step_(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    max_exp_avg_sq: Tensor | None,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    amsgrad: bool,
    maximize: bool,
    decoupled: bool = True,
) -> None:
    """One Adam (``decoupled=False``) or AdamW (``decoupled=True``) step, in place.

    Updates ``param``, ``exp_avg``, ``exp_avg_sq`` (and ``max_exp_avg_sq`` when
    ``amsgrad``) in place; ``grad`` is read only. All tensors have one shape (flat
    shards are the usual case) and live on one device.

    Args:
        step: the step number after this update (1 on the first call), as torch's
            ``state["step"]`` after its increment.
        decoupled: True for AdamW (``param *= 1 - lr * weight_decay``), False for
            Adam's L2 penalty (``grad + weight_decay * param``).

    The result equals ``torch.optim.AdamW`` / ``torch.optim.Adam`` (``foreach`` either
    way, ``capturable=False``, float ``lr``) bit for bit on the same device.
    """
    _check_same("grad", grad, param)
    _check_same("exp_avg", exp_avg, param)
    _check_same("exp_avg_sq", exp_avg_sq, param)
    if amsgrad:
        if max_exp_avg_sq is None:
            raise ValueError("amsgrad=True needs a max_exp_avg_sq tensor, got None")
        _check_same("max_exp_avg_sq", max_exp_avg_sq, param)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be an int >= 1 (the count after this update), got {step!r}")

    if maximize:
        grad = -grad
    if weight_decay != 0:
        if decoupled:
            param.mul_(1 - lr * weight_decay)
        else:
            grad = grad.add(param, alpha=weight_decay)

    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)

    # torch reads the step back from a float tensor: the same double after float().
    t = float(step)
    bias_correction1 = 1 - beta1**t
    bias_correction2 = 1 - beta2**t
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5

    if amsgrad:
        torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)
        denom = (max_exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    else:
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


def adam_foreach_(
    params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
    max_exp_avg_sqs: list[Tensor], steps: list[Tensor], *, lr: float | Tensor,
    beta1: float | Tensor, beta2: float | Tensor, eps: float, weight_decay: float, amsgrad: bool,
    maximize: bool, decoupled: bool, foreach: bool | None = None, fused: bool | None = None,
    capturable: bool = False, differentiable: bool = False,
) -> None:
    """torch.optim's own functional Adam(W) on lists of tensors, in place, with torch's
    implementation flags: ``fused=True`` runs torch's fused kernel, ``foreach`` picks the
    multi-tensor (True) or single-tensor (False) implementation, ``capturable`` and
    ``differentiable`` are passed on (torch raises where they cannot work).
    ``foreach=None`` takes the multi-tensor one when every tensor is on one device and
    torch allows it (no Tensor lr or betas without ``capturable``, not ``differentiable``):
    the same bits as torch's default single-tensor path on the CPU, faster.

    ``steps`` are float32 0-d tensors, incremented here as torch does. Elementwise, so a
    list of slices (or one flat buffer) gets exactly the values the whole tensors would.
    """
    if not params:
        return
    if foreach is None and not fused:
        tensor_hp = any(isinstance(h, Tensor) for h in (lr, beta1, beta2))
        foreach = (len({p.device for p in params}) == 1 and not differentiable
                   and not (tensor_hp and not capturable))
    _torch_adam(
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
        foreach=bool(foreach) and not fused, fused=fused, capturable=capturable,
        differentiable=differentiable, amsgrad=amsgrad, beta1=beta1, beta2=beta2, lr=lr,
        weight_decay=weight_decay, eps=eps, maximize=maximize, decoupled_weight_decay=decoupled,
        grad_scale=None, found_inf=None,
    )


def check_adam_hparams(lr: float | Tensor, betas: tuple[float, float], eps: float,
                       weight_decay: float, *, foreach: bool | None = None,
                       capturable: bool = False) -> None:
    """torch.optim.Adam's argument checks, with the same messages."""
    if isinstance(lr, Tensor):
        if foreach and not capturable:
            raise ValueError("lr as a Tensor is not supported for capturable=False and foreach=True")
        if lr.numel() != 1:
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
    if not (all(isinstance(b, float) for b in betas) or all(isinstance(b, Tensor) for b in betas)):
        raise ValueError("betas must be either both floats or both Tensors")
    for i, b in enumerate(betas):
        if isinstance(b, Tensor):
            if foreach and not capturable:
                raise ValueError(f"betas[{i}] as a Tensor is not supported for capturable=False and foreach=True")
            if b.numel() != 1:
                raise ValueError(f"Tensor betas[{i}] must be 1-element")
