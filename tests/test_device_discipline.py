"""Device discipline of the library's collectives.

* A static scan: every tensor the library creates in a function that calls a tensor
  collective names its device, since a CPU tensor has no backend on a CUDA-only process
  group (NCCL: "No backend type associated with device type cpu").
* A count of the collectives of a steady-state optimizer step ([Note: consistent
  steps] in _step_loop.py): none for AdamW and AdamW8bit on our fully_shard, one
  exchange out and one back per exchange bucket for Muon on FSDP2.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import pathlib

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from torch import nn

import vefsdp_optim

ROOT = pathlib.Path(__file__).resolve().parents[1]

# -- the static scan -------------------------------------------------------------------

#: torch's tensor factories: without device= they make a CPU tensor (or the default device's)
FACTORIES = frozenset({
    "tensor", "as_tensor", "asarray", "empty", "zeros", "ones", "full", "arange", "range", "linspace",
    "logspace", "eye", "rand", "randn", "randint", "randperm", "empty_strided", "scalar_tensor",
    "tril_indices", "triu_indices", "from_numpy", "frombuffer", "sparse_coo_tensor",
})
#: a call whose name starts or ends with one of these is a tensor collective, whatever it is
#: called on (torch's functions, comm's flat collectives, redistribute, a DistributedBuffer)
COLLECTIVE_NAMES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "batch_isend_irecv",
                    "redistribute", "_flat")
#: names that are collectives only when called on ``dist`` / ``torch.distributed``
#: (``torch.gather`` and ``Tensor.scatter_`` are not)
DIST_ONLY = frozenset({"broadcast", "reduce", "gather", "scatter", "send", "recv", "isend", "irecv", "P2POp"})
#: (file, function, factory) exceptions, each with its reason; none today
ALLOWED: dict[tuple[str, str, str], str] = {}


def _callee(call: ast.Call) -> tuple[str | None, ast.expr | None]:
    f = call.func
    if isinstance(f, ast.Attribute):
        return f.attr, f.value
    if isinstance(f, ast.Name):
        return f.id, None
    return None, None


def _is_dist(v: ast.expr | None) -> bool:
    return (isinstance(v, ast.Name) and v.id == "dist") or (isinstance(v, ast.Attribute) and v.attr == "distributed")


def _is_tensor_collective(call: ast.Call) -> bool:
    name, on = _callee(call)
    if name is None or name.endswith(("_object", "_object_list")):  # pickled objects: no tensor of ours
        return False
    if any(name.startswith(c) or name.endswith(c) for c in COLLECTIVE_NAMES):
        return True
    return name in DIST_ONLY and _is_dist(on)


def _deviceless_factory(call: ast.Call) -> str | None:
    name, on = _callee(call)
    if name not in FACTORIES or not (isinstance(on, ast.Name) and on.id == "torch"):
        return None
    device = next((k.value for k in call.keywords if k.arg == "device"), None)
    if device is None or (isinstance(device, ast.Constant) and device.value is None):
        return name
    return None


def deviceless_factories(source: str, filename: str) -> list[tuple[str, str, str, int]]:
    """The rule: in a function (nested ones included) that calls a tensor collective, a
    torch factory without ``device=`` (or with ``device=None``), as (file, function,
    factory, line). A tensor made there may be the one sent; ``x.new_empty`` and
    ``torch.zeros_like`` take ``x``'s device and pass."""
    out = []
    for fn in ast.walk(ast.parse(source, filename)):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call)]
        if not any(_is_tensor_collective(c) for c in calls):
            continue
        for c in calls:
            name = _deviceless_factory(c)
            if name is not None:
                out.append((filename, fn.name, name, c.lineno))
    return out


def test_scan_rule_finds_a_deviceless_tensor_sent_through_a_collective():
    bad = (
        "def check(flags, process_group):\n"
        "    mine = torch.tensor(flags, dtype=torch.uint8)\n"
        "    every = mine.new_empty(process_group.size() * mine.numel())\n"
        "    all_gather_flat(every, mine, process_group)\n"
        "def check2(x, g):\n"
        "    dist.all_reduce(torch.zeros(3, device=None), group=g)\n"
        "def fine(x, g):\n"
        "    dist.all_reduce(torch.zeros(3, device=x.device), group=g)\n"
        "    dist.all_gather_object([None], 1)\n"
        "def not_a_collective(x):\n"
        "    return torch.gather(torch.ones(2), 0, torch.zeros(1, dtype=torch.long)), x.scatter_(0, x, 1)\n"
    )
    found = deviceless_factories(bad, "x.py")
    assert [(f, n) for _, f, n, _ in found] == [("check", "tensor"), ("check2", "zeros")], found


