"""``capturable=True`` on every optimizer ([Note: capturable steps]).

A capturable step is a fixed sequence of device work that a CUDA graph can capture and
replay: step counts live on the parameters' device, a Tensor ``lr`` is read there, and
nothing in the step reads a device value on the host or a host tensor on the device.
Checked here without a GPU:

1. refused on the CPU, as torch.optim refuses it (our ValueError; AdamW: torch's own);
2. with the CPU let in (tests/capturable_utils.py), on one device: close to the same
   optimizer with ``capturable=False`` (the coefficients are rounded on the device), an
   ``lr`` tensor changed in place between steps is the ``lr`` of the next step, and the
   state's step counts are tensors on the parameters' device;
3. the same, sharded on FSDP2 and on our ``fully_shard`` at W = 2 and 3: bit for bit the
   one-device capturable run fed the same full gradients;
4. on fake CUDA tensors under FakeTensorMode (a torch with CUDA built): every step runs
   with no data-dependent op (FakeTensorMode raises) and no host sync, and every step
   after the first (the warm-up, which may copy host-made tables in: the 8-bit code maps)
   with no host tensor in any op (a captured graph would keep the value read at capture).

tools/_gpu_capture.py captures the whole step on a GPU and replays it against eager
steps, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from capturable_utils import capturable_on_cpu
from dist_utils import run_distributed
from sharded_bag import full_params, set_full_grads, shard_bag
from test_no_host_sync import SyncRecorder
from torch import nn
from torch.utils._pytree import tree_flatten

import vefsdp_optim

Factory = Callable[..., torch.optim.Optimizer]

# name -> (factory(params, lr=..., capturable=...), (rtol, atol) against capturable=False)
# small hyperparameters that reach every code path within three steps
CASES: dict[str, tuple[Factory, tuple[float, float]]] = {
    "AdamW": (lambda ps, **kw: vefsdp_optim.AdamW(ps, weight_decay=0.1, **kw), (1e-5, 1e-6)),
    "AdamW-amsgrad": (lambda ps, **kw: vefsdp_optim.AdamW(ps, amsgrad=True, **kw), (1e-5, 1e-6)),
    "AdamW8bit": (lambda ps, **kw: vefsdp_optim.AdamW8bit(ps, min_8bit_size=16, block_size=64, **kw),
                  (1e-5, 1e-6)),
    "Adam8bit": (lambda ps, **kw: vefsdp_optim.Adam8bit(ps, weight_decay=0.1, min_8bit_size=16, block_size=64,
                                                        **kw), (1e-5, 1e-6)),
    "Muon": (lambda ps, **kw: vefsdp_optim.Muon(ps, **kw), (1e-5, 1e-6)),
    "NorMuon": (lambda ps, **kw: vefsdp_optim.NorMuon(ps, **kw), (1e-5, 1e-6)),
    # the 8-bit momentum's rounding reads its step count on the device
    "Muon-int8": (lambda ps, **kw: vefsdp_optim.Muon(ps, momentum_dtype=torch.int8, **kw), (1e-5, 1e-6)),
    "NorMuon-int8": (lambda ps, **kw: vefsdp_optim.NorMuon(ps, momentum_dtype=torch.int8, **kw), (1e-5, 1e-6)),
    "Shampoo": (lambda ps, **kw: vefsdp_optim.Shampoo(ps, max_preconditioner_dim=32, precondition_frequency=2,
                                                      start_preconditioning_step=1, **kw), (1e-4, 1e-6)),
    "SOAP": (lambda ps, **kw: vefsdp_optim.SOAP(ps, precondition_frequency=2, **kw), (1e-4, 1e-6)),
}
LR = 1e-2
STEPS = 3
# two matrices of one shape (batched Newton-Schulz), a tall one, vectors
SHAPES = {"a": (64, 48), "b": (64, 48), "c": (40, 33), "d": (300,), "e": (7,)}


def _init() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}


def _grad(name: str, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + sorted(SHAPES).index(name))
    return torch.randn(SHAPES[name], generator=g)


def _lr(step: int) -> float:
    return LR * (1.0, 0.5, 0.25)[step]  # a schedule: the tensor is changed in place


def _run(name: str, model: nn.Module, capturable: bool, tensor_lr: bool) -> torch.optim.Optimizer:
    lr: float | torch.Tensor = torch.tensor(_lr(0)) if tensor_lr else _lr(0)
    opt = CASES[name][0](list(model.parameters()), lr=lr, capturable=capturable)
    for step in range(STEPS):
        for group in opt.param_groups:
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(_lr(step))
            else:
                group["lr"] = _lr(step)
        set_full_grads(model, lambda k, step=step: _grad(k, step))
        opt.step()
    return opt


def _one_device(name: str, capturable: bool, tensor_lr: bool) -> tuple[dict[str, torch.Tensor], Any]:
    from sharded_bag import Bag

    model = Bag(_init())
    if capturable:
        with capturable_on_cpu():
            opt = _run(name, model, True, tensor_lr)
    else:
        opt = _run(name, model, False, tensor_lr)
    return {k: p.detach().clone() for k, p in model.named_parameters()}, opt


# -- 1. refused where torch refuses it ----------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CASES))
def test_capturable_refused_on_cpu(name: str) -> None:
    p = nn.Parameter(torch.randn(8, 8))
    p.grad = torch.randn(8, 8)
    opt = CASES[name][0]([p], lr=LR, capturable=True)
    assert all(g["capturable"] is True for g in opt.param_groups)
    if name.startswith("AdamW") and "8bit" not in name:
        with pytest.raises(AssertionError, match="capturable=True"):  # torch.optim.AdamW's own
            opt.step()
    else:
        with pytest.raises(ValueError, match=r"capturable=True\) needs its parameters on a device"):
            opt.step()


@pytest.mark.parametrize("cls", [vefsdp_optim.Muon, vefsdp_optim.NorMuon])
def test_capturable_must_be_a_bool(cls: type) -> None:
    p = nn.Parameter(torch.randn(8, 8))
    with pytest.raises(TypeError, match="capturable must be a bool, got 1"):
        cls([p], capturable=1)
    opt = cls([p], capturable=True)
    with pytest.raises(TypeError, match="capturable must be a bool, got 'yes'"):
        opt.add_param_group({"params": [nn.Parameter(torch.randn(4, 4))], "capturable": "yes"})


# -- 2. one device, the CPU let in ----------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CASES))
def test_capturable_close_to_eager_and_lr_tensor_read_each_step(name: str) -> None:
    eager, eager_opt = _one_device(name, capturable=False, tensor_lr=False)
    captured, opt = _one_device(name, capturable=True, tensor_lr=True)
    if name.endswith("-int8"):  # given gradients: the momentum's rounding, dither included, is exact
        for st, want in zip(opt.state.values(), eager_opt.state.values(), strict=True):
            if "momentum_codes" in want:
                assert torch.equal(st["momentum_codes"], want["momentum_codes"])
                assert torch.equal(st["momentum_absmax"], want["momentum_absmax"])
                assert torch.equal(st["momentum_step"], want["momentum_step"])
    floats, _ = _one_device(name, capturable=True, tensor_lr=False)
    rtol, atol = CASES[name][1]
    for k in SHAPES:
        torch.testing.assert_close(captured[k], eager[k], rtol=rtol, atol=atol, msg=lambda m, k=k: f"{k}: {m}")
        # a float lr and a tensor lr of the same values: one step either way
        torch.testing.assert_close(captured[k], floats[k], rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")
    for st in opt.state.values():
        for key, v in st.items():
            assert not (isinstance(v, (int, float)) and not isinstance(v, bool)), \
                f"state[{key!r}] is a host number ({v!r}): a captured step cannot advance it"
        for key in ("step", "momentum_step"):
            if key in st:
                assert isinstance(st[key], torch.Tensor) and st[key].device.type == "cpu"


def test_capturable_lr_tensor_must_be_on_the_parameters_device() -> None:
    p = nn.Parameter(torch.randn(8, 8))
    p.grad = torch.randn(8, 8)
    lr = torch.tensor(LR, device="meta")
    opt = vefsdp_optim.Muon([p], lr=LR, capturable=True)
    opt.param_groups[0]["lr"] = lr
    with capturable_on_cpu(), pytest.raises(ValueError, match="needs Tensor hyperparameters on the parameters'"):
        opt.step()


# -- 3. sharded: bit for bit the capturable one-device run -------------------------------------------


def _sharded(kind: str, names: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    with capturable_on_cpu():
        for name in names:
            model = shard_bag(kind, _init())
            _run(name, model, True, True)
            out[name] = full_params(model)
    return out


@pytest.mark.parametrize("world_size", [pytest.param(2, marks=pytest.mark.slow), 3])
@pytest.mark.parametrize("kind", ["fsdp2", "fully_shard"])
def test_capturable_sharded_equals_one_device(kind: str, world_size: int) -> None:
    names = sorted(CASES)
    want = {n: _one_device(n, capturable=True, tensor_lr=True)[0] for n in names}
    for rank, got in enumerate(run_distributed(_sharded, world_size, kind, names)):
        for n in names:
            for k in SHAPES:
                torch.testing.assert_close(got[n][k], want[n][k], rtol=0, atol=0,
                                           msg=lambda m, n=n, k=k, rank=rank: f"{n} {k} rank {rank}: {m}")


# -- 4. fake CUDA tensors: nothing the graph could not replay -------------------------------------------


class CaptureRecorder(SyncRecorder):
    """SyncRecorder on CUDA, and also any op with a host tensor among its operands."""

    def __init__(self) -> None:
        super().__init__(device_type="cuda")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        tensors = [a for a in tree_flatten((args, kwargs or {}))[0] if isinstance(a, torch.Tensor)]
        if any(t.device.type == "cpu" for t in tensors):
            self._record(f"{func} on a host tensor")
        return super().__torch_dispatch__(func, types, args, kwargs)


@pytest.mark.skipif(not torch.backends.cuda.is_built(), reason="a torch without CUDA makes fake CUDA tensors "
                    "but indexes them with CPU kernels ('PyTorch is not linked with support for cuda devices')")
@pytest.mark.parametrize("name", sorted(CASES))
def test_fake_cuda_capturable_step(name: str) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        params = [nn.Parameter(torch.randn(s, device="cuda")) for s in SHAPES.values()]
        lr = torch.full((), LR, device="cuda")
    extra = {"fused": False} if "8bit" in name else {}  # the Triton kernel needs real memory: its eager ops
    opt = CASES[name][0](params, lr=LR, capturable=True, **extra)
    for group in opt.param_groups:  # (the constructor's checks read a Tensor lr on the host, as torch's)
        group["lr"] = lr
    numbers: list[dict[tuple[int, str], Any]] = []
    for step in range(STEPS):
        with mode:
            for p in params:
                p.grad = torch.randn(p.shape, device="cuda")
            # the first step may copy host-made tables in (the warm-up a capture follows)
            with CaptureRecorder() if step else SyncRecorder(device_type="cuda") as rec:
                opt.step()  # FakeTensorMode raises on a data-dependent op
        assert rec.found == [], (step, rec.found)
        numbers.append({(i, k): v for i, st in enumerate(opt.state.values()) for k, v in st.items()
                        if isinstance(v, (int, float))})
    assert numbers[-1] == numbers[-2], f"host numbers in the state change between steps: {numbers[-2:]}"
    for st in opt.state.values():
        for k, v in st.items():
            for t in tree_flatten(v)[0]:
                if isinstance(t, torch.Tensor):
                    assert t.device.type == "cuda", f"state[{k!r}] on {t.device}"


# -- 5. QK-clip after capturable steps ---------------------------------------------------------------


@pytest.mark.parametrize("cls", [vefsdp_optim.Muon, vefsdp_optim.NorMuon])
def test_capturable_with_qk_clip(cls: type) -> None:
    """QK-clip after each capturable step (a graph may capture the step and the clip):
    close to capturable=False on one device, the clipped rows included; on fake CUDA
    neither the step nor the clip syncs, and after the first step neither reads a host
    tensor."""
    from test_qk_clip import LOGITS, TAU, _groups, _model, _register, _shapes
    from test_qk_clip import _grad as qk_grad

    def run(capturable: bool) -> dict[str, torch.Tensor]:
        params = dict(_model().named_parameters())
        opt = cls(_groups(params), lr=0.02, weight_decay=0.1, qk_clip_threshold=TAU, capturable=capturable)
        _register(opt, params)
        for step, logits in enumerate(LOGITS):
            for k, p in params.items():
                p.grad = qk_grad(step, k)
            opt.step()
            opt.qk_clip_({k: torch.tensor(v) for k, v in logits.items()})
        return {k: p.detach() for k, p in params.items()}

    eager = run(False)
    with capturable_on_cpu():
        captured = run(True)
    for k, want in eager.items():
        torch.testing.assert_close(captured[k], want, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    if not torch.backends.cuda.is_built():
        return  # fake CUDA tensors need a CUDA build of torch (the -lo / -hi venvs)
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        fake = {k: nn.Parameter(torch.randn(s, device="cuda")) for k, s in _shapes().items()}
    opt = cls(_groups(fake), lr=0.02, qk_clip_threshold=TAU, capturable=True)
    _register(opt, fake)
    for step in range(STEPS):
        with mode:
            for p in fake.values():
                p.grad = torch.randn(p.shape, device="cuda")
            logits = {k: torch.randn(len(v), device="cuda") for k, v in LOGITS[0].items()}
            with CaptureRecorder() if step else SyncRecorder(device_type="cuda") as rec:
                opt.step()
                opt.qk_clip_(logits)
        assert rec.found == [], (step, rec.found)
