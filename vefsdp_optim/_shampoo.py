"""Block-diagonal Shampoo with Adam grafting; every tile band lives whole on one rank."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from typing import Any

import torch

from vefsdp_optim._math import ShampooTile, check_adam_hparams, shampoo_step_, shampoo_tiles
from vefsdp_optim.comm import ShardedView
from vefsdp_optim.sharding import Elementwise, RaggedShard, Requirement, RowBlocks

from ._block_optimizer import BlockContext, BlockOptimizer
from ._checkpoint import ELEMENTWISE, LOCAL, REPLICATED
from ._host_steps import HostStepCounts, ReplayCounting
from ._registry import register_optimizer

__all__ = ["Shampoo"]

_GRAFTINGS = ("adam", "sgd", "none")
_TILE_STATS = ("L", "R", "L_inv_root", "R_inv_root")


def _tile_key(stat: str, band: int, col: int) -> str:
    """The state key (live and saved) of one statistic of tile (band, col)."""
    return f"{stat}.{band}.{col}"

# A matrix (dim 0, rest) of shape (rows, cols) is cut into tiles of at most
# max_preconditioner_dim (= d) on each side; tile (b, c) covers rows [b*d, (b+1)*d) and
# columns [c*d, (c+1)*d), clipped at the edges. The requirement RowBlocks(d) makes every
# rank's compute slice a run of whole row bands, so each tile lies on exactly one rank,
# with its statistics. The state of a slice keys its tiles by GLOBAL (band, column)
# index, the band counted from the slice's first row ctx.start // cols: the math on a
# tile is then the same on any rank at any world size as on a single device.
#
# A tile's statistics live in the parameter's state as flat entries
# state["{stat}.{band}.{col}"] (stat one of L, R, L_inv_root, R_inv_root), the very keys
# state_dict() saves them under (through export_extra_state). Framework flows rebuild a
# parameter's state from the keys of the LIVE state: torch's
# set_optimizer_state_dict(flatten_optimizer_state_dict=True) (torchtitan) looks up
# "state.{fqn}.{key}" for each key of optim.state[param], so a saved key the live state
# lacks would be dropped. The LOCAL bookkeeping ("span", "root_failures",
# "skipped_tiles") is never saved; such a flow hands it back as an empty dict, which
# load ignores.


def _check_int(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} of type {type(value).__name__}")
    if value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value}")


def _matrix_cols(shape: torch.Size) -> int | None:
    """Columns of the (dim 0, rest) matrix view, or None for 0-D / 1-D parameters."""
    return math.prod(shape[1:]) if len(shape) >= 2 else None


@register_optimizer("shampoo")
class Shampoo(ReplayCounting, BlockOptimizer):
    """Block-diagonal Shampoo with per-tile grafting, on plain, FSDP2 and fully_shard params.

    A parameter with 2 or more dims is viewed as the matrix ``(dim 0, rest)`` and cut
    into tiles of at most ``max_preconditioner_dim`` on each side (see
    the comments at the top of this file). Per step ``t`` (from 1), with
    ``(beta1, beta2) = betas`` and ``g`` the raw gradient:

    * ``m <- beta1 m + (1 - beta1) g`` (momentum, per element), ``m_hat = m / (1 - beta1^t)``;
    * grafting ``"adam"`` also keeps ``v <- beta2 v + (1 - beta2) g^2`` and its direction is
      ``A = m_hat / (sqrt(v / (1 - beta2^t)) + grafting_epsilon)`` (``grafting_epsilon``
      default 1e-8, torch.optim.AdamW's eps); ``"sgd"`` and ``"none"``: ``A = m_hat``;
    * per tile, ``L <- beta2 L + (1 - beta2) G G^T`` and ``R <- beta2 R + (1 - beta2) G^T G``
      from the RAW gradient tile ``G``; at ``t = start_preconditioning_step + k *
      precondition_frequency`` the roots ``(L / (1 - beta2^t) + epsilon I)^(-1/4)`` (and
      R's) are recomputed by a float64 symmetric eigendecomposition;
    * from ``t >= start_preconditioning_step`` the tile's direction is
      ``P = L^(-1/4) M R^(-1/4)`` with ``M`` the tile of the MOMENTUM ``m_hat`` (not the raw
      gradient), rescaled to the Frobenius norm of ``A``'s tile (grafting ``"adam"`` or
      ``"sgd"``; ``"none"`` keeps ``P`` as it is); before that step the direction is ``A``;
    * ``p <- p (1 - lr weight_decay) - lr * direction``.

    0-D and 1-D parameters always take ``A``: with ``grafting="adam"`` that is exactly
    ``torch.optim.AdamW(lr, betas, eps=grafting_epsilon, weight_decay)``; with ``"sgd"`` or
    ``"none"`` it is bias-corrected momentum SGD.

    A root whose eigendecomposition fails or is not finite (e.g. from a non-finite
    statistic) is not used: the tile keeps its previous root (the identity before the
    first success); a tile whose gradient is not finite keeps its statistics for that
    step. Both are decided on the device, with no host sync in the step, so no warning
    is given: ``state["root_failures"]`` and ``state["skipped_tiles"]`` (0-dim int64
    tensors on the parameter's device, not saved) count them; reading one is a host sync.

    ``capturable=True`` ([Note: capturable steps] in _capturable.py): ``state["step"]``
    is a float32 0-d tensor on the parameter's device (a host float32 tensor otherwise,
    as torch.optim keeps it) and the bias corrections, step sizes and ``lr`` are device
    tensors. When to recompute the roots, and from which step to precondition, stays a
    host decision, from the optimizer's own count of its ``step()`` calls (re-derived from
    the device counts by ``load_state_dict``). So the steps between recomputations are
    the ones a CUDA graph replays; the recomputing steps call ``eigh``, which reads its
    error code back to the host on CUDA, and run eagerly, as ``step()`` calls (so does
    ``start_preconditioning_step``, the first preconditioned one). A replay advances the
    device counts alone: :meth:`count_replays` adds replays to the host count, without
    which the recomputations follow ``step()`` calls.
    """

    step_count_keys = ("step",)  # float32 0-d tensors, on the device when capturable

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        epsilon: float = 1e-12,
        weight_decay: float = 0.0,
        max_preconditioner_dim: int = 1024,
        precondition_frequency: int = 20,
        start_preconditioning_step: int = 20,
        grafting: str = "adam",
        *,
        grafting_epsilon: float = 1e-8,
        capturable: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr, betas=tuple(betas) if isinstance(betas, (tuple, list)) else betas,
            epsilon=epsilon, weight_decay=weight_decay,
            max_preconditioner_dim=max_preconditioner_dim,
            precondition_frequency=precondition_frequency,
            start_preconditioning_step=start_preconditioning_step, grafting=grafting,
            grafting_epsilon=grafting_epsilon, capturable=capturable,
        )
        self._check_group(defaults)
        self._host_steps = HostStepCounts()  # capturable states' step counts, on the host
        super().__init__(params, defaults)

    @staticmethod
    def _check_group(group: dict[str, Any]) -> None:
        check_adam_hparams(group["lr"], group["betas"], group["epsilon"], group["weight_decay"])
        eps_g = group["grafting_epsilon"]
        if isinstance(eps_g, bool) or not isinstance(eps_g, (int, float)) or not eps_g >= 0:
            raise ValueError(f"grafting_epsilon must be a float >= 0, got {eps_g!r}")
        _check_int("max_preconditioner_dim", group["max_preconditioner_dim"], 1)
        _check_int("precondition_frequency", group["precondition_frequency"], 1)
        _check_int("start_preconditioning_step", group["start_preconditioning_step"], 0)
        if group["grafting"] not in _GRAFTINGS:
            raise ValueError(f"grafting must be one of {_GRAFTINGS}, got {group['grafting']!r}")
        if not isinstance(group["capturable"], bool):
            raise TypeError(f"capturable must be a bool, got {group['capturable']!r}")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if isinstance(group["betas"], list):
            group["betas"] = tuple(group["betas"])
        self._check_group(group)

    def requirement(self, shape: torch.Size, group: dict[str, Any]) -> Requirement:
        if len(shape) >= 2:
            return RowBlocks(group["max_preconditioner_dim"])
        return Elementwise()

    # -- checkpoint: per-element state sharded, tiles by global (band, column) ---------

    structural_keys = ("max_preconditioner_dim", "grafting")
    extra_state_prefixes = tuple(f"{stat}." for stat in _TILE_STATS)

    def checkpoint_spec(self, shape: torch.Size, group: dict[str, Any]) -> dict[str, str | int]:
        # tiles "{stat}.{band}.{col}": saved by the extra-state hooks, keyed by global index
        spec: dict[str, str | int] = {"step": REPLICATED, "exp_avg": ELEMENTWISE, "span": LOCAL,
                                      "root_failures": LOCAL, "skipped_tiles": LOCAL}
        if group["grafting"] == "adam":
            spec["exp_avg_sq"] = ELEMENTWISE
        return spec

    def export_extra_state(self, state: dict[str, Any], view: ShardedView, layout: RaggedShard,
                           group: dict[str, Any]) -> dict[str, Any]:
        # the live keys themselves (see the comments at the top of this file)
        return {k: v for k, v in state.items() if k.startswith(self.extra_state_prefixes)}

    def import_extra_state(self, state: dict[str, Any], saved: dict[str, Any], view: ShardedView,
                           layout: RaggedShard, group: dict[str, Any], name: object) -> None:
        if isinstance(layout, RaggedShard) and state["span"].start != layout.local(view.rank)[0]:
            raise AssertionError(f"Shampoo state starts at {state['span'].start}, its layout at "
                                 f"{layout.local(view.rank)[0]}")
        keys = [k for k in state if k.startswith(self.extra_state_prefixes)]
        missing = [k for k in keys if k not in saved]
        if missing:
            raise ValueError(f"Shampoo state of parameter {name!r} (shape "
                             f"{tuple(view.shape)}): the checkpoint lacks tiles "
                             f"{missing[:8]}{'...' if len(missing) > 8 else ''}")
        for k in keys:
            live, v = state[k], saved[k]
            if not isinstance(v, torch.Tensor) or v.shape != live.shape:
                raise ValueError(
                    f"Shampoo state {name!r}.{k} has shape "
                    f"{tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__}, "
                    f"expected {tuple(live.shape)} (max_preconditioner_dim "
                    f"{group['max_preconditioner_dim']})")
            if v.data_ptr() != live.data_ptr():
                live.copy_(v)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """:meth:`BlockOptimizer.load_state_dict` (each step count goes where its group's
        ``capturable``, saved with the groups as torch.optim's, keeps it: ``step_count_keys``);
        then the host counts are read from them."""
        super().load_state_dict(state_dict)
        self._host_steps.rederive(st.get("step") for st in self.state.values())

    # -- state ------------------------------------------------------------------------

    def init_state(self, p: torch.Tensor, ctx: BlockContext,
                   group: dict[str, Any]) -> dict[str, Any]:
        if group["capturable"]:  # on the device ([Note: capturable steps])
            step = torch.zeros((), dtype=torch.float32, device=p.device)
            self._host_steps.start(step)
        else:
            step = torch.tensor(0.0, dtype=torch.float32)
        state: dict[str, Any] = {
            "step": step,
            # the flat slice this state belongs to
            "span": slice(ctx.start, ctx.start + ctx.length),
            "exp_avg": torch.zeros_like(p),  # 1-D, ctx.length elems
        }
        if group["grafting"] == "adam":
            state["exp_avg_sq"] = torch.zeros_like(p)  # 1-D, ctx.length elems
        cols = _matrix_cols(ctx.shape)
        if cols is not None:
            dtype = torch.promote_types(p.dtype, torch.float32)
            # flat keys, as saved (the comments at the top of this file)
            for (band, col), rs, cs, *_ in self._tiles(ctx, group):
                r, c = rs.stop - rs.start, cs.stop - cs.start
                state[_tile_key("L", band, col)] = torch.zeros(r, r, dtype=dtype, device=p.device)
                state[_tile_key("R", band, col)] = torch.zeros(c, c, dtype=dtype, device=p.device)
                state[_tile_key("L_inv_root", band,
                                col)] = torch.eye(r, dtype=dtype, device=p.device)
                state[_tile_key("R_inv_root", band,
                                col)] = torch.eye(c, dtype=dtype, device=p.device)
            # diagnostics counted on the device (reading one is a host sync)
            state["root_failures"] = torch.zeros((), dtype=torch.int64, device=p.device)
            state["skipped_tiles"] = torch.zeros((), dtype=torch.int64, device=p.device)
        return state

    @staticmethod
    def _tiles(ctx: BlockContext, group: dict[str, Any]) -> tuple[_SliceTile, ...]:
        """Tiles of the slice: global (band, column tile), local slices and state keys."""
        return _slice_tiles(ctx.shape, ctx.start, ctx.length, group["max_preconditioner_dim"])

    # -- the per-slice update -------------------------------------------------------

    def update_block(
        self, p: torch.Tensor, g: torch.Tensor, state: dict[str, Any], ctx: BlockContext,
        group: dict[str, Any],
    ) -> None:
        span = state["span"]
        if span.start != ctx.start or span.stop - span.start != ctx.length:
            raise AssertionError(
                f"Shampoo state holds the slice at {span.start} of {span.stop - span.start} elems, "
                f"the step gives {ctx.start} of {ctx.length}")
        step: int | torch.Tensor
        if group["capturable"]:
            step = state["step"]
            t = self._host_steps.advance(step)
            step.add_(1)
        else:
            state["step"] += 1
            step = t = int(state["step"].item())  # a host tensor, as torch.optim keeps it: no sync
        m, v = state["exp_avg"], state.get("exp_avg_sq")  # 1-D, ctx.length elems
        cols = _matrix_cols(ctx.shape)  # None: no tiles (0-D / 1-D)
        tiles: list[ShampooTile] = []
        if cols is not None:  # the slice as its (rows, cols) matrix, with its tiles' state
            shape = (ctx.length // cols, cols)
            p, g, m = p.view(shape), g.view(shape), m.view(shape)
            v = v.view(shape) if v is not None else None
            tiles = [ShampooTile(rs, cs, state[kl], state[kr], state[kli], state[kri])
                     for _, rs, cs, kl, kr, kli, kri in self._tiles(ctx, group)]
        skipped, failed = shampoo_step_(
            p, g, m, v, tiles, step=step, lr=group["lr"], betas=group["betas"],
            epsilon=group["epsilon"],
            weight_decay=group["weight_decay"], grafting=group["grafting"],
            grafting_epsilon=group["grafting_epsilon"],
            start_preconditioning_step=group["start_preconditioning_step"],
            precondition_frequency=group["precondition_frequency"], host_step=t)
        if tiles:  # on the device: no warning, which would need a host read
            state["skipped_tiles"] += skipped
            state["root_failures"] += failed


#: one tile of a compute slice: ((global band, column tile), local row slice, column
#: slice, and the state keys of its L, R, L_inv_root, R_inv_root)
_SliceTile = tuple[tuple[int, int], slice, slice, str, str, str, str]


@functools.lru_cache(maxsize=1024)
def _slice_tiles(shape: torch.Size, start: int, length: int, d: int) -> tuple[_SliceTile, ...]:
    cols = _matrix_cols(shape)
    if cols is None or cols == 0 or start % (d * cols) or length % cols:
        raise AssertionError(
            f"Shampoo slice [{start}, {start + length}) of shape "
            f"{tuple(shape)} is not a run of whole {d}-row bands")
    band0 = start // (d * cols)
    out = []
    for rs, cs in shampoo_tiles(length // cols, cols, d):
        band, col = band0 + rs.start // d, cs.start // d
        out.append(((band, col), rs, cs, *(_tile_key(stat, band, col) for stat in _TILE_STATS)))
    return tuple(out)
