"""SOAP: Adam in the eigenbasis of Shampoo's preconditioner; every factor whole on one rank."""

from __future__ import annotations

import math
from collections.abc import Iterable
from functools import lru_cache
from typing import Any

import torch

from vefsdp_optim._math._soap import SoapGeometry, SoapHparams, SoapState, soap_geometry, soap_step_
from vefsdp_optim.sharding import Elementwise, Requirement, WholeTensor

from ._block_optimizer import BlockContext, BlockOptimizer
from ._capturable import check_capturable
from ._checkpoint import ELEMENTWISE, REPLICATED, WHOLE, validate_state
from ._host_steps import HostStepCounts, ReplayCounting
from ._registry import register_optimizer
from ._step_loop import StepItem, aligned
from ._torch_compat import FakeTensor

__all__ = ["SOAP"]

# [Note: SOAP state]
# A tensor with a factor (see ``SoapGeometry`` in vefsdp_optim/_math/_soap.py) is updated whole on
# one rank, its owner, with all its state. That state is the moments, with exp_avg in
# the eigenbasis and both in the work shape, and per factor dim i two entries: "GG.{i}",
# the factor, the reference's state['GG'][i]; and "Q.{i}", its eigenbasis, the
# reference's state['Q'][i]. All of them are WHOLE. The owner saves them whole, and the
# owner at any world size loads them whole. A tensor without a factor is Adam element by
# element on any slice, so its moments are ELEMENTWISE. The owner stays the same from
# step to step ([Note: owners stay] in _step_loop.py). Each whole parameter still
# remembers the compute layout of its last step. A step that would compute it elsewhere
# would find no factors there, so it raises, on every rank alike, before its exchange.
# A step rebinds the moments and bases to new tensors where the reference rebinds its
# own, since their memory layouts set the bits of the next step's matmuls. The keys
# stay. With capturable=True the step copies the new values into the state's own
# tensors instead. A captured step reads and writes those, and an eager step between
# replays must leave them where the graph finds them.


_HPARAMS = ("lr", "betas", "shampoo_beta", "eps", "weight_decay", "precondition_frequency",
            "normalize_grads", "correct_bias")  # SoapHparams' fields, in order
_PLAIN = (torch.Tensor, torch.nn.Parameter, FakeTensor)  # FakeTensorMode's fake of a plain tensor


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r} of type {type(value).__name__}")


@lru_cache(maxsize=1024)
def _geometry(shape: tuple[int, ...], max_precond_dim: int, merge_dims: bool, precondition_1d: bool,
              data_format: str) -> SoapGeometry:
    return soap_geometry(shape, max_precond_dim, merge_dims, precondition_1d, data_format)


