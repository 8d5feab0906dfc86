"""Move many tensors between RaggedShard layouts in one batched all_to_all_single.

Tensor i lives on this rank as the slice [a_i, b_i) of its flat storage under src[i]
and must end as [c_i, d_i) under dst[i]. For each peer p the outgoing pieces are the
intersections of [a_i, b_i) with p's dst slice, in tensor order. The send buffer is one
torch.cat of these pieces, peer-major (rank order), so split sizes are per-peer sums.
Pieces that stay on this rank never enter the send buffer. Incoming pieces arrive
peer-major too. Since src slices are in rank order, the pieces of one output sorted by
peer are also sorted by position. So an output is a single view, of an input or of the
receive buffer, when one source covers it, else a view of the one buffer that assembles
every such output (see ``_JOIN_ALIGN``). Nothing crosses ranks iff src[i] == dst[i] for
every i: if two boundary lists differ at position k, say b_src[k] < b_dst[k], the
element b_src[k] is held by a src rank >= k and by a dst rank < k. So equal layouts are
the only case without a collective.

Every rank must pass the same layouts, in the same order: the collective does not detect
a mismatch (it would exchange wrong sizes or hang), so callers run
:func:`check_same_on_all_ranks` on a fingerprint of their layouts before the first exchange."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from vefsdp_optim._torch_compat import foreach_copy_
from vefsdp_optim.sharding import BoxShard, RaggedShard

from ._box_exchange import BoxPlan, box_plan, launch_boxes
from ._collectives import same_on_all_ranks

__all__ = ["RedistributeHandle", "Route", "check_same_on_all_ranks", "redistribute",
           "transfer_sizes"]


class _Piece(NamedTuple):
    tensor: int  # index into the batch
    lo: int  # flat start in the tensor
    hi: int  # flat end in the tensor (exclusive)


def _overlaps(lo: int, hi: int, layout: RaggedShard) -> list[tuple[int, int, int]]:
    """``(peer, lo', hi')`` for each peer whose slice under ``layout`` meets ``[lo, hi)``."""
    out = []
    for p in layout.holders(lo, hi):
        x, y = layout.flat_span(p)
        x, y = max(lo, x), min(hi, y)
        if x < y:
            out.append((p, x, y))
    return out


def _routes(
    src: Sequence[RaggedShard], dst: Sequence[RaggedShard], rank: int
) -> tuple[list[list[_Piece]], list[list[_Piece]]]:
    """Per peer: the pieces this rank sends and receives (self included), tensor order."""
    w = src[0].world_size if src else 1
    send: list[list[_Piece]] = [[] for _ in range(w)]
    recv: list[list[_Piece]] = [[] for _ in range(w)]
    for i, (s, d) in enumerate(zip(src, dst, strict=True)):
        a, n = s.local(rank)
        for p, x, y in _overlaps(a, a + n, d):
            send[p].append(_Piece(i, x, y))
        c, m = d.local(rank)
        for p, x, y in _overlaps(c, c + m, s):
            recv[p].append(_Piece(i, x, y))
    return send, recv


def _check_layouts(src: Sequence[RaggedShard], dst: Sequence[RaggedShard]) -> int:
    if len(src) != len(dst):
        raise ValueError(f"src and dst must list the same tensors, got {len(src)} and {len(dst)} layouts")
    w = None
    for i, (s, d) in enumerate(zip(src, dst, strict=True)):
        for name, lay in (("src", s), ("dst", d)):
            if not isinstance(lay, (RaggedShard, BoxShard)):
                raise TypeError(f"{name}[{i}] must be a RaggedShard or a BoxShard, got {type(lay).__name__}")
        if isinstance(s, BoxShard) and isinstance(d, BoxShard) and s != d:
            raise NotImplementedError(f"tensor {i}: redistribution between two different BoxShards; "
                                      "supported: between a BoxShard and a RaggedShard")
        if s.numel != d.numel:
            raise ValueError(f"tensor {i}: src has {s.numel} elements, dst has {d.numel}")
        if s.world_size != d.world_size or (w is not None and s.world_size != w):
            raise ValueError(
                f"tensor {i}: all layouts must have one world size, got src {s.world_size}, "
                f"dst {d.world_size}" + (f", expected {w}" if w is not None else "")
            )
        w = s.world_size
    return 1 if w is None else w


def transfer_sizes(
    src: Sequence[RaggedShard], dst: Sequence[RaggedShard], rank: int
) -> tuple[list[int], list[int]]:
    """Elements ``rank`` sends to and receives from each peer in ``redistribute(src -> dst)``.

    These are the split sizes of the all_to_all_single: the entry for ``rank`` itself is
    0, since what stays on a rank is copied locally, not sent.
    """
    w = _check_layouts(src, dst)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < w:
        raise ValueError(f"rank must be an int in [0, {w}), got {rank!r}")
    send, recv = _routes(src, dst, rank)
    sc = [sum(q.hi - q.lo for q in pieces) for pieces in send]
    rc = [sum(q.hi - q.lo for q in pieces) for pieces in recv]
    sc[rank] = rc[rank] = 0
    return sc, rc


class _RaggedPlan(NamedTuple):
    """One rank's part of an exchange between RaggedShards, derived once per layouts
    (the step loop repeats the same few every step)."""

    send: tuple[tuple[int, int, int], ...]  # (tensor, local lo, local hi), peer-major
    send_counts: tuple[int, ...]
    recv_counts: tuple[int, ...]
    recv_numel: int
    # per output, its pieces in flat order: (tensor, lo, hi) of a local input that
    # stays, or (-1, lo, hi) of the receive buffer
    assemble: tuple[tuple[tuple[int, int, int], ...], ...]
    # the outputs of two or more pieces, copied into one buffer (see ``_JOIN_ALIGN``):
    # (output, offset, numel) in output order; all their pieces in that order, each with
    # its destination (lo, hi) in the buffer; the buffer's numel
    joined: tuple[tuple[int, int, int], ...]
    # (buffer, lo, hi, count, stride): count pieces of hi - lo elements, stride apart from
    # lo (see ``_JOIN_ALIGN``: a run that steps evenly through its buffer is one view)
    joined_pieces: tuple[tuple[int, int, int, int, int], ...]
    joined_dst: tuple[tuple[int, int], ...]
    joined_numel: int


def _coalesced(pieces: list[tuple[int, int, int]], dst: list[tuple[int, int]]
               ) -> tuple[tuple[tuple[int, int, int], ...], tuple[tuple[int, int], ...]]:
    """Pieces ``(buffer, lo, hi)`` copied to ranges ``dst`` (``(lo, hi)``, in order), with
    each run that is consecutive on both sides as one piece: one copy (see ``_JOIN_ALIGN``)."""
    src_out: list[tuple[int, int, int]] = []
    dst_out: list[tuple[int, int]] = []
    for (b, lo, hi), (a, c) in zip(pieces, dst, strict=True):
        if src_out and src_out[-1][0] == b and src_out[-1][2] == lo and dst_out[-1][1] == a:
            src_out[-1], dst_out[-1] = (b, src_out[-1][1], hi), (dst_out[-1][0], c)
        else:
            src_out.append((b, lo, hi))
            dst_out.append((a, c))
    return tuple(src_out), tuple(dst_out)


def _strided(pieces: tuple[tuple[int, int, int], ...], dst: tuple[tuple[int, int], ...]
             ) -> tuple[tuple[tuple[int, int, int, int, int], ...], tuple[tuple[int, int], ...]]:
    """Coalesced pieces ``(buffer, lo, hi)`` with each run of equal pieces that step evenly
    through one buffer, copied to consecutive ranges, as one ``(buffer, lo, lo + n,
    count, stride)`` to one range (see ``_JOIN_ALIGN``): an owner's pieces of one tensor
    from each of W peers, which each sent two tensors, lie every other piece in the
    receive buffer."""
    out: list[list[int]] = []
    dst_out: list[tuple[int, int]] = []
    for (b, lo, hi), (a, c) in zip(pieces, dst, strict=True):
        if out:
            pb, plo, phi, count, stride = out[-1]
            # a second piece sets the stride
            n, step = phi - plo, lo - plo if count == 1 else stride
            if pb == b and hi - lo == n and dst_out[-1][1] == a and step > n and lo - plo == count * step:
                out[-1][3:] = [count + 1, step]
                dst_out[-1] = (dst_out[-1][0], c)
                continue
        out.append([b, lo, hi, 1, 0])
        dst_out.append((a, c))
    return tuple(tuple(x) for x in out), tuple(dst_out)


def _piece(buf: torch.Tensor, lo: int, hi: int, count: int, stride: int) -> torch.Tensor:
    """The view of a :func:`_strided` piece of the 1-D ``buf``: ``(count, hi - lo)``."""
    return buf[lo:hi] if count == 1 else buf[lo:].as_strided((count, hi - lo), (stride, 1))


@functools.lru_cache(maxsize=1024)
def _ragged_plan(src: tuple[RaggedShard, ...], dst: tuple[RaggedShard, ...], rank: int) -> _RaggedPlan:
    w = src[0].world_size
    send, recv = _routes(src, dst, rank)
    sends = []
    for p in range(w):
        if p != rank:
            for q in send[p]:
                a = src[q.tensor].local(rank)[0]
                sends.append((q.tensor, q.lo - a, q.hi - a))
    send_counts = tuple(0 if p == rank else sum(q.hi - q.lo for q in send[p]) for p in range(w))
    recv_counts = tuple(0 if p == rank else sum(q.hi - q.lo for q in recv[p]) for p in range(w))
    assemble: list[list[tuple[int, int, int]]] = [[] for _ in src]
    pos = 0
    for p in range(w):
        for q in recv[p]:
            if p == rank:
                a = src[q.tensor].local(rank)[0]
                assemble[q.tensor].append((q.tensor, q.lo - a, q.hi - a))
            else:
                assemble[q.tensor].append((-1, pos, pos + q.hi - q.lo))
                pos += q.hi - q.lo
    for i, pieces in enumerate(assemble):
        got, n = sum(hi - lo for _, lo, hi in pieces), dst[i].local(rank)[1]
        if got != n:
            raise AssertionError(f"tensor {i}: assembled {got} elements, dst gives {n}")
    joined, joined_pieces, joined_dst, at = [], [], [], 0
    for i, pieces in enumerate(assemble):
        if len(pieces) > 1:
            at = -(-at // _JOIN_ALIGN) * _JOIN_ALIGN
            n = sum(hi - lo for _, lo, hi in pieces)
            joined.append((i, at, n))
            for piece in pieces:
                joined_pieces.append(piece)
                joined_dst.append((at, at + piece[2] - piece[1]))
                at += piece[2] - piece[1]
    # the send buffer is the sends one after another
    starts = list(itertools.accumulate((hi - lo for _, lo, hi in sends), initial=0))
    send, _ = _coalesced(sends, list(itertools.pairwise(starts)))
    joined_pieces, joined_dst = _strided(*_coalesced(joined_pieces, joined_dst))
    return _RaggedPlan(send, send_counts, recv_counts, pos, tuple(tuple(ps) for ps in assemble),
                       tuple(joined), joined_pieces, joined_dst, at)


# An output of one piece is a view of it, of the receive buffer or of the local input
# that stays. Outputs of several pieces are assembled in ONE buffer by one foreach copy
# (one launch on CUDA, where a cat per output took one each), in output order. Each starts
# at a multiple of _JOIN_ALIGN elements: 64-byte aligned like a fresh tensor, since CPU
# kernels round by the address of their operands (``aligned`` in _step_loop.py). They are
# consecutive where an output's length is a multiple of it, so a batch of equal outputs is
# a view of the buffer (muon_orthogonalize_batched's). Pieces that lie one after another in
# their buffer are one copy: an owner's W row pieces of a matrix, received in rank order,
# are one range of the receive buffer. Equal pieces that step evenly through their buffer
# are one strided view: an owner's pieces of one tensor from W peers that each sent it two
# tensors, every other piece of the receive buffer.
_JOIN_ALIGN = 64  # elements: 64 bytes or more for every dtype


@functools.lru_cache(maxsize=1024)
def _check_layouts_cached(src: tuple, dst: tuple) -> tuple[int, bool]:
    return _check_layouts(src, dst), any(isinstance(lay, BoxShard) for lay in (*src, *dst))


def _checked(src: tuple, dst: tuple) -> tuple[int, bool]:
    """(world size, whether a layout is a BoxShard): :func:`_check_layouts` once per
    distinct layouts."""
    try:
        return _check_layouts_cached(src, dst)
    except TypeError:
        _check_layouts(src, dst)  # an unhashable entry: the check names it
        raise


class RedistributeHandle:
    """An exchange in flight; :meth:`wait` returns this rank's slices under dst.

    The send buffer is held until the exchange completes (the backend reads it
    asynchronously). ``wait()`` may be called more than once.
    """

    def __init__(self, work: dist.Work | None, buffers: tuple[torch.Tensor, ...], finish) -> None:
        self._work = work
        self._buffers = buffers  # (send 1-D, recv 1-D): kept alive until wait()
        self._finish = finish
        self._result: list[torch.Tensor] | None = None

    def wait(self) -> list[torch.Tensor]:
        if self._result is None:
            if self._work is not None:
                self._work.wait()
            self._result = self._finish()
            self._work, self._buffers, self._finish = None, (), None
        return self._result

    def is_completed(self) -> bool:
        return self._result is not None or self._work is None or self._work.is_completed()


def _group_rank(process_group: dist.ProcessGroup | None, w: int) -> int:
    """This rank's index in ``process_group`` for layouts over ``w`` ranks (None: one rank)."""
    if process_group is None:
        if w != 1:
            raise ValueError(f"layouts over {w} ranks need a process group, got None")
        return 0
    if process_group.size() != w:
        raise ValueError(f"layouts have {w} ranks but the process group has {process_group.size()}")
    return dist.get_rank(process_group)


