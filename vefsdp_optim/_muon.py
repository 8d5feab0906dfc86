"""Muon with torch.optim.Muon's numerics; Newton-Schulz once per matrix, on an owner."""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from vefsdp_optim._kernels import fast_addmm_available, fast_mm_nt_available
from vefsdp_optim._math import (
    NS_COEFFICIENTS,
    check_adam_hparams,
    check_ns_coefficients,
    muon_adjust_lr,
    zeropower_via_newtonschulz,
)
from vefsdp_optim._math._muon import (
    Int8Momentum,
    _add_,  # noqa: F401 - re-exported for tests
    muon_apply_,
    muon_momentum_,
)
from vefsdp_optim._math._muon_int8 import MOMENTUM_BLOCK, empty_momentum
from vefsdp_optim._math._newton_schulz import (
    NS_EPS,
    NS_STEPS,
    NsCoefficients,
    muon_batch_view,
    muon_block_unit,
    muon_blocks,
    muon_blocks_cost,
    newtonschulz_batch_exact,
    zeropower_via_newtonschulz_batched,
)
from vefsdp_optim._math._normuon import (
    normuon_batch_exact,
    normuon_normalize_,
    normuon_normalize_batched_,
)
from vefsdp_optim._math._quant8 import dynamic_code_map
from vefsdp_optim.comm import ShardedView
from vefsdp_optim.sharding import (
    BoxShard,
    Elementwise,
    FlatBlocks,
    RaggedShard,
    Requirement,
    RowBlocks,
    WholeTensor,
)

from ._adam_state import adam_bucket_, adam_state_spec
from ._block_optimizer import BlockOptimizer
from ._checkpoint import ELEMENTWISE, LOCAL, REPLICATED
from ._qk_clip import QKClip, qk_clip_defaults
from ._registry import register_optimizer
from ._step_loop import StepItem

__all__ = ["Muon", "muon_defaults"]


@dataclass(frozen=True)
class _MuonPlan:
    """How one Muon parameter splits into separately orthogonalised blocks
    ([Note: Muon blocks] in _math/_newton_schulz.py) and what it asks of the planner."""

    requirement: Requirement
    offsets: tuple[int, ...]  # flat offset of each block
    blocks: tuple[tuple[int, int], ...]  # (rows, cols) of each block
    simple: bool  # one block: the whole (dim 0, rest) matrix (today's path)
    uniform: bool  # every block has the same (rows, cols): one lr adjustment
    cost: float  # Newton-Schulz cost of all the blocks (muon_blocks_cost), for owner balancing

    def span(self, start: int, length: int) -> range:
        """Indices of the blocks that intersect flat ``[start, start + length)``."""
        lo = bisect.bisect_right(self.offsets, start) - 1
        hi = bisect.bisect_left(self.offsets, start + length)
        return range(max(lo, 0), hi)


@functools.lru_cache(maxsize=1024)
def _muon_plan(shape: tuple[int, ...], flatten: bool, split_sizes: tuple[int, ...] | None) -> _MuonPlan:
    blocks = muon_blocks(shape, flatten, split_sizes)
    unit = muon_block_unit(shape, flatten, split_sizes)
    numel = math.prod(shape)
    if unit >= numel:
        req: Requirement = WholeTensor()
    elif not flatten and len(shape) == 3 and unit == shape[1] * shape[2]:
        req = RowBlocks(1)  # whole experts: FSDP2's Shard(0) already satisfies it
    else:
        req = FlatBlocks(unit)
    return _MuonPlan(req, tuple(b[0] for b in blocks), tuple((r, c) for _, r, c in blocks),
                     simple=len(blocks) == 1, uniform=len({(r, c) for _, r, c in blocks}) == 1,
                     cost=muon_blocks_cost(shape, flatten, split_sizes))


# (shape, flatten, split_sizes, num_heads) of a param group -> its _MuonPlan: a step asks
# for the plan of every matrix several times (requirement, cost, compute, apply)
_PLANS: dict[tuple, _MuonPlan] = {}