def test_tensors_made_for_collectives_name_their_device():
    found = []
    for package in ("vefsdp_optim", "comm", "sharding"):
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            found += [f for f in deviceless_factories(path.read_text(), rel) if f[:3] not in ALLOWED]
    assert not found, (
        "tensors made without device= in functions that call a collective (a CPU tensor has no "
        "backend on NCCL; make it on the parameters' or the mesh's device, or add a justified "
        f"entry to ALLOWED): {found}")


# -- the switch ------------------------------------------------------------------------


def test_debug_switch(monkeypatch):
    from vefsdp_optim import _debug

    monkeypatch.setattr(_debug, "DEBUG", False)
    monkeypatch.setattr(dist, "get_debug_level", lambda: dist.DebugLevel.OFF)
    assert not _debug.check_every_step()
    monkeypatch.setattr(dist, "get_debug_level", lambda: dist.DebugLevel.DETAIL)
    assert _debug.check_every_step()  # TORCH_DISTRIBUTED_DEBUG=DETAIL
    monkeypatch.setattr(dist, "get_debug_level", lambda: dist.DebugLevel.INFO)
    assert not _debug.check_every_step()
    monkeypatch.setattr(_debug, "DEBUG", True)  # VEFSDP_OPTIM_DEBUG=1
    assert _debug.check_every_step()


# -- counting a step's collectives -------------------------------------------------------

#: torch.distributed's communicating functions (those a torch release lacks are skipped)
DIST_FUNCTIONS = (
    "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_coalesced", "all_gather_object",
    "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_reduce", "all_reduce_coalesced",
    "all_to_all", "all_to_all_single", "broadcast", "broadcast_object_list", "reduce", "gather",
    "gather_object", "scatter", "scatter_object_list", "send", "recv", "isend", "irecv", "send_object_list",
    "recv_object_list", "batch_isend_irecv", "barrier", "monitored_barrier",
)


