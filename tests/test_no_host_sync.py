"""No host-device sync in any optimizer's step.

A host sync is an op that makes the host wait for the device: a device value read back
(``.item()``, ``bool()`` / ``if`` of a tensor, ``.tolist()``, ``torch.equal``), an op
whose output size depends on device values (``nonzero``, boolean-mask indexing,
``masked_select``, ``unique``) or a blocking copy between host and device. On CUDA each
one drains the stream. Two checks, each on every optimizer (and the 8-bit, int8 and
eager variants), after a warm-up step, which creates the state and runs the one-time
CPU probes (the batched Newton-Schulz / NorMuon bit probe of each new (batch, shape)
class, host work: ``newtonschulz_batch_exact`` in vefsdp_optim/_math/_newton_schulz.py):

1. On the CPU, in every venv: each step under :class:`SyncRecorder`, a TorchDispatchMode
   that records the ops that would sync and fails on any of them applied to a tensor that
   is not a host-side step counter. Everything is on the CPU here, so a device tensor
   cannot be told by its device; the rule is the other way round: every tensor counts as
   a device tensor except the host-side step counters, which torch.optim keeps on the
   host (unless capturable or fused) and reads there. Those are the tensors of the
   optimizer state's ``step`` entries (and 8-bit Muon's ``momentum_step``), matched by
   storage, so the views of a flat step buffer (AdamW's fused stores) count too; the CPU
   tensors among the hyperparameters (a Tensor ``lr``, which torch.optim also reads on
   the host); and the tensors computed from them alone (an op whose tensor operands are all host-side runs
   on the host, e.g. ``torch.stack(steps)``); plain Python numbers need no rule. Plain
   parameters on one device, and at W = 2 and 3 on
   FSDP2 DTensors and on our ``fully_shard`` (at W = 3 FSDP2 splits the 64-row matrices
   22/22/20 and gives one rank no row of the 2-row gate). ``.tolist()`` dispatches nothing on a CPU tensor,
   so it is wrapped for the step; ``.cpu()`` of a CPU tensor is no op at all (check 2
   sees it).
2. On fake CUDA parameters, where torch has a CUDA build (.venv-torch-lo and -hi; the
   CPU wheel makes fake CUDA tensors but cannot index them): each single-device step,
   the first one too, under FakeTensorMode, which
   raises on any data-dependent op, and under the recorder, which here flags the syncing
   ops on CUDA tensors and every blocking copy between host and CUDA (what
   ``torch.cuda.set_sync_debug_mode("error")`` refuses). 8-bit Adam runs its eager ops:
   its Triton kernel needs real device memory (a launch reads the pointers), and the
   eager ops are the ones it is checked against bit for bit.

Neither check sees a sync inside one torch kernel: on CUDA ``torch.linalg.eigh`` reads
its error code back to the host (torch's ``_linalg_check_errors``), and no eigh without
that check exists in torch 2.11-2.15. Shampoo's steps that recompute roots (every
``precondition_frequency``) and SOAP's first step call it, once per root.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch
from dist_utils import run_distributed
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import vefsdp_optim

aten = torch.ops.aten

# ops that read a value back, or whose output size depends on values
SYNC_OPS = {aten._local_scalar_dense, aten.item, aten.is_nonzero, aten.equal, aten.nonzero,
            aten.masked_select, aten._unique2, aten.unique_dim, aten.unique_consecutive}
INDEX_OPS = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}  # a bool mask: nonzero
STEP_KEYS = ("step", "momentum_step")  # the host-side step counters of the optimizers' states


def _plain(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding ``t``'s data (a wrapper subclass's inner tensors)."""
    if type(t) in (torch.Tensor, nn.Parameter) or not hasattr(t, "__tensor_flatten__"):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [x for n in names for x in _plain(getattr(t, n))]


