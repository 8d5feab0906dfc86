"""The exchange between BoxShard and RaggedShard layouts (tensor parallel), planned
once per (src, dst, rank), as the comment below says; :mod:`._redistribute` runs it."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from vefsdp_optim._torch_compat import foreach_copy_, view_base
from vefsdp_optim.sharding import BoxShard, RaggedShard

__all__ = ["box_plan", "launch_boxes"]

# Between a BoxShard and a RaggedShard ([Note: boxes in flat order] in sharding/_box.py),
# the piece of tensor i that rank r sends to rank q is r's part of it under src that q
# holds under dst, in increasing flat order. Where src is the BoxShard, that piece is one
# run of r's local data. Where dst is, r gathers it from its contiguous slice. A box
# meets a flat range in at most 2 * ndim - 1 strided blocks (``BoxShard.range_parts``),
# and a run of a box (fully_shard over a tensor-parallel box) is itself at most
# 2 * ndim - 1 boxes (``sub_boxes``). So the gather and the scatter on the ragged side are
# a few strided copies, with no index tensors; a whole box into or out of a whole tensor
# is one. Pieces are packed peer-major, as in comm/_redistribute.py. The peers a tensor
# meets are found from flat spans (``flat_span``: a ragged slice, a box's run), by
# bisection on the ragged boundaries or on the box layout's sweep index (``holders``). So
# a plan costs O(P log W + pieces), and it is built once per (src, dst, rank).


def _count(s: RaggedShard | BoxShard, d: RaggedShard | BoxShard, a: int, b: int) -> int:
    """How many elements rank ``a`` holds under ``s`` and rank ``b`` under ``d``."""
    if isinstance(d, RaggedShard):
        y, m = d.local(b)
        return s.count_below(a, y + m) - s.count_below(a, y)
    if isinstance(s, RaggedShard):
        x, n = s.local(a)
        return d.count_below(b, x + n) - d.count_below(b, x)
    if s != d:
        raise AssertionError("redistribution between two different BoxShards")
    return s.local_numel(a) if a == b else 0


def _gather_views(t: torch.Tensor, s: RaggedShard | BoxShard, d: RaggedShard | BoxShard, a: int,
                  b: int) -> list[torch.Tensor]:
    """Of rank ``a``'s local ``t`` under ``s``, what rank ``b`` holds under ``d``: views of
    ``t``, in the piece's order (strided where a part is)."""
    if isinstance(d, RaggedShard):
        y, m = d.local(b)
        return [t[s.count_below(a, y):s.count_below(a, y + m)]]
    if isinstance(s, BoxShard):  # equal boxes (see the comment at the top of this file)
        return [t if a == b else t[:0]]
    x, n = s.local(a)
    if x == 0 and n == d.numel:
        return [t.view(d.shape)[tuple(slice(o, o + z) for o, z in zip(off, size, strict=True))]
                for off, size in d.sub_boxes(b)]
    return [t[f:f + math.prod(sz)].view(sz)[sl] for f, sz, sl, _ in d.range_parts(b, x, x + n)]


def _gather(t: torch.Tensor, s: RaggedShard | BoxShard, d: RaggedShard | BoxShard, a: int,
            b: int) -> torch.Tensor:
    """Of rank ``a``'s local ``t`` under ``s``, what rank ``b`` holds under ``d`` (1-D)."""
    parts = [v.reshape(-1) for v in _gather_views(t, s, d, a, b)]
    if len(parts) == 1:
        return parts[0]
    return torch.cat(parts) if parts else t[:0]


def _scatter_targets(out: torch.Tensor, s: RaggedShard | BoxShard, d: RaggedShard | BoxShard,
                     p: int, rank: int) -> list[torch.Tensor]:
    """Where this rank's ``out`` under ``d`` takes what rank ``p`` holds under ``s``: views
    of ``out``, in the piece's order (a piece fills them one after the other)."""
    if isinstance(d, BoxShard):
        if isinstance(s, BoxShard):
            return [out]
        x, n = s.local(p)
        return [out[d.count_below(rank, x):d.count_below(rank, x + n)]]
    y, m = d.local(rank)
    if isinstance(s, RaggedShard):
        lo = max(s.local(p)[0], y) - y
        return [out[lo:lo + _count(s, d, p, rank)]]
    if y == 0 and m == s.numel:
        return [out.view(s.shape)[tuple(slice(o, o + z) for o, z in zip(off, size, strict=True))]
                for off, size in s.sub_boxes(p)]
    return [out[f:f + math.prod(sz)].view(sz)[sl] for f, sz, sl, _ in s.range_parts(p, y, y + m)]


