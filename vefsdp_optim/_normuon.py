"""NorMuon: Muon with a neuron-wise second moment, normalized on the rank that
orthogonalizes each matrix."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from vefsdp_optim._math import NsCoefficients, normuon_orthogonalize_batched
from vefsdp_optim.comm import ShardedView
from vefsdp_optim.sharding import RaggedShard

from ._adam_state import adam_state_spec
from ._block_optimizer import BlockOptimizer
from ._checkpoint import LOCAL
from ._muon import Muon
from ._muon_plan import MuonPlan, muon_defaults, ns_args
from ._qk_clip import qk_clip_defaults
from ._registry import register_optimizer
from ._step_loop import StepItem

__all__ = ["NorMuon"]

_VARIANCE = "variance_neuron."  # + global block index: one block's row second moment

# [Note: NorMuon state]
# The row second moment of a block needs the block's whole orthogonalized update. Only the
# rank that runs the block's Newton-Schulz has it. That rank is the owner of a whole
# matrix, or the rank holding a block where blocks stay in place, as whole experts and QKV
# blocks do. So the moment lives there, as state["variance_neuron.{b}"] with rows_b floats,
# per block b of [Note: Muon blocks]. It is created at the block's first step. The
# normalization runs on the owner, and the normalized float32 update comes back instead of
# Newton-Schulz's bfloat16 one. The momentum stays sharded, as Muon's. The rank that holds
# the entries saves them under these keys, by global block index. So a checkpoint loads at
# any world size onto whichever rank then computes the block. The saved keys are the live
# ones, as for Shampoo's tiles (see vefsdp_optim/_shampoo.py). The owner stays from step to
# step ([Note: owners stay] in _step_loop.py). After a load it is the rank that saved the
# moments. Each parameter still keeps the compute layout of its last step, in
# state["compute"], which is LOCAL. A step that would compute the parameter elsewhere
# raises, on every rank alike and before its exchange, instead of restarting the moment
# from zero.


def _check_beta2(value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"muon_beta2 must be a float in [0, 1], got {value!r}")


@register_optimizer("normuon")
class NorMuon(Muon):
    """NorMuon (arXiv 2510.05491) as Microsoft Dion's ``NorMuon`` computes it, on plain,
    FSDP2 and fully_shard parameters, equal to one device at any world size.

    Muon's update, then per orthogonalized matrix ``O`` (m x n): the row second moment
    ``v <- muon_beta2 v + (1 - muon_beta2) mean_j O_ij^2``, ``O / (sqrt(v) + 1e-8)`` row by
    row, rescaled to ``||O||_F`` (see vefsdp_optim/_math/_normuon.py),
    then the learning-rate adjustment and decoupled weight decay. Newton-Schulz and the
    normalization run once per matrix in the world, on whole matrices (or whole blocks),
    as in :class:`Muon`; ``v`` lives on that rank ([Note: NorMuon state]).

    Arguments and group keys are :class:`Muon`'s (torch.optim.Muon's names, ``flatten``,
    ``split_sizes``, ``use_muon=False`` groups and 1-D parameters updated by AdamW with
    ``betas`` / ``adamw_eps``) plus ``muon_beta2``; ``split_sizes`` blocks and
    ``flatten=False`` slices are normalized as separate parameters. The defaults are
    Dion's NorMuon's: ``lr=0.01``, ``weight_decay=0.01``, ``momentum=0.95`` (Dion's
    ``mu``), ``nesterov=False``, ``muon_beta2=0.95``, Polar Express
    (``ns_coefficients="polar_express"``: the paper's table, where Dion's
    ``use_polar_express`` uses modded-nanogpt's) and ``adjust_lr_fn="spectral_norm"``
    (``lr * sqrt(rows / cols)``; also ``"rms_norm"``, and torch's ``None`` /
    ``"original"`` / ``"match_rms_adamw"`` / ``"spectral_unclamped"``). The momentum is
    torch's average (``m <- momentum m + (1 - momentum) g``) where Dion sums (``m <- mu m
    + g``): the same direction, a constant factor that Newton-Schulz's normalization
    removes. ``eps`` is Newton-Schulz's (torch's and the Polar Express paper's 1e-7).
    QK-clip as :class:`Muon`'s (``qk_clip_threshold``, ``register_qk_clip``,
    ``qk_clip_``).
    """

    adjust_lr_fns = Muon.adjust_lr_fns + ("spectral_norm", "rms_norm")
    extra_state_prefixes = (_VARIANCE,)

    # the row second moments live where a block is orthogonalized ([Note: NorMuon state]):
    # the nearest cuts, a function of the parameter alone
    balance_compute_cuts = False

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 0.01,
        weight_decay: float = 0.01,
        momentum: float = 0.95,
        nesterov: bool = False,
        ns_coefficients: NsCoefficients = "polar_express",
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = "spectral_norm",
        *,
        muon_beta2: float = 0.95,
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
        _check_beta2(muon_beta2)
        defaults = muon_defaults(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
            ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
            betas=betas, adamw_eps=adamw_eps, flatten=flatten, split_sizes=split_sizes,
            adjust_lr_fns=self.adjust_lr_fns, num_heads=num_heads, momentum_dtype=momentum_dtype)
        defaults["muon_beta2"] = muon_beta2
        defaults.update(qk_clip_defaults(qk_clip_threshold, qk_clip_alpha))
        defaults["capturable"] = capturable  # as Muon's ([Note: capturable steps])
        # what Muon.__init__ does, with these defaults
        BlockOptimizer.__init__(self, params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if "muon_beta2" in param_group:
            _check_beta2(param_group["muon_beta2"])
        if param_group.get("adjust_lr_fn", None) not in self.adjust_lr_fns:
            raise ValueError(f"adjust_lr_fn {param_group['adjust_lr_fn']!r} is not "
                             f"supported; use one of {', '.join(map(repr, self.adjust_lr_fns))}")
        super().add_param_group(param_group)

    def checkpoint_spec(self, shape: torch.Size, group: dict[str, Any]) -> dict[str, str | int]:
        if not self._is_muon(shape, group):
            return adam_state_spec()
        # + the per-block row second moments, by the extra-state hooks ([Note: NorMuon state])
        return {**self._momentum_spec(group), "compute": LOCAL}

    def export_extra_state(self, state: dict[str, Any], view: ShardedView,
                           layout: RaggedShard | None, group: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in state.items() if isinstance(k, str) and k.startswith(_VARIANCE)}

    def import_extra_state(self, state: dict[str, Any], saved: dict[str, Any], view: ShardedView,
                           layout: RaggedShard | None, group: dict[str, Any], name: object) -> None:
        keys = [k for k in state if isinstance(k, str) and k.startswith(_VARIANCE)]
        missing = [k for k in keys if k not in saved]
        if missing:
            raise ValueError(f"NorMuon state of parameter {name!r} (shape {tuple(view.shape)}): "
                             "the checkpoint lacks "
                             f"{missing[:8]}{'...' if len(missing) > 8 else ''}")
        for k in keys:
            live, v = state[k], saved[k]
            if not isinstance(v, torch.Tensor) or v.shape != live.shape:
                raise ValueError(
                    f"NorMuon state {name!r}.{k} has shape "
                    f"{tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__}, "
                    f"expected {tuple(live.shape)} (the rows of that block: flatten and "
                    "split_sizes must match)")
            if v.data_ptr() != live.data_ptr():
                live.copy_(v)

    # hooks: Muon's, plus the normalization on the owner ([Note: NorMuon state])

    def _gather_bucket(self, bucket: list[StepItem]) -> list[list[torch.Tensor]]:
        for item in bucket:
            if not self._is_muon(item.view.shape, item.group):
                continue
            state = self.state[item.param]
            last = state.get("compute")
            if last is not None and last != item.compute:
                raise NotImplementedError(
                    f"NorMuon: a parameter of shape {tuple(item.view.shape)} would be "
                    f"orthogonalized on other ranks than at its last step ({item.compute} instead "
                    f"of {last}), which lack its row second moments: a parameter of its param "
                    "group stepped without a gradient and moved the owners ([Note: NorMuon "
                    "state]); give every parameter of a NorMuon group a gradient at every step "
                    "(zeros rather than None)")
            state["compute"] = item.compute
        # Muon's momentum (see ``Muon._gather_bucket`` in vefsdp_optim/_muon.py)
        return super()._gather_bucket(bucket)

    def _update_dtype(self, item: StepItem) -> torch.dtype:
        return torch.promote_types(item.view.local.dtype, torch.float32)

    def _orthogonalize(self, where: list[tuple[StepItem, MuonPlan, int]],
                       updates: list[torch.Tensor],
                       blocks: list[list[tuple[int, int, int]]]) -> list[torch.Tensor]:
        variances = []  # per slice, the row second moment of each of its blocks
        for (item, plan, start), x in zip(where, updates, strict=True):
            state, dtype = self.state[item.param], self._update_dtype(item)
            vs = []
            for b in plan.span(start, x.numel()):
                key = f"{_VARIANCE}{b}"
                v = state.get(key)
                if v is None:  # the block's first step
                    v = state[key] = torch.zeros(plan.blocks[b][0], dtype=dtype, device=x.device)
                vs.append(v)
            variances.append(vs)
        group = where[0][0].group
        return normuon_orthogonalize_batched(updates, blocks, variances, group["muon_beta2"],
                                             self._update_dtype(where[0][0]), *ns_args(group))
