"""Muon's parameter groups chosen from a module: which parameters are hidden matrices.

Muon is for the hidden weight matrices; the input embedding, the output head, norms, biases
and gains go to AdamW (Keller Jordan's rule, kept by torch.optim.Muon, Moonlight and Dion).
:func:`muon_param_groups` applies that rule to a module and says why for each parameter
(:func:`muon_param_report`), in this order, the first that holds deciding:

1. a name the caller lists in ``adamw`` patterns: AdamW;
2. a parameter of an input embedding (``nn.Embedding``, Hugging Face's
   ``get_input_embeddings()``, any module whose class name has "Embedding", as ViT's patch
   and position embeddings): AdamW; a head tied to it is the same tensor;
3. the output head: Hugging Face's ``get_output_embeddings()``, a module named ``lm_head``,
   ``output``, ``head``, ``classifier`` or ``score``, or a matrix whose rows are an input
   embedding's vocabulary: AdamW;
4. fewer than two dims larger than 1 (norms, biases, gains, a ``[1, 1, d]`` token): AdamW;
5. three or more dims: a convolution's filters are one ``(out, in * kernel)`` matrix
   (``flatten=True``); an expert stack (a module or name with "expert") is a batch of
   ``[E, m, n]`` matrices (``flatten=False``), with ``gate_up_proj`` split into its two
   halves; anything else is a parameter it cannot classify: AdamW;
6. a matrix: Muon, with ``split_sizes`` for the fused projections it can size from the
   module (``qkv_proj``: query, key, value rows from the attention's config; ``gate_up_proj``:
   two halves; MLA's ``kv_a_proj_with_mqa`` / ``wkv_a``: the latent and the rope key;
   ``kv_b_proj`` / ``wkv_b``: each head's key and value rows), or the caller's
   ``split_sizes`` / ``num_heads`` patterns.

GPT-2's ``Conv1D`` stores a weight as ``[in, out]``: Newton-Schulz gives the same matrix
for a tensor and its transpose, but the lr adjustment and NorMuon's row normalization see
the stored orientation, and its fused ``c_attn`` splits columns, which ``split_sizes``
(rows) cannot express: such a matrix is orthogonalized whole, and the report says so.
Parameters are classified by their global shape, so the groups are the same for a plain
module, FSDP2's DTensors, tensor parallelism and ``vefsdp_optim.fully_shard``, before or
after sharding; a parameter another sharding flattened raises ValueError
(see vefsdp_optim/_flattened.py).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ._flattened import flattened_by

__all__ = ["ParamChoice", "muon_param_groups", "muon_param_report"]

_HEAD_NAMES = frozenset({"lm_head", "output", "head", "classifier", "score"})


@dataclass(frozen=True)
class ParamChoice:
    """What :func:`muon_param_groups` chose for one parameter, and why."""

    name: str
    shape: tuple[int, ...]
    use_muon: bool
    reason: str
    #: the Muon group's block options (``flatten``, ``split_sizes``, ``num_heads``)
    options: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        opts = "".join(f" {k}={v}" for k, v in self.options.items())
        algorithm = "Muon" if self.use_muon else "AdamW"
        return f"{self.name} {list(self.shape)}: {algorithm}{opts} ({self.reason})"


class ParamReport(list):
    """A list of :class:`ParamChoice`, printed one line each."""

    def __str__(self) -> str:
        return "\n".join(map(str, self))


def muon_param_report(
    module: nn.Module,
    *,
    adamw: Iterable[str] = (),
    split_sizes: Mapping[str, Sequence[int]] | None = None,
    num_heads: Mapping[str, int] | None = None,
) -> ParamReport:
    """The choice :func:`muon_param_groups` makes for each parameter of ``module`` (in
    ``named_parameters()`` order), with its reason (see the module docstring)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"muon_param_report expects an nn.Module, got {type(module).__name__}")
    split_sizes, num_heads = dict(split_sizes or {}), dict(num_heads or {})
    _check_patterns(split_sizes, num_heads)
    modules = dict(module.named_modules())
    embeds, heads = _embedding_params(module, modules), _head_params(module, modules)
    vocab = {m.num_embeddings for m in modules.values() if isinstance(m, nn.Embedding)}
    report = ParamReport()
    for name, p in module.named_parameters():
        found = flattened_by(p)
        if found is not None:
            raise ValueError(f"muon_param_groups: parameter {name!r} is {found[0]}, so its "
                             "shape is lost; apply FSDP2's fully_shard or vefsdp_optim.fully_shard "
                             "instead")
        owner_name = name.rpartition(".")[0]
        owner = modules[owner_name]
        parent = modules[owner_name.rpartition(".")[0]] if owner_name else owner
        report.append(_choose(name, p, (owner, owner_name, parent), embeds, heads, vocab,
                              tuple(adamw), split_sizes, num_heads))
    return report


