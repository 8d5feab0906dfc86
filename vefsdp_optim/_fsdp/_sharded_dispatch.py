"""The ops of :class:`ShardedParameter`: which run on local slices, which gather.

See [Note: sharded dispatch]. ``dispatch(cls, func, args, kwargs)`` is the whole of
``ShardedParameter.__torch_dispatch__``; ``cls`` is passed in to keep the import one-way.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from vefsdp_optim._torch_compat import (
    ATEN_FOREACH_NORM,
    ATEN_TO_COPY,
    op_schema,
    tree_flatten,
    tree_map,
    tree_unflatten,
)

__all__ = ["dispatch"]

aten = torch.ops.aten

# [Note: sharded dispatch]
# A ShardedParameter holds one rank's contiguous slice of the flattened tensor. So an op
# runs on the slices only when each output element depends on the inputs at the same
# flat element. Anything else follows DTensor: redistribute to Replicate, compute, return
# a replicated result. A local result is never silently wrong. The rules:
# 1. Local: pointwise ops (torch.Tag.pointwise), masked_fill, *_like, clone, copy_,
#    detach and _to_copy, with their in-place, out= and _foreach_ forms; torch's fused
#    optimizer kernels (_FUSED); a boolean-mask index_put_ with a mask of the same
#    layout, as Rprop uses. Sharded operands must share shape, layout and process group,
#    else ValueError. A plain operand is broadcast to the global shape and this rank's
#    slice taken, so `param.add_(full_update)` works. 0-d tensors and scalars stay as is.
# 2. Flat-order views, contiguous at offset 0 on the global shape (view, reshape, flatten,
#    squeeze, unsqueeze, t of a vector): a ShardedParameter of the new shape, same slice.
# 3. new_zeros / new_ones / new_empty / new_full of another size: a plain tensor.
# 4. Norms with no dim (linalg_vector_norm, _foreach_norm) all-reduce the slices' partial
#    sums, in float32 for 16-bit inputs, once per process group. The plain result is
#    equal on every rank, within rounding of one device's, as DTensor's.
# 5. Everything else gathers every sharded operand, one collective each in argument
#    order, alike on every rank. The op runs on plain tensors and returns replicated
#    results, bitwise one device's. A sharded operand the op writes gets its slice back.
#    So a non-flat-order view such as p.t() or p[1] is a gathered copy: writes miss p.
# 6. In-place random fills (uniform_, normal_: nn.init) draw the whole tensor on every
#    rank from one generator and keep the slice. With a seed shared by the ranks,
#    meta-device initialization then equals one device's.
# NotImplementedError, naming the op, refuses in-place shape changes (t_, resize_, set_),
# other random ops, and fused or foreach kernels handed a plain non-scalar tensor.

_RANDOM_FILLS = {
    aten.uniform_.default, aten.normal_.default, aten.bernoulli_.float, aten.random_.default,
    getattr(aten.random_, "from"), aten.random_.to, aten.exponential_.default, aten.cauchy_.default,
    aten.log_normal_.default, aten.geometric_.default,
}


def _random_fill(func: Any, args: tuple, kwargs: dict) -> Any:
    """Rule 6: draw the whole tensor as one device would, keep this rank's slice."""
    dst = args[0]
    full = torch.empty(dst.shape, dtype=dst.dtype, device=dst._local.device)
    func(full, *args[1:], **kwargs)
    dst._local.copy_(full.view(-1)[dst._layout.local_index(dst._rank, full.device)])
    return dst


_LIKE_OPS = {
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.empty_like.default,
    aten.full_like.default,
    aten.rand_like.default,
    aten.randn_like.default,
    aten.clone.default,
    aten.detach.default,
    aten.alias.default,
    ATEN_TO_COPY,
    aten.zero_.default,
    aten.fill_.Scalar,
    aten.copy_.default,
}
_ELEMENTWISE = {aten.masked_fill.Scalar, aten.masked_fill_.Scalar, aten.masked_fill.Tensor,
                aten.masked_fill_.Tensor}  # per element, though not tagged pointwise
_NORM_OPS = {aten.linalg_vector_norm.default, ATEN_FOREACH_NORM}
_FUSED = {"_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_"}
_NEW_OPS = {aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default,
            aten.new_full.default, aten.new_empty_strided.default}
_SHAPE_MUTATING = {"t_", "transpose_", "squeeze_", "unsqueeze_", "as_strided_", "resize_",
                   "resize_as_", "set_", "swapdims_", "swapaxes_", "_unsafe_view_"}
_SUPPORTED = ("elementwise ops (local), flat-order views, norms (partial sums), and any other "
              "op on gathered full tensors [Note: sharded dispatch]")


