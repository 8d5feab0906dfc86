"""Muon with torch.optim.Muon's numerics; Newton-Schulz once per matrix, on an owner."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from vefsdp_optim._kernels import fast_addmm_available, fast_mm_nt_available
from vefsdp_optim._math import (
    NS_COEFFICIENTS,
    Int8Momentum,
    NsCoefficients,
    check_ns_coefficients,
    muon_adjust_lr,
    muon_apply_,
    muon_apply_foreach_,
    muon_momentum_,
    muon_momentum_foreach_,
    muon_orthogonalize_batched,
)
from vefsdp_optim._math._muon_int8 import MOMENTUM_BLOCK, empty_momentum
from vefsdp_optim._math._quant8 import dynamic_code_map
from vefsdp_optim.comm import ShardedView
from vefsdp_optim.sharding import BoxShard, Elementwise, FlatBlocks, RaggedShard, Requirement

from ._adam_state import adam_bucket_, adam_state_spec
from ._block_optimizer import BlockOptimizer
from ._checkpoint import ELEMENTWISE, LOCAL, REPLICATED
from ._muon_plan import (
    MuonPlan,
    block_runs,
    check_heads,
    check_momentum_dtype,
    muon_defaults,
    muon_group_plan,
    ns_args,
    whole_blocks,
)
from ._qk_clip import QKClip, qk_clip_defaults
from ._registry import register_optimizer
from ._step_loop import StepItem

__all__ = ["Muon"]


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

    * ``flatten``: for parameters of 3 or more dims, ``True`` orthogonalizes one
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
      (see vefsdp_optim/_math/_muon_int8.py); its blocks stay whole on
      single ranks, so the result is the same at every world size.

    ``ns_coefficients="polar_express"`` replaces the fixed quintic by Polar Express's
    per-iteration coefficients and input scale (arXiv 2505.16932, Algorithm 1:
    vefsdp_optim/_math/_polar_express.py), ``ns_steps`` iterations of it.

    QK-clip (MuonClip, Kimi K2): ``qk_clip_threshold`` (None: off) and ``qk_clip_alpha``
    (group keys), :meth:`register_qk_clip` and :meth:`qk_clip_` after each step
    (see vefsdp_optim/_math/_qk_clip.py).

    ``capturable=True`` (torch.optim's flag, [Note: capturable steps]): the learning rate
    (a float, or a 0-d tensor on the parameters' device that a scheduler may change in
    place), its per-shape adjustment and the weight decay factor are device tensors, so a
    CUDA graph can capture the step; the 1-D parameters' AdamW keeps its step counts on
    the device, as torch's capturable AdamW; with ``momentum_dtype=torch.int8`` the
    rounding's step count too (see vefsdp_optim/_math/_muon_int8.py).
    """

    #: accepted ``adjust_lr_fn`` values: torch.optim.Muon's (``"spectral_unclamped"``,
    #: ``lr * sqrt(rows / cols)``, since torch 2.14; accepted here on any torch)
    adjust_lr_fns: tuple[str | None, ...] = (None, "original", "match_rms_adamw",
                                             "spectral_unclamped")

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
        capturable: bool = False,
    ) -> None:
        super().__init__(params, muon_defaults(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
            ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
            betas=betas, adamw_eps=adamw_eps, flatten=flatten, split_sizes=split_sizes,
            adjust_lr_fns=self.adjust_lr_fns, num_heads=num_heads, momentum_dtype=momentum_dtype)
            | qk_clip_defaults(qk_clip_threshold, qk_clip_alpha) | {"capturable": capturable})

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
                raise TypeError("split_sizes must be a sequence of positive ints "
                                f"(row-block sizes), got {split!r}")
            param_group["split_sizes"] = tuple(split)
        if "num_heads" in param_group:
            param_group["num_heads"] = check_heads(param_group["num_heads"])
        if "momentum_dtype" in param_group:
            param_group["momentum_dtype"] = check_momentum_dtype(param_group["momentum_dtype"])
        if "ns_coefficients" in param_group:
            param_group["ns_coefficients"] = check_ns_coefficients(param_group["ns_coefficients"])
        check_muon_capturable(type(self).__name__, param_group, self.defaults)
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

    _plan = staticmethod(muon_group_plan)  # the one plan cache ([Note: Muon blocks])

    @staticmethod
    def _is_muon(shape: torch.Size, group: dict[str, Any]) -> bool:
        return bool(group["use_muon"]) and len(shape) >= 2

    def updates_elementwise(self, group: dict[str, Any]) -> bool:
        return not group["use_muon"]  # the AdamW path

    def requirement(self, shape: torch.Size, group: dict[str, Any]) -> Requirement:
        if not self._is_muon(shape, group):
            return Elementwise()
        req = self._plan(shape, group).requirement
        if group.get("momentum_dtype") is torch.int8 and not req.needs_whole:
            # whole blocks and whole 256-element momentum blocks (see _math/_muon_int8.py)
            return FlatBlocks(math.lcm(req.unit(tuple(shape)), MOMENTUM_BLOCK))
        return req

    # the float momentum stays with the storage: the cuts of split blocks may balance
    # (``balanced_compute`` in _compute_layouts.py); 8-bit momentum lives on them (state_layout)
    balance_compute_cuts = True
    structural_keys = ("use_muon", "momentum_dtype")
    step_count_keys = ("step", "momentum_step")  # the 1-D AdamW path's, the 8-bit momentum's
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
            return super().state_layout(view, group)  # the compute slices (_math/_muon_int8.py)
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
        # Newton-Schulz's bfloat16 input, cast before the exchange (see vefsdp_optim/_math/_muon.py)
        return [muon_momentum_(g, buf, momentum=group["momentum"], nesterov=group["nesterov"])]

    # The momentum and the apply are elementwise, the same ops on every matrix of a
    # bucket (one param group, dtype and device): the step runs them over the bucket's
    # lists with torch's foreach ops, one launch per op on CUDA (per tensor on the CPU,
    # without the Python per matrix) instead of one per matrix and op. The bits are the
    # per-matrix functions' (muon_momentum_, muon_apply_): torch's foreach lerp, mul and
    # add apply the pointwise ops' own formulas (the CPU runs those ops themselves), in the
    # same order on each element: every lerp_ of the momentum, then each input; every
    # decay, then each step (a matrix of blocks of several shapes: each run of blocks
    # with one adjusted lr as its own pair of slices). What this does not cover takes the
    # per-item hooks: 8-bit momentum (the gather), capturable steps and a Tensor lr (the
    # apply), and a subclass's own gather_inputs / apply_results.

    def _gather_bucket(self, bucket: list[StepItem]) -> list[list[torch.Tensor]]:
        group = bucket[0].group
        if (type(self).gather_inputs is not Muon.gather_inputs or group.get("momentum_dtype") is torch.int8
                or not group["use_muon"]):
            return super()._gather_bucket(bucket)
        inputs: list[list[torch.Tensor]] = [[] for _ in bucket]
        where, grads, bufs = [], [], []
        for i, it in enumerate(bucket):
            if len(it.view.shape) < 2:  # AdamW's (param, grad)
                inputs[i] = [it.view.local, it.grad]
                continue
            state = self.state[it.param]
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = torch.zeros_like(it.grad, memory_format=torch.preserve_format)
            where.append(i)
            grads.append(it.grad)
            bufs.append(buf)
        if where:
            xs = muon_momentum_foreach_(grads, bufs, momentum=group["momentum"], nesterov=group["nesterov"])
            for i, x in zip(where, xs, strict=True):
                inputs[i] = [x]
        return inputs

    def _apply_bucket(self, bucket: list[StepItem], outputs: list[list[torch.Tensor]]) -> None:
        group = bucket[0].group
        lr = group["lr"]
        if (type(self).apply_results is not Muon.apply_results or group.get("capturable")
                or isinstance(lr, torch.Tensor) or not group["use_muon"]):
            super()._apply_bucket(bucket, outputs)
            return
        params, updates, lrs = [], [], []
        adjusted: dict[tuple[int, int], float] = {}  # block shape -> its adjusted lr, this step
        for it, outs in zip(bucket, outputs, strict=True):
            if len(it.view.shape) < 2:
                BlockOptimizer.apply_results(self, it, outs)
                continue
            params.append(it.view.local)
            updates.append(outs[0])
            lrs.append(self._adjusted_lr(it, self._plan(it.view.shape, group), lr, adjusted))
        if params:
            muon_apply_foreach_(params, updates, lrs, lr=lr, weight_decay=group["weight_decay"])

    def _adjusted_lr(self, item: StepItem, plan: MuonPlan, lr: float | torch.Tensor,
                     adjusted: dict[tuple[int, int], Any]) -> Any:
        """muon_apply_'s ``adjusted_lr`` for this rank's slice of ``item``: one lr (blocks
        of one shape), or the runs ``(lo, hi, lr)`` of its blocks (blocks of several
        shapes: each block's own adjustment, consecutive equal ones merged). ``adjusted``:
        block shape -> adjusted lr, filled as met."""
        fn = item.group["adjust_lr_fn"]

        def of(rc: tuple[int, int]) -> Any:
            a_lr = adjusted.get(rc)
            if a_lr is None:
                a_lr = adjusted[rc] = muon_adjust_lr(lr, fn, rc)
            return a_lr

        if plan.uniform:
            return of(plan.blocks[0])
        runs: list[tuple[int, int, Any]] = []
        for lo, hi, rc in self._block_runs(item, plan):
            a_lr = of(rc)
            if runs and a_lr == runs[-1][2] and lo == runs[-1][1]:
                runs[-1] = (runs[-1][0], hi, a_lr)
            else:
                runs.append((lo, hi, a_lr))
        return runs

    def _block_runs(self, item: StepItem, plan: MuonPlan) -> list[tuple[int, int, tuple[int, int]]]:
        """:func:`block_runs` (_muon_plan.py) per (plan, storage layout, rank): the same each step."""
        cache = self.__dict__.setdefault("_block_runs_cache", {})
        key = (id(plan), item.view.layout, item.view.rank)
        hit = cache.get(key)
        if hit is None or hit[0] is not plan:
            if len(cache) > 4096:
                cache.clear()
            hit = cache[key] = (plan, block_runs(item, plan))
        return hit[1]

    def compute_bucket(self, items: list[StepItem], inputs: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        out: list[list[torch.Tensor]] = [[] for _ in items]
        adam_idx = [i for i, it in enumerate(items) if not self._is_muon(it.view.shape, it.group)]
        if adam_idx:  # one param group per bucket: its lr, betas, adamw_eps, weight_decay
            adam_bucket_([self.state[items[i].param] for i in adam_idx], [inputs[i][0] for i in adam_idx],
                         [inputs[i][1] for i in adam_idx], group=items[0].group, eps_key="adamw_eps")
            for i in adam_idx:
                out[i] = [inputs[i][0]]
        # every whole block this rank orthogonalizes in this bucket: one batched
        # Newton-Schulz per block shape across parameters (see
        # ``newtonschulz_batch_exact`` in vefsdp_optim/_math/_newton_schulz.py)
        updates: list[torch.Tensor] = []
        blocks: list[list[tuple[int, int, int]]] = []
        where: list[tuple[int, MuonPlan, int]] = []  # (item, plan, flat offset of its slice)
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
            blocks.append(whole_blocks(it, plan, start, x.numel()))
        if updates:  # one param group per bucket: one Newton-Schulz
            results = self._orthogonalize([(items[i], plan, start) for i, plan, start in where], updates, blocks)
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
                "the owners; give every parameter of the group a gradient at every step "
                "(zeros rather than None)")
        state["compute"] = item.compute
        if "momentum_codes" not in state:
            state["momentum_codes"], state["momentum_absmax"] = empty_momentum(grad.numel(), grad.device)
            # the dither's phase: a host counter, on the device when capturable (read there)
            state["momentum_step"] = torch.zeros((), dtype=torch.int64,
                                                 device=grad.device if item.group.get("capturable") else "cpu")
        codes = self.__dict__.setdefault("_signed_codes", {})  # device -> 8-bit signed code map
        code = codes.get(grad.device)
        if code is None:
            code = codes[grad.device] = dynamic_code_map(True).to(grad.device, non_blocking=True)
        group = item.group
        # the rounding keys on the flat index in the whole parameter (see _math/_muon_int8.py)
        if not isinstance(item.compute, RaggedShard):  # FlatBlocks, whole requirements: flat runs
            raise AssertionError(f"8-bit Muon momentum on a compute layout of boxes: {item.compute}")
        offset = item.compute.local(item.view.rank)[0]
        momentum = Int8Momentum(state["momentum_codes"], state["momentum_absmax"], code,
                                state["momentum_step"], offset)
        return muon_momentum_(grad, momentum, momentum=group["momentum"], nesterov=group["nesterov"])

    # what a subclass changes after Newton-Schulz (NorMuon's normalization)

    def _update_dtype(self, item: StepItem) -> torch.dtype:
        """The dtype of the update a Muon matrix's compute sends back: Newton-Schulz's
        bfloat16 (the same on every rank: the exchange groups tensors by dtype)."""
        return torch.bfloat16

    def _orthogonalize(self, where: list[tuple[StepItem, MuonPlan, int]], updates: list[torch.Tensor],
                       blocks: list[list[tuple[int, int, int]]]) -> list[torch.Tensor]:
        """The updates sent back for the compute slices this rank orthogonalizes in a
        bucket (one param group): ``updates[k]`` is the Newton-Schulz input of item
        ``where[k] = (item, plan, start)``'s slice (1-D, flat order, whole blocks from flat
        offset ``start``; ``blocks[k]``, offsets in the slice)."""
        return muon_orthogonalize_batched(updates, blocks, *ns_args(where[0][0].group))

    def apply_results(self, item: StepItem, outputs: list[torch.Tensor]) -> None:
        if not self._is_muon(item.view.shape, item.group):
            return super().apply_results(item, outputs)
        (ortho,) = outputs
        p, group = item.view.local, item.group
        lr, wd = group["lr"], group["weight_decay"]
        plan = self._plan(item.view.shape, group)
        if group.get("capturable"):
            self._apply_capturable(item, plan, ortho)
            return
        muon_apply_(p, ortho, lr=lr, weight_decay=wd, adjusted_lr=self._adjusted_lr(item, plan, lr, {}))

    def _apply_capturable(self, item: StepItem, plan: MuonPlan, ortho: torch.Tensor) -> None:
        """``apply_results`` under ``capturable`` ([Note: capturable steps]): the lr, its
        adjustments and the decay factor as device tensors, each block's run of this slice
        updated by one ``addcmul_`` (float32 on the device, whatever the lr's form)."""
        p, group = item.view.local, item.group
        lr = device_lr(group["lr"], p.device)
        p.mul_(1 - lr * group["weight_decay"])
        if not p.numel():
            return
        fn = group["adjust_lr_fn"]
        if plan.uniform:
            p.addcmul_(ortho, -muon_adjust_lr(lr, fn, plan.blocks[0]))
            return
        runs = self._block_runs(item, plan)
        adjusted = {rc: -muon_adjust_lr(lr, fn, rc) for rc in {r[2] for r in runs}}
        for lo, hi, rc in runs:
            p[lo:hi].addcmul_(ortho[lo:hi], adjusted[rc])


def device_lr(lr: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A capturable step's learning rate: a float32 0-d tensor on ``device`` (a fill for a
    float lr, so a float and a tensor of its float32 value give the same bits)."""
    if isinstance(lr, torch.Tensor):
        return lr if lr.dtype == torch.float32 else lr.to(torch.float32)
    return torch.full((), lr, dtype=torch.float32, device=device)


def check_muon_capturable(name: str, param_group: dict[str, Any], defaults: dict[str, Any]) -> None:
    """``capturable`` is a bool."""
    capturable = param_group.get("capturable", defaults.get("capturable", False))
    if not isinstance(capturable, bool):
        raise TypeError(f"{name}: capturable must be a bool, got {capturable!r}")