def redistribute(
    locals: Sequence[torch.Tensor],
    src: Sequence[RaggedShard],
    dst: Sequence[RaggedShard],
    process_group: dist.ProcessGroup | None,
    *,
    async_op: bool = False,
) -> list[torch.Tensor] | RedistributeHandle:
    """Move tensors from their ``src`` layouts to their ``dst`` layouts.

    ``locals[i]`` is this rank's 1-D slice of tensor i under ``src[i]``; the result's
    entry i is its slice under ``dst[i]``. All tensors move in one
    ``all_to_all_single`` on ``process_group`` (none when nothing crosses ranks or the
    process group has one rank; it may be None only then). All locals share one dtype and
    device. Outputs may be views of the inputs (pieces that stay on this rank), of one
    receive buffer, or of one buffer assembling the outputs of several pieces, so write
    to them only when that is intended. Every rank must pass
    the same layouts: see :func:`check_same_on_all_ranks`. With ``async_op=True`` the
    exchange is launched and a :class:`RedistributeHandle` is returned.
    """
    locals, src, dst = list(locals), tuple(src), tuple(dst)
    w, boxes = _checked(src, dst)
    if len(locals) != len(src):
        raise ValueError(f"got {len(locals)} local tensors for {len(src)} layouts")
    if not locals:
        return RedistributeHandle(None, (), list) if async_op else []
    rank = _group_rank(process_group, w)
    _check_locals(locals, src, rank)

    if w == 1 or src == dst:
        out = [t[:] for t in locals]
        return RedistributeHandle(None, (), lambda: out) if async_op else out
    if boxes:
        return _run_boxes(locals, src, dst, box_plan(src, dst, rank, w), process_group, rank, async_op)

    return _launch_ragged(locals, _ragged_plan(src, dst, rank), process_group, async_op)


