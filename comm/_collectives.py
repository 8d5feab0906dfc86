"""Stateless flat collectives for one store's buffer, and the plan consistency check.

Every function takes its process group explicitly (never the implicit global group),
so a mesh axis of a 2-D DeviceMesh works the same as a plain process group.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

from vefsdp_optim._torch_compat import FakeTensor, all_gather_single, reduce_scatter_single
from vefsdp_optim.sharding import BufferPlan

__all__ = [
    "FlatWork",
    "PointToPointWork",
    "all_gather_flat",
    "all_reduce_avg",
    "check_plan_consistent",
    "first_difference",
    "reduce_scatter_flat",
    "same_on_all_ranks",
    "supports_native_avg",
]

_REDUCE_OPS = ("sum", "avg")
# Backends whose reduce-scatter takes ReduceOp.AVG (NCCL >= 2.10). Elsewhere (gloo):
# SUM, then one in-place division of the m-element result; see ``supports_native_avg``.
_NATIVE_AVG_BACKENDS = frozenset({"nccl"})


class FlatWork(NamedTuple):
    """An in-flight flat collective: ``wait()`` completes it and applies the in-place
    epilogue (the division of an averaged reduce-scatter on backends without AVG)."""

    work: dist.Work | PointToPointWork
    divide_by: int  # 1: nothing after the collective; W: output.div_(W) after wait
    output: torch.Tensor  # 1-D, the collective's output

    def wait(self) -> bool:
        self.work.wait()
        if self.divide_by != 1:
            self.output.div_(self.divide_by)
        return True


# [Note: gloo flat collectives]
# gloo's own reduce-scatter and all-gather are several times slower than sending the
# same bytes point to point, and its reduce-scatter first copies its whole input. So on
# gloo the flat collectives are point-to-point sends between every pair of ranks. They
# are launched together with ``batch_isend_irecv``, straight from and into the caller's
# buffers.
#   - An all-gather sends this rank's shard to every peer. It receives each peer's shard
#     into its place in the output, with no copy.
#   - At W = 2 a reduce-scatter sends the peer's chunk of its input to the peer. It
#     receives its own chunk from the peer into the output and adds its own chunk on
#     ``wait()``, with no buffer. Two terms sum alike in either order, so the bits are
#     those of ``c_0 + c_1``.
#   - At W >= 3 the reduce-scatter stays on gloo's collective. Received chunks would
#     need (W - 2) m elements of buffers of our own, and fully_shard's peak live bytes
#     are held at FSDP2's.
# Tags keep these sends apart from other traffic. Every rank launches the same flat
# collectives in the same order, because the plans are checked equal first, so sends and
# receives pair up. A point-to-point message pays a rendezvous that a collective between
# two ranks does not. So at W = 2 shards under P2P_MIN_SHARD_BYTES_W2 keep gloo's own
# collective. NCCL keeps its native collectives. The measurements are in
# docs/decisions.md.
_P2P_BACKENDS = frozenset({"gloo"})
_TAG_ALL_GATHER, _TAG_REDUCE_SCATTER = 0x7A6, 0x7A7
#: at W = 2, shards below this many bytes keep gloo's own collective (measured crossover)
P2P_MIN_SHARD_BYTES_W2 = 256 << 10


class PointToPointWork:
    """The point-to-point sends of one flat collective ([Note: gloo flat collectives]);
    ``wait()`` completes them and runs the epilogue (a reduce-scatter's sum)."""

    def __init__(self, works: list[dist.Work], epilogue: Callable[[], None] | None,
                 buffers: tuple[torch.Tensor, ...]) -> None:
        self._works = works
        self._epilogue = epilogue
        self._buffers = buffers  # read or written by the backend until wait()

    @torch.compiler.disable  # point-to-point works are opaque to dynamo: the hooks run eagerly
    def wait(self) -> bool:
        for w in self._works:
            w.wait()
        self._works = []
        if self._epilogue is not None:
            epilogue, self._epilogue = self._epilogue, None
            epilogue()
        self._buffers = ()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)


def _point_to_point(group: dist.ProcessGroup, shard: torch.Tensor) -> bool:
    """gloo with CPU tensors (gloo's point-to-point sends take CPU tensors only), except
    small shards at W = 2 ([Note: gloo flat collectives])."""
    w = group.size()
    return (shard.device.type == "cpu" and w > 1 and dist.get_backend(group) in _P2P_BACKENDS
            and (w > 2 or shard.numel() * shard.element_size() >= P2P_MIN_SHARD_BYTES_W2))