def dispatch(cls: type, func: Any, args: tuple, kwargs: dict) -> Any:
    name = func.overloadpacket.__name__
    for a in tree_flatten((args, kwargs))[0]:
        if (isinstance(a, torch.Tensor) and not isinstance(a, cls)
                and type(a) not in (torch.Tensor, torch.nn.Parameter)):
            return NotImplemented  # another tensor subclass (a DTensor): let it decide
    if func in _NORM_OPS and not _norm_has_dim(func, args, kwargs):
        return _norm(cls, func, args, kwargs)
    if name in _FUSED:
        return _fused(cls, func, args, kwargs)
    if name.startswith("_foreach_"):
        return _foreach(func, args, kwargs)
    if func is aten.is_same_size.default:
        return args[0].shape == args[1].shape
    if name in _SHAPE_MUTATING:
        raise NotImplementedError(
            f"ShardedParameter does not support {func} (an in-place change of shape or storage); "
            f"supported: {_SUPPORTED}")
    if func in _NEW_OPS:
        return _new(cls, func, args, kwargs)
    if func in _RANDOM_FILLS:
        return _random_fill(func, args, kwargs)
    if torch.Tag.nondeterministic_seeded in func.tags and func not in _LIKE_OPS:
        raise NotImplementedError(
            f"ShardedParameter does not support {func}: a random op would differ between ranks; "
            f"supported: {_SUPPORTED}")
    if func in _LIKE_OPS or func in _ELEMENTWISE or torch.Tag.pointwise in func.tags:
        local = _pointwise(cls, func, args, kwargs)
        if local is not NotImplemented:
            return local
    elif func.is_view:
        view = _flat_view(cls, func, args, kwargs)
        if view is not NotImplemented:
            return view
    elif func is aten.index_put_.default:
        local = _mask_put(cls, args, kwargs)
        if local is not NotImplemented:
            return local
    return _gathered(cls, func, args, kwargs)


# -- rule 1: local ---------------------------------------------------------------------

def _ref(cls: type, func: Any, flat: list) -> Any:
    ref = None
    for a in flat:
        if isinstance(a, cls):
            if ref is None:
                ref = a
            elif (a._layout != ref._layout or a._process_group is not ref._process_group
                      or a.shape != ref.shape):
                raise ValueError(
                    f"{func}: sharded operands differ in shape or layout: {tuple(ref.shape)} "
                    f"{ref._layout} vs {tuple(a.shape)} {a._layout}")
    if ref is None:
        raise AssertionError(f"{func} dispatched to ShardedParameter without a sharded operand")
    return ref


def _slice_of(ref: Any, t: torch.Tensor) -> torch.Tensor:
    """This rank's slice of plain ``t`` broadcast to ``ref``'s global shape."""
    return t.expand(ref.shape).reshape(-1)[ref._layout.local_index(ref._rank, t.device)]


def _pointwise(cls: type, func: Any, args: tuple, kwargs: dict) -> Any:
    if any(str(r.type) != "Tensor" for r in op_schema(func).returns):
        return NotImplemented  # a reduction to a Python value (aten.equal): on the full tensors
    flat, spec = tree_flatten((args, kwargs))
    ref = _ref(cls, func, flat)
    names = {a.name for a in op_schema(func).arguments
             if a.alias_info is not None and a.alias_info.is_write}
    mutable = bool(names)
    if names - {"self"} and names != {"out"}:
        return NotImplemented  # several outputs written: rule 5 maps them back
    written = kwargs.get("out") if names == {"out"} else args[0] if mutable else None
    plain = [a for a in flat
             if isinstance(a, torch.Tensor) and not isinstance(a, cls) and a.dim() > 0]
    if plain:
        try:
            shape = torch.broadcast_shapes(*(a.shape for a in flat if isinstance(a, torch.Tensor)))
        except RuntimeError:
            return NotImplemented
        if shape != ref.shape or (mutable and not isinstance(written, cls)):
            return NotImplemented  # the sharded operand is broadcast, or a plain one is written
    if mutable and written is not None and not isinstance(written, cls):
        return NotImplemented

    def unwrap(a: Any) -> Any:
        if isinstance(a, cls):
            return a._local
        if isinstance(a, torch.Tensor) and a.dim() > 0:
            return _slice_of(ref, a)
        return a

    local_args, local_kwargs = tree_unflatten([unwrap(a) for a in flat], spec)
    out = func(*local_args, **local_kwargs)
    if mutable:
        return written

    def wrap(o: Any) -> Any:
        if isinstance(o, torch.Tensor) and o.dim() == 1 and o.numel() == ref._local.numel():
            return ref._same(o)
        raise AssertionError(f"{func} on local slices gave {o!r}, not a slice of the layout")

    return tree_map(wrap, out)