def _launch_ragged(locals: list[torch.Tensor], plan: _RaggedPlan, process_group: dist.ProcessGroup,
                   async_op: bool) -> list[torch.Tensor] | RedistributeHandle:
    """The exchange between RaggedShards of ``plan``, of checked ``locals``."""
    ref = locals[0]
    send_buf = torch.cat([locals[i][lo:hi] for i, lo, hi in plan.send]) if plan.send else ref.new_empty(0)
    recv_buf = ref.new_empty(plan.recv_numel)
    work = dist.all_to_all_single(
        recv_buf, send_buf, list(plan.recv_counts), list(plan.send_counts), group=process_group, async_op=async_op
    )

    def finish() -> list[torch.Tensor]:
        result = [(recv_buf[ps[0][1]:ps[0][2]] if ps[0][0] < 0 else locals[ps[0][0]][ps[0][1]:ps[0][2]])
                  if len(ps) == 1 else None for ps in plan.assemble]
        if plan.joined:  # ``_JOIN_ALIGN``
            flat = ref.new_empty(plan.joined_numel)
            foreach_copy_([flat[lo:hi] if ps[3] == 1 else flat[lo:hi].view(ps[3], ps[2] - ps[1])
                           for (lo, hi), ps in zip(plan.joined_dst, plan.joined_pieces, strict=True)],
                          [_piece(recv_buf if ps[0] < 0 else locals[ps[0]], *ps[1:]) for ps in plan.joined_pieces])
            for k, a, n in plan.joined:
                result[k] = flat[a:a + n]
        return [ref.new_empty(0) if r is None else r for r in result]

    if async_op:
        return RedistributeHandle(work, (send_buf, recv_buf), finish)
    return finish()