def _launch_p2p(sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor],
                group: dist.ProcessGroup, tag: int) -> list[dist.Work]:
    ops = []
    for peer in sorted(sends):
        ops.append(dist.P2POp(dist.isend, sends[peer], group=group, tag=tag, group_peer=peer))
        ops.append(dist.P2POp(dist.irecv, recvs[peer], group=group, tag=tag, group_peer=peer))
    return dist.batch_isend_irecv(ops)


@torch.compiler.disable
def _all_gather_p2p(output: torch.Tensor, input: torch.Tensor,
                    group: dist.ProcessGroup) -> PointToPointWork:
    w, rank, m = group.size(), dist.get_rank(group), input.numel()
    mine = output[rank * m:(rank + 1) * m]
    if mine.data_ptr() != input.data_ptr():
        # all_gather semantics; a view of its own place (the buffers') copies nothing
        mine.copy_(input)
    peers = [p for p in range(w) if p != rank]
    works = _launch_p2p({p: input for p in peers}, {p: output[p * m:(p + 1) * m] for p in peers},
                        group, _TAG_ALL_GATHER)
    return PointToPointWork(works, None, (output, input))


@torch.compiler.disable
def _reduce_scatter_p2p(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup,
                        divide_by: int) -> PointToPointWork:
    """W = 2, ``output`` apart from ``input``: the peer's chunk of this rank is received
    into the output, and this rank's own chunk added on ``wait()`` (two terms: their sum
    is the same in either order)."""
    rank, m = dist.get_rank(group), output.numel()
    peer = 1 - rank
    works = _launch_p2p({peer: input[peer * m:(peer + 1) * m]}, {peer: output}, group,
                        _TAG_REDUCE_SCATTER)

    def epilogue() -> None:
        output.add_(input[rank * m:(rank + 1) * m])
        if divide_by != 1:
            output.div_(divide_by)

    return PointToPointWork(works, epilogue, (output, input))


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def supports_native_avg(group: dist.ProcessGroup) -> bool:
    """Whether reduce-scatter on ``group`` takes ``ReduceOp.AVG`` directly.

    gloo in torch 2.13 accepts ReduceOp.AVG for reduce_scatter_single, but its rounding is
    the backend's business. Elsewhere than NCCL an average is therefore SUM, then one
    in-place division: exactly the reference's sum / W, one pass over m elements and no
    allocation."""
    return dist.get_backend(group) in _NATIVE_AVG_BACKENDS


def all_reduce_avg(t: torch.Tensor, group: dist.ProcessGroup) -> None:
    """In-place average of ``t`` over ``group`` (AVG where the backend has it, else SUM
    and one division, as ``supports_native_avg``)."""
    if supports_native_avg(group):
        dist.all_reduce(t, op=dist.ReduceOp.AVG, group=group)
    else:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        t.div_(group.size())