def _storages(t: torch.Tensor) -> set[int]:
    out = set()
    for x in _plain(t):
        try:
            out.add(x.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # no storage: no host-side counter
            pass
    return out


def _where() -> str:
    """The innermost library frame of the current stack."""
    for f in reversed(traceback.extract_stack()[:-3]):
        if "/vefsdp_optim/" in f.filename or "/comm/" in f.filename:
            return f"{f.filename.rsplit('/', 2)[-2]}/{f.filename.rsplit('/', 1)[-1]}:{f.lineno} ({f.line})"
    return "outside the library"


class SyncRecorder(TorchDispatchMode):
    """Records the ops that would make the host wait for the device (module docstring).

    ``device_type`` None: every tensor is a device tensor except those sharing storage
    with ``host`` (the step counters) or computed from them alone (check 1). ``device_type`` "cuda": a tensor on CUDA
    is a device tensor, and blocking copies between the host and CUDA are recorded too
    (check 2)."""

    def __init__(self, host: Iterable[torch.Tensor] = (), device_type: str | None = None) -> None:
        super().__init__()
        self.host = set().union(*(_storages(t) for t in host))
        self.device_type = device_type
        self.found: list[str] = []

    def on_device(self, t: torch.Tensor) -> bool:
        if self.device_type is not None:
            return t.device.type == self.device_type
        return not (_storages(t) & self.host)

    def _record(self, what: str) -> None:
        self.found.append(f"{what} at {_where()}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        packet = func.overloadpacket
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        if packet in SYNC_OPS and any(self.on_device(t) for t in tensors):
            self._record(str(func))
        elif packet in INDEX_OPS and any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                                         and self.on_device(i) for i in args[1] if i is not None):
            self._record(f"{func} with a boolean mask")
        elif self.device_type is not None and packet is aten._to_copy and kwargs.get("device") is not None \
                and torch.device(kwargs["device"]).type != args[0].device.type \
                and self.device_type in (torch.device(kwargs["device"]).type, args[0].device.type) \
                and not kwargs.get("non_blocking", False):
            self._record(f"blocking copy {args[0].device.type} -> {torch.device(kwargs['device']).type}")
        elif self.device_type is not None and packet is aten.copy_ and args[0].device != args[1].device \
                and self.device_type in (args[0].device.type, args[1].device.type) \
                and not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False)):
            self._record(f"blocking copy_ {args[1].device.type} -> {args[0].device.type}")
        out = func(*args, **kwargs)
        if self.device_type is None and tensors and not any(self.on_device(t) for t in tensors):
            for t in tree_flatten(out)[0]:  # computed on the host from host-side counters alone
                if isinstance(t, torch.Tensor):
                    self.host |= _storages(t)
        return out

    def __enter__(self) -> SyncRecorder:
        super().__enter__()
        self._tolist = torch.Tensor.tolist
        recorder, tolist = self, self._tolist

        def recorded_tolist(t: torch.Tensor) -> Any:
            if recorder.on_device(t):
                recorder._record("Tensor.tolist")
            return tolist(t)

        torch.Tensor.tolist = recorded_tolist  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        torch.Tensor.tolist = self._tolist  # type: ignore[method-assign]
        super().__exit__(*exc)


