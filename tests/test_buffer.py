"""DistributedBuffer and the flat collectives, on gloo at W = 1..4, against full tensors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from torch.utils._python_dispatch import TorchDispatchMode

from vefsdp_optim.comm import (
    DistributedBuffer,
    all_gather_flat,
    check_plan_consistent,
    reduce_scatter_flat,
)
from vefsdp_optim.sharding import TensorSpec, plan_buffer

# uneven shapes, several units: row bands, whole matrices, flat blocks, elementwise
SPECS = (
    TensorSpec("w1", (37, 13), unit=2 * 13),
    TensorSpec("b1", (37,)),
    TensorSpec("w2", (11, 7), unit=77),
    TensorSpec("q", (50,), unit=16),
    TensorSpec("s", (1,)),
    TensorSpec("e", (5, 3, 2), unit=6),
    TensorSpec("wide", (3, 41), unit=41),
)


def _reference(seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Integer-valued tensors, identical on every rank: sums of a few are exact."""
    gen = torch.Generator().manual_seed(seed)
    return {s.name: torch.randint(-50, 50, s.shape, generator=gen).to(dtype) for s in SPECS}


class _OpLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _within(view: torch.Tensor, flat: torch.Tensor) -> bool:
    lo, hi = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
    return view.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() and (
        view.numel() == 0 or lo <= view.data_ptr() and view.data_ptr() + view.numel() * view.element_size() <= hi)


def _covered(plan) -> torch.Tensor:
    mask = torch.zeros(plan.global_size, dtype=torch.bool)
    for s in plan.specs:
        off = plan.offsets[s.name]
        mask[off:off + s.numel] = True
    return mask


def _fill_local(buf: DistributedBuffer, tensors: dict[str, torch.Tensor]) -> None:
    for name, t in tensors.items():
        start, n = buf.local_extent(name)
        buf.local_view(name).copy_(t.flatten()[start:start + n])


def _check_gather(buf: DistributedBuffer, ref: dict[str, torch.Tensor], async_op: bool = False) -> None:
    work = buf.all_gather(async_op=async_op)
    if work is not None:
        work.wait()
    for name, t in ref.items():
        got = buf.full_view(name)
        if got.shape != t.shape or not torch.equal(got, t):
            raise AssertionError(f"W={buf.world_size} rank {buf.rank}: {name} differs after all_gather")


