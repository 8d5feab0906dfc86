"""QK-clip for Muon and NorMuon: which weights are an attention module's query and key
projections, and their clip after a step, on any sharding (see ``QKClip``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from vefsdp_optim._math._qk_clip import (
    QKClipHeads,
    check_qk_clip_hparams,
    qk_clip_gamma,
    qk_clip_row_scales,
    scale_rows_,
)
from vefsdp_optim.comm import ShardedView, sharded_view
from vefsdp_optim.comm._views import _dtensor_type
from vefsdp_optim.sharding import RaggedShard

from ._debug import check_every_step

__all__ = ["QKClip", "qk_clip_defaults"]


def qk_clip_defaults(threshold: float | None, alpha: float) -> dict[str, Any]:
    """The param-group keys of QK-clip, validated: ``qk_clip_threshold`` (None: off) and
    ``qk_clip_alpha``."""
    check_qk_clip_hparams(threshold, alpha)
    return {"qk_clip_threshold": threshold, "qk_clip_alpha": alpha}


@dataclass(frozen=True, slots=True)
class _Attention:
    """One registered attention module: its head layout and its weights, each with the
    name of its rows ("q", "k" or "qkv")."""

    heads: QKClipHeads
    weights: tuple[tuple[str, Any], ...]


# The clip multiplies every row of a registered query or key weight by a factor that
# depends only on the row's index and on the per-head maximum logits, which every rank
# holds whole: the user reduces them over the data-parallel ranks first (Megatron-LM's
# clip_qk all-reduces them with MAX) and tensor-parallel ranks pass every head. So each
# rank scales the elements it holds and sends nothing. Through the parameter's
# ShardedView its local data is one run of a row-major matrix: for a RaggedShard the
# flat slice [start, start + n) of the (rows, cols) weight (a fully_shard slice may begin
# or end inside a row, even inside a head; FSDP2's Shard(0) holds whole rows); for a
# BoxShard (tensor parallel, fully_shard over it) the run [start, start + n) of the box's
# own row-major order, whose row i is the weight's row offsets[0] + i. scale_rows_
# multiplies the run's partial first row, its whole rows and its partial last row, each
# element by its row's factor in the factor's dtype, rounded once: the product one device
# computes for that element (vefsdp_optim/_math/_qk_clip.py), so the bits are the same at
# every world size and placement. The factors are device-side selects on the logits (no
# host sync) and a step's collectives stay the step loop's alone (the debug check:
# ``_check_replicated``).
class QKClip:
    """QK-clip for an optimizer whose param groups carry ``qk_clip_threshold`` and
    ``qk_clip_alpha`` (mixed into :class:`~vefsdp_optim.Muon`, hence NorMuon)."""

    param_groups: list[dict[str, Any]]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if "qk_clip_threshold" in param_group or "qk_clip_alpha" in param_group:
            check_qk_clip_hparams(param_group.get("qk_clip_threshold"),
                                  param_group.get("qk_clip_alpha", 0.5))
        super().add_param_group(param_group)  # type: ignore[misc]

    def _qk_clip_registry(self) -> dict[str, _Attention]:
        return self.__dict__.setdefault("_qk_clip_attention", {})

    def register_qk_clip(
        self, name: str, *, num_heads: int, head_dim: int, q: Any = None, k: Any = None,
        qkv: Any = None,
        num_kv_heads: int | None = None, rope_head_dim: int = 0, v_head_dim: int = 0,
    ) -> None:
        """Declare the query and key weights of attention module ``name`` for
        :meth:`qk_clip_`: ``q`` and ``k`` (parameters of this optimizer, ``(rows, in)``),
        or a fused ``qkv`` (query, key then value rows, as Muon's ``split_sizes``).

        The head layout: ``num_heads`` query heads of ``head_dim`` rows
        (+ ``rope_head_dim`` per-head rotary rows: MLA's q^R); ``num_kv_heads`` key heads
        (default ``num_heads``; fewer: GQA, one factor per key group) of ``head_dim`` rows
        (+ ``v_head_dim`` value rows each, when ``k`` is MLA's key-value up-projection).
        MLA's shared rotary key k^R is not registered: the clip never touches it
        (see vefsdp_optim/_math/_qk_clip.py). The threshold and alpha are the param group's
        ``qk_clip_threshold`` / ``qk_clip_alpha``.
        """
        if not isinstance(name, str):
            raise TypeError("register_qk_clip: name must be a str (the attention module's name), "
                            f"got {name!r}")
        registry = self._qk_clip_registry()
        if name in registry:
            raise ValueError(f"register_qk_clip: attention {name!r} is already registered")
        heads = QKClipHeads(num_heads, head_dim,
                            num_heads if num_kv_heads is None else num_kv_heads,
                            rope_head_dim, v_head_dim)
        if qkv is not None:
            if q is not None or k is not None:
                raise ValueError(f"register_qk_clip({name!r}): pass q and k, or one fused "
                                 "qkv, not both")
            if rope_head_dim or v_head_dim:
                raise ValueError(f"register_qk_clip({name!r}): rope_head_dim and v_head_dim "
                                 "describe MLA's separate query and key-value up-projections; pass "
                                 "them as q and k")
            weights: tuple[tuple[str, Any], ...] = (("qkv", qkv),)
        elif q is None or k is None:
            raise ValueError(f"register_qk_clip({name!r}): pass both the query weight q and the "
                             "key weight k (or one fused qkv)")
        elif q is k:
            raise ValueError(f"register_qk_clip({name!r}): q and k are the same tensor; a fused "
                             "weight is qkv")
        else:
            weights = (("q", q), ("k", k))
        groups = self._groups_of([w for _, w in weights])
        taken = {id(w): n for n, a in registry.items() for _, w in a.weights}
        for kind, w in weights:
            if id(w) not in groups:
                raise ValueError(f"register_qk_clip({name!r}): the {kind} weight (shape "
                                 f"{tuple(w.shape)}) is not a parameter of this "
                                 f"{type(self).__name__}")
            if id(w) in taken:
                raise ValueError(f"register_qk_clip({name!r}): the {kind} weight is already "
                                 f"registered for attention {taken[id(w)]!r}")
            shape = tuple(sharded_view(w).shape)
            if len(shape) != 2:
                raise NotImplementedError(f"register_qk_clip({name!r}): QK-clip scales rows of "
                                          f"2-D (out, in) weights; the {kind} weight has "
                                          f"shape {shape}")
            want = {"q": heads.q_rows, "k": heads.k_rows, "qkv": heads.qkv_rows}[kind]
            if shape[0] != want:
                raise ValueError(f"register_qk_clip({name!r}): the {kind} weight has {shape[0]} "
                                 f"rows (shape {shape}), the head layout "
                                 f"{_describe(heads, kind)} = {want}")
            if groups[id(w)].get("qk_clip_threshold") is None:
                raise ValueError(f"register_qk_clip({name!r}): the param group of the "
                                 f"{kind} weight has qk_clip_threshold=None (QK-clip off); pass "
                                 "qk_clip_threshold to the constructor or set the group key")
        registry[name] = _Attention(heads, weights)

    @torch.no_grad()
    def qk_clip_(self, max_logits: Mapping[str, torch.Tensor]) -> None:
        """QK-clip after :meth:`step`: for each registered attention ``name`` in
        ``max_logits``, ``max_logits[name]`` is the largest pre-softmax logit of each query
        head in this step's forward pass, ``(num_heads,)``, floating, on the weights' device,
        the same on every rank (reduce it with MAX over the data-parallel ranks, and gather
        the heads of tensor-parallel ranks). Heads above their group's ``qk_clip_threshold``
        get their query and key rows scaled (see vefsdp_optim/_math/_qk_clip.py); each rank
        scales the rows it holds, without a host sync or a collective (see the comment above
        this class). Attentions left out are not touched."""
        if not isinstance(max_logits, Mapping):
            raise TypeError("qk_clip_ takes a mapping from registered attention names to "
                            f"per-head max logits, got {type(max_logits).__name__}")
        registry = self._qk_clip_registry()
        unknown = [n for n in max_logits if n not in registry]
        if unknown:
            raise ValueError(f"qk_clip_: {unknown[:4]} {'is' if len(unknown) == 1 else 'are'} "
                             "not registered (register_qk_clip); registered: "
                             f"{sorted(registry)[:8]}{'...' if len(registry) > 8 else ''}")
        groups = self._groups_of([w for n in max_logits for _, w in registry[n].weights])
        for name, logits in max_logits.items():
            att = registry[name]
            views = [(kind, sharded_view(w)) for kind, w in att.weights]
            _check_logits(name, logits, att.heads, views)
            if any(id(w) not in groups for _, w in att.weights):
                raise ValueError(f"qk_clip_({name!r}): a registered weight is no longer a "
                                 f"parameter of this {type(self).__name__}")
            hparams = {(groups[id(w)]["qk_clip_threshold"], groups[id(w)]["qk_clip_alpha"])
                       for _, w in att.weights}
            if len(hparams) != 1:
                raise ValueError(f"qk_clip_({name!r}): the param groups of its query and key "
                                 "weights disagree on (qk_clip_threshold, qk_clip_alpha): "
                                 f"{sorted(hparams, key=repr)}")
            ((threshold, alpha),) = hparams
            check_qk_clip_hparams(threshold, alpha)
            if threshold is None:
                raise ValueError(f"qk_clip_({name!r}): its param group has qk_clip_threshold=None "
                                 "(QK-clip off)")
            if check_every_step():
                _check_replicated(name, logits, views)
            qs, ks = qk_clip_row_scales(qk_clip_gamma(logits, threshold, att.heads.num_kv_heads),
                                        alpha, att.heads)
            for kind, view in views:
                if kind == "q":
                    scale = qs
                elif kind == "k":
                    scale = ks
                else:  # fused: query, key, then value rows (factor 1)
                    scale = torch.cat([qs, ks, torch.ones_like(qs[:1])
                                       .expand(view.shape[0] - qs.numel() - ks.numel())])
                _scale_view_(view, scale)

    def _groups_of(self, weights: list[Any]) -> dict[int, dict[str, Any]]:
        """id(weight) -> its param group, for the given weights that are parameters here."""
        wanted = {id(w) for w in weights}
        return {id(p): g for g in self.param_groups for p in g["params"] if id(p) in wanted}


def _describe(heads: QKClipHeads, kind: str) -> str:
    q = (f"num_heads={heads.num_heads} x (head_dim={heads.head_dim} + "
         f"rope_head_dim={heads.rope_head_dim})")
    k = (f"num_kv_heads={heads.num_kv_heads} x (head_dim={heads.head_dim} + "
         f"v_head_dim={heads.v_head_dim})")
    if kind == "q":
        return q
    if kind == "k":
        return k
    return (f"(num_heads={heads.num_heads} + 2 x num_kv_heads={heads.num_kv_heads}) x "
            f"head_dim={heads.head_dim}")


def _check_logits(name: str, logits: object, heads: QKClipHeads,
                  views: list[tuple[str, ShardedView]]) -> None:
    if not isinstance(logits, torch.Tensor) or isinstance(logits, _dtensor_type()):
        raise TypeError(f"qk_clip_({name!r}): max logits must be a plain torch.Tensor of shape "
                        f"({heads.num_heads},), got {type(logits).__name__}"
                        + (" (pass its full_tensor())" if isinstance(logits, torch.Tensor) else ""))
    if tuple(logits.shape) != (heads.num_heads,):
        raise ValueError(f"qk_clip_({name!r}): max logits of shape {tuple(logits.shape)}; the "
                         f"attention has num_heads={heads.num_heads} query heads: one maximum per "
                         f"head, shape ({heads.num_heads},)")
    if not logits.is_floating_point():
        raise ValueError(f"qk_clip_({name!r}): max logits must be floating point, got "
                         f"{logits.dtype}")
    for kind, view in views:
        if logits.device != view.local.device:
            raise ValueError(f"qk_clip_({name!r}): max logits on {logits.device}, the {kind} "
                             f"weight's local data on {view.local.device}; move them to the "
                             "weights' device")


def _check_replicated(name: str, logits: torch.Tensor,
                      views: list[tuple[str, ShardedView]]) -> None:
    """Debug check, under VEFSDP_OPTIM_DEBUG=1 (or TORCH_DISTRIBUTED_DEBUG=DETAIL): a MAX
    all-reduce checks that every rank of each shard process group holds the same logits
    (NaN included), since different logits would scale the pieces of one row differently
    and nothing else would notice (see ``QKClip``)."""
    seen: set[int] = set()
    for _, view in views:
        pg = view.process_group
        if pg is None or id(pg) in seen:
            continue
        seen.add(id(pg))
        x = logits.to(torch.float64)
        nan = torch.isnan(x).to(torch.float64)
        x = torch.nan_to_num(x, nan=0.0)
        mine = torch.cat([x, -x, nan, -nan])  # the MAX of each half gives the max and the min
        most = mine.clone()
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=pg)
        if not torch.equal(most, mine):
            raise ValueError(f"qk_clip_({name!r}): the ranks of a shard process group were given "
                             "different max logits; reduce them with all_reduce(op=MAX) over the "
                             "data-parallel ranks first (each rank scales its own rows "
                             "of one weight)")


def _scale_view_(view: ShardedView, row_scale: torch.Tensor) -> None:
    """Scale this rank's local data of a 2-D weight by ``row_scale`` (one factor per row)."""
    x = view.local
    if not x.numel():
        return
    layout = view.layout
    if isinstance(layout, RaggedShard):
        width = view.shape[1]
        start, row0 = layout.local(view.rank)[0], 0
    else:  # a box: its own row-major order, row i being the weight's row offsets[0] + i
        box = layout.boxes[view.rank]
        width, start, row0 = box.sizes[1], box.start, box.offsets[0]
    scale_rows_(x, row_scale[row0 + start // width:], start, width)
