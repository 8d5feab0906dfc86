"""QK-clip (MuonClip, Kimi K2, arXiv 2507.20534): per-head rescaling of the query and key
projections after an optimizer step, so that each head's largest attention logit stays at
or below a threshold.

For an attention module with H query heads in Hkv key groups (Hkv = H
without GQA) and the largest pre-softmax logit ``S_h`` of each head in this step's
forward pass, with threshold tau > 0 and balance alpha in [0, 1]:

    S_g     = max over the H / Hkv query heads h of group g of S_h
    gamma_g = tau / S_g  where S_g > tau (and finite), else 1   (tau ÷ S_g, correctly rounded)
    query rows of every head of group g   *= gamma_g ** alpha
    key rows of group g                   *= gamma_g ** (1 - alpha)

so every logit of the group is multiplied by gamma_g and the largest becomes tau; groups at
or below tau are multiplied by exactly 1 (the same bits). With H = Hkv this is the paper's
per-head rule; with GQA the shared key forces one factor per group, Megatron-LM's rule
(``SelfAttention.clip_qk``). MLA (the paper's case): each query head's rows are its content
rows q^C (``head_dim``, scaled by gamma ** alpha) then its rotary rows q^R
(``rope_head_dim``, scaled by gamma: the shared rotary key k^R, one for all heads, is never
touched, so q^R carries the whole factor); each head's rows of the key up-projection are
its key rows k^C (``head_dim``, gamma ** (1 - alpha)) then its value rows (``v_head_dim``,
untouched). A non-finite S_g (an overflowed forward) leaves its group unchanged instead of
zeroing it. The factors are computed in float32 (or the logits' wider dtype), each weight
element is multiplied by its row's factor in the wider of the two dtypes and rounded once
to the weight's dtype, so any piece of a row, scaled alone, gets the bits the whole row
gets: the sharded form (see ``QKClip`` in vefsdp_optim/_qk_clip.py) equals ``qk_clip_`` on
one device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["QKClipHeads", "check_qk_clip_hparams", "qk_clip_", "qk_clip_gamma",
           "qk_clip_row_scales", "scale_rows_"]


def _positive_int(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class QKClipHeads:
    """The head layout of one attention module's query and key projections (rows = dim 0
    of a ``(out_features, in_features)`` weight):

    * query: ``num_heads`` heads of ``head_dim + rope_head_dim`` rows each (content rows,
      then MLA's per-head rotary rows);
    * key: ``num_kv_heads`` heads of ``head_dim + v_head_dim`` rows each (key rows, then
      MLA's value rows of the same up-projection; 0 for a plain key projection);
    * a fused QKV weight: the query rows, the key rows, then ``num_kv_heads * head_dim``
      value rows (Muon's ``split_sizes=[q_rows, kv_rows, kv_rows]``).
    """

    num_heads: int
    head_dim: int
    num_kv_heads: int
    rope_head_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self) -> None:
        _positive_int("num_heads", self.num_heads)
        _positive_int("head_dim", self.head_dim)
        _positive_int("num_kv_heads", self.num_kv_heads)
        _positive_int("rope_head_dim", self.rope_head_dim, 0)
        _positive_int("v_head_dim", self.v_head_dim, 0)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads={self.num_kv_heads} does not divide "
                             f"num_heads={self.num_heads} (grouped-query attention: each key head "
                             "serves num_heads / num_kv_heads query heads)")

    @property
    def q_rows(self) -> int:
        return self.num_heads * (self.head_dim + self.rope_head_dim)

    @property
    def k_rows(self) -> int:
        return self.num_kv_heads * (self.head_dim + self.v_head_dim)

    @property
    def qkv_rows(self) -> int:
        return self.q_rows + self.k_rows + self.num_kv_heads * self.head_dim


def check_qk_clip_hparams(threshold: object, alpha: object) -> None:
    """ValueError unless ``threshold`` is None (off) or a finite number > 0 and ``alpha`` a
    number in [0, 1]."""
    def number(v: object) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    if threshold is not None and not (number(threshold) and threshold > 0):
        raise ValueError("qk_clip_threshold must be None (no QK-clip) or a finite number > 0 "
                         f"(the largest attention logit a head keeps), got {threshold!r}")
    if not (number(alpha) and 0 <= alpha <= 1):
        raise ValueError("qk_clip_alpha must be a number in [0, 1] (the query's share of "
                         f"the factor; 0.5 splits it evenly), got {alpha!r}")


def qk_clip_gamma(max_logits: torch.Tensor, threshold: float, num_kv_heads: int) -> torch.Tensor:
    """``gamma_g`` of each key group (see the module docstring): (num_kv_heads,), float32 or the
    logits' wider dtype, computed on the logits' device without a host sync."""
    dtype = torch.promote_types(max_logits.dtype, torch.float32)
    s = max_logits.to(dtype).view(num_kv_heads, -1).amax(dim=1)
    tau = torch.full_like(s, threshold)
    return torch.where(torch.isfinite(s) & (s > tau), torch.div(tau, s), torch.ones_like(s))


def qk_clip_row_scales(gamma: torch.Tensor, alpha: float,
                       heads: QKClipHeads) -> tuple[torch.Tensor, torch.Tensor]:
    """The factor of every query row and every key row (see the module docstring): ((q_rows,),
    (k_rows,)), from the groups' ``gamma`` (num_kv_heads,)."""
    group = heads.num_heads // heads.num_kv_heads
    # each group's factor computed once, then repeated for its query heads (a vectorized
    # pow may round a lane and the loop's tail differently)
    q = gamma.pow(alpha).repeat_interleave(group)[:, None].expand(heads.num_heads, heads.head_dim)
    if heads.rope_head_dim:
        rope = gamma.repeat_interleave(group)[:, None].expand(heads.num_heads, heads.rope_head_dim)
        q = torch.cat([q, rope], dim=1)
    k = gamma.pow(1.0 - alpha)[:, None].expand(heads.num_kv_heads, heads.head_dim)
    if heads.v_head_dim:
        k = torch.cat([k,
                       torch.ones_like(gamma)[:, None].expand(heads.num_kv_heads,
                                                              heads.v_head_dim)], dim=1)
    return q.reshape(-1), k.reshape(-1)


def scale_rows_(x: torch.Tensor, row_scale: torch.Tensor, start: int, width: int) -> torch.Tensor:
    """Multiply, in place, ``x`` (1-D: the elements ``[start, start + x.numel())`` of a
    row-major matrix ``width`` elements wide) by the factor of each element's row;
    ``row_scale[i]`` is the factor of the matrix's row ``start // width + i``. The factors
    stay 1-D or 2-D tensors (never 0-dim, which would be cast to ``x``'s dtype first), so a
    partial row gets the bits its whole row gets. Returns ``x``."""
    n = x.numel()
    if n == 0:
        return x
    pos, row = 0, 0
    lead = start % width
    if lead:  # the end of a row
        pos = min(width - lead, n)
        x[:pos].mul_(row_scale[:1])
        row = 1
    full = (n - pos) // width
    if full:
        x[pos:pos + full * width].view(full, width).mul_(row_scale[row:row + full, None])
        pos, row = pos + full * width, row + full
    if pos < n:  # the start of a row
        x[pos:].mul_(row_scale[row:row + 1])
    return x


def qk_clip_(
    q: torch.Tensor | None, k: torch.Tensor | None, max_logits: torch.Tensor, threshold: float,
    alpha: float, heads: QKClipHeads, qkv: torch.Tensor | None = None,
) -> None:
    """QK-clip of one attention module on whole weights (see the module docstring): ``q``
    (``heads.q_rows`` rows) and ``k`` (``heads.k_rows`` rows), or one fused ``qkv``
    (``heads.qkv_rows`` rows: query, key, value), scaled in place from the per-head
    maximum logits ``max_logits`` (num_heads,). The definition the sharded form equals."""
    check_qk_clip_hparams(threshold, alpha)
    if threshold is None:
        raise ValueError("qk_clip_ needs a threshold, got None")
    gamma = qk_clip_gamma(max_logits, threshold, heads.num_kv_heads)
    qs, ks = qk_clip_row_scales(gamma, alpha, heads)
    if qkv is not None:
        cols = qkv[0].numel()
        scale_rows_(qkv.view(-1)[:heads.q_rows * cols], qs, 0, cols)
        scale_rows_(qkv.view(-1)[heads.q_rows * cols:(heads.q_rows + heads.k_rows) * cols], ks, 0,
                    cols)
        return
    for w, s in ((q, qs), (k, ks)):
        if w is not None:
            scale_rows_(w.view(-1), s, 0, w[0].numel())
