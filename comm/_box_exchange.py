"""The exchange between BoxShard and RaggedShard layouts (tensor parallel), planned
once per (src, dst, rank) ([Note: box exchange]); :mod:`._redistribute` runs it."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from vefsdp_optim.sharding import BoxShard, RaggedShard

__all__ = ["box_plan", "launch_boxes"]

# [Note: box exchange]
# Between a BoxShard and a RaggedShard ([Note: boxes in flat order]), the piece of
# tensor i that rank r sends to rank q is r's part of it under src that q holds under
# dst, in increasing flat order. Where src is the BoxShard, that piece is one run of
# r's local data; where dst is, r gathers it from its contiguous slice. A box meets a
# flat range in at most 2 * ndim - 1 strided blocks (``BoxShard.range_parts``), so both
# the gather and the scatter on the ragged side are a few strided copies, no index
# tensors (a whole box into or out of a whole tensor: one). A run of a box (fully_shard
# over a tensor-parallel box) is itself at most 2 * ndim - 1 boxes (``sub_boxes``).
# Pieces are packed peer-major, as in [Note: one exchange per bucket]. Which peers a
# tensor meets is found from flat spans (``flat_span``: a ragged slice, a box's run), by
# bisection on the ragged boundaries or on the box layout's sweep index (``holders``), so
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


def _gather(t: torch.Tensor, s: RaggedShard | BoxShard, d: RaggedShard | BoxShard, a: int, b: int) -> torch.Tensor:
    """Of rank ``a``'s local ``t`` under ``s``, what rank ``b`` holds under ``d`` (1-D)."""
    if isinstance(d, RaggedShard):
        y, m = d.local(b)
        return t[s.count_below(a, y):s.count_below(a, y + m)]
    if isinstance(s, BoxShard):  # equal boxes ([Note: box exchange])
        return t if a == b else t[:0]
    x, n = s.local(a)
    if x == 0 and n == d.numel:
        parts = [t.view(d.shape)[tuple(slice(o, o + z) for o, z in zip(off, size, strict=True))].reshape(-1)
                 for off, size in d.sub_boxes(b)]
    else:
        parts = [t[f:f + math.prod(sz)].view(sz)[sl].reshape(-1) for f, sz, sl, _ in d.range_parts(b, x, x + n)]
    if len(parts) == 1:
        return parts[0]
    return torch.cat(parts) if parts else t[:0]


def _scatter(out: torch.Tensor, piece: torch.Tensor, s: RaggedShard | BoxShard, d: RaggedShard | BoxShard,
             p: int, rank: int) -> None:
    """Write ``piece`` (what rank ``p`` holds under ``s`` and this rank under ``d``) into
    this rank's ``out`` under ``d``."""
    if isinstance(d, BoxShard):
        if isinstance(s, BoxShard):
            out.copy_(piece)
            return
        x, n = s.local(p)
        out[d.count_below(rank, x):d.count_below(rank, x + n)].copy_(piece)
        return
    y, m = d.local(rank)
    if isinstance(s, RaggedShard):
        lo = max(s.local(p)[0], y) - y
        out[lo:lo + piece.numel()].copy_(piece)
        return
    k = 0
    if y == 0 and m == s.numel:
        for off, size in s.sub_boxes(p):
            c = math.prod(size)
            out.view(s.shape)[tuple(slice(o, o + z) for o, z in zip(off, size, strict=True))].copy_(
                piece[k:k + c].view(size))
            k += c
        return
    for f, sz, sl, isz in s.range_parts(p, y, y + m):
        c = math.prod(isz)
        out[f:f + math.prod(sz)].view(sz)[sl].copy_(piece[k:k + c].view(isz))
        k += c


class BoxPlan(NamedTuple):
    """One rank's exchange between layouts of which some are BoxShards."""

    sends: tuple[tuple[int, int], ...]  # (peer, tensor) of every outgoing piece, peer-major
    recvs: tuple[tuple[int, int, int], ...]  # (peer, tensor, numel) of every incoming piece and
    #                                          of those that stay on this rank, peer-major
    send_counts: tuple[int, ...]  # W: elements to each peer
    recv_counts: tuple[int, ...]  # W: elements from each peer
    recv_numel: int
    out_numels: tuple[int, ...]  # per tensor: this rank's elements under dst


@functools.lru_cache(maxsize=1024)
def box_plan(src: tuple[RaggedShard | BoxShard, ...], dst: tuple[RaggedShard | BoxShard, ...], rank: int,
             w: int) -> BoxPlan:
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
    return BoxPlan(tuple(sends), tuple(recvs), tuple(send_counts), tuple(recv_counts), sum(recv_counts),
                   tuple(d.local_numel(rank) for d in dst))


def launch_boxes(locals: list[torch.Tensor], src: Sequence[RaggedShard | BoxShard],
                 dst: Sequence[RaggedShard | BoxShard], plan: BoxPlan, process_group: dist.ProcessGroup,
                 rank: int, async_op: bool
                 ) -> tuple[dist.Work | None, tuple[torch.Tensor, ...], Callable[[], list[torch.Tensor]]]:
    """Launch the exchange of ``plan`` of checked ``locals``: the collective's work (None
    when not ``async_op``), the buffers it uses and the function that unpacks the outputs."""
    ref = locals[0]
    send_pieces = [_gather(locals[i], src[i], dst[i], rank, p) for p, i in plan.sends]
    send_buf = torch.cat(send_pieces) if send_pieces else ref.new_empty(0)
    recv_buf = ref.new_empty(plan.recv_numel)
    work = dist.all_to_all_single(recv_buf, send_buf, list(plan.recv_counts), list(plan.send_counts),
                                  group=process_group, async_op=async_op)

    def finish() -> list[torch.Tensor]:
        out = [ref.new_empty(n) for n in plan.out_numels]
        pos = 0
        for p, i, n in plan.recvs:
            if p == rank:
                piece = _gather(locals[i], src[i], dst[i], rank, rank)
            else:
                piece, pos = recv_buf[pos:pos + n], pos + n
            _scatter(out[i], piece, src[i], dst[i], p, rank)
        if pos != recv_buf.numel():
            raise AssertionError(f"unpacked {pos} of {recv_buf.numel()} received elements")
        return out

    return work, (send_buf, recv_buf), finish