def muon_defaults(
    *, lr: float, weight_decay: float, momentum: float, nesterov: bool, ns_coefficients: object,
    eps: float, ns_steps: int, adjust_lr_fn: str | None, betas: tuple[float, float], adamw_eps: float,
    flatten: bool | None, split_sizes: Sequence[int] | None, adjust_lr_fns: tuple[str | None, ...],
    num_heads: int | None = None, momentum_dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """Muon's param-group defaults from its constructor arguments, validated (ValueError
    naming the bad value, with torch.optim.Muon's messages where it has one)."""
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not 0.0 <= lr:
        raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
    if not 0.0 <= momentum:
        raise ValueError(f"momentum should be >= 0 but is: {momentum}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"weight decay should be >= 0 but is: {weight_decay}")
    if adjust_lr_fn not in adjust_lr_fns:
        raise ValueError(
            f"Adjust learning rate function {adjust_lr_fn} is not supported; "
            f"use one of {', '.join(map(repr, adjust_lr_fns))}")
    if not (isinstance(ns_steps, int) and 0 < ns_steps < 100):
        raise ValueError(f"ns_steps must be an int in [1, 100), got {ns_steps!r}")
    check_adam_hparams(lr, betas, adamw_eps, weight_decay)
    return dict(
        lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
        ns_coefficients=check_ns_coefficients(ns_coefficients), eps=eps, ns_steps=ns_steps,
        adjust_lr_fn=adjust_lr_fn, use_muon=True, betas=tuple(betas), adamw_eps=adamw_eps,
        flatten=flatten, split_sizes=split_sizes, num_heads=_check_heads(num_heads),
        momentum_dtype=_check_momentum_dtype(momentum_dtype),
    )


def _check_momentum_dtype(dtype: object) -> torch.dtype | None:
    if dtype is None or dtype == torch.int8:
        return dtype
    raise ValueError(f"momentum_dtype must be None (the parameter's dtype, as torch.optim.Muon) or "
                     f"torch.int8 (8-bit block-wise momentum), got {dtype!r}")


def _check_heads(num_heads: object) -> int | None:
    if num_heads is None:
        return None
    if isinstance(num_heads, bool) or not isinstance(num_heads, int):
        raise TypeError(f"num_heads must be a positive int or None, got {num_heads!r}")
    if num_heads < 1:
        raise ValueError(f"num_heads must be >= 1, got {num_heads}")
    return num_heads


_FLATTEN_HELP = (
    "set the group key flatten=True to orthogonalise it as one (dim 0, rest) matrix (the "
    "convolution convention), or flatten=False to orthogonalise each [..., m, n] slice over the "
    "leading dims alone, as a separate 2-D parameter (MoE expert weights [experts, out, in])")


@register_optimizer("muon")
class Muon(QKClip, BlockOptimizer):
    """``torch.optim.Muon`` for whole models, on plain, FSDP2 and fully_shard parameters.

    For a parameter with 2 or more dims (viewed as ``(dim 0, rest)``) the update is
    torch.optim.Muon's: momentum (kept sharded, elementwise), Newton-Schulz on the
    whole matrix, decoupled weight decay. Newton-Schulz runs exactly once per matrix
    in the world, on an owner rank chosen to balance ``m * n * min(m, n)``, on exactly
    the full matrix a single device would see; only the momentum-combined update goes
    to the owner (in bfloat16, Newton-Schulz's first step) and only the orthogonalized
    update (bfloat16) comes back.

    1-D parameters, and every parameter of a group with ``use_muon=False`` (embeddings,
    output heads), are updated by AdamW inside the same optimizer, with the group keys
    ``betas`` (default (0.9, 0.95)) and ``adamw_eps`` (default 1e-8; in a group with
    ``use_muon=False`` an explicit ``eps`` means AdamW's eps), and the group's ``lr``
    and ``weight_decay``.

    Block structure, per param group (Dion's names):

    * ``flatten``: for parameters of 3 or more dims, ``True`` orthogonalises one
      ``(dim 0, rest)`` matrix; ``False`` treats the tensor as a batch of matrices over
      its leading dims (MoE experts ``[E, out, in]``): each ``[m, n]`` slice gets its own
      Newton-Schulz and lr adjustment, exactly as a separate 2-D parameter. A group with
      such a parameter must set it (ValueError otherwise). Whole experts stay on single
      ranks (FSDP2's ``Shard(0)`` already does this: no exchange).
    * ``split_sizes``: row-block sizes of each matrix (e.g. ``[q_rows, kv_rows, kv_rows]``
      of a fused QKV projection), summing to its rows; each block is updated exactly as
      a separate parameter of that shape.
    * ``num_heads``: per-head Muon (Dion's key): each matrix viewed as ``num_heads``
      equal row blocks (attention heads), each updated exactly as a separate parameter
      (``split_sizes`` of ``rows // num_heads`` each; the rows must divide; not together
      with ``split_sizes``). The planner keeps heads whole on single ranks.
    * ``momentum_dtype``: ``None`` (the parameter's dtype, as torch.optim.Muon) or
      ``torch.int8``: the momentum block-wise quantized in 256-element blocks of the
      flat order with 8-bit Adam's signed code map, 1.016 bytes per element
      ([Note: 8-bit Muon momentum] in _math/_muon_int8.py); its blocks stay whole on
      single ranks, so the result is the same at every world size.

    ``ns_coefficients="polar_express"`` replaces the fixed quintic by Polar Express's
    per-iteration coefficients and input scale (arXiv 2505.16932, Algorithm 1:
    [Note: Polar Express] in _math/_polar_express.py), ``ns_steps`` iterations of it.

    QK-clip (MuonClip, Kimi K2): ``qk_clip_threshold`` (None: off) and ``qk_clip_alpha``
    (group keys), :meth:`register_qk_clip` and :meth:`qk_clip_` after each step
    ([Note: QK-clip] in _math/_qk_clip.py).
    """

    #: accepted ``adjust_lr_fn`` values: torch.optim.Muon's (``"spectral_unclamped"``,
    #: ``lr * sqrt(rows / cols)``, since torch 2.14; accepted here on any torch)
    adjust_lr_fns: tuple[str | None, ...] = (None, "original", "match_rms_adamw", "spectral_unclamped")

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: NsCoefficients = NS_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        *,
        betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        flatten: bool | None = None,
        split_sizes: Sequence[int] | None = None,
        num_heads: int | None = None,
        momentum_dtype: torch.dtype | None = None,
        qk_clip_threshold: float | None = None,
        qk_clip_alpha: float = 0.5,
    ) -> None:
        super().__init__(params, muon_defaults(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
            ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
            betas=betas, adamw_eps=adamw_eps, flatten=flatten, split_sizes=split_sizes,
            adjust_lr_fns=self.adjust_lr_fns, num_heads=num_heads, momentum_dtype=momentum_dtype)
            | qk_clip_defaults(qk_clip_threshold, qk_clip_alpha))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if param_group.get("use_muon", True) is False and "eps" in param_group:
            param_group.setdefault("adamw_eps", param_group["eps"])
        use = param_group.get("use_muon", True)
        if not isinstance(use, bool):
            raise TypeError(f"use_muon must be a bool, got {use!r}")
        flatten = param_group.get("flatten", self.defaults.get("flatten"))
        if flatten is not None and not isinstance(flatten, bool):
            raise TypeError(f"flatten must be True, False or None, got {flatten!r}")
        split = param_group.get("split_sizes", self.defaults.get("split_sizes"))
        if split is not None:
            if isinstance(split, (str, bytes, torch.Tensor)) or not isinstance(split, Sequence):
                raise TypeError(f"split_sizes must be a sequence of positive ints (row-block sizes), "
                                f"got {split!r}")
            param_group["split_sizes"] = tuple(split)
        if "num_heads" in param_group:
            param_group["num_heads"] = _check_heads(param_group["num_heads"])
        if "momentum_dtype" in param_group:
            param_group["momentum_dtype"] = _check_momentum_dtype(param_group["momentum_dtype"])
        if "ns_coefficients" in param_group:
            param_group["ns_coefficients"] = check_ns_coefficients(param_group["ns_coefficients"])
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            for p in group["params"]:
                if self._is_muon(p.shape, group):
                    self._plan(p.shape, group)  # raises ValueError on a bad flatten / split_sizes
        except ValueError:
            self.param_groups.pop()
            raise
        if any(p.device.type == "cpu" and self._is_muon(p.shape, group) for p in group["params"]):
            # the CPU kernels' one-time probes ([Note: fast bfloat16 addmm]) here, not in a step
            fast_addmm_available()
            fast_mm_nt_available()

    @staticmethod
    def _is_muon(shape: torch.Size, group: dict[str, Any]) -> bool:
        return bool(group["use_muon"]) and len(shape) >= 2

    @staticmethod
    def _plan(shape: Sequence[int], group: dict[str, Any]) -> _MuonPlan:
        split = group.get("split_sizes")
        flatten = group.get("flatten")
        key = (tuple(shape), flatten is None, flatten is not False,
               tuple(split) if isinstance(split, list) else split, group.get("num_heads"))
        try:
            plan = _PLANS.get(key)
        except TypeError:  # an unhashable value: _make_plan names what is wrong with it
            return Muon._make_plan(shape, group)
        if plan is None:
            plan = Muon._make_plan(shape, group)
            if len(_PLANS) > 4096:
                _PLANS.clear()
            _PLANS[key] = plan
        return plan

    @staticmethod
    def _make_plan(shape: Sequence[int], group: dict[str, Any]) -> _MuonPlan:
        shape = tuple(int(d) for d in shape)
        flatten = group.get("flatten")
        if flatten is None and len(shape) >= 3:
            raise ValueError(
                f"Muon got a parameter of shape {shape} in a group without the key 'flatten': "
                + _FLATTEN_HELP)
        split = Muon._split_sizes(shape, group)
        try:
            return _muon_plan(shape, flatten is not False, split)
        except ValueError as e:
            if split is None:
                raise
            batch, rows, cols = muon_batch_view(shape, flatten is not False)
            raise ValueError(f"bad split_sizes for a Muon parameter of shape {shape} (matrices of "
                             f"{rows} x {cols}): {e}") from None

    @staticmethod
    def _split_sizes(shape: tuple[int, ...], group: dict[str, Any]) -> tuple[int, ...] | None:
        """The group's row blocks of each matrix: ``split_sizes``, or ``num_heads`` equal ones."""
        split = group.get("split_sizes")
        heads = group.get("num_heads")
        if heads is None:
            return None if split is None else tuple(split)
        if split is not None:
            raise ValueError(f"a Muon group sets both num_heads={heads} and split_sizes={tuple(split)}; "
                             "set one (num_heads: equal row blocks; split_sizes: any row blocks)")
        _, rows, cols = muon_batch_view(shape, group.get("flatten") is not False)
        if rows % heads:
            raise ValueError(f"num_heads={heads} does not divide the {rows} rows of the {rows} x {cols} "
                             f"matrices of a Muon parameter of shape {shape}")
        return (rows // heads,) * heads

    def requirement(self, shape: torch.Size, group: dict[str, Any]) -> Requirement:
        if not self._is_muon(shape, group):
            return Elementwise()
        req = self._plan(shape, group).requirement
        if group.get("momentum_dtype") is torch.int8 and not req.needs_whole:
            # whole blocks and whole 256-element momentum blocks ([Note: 8-bit Muon momentum])
            return FlatBlocks(math.lcm(req.unit(tuple(shape)), MOMENTUM_BLOCK))
        return req

    structural_keys = ("use_muon", "momentum_dtype")
    plan_keys = ("flatten", "split_sizes", "num_heads")  # _plan() reads them ([Note: step plan])

    def checkpoint_spec(self, shape: torch.Size, group: dict[str, Any]) -> dict[str, str | int]:
        return self._momentum_spec(group) if self._is_muon(shape, group) else adam_state_spec()

    @staticmethod
    def _momentum_spec(group: dict[str, Any]) -> dict[str, str | int]:
        if group.get("momentum_dtype") is torch.int8:
            return {"momentum_codes": ELEMENTWISE, "momentum_absmax": MOMENTUM_BLOCK, "momentum_step": REPLICATED,
                    "compute": LOCAL}
        return {"momentum_buffer": ELEMENTWISE}

    def state_layout(self, view: ShardedView, group: dict[str, Any]) -> RaggedShard | BoxShard | None:
        if group.get("momentum_dtype") is torch.int8 and self._is_muon(view.shape, group):
            return super().state_layout(view, group)  # with the compute slices ([Note: 8-bit Muon momentum])
        return view.layout  # momentum stays sharded like the parameter

    def cost(self, shape: torch.Size, group: dict[str, Any]) -> float:
        """Newton-Schulz cost of all the blocks ([Note: Muon blocks]): each QKV block or
        expert alone, not the fused matrix."""
        if not self._is_muon(shape, group):
            return float(math.prod(shape))
        return self._plan(shape, group).cost

    # hooks: momentum on the local shard, Newton-Schulz on the owner, apply locally

    def gather_inputs(self, item: StepItem) -> list[torch.Tensor]:
        if not self._is_muon(item.view.shape, item.group):
            return super().gather_inputs(item)
        if item.group.get("momentum_dtype") is torch.int8:
            return [item.grad]  # the momentum steps on the compute slices (compute_bucket)
        g, group = item.grad, item.group
        state = self.state[item.param]
        buf = state.get("momentum_buffer")
        if buf is None:
            buf = state["momentum_buffer"] = torch.zeros_like(g, memory_format=torch.preserve_format)
        # Newton-Schulz's bfloat16 input, cast before the exchange ([Note: Muon's phases])
        return [muon_momentum_(g, buf, momentum=group["momentum"], nesterov=group["nesterov"])]

    def compute_bucket(self, items: list[StepItem], inputs: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        out: list[list[torch.Tensor]] = [[] for _ in items]
        adam_idx = [i for i, it in enumerate(items) if not self._is_muon(it.view.shape, it.group)]
        if adam_idx:  # one param group per bucket: its lr, betas, adamw_eps, weight_decay
            adam_bucket_([self.state[items[i].param] for i in adam_idx], [inputs[i][0] for i in adam_idx],
                         [inputs[i][1] for i in adam_idx], group=items[0].group, eps_key="adamw_eps")
            for i in adam_idx:
                out[i] = [inputs[i][0]]
        # every whole block this rank orthogonalises in this bucket: one batched
        # Newton-Schulz per block shape across parameters ([Note: batched Newton-Schulz])
        updates: list[torch.Tensor] = []
        blocks: list[list[tuple[int, int, int]]] = []
        where: list[tuple[int, _MuonPlan, int]] = []  # (item, plan, flat offset of its slice)
        for i, it in enumerate(items):
            if i in adam_idx:
                continue
            (x,) = inputs[i]
            if x.numel() and it.group.get("momentum_dtype") is torch.int8:
                x = self._int8_momentum(it, x)
            if x.numel() == 0:  # not the owner of this matrix
                out[i] = [x.to(self._update_dtype(it))]
                continue
            plan = self._plan(it.view.shape, it.group)
            start = 0 if plan.simple else it.compute.local(it.view.rank)[0]
            where.append((i, plan, start))
            updates.append(x)
            blocks.append(_whole_blocks(it, plan, start, x.numel()))
        if updates:  # one param group per bucket: one Newton-Schulz
            results = self._orthogonalise([(items[i], plan, start) for i, plan, start in where], updates, blocks)
            for (i, _, _), r in zip(where, results, strict=True):
                out[i] = [r]
        return out

    def _int8_momentum(self, item: StepItem, grad: torch.Tensor) -> torch.Tensor:
        """The bfloat16 Newton-Schulz input of a compute slice with 8-bit momentum."""
        state = self.state[item.param]
        last = state.get("compute")
        if last is not None and last != item.compute:
            raise NotImplementedError(
                f"Muon with momentum_dtype=torch.int8: a parameter of shape {tuple(item.view.shape)} would "
                f"step on other ranks than at its last step ({item.compute} instead of {last}), which lack "
                "its 8-bit momentum: a parameter of its param group stepped without a gradient and moved "
                "the owners; give every parameter of the group a gradient at every step (zeros rather "
                "than None)")
        state["compute"] = item.compute
        if "momentum_codes" not in state:
            state["momentum_codes"], state["momentum_absmax"] = empty_momentum(grad.numel(), grad.device)
            state["momentum_step"] = torch.tensor(0, dtype=torch.int64)  # the dither's phase, a host counter
        codes = self.__dict__.setdefault("_signed_codes", {})  # device -> 8-bit Adam's signed code map
        code = codes.get(grad.device)
        if code is None:
            code = codes[grad.device] = dynamic_code_map(True).to(grad.device, non_blocking=True)
        group = item.group
        # the rounding keys on the flat index in the whole parameter ([Note: no dead zone])
        if not isinstance(item.compute, RaggedShard):  # FlatBlocks and whole requirements snap to flat runs
            raise AssertionError(f"8-bit Muon momentum on a compute layout of boxes: {item.compute}")
        offset = item.compute.local(item.view.rank)[0]
        momentum = Int8Momentum(state["momentum_codes"], state["momentum_absmax"], code, state["momentum_step"],
                                offset)
        return muon_momentum_(grad, momentum, momentum=group["momentum"], nesterov=group["nesterov"])

    # what a subclass changes after Newton-Schulz (NorMuon's normalization)

    def _update_dtype(self, item: StepItem) -> torch.dtype:
        """The dtype of the update a Muon matrix's compute sends back: Newton-Schulz's
        bfloat16 (the same on every rank: the exchange groups tensors by dtype)."""
        return torch.bfloat16

    def _orthogonalise(self, where: list[tuple[StepItem, _MuonPlan, int]], updates: list[torch.Tensor],
                       blocks: list[list[tuple[int, int, int]]]) -> list[torch.Tensor]:
        """The updates sent back for the compute slices this rank orthogonalises in a
        bucket (one param group): ``updates[k]`` is the Newton-Schulz input of item
        ``where[k] = (item, plan, start)``'s slice (1-D, flat order, whole blocks from flat
        offset ``start``; ``blocks[k]``, offsets in the slice)."""
        return muon_orthogonalise_batched(updates, blocks, *_ns_args(where[0][0].group))

    def apply_results(self, item: StepItem, outputs: list[torch.Tensor]) -> None:
        if not self._is_muon(item.view.shape, item.group):
            return super().apply_results(item, outputs)
        (ortho,) = outputs
        p, group = item.view.local, item.group
        lr, wd = group["lr"], group["weight_decay"]
        plan = self._plan(item.view.shape, group)
        if plan.uniform:
            muon_apply_(p, ortho, lr=lr, weight_decay=wd,
                        adjusted_lr=muon_adjust_lr(lr, group["adjust_lr_fn"], plan.blocks[0]))
            return
        # blocks of several shapes: each block's own lr adjustment, on its part of this slice
        if not p.numel():
            p.mul_(1 - lr * wd)
            return
        layout, rank = item.view.layout, item.view.rank
        if isinstance(layout, RaggedShard):
            span = plan.span(*layout.local(rank))
        else:  # a tensor-parallel box: each block's elements are one run of it
            span = range(len(plan.blocks))
        adjusted = {rc: muon_adjust_lr(lr, group["adjust_lr_fn"], rc) for rc in set(plan.blocks)}
        runs: list[tuple[int, int, float]] = []  # (lo, hi, adjusted lr) in this slice
        for b in span:
            rows, cols = plan.blocks[b]
            lo = layout.count_below(rank, plan.offsets[b])
            hi = layout.count_below(rank, plan.offsets[b] + rows * cols)
            if lo == hi:
                continue
            a_lr = adjusted[plan.blocks[b]]
            if runs and a_lr == runs[-1][2] and lo == runs[-1][1]:
                runs[-1] = (runs[-1][0], hi, a_lr)
            else:
                runs.append((lo, hi, a_lr))
        muon_apply_(p, ortho, lr=lr, weight_decay=wd, adjusted_lr=runs)


class _ShapeBatch(NamedTuple):
    """Newton-Schulz of every block of one shape in a bucket's inputs ([Note: batched
    Newton-Schulz])."""

    rows: int
    cols: int
    members: list[tuple[int, int, int]]  # (input, its block index, flat offset) of each block
    ortho: torch.Tensor | list[torch.Tensor]  # (k, rows, cols) bf16 batch, or each block's result
    covers: str  # "input": the blocks are one input, in order; "each": each block a whole input; ""


def _newton_schulz_by_shape(
    updates: Sequence[torch.Tensor], blocks: Sequence[Sequence[tuple[int, int, int]]],
    ns_coefficients: NsCoefficients, ns_steps: int, eps: float,
) -> list[_ShapeBatch]:
    """Newton-Schulz of every block of ``updates`` (1-D; ``blocks[i]`` covers
    ``updates[i]``), one batch per block shape where :func:`newtonschulz_batch_exact`
    says it gives the per-block bits, per block elsewhere."""
    by_shape: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for i, bs in enumerate(blocks):
        for j, (a, rows, cols) in enumerate(bs):
            by_shape.setdefault((rows, cols), []).append((i, j, a))
    out = []
    for (rows, cols), members in by_shape.items():
        n, k = rows * cols, len(members)
        first = updates[members[0][0]]
        prefix = all(i == members[0][0] and a == j * n for j, (i, _, a) in enumerate(members))
        if prefix and first.numel() == k * n:
            covers = "input"
        elif all(a == 0 and n == updates[i].numel() for i, _, a in members) and \
                len({i for i, _, _ in members}) == k:
            covers = "each"
        else:
            covers = ""
        if k == 1 or not newtonschulz_batch_exact(k, rows, cols, first.device, ns_coefficients, ns_steps, eps,
                                                  torch.get_num_threads()):
            orthos = [zeropower_via_newtonschulz(updates[i][a:a + n].view(rows, cols), ns_coefficients,
                                                 ns_steps, eps) for i, _, a in members]
            out.append(_ShapeBatch(rows, cols, members, orthos, covers))
            continue
        if prefix:  # the first blocks of one input: a view
            batch = first[:k * n].view(k, rows, cols)
        else:
            batch = torch.stack([updates[i][a:a + n].view(rows, cols) for i, _, a in members])
        out.append(_ShapeBatch(rows, cols, members,
                               zeropower_via_newtonschulz_batched(batch, ns_coefficients, ns_steps, eps), covers))
    return out


def muon_orthogonalise_batched(
    updates: Sequence[torch.Tensor], blocks: Sequence[Sequence[tuple[int, int, int]]],
    ns_coefficients: NsCoefficients = NS_COEFFICIENTS, ns_steps: int = NS_STEPS, eps: float = NS_EPS,
) -> list[torch.Tensor]:
    """The batched form of ``_math.muon_orthogonalise`` ([Note: Muon's phases]):
    ``[muon_orthogonalise(x, b, ...) for x, b in zip(updates, blocks)]``, bit for bit, with
    one batched Newton-Schulz per block shape across all the inputs where
    :func:`newtonschulz_batch_exact` says it gives the per-block bits ([Note: batched
    Newton-Schulz]); per block elsewhere. Each ``blocks[i]`` covers ``updates[i]`` (1-D).
    The step loop runs it on the whole blocks a rank computes in a bucket."""
    results: list[torch.Tensor | None] = [None] * len(updates)
    for sb in _newton_schulz_by_shape(updates, blocks, ns_coefficients, ns_steps, eps):
        n = sb.rows * sb.cols
        if isinstance(sb.ortho, list):
            for (i, _, a), ortho in zip(sb.members, sb.ortho, strict=True):
                if a == 0 and n == updates[i].numel():  # a whole input: a view when wide
                    results[i] = ortho.reshape(-1)
                else:
                    _result(results, i, updates[i])[a:a + n].view(sb.rows, sb.cols).copy_(ortho)
        elif sb.covers == "input":
            results[sb.members[0][0]] = _flat_copy(sb.ortho)  # the whole input: a view when wide
        elif sb.covers == "each":  # whole inputs: views of one copy
            flat = _flat_copy(sb.ortho).view(len(sb.members), n)
            for (i, _, _), o in zip(sb.members, flat.unbind(0), strict=True):
                results[i] = o
        else:
            for j, (i, _, a) in enumerate(sb.members):
                _result(results, i, updates[i])[a:a + n].view(sb.rows, sb.cols).copy_(sb.ortho[j])
    for i, r in enumerate(results):
        if r is None:  # no blocks
            results[i] = torch.empty(0, dtype=torch.bfloat16, device=updates[i].device)
    return results  # type: ignore[return-value]


def normuon_orthogonalise_batched(
    updates: Sequence[torch.Tensor], blocks: Sequence[Sequence[tuple[int, int, int]]],
    variances: Sequence[Sequence[torch.Tensor]], beta2: float, dtype: torch.dtype,
    ns_coefficients: NsCoefficients = NS_COEFFICIENTS, ns_steps: int = NS_STEPS, eps: float = NS_EPS,
) -> list[torch.Tensor]:
    """NorMuon's orthogonalization of a bucket: :func:`muon_orthogonalise_batched`, then
    ``_math.normuon_normalize_blocks`` of each input with ``variances[i]`` (one per block
    of ``blocks[i]``, updated in place), bit for bit; returns 1-D ``dtype`` tensors. The
    blocks of one shape are normalized in one batch where :func:`normuon_batch_exact`
    says it gives the per-block bits ([Note: batched NorMuon normalization]), straight
    from Newton-Schulz's batch (or its per-block results) into the results (no bfloat16
    copy in between)."""
    results: list[torch.Tensor | None] = [None] * len(updates)
    threads = torch.get_num_threads()
    for sb in _newton_schulz_by_shape(updates, blocks, ns_coefficients, ns_steps, eps):
        rows, cols, k = sb.rows, sb.cols, len(sb.members)
        n = rows * cols
        vs = [variances[i][j] for i, j, _ in sb.members]
        device = updates[sb.members[0][0]].device
        # batched even where Newton-Schulz was not (its results one by one into the batch)
        if not normuon_batch_exact(k, rows, cols, dtype, device, beta2, threads):
            for m, ((i, _, a), v) in enumerate(zip(sb.members, vs, strict=True)):
                dst = _result(results, i, updates[i], dtype)[a:a + n].view(rows, cols)
                normuon_normalize_(sb.ortho[m], v, beta2, out=dst)
            continue
        if sb.covers == "input":
            i = sb.members[0][0]
            dst = results[i] = torch.empty(k * n, dtype=dtype, device=device)
            normuon_normalize_batched_(sb.ortho, vs, beta2, out=dst.view(k, rows, cols))
        elif sb.covers == "each":  # whole inputs: views of one buffer
            dst = torch.empty(k, n, dtype=dtype, device=device)
            normuon_normalize_batched_(sb.ortho, vs, beta2, out=dst.view(k, rows, cols))
            for (i, _, _), o in zip(sb.members, dst.unbind(0), strict=True):
                results[i] = o
        else:
            dst = normuon_normalize_batched_(sb.ortho, vs, beta2)
            for m, (i, _, a) in enumerate(sb.members):
                _result(results, i, updates[i], dtype)[a:a + n].view(rows, cols).copy_(dst[m])
    for i, r in enumerate(results):
        if r is None:  # no blocks
            results[i] = torch.empty(0, dtype=dtype, device=updates[i].device)
    return results  # type: ignore[return-value]


def _ns_args(group: dict[str, Any]) -> tuple[NsCoefficients, int, float]:
    """(coefficients, steps, eps) of a param group's Newton-Schulz, hashable."""
    coeffs = group["ns_coefficients"]
    return coeffs if isinstance(coeffs, str) else tuple(coeffs), group["ns_steps"], group["eps"]


def _whole_blocks(it: StepItem, plan: _MuonPlan, start: int, length: int) -> list[tuple[int, int, int]]:
    """(offset in the slice, rows, cols) of each block of the compute slice ``[start,
    start + length)`` of item ``it``, which must hold whole blocks only."""
    found, done = [], 0
    for b in plan.span(start, length):
        (rows, cols), a = plan.blocks[b], plan.offsets[b] - start
        if a < 0 or a + rows * cols > length:
            raise RuntimeError(f"Muon block at flat offset {plan.offsets[b]} of a parameter of shape "
                               f"{tuple(it.view.shape)} is split by the compute layout {it.compute}")
        found.append((a, rows, cols))
        done += rows * cols
    if done != length:
        raise RuntimeError(f"Muon compute slice [{start}, {start + length}) of a parameter of shape "
                           f"{tuple(it.view.shape)} does not hold whole blocks")
    return found


def _result(results: list[torch.Tensor | None], i: int, x: torch.Tensor,
            dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Input ``i``'s result (1-D, the length of ``x``; bfloat16: Newton-Schulz's)."""
    res = results[i]
    if res is None:
        res = results[i] = torch.empty(x.numel(), dtype=dtype, device=x.device)
    return res


def _flat_copy(batch: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``batch`` (k, rows, cols) in flat row-major order, into ``out`` (1-D) when given.
    A tall batch's Newton-Schulz result is a transposed view: on the CPU, torch copies
    it faster one matrix at a time than as one strided batch (docs/performance.md), so
    it is copied per matrix there; the bits are the same."""
    if out is None:
        if batch.is_contiguous():
            return batch.reshape(-1)
        out = torch.empty(batch.numel(), dtype=batch.dtype, device=batch.device)
    dst = out.view(batch.shape)
    if batch.device.type == "cpu" and not batch.is_contiguous():
        for i in range(batch.shape[0]):
            dst[i].copy_(batch[i])
    else:
        dst.copy_(batch)
    return out
