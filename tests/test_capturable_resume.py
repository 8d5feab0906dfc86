"""Checkpoints of ``capturable=True`` optimizers beyond SOAP and Shampoo
(tests/test_capturable_soap.py): the 8-bit Adams' step counts, Muon's and NorMuon's (the
1-D parameters' AdamW counts, the 8-bit momentum's ``momentum_step``). Saved with
``capturable=True`` and loaded into a fresh optimizer, the run goes on bit for bit;
loaded into a group whose saved ``capturable`` is flipped (torch.optim's rule: the
saved groups' keys are the groups' after a load), the counts take the loading group's
form and the run goes on close to the uninterrupted one, both ways ([Note: capturable
steps])."""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch
from capturable_utils import capturable_on_cpu
from test_capturable import CASES, SHAPES, _grad, _init
from torch import nn
from torch.utils._pytree import tree_flatten

NAMES = ["AdamW8bit", "Adam8bit", "Muon", "NorMuon", "Muon-int8"]
STEPS, SPLIT = 4, 2
LR = 1e-2
COUNTS = {"step": torch.float32, "momentum_step": torch.int64}  # the step counts and their dtypes


def _params(values: dict[str, torch.Tensor] | None = None) -> list[nn.Parameter]:
    values = _init() if values is None else values
    return [nn.Parameter(values[k].detach().clone()) for k in SHAPES]


def _run(opt: torch.optim.Optimizer, steps: range) -> None:
    params = opt.param_groups[0]["params"]
    for step in steps:
        for k, p in zip(SHAPES, params, strict=True):
            p.grad = _grad(k, step % 3)
        opt.step()


def _saved(opt: torch.optim.Optimizer, capturable: bool) -> dict[str, Any]:
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    for g in sd["param_groups"]:
        g["capturable"] = capturable
    return sd


def _resume(name: str, sd: dict[str, Any], opt: torch.optim.Optimizer, capturable: bool
            ) -> torch.optim.Optimizer:
    params = _params({k: p for k, p in zip(SHAPES, opt.param_groups[0]["params"], strict=True)})
    fresh = CASES[name][0](params, lr=LR, capturable=not capturable)  # the load sets the flag
    with capturable_on_cpu():  # (the load's zero step runs with the flag it was built with)
        fresh.load_state_dict(sd)
    assert all(g["capturable"] is capturable for g in fresh.param_groups)
    return fresh


def _counts(opt: torch.optim.Optimizer) -> dict[tuple[int, str], torch.Tensor]:
    out = {}
    for i, st in enumerate(opt.state.values()):
        for key, dtype in COUNTS.items():
            if key in st:
                v = st[key]
                assert isinstance(v, torch.Tensor) and v.dtype == dtype and v.dim() == 0, (key, v)
                out[i, key] = v
    return out


def _assert_same(got: torch.optim.Optimizer, want: torch.optim.Optimizer, rtol: float, atol: float) -> None:
    for g, w in zip(got.param_groups[0]["params"], want.param_groups[0]["params"], strict=True):
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol)
    for g, w in zip(got.state.values(), want.state.values(), strict=True):
        assert sorted(g) == sorted(w)
        for key in g:
            for a, b in zip(tree_flatten(g[key])[0], tree_flatten(w[key])[0], strict=True):
                if isinstance(a, torch.Tensor) and a.dtype.is_floating_point:
                    torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m, key=key: f"{key}: {m}")
                elif isinstance(a, torch.Tensor):  # codes and counts: exact either way
                    assert torch.equal(a, b), key


@pytest.mark.parametrize("name", NAMES)
def test_resumed_capturable_run_equals_uninterrupted(name: str) -> None:
    with capturable_on_cpu():
        want = CASES[name][0](_params(), lr=LR, capturable=True)
        _run(want, range(STEPS))
        opt = CASES[name][0](_params(), lr=LR, capturable=True)
        _run(opt, range(SPLIT))
        resumed = _resume(name, _saved(opt, True), opt, capturable=True)
        counts = _counts(resumed)
        assert counts and all(int(v) == SPLIT for v in counts.values()), counts
        _run(resumed, range(SPLIT, STEPS))
    _assert_same(resumed, want, 0, 0)


@pytest.mark.parametrize("name", NAMES)
def test_step_counts_follow_the_loaded_groups_capturable(name: str) -> None:
    """capturable=True saved, loaded as capturable=False, stepped, saved, and loaded as
    capturable=True again: the counts are the loading group's 0-d tensors each time, and
    the runs stay close to the uninterrupted capturable=False run (the 8-bit codes and
    the counts exactly)."""
    want = CASES[name][0](_params(), lr=LR, capturable=False)
    _run(want, range(STEPS + 2))
    with capturable_on_cpu():
        opt = CASES[name][0](_params(), lr=LR, capturable=True)
        _run(opt, range(SPLIT))
    eager = _resume(name, _saved(opt, False), opt, capturable=False)
    assert all(int(v) == SPLIT for v in _counts(eager).values())
    _run(eager, range(SPLIT, STEPS))
    with capturable_on_cpu():
        back = _resume(name, _saved(eager, True), eager, capturable=True)
        assert all(int(v) == STEPS for v in _counts(back).values())
        _run(back, range(STEPS, STEPS + 2))
    rtol, atol = CASES[name][1]
    _assert_same(back, want, rtol, atol)
    assert copy.deepcopy(_counts(back)).keys() == _counts(want).keys()


@pytest.mark.skipif(not torch.backends.cuda.is_built(), reason="fake CUDA tensors need a torch built with CUDA")
@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")
@pytest.mark.parametrize("name", ["AdamW", *NAMES])
def test_fake_cuda_step_counts_go_where_the_loaded_flag_says(name: str) -> None:
    """On (fake) CUDA parameters, where host and device differ: a state saved with either
    flag and loaded with the other keeps its counts on the device when the loaded group
    is capturable and on the host when it is not, as torch.optim's load places AdamW's."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    extra = {"fused": False} if "8bit" in name else {}  # the Triton kernel needs real memory

    def build(capturable: bool) -> torch.optim.Optimizer:
        with mode:
            params = [nn.Parameter(torch.randn(s, device="cuda")) for s in SHAPES.values()]
        return CASES[name][0](params, lr=LR, capturable=capturable, **extra)

    for saved_flag in (True, False):
        opt = build(saved_flag)
        with mode:
            for p in opt.param_groups[0]["params"]:
                p.grad = torch.randn(p.shape, device="cuda")
            opt.step()
            sd = opt.state_dict()
        for g in sd["param_groups"]:
            g["capturable"] = not saved_flag
        fresh = build(saved_flag)
        with mode:
            fresh.load_state_dict(sd)
        want = "cuda" if not saved_flag else "cpu"
        counts = {(i, k): st[k] for i, st in enumerate(fresh.state.values()) for k in COUNTS if k in st}
        assert counts, name
        for key, v in counts.items():
            assert v.device.type == want and v.dtype == COUNTS[key[1]], (saved_flag, key, v.device)