def _fused(cls: type, func: Any, args: tuple, kwargs: dict) -> Any:
    """A fused optimizer kernel on the local slices (its math is per element). Entry k of
    every list belongs to parameter k: all sharded with one layout, or all plain."""
    lists = [i for i, a in enumerate(args) if isinstance(a, (list, tuple))]
    new_args = [list(a) if i in lists else a for i, a in enumerate(args)]
    for a in tree_flatten(([a for i, a in enumerate(args) if i not in lists], kwargs))[0]:
        if isinstance(a, cls):
            raise NotImplementedError(f"{func}: a ShardedParameter as a scalar argument")
    for k in range(len(args[lists[0]]) if lists else 0):
        column = [(i, args[i][k]) for i in lists if len(args[i]) > k]
        if not any(isinstance(t, cls) for _, t in column):
            continue
        _ref(cls, func, [t for _, t in column])
        for i, t in column:
            if isinstance(t, cls):
                new_args[i][k] = t._local
            elif isinstance(t, torch.Tensor) and t.numel() > 1:
                raise NotImplementedError(
                    f"{func}: a plain tensor of shape {tuple(t.shape)} with a "
                    "ShardedParameter's params, grads or states; supported: all of one parameter's "
                    "tensors sharded with one layout (steps and scalars as 0-d / 1-element "
                    "tensors), or all plain")
    func(*new_args, **kwargs)
    return None


def _mask_put(cls: type, args: tuple, kwargs: dict) -> Any:
    """``t[mask] = v`` with a boolean mask of t's layout and a scalar v: local."""
    self, indices, values = args[0], args[1], args[2]
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    if (not isinstance(self, cls) or len(indices) != 1 or not isinstance(indices[0], cls)
            or indices[0].dtype != torch.bool or values.dim() != 0 or isinstance(values, cls)):
        return NotImplemented
    _ref(cls, aten.index_put_.default, [self, indices[0]])
    self._local.index_put_((indices[0]._local,), values, accumulate)
    return self


def _foreach(func: Any, args: tuple, kwargs: dict) -> Any:
    """Run a ``_foreach_`` op as its per-element op (its lists may mix process groups)."""
    name = func.overloadpacket.__name__
    inplace = name.endswith("_")
    base = name[len("_foreach_"):]
    lists = [i for i, a in enumerate(args) if isinstance(a, (list, tuple))]
    n = len(args[lists[0]])
    per = getattr(aten, base, None)
    if per is None and inplace:  # e.g. maximum_: only an out= form per element
        out_of_place = getattr(aten, base[:-1])

        def per(t: Any, *rest: Any, **kw: Any) -> Any:
            return out_of_place(t, *rest, **kw, out=t)
    results = []
    for k in range(n):
        a_k = [a[k] if i in lists else a for i, a in enumerate(args)]
        kw = dict(kwargs)
        if base.startswith(("addcmul", "addcdiv")) and len(a_k) == 4:
            v = a_k.pop()  # positional in the foreach schema, keyword-only per element
            kw["value"] = v[k].item() if isinstance(v, torch.Tensor) else v
        results.append(per(*a_k, **kw))
    return None if inplace else results


# -- rule 2: flat-order views ----------------------------------------------------------

def _flat_view(cls: type, func: Any, args: tuple, kwargs: dict) -> Any:
    t = args[0]
    if not isinstance(t, cls) or any(isinstance(a, cls)
                                     for a in tree_flatten((args[1:], kwargs))[0]):
        return NotImplemented
    meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
    try:
        out = func(meta, *args[1:], **kwargs)
    except (RuntimeError, NotImplementedError):  # no meta kernel: rule 5 decides
        return NotImplemented
    if (not isinstance(out, torch.Tensor) or out.dtype != t.dtype or out.numel() != t.numel()
            or out.storage_offset() != 0 or not out.is_contiguous()):
        return NotImplemented
    return cls(t._local.view(-1), t._layout, t._process_group, out.shape, t._rank)


# -- rule 3: new tensors of another size -----------------------------------------------

def _new(cls: type, func: Any, args: tuple, kwargs: dict) -> Any:
    t = args[0]
    like = torch.empty(0, dtype=t.dtype, device=t.device)  # carries dtype and device only
    return func(like, *args[1:], **kwargs)


# -- rule 4: norms -------------------------------------------------------------------------