def _check_flat(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous 1-D tensor, got shape {tuple(t.shape)}")
    return t


def _check_sizes(big: torch.Tensor, small: torch.Tensor, world_size: int, what: str) -> None:
    if big.numel() != world_size * small.numel():
        raise ValueError(
            f"{what}: the flat buffer has {big.numel()} elements, expected W * m = "
            f"{world_size} * {small.numel()} = {world_size * small.numel()}")
    if big.dtype != small.dtype:
        raise ValueError(f"{what}: dtypes differ ({big.dtype} vs {small.dtype}); one "
                         "buffer per dtype")


def all_gather_flat(
    output: torch.Tensor,  # 1-D, W * m elements
    input: torch.Tensor,  # 1-D, m elements (may be output[rank*m:(rank+1)*m])
    group: dist.ProcessGroup,
    *,
    async_op: bool = False,
) -> FlatWork | None:
    """One ``all_gather_single(output, input, group)``; nothing is copied around it (on
    gloo: point-to-point sends, [Note: gloo flat collectives])."""
    _check_flat("output", output)
    _check_flat("input", input)
    _check_sizes(output, input, group.size(), "all_gather_flat")
    if _point_to_point(group, input):
        p2p = _all_gather_p2p(output, input, group)
        if async_op:
            return FlatWork(p2p, 1, output)
        p2p.wait()
        return None
    work = all_gather_single(output, input, group, async_op=async_op)
    return FlatWork(work, 1, output) if async_op else None


def reduce_scatter_flat(
    output: torch.Tensor,  # 1-D, m elements
    input: torch.Tensor,  # 1-D, W * m elements
    group: dist.ProcessGroup,
    *,
    op: str = "avg",
    async_op: bool = False,
) -> FlatWork | None:
    """One ``reduce_scatter_single(output, input, group)`` with op ``"sum"`` or ``"avg"``
    (on gloo: point-to-point sends and a sum in rank order, [Note: gloo flat collectives]).

    On backends without ``ReduceOp.AVG`` an average is a SUM followed by one in-place
    ``output.div_(W)`` (on ``wait()`` when ``async_op``), which rounds exactly as
    ``sum / W`` does (see ``supports_native_avg``).
    """
    if op not in _REDUCE_OPS:
        raise ValueError(f"reduce op must be one of {_REDUCE_OPS}, got {op!r}")
    _check_flat("output", output)
    _check_flat("input", input)
    w = group.size()
    _check_sizes(input, output, w, "reduce_scatter_flat")
    divide_by = 1
    if op == "sum":
        rop = dist.ReduceOp.SUM
    elif supports_native_avg(group):
        rop = dist.ReduceOp.AVG
    else:
        if not output.is_floating_point() and not output.is_complex():
            raise NotImplementedError(
                f"op='avg' is supported for floating and complex dtypes, got {output.dtype}; "
                "use op='sum'")
        rop, divide_by = dist.ReduceOp.SUM, w
    if (w == 2 and rop == dist.ReduceOp.SUM and _point_to_point(group, output)
            and not _overlap(output, input)):
        p2p = _reduce_scatter_p2p(output, input, group, divide_by)
        if async_op:
            return FlatWork(p2p, 1, output)
        p2p.wait()
        return None
    work = reduce_scatter_single(output, input, rop, group, async_op=async_op)
    if async_op:
        return FlatWork(work, divide_by, output)
    if divide_by != 1:
        output.div_(divide_by)
    return None


def group_device(group: dist.ProcessGroup) -> torch.device:
    """The device a check's tensor lives on for ``group``: the host for gloo (and the fake
    process group), else the current accelerator (NCCL's current CUDA device)."""
    backend = str(dist.get_backend(group))
    if "gloo" in backend or backend == "fake" or not torch.accelerator.is_available():
        return torch.device("cpu")
    acc = torch.accelerator.current_accelerator()
    return torch.device(acc.type, torch.accelerator.current_device_index())


def same_on_all_ranks(key: str | int, group: dist.ProcessGroup,
                      device: torch.device | None = None) -> bool:
    """Whether every rank of ``group`` passes the same ``key``, the same answer on every rank.

    One ``all_reduce(MAX)`` of two int64 per rank, the
    62-bit hash ``h`` of the key and ``-h``: the ranks agree iff max(h) == -max(-h) (the
    minimum). What a rank sends and holds is the same at any W, where gathering every
    rank's key (``all_gather_object``) costs each rank W keys, W tensors and W
    deserializations: at W = 10,000, per shard group at setup. A caller that finds a
    disagreement gathers the keys then, to say which ranks differ (the error path only).
    ``device``: the tensor's (default :func:`group_device`). True without a collective at
    one rank, and where no rank's values can be seen: the fake process group (one
    process playing one rank of a W-rank job) and fake tensors (FakeTensorMode).
    """
    if not isinstance(key, (str, int)) or isinstance(key, bool):
        raise TypeError(f"key must be a str or an int, got {type(key).__name__}")
    if group.size() == 1 or dist.get_backend(group) == "fake":
        return True
    raw = key.encode() if isinstance(key, str) else key.to_bytes(16, "little", signed=True)
    h = int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") >> 2  # [0, 2**62)
    both = torch.tensor([h, -h], dtype=torch.int64, device=device or group_device(group))
    if isinstance(both, FakeTensor):
        return True
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    most, least = both.tolist()  # a check at setup or a layout change: one host read
    return most == -least


_MASK62 = (1 << 62) - 1


def first_difference(keys: list[int], flags: list[bool], group: dist.ProcessGroup,
                     device: torch.device | None = None) -> tuple[int, list[int], list[int]]:
    """Where the ranks of ``group``, which disagree (:func:`same_on_all_ranks` said so),
    first differ in ``keys`` (one int per position, the same meaning on every rank), the
    same on every rank: ``(position, ranks whose key there differs from rank 0's, ranks
    whose flag there is set)``; position -1 where the lists agree up to the shortest's
    length and differ in length (the ranks then: those whose length differs from rank 0's).
    What each rank sends is O(len(keys) + W) int64 in four collectives (the
    lengths, the keys' maximum and minimum, rank 0's key at the position, one slot per
    rank), never every rank's keys: an error path that stays in memory at W = 10,000."""
    w, me = group.size(), dist.get_rank(group)
    dev = device or group_device(group)
    lengths = torch.tensor([len(keys), -len(keys)], dtype=torch.int64, device=dev)
    dist.all_reduce(lengths, op=dist.ReduceOp.MAX, group=group)
    longest, shortest = lengths.tolist()  # the error path: host reads are fine here
    shortest = -shortest
    mine = [k & _MASK62 for k in keys[:shortest]]
    both = torch.tensor(mine + [-k for k in mine], dtype=torch.int64, device=dev)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    most = both.tolist()
    at = next((i for i in range(shortest) if most[i] != -most[shortest + i]), shortest)
    counts = at == shortest  # the lists agree but for their lengths (longest != shortest)
    key = len(keys) if counts else keys[at] & _MASK62
    first = torch.tensor([key], dtype=torch.int64, device=dev)
    dist.broadcast(first, src=dist.get_global_rank(group, 0), group=group)
    slots = torch.zeros(w, dtype=torch.int64, device=dev)
    slots[me] = (key != int(first.tolist()[0])) + 2 * bool(not counts and flags[at])
    dist.all_reduce(slots, group=group)
    per_rank = slots.tolist()
    return -1 if counts else at, [r for r in range(w)
                                  if per_rank[r] & 1], [r for r in range(w) if per_rank[r] & 2]


def check_plan_consistent(plan: BufferPlan, process_group: dist.ProcessGroup | None) -> None:
    """Raise ValueError on every rank if the ranks of ``process_group`` hold different plans.

    Compares each rank's ``(plan fingerprint, plan.world_size)`` with
    :func:`same_on_all_ranks` (see ``same_on_all_ranks``), and only where they
    differ gathers them (``all_gather_object``) to name the ranks, so that a mismatch
    raises everywhere instead of hanging the first collective on a wrongly sized buffer.
    ``process_group=None`` or a single-rank process group: only the plan's world size is checked.
    """
    if not isinstance(plan, BufferPlan):
        raise TypeError(f"plan must be a BufferPlan, got {type(plan).__name__}")
    w = 1 if process_group is None else process_group.size()
    if w == 1:
        if plan.world_size != 1:
            raise ValueError(f"plan is for {plan.world_size} ranks but the process "
                             "group has 1 rank")
        return
    mine = (plan.fingerprint()[:16], plan.world_size)
    if same_on_all_ranks(f"{mine[0]} {mine[1]}", process_group):
        if plan.world_size != w:
            raise ValueError(f"plan is for {plan.world_size} ranks but the process group "
                             f"has {w} ranks")
        return
    gathered: list[tuple[str, int] | None] = [None] * w
    dist.all_gather_object(gathered, mine, group=process_group)
    if any(g is None for g in gathered):  # pragma: no cover - all_gather_object fills all
        raise AssertionError(f"all_gather_object left holes: {gathered}")
    by_fp = Counter(gathered)
    if len(by_fp) > 1:
        # the most common plan is the reference; ties go to the lowest rank's plan
        ref = max(by_fp, key=lambda g: (by_fp[g], -gathered.index(g)))
        bad = [r for r, g in enumerate(gathered) if g != ref]
        detail = ", ".join(f"rank {r}: {gathered[r][0]} (W={gathered[r][1]})" for r in bad)
        raise ValueError(
            f"BufferPlan differs across the {w} ranks of the process_group: ranks {bad} hold "
            f"a plan other than the one of ranks {[r for r in range(w) if r not in bad]} "
            f"({ref[0]}, W={ref[1]}); {detail}")
    if plan.world_size != w:
        raise ValueError(f"plan is for {plan.world_size} ranks but the process group has {w} ranks")