def _buffer_checks(align: int) -> dict[str, object]:
    """Everything that needs W ranks, in one job per world size."""
    group = dist.group.WORLD
    w, rank = dist.get_world_size(group), dist.get_rank(group)
    plan = plan_buffer(SPECS, w, align=align)
    buf = DistributedBuffer(plan, group, dtype=torch.float32)
    m = plan.shard_size
    assert (buf.rank, buf.world_size, buf.local.shape) == (rank, w, (m,))
    ref = _reference(1234)

    # local views: extents from the plan, aliasing `local`, writes visible in `local`
    for s in SPECS:
        start, n = buf.local_extent(s.name)
        assert (start, n) == plan.layout(s.name).local(rank)
        v = buf.local_view(s.name)
        assert v.shape == (n,) and _within(v, buf.local)
    _fill_local(buf, ref)
    expected_local = torch.zeros(m)
    for name, start_t, start_s, n in plan.local_slices(rank):
        expected_local[start_s:start_s + n] = ref[name].flatten()[start_t:start_t + n]
    assert torch.equal(buf.local, expected_local)

    # all-gather: every full tensor equals its reference, padding stays zero
    buf.alloc_global()
    _check_gather(buf, ref)
    g = buf.global_buffer
    assert g.shape == (w * m,) and torch.equal(g[~_covered(plan)], torch.zeros(plan.padding))
    views = {s.name: buf.full_view(s.name) for s in SPECS}
    for s in SPECS:
        assert buf.full_view(s.name) is views[s.name] and _within(views[s.name], g)
    if w == 1:  # the global buffer is the local shard
        assert g.data_ptr() == buf.local.data_ptr()
    if rank == 0:  # writing through a full view shows in the global buffer
        views["w2"][3, 4] = 999.0
        assert g[plan.offsets["w2"] + 3 * 7 + 4] == 999.0

    # free / alloc round trip: the same view objects see the next gather
    buf.free_global()
    assert buf.global_allocated == (w == 1)
    if w > 1:
        assert views["w1"].untyped_storage().nbytes() == 0
    ref2 = {k: v + 1 for k, v in ref.items()}
    _fill_local(buf, ref2)
    buf.alloc_global()
    buf.alloc_global()  # no-op when allocated
    _check_gather(buf, ref2, async_op=True)
    for s in SPECS:
        assert torch.equal(views[s.name], ref2[s.name]) and buf.full_view(s.name) is views[s.name]

    # no copies around the collectives: the op log equals the flat collective's on bare
    # tensors (on gloo point-to-point sends, [Note: gloo flat collectives]: the one copy is
    # this rank's shard into its place in the output, which gloo's own all-gather makes too)
    bare_ag, bare_rs = _OpLog(), _OpLog()
    if w > 1:
        out, inp = torch.empty(w * m), torch.empty(m)
        with bare_ag:
            all_gather_flat(out, inp, group)
        with bare_rs:
            reduce_scatter_flat(inp, out, group, op="sum")
    with _OpLog() as log:
        buf.all_gather()
    assert log.ops == bare_ag.ops, (log.ops, bare_ag.ops)
    assert log.ops.count("aten.copy_.default") <= 1, log.ops
    assert not any("cat" in op or "split" in op for op in log.ops), log.ops

    # gradients: each rank contributes a distinct gradient; the reference sums them all
    grads = [_reference(100 + r) for r in range(w)]
    ref_sum = {s.name: sum(gr[s.name] for gr in grads) for s in SPECS}
    buf.alloc_grad_global()
    gg = buf.grad_global
    assert gg.shape == (w * m,) and not gg.any()
    gviews = {s.name: buf.grad_full_view(s.name) for s in SPECS}

    def fill_grads() -> None:
        for name, t in grads[rank].items():
            gviews[name].copy_(t)

    def check(op: str, scale: float) -> None:
        for s in SPECS:
            start, n = buf.local_extent(s.name)
            got = buf.local_grad_view(s.name)
            want = ref_sum[s.name].flatten()[start:start + n] / scale
            assert _within(got, buf.local_grad)
            if not torch.equal(got, want):
                raise AssertionError(f"W={w} rank {rank} op={op}: grad of {s.name} differs")
        pad = torch.ones(m, dtype=torch.bool)
        for _, _, start_s, n in plan.local_slices(rank):
            pad[start_s:start_s + n] = False
        assert not buf.local_grad[pad].any()

    logs = {}
    for op, scale, async_op in (("sum", 1, False), ("avg", w, False), ("avg", w, True), ("sum", 1, True)):
        fill_grads()
        with _OpLog() as log:
            work = buf.reduce_scatter(op, async_op=async_op)
            if work is not None:
                work.wait()
        logs[(op, async_op)] = log.ops
        check(op, scale)
    div = ["aten.div_.Tensor"] if w > 1 else []  # the python int W, wrapped as a scalar
    assert logs[("sum", False)] == bare_rs.ops, (logs, bare_rs.ops)
    assert logs[("avg", False)] == bare_rs.ops + div, (logs, bare_rs.ops)
    assert logs[("avg", True)] == bare_rs.ops + div, (logs, bare_rs.ops)

    # gradient buffer free / alloc: same views, zero-filled again (padding zero)
    buf.free_grad_global()
    buf.alloc_grad_global()
    if w > 1:
        assert not buf.grad_global.any()
    fill_grads()
    buf.reduce_scatter("sum")
    check("sum", 1)
    for s in SPECS:
        assert buf.grad_full_view(s.name) is gviews[s.name]

    # another dtype: int64, sum only
    ibuf = DistributedBuffer(plan, group, dtype=torch.int64, validate=False)
    iref = _reference(7, torch.int64)
    _fill_local(ibuf, iref)
    _check_gather(ibuf, iref)
    return {"ag_ops": bare_ag.ops, "rs_ops": bare_rs.ops, "m": m, "padding": plan.padding}


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_buffer_gather_scatter_views(world_size: int) -> None:
    results = run_distributed(_buffer_checks, world_size, 1)
    assert len(results) == world_size
    if world_size > 1:  # gloo: the all-gather sends to and receives from each peer at W > 2; below
        # (small shards at W = 2) and for the reduce-scatter, gloo's own collective
        ops = results[0]["ag_ops"]
        if world_size > 2:
            assert ops.count("c10d.send.default") == ops.count("c10d.recv_.default") == world_size - 1, ops
        else:
            assert ops == ["c10d._allgather_base_.default"], ops
        assert results[0]["rs_ops"][0] == "c10d._reduce_scatter_base_.default"