def _norm_has_dim(func: Any, args: tuple, kwargs: dict) -> bool:
    """A norm over dims, or with keepdim: not a full reduction to a 0-d tensor (rule 5)."""
    if func is not aten.linalg_vector_norm.default:
        return False
    return ((len(args) > 2 and args[2] is not None) or kwargs.get("dim") is not None
            or (len(args) > 3 and args[3]) or bool(kwargs.get("keepdim")))


def _norm(cls: type, func: Any, args: tuple, kwargs: dict) -> Any:
    tensors = list(args[0]) if func is ATEN_FOREACH_NORM else [args[0]]
    ord_ = float(args[1] if len(args) > 1 else kwargs.get("ord", 2))
    dtype = kwargs.get("dtype") if func is aten.linalg_vector_norm.default else (
        args[2] if len(args) > 2 else kwargs.get("dtype"))
    outs = []
    for t in tensors:
        local = t._local if isinstance(t, cls) else t.reshape(-1)
        if dtype is not None:
            local = local.to(dtype)
        out_dtype = local.dtype
        if local.dtype in (torch.float16, torch.bfloat16):
            local = local.float()  # as torch's own kernel accumulates
        if ord_ == math.inf:
            part = local.abs().amax() if local.numel() else local.new_zeros(())
        elif ord_ == -math.inf:
            part = local.abs().amin() if local.numel() else local.new_full((), math.inf)
        elif ord_ == 0:
            part = (local != 0).sum().to(local.dtype)
        else:
            part = local.abs().pow(ord_).sum() if local.numel() else local.new_zeros(())
        outs.append((t, part, out_dtype))
    # one all_reduce per (process group, kind) of partials
    results: list[torch.Tensor | None] = [None] * len(outs)
    by_process_group: dict[int, list[int]] = {}
    for i, (t, _, _) in enumerate(outs):
        process_group = t._process_group if isinstance(t, cls) else None
        by_process_group.setdefault(id(process_group), []).append(i)
    for idx in by_process_group.values():
        t0 = outs[idx[0]][0]
        process_group = t0._process_group if isinstance(t0, cls) else None
        parts = torch.stack([outs[i][1] for i in idx])
        if process_group is not None:
            op = {math.inf: dist.ReduceOp.MAX,
                  -math.inf: dist.ReduceOp.MIN}.get(ord_, dist.ReduceOp.SUM)
            dist.all_reduce(parts, op=op, group=process_group)
        for j, i in enumerate(idx):
            v = parts[j]
            if ord_ not in (math.inf, -math.inf, 0.0):
                v = v.pow(1.0 / ord_)
            results[i] = v.to(outs[i][2])
    return results if func is ATEN_FOREACH_NORM else results[0]


# -- rule 5: gather, compute, replicate ----------------------------------------------------

def _gathered(cls: type, func: Any, args: tuple, kwargs: dict) -> Any:
    flat, spec = tree_flatten((args, kwargs))
    written_idx = _written_positions(func, args, kwargs, spec)
    full: dict[int, torch.Tensor] = {}  # id(sharded) -> its gathered tensor (one per object)
    for a in flat:
        if isinstance(a, cls) and id(a) not in full:
            full[id(a)] = a._gather_full()
    plain_flat = [full[id(a)] if isinstance(a, cls) else a for a in flat]
    local_args, local_kwargs = tree_unflatten(plain_flat, spec)
    out = func(*local_args, **local_kwargs)
    back: dict[int, Any] = {}
    for i in written_idx:
        dst = flat[i]
        if not isinstance(dst, cls):
            continue
        src = full[id(dst)]
        if src.shape != dst.shape:
            raise NotImplementedError(f"ShardedParameter does not support {func} "
                                      "changing its shape")
        dst._local.copy_(src.reshape(-1)[dst._layout.local_index(dst._rank, src.device)])
        back[id(src)] = dst
    return tree_map(lambda o: back.get(id(o), o) if isinstance(o, torch.Tensor) else o, out)


def _written_positions(func: Any, args: tuple, kwargs: dict, spec: Any) -> list[int]:
    """Flat positions (in tree_flatten((args, kwargs)) order) of the tensors func writes."""
    names = {a.name for a in op_schema(func).arguments
             if a.alias_info is not None and a.alias_info.is_write}
    if not names:
        return []
    marks = []
    for j, a in enumerate(op_schema(func).arguments):
        value = (kwargs[a.name] if a.name in kwargs else args[j]
                 if j < len(args) and not a.kwarg_only else None)
        marks.append((a.name, value))
    written = {id(t) for n, v in marks if n in names for t in tree_flatten(v)[0]}  # lists too
    flat, _ = tree_flatten((args, kwargs))
    return [i for i, a in enumerate(flat) if id(a) in written]