def _run_boxes(locals: list[torch.Tensor], src: Sequence[RaggedShard | BoxShard],
               dst: Sequence[RaggedShard | BoxShard], plan: BoxPlan, process_group: dist.ProcessGroup,
               rank: int, async_op: bool) -> list[torch.Tensor] | RedistributeHandle:
    """The exchange between layouts of which some are BoxShards (see comm/_box_exchange.py)."""
    work, buffers, finish = launch_boxes(locals, src, dst, plan, process_group, rank, async_op)
    if async_op:
        return RedistributeHandle(work, buffers, finish)
    return finish()


class Route:
    """:func:`redistribute` between fixed layouts, checked and planned once.

    The step loop exchanges the same layouts every step ([Note: step plan]); a route
    runs the layout checks and derives its plan when built, and :meth:`launch` then
    checks only what the caller passes: each tensor's length and the batch's dtype and
    device (the checks :func:`redistribute` makes of its locals, with its errors).
    """

    __slots__ = ("dst", "numels", "plan", "process_group", "rank", "src")

    def __init__(self, src: Sequence[RaggedShard | BoxShard], dst: Sequence[RaggedShard | BoxShard],
                 process_group: dist.ProcessGroup | None) -> None:
        src, dst = tuple(src), tuple(dst)
        w, boxes = _checked(src, dst)
        rank = _group_rank(process_group, w)
        self.src, self.dst, self.process_group, self.rank = src, dst, process_group, rank
        self.numels = tuple(s.local_numel(rank) for s in src)
        # None: no collective (one rank, or equal layouts); a BoxPlan where a layout is a box
        self.plan = (None if w == 1 or src == dst else box_plan(src, dst, rank, w) if boxes
                     else _ragged_plan(src, dst, rank))

    def launch(self, locals: list[torch.Tensor], *, async_op: bool = False) -> list[torch.Tensor] | RedistributeHandle:
        """:func:`redistribute` of ``locals`` (this rank's slices under ``src``) to ``dst``."""
        numels = self.numels
        if len(locals) != len(numels):
            raise ValueError(f"got {len(locals)} local tensors for {len(numels)} layouts")
        if not locals:
            return RedistributeHandle(None, (), list) if async_op else []
        ref = locals[0]
        dtype, device = ref.dtype, ref.device
        for t, n in zip(locals, numels, strict=True):
            if not isinstance(t, torch.Tensor) or t.numel() != n or t.dim() != 1 or t.dtype is not dtype \
                    or t.device != device:
                _check_locals(locals, self.src, self.rank)  # raises, naming what is wrong
        if isinstance(self.plan, BoxPlan):
            return _run_boxes(locals, self.src, self.dst, self.plan, self.process_group, self.rank, async_op)
        if self.plan is not None:
            return _launch_ragged(locals, self.plan, self.process_group, async_op)
        # no collective: redistribute's own path
        return redistribute(locals, self.src, self.dst, self.process_group, async_op=async_op)