@register_optimizer("soap")
class SOAP(ReplayCounting, BlockOptimizer):
    """SOAP (Vyas et al., arXiv 2409.11321) on plain, FSDP2 and fully_shard parameters,
    equal to one device at any world size.

    The signature, defaults and numerics are those of the reference implementation
    (github.com/nikhilvyas/SOAP, ``soap.py``). Per parameter, with its gradient ``G``
    viewed in the work shape (see ``SoapGeometry`` in vefsdp_optim/_math/_soap.py: each dim of at
    most ``max_precond_dim`` gets a factor ``F_i``, a larger one is left unrotated):

    * the first step only starts the factors ``F_i = (1 - beta_F) G_(i) G_(i)^T`` and
      takes their eigenvectors ``Q_i`` (``eigh``, decreasing eigenvalues); the
      parameter does not move;
    * every later step (Adam's ``t = 1, 2, ...``) runs Adam on ``G' = G x_i Q_i^T``:
      ``m <- b1 m + (1 - b1) G'``, ``v <- b2 v + (1 - b2) G'^2``, ``u = (m / (sqrt(v) +
      eps)) x_i Q_i`` (``/ (RMS(u) + 1e-30)`` with ``normalize_grads``), ``p <- p - lr
      sqrt(1 - b2^t) / (1 - b1^t) u`` (``lr`` alone without ``correct_bias``), then
      ``p <- p - lr weight_decay p`` (after the update, as the reference);
    * then ``F_i <- beta_F F_i + (1 - beta_F) G_(i) G_(i)^T`` (``beta_F = shampoo_beta``,
      or ``betas[1]`` when negative), and every ``precondition_frequency`` Adam steps
      one power iteration with QR gives new ``Q_i`` (columns sorted by ``diag(Q^T F Q)``,
      ``v`` permuted with them, ``m`` rotated into the new basis).

    ``merge_dims``, ``precondition_1d``, ``normalize_grads``, ``data_format`` and
    ``correct_bias`` are the reference's; ``data_format`` is also a group key. A tensor
    with a factor, or any tensor with ``normalize_grads``, is updated whole on one rank
    with its state ([Note: SOAP state]); others element by element where they lie.
    Factors, bases and moments are float32 (float64 for float64 parameters).

    The arithmetic is the reference's, op for op (its momentum round trip included:
    ``soap_step_`` in vefsdp_optim/_math/_soap.py), so one device gives the
    reference's bits, and any sharding gives one device's. What differs is the work
    around it: a matrix is rotated by ``mm`` without ``tensordot``'s wrapper (see
    ``soap_project`` in vefsdp_optim/_math/_soap.py) and plain parameters skip the
    exchange bookkeeping (``claim_params``).

    ``capturable=True`` ([Note: capturable steps] in _capturable.py): ``state["step"]``
    is a float32 0-d tensor on the parameter's device (an int otherwise, as the
    reference's) and the bias corrections, the step size and ``lr`` are device tensors.
    When to take the eigenbases (the first step) and to renew them (every
    ``precondition_frequency`` Adam steps) stays a host decision, from the optimizer's own
    count of its ``step()`` calls (re-derived from the device counts by
    ``load_state_dict``). So the steps between renewals are the ones a CUDA graph
    replays; the first step (``eigh``, which reads its error code back to the host on
    CUDA) and the renewals (QR) run eagerly, as ``step()`` calls. A replay advances the
    device counts alone: :meth:`count_replays` adds replays to the host count, without
    which the renewals follow ``step()`` calls.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 3e-3,
        betas: tuple[float, float] = (0.95, 0.95),
        shampoo_beta: float = -1,
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        precondition_frequency: int = 10,
        max_precond_dim: int = 10000,
        merge_dims: bool = False,
        precondition_1d: bool = False,
        normalize_grads: bool = False,
        data_format: str = "channels_first",
        correct_bias: bool = True,
        *,
        capturable: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr, betas=tuple(betas) if isinstance(betas, (tuple, list)) else betas,
            shampoo_beta=shampoo_beta, eps=eps, weight_decay=weight_decay,
            precondition_frequency=precondition_frequency, max_precond_dim=max_precond_dim,
            merge_dims=merge_dims, precondition_1d=precondition_1d, normalize_grads=normalize_grads,
            data_format=data_format, correct_bias=correct_bias, capturable=capturable,
        )
        self._check_group(defaults)
        # id(param) -> compute layout of its last step, for whole parameters ([Note: SOAP state])
        self._last_compute: dict[int, Any] = {}
        # id(group) -> (values, hparams)
        self._hp_cache: dict[int, tuple[tuple[Any, ...], SoapHparams]] = {}
        self._host_steps = HostStepCounts()  # capturable states' step counts, on the host
        super().__init__(params, defaults)

    @staticmethod
    def _hparams(group: dict[str, Any]) -> SoapHparams:
        return SoapHparams(*(group[k] for k in _HPARAMS))

    def _group_hparams(self, group: dict[str, Any]) -> SoapHparams:
        """The group's hyperparameters, validated once per change of their values."""
        values = tuple(group[k] for k in _HPARAMS)
        cached = self._hp_cache.get(id(group))
        if cached is None or cached[0] != values:
            cached = self._hp_cache[id(group)] = (values, SoapHparams(*values))
        return cached[1]

    @classmethod
    def _check_group(cls, group: dict[str, Any]) -> None:
        cls._hparams(group)  # raises ValueError / TypeError naming the bad value
        lr = group["lr"]
        # a host read, once
        if isinstance(lr, torch.Tensor) and not (lr.numel() == 1 and float(lr) >= 0):
            raise ValueError(f"Invalid learning rate: {lr}")
        _check_bool("capturable", group["capturable"])
        m = group["max_precond_dim"]
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise ValueError(f"max_precond_dim must be an int >= 0, got {m!r}")
        for name in ("merge_dims", "precondition_1d"):
            _check_bool(name, group[name])
        soap_geometry((1,), 1, data_format=group["data_format"])  # raises for a bad data_format

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if isinstance(group["betas"], list):
            group["betas"] = tuple(group["betas"])
        self._check_group(group)

    def geometry(self, shape: torch.Size, group: dict[str, Any]) -> SoapGeometry:
        """How SOAP views a parameter of ``shape`` in ``group`` (see ``SoapGeometry`` in
        vefsdp_optim/_math/_soap.py)."""
        return _geometry(tuple(shape), group["max_precond_dim"], group["merge_dims"],
                         group["precondition_1d"], group["data_format"])

    def _is_whole(self, shape: torch.Size, group: dict[str, Any]) -> bool:
        return group["normalize_grads"] or self.geometry(shape, group).has_factors

    def requirement(self, shape: torch.Size, group: dict[str, Any]) -> Requirement:
        return WholeTensor() if self._is_whole(shape, group) else Elementwise()

    def cost(self, shape: torch.Size, group: dict[str, Any]) -> float:
        geo = self.geometry(shape, group)
        n = float(max(1, math.prod(shape)))
        dims = [geo.work_shape[i] for i in geo.factor_dims]
        # two rotations and the outer products per step; a QR and two products per
        # factor every precondition_frequency steps
        return n * (1 + 3 * sum(dims)) + sum(4.0 * d**3
                                             for d in dims) / group["precondition_frequency"]

    # -- checkpoint ([Note: SOAP state]) ---------------------------------------------------

    structural_keys = ("max_precond_dim", "merge_dims", "precondition_1d", "normalize_grads",
                       "data_format")
    plan_keys = ("precondition_frequency",)  # cost() reads it ([Note: step plan])

    def checkpoint_spec(self, shape: torch.Size, group: dict[str, Any]) -> dict[str, str | int]:
        if not self._is_whole(shape, group):
            return {"step": REPLICATED, "exp_avg": ELEMENTWISE, "exp_avg_sq": ELEMENTWISE}
        spec: dict[str, str | int] = {"step": REPLICATED, "exp_avg": WHOLE, "exp_avg_sq": WHOLE}
        for i in self.geometry(shape, group).factor_dims:
            spec[f"GG.{i}"] = WHOLE
            spec[f"Q.{i}"] = WHOLE
        return spec

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """:meth:`BlockOptimizer.load_state_dict`; then each step count takes the form of its
        group's ``capturable`` (saved with the groups, as torch.optim's): a float32 0-d tensor
        on the parameter's device, or an int, and the host counts are read from it."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if not state or "step" not in state:
                    continue
                step = state["step"]
                if group["capturable"]:
                    if not isinstance(step, torch.Tensor) or step.device != state["exp_avg"].device:
                        state["step"] = torch.tensor(float(step), dtype=torch.float32,
                                                     device=state["exp_avg"].device)
                    elif step.dtype != torch.float32:
                        state["step"] = step.to(torch.float32)
                elif isinstance(step, torch.Tensor):
                    state["step"] = int(step.item())
        self._host_steps.rederive(st.get("step") for st in self.state.values())

    # -- state and the update ---------------------------------------------------------------

    def init_state(self, p: torch.Tensor, ctx: BlockContext,
                   group: dict[str, Any]) -> dict[str, Any]:
        dtype = torch.promote_types(p.dtype, torch.float32)
        zeros = dict(dtype=dtype, device=p.device)
        step: int | torch.Tensor
        if group["capturable"]:  # calls, on the device ([Note: capturable steps])
            step = torch.zeros((), dtype=torch.float32, device=p.device)
            self._host_steps.start(step)
        else:
            step = 0  # calls (an int, as the reference's); Adam's t = step - 1
        state: dict[str, Any] = {"step": step}
        if not self._is_whole(ctx.shape, group):
            state["exp_avg"] = torch.zeros(p.numel(), **zeros)  # 1-D, ctx.length elems
            state["exp_avg_sq"] = torch.zeros(p.numel(), **zeros)  # 1-D, ctx.length elems
            return state
        geo = self.geometry(ctx.shape, group)
        state["exp_avg"] = torch.zeros(geo.work_shape, **zeros)  # work shape, eigenbasis
        state["exp_avg_sq"] = torch.zeros(geo.work_shape, **zeros)  # work shape, eigenbasis
        for i in geo.factor_dims:
            d = geo.work_shape[i]
            state[f"GG.{i}"] = torch.zeros(d, d, **zeros)  # (d, d)
            # (d, d), eigenvectors as columns from step 1
            state[f"Q.{i}"] = torch.zeros(d, d, **zeros)
        return state

    def claim_params(self, group: dict[str, Any]) -> list[Any]:
        """Update the plain (unsharded) parameters of ``group`` here: they need no exchange,
        and the step loop's bookkeeping would cost more than the math on small tensors.
        The same update_block runs on the same whole tensors; the rest go to the loop."""
        rest = []
        checked: set[torch.device] = set()  # capturable: the devices checked this step
        for p in group["params"]:
            g = p.grad
            if (g is None or type(p) not in _PLAIN or type(g) not in _PLAIN or g.is_sparse
                or p.is_meta
                    or p.is_complex() or not (p.is_contiguous() and g.is_contiguous())
                    or g.shape != p.shape):
                rest.append(p)  # the loop skips it, steps it, or raises its error
                continue
            if group["capturable"] and p.device not in checked:
                check_capturable(type(self).__name__, group, p.device)
                checked.add(p.device)
            state = self.state[p]
            flat = p.view(-1)  # under the step's no_grad
            ctx = BlockContext(p.shape, 0, flat.numel(), 0, 1)
            if not state:
                if ctx.length == 0:
                    continue
                state.update(self.init_state(flat, ctx, group))
            # ``aligned`` in vefsdp_optim/_step_loop.py
            self.update_block(flat, aligned(g.view(-1)), state, ctx, group)
            if id(p) not in self._validated:
                validate_state(self, p, group)
                self._validated.add(id(p))
        return rest

    def gather_inputs(self, item: StepItem) -> list[torch.Tensor]:
        if item.requirement.needs_whole:
            key = id(item.param)
            last = self._last_compute.get(key)
            if last is not None and last != item.compute:
                raise NotImplementedError(
                    f"SOAP: a parameter of shape {tuple(item.view.shape)} would be "
                    f"updated on other ranks than at its last step ({item.compute} instead of "
                    f"{last}), which lack its factors: a parameter of its param group stepped "
                    "without a gradient and moved the owners ([Note: SOAP state]); give every "
                    "parameter of a SOAP group a gradient at every step (zeros rather than None)")
            self._last_compute[key] = item.compute
        return super().gather_inputs(item)

    def update_block(
        self, p: torch.Tensor, g: torch.Tensor, state: dict[str, Any], ctx: BlockContext,
        group: dict[str, Any],
    ) -> None:
        geo = self.geometry(ctx.shape, group)
        m = state["exp_avg"]
        if not (group["normalize_grads"] or geo.has_factors):
            if m.numel() != ctx.length:
                raise AssertionError(f"SOAP state holds {m.numel()} elements, the step gives "
                                     f"{ctx.length}")
            geo = None  # elementwise: any slice
        elif ctx.start != 0 or ctx.length != m.numel() or m.shape != geo.work_shape:
            raise AssertionError(f"SOAP got the slice [{ctx.start}, {ctx.start + ctx.length}) of "
                                 f"a parameter of shape {tuple(ctx.shape)} that needs the whole "
                                 f"tensor, with state of shape {tuple(m.shape)}")
        step: int | torch.Tensor
        if group["capturable"]:
            step = state["step"]
            host_step = self._host_steps.advance(step)
            step.add_(1)
        else:
            step = host_step = state["step"] = state["step"] + 1
        if geo is None or not geo.has_factors:
            soap_step_(p, g, SoapState(m, state["exp_avg_sq"], [], []), step,
                       self._group_hparams(group), geo, host_step)
            return
        dims = range(len(geo.work_shape))
        soap = SoapState(m, state["exp_avg_sq"], [state.get(f"GG.{i}") for i in dims],
                         [state.get(f"Q.{i}") for i in dims])
        soap_step_(p, g, soap, step, self._group_hparams(group), geo, host_step)
        # the step rebinds the moments and bases ([Note: SOAP state]); capturable, their
        # values go into the state's own tensors, which a captured step reads and writes
        new = {"exp_avg": soap.exp_avg, "exp_avg_sq": soap.exp_avg_sq}
        new.update((f"Q.{i}", q) for i, q in zip(dims, soap.bases, strict=True) if q is not None)
        for key, value in new.items():
            if not group["capturable"]:
                state[key] = value
            elif value is not state[key]:
                state[key].copy_(value)