def test_buffer_align_w3() -> None:
    results = run_distributed(_buffer_checks, 3, 8)
    assert all(r["m"] % 8 == 0 for r in results)


def _mismatch_checks(bad_rank: int) -> list[str]:
    group = dist.group.WORLD
    w, rank = group.size(), group.rank()
    specs = list(SPECS)
    if rank == bad_rank:
        specs[1] = TensorSpec("b1", (36,))
    msgs = []
    try:
        DistributedBuffer(plan_buffer(specs, w), group, dtype=torch.float32)
    except ValueError as e:
        msgs.append(str(e))
    try:  # a plan for the wrong world size, on every rank
        check_plan_consistent(plan_buffer(SPECS, w + 1), group)
    except ValueError as e:
        msgs.append(str(e))
    t = torch.ones(1)
    dist.all_reduce(t, group=group)  # nobody is stuck in a collective
    msgs.append(str(int(t.item())))
    return msgs


@pytest.mark.parametrize(("world_size", "bad_rank"), [(2, 1), (3, 2), (3, 0)])
def test_mismatched_plans_raise(world_size: int, bad_rank: int) -> None:
    results = run_distributed(_mismatch_checks, world_size, bad_rank)
    for msgs in results:
        assert len(msgs) == 3, msgs
        assert f"ranks [{bad_rank}] hold a plan other" in msgs[0]
        assert f"plan is for {world_size + 1} ranks but the process group has {world_size}" in msgs[1]
        assert msgs[2] == str(world_size)


# -- single process ----------------------------------------------------------------------


def test_single_process_group_none_aliases_local() -> None:
    plan = plan_buffer(SPECS, 1)
    buf = DistributedBuffer(plan, None, dtype=torch.float64)
    ref = _reference(3, torch.float64)
    _fill_local(buf, ref)
    with _OpLog() as log:
        assert buf.all_gather(async_op=True) is None
        assert buf.reduce_scatter("avg") is None
    assert log.ops == []
    assert buf.global_buffer is buf.local and buf.grad_global is buf.local_grad
    for name, t in ref.items():
        assert torch.equal(buf.full_view(name), t) and _within(buf.full_view(name), buf.local)
    buf.free_global()  # no-op: the local shard is the global buffer
    assert torch.equal(buf.full_view("w1"), ref["w1"])


def test_detached_buffer_local_only() -> None:
    plan = plan_buffer(SPECS, 3)
    buf = DistributedBuffer(plan, None, dtype=torch.float32, rank=2)
    assert buf.world_size == 3 and buf.local.shape == (plan.shard_size,)
    for s in SPECS:
        assert buf.local_extent(s.name) == plan.layout(s.name).local(2)
        assert buf.local_view(s.name).numel() == plan.layout(s.name).local(2)[1]
    with pytest.raises(RuntimeError, match="detached"):
        buf.all_gather()
    with pytest.raises(RuntimeError, match="detached"):
        buf.full_view("w1")


def test_bad_arguments() -> None:
    plan1, plan3 = plan_buffer(SPECS, 1), plan_buffer(SPECS, 3)
    with pytest.raises(ValueError, match="plan for 1 rank"):
        DistributedBuffer(plan3, None, dtype=torch.float32)
    with pytest.raises(TypeError, match="BufferPlan"):
        DistributedBuffer(SPECS, None, dtype=torch.float32)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dtype"):
        DistributedBuffer(plan1, None, dtype="float32")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"rank must be in \[0, 3\)"):
        DistributedBuffer(plan3, None, dtype=torch.float32, rank=3)
    buf = DistributedBuffer(plan1, None, dtype=torch.float32)
    with pytest.raises(ValueError, match="'sum' or 'avg'"):
        buf.reduce_scatter("max")
    with pytest.raises(KeyError, match="nope"):
        buf.local_view("nope")
    with pytest.raises(ValueError, match="plan is for 3 ranks"):
        check_plan_consistent(plan3, None)
    with pytest.raises(ValueError, match="one of"):
        reduce_scatter_flat(torch.empty(2), torch.empty(4), None, op="mean")  # type: ignore[arg-type]
