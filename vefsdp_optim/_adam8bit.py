"""Block-wise 8-bit Adam and AdamW (Dettmers et al., ICLR 2022) on sharded parameters."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from vefsdp_optim._math import (
    TableQuantizer,
    adam8bit_capturable_step_,
    adam8bit_multi_tensor_step_,
    check_adam_hparams,
    dynamic_code_map,
    host_table_quantizers,
    num_blocks,
    quantize_blockwise,
)
from vefsdp_optim._math._adam8bit_step import select_capturable_backend
from vefsdp_optim.sharding import Elementwise, FlatBlocks, Requirement

from ._adam_state import adam_bucket_, adam_state_spec
from ._block_optimizer import BlockContext, BlockOptimizer
from ._checkpoint import ELEMENTWISE, REPLICATED
from ._registry import register_optimizer
from ._step_loop import StepItem
from ._torch_compat import foreach_add_

__all__ = ["AdamW8bit", "Adam8bit"]


def _check_8bit_args(block_size: object, min_8bit_size: object) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if isinstance(min_8bit_size, bool) or not isinstance(min_8bit_size, int) or min_8bit_size < 0:
        raise ValueError(f"min_8bit_size must be a non-negative int, got {min_8bit_size!r}")


class _Adam8bitBase(BlockOptimizer):
    """Shared body of ``AdamW8bit`` and ``Adam8bit``; ``decoupled`` picks the decay."""

    decoupled: bool

    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        block_size: int,
        *,
        min_8bit_size: int,
        amsgrad: bool = False,
        maximize: bool = False,
        fused: bool | None = None,
        capturable: bool = False,
    ) -> None:
        check_adam_hparams(lr, betas, eps, weight_decay)
        if not isinstance(capturable, bool):
            raise TypeError(f"capturable must be a bool, got {capturable!r}")
        _check_8bit_args(block_size, min_8bit_size)
        if fused is not None and not isinstance(fused, bool):
            raise ValueError(f"fused must be None, True or False, got {fused!r}")
        #: a fused kernel (Triton on CUDA, C++ on the CPU): None where one runs, True
        #: required, False never (see vefsdp_optim/_kernels/_backend.py; the same bits every way)
        self.fused = fused
        from vefsdp_optim._kernels import requested_backend, select_backend

        requested_backend()  # a bad VEFSDP_ADAM8BIT_BACKEND raises here, before any step
        if amsgrad:
            raise NotImplementedError(
                f"{type(self).__name__}(amsgrad=True) is not supported: the 8-bit state "
                "keeps the two Adam moments only; use vefsdp_optim.AdamW(amsgrad=True)")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        block_size=block_size, min_8bit_size=min_8bit_size, amsgrad=False,
                        maximize=maximize, capturable=capturable)
        # code maps and quantizer tables per device, shared by every parameter: built on
        # the host (the tables once per process, here) and copied to a device without
        # waiting for it, so no step reads a device value back
        self._codes: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._quantizers: dict[torch.device, tuple[TableQuantizer, TableQuantizer]] = {}
        self._host_quantizers = host_table_quantizers()
        super().__init__(params, defaults)
        if fused:  # a kernel must run on every device type that holds parameters; capturable:
            # the Triton kernel, which reads the coefficients on the device (see
            # ``_adam8bit_step_kernel`` in vefsdp_optim/_kernels/_quant8_triton.py), never the C++
            # kernel's host scalars
            select = select_capturable_backend if capturable else select_backend
            for device_type in sorted({p.device.type for g in self.param_groups
                                       for p in g["params"]} - {"meta"}):
                try:
                    select(device_type, block_size, 1, True)
                except RuntimeError as e:
                    flag = ", capturable=True" if capturable else ""
                    raise RuntimeError(f"{type(self).__name__}(fused=True{flag}): {e}") from None

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        merged = {**self.defaults, **param_group}
        check_adam_hparams(merged["lr"], merged["betas"], merged["eps"], merged["weight_decay"])
        _check_8bit_args(merged["block_size"], merged["min_8bit_size"])
        if merged.get("amsgrad"):
            raise NotImplementedError(f"{type(self).__name__}: amsgrad=True is not supported "
                                      "(param group keys); use vefsdp_optim.AdamW(amsgrad=True)")
        super().add_param_group(param_group)

    def is_quantized(self, shape: torch.Size, group: dict[str, Any]) -> bool:
        """Whether a parameter of global ``shape`` in ``group`` keeps 8-bit moments.

        A parameter is quantized iff its GLOBAL numel (from its global shape, never the
        local shard) is at least the group's ``min_8bit_size``. Every rank sees the same
        global shapes and the same param groups, so every rank takes the same decision
        without talking. Smaller tensors (biases, norms) keep float32 moments and plain
        Adam(W) math with an elementwise requirement, so they never move; their 8-bit state
        would save little and cost accuracy. Quantized tensors require
        FlatBlocks(block_size): each compute slice starts on a block boundary of the full
        parameter, so the block-local dequantize / update / requantize gives the same bits
        as on a single device."""
        numel = math.prod(shape)
        return numel > 0 and numel >= group["min_8bit_size"]

    def requirement(self, shape: torch.Size, group: dict[str, Any]) -> Requirement:
        if self.is_quantized(shape, group):
            return FlatBlocks(group["block_size"])
        return Elementwise()

    structural_keys = ("block_size", "min_8bit_size")
    step_count_keys = ("step",)

    def checkpoint_spec(self, shape: torch.Size, group: dict[str, Any]) -> dict[str, str | int]:
        if not self.is_quantized(shape, group):
            return adam_state_spec()
        bs = group["block_size"]
        return {"step": REPLICATED, "exp_avg_codes": ELEMENTWISE, "exp_avg_absmax": bs,
                "exp_avg_sq_codes": ELEMENTWISE, "exp_avg_sq_absmax": bs}

    def _code_maps(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        maps = self._codes.get(device)
        if maps is None:
            maps = self._codes[device] = (dynamic_code_map(True).to(device, non_blocking=True),
                                          dynamic_code_map(False).to(device, non_blocking=True))
        return maps

    def _table_quantizers(self, device: torch.device) -> tuple[TableQuantizer, TableQuantizer]:
        qs = self._quantizers.get(device)
        if qs is None:
            qs = self._quantizers[device] = tuple(q.to(device) for q in self._host_quantizers)
        return qs

    def init_state(self, p: torch.Tensor, ctx: BlockContext,
                   group: dict[str, Any]) -> dict[str, Any]:
        signed, unsigned = self._code_maps(p.device)
        zeros = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
        bs = group["block_size"]
        m_codes, m_absmax = quantize_blockwise(zeros, signed, bs)
        v_codes, v_absmax = quantize_blockwise(zeros, unsigned, bs)
        if m_absmax.numel() != num_blocks(p.numel(), bs):
            raise AssertionError(f"absmax has {m_absmax.numel()} blocks for {p.numel()} elements")
        return {  # the step on the host as torch.optim keeps it, on the device when capturable
            "step": (torch.zeros((), dtype=torch.float32, device=p.device)
                     if group.get("capturable")
                     else torch.tensor(0.0, dtype=torch.float32)),
            "exp_avg_codes": m_codes,  # uint8 (slice numel,)
            "exp_avg_absmax": m_absmax,  # float32 (ceil(slice numel / block_size),)
            "exp_avg_sq_codes": v_codes,  # uint8 (slice numel,)
            "exp_avg_sq_absmax": v_absmax,  # float32 (ceil(slice numel / block_size),)
        }

    def update_block(
        self, p: torch.Tensor, g: torch.Tensor, state: dict[str, Any], ctx: BlockContext,
        group: dict[str, Any],
    ) -> None:
        self._update_blocks([(p, g, state, ctx)], group)

    def _update_blocks(self,
                       work: list[tuple[torch.Tensor, torch.Tensor, dict[str, Any], BlockContext]],
                       group: dict[str, Any]) -> None:
        """``update_block`` on each ``(p, g, state, ctx)`` of ``group`` (one device, as a
        bucket is), all in one ``adam8bit_multi_tensor_step_`` (one kernel call on the
        CPU; the same bits as one call each)."""
        bs = group["block_size"]
        for p, _, state, ctx in work:
            if ctx.start % bs != 0 and not ctx.is_whole:
                raise AssertionError(
                    f"8-bit Adam slice starts at flat offset {ctx.start}, not a multiple of "
                    f"block_size {bs}, in a parameter of shape {tuple(ctx.shape)}")
            if state["exp_avg_codes"].numel() != p.numel():
                raise AssertionError(
                    f"8-bit state covers {state['exp_avg_codes'].numel()} elements but the compute "
                    f"slice has {p.numel()}: the compute layout changed between steps")
        step_tensors = [state["step"] for _, _, state, _ in work]
        foreach_add_(step_tensors, 1)
        device = work[0][0].device
        signed, unsigned = self._code_maps(device)
        beta1, beta2 = group["betas"]
        # [Note: capturable steps]: the coefficients on the device, read there by the Triton
        # kernel or the eager ops (see ``_adam8bit_step_kernel`` in _kernels/_quant8_triton.py)
        if group.get("capturable"):
            adam8bit_capturable_step_(
                [p for p, _, _, _ in work], [g for _, g, _, _ in work],
                [(st["exp_avg_codes"], st["exp_avg_absmax"], st["exp_avg_sq_codes"],
                  st["exp_avg_sq_absmax"])
                 for _, _, st, _ in work],
                steps=step_tensors, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                weight_decay=group["weight_decay"], decoupled=self.decoupled, block_size=bs,
                signed_code=signed, unsigned_code=unsigned,
                quantizers=self._table_quantizers(device),
                maximize=group["maximize"], fused=self.fused)
            return
        adam8bit_multi_tensor_step_(
            [p for p, _, _, _ in work], [g for _, g, _, _ in work],
            [(st["exp_avg_codes"], st["exp_avg_absmax"], st["exp_avg_sq_codes"],
              st["exp_avg_sq_absmax"])
             for _, _, st, _ in work],
            steps=[int(t.item()) for t in step_tensors], lr=group["lr"], beta1=beta1, beta2=beta2,
            eps=group["eps"], weight_decay=group["weight_decay"], decoupled=self.decoupled,
            block_size=bs, signed_code=signed, unsigned_code=unsigned,
            quantizers=self._table_quantizers(device), maximize=group["maximize"], fused=self.fused)

    def compute_bucket(self, items: list[StepItem],
                       inputs: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        out: list[list[torch.Tensor]] = [[ins[0]] for ins in inputs]
        fp32 = []  # small tensors: fused fp32 Adam(W) (one param group and device per bucket)
        work: list[tuple[torch.Tensor, torch.Tensor, dict[str, Any], BlockContext]] = []
        for i, it in enumerate(items):
            if not self.is_quantized(it.view.shape, it.group):
                fp32.append(i)
                continue
            p, g = inputs[i]
            if p.numel():
                ctx = it.ctx(it.compute)
                work.append((p, g, self._block_state(it, p, ctx), ctx))
        if work:
            self._update_blocks(work, items[0].group)
        if fp32:
            adam_bucket_([self.state[items[i].param] for i in fp32], [inputs[i][0] for i in fp32],
                         [inputs[i][1] for i in fp32], group=items[0].group,
                         decoupled=self.decoupled, maximize=items[0].group["maximize"])
        return out


@register_optimizer("adamw8bit")
class AdamW8bit(_Adam8bitBase):
    """AdamW with both moments stored as block-wise 8-bit codes.

    Each moment of a parameter with at least ``min_8bit_size`` elements is kept as one
    uint8 code per element (dynamic code map: signed for ``exp_avg``, unsigned for
    ``exp_avg_sq``) and one float32 absmax per block of ``block_size`` consecutive
    elements counted from the parameter's first element: about 2 + 8 / block_size
    bytes per element. Smaller parameters keep float32 moments (see
    ``is_quantized``). On plain, FSDP2/HSDP and fully_shard parameters
    the result is bit-identical to a single-device run at any world size: only whole
    blocks are ever updated together, and only pieces of blocks cut by a shard
    boundary move.

    ``fused=None`` (default) steps the 8-bit tensors with a fused kernel: Triton on
    CUDA (with ``pip install 'vefsdp-optim[triton]'``), C++ on the CPU where the system
    compiler can build it; with eager torch ops elsewhere (a logged reason; also with
    ``fused=False``). ``VEFSDP_ADAM8BIT_BACKEND`` =
    ``triton`` / ``c`` / ``eager`` forces one (see vefsdp_optim/_kernels/_backend.py);
    ``fused=True`` raises where no kernel can run. All give the same bits.
    ``capturable=True`` ([Note: capturable steps]) computes each step's coefficients on the
    device and steps with the Triton kernel, which reads them there, where it runs (CUDA),
    else with the eager ops (also with ``fused=False``; never the C++ kernel, which takes
    host scalars: ``fused=True`` raises where Triton cannot run).
    """

    decoupled = True

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        block_size: int = 256,
        *,
        min_8bit_size: int = 4096,
        amsgrad: bool = False,
        maximize: bool = False,
        fused: bool | None = None,
        capturable: bool = False,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, block_size,
                         min_8bit_size=min_8bit_size, amsgrad=amsgrad, maximize=maximize,
                         fused=fused, capturable=capturable)


@register_optimizer("adam8bit")
class Adam8bit(_Adam8bitBase):
    """Adam (weight decay added to the gradient, as ``torch.optim.Adam``) with block-wise
    8-bit moments; otherwise as :class:`AdamW8bit`."""

    decoupled = False

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        block_size: int = 256,
        *,
        min_8bit_size: int = 4096,
        amsgrad: bool = False,
        maximize: bool = False,
        fused: bool | None = None,
        capturable: bool = False,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, block_size,
                         min_8bit_size=min_8bit_size, amsgrad=amsgrad, maximize=maximize,
                         fused=fused, capturable=capturable)