def _scatter(out: torch.Tensor, piece: torch.Tensor, s: RaggedShard | BoxShard,
             d: RaggedShard | BoxShard, p: int, rank: int) -> None:
    """Write ``piece`` (what rank ``p`` holds under ``s`` and this rank under ``d``) into
    this rank's ``out`` under ``d``."""
    k = 0
    for target in _scatter_targets(out, s, d, p, rank):
        c = target.numel()
        target.copy_(piece[k:k + c].view(target.shape))
        k += c


# An owner of a whole matrix meets every rank that holds a part of it: W pieces per
# exchange. Copying each piece on its own costs Python time per piece and, on a GPU, one
# copy kernel each (figures in docs/decisions.md). So the plan records every piece's place
# once, on meta tensors, as a strided view (size, stride, offset) of a local buffer, of the
# send or receive buffer, or of an output. A step makes the views with ``as_strided`` and
# moves them all with one ``torch._foreach_copy_`` per side: the same copies, so the same
# bits. ``_merged`` joins consecutive places that step evenly through one buffer into one
# view of one more dimension, so an owner's pieces of an evenly cut dp x tp grid are one.


class Views(NamedTuple):
    """Strided views of several 1-D buffers: (buffer, size, stride, offset from the
    buffer's start) each, in order."""

    views: tuple[tuple[int, tuple[int, ...], tuple[int, ...], int], ...]

    def of(self, buffers: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        starts = [t.storage_offset() for t in buffers]
        return [buffers[i].as_strided(size, stride, starts[i] + off)
                for i, size, stride, off in self.views]


def _places(views: list[torch.Tensor], root: torch.Tensor,
            i: int) -> list[tuple[int, tuple, tuple, int]]:
    """The places of the non-empty ``views`` of the flat meta buffer ``root`` (index ``i``)."""
    out = []
    for v in views:
        if v.numel() == 0:
            continue
        if not (v is root or view_base(v) is root):
            raise AssertionError("a box piece that is not a view of its buffer")
        out.append((i, tuple(v.shape), tuple(v.stride()),
                    v.storage_offset() - root.storage_offset()))
    return out


def _merged(places: list[tuple[int, tuple, tuple, int]]) -> list[tuple[int, tuple, tuple, int]]:
    """The same elements in the same order as fewer views (see ``Views``): a
    run of consecutive views of one buffer with one size and stride whose offsets step
    by a constant is one view with a leading dimension of the run's length; repeated, so
    an owner's W pieces of an evenly cut dp x tp grid become one [dp, tp, rows, cols] view."""
    while True:
        out: list[tuple[int, tuple, tuple, int]] = []
        j = 0
        while j < len(places):
            i, size, stride, off = places[j]
            k = j + 1
            if k < len(places) and places[k][:3] == (i, size, stride):
                step = places[k][3] - off  # > 0 only: as_strided takes no negative stride
                while (step > 0 and k < len(places) and places[k][:3] == (i, size, stride)
                       and places[k][3] - off == (k - j) * step):
                    k += 1
            if k - j > 1:
                out.append((i, (k - j, *size), (step, *stride), off))
            else:
                out.append(places[j])
            j = k
        if len(out) == len(places):
            return out
        places = out


def _packed(places: list[tuple[int, tuple, tuple, int]]) -> Views:
    """The same shapes, one after another in one contiguous buffer (index 0)."""
    out, pos = [], 0
    for _, size, _, _ in places:
        stride, k = [], 1
        for z in reversed(size):
            stride.append(k)
            k *= z
        out.append((0, size, tuple(reversed(stride)), pos))
        pos += math.prod(size)
    return Views(tuple(out))


class BoxPlan(NamedTuple):
    """One rank's exchange between layouts of which some are BoxShards."""

    sends: tuple[tuple[int, int], ...]  # (peer, tensor) of every outgoing piece, peer-major
    recvs: tuple[tuple[int, int, int], ...]  # (peer, tensor, numel) of every incoming piece and
    #                                          of those that stay on this rank, peer-major
    send_counts: tuple[int, ...]  # W: elements to each peer
    recv_counts: tuple[int, ...]  # W: elements from each peer
    recv_numel: int
    out_numels: tuple[int, ...]  # per tensor: this rank's elements under dst
    # ``Views``: where the sent pieces are in the src locals and in the
    # send buffer; where the received ones (not this rank's own) are in the receive buffer
    # and in the outputs
    send_from: Views = Views(())
    send_to: Views = Views(())
    recv_from: Views = Views(())
    recv_to: Views = Views(())
    own: tuple[int, ...] = ()  # the tensors of which this rank keeps a piece


@functools.lru_cache(maxsize=1024)
def box_plan(src: tuple[RaggedShard | BoxShard, ...], dst: tuple[RaggedShard | BoxShard, ...],
             rank: int, w: int) -> BoxPlan:
    """The plan of :func:`launch_boxes` for checked layouts over ``w`` ranks."""
    out: dict[int, list[tuple[int, int]]] = {}  # peer -> (tensor, numel) sent to it
    inc: dict[int, list[tuple[int, int]]] = {}  # peer -> (tensor, numel) received from it
    for i, (s, d) in enumerate(zip(src, dst, strict=True)):
        if isinstance(s, BoxShard) and isinstance(d, BoxShard):  # equal boxes: all stays
            peers_out, peers_in = [], []
        else:
            peers_out = d.holders(*s.flat_span(rank))
            peers_in = s.holders(*d.flat_span(rank))
        for p in peers_out:
            if p != rank and (n := _count(s, d, rank, p)):
                out.setdefault(p, []).append((i, n))
        for p in sorted({*peers_in, rank}):
            if n := _count(s, d, p, rank):
                inc.setdefault(p, []).append((i, n))
    send_counts, recv_counts = [0] * w, [0] * w
    sends = []
    for p in sorted(out):
        for i, n in out[p]:
            sends.append((p, i))
            send_counts[p] += n
    recvs = []
    for p in sorted(inc):
        for i, n in sorted(inc[p]):
            recvs.append((p, i, n))
            if p != rank:
                recv_counts[p] += n
    out_numels = tuple(d.local_numel(rank) for d in dst)
    meta = torch.device("meta")
    ins = [torch.empty(s.local_numel(rank), device=meta) for s in src]
    outs = [torch.empty(n, device=meta) for n in out_numels]
    send_from = _merged([v for p, i in sends
                         for v in _places(_gather_views(ins[i], src[i], dst[i], rank, p), ins[i],
                                          i)])
    recv_to = _merged([v for p, i, _ in recvs if p != rank
                       for v in _places(_scatter_targets(outs[i], src[i], dst[i], p, rank), outs[i],
                                        i)])
    if (sum(math.prod(sz) for _, sz, _, _ in recv_to) != sum(recv_counts)
            or sum(math.prod(sz) for _, sz, _, _ in send_from) != sum(send_counts)):
        raise AssertionError("the pieces do not fill the send and receive buffers")
    return BoxPlan(tuple(sends), tuple(recvs), tuple(send_counts), tuple(recv_counts),
                   sum(recv_counts),
                   out_numels, Views(tuple(send_from)), _packed(send_from), _packed(recv_to),
                   Views(tuple(recv_to)), tuple(i for p, i, _ in recvs if p == rank))


def launch_boxes(locals: list[torch.Tensor], src: Sequence[RaggedShard | BoxShard],
                 dst: Sequence[RaggedShard | BoxShard], plan: BoxPlan,
                 process_group: dist.ProcessGroup, rank: int, async_op: bool
                 ) -> tuple[dist.Work | None, tuple[torch.Tensor, ...],
                            Callable[[], list[torch.Tensor]]]:
    """Launch the exchange of ``plan`` of checked ``locals``: the collective's work (None
    when not ``async_op``), the buffers it uses and the function that unpacks the outputs."""
    ref = locals[0]
    # the plan's places are in 1-D contiguous buffers (see ``Views``)
    locals = [t if t.is_contiguous() else t.contiguous() for t in locals]
    send_buf = ref.new_empty(sum(plan.send_counts))
    if plan.send_from.views:  # ``Views``
        foreach_copy_(plan.send_to.of([send_buf]), plan.send_from.of(locals))
    recv_buf = ref.new_empty(plan.recv_numel)
    work = dist.all_to_all_single(recv_buf, send_buf, list(plan.recv_counts),
                                  list(plan.send_counts), group=process_group, async_op=async_op)

    def finish() -> list[torch.Tensor]:
        out = [ref.new_empty(n) for n in plan.out_numels]
        if plan.recv_to.views:  # ``Views``
            foreach_copy_(plan.recv_to.of(out), plan.recv_from.of([recv_buf]))
        for i in plan.own:
            _scatter(out[i], _gather(locals[i], src[i], dst[i], rank, rank), src[i], dst[i], rank,
                     rank)
        return out

    return work, (send_buf, recv_buf), finish
