"""Muon's batched Newton-Schulz across parameters (see ``newtonschulz_batch_exact`` in
vefsdp_optim/_math/_newton_schulz.py).

A rank orthogonalizes every whole block it computes in an exchange bucket (parameters
of one param group), by shape, in one batch: the blocks of several fused QKV matrices
(``split_sizes``), experts (``flatten=False``), plain matrices of one shape. The
reference is torch.optim.Muon on every block as its own parameter, bit for bit, on one
device and sharded (FSDP2 and fully_shard, W = 2 and 3).
The guard (``BATCH_MIN_DIM``) is checked on input families a random probe does not cover.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from dist_utils import run_distributed
from sharded_bag import full_params, set_full_grads, shard_bag
from torch import nn

import vefsdp_optim
from vefsdp_optim._math._newton_schulz import (
    BATCH_MIN_DIM,
    NS_COEFFICIENTS,
    NS_EPS,
    NS_STEPS,
    newtonschulz_batch_exact,
    zeropower_via_newtonschulz,
    zeropower_via_newtonschulz_batched,
)

STEPS = 3
HP = dict(lr=0.02, weight_decay=0.1)

# name -> (shape, group keys): param groups by keys; the QKV group's six 32 x 40 blocks,
# three experts and the two tall matrices batch; 8 x 32 blocks stay below the guard
PARAMS = {
    "qkv0": ((96, 40), dict(split_sizes=[32, 32, 32])),
    "qkv1": ((96, 40), dict(split_sizes=[32, 32, 32])),
    "gqa": ((48, 32), dict(split_sizes=[32, 8, 8])),
    "square": ((32, 32), {}),
    "dense": ((32, 40), {}),
    "experts": ((3, 32, 40), dict(flatten=False)),
    "tall": ((64, 33), {}),
    "tall2": ((64, 33), {}),
}


def _blocks(shape, keys):
    """(index into the parameter, shape) of each separate matrix of the reference run."""
    lead = [(e,) for e in range(shape[0])] if keys.get("flatten") is False else [()]
    m, n = shape[-2:]
    out = []
    for ix in lead:
        r = 0
        for s in keys.get("split_sizes") or [m]:
            out.append(ix + (slice(r, r + s),))
            r += s
    return out


def _init():
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(s, generator=g) for k, (s, _) in PARAMS.items()}


def _grad(step, name):
    g = torch.Generator().manual_seed(1000 * step + sum(map(ord, name)))
    return torch.randn(PARAMS[name][0], generator=g)


def _groups(params):
    groups: dict[str, dict] = {}
    for k, (_, keys) in PARAMS.items():
        groups.setdefault(repr(keys), {**keys, "params": []})["params"].append(params[k])
    return list(groups.values())


def _torch_reference():
    init = _init()
    pieces = {k: [(ix, nn.Parameter(init[k][ix].clone())) for ix in _blocks(s, keys)]
              for k, (s, keys) in PARAMS.items()}
    opt = torch.optim.Muon([p for ps in pieces.values() for _, p in ps], **HP)
    for step in range(STEPS):
        for k, ps in pieces.items():
            g = _grad(step, k)
            for ix, p in ps:
                p.grad = g[ix].clone()
        opt.step()
    out = {k: v.clone() for k, v in init.items()}
    for k, ps in pieces.items():
        for ix, p in ps:
            out[k][ix] = p.detach()
    return out


def test_blocks_of_several_parameters_in_one_batch(monkeypatch):
    import vefsdp_optim._math._muon as muon_mod

    batches = []
    real = muon_mod.newtonschulz_batch_exact

    def exact(*args):
        ok = real(*args)
        if ok:
            batches.append(args[:3])  # (batch, rows, cols) of every batch taken
        return ok

    monkeypatch.setattr(muon_mod, "newtonschulz_batch_exact", exact)
    params = {k: nn.Parameter(v.clone()) for k, v in _init().items()}
    opt = vefsdp_optim.Muon(_groups(params), **HP)
    for step in range(STEPS):
        for k, p in params.items():
            p.grad = _grad(step, k)
        opt.step()
    want = _torch_reference()
    for k in PARAMS:
        assert torch.equal(params[k].detach(), want[k]), (k, (params[k] - want[k]).abs().max())
    assert {(6, 32, 40), (3, 32, 40), (2, 64, 33)} <= set(batches), batches
    assert not any(rows == 8 for _, rows, _ in batches)  # below the guard


def _sharded_run(kind):
    model = shard_bag(kind, _init())
    opt = vefsdp_optim.Muon(_groups(dict(model.named_parameters())), **HP)
    for step in range(STEPS):
        set_full_grads(model, partial(_grad, step))
        opt.step()
    return full_params(model)


def _sharded_both():
    return {kind: _sharded_run(kind) for kind in ("fsdp2", "fully_shard")}


@pytest.mark.parametrize("world_size", [2, 3])
def test_sharded_equals_torch_on_separate_blocks(world_size):
    got = run_distributed(_sharded_both, world_size)[0]
    want = _torch_reference()
    for kind, full in got.items():
        for k in PARAMS:
            assert torch.equal(full[k], want[k]), (kind, k, (full[k] - want[k]).abs().max())


def _families(batch, rows, cols, g):
    """Inputs a random probe does not stand for: quantized momentum, mostly zeros, rank
    two, constant rows (the probe itself is normal)."""
    yield "normal", torch.randn(batch, rows, cols, generator=g)
    scale = torch.rand(batch, 1, 1, generator=g)
    yield "quantized", torch.randint(-127, 128, (batch, rows, cols), generator=g).float() / 127 * scale
    yield "zeros", torch.randn(batch, rows, cols, generator=g) * (torch.rand(batch, rows, cols, generator=g) < 0.1)
    yield "rank2", torch.randn(batch, rows, 2, generator=g) @ torch.randn(batch, 2, cols, generator=g)
    yield "rows", torch.randn(batch, rows, 1, generator=g).expand(batch, rows, cols).contiguous()


@pytest.mark.parametrize("shape", [(32, 32), (32, 128), (40, 33), (96, 48), (8, 64), (16, 128), (70, 5)])
@pytest.mark.parametrize("ns_coefficients", [NS_COEFFICIENTS, "polar_express"])
def test_batch_guard_holds_on_every_input_family(shape, ns_coefficients):
    """Where the probe allows a batch, the batch equals the per-matrix function on every
    family; below ``BATCH_MIN_DIM`` the guard refuses without a probe."""
    rows, cols = shape
    ns = (ns_coefficients, NS_STEPS, NS_EPS)
    allowed = [b for b in (2, 3, 8) if newtonschulz_batch_exact(b, rows, cols, torch.device("cpu"), *ns,
                                                                  torch.get_num_threads())]
    if min(shape) < BATCH_MIN_DIM:
        assert allowed == []
        return
    g = torch.Generator().manual_seed(rows * 7 + cols)
    for b in allowed:
        for name, x in _families(b, rows, cols, g):
            want = torch.stack([zeropower_via_newtonschulz(m, *ns) for m in x])
            assert torch.equal(zeropower_via_newtonschulz_batched(x, *ns), want), (shape, b, name)


@pytest.mark.parametrize("n", [(1 << 16) * 3 + 17, (1 << 16) + 1, 1000])
def test_mixed_dtype_add_in_pieces_equals_torch(n):
    """Muon adds its bfloat16 update to a float32 parameter in pieces on the CPU: the
    bits of one ``add_``, tails included."""
    from vefsdp_optim._math._muon import _add_

    g = torch.Generator().manual_seed(n)
    p = torch.randn(n, generator=g) * 1e-3
    update = torch.randn(n, generator=g).bfloat16()
    want = p.clone().add_(update, alpha=-0.0123)
    _add_(p, update, -0.0123)
    assert torch.equal(p, want)


def test_large_matrix_equals_torch():
    """A matrix above the piece size, through the whole step, against torch.optim.Muon."""
    g = torch.Generator().manual_seed(5)
    init = torch.randn(300, 501, generator=g)
    ours, ref = nn.Parameter(init.clone()), nn.Parameter(init.clone())
    opt, ref_opt = vefsdp_optim.Muon([ours], **HP), torch.optim.Muon([ref], **HP)
    for _ in range(2):
        grad = torch.randn(300, 501, generator=g)
        ours.grad, ref.grad = grad.clone(), grad.clone()
        opt.step()
        ref_opt.step()
    assert torch.equal(ours.detach(), ref.detach())


# -- off the CPU: the probe's answer without a host sync (see vefsdp_optim/_math/_batch_probe.py) --

class _Event:
    done = False

    def record(self):
        pass

    def query(self):
        return self.done


def test_probe_off_the_cpu_answers_when_its_event_is_done(monkeypatch):
    """The probe is queued once; the per-matrix path (False) runs until its event is
    done, then the verdict read from the host flag."""
    from vefsdp_optim._math import _batch_probe as bp

    event = _Event()
    monkeypatch.setattr(bp, "_event", lambda device: event)
    monkeypatch.setattr(bp, "_host_flag", lambda: torch.empty((), dtype=torch.bool))
    monkeypatch.setattr(bp, "_answers", {})
    monkeypatch.setattr(bp, "_pending", {})
    runs = []

    def run(verdict):
        runs.append(verdict)
        return torch.tensor(verdict)

    meta = torch.device("meta")  # not the CPU: the asynchronous path
    for verdict in (True, False):
        event.done = False
        assert bp.batch_probe(("k", verdict), meta, lambda v=verdict: run(v)) is False  # queued
        assert bp.batch_probe(("k", verdict), meta, lambda v=verdict: run(v)) is False  # pending
        event.done = True
        assert bp.batch_probe(("k", verdict), meta, lambda v=verdict: run(v)) is verdict
        assert bp.batch_probe(("k", verdict), meta, lambda v=verdict: run(v)) is verdict
    assert runs == [True, False]  # once per key


def test_probe_is_not_queued_under_fake_tensor_mode(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vefsdp_optim._math import _batch_probe as bp

    monkeypatch.setattr(bp, "_answers", {})
    monkeypatch.setattr(bp, "_pending", {})
    with FakeTensorMode(allow_non_fake_inputs=True):
        assert bp.batch_probe("k", torch.device("cuda"), lambda: pytest.fail("probe queued")) is False
    assert bp._pending == {} and bp._answers == {}


@pytest.mark.skipif(not torch.backends.cuda.is_built(), reason="a torch without CUDA makes fake CUDA tensors "
                    "but indexes them with CPU kernels")
@pytest.mark.parametrize("name", ["Muon", "NorMuon"])
def test_fake_cuda_batched_step_makes_no_host_sync(monkeypatch, name):
    """Where the probes have answered True, Muon's and NorMuon's steps on fake CUDA
    parameters batch Newton-Schulz (and NorMuon its normalization) over same-shape
    blocks, with no data-dependent op (FakeTensorMode raises on one) and no sync."""
    from test_no_host_sync import SyncRecorder
    from torch._subclasses.fake_tensor import FakeTensorMode

    import vefsdp_optim._math._muon as muon_mod
    import vefsdp_optim._math._normuon as normuon_mod

    batched = []
    real_ns, real_nm = muon_mod.zeropower_via_newtonschulz_batched, normuon_mod.normuon_normalize_batched_
    monkeypatch.setattr(muon_mod, "newtonschulz_batch_exact", lambda *a: True)
    monkeypatch.setattr(normuon_mod, "normuon_batch_exact", lambda *a: True)
    monkeypatch.setattr(muon_mod, "zeropower_via_newtonschulz_batched",
                        lambda x, *a: batched.append(("ns", *x.shape)) or real_ns(x, *a))
    monkeypatch.setattr(normuon_mod, "normuon_normalize_batched_",
                        lambda x, *a, **k: batched.append(("norm", *x.shape)) or real_nm(x, *a, **k))
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        params = [nn.Parameter(torch.randn(s, device="cuda")) for s in [(40, 33), (40, 33), (3, 32, 48)]]
    groups = [dict(params=params[:2]), dict(params=params[2:], flatten=False)]
    opt = getattr(vefsdp_optim, name)(groups, lr=0.02)
    for _ in range(2):
        with mode:
            for p in params:
                p.grad = torch.randn(p.shape, device="cuda")
            with SyncRecorder(device_type="cuda") as rec:
                opt.step()
        assert rec.found == []
    want = {("ns", 2, 40, 33), ("ns", 3, 32, 48)} | ({("norm", 2, 40, 33), ("norm", 3, 32, 48)}
                                                       if name == "NorMuon" else set())
    assert set(batched) == want, batched


def test_normuon_normalization_batched_where_newton_schulz_is_not(monkeypatch):
    """NorMuon normalizes same-shape blocks in one batch also where Newton-Schulz ran per
    block (its results cast into the batch one by one): the bits of the per-block path."""
    import vefsdp_optim._math._muon as muon_mod
    import vefsdp_optim._math._normuon as normuon_mod

    shapes = [(40, 33), (40, 33), (40, 33), (64, 48)]
    init = [torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(shapes)]
    monkeypatch.setattr(muon_mod, "newtonschulz_batch_exact", lambda *a: False)
    # the probe of the batched normalization (its own call of it) before the count
    beta2 = vefsdp_optim.NorMuon([nn.Parameter(torch.zeros(2, 2))]).defaults["muon_beta2"]
    normuon_mod.normuon_batch_exact(3, 40, 33, torch.float32, torch.device("cpu"), beta2, torch.get_num_threads())
    real, lists = normuon_mod.normuon_normalize_batched_, []
    monkeypatch.setattr(normuon_mod, "normuon_normalize_batched_",
                        lambda o, *a, **k: lists.append(isinstance(o, list)) or real(o, *a, **k))
    out = {}
    for batch in (True, False):
        if not batch:
            monkeypatch.setattr(normuon_mod, "normuon_batch_exact", lambda *a: False)
        ps = [nn.Parameter(t.clone()) for t in init]
        opt = vefsdp_optim.NorMuon(ps, lr=0.02, weight_decay=0.1)
        for step in range(STEPS):
            for i, p in enumerate(ps):
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * step + i))
            opt.step()
        out[batch] = [p.detach() for p in ps]
    assert lists == [True] * STEPS  # the three 40 x 33 blocks, once a step
    assert all(torch.equal(a, b) for a, b in zip(out[True], out[False], strict=True))