def host_scalars(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The host-side step counters of ``opt``'s state and the CPU tensors among its
    hyperparameters (a Tensor ``lr``, as torch.optim takes it; see the module docstring)."""
    counters = [v for st in opt.state.values() for k, v in st.items()
                if k in STEP_KEYS and isinstance(v, torch.Tensor) and v.device.type == "cpu"]
    hyper = [t for group in opt.param_groups for k, v in group.items() if k != "params"
             for t in tree_flatten(v)[0] if isinstance(t, torch.Tensor) and t.device.type == "cpu"]
    return counters + hyper


# name -> a factory of the optimizer: small hyperparameters that reach every code path
# within two steps (roots and bases renewed at every step, 8-bit tensors from 16 elements)
CASES: dict[str, Callable[[list[Any]], torch.optim.Optimizer]] = {
    "AdamW": lambda ps: vefsdp_optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "AdamW-fused": lambda ps: vefsdp_optim.AdamW(ps, lr=1e-2, fused=True),
    "AdamW8bit": lambda ps: vefsdp_optim.AdamW8bit(ps, lr=1e-2, min_8bit_size=16, block_size=64),
    "AdamW8bit-eager": lambda ps: vefsdp_optim.AdamW8bit(ps, lr=1e-2, min_8bit_size=16, block_size=64,
                                                         fused=False),
    "Adam8bit-eager": lambda ps: vefsdp_optim.Adam8bit(ps, lr=1e-2, weight_decay=0.1, min_8bit_size=16,
                                                       block_size=64, fused=False),
    "AdamW-tensor-lr": lambda ps: vefsdp_optim.AdamW(ps, lr=torch.tensor(1e-2), betas=(0.9, 0.99)),
    "Muon": lambda ps: vefsdp_optim.Muon(ps, lr=1e-2),
    "Muon-tensor-lr": lambda ps: vefsdp_optim.Muon(ps, lr=torch.tensor(1e-2)),
    "Muon-int8": lambda ps: vefsdp_optim.Muon(ps, lr=1e-2, momentum_dtype=torch.int8),
    "NorMuon": lambda ps: vefsdp_optim.NorMuon(ps, lr=1e-2),
    "NorMuon-int8": lambda ps: vefsdp_optim.NorMuon(ps, lr=1e-2, momentum_dtype=torch.int8),
    "Shampoo": lambda ps: vefsdp_optim.Shampoo(ps, lr=1e-2, max_preconditioner_dim=32, precondition_frequency=1,
                                               start_preconditioning_step=1),
    "SOAP": lambda ps: vefsdp_optim.SOAP(ps, lr=1e-2, precondition_frequency=1),
}
# two matrices of one shape (a batched Newton-Schulz on the CPU), a tall one, vectors
SHAPES = [(64, 48), (64, 48), (40, 33), (300,), (7,)]


def _grads(params: list[nn.Parameter], seed: int, device: str = "cpu") -> None:
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(device) if device == "cpu" else torch.randn(p.shape,
                                                                                               device=device)


def _recorded_step(opt: torch.optim.Optimizer) -> list[str]:
    with SyncRecorder(host_scalars(opt)) as rec:
        opt.step()
    return rec.found


# -- 1. plain parameters on one device ----------------------------------------------------


@pytest.mark.parametrize("name", sorted(CASES))
def test_plain_step_makes_no_host_sync(name: str) -> None:
    g = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]
    opt = CASES[name](params)
    _grads(params, 1)
    opt.step()  # the warm-up step
    _grads(params, 2)
    assert _recorded_step(opt) == []


def test_recorder_sees_each_kind_of_sync() -> None:
    """The recorder fails on what it must refuse, and spares the host-side counters."""
    x, step = torch.randn(8), torch.tensor(3.0)
    with SyncRecorder([step]) as rec:
        bool(x.sum() > 0)
        float(x[0])
        x.nonzero()
        torch.equal(x, x)
        x[x > 0]
        x.tolist()
        int(step.item()), step.tolist()  # a host-side counter: allowed
        step += 1
        float(step)
    assert [f.split(" at ")[0] for f in rec.found] == [
        "aten._local_scalar_dense.default", "aten._local_scalar_dense.default", "aten.nonzero.default",
        "aten.equal.default", "aten.index.Tensor with a boolean mask", "Tensor.tolist"], rec.found


# -- sharded at W = 2 and 3: FSDP2 DTensors and fully_shard ----------------------------------


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a = nn.Parameter(torch.randn(64, 48, generator=g) / 8)
        self.b = nn.Parameter(torch.randn(64, 48, generator=g) / 8)
        self.c = nn.Parameter(torch.randn(48, 33, generator=g) / 8)
        self.bias = nn.Parameter(torch.randn(33, generator=g))
        self.gate = nn.Parameter(torch.randn(2, 33, generator=g))  # fewer rows than ranks at W = 3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (((x @ self.a + x @ self.b) @ self.c + self.bias) * self.gate.sum(0)).square().mean()


def _sharded_steps(kind: str) -> dict[str, list[str]]:
    torch.manual_seed(0)
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        from vefsdp_optim import fully_shard
    found = {}
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    for name, make in sorted(CASES.items()):
        model = _Net()
        fully_shard(model)
        opt = make(list(model.parameters()))
        for step in range(2):
            model(x * (step + 1)).backward()
            if step == 0:
                opt.step()  # the warm-up step
            else:
                found[name] = _recorded_step(opt)
            opt.zero_grad()
    return found


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("kind", ["fsdp2", "fully_shard"])
def test_sharded_step_makes_no_host_sync(kind: str, world_size: int) -> None:
    for rank, found in enumerate(run_distributed(_sharded_steps, world_size, kind)):
        assert found == dict.fromkeys(CASES, []), (rank, {k: v for k, v in found.items() if v})


# -- 2. fake CUDA parameters under FakeTensorMode ---------------------------------------------


@pytest.mark.skipif(not torch.backends.cuda.is_built(), reason="a torch without CUDA makes fake CUDA tensors "
                    "but indexes them with CPU kernels ('PyTorch is not linked with support for cuda devices')")
@pytest.mark.parametrize("name", sorted(n for n in CASES if n != "AdamW8bit"))  # its Triton kernel: see above
def test_fake_cuda_step_makes_no_host_sync(name: str) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        params = [nn.Parameter(torch.randn(s, device="cuda")) for s in SHAPES]
    opt = CASES[name](params)  # built outside: host work that real tensors do (code tables)
    for step in range(3):
        with mode:
            _grads(params, step, "cuda")
            with SyncRecorder(device_type="cuda") as rec:
                opt.step()  # FakeTensorMode raises on a data-dependent op
        assert rec.found == [], (step, rec.found)
    assert all(p.device.type == "cuda" for p in params)