def _check_locals(locals: list[torch.Tensor], src: Sequence[RaggedShard], rank: int) -> None:
    dtype = device = None
    for i, (t, s) in enumerate(zip(locals, src, strict=True)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"locals[{i}] must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 1:
            raise ValueError(f"locals[{i}] must be 1-D, got shape {tuple(t.shape)}")
        n = s.local_numel(rank)
        if t.numel() != n:
            raise ValueError(
                f"locals[{i}] has {t.numel()} elements; src[{i}] gives rank {rank} {n}: {s}"
            )
        if dtype is None:
            dtype, device = t.dtype, t.device
        elif t.dtype != dtype or t.device != device:
            dtypes = sorted({str(t.dtype) for t in locals})
            devices = sorted({str(t.device) for t in locals})
            raise ValueError(
                f"all locals must share one dtype and device (batch them per dtype), got "
                f"dtypes {dtypes} on devices {devices}"
            )


def check_same_on_all_ranks(obj_fingerprint: str, process_group: dist.ProcessGroup | None) -> None:
    """Raise ValueError on every rank unless all ranks of ``process_group`` pass the same string.

    Run once before the first collective on layouts or plans (e.g. with
    ``BufferPlan.fingerprint()``): a mismatch then raises here instead of hanging or
    exchanging wrong data later. A no-op when ``process_group`` is None (one rank).
    """
    if not isinstance(obj_fingerprint, str):
        raise TypeError(f"obj_fingerprint must be a str, got {type(obj_fingerprint).__name__}")
    if process_group is None or same_on_all_ranks(obj_fingerprint, process_group):
        # ``same_on_all_ranks`` in comm/_collectives.py; the keys are gathered only to name who
        # differs
        return
    gathered: list[object] = [None] * process_group.size()
    dist.all_gather_object(gathered, obj_fingerprint, group=process_group)
    if any(g != gathered[0] for g in gathered):
        by_value: dict[str, list[int]] = {}
        for r, g in enumerate(gathered):
            by_value.setdefault(str(g), []).append(r)
        detail = "; ".join(f"ranks {rs}: {v[:80]!r}" for v, rs in by_value.items())
        raise ValueError(f"ranks disagree on the fingerprint ({process_group.size()} ranks): {detail}")