class CollectiveCounter:
    """Records the *logical* collectives made while active: each call of one of
    torch.distributed's functions that no other counted call made. gloo's flat
    collectives ([Note: gloo flat collectives] in comm/_collectives.py) are one
    ``batch_isend_irecv`` of several sends (one meeting: counted once, the isends it
    issues not at all), and an ``all_gather_object`` is two all-gathers inside torch
    (counted once). The functions are wrapped in ``torch.distributed`` and in
    ``distributed_c10d``, where torch's own functions (and P2POp's check of its op) find
    them. So that nothing escapes the wrappers (a ProcessGroup method called directly, a
    functional collective), a dispatch mode also sees every c10d operator and records
    any made outside a counted call."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.escaped: list[str] = []
        self._depth = 0

    def _wrap(self, name: str, fn):
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            if self._depth == 0:
                self.calls.append(name)
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
        return counted

    @contextlib.contextmanager
    def counting(self):
        from torch.distributed import distributed_c10d
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class C10dOps(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.namespace in ("c10d", "_c10d_functional", "c10d_functional") and counter._depth == 0:
                    counter.escaped.append(str(func))
                return func(*args, **(kwargs or {}))

        saved = []
        for name in DIST_FUNCTIONS:
            fn = getattr(distributed_c10d, name, None) or getattr(dist, name, None)
            if fn is None:
                continue
            wrapped = self._wrap(name, fn)
            for mod in (dist, distributed_c10d):
                if hasattr(mod, name):
                    saved.append((mod, name, getattr(mod, name)))
                    setattr(mod, name, wrapped)
        self.calls, self.escaped = [], []
        try:
            with C10dOps():
                yield self
        finally:
            for mod, name, fn in reversed(saved):
                setattr(mod, name, fn)


def _count_step(opt, counter: CollectiveCounter) -> list[str]:
    with counter.counting():
        opt.step()
    assert not counter.escaped, f"c10d operators outside torch.distributed's functions: {counter.escaped}"
    return list(counter.calls)


def _fully_shard_model(world_size: int) -> nn.Module:
    torch.manual_seed(0)
    # uneven: 37 x 29 and 11 x 37 split over 2 or 3 ranks leave ragged shards; 8-bit blocks
    # of 32 elements all fit whole within the padding rule at W = 2 and 3
    model = nn.Sequential(nn.Linear(29, 37), nn.Tanh(), nn.Linear(37, 11))
    for layer in (model[0], model[2]):
        vefsdp_optim.fully_shard(layer)
    vefsdp_optim.fully_shard(model)
    return model


def _backward(model: nn.Module, step: int) -> None:
    x = torch.randn(5, 29, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
    model(x).square().mean().backward()


def _steady_state_counts() -> dict[str, object]:
    """Every case on one set of ranks (one spawn per world size)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as fsdp2_shard
    from torch.distributed.tensor import distribute_tensor

    import vefsdp_optim._planner as bo
    from vefsdp_optim import _debug

    w = dist.get_world_size()
    counter = CollectiveCounter()
    out: dict[str, object] = {}
    debug = _debug.DEBUG
    _debug.DEBUG = False
    try:
        # our fully_shard: AdamW (fused stores) and AdamW8bit (blocks whole after the re-plan)
        for name, make in (("adamw", lambda ps: vefsdp_optim.AdamW(ps, lr=1e-2)),
                           ("adamw8bit", lambda ps: vefsdp_optim.AdamW8bit(ps, lr=1e-2, min_8bit_size=0,
                                                                           block_size=32))):
            model = _fully_shard_model(w)
            opt = make(list(model.parameters()))
            counts = []
            for step in range(3):  # a warm-up step, then two steady-state ones
                _backward(model, step)
                counts.append(_count_step(opt, counter))
                opt.zero_grad()
            out[name] = (counts, opt.replan_report.kept)

        # Muon on FSDP2: whole matrices to their owners and back, one bucket per round
        shapes = [(12, 8), (7, 9), (16, 5), (5, 16), (9, 9), (3, 11)]
        g = torch.Generator().manual_seed(0)
        model = nn.ParameterList([nn.Parameter(torch.randn(s, generator=g)) for s in shapes])
        fsdp2_shard(model, mesh=init_device_mesh("cpu", (w,)))
        opt = vefsdp_optim.Muon(list(model), lr=0.02)
        opt.min_round_numel = 1  # every owner round its own bucket
        buckets: list[int] = []
        make_buckets = bo.make_buckets

        def recording(items, *args):
            bs = make_buckets(items, *args)
            buckets.append(sum(any(it.moves for it in b) for b in bs))  # buckets that exchange
            return bs

        bo.make_buckets = recording
        try:
            def grads(step, skip=()):
                for i, p in enumerate(model):
                    t = torch.randn(shapes[i], generator=torch.Generator().manual_seed(100 * step + i))
                    p.grad = None if i in skip else distribute_tensor(t, p.device_mesh, p.placements)

            muon: dict[str, tuple[list[str], int]] = {}
            for step, case in enumerate(("first", "steady", "steady2", "no_grad_on_all", "debug", "after_load",
                                         "after_load2", "group_edit")):
                grads(step, skip=(1,) if case == "no_grad_on_all" else ())
                if case == "debug":
                    _debug.DEBUG = True
                if case == "group_edit":  # the param list edited (alike on every rank)
                    opt.param_groups[0]["params"].reverse()
                try:
                    muon[case] = (_count_step(opt, counter), buckets[-1])
                finally:
                    _debug.DEBUG = False
                if case == "debug":
                    opt.load_state_dict(opt.state_dict())
            out["muon"] = muon
        finally:
            bo.make_buckets = make_buckets
    finally:
        _debug.DEBUG = debug
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_steady_state_step_makes_no_control_collectives(world_size: int) -> None:
    res = run_distributed(_steady_state_counts, world_size, timeout=180)
    assert all(r == res[0] for r in res), res
    r = res[0]
    for name in ("adamw", "adamw8bit"):
        counts, kept = r[name]
        assert not kept, (name, kept)  # every 8-bit block whole on one rank: nothing to exchange
        assert counts[1:] == [[], []], (name, counts)
    muon = r["muon"]
    for case in ("steady", "steady2", "no_grad_on_all", "after_load2"):
        calls, buckets = muon[case]
        # one all_to_all out and one back per bucket; no check: a change of which
        # parameters have gradients is not a trigger ([Note: consistent steps])
        assert buckets >= 2 and calls == ["all_to_all_single"] * (2 * buckets), (case, muon)
    for case in ("first", "debug", "after_load", "group_edit"):
        calls, buckets = muon[case]
        # the check: one all-reduce of two int64 per rank before the exchanges (see
        # ``same_on_all_ranks`` in comm/_collectives.py)
        assert len(calls) == 2 * buckets + 1 and calls[1:] == ["all_to_all_single"] * (2 * buckets), (case, muon)
        assert calls[0] == "all_reduce", (case, calls)