def muon_param_groups(
    module: nn.Module,
    *,
    adamw: Iterable[str] = (),
    split_sizes: Mapping[str, Sequence[int]] | None = None,
    num_heads: Mapping[str, int] | None = None,
    muon_options: Mapping[str, Any] | None = None,
    adamw_options: Mapping[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Param groups for :class:`~vefsdp_optim.Muon` / :class:`~vefsdp_optim.NorMuon` from
    ``module``: one Muon group per distinct block options, then one ``use_muon=False`` group
    (AdamW) for the rest (see the module docstring).

    Args:
        module: a plain, FSDP2, tensor-parallel or ``vefsdp_optim.fully_shard`` module.
        adamw: ``fnmatch`` patterns of parameter names sent to AdamW whatever they are.
        split_sizes: pattern -> row blocks of each matrix (fused projections), in place of
            the sizes the function reads from the module.
        num_heads: pattern -> per-head Muon (``num_heads`` equal row blocks).
        muon_options, adamw_options: more keys for the Muon groups / the AdamW group
            (``lr``, ``weight_decay``, ``betas``, ``eps``: the optimizer's group keys).

    Each group holds ``params`` and ``param_names`` (torch.optim's key); an empty group
    is left out. ``muon_param_report`` gives the reasons.
    """
    report = muon_param_report(module, adamw=adamw, split_sizes=split_sizes, num_heads=num_heads)
    params = dict(module.named_parameters())
    muon: dict[tuple, dict[str, Any]] = {}
    rest: dict[str, Any] = {"params": [], "param_names": [], "use_muon": False,
                            **(adamw_options or {})}
    for choice in report:
        if not choice.use_muon:
            rest["params"].append(params[choice.name])
            rest["param_names"].append(choice.name)
            continue
        key = tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                           for k, v in choice.options.items()))
        group = muon.setdefault(key, {"params": [], "param_names": [], "use_muon": True,
                                      **choice.options, **(muon_options or {})})
        group["params"].append(params[choice.name])
        group["param_names"].append(choice.name)
    return [g for g in (*muon.values(), rest) if g["params"]]


def _check_patterns(split_sizes: dict[str, Any], num_heads: dict[str, Any]) -> None:
    for pattern, sizes in split_sizes.items():
        if (isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence)
                or not all(isinstance(s, int) and s > 0 for s in sizes)):
            raise TypeError(f"split_sizes[{pattern!r}] must be a sequence of positive ints, "
                            f"got {sizes!r}")
    for pattern, heads in num_heads.items():
        if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
            raise TypeError(f"num_heads[{pattern!r}] must be a positive int, got {heads!r}")
        if any(fnmatch.fnmatchcase(pattern, s) or s == pattern for s in split_sizes):
            raise ValueError(f"pattern {pattern!r} is in both split_sizes and num_heads; give one")


def _hf_module(module: nn.Module, getter: str) -> nn.Module | None:
    """What a Hugging Face model's ``get_input_embeddings`` / ``get_output_embeddings``
    returns, or None (no such method, not implemented, or not a module)."""
    get = getattr(module, getter, None)
    try:
        found = get() if callable(get) else None
    except (NotImplementedError, AttributeError):
        return None
    return found if isinstance(found, nn.Module) else None


def _embedding_params(module: nn.Module, modules: dict[str, nn.Module]) -> set[int]:
    roots = [m for m in modules.values()
             if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) or "Embedding" in type(m).__name__]
    found = _hf_module(module, "get_input_embeddings")
    if found is not None:
        roots.append(found)
    return {id(p) for m in roots for p in m.parameters()}


def _head_params(module: nn.Module, modules: dict[str, nn.Module]) -> dict[int, str]:
    heads: dict[int, str] = {}
    found = _hf_module(module, "get_output_embeddings")
    if found is not None:
        heads.update((id(p), "the output head (get_output_embeddings())")
                     for p in found.parameters())
    for name, m in modules.items():
        leaf = name.rpartition(".")[2]
        if leaf in _HEAD_NAMES and m is not module:
            for p in m.parameters():
                heads.setdefault(id(p), f"the output head (a module named {leaf!r})")
    return heads


def _choose(name: str, p: torch.Tensor, where: tuple[nn.Module, str, nn.Module], embeds: set[int],
            heads: dict[int, str], vocab: set[int], adamw: tuple[str, ...],
            split_sizes: dict[str, Sequence[int]], num_heads: dict[str, int]) -> ParamChoice:
    shape = tuple(p.shape)
    owner, owner_name, parent = where

    def to_adamw(reason: str) -> ParamChoice:
        return ParamChoice(name, shape, False, reason)

    hit = next((a for a in adamw if fnmatch.fnmatchcase(name, a)), None)
    if hit is not None:
        return to_adamw(f"asked: matches {hit!r}")
    if id(p) in embeds:
        tied = " (tied to the output head)" if id(p) in heads else ""
        return to_adamw(f"the input embedding{tied}")
    if id(p) in heads:
        return to_adamw(heads[id(p)])
    big = [d for d in shape if d > 1]
    if len(big) < 2:
        kind = "a bias" if name.endswith("bias") else (
            "a norm's weight" if "Norm" in type(owner).__name__ else "a vector")
        return to_adamw(f"{kind}: fewer than two dims above 1")
    if len(shape) == 2 and shape[0] in vocab and isinstance(owner, nn.Linear):
        return to_adamw(f"the output head (its {shape[0]} rows are the vocabulary)")
    if len(shape) >= 3:
        return _many_dims(name, shape, owner, owner_name, split_sizes, num_heads)
    return _matrix(name, shape, owner, parent, split_sizes, num_heads)


def _many_dims(name: str, shape: tuple[int, ...], owner: nn.Module, owner_name: str,
               split_sizes: dict[str, Sequence[int]], num_heads: dict[str, int]) -> ParamChoice:
    if isinstance(owner, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):  # not ConvTranspose: [in, out, ...]
        return ParamChoice(name, shape, True, "convolution filters, one (out, in x kernel) matrix",
                           {"flatten": True})
    if len(shape) == 3 and ("Expert" in type(owner).__name__ or "expert" in owner_name.lower()):
        options: dict[str, Any] = {"flatten": False}
        asked = _asked(name, split_sizes, num_heads)
        if asked:
            options.update(asked[0])
            return ParamChoice(name, shape, True, f"an expert stack [E, m, n]; {asked[1]}", options)
        reason = "an expert stack [E, m, n], each expert's matrix on its own"
        if name.rpartition(".")[2] == "gate_up_proj" and shape[1] % 2 == 0:
            options["split_sizes"] = [shape[1] // 2] * 2
            reason += ", split into its gate and up halves"
        return ParamChoice(name, shape, True, reason, options)
    return ParamChoice(name, shape, False, f"a {len(shape)}-D parameter of {type(owner).__name__} "
                       "that is neither a convolution nor an expert stack: its matrices are "
                       "unknown")


def _asked(name: str, split_sizes: dict[str, Sequence[int]],
           num_heads: dict[str, int]) -> tuple[dict[str, Any], str] | None:
    for pattern, sizes in split_sizes.items():
        if fnmatch.fnmatchcase(name, pattern):
            return {"split_sizes": list(sizes)}, f"split_sizes asked by {pattern!r}"
    for pattern, heads in num_heads.items():
        if fnmatch.fnmatchcase(name, pattern):
            return {"num_heads": heads}, f"num_heads asked by {pattern!r}"
    return None


def _matrix(name: str, shape: tuple[int, ...], owner: nn.Module, parent: nn.Module,
            split_sizes: dict[str, Sequence[int]], num_heads: dict[str, int]) -> ParamChoice:
    asked = _asked(name, split_sizes, num_heads)
    if asked:
        return ParamChoice(name, shape, True, f"a hidden matrix; {asked[1]}", asked[0])
    leaf = name.rpartition(".")[0].rpartition(".")[2]
    if any(c.__name__ == "Conv1D" for c in type(owner).__mro__):
        fused = ", its fused query, key and value columns not split" if leaf == "c_attn" else ""
        return ParamChoice(name, shape, True, "a hidden matrix of GPT-2's Conv1D, stored "
                           f"[in, out]: orthogonalized whole in the stored orientation{fused}")
    if leaf == "wqkv" and _attr(parent, "r_dim"):
        groups = shape[0] // (_attr(parent, "head_dim") or shape[0])
        return ParamChoice(name, shape, True, "torchtitan's fused QKV, its rows interleaved by "
                           "key-value head: orthogonalized whole (per-head Muon: num_heads="
                           f"{groups})")
    fused = _fused_rows(leaf, shape, parent)
    if fused is not None:
        sizes, what = fused
        return ParamChoice(name, shape, True, f"a fused projection: {what}", {"split_sizes": sizes})
    return ParamChoice(name, shape, True, "a hidden matrix")


def _attr(owner: nn.Module, *names: str) -> int | None:
    """The first of ``names`` that the owner of a projection (its attention module) or its
    config holds as an int."""
    config = getattr(owner, "config", None)
    for name in names:
        for source in (owner, config):
            value = getattr(source, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def _fused_rows(leaf: str, shape: tuple[int, ...],
                parent: nn.Module) -> tuple[list[int], str] | None:
    """The row blocks of the fused projection ``leaf`` (a Linear's name), sized from the
    module holding it (its attention or MLP) or that module's config, or None."""
    rows = shape[0]
    if leaf == "gate_up_proj" and rows % 2 == 0:
        return [rows // 2] * 2, "gate and up halves"
    heads = _attr(parent, "num_heads", "num_attention_heads", "n_heads")
    if leaf == "qkv_proj":
        head_dim = _attr(parent, "head_dim")
        kv = _attr(parent, "num_key_value_heads", "n_kv_heads")
        if heads and head_dim and kv and rows == (heads + 2 * kv) * head_dim:
            return [heads * head_dim, kv * head_dim, kv * head_dim], "query, key and value rows"
    if leaf in ("kv_a_proj_with_mqa", "wkv_a"):
        lora, rope = _attr(parent, "kv_lora_rank"), _attr(parent, "qk_rope_head_dim")
        if lora and rope and rows == lora + rope:
            return [lora, rope], "MLA's compressed key-value latent and its rope key"
    if leaf in ("kv_b_proj", "wkv_b"):
        nope, v = _attr(parent, "qk_nope_head_dim"), _attr(parent, "v_head_dim")
        if heads and nope and v and rows == heads * (nope + v):
            return [nope, v] * heads, "MLA's key and value rows of each head"
    return None
