"""The Adam / AdamW update on local tensors, in torch.optim's exact op order.

``adamw_step_`` mirrors ``torch.optim.adam._single_tensor_adam`` (the non-capturable,
non-differentiable path) op for op: the same lerp, mul_/addcmul_, Python-float bias
corrections, sqrt / divide / add eps and addcdiv_. Every op is elementwise, so applying
it to any slice of a parameter gives the same bits as applying it to the whole
parameter: this is what makes sharded AdamW bit-identical to the single-device one.
torch's fused kernel is the exception: see ``FUSED_BLOCK`` and
``fused_pieces`` / ``adam_fused_pieces_``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.optim.adam import adam as _torch_adam

from vefsdp_optim._torch_compat import (
    foreach_add,
    foreach_add_,
    foreach_addcdiv_,
    foreach_addcmul_,
    foreach_div_,
    foreach_lerp_,
    foreach_maximum_,
    foreach_mul_,
    foreach_neg,
    foreach_sqrt,
)

__all__ = ["FUSED_BLOCK", "FusedPieces", "LocalSlice", "adam_foreach_", "adam_fused_pieces_",
           "adamw_step_", "check_adam_hparams", "fused_pieces"]

# torch's fused CPU Adam(W) kernel (aten/src/ATen/native/cpu/FusedAdamKernel.cpp) steps
# each tensor of its list in a vector body and then a scalar tail: the last numel % V
# elements of a tensor, V the kernel's vector length (Vectorized<T>::size(); 8 float32s
# in the AVX2 code that AVX2 and AVX-512 CPUs both run, since the kernel registers no
# AVX-512 variant). The two loops round differently: the compiler contracts
# ``exp_avg_sq * beta2 + (1 - beta2) * grad * grad`` into an FMA around the other
# product in each, so an element's bits depend on whether it is in its tensor's last
# numel % V elements (not on its address: loads are unaligned; not on the thread count:
# threads split at whole cache lines). One device steps each parameter as one tensor;
# a slice of it in a flat buffer (or alone) sits elsewhere relative to a tensor's end.
# So each element is stepped where its position relative to a tensor's end is the one it
# has on one device: ``fused_pieces`` builds such pieces of FUSED_BLOCK elements.

#: elements per block of the pieces above; a multiple of every vector length
FUSED_BLOCK = 64


@dataclass(frozen=True, slots=True)
class LocalSlice:
    """One parameter's local elements in a flat buffer, for :func:`fused_pieces`.

    ``last`` holds the global flat indices (increasing) of the local elements that lie
    in the parameter's last partial block ``[numel - numel % FUSED_BLOCK, numel)``; they
    are the slice's last ``len(last)`` elements (local elements are in global order).
    """

    offset: int  # of the slice's first element in the flat buffer
    length: int  # local elements
    numel: int  # elements of the whole parameter
    last: tuple[int, ...]  # global indices, increasing; at most FUSED_BLOCK - 1

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length < 0 or self.numel < self.length:
            raise ValueError(f"LocalSlice needs 0 <= offset, 0 <= length <= numel, got {self}")
        first = self.numel - self.numel % FUSED_BLOCK
        if len(self.last) > self.length or any(not first <= i < self.numel for i in self.last) \
                or any(b <= a for a, b in zip(self.last, self.last[1:], strict=False)):
            raise ValueError(f"LocalSlice.last must be increasing indices in [{first}, "
                             f"{self.numel}) and at most length={self.length} of them, "
                             f"got {self.last}")


@dataclass(frozen=True, slots=True)
class FusedPieces:
    """How to step a flat buffer with torch's fused kernel so that every element gets
    the bits one device gives it (see ``FUSED_BLOCK``): each ``views`` range
    of the buffer as its own tensor, then each ``rows`` zero row, into which element
    ``src[k]`` of the buffer is copied at index ``dst[k]`` of the rows laid end to end."""

    views: tuple[tuple[int, int], ...]  # (offset, length) in the flat buffer
    rows: tuple[int, ...]  # lengths of the zero rows
    src: tuple[int, ...]  # offsets in the flat buffer
    dst: tuple[int, ...]  # indices in the rows, end to end


def fused_pieces(slices: Sequence[LocalSlice]) -> FusedPieces:
    """The pieces of ``FUSED_BLOCK`` for local slices of one flat buffer
    (disjoint, any order): consecutive body elements share views and rows.

    With B = FUSED_BLOCK = 64, a multiple of every V (a power of two, at most 64 bytes),
    element i of a parameter of N elements is in the tail iff i >= N - N % V, hence:
      - i < N - N % B: in the body for every V. Stepped in any tensor of a multiple of B
        elements it gets the bits one device gives it: runs of such elements are stepped
        as views of whole multiples of B, the rest of a run (< B) copied into a zero row
        of B elements;
      - i >= N - N % B (the parameter's last partial block, N % B elements): at index
        i - (N - N % B) of a tensor of N % B elements it is in the tail for exactly the V
        for which it is on one device. The block is stepped as a view when the slice holds
        all of it, else its local elements are copied into a zero row of N % B elements.
        A whole block may end a view of body elements whose length is a multiple of B (a
        parameter held whole is then one view, as on one device).
    Neither needs V. Zero rows stay zero where no element is copied in (zero param, grad
    and moments), and nothing outside the slices (padding) is stepped.
    """
    views: list[tuple[int, int]] = []
    rows: list[int] = []
    src: list[int] = []
    dst: list[int] = []

    def row(length: int, at: int, index: Sequence[int]) -> None:
        base = sum(rows)
        rows.append(length)
        src.extend(range(at, at + len(index)))
        dst.extend(base + j for j in index)

    run: list[int] = []  # [start, end) of body elements not yet placed

    def flush() -> None:
        if run:
            start, end = run
            whole = (end - start) - (end - start) % FUSED_BLOCK
            if whole:
                views.append((start, whole))
            if start + whole < end:
                row(FUSED_BLOCK, start + whole, range(end - start - whole))
            run.clear()

    for sl in sorted(slices, key=lambda s: s.offset):
        head = sl.length - len(sl.last)
        if head:
            if run and run[1] == sl.offset:
                run[1] += head
            else:
                flush()
                run[:] = [sl.offset, sl.offset + head]
        if sl.last:
            k = sl.numel % FUSED_BLOCK
            at = sl.offset + head
            index = [i - (sl.numel - k) for i in sl.last]
            if index != list(range(k)):
                flush()
                row(k, at, index)
            elif run and run[1] == at and (at - run[0]) % FUSED_BLOCK == 0:
                views.append((run[0], at + k - run[0]))  # body, then the block at its end
                run.clear()
            else:
                flush()
                views.append((at, k))
    flush()
    return FusedPieces(tuple(views), tuple(rows), tuple(src), tuple(dst))


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
    capturable: bool = False, differentiable: bool = False, uniform: bool = False,
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
    ``uniform``: the caller knows that the parameters share one device and dtype (a
    step-loop bucket's), so torch would take the lists as one group:
    ``_multi_tensor_adam_host_steps_``'s path checks nothing more of them.
    """
    if not params:
        return
    if foreach is None and not fused:
        tensor_hp = any(isinstance(h, Tensor) for h in (lr, beta1, beta2))
        foreach = (len({p.device for p in params}) == 1 and not differentiable
                   and not (tensor_hp and not capturable))
    if (foreach and not fused and not capturable and not differentiable
            and _host_steps_apply(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr,
                                  beta1, beta2, amsgrad, uniform)):
        _multi_tensor_adam_host_steps_(
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr=lr, beta1=beta1,
            beta2=beta2,
            eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
            decoupled=decoupled)
        return
    _torch_adam(
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
        foreach=bool(foreach) and not fused, fused=fused, capturable=capturable,
        differentiable=differentiable, amsgrad=amsgrad, beta1=beta1, beta2=beta2, lr=lr,
        weight_decay=weight_decay, eps=eps, maximize=maximize, decoupled_weight_decay=decoupled,
        grad_scale=None, found_inf=None,
    )


def _host_steps_apply(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
                      exp_avg_sqs: list[Tensor], max_exp_avg_sqs: list[Tensor], steps: list[Tensor],
                      lr: float | Tensor, beta1: float | Tensor, beta2: float | Tensor,
                      amsgrad: bool, uniform: bool) -> bool:
    """Whether ``_multi_tensor_adam_host_steps_``'s path takes this call (a device read
    costs ~0.1 us a tensor: ``uniform`` skips those the caller vouches for)."""
    if isinstance(lr, Tensor) or isinstance(beta1, Tensor) or isinstance(beta2, Tensor):
        return False
    p0 = params[0]
    device, dtype = p0.device, p0.dtype
    if not dtype.is_floating_point:
        return False
    if uniform:  # torch groups the lists by the parameters' device and dtype alone: one group
        lists: tuple[list[Tensor], ...] = ()
    else:
        lists = (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs) if amsgrad else (
            params, grads, exp_avgs, exp_avg_sqs)
    for ts in lists:
        if len(ts) != len(params):
            return False
        for t in ts:
            if t.device != device or t.dtype != dtype:
                return False
    return len(steps) == len(params) and all(type(s) is Tensor and s.is_cpu and not s.dim()
                                             for s in steps)


def _multi_tensor_adam_host_steps_(
    params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
    max_exp_avg_sqs: list[Tensor], steps: list[Tensor], *, lr: float, beta1: float, beta2: float,
    eps: float, weight_decay: float, amsgrad: bool, maximize: bool, decoupled: bool,
) -> None:
    """torch.optim.adam._multi_tensor_adam's non-capturable path, op for op, with the step
    counts read in one stack.

    torch's multi-tensor Adam (non-capturable) reads every parameter's step count back
    with its own .item(), twice, and regroups the lists by device and dtype: host work per
    parameter on every step, whatever its size (figure in docs/decisions.md). Where every
    tensor of a call is on one device with one floating dtype and every step count is a
    host tensor (the non-capturable, non-fused state), this runs the same foreach ops in
    the same order with the same Python-float bias corrections, reading the counts in one
    stack; where they are all equal (every parameter stepped every time: the usual case)
    each op takes one scalar instead of a list of equal ones. An elementwise op rounds its
    scalar to the tensors' opmath type either way, so the bits are torch's
    (tests/test_math_functional.py checks them against torch's _multi_tensor_adam, mixed
    counts, amsgrad, maximize and both decays included). Anything else goes to torch."""
    if maximize:
        grads = foreach_neg(grads)
    foreach_add_(steps, torch.tensor(1.0, device="cpu"), alpha=1.0)
    if weight_decay != 0:
        if decoupled:
            foreach_mul_(params, 1 - lr * weight_decay)
        elif maximize:
            foreach_add_(grads, params, alpha=weight_decay)
        else:
            grads = foreach_add(grads, params, alpha=weight_decay)
    foreach_lerp_(exp_avgs, grads, 1 - beta1)
    foreach_mul_(exp_avg_sqs, beta2)
    foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    del grads
    counts = torch.stack(steps).tolist() if len(steps) > 1 else [steps[0].item()]
    first = counts[0]
    if all(c == first for c in counts):
        step_size: float | list[float] = (lr / (1 - beta1 ** first)) * -1
        bias_correction2_sqrt: float | list[float] = (1 - beta2 ** first) ** 0.5
    else:
        step_size = [(lr / (1 - beta1 ** c)) * -1 for c in counts]
        bias_correction2_sqrt = [(1 - beta2 ** c) ** 0.5 for c in counts]
    if amsgrad:
        foreach_maximum_(max_exp_avg_sqs, exp_avg_sqs)
        exp_avg_sq_sqrt = foreach_sqrt(max_exp_avg_sqs)
    else:
        exp_avg_sq_sqrt = foreach_sqrt(exp_avg_sqs)
    foreach_div_(exp_avg_sq_sqrt, bias_correction2_sqrt)
    foreach_add_(exp_avg_sq_sqrt, eps)
    foreach_addcdiv_(params, exp_avgs, exp_avg_sq_sqrt, step_size)


def adam_fused_pieces_(
    pieces: FusedPieces, param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor,
    max_exp_avg_sq: Tensor | None, *, step: float, lr: float, beta1: float, beta2: float,
    eps: float, weight_decay: float, amsgrad: bool, maximize: bool, decoupled: bool,
) -> None:
    """torch's fused Adam(W) on 1-D flat buffers, in place, stepped in ``pieces`` (from
    :func:`fused_pieces`) so that each element gets the bits torch's fused kernel gives
    it on one device (see ``FUSED_BLOCK``). ``step`` is the count before this
    update, as in torch's ``state["step"]``; ``grad`` is read only."""
    tensors = [param, grad, exp_avg, exp_avg_sq]
    if amsgrad:
        if max_exp_avg_sq is None:
            raise ValueError("amsgrad=True needs a max_exp_avg_sq tensor, got None")
        tensors.append(max_exp_avg_sq)
    lists = [[t.narrow(0, o, n) for o, n in pieces.views] for t in tensors]
    if pieces.rows:
        src = torch.tensor(pieces.src, dtype=torch.int64, device=param.device)
        dst = torch.tensor(pieces.dst, dtype=torch.int64, device=param.device)
        rows = [t.new_zeros(sum(pieces.rows)).index_copy_(0, dst, t.index_select(0, src))
                for t in tensors]
        for lst, r in zip(lists, rows, strict=True):
            lst.extend(r.split(pieces.rows))
    steps = list(torch.full((len(lists[0]),), step, dtype=torch.float32,
                            device=param.device).unbind())
    adam_foreach_(lists[0], lists[1], lists[2], lists[3], lists[4] if amsgrad else [], steps,
                  lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                  amsgrad=amsgrad, maximize=maximize, decoupled=decoupled, fused=True)
    if pieces.rows:
        for i, (t, r) in enumerate(zip(tensors, rows, strict=True)):
            if i != 1:  # the gradient is read only
                t.index_copy_(0, src, r.index_select(0, dst))


def check_adam_hparams(lr: float | Tensor, betas: tuple[float, float], eps: float,
                       weight_decay: float, *, foreach: bool | None = None,
                       capturable: bool = False) -> None:
    """torch.optim.Adam's argument checks, with the same messages."""
    if isinstance(lr, Tensor):
        if foreach and not capturable:
            raise ValueError("lr as a Tensor is not supported for capturable=False and "
                             "foreach=True")
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
                raise ValueError(f"betas[{i}] as a Tensor is not supported for capturable=False "
                                 "and foreach=True")
            if b.numel() != 1:
                raise ValueError(f"Tensor betas[{i}] must be 1-element")
