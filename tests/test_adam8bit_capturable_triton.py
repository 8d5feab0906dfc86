"""The capturable 8-bit Adam step on the Triton kernel (see ``_adam8bit_step_kernel`` in
vefsdp_optim/_kernels/_quant8_triton.py): the coefficients read from a device table, bit
for bit the eager capturable step given the same table and the host-scalar kernel given the
same float32 coefficients, one launch for tensors of different step counts, and the
optimizer's ``capturable=True`` on it.

On the CPU the kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``), so the
sizes stay small; with ``VEFSDP_TEST_DEVICE=cuda`` the kernel tests run compiled on the GPU.
"""

import pytest
import torch
from capturable_utils import capturable_on_cpu
from dist_utils import run_distributed
from test_adam8bit_triton import (
    SIGNED,
    UNSIGNED,
    _Backend,
    _equal,
    _grad,
    _Launches,
    _state,
    _Uneven,
    needs_triton,
)
from torch import nn

import vefsdp_optim
from vefsdp_optim._math import TableQuantizer, adam8bit_capturable_step_
from vefsdp_optim._math._adam8bit_step import adam8bit_device_hparams

# the interpreter's numpy divides NaN moments of the non-finite cases (zeroed afterwards)
pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"), needs_triton]


def _kw(bs, decoupled, wd, maximize, device):
    return dict(beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=wd, decoupled=decoupled, block_size=bs,
                signed_code=SIGNED.to(device), unsigned_code=UNSIGNED.to(device), maximize=maximize)


@pytest.mark.parametrize("bs,decoupled,wd,maximize", [
    (64, True, 1e-2, False),  # AdamW
    (64, False, 0.1, True),  # Adam's L2 term, maximize
    (256, True, 0.0, False),  # no decay; tensors shorter than a block
    (256, False, 0.0, True),
])
def test_device_table_kernel_equals_eager_capturable_bitwise(device, bs, decoupled, wd, maximize):
    """Uneven tensors (a block's tail, one shorter than a block, an empty one) at different
    step counts (a fresh tensor among stepped ones) in ONE launch a step, the bits of the
    eager capturable step (``fused=False``) with a tensor ``lr`` changed in place."""
    from vefsdp_optim._kernels import _quant8_triton as qt

    ns = [333, 5, 0, 2 * bs + 1, 1, 100]
    gen = torch.Generator().manual_seed(bs + 2 * decoupled + maximize)
    init = [torch.randn(n, generator=gen).to(device) for n in ns]
    runs = {fused: ([p.clone() for p in init], [_state(n, bs, device) for n in ns],
                    [torch.zeros((), device=device) for _ in ns]) for fused in (None, False)}
    lr = torch.tensor(1e-2, device=device)
    kw = _kw(bs, decoupled, wd, maximize, device)
    for step in (1, 2, 3):
        lr.fill_(1e-2 / step)
        gs = [(_grad(n, gen, step) if n > 2 else torch.randn(n, generator=gen)).to(device) for n in ns]
        for fused, (ps, ss, counts) in runs.items():
            on = [i for i in range(len(ns)) if i != 3 or step == 3]  # tensor 3 fresh at step 3 (count 1)
            for i in on:
                counts[i].add_(1)
            with _Backend("triton", interpret=torch.device(device).type == "cpu"), _Launches(qt) as spy:
                adam8bit_capturable_step_([ps[i] for i in on], [gs[i] for i in on], [ss[i] for i in on],
                                          steps=[counts[i] for i in on], lr=lr, fused=fused, **kw)
            assert spy.launches == (1 if fused is None else 0), (fused, step)
        for i in range(len(ns)):
            assert _equal(runs[None][0][i], runs[False][0][i]), (step, i)
            for x, y in zip(runs[None][1][i], runs[False][1][i], strict=True):
                assert _equal(x, y), (step, i)
    assert runs[None][0][0].isnan().any()  # the non-finite case ran


class _CountingDict(dict):
    inserted = 0

    def __setitem__(self, key, value):
        self.inserted += 1
        super().__setitem__(key, value)


@pytest.mark.parametrize("bs,flags", [(64, 2 | 4), (256, 1 | 2)])
def test_device_table_kernel_equals_host_scalar_kernel_bitwise(device, monkeypatch, bs, flags):
    """The same float32 coefficients as host scalars (one launch per step count) and as a
    device table (one launch): the same bits; a steady-state step adds no address table."""
    from vefsdp_optim._kernels import _quant8_triton as qt

    ns = [333, 2 * bs + 1, 100, 16]
    steps = torch.tensor([5.0, 1.0, 5.0, 2.0], device=device)
    table = adam8bit_device_hparams(steps, lr=torch.tensor(3e-3), beta1=0.9, beta2=0.999, eps=1e-8,
                                    weight_decay=0.1)
    hps = [tuple(float(x) for x in row) for row in table.cpu()]
    tables = tuple(t.to(device) for t in (SIGNED, UNSIGNED, TableQuantizer(SIGNED).packed,
                                          TableQuantizer(UNSIGNED).packed))
    gen = torch.Generator().manual_seed(bs)
    init = [torch.randn(n, generator=gen).to(device) for n in ns]
    runs = {how: ([p.clone() for p in init], [_state(n, bs, device) for n in ns]) for how in ("host", "table")}
    monkeypatch.setattr(qt, "_tables", _CountingDict())  # a fresh cache, its insertions counted
    gs = [torch.empty(n, device=device) for n in ns]  # a steady state keeps its gradients' storage
    for step in (1, 2):
        for g, n in zip(gs, ns, strict=True):
            g.copy_(_grad(n, gen, step + 1))
        with _Backend("triton", interpret=torch.device(device).type == "cpu"), _Launches(qt) as spy:
            ps, ss = runs["host"]
            qt.run_triton_steps_(ps, gs, *(list(c) for c in zip(*ss, strict=True)), hps, [flags] * len(ns), bs,
                                 tables)
            assert spy.launches == 3  # three step counts
            ps, ss = runs["table"]
            qt.run_triton_capturable_steps_(ps, gs, *(list(c) for c in zip(*ss, strict=True)), table, flags, bs,
                                            tables)
            assert spy.launches == 4
        assert qt._tables.inserted == 4, step  # the first step's 4 address tables; none after: no copy
        for i in range(len(ns)):
            assert _equal(runs["host"][0][i], runs["table"][0][i]), (step, i)
            for x, y in zip(runs["host"][1][i], runs["table"][1][i], strict=True):
                assert _equal(x, y), (step, i)


def test_device_table_launcher_checks_its_arguments():
    from vefsdp_optim._kernels import _quant8_triton as qt

    p = [torch.zeros(8), torch.zeros(0)]
    s = _state(8, 4, "cpu")
    cols = [[t, t] for t in s]
    with pytest.raises(ValueError, match=r"hp must be a contiguous \(2, 8\) float32 tensor, got torch.float64"):
        qt.run_triton_capturable_steps_(p, p, *cols, torch.zeros(2, 8, dtype=torch.float64), 0, 4, ())
    with pytest.raises(ValueError, match=r"takes non-empty tensors .*got numels \[8, 0\]"):
        qt.run_triton_capturable_steps_(p, p, *cols, torch.zeros(2, 8), 0, 4, ())


def _opt_run(fused, steps=3, **kw):
    """AdamW8bit(capturable=True) on CPU parameters (the CPU let in), a tensor lr changed in
    place each step."""
    torch.manual_seed(0)
    ps = [nn.Parameter(torch.randn(s)) for s in [(70, 10), (333,), (10,), (3, 50)]]
    lr = torch.tensor(1e-2)
    with capturable_on_cpu():
        opt = vefsdp_optim.AdamW8bit(ps, lr=lr, min_8bit_size=100, block_size=64, capturable=True, fused=fused,
                                     **kw)
        gen = torch.Generator().manual_seed(1)
        for p in ps:
            p.grad = torch.empty_like(p)  # static gradients, as a captured step reads them
        for step in range(steps):
            lr.fill_(1e-2 * (1.0, 0.5, 0.25)[step])
            for p in ps:
                p.grad.copy_(torch.randn(p.shape, generator=gen))
            opt.step()
    return [p.detach().clone() for p in ps], opt


def test_optimizer_capturable_on_triton_equals_eager_bitwise(monkeypatch):
    """AdamW8bit(capturable=True) on the Triton kernel (forced, under the interpreter): one
    launch a step for its three 8-bit tensors, its address table built at the first step
    only (no host tensor copied in after it), the bits of its eager capturable step."""
    from vefsdp_optim._kernels import _quant8_triton as qt

    monkeypatch.setattr(qt, "_tables", _CountingDict())
    with _Backend("triton", interpret=True), _Launches(qt) as spy:
        got, opt = _opt_run(None)
        assert spy.launches == 3 and qt._tables.inserted == 1
        forced, _ = _opt_run(True)  # fused=True: the Triton kernel runs
        assert spy.launches == 6 and qt._tables.inserted == 2
    want, want_opt = _opt_run(False)
    for a, b, c in zip(got, forced, want, strict=True):
        assert _equal(a, c) and _equal(b, c)
    for st, wst in zip(opt.state.values(), want_opt.state.values(), strict=True):
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                assert _equal(v, wst[k]), k


def test_fused_true_capturable_needs_triton(monkeypatch):
    """fused=True with capturable=True: the C++ kernel takes host scalars, so where only it
    could run (the CPU without a forced Triton, or VEFSDP_ADAM8BIT_BACKEND=c) a
    RuntimeError names why; fused=None there runs the eager ops."""
    monkeypatch.delenv("VEFSDP_ADAM8BIT_BACKEND", raising=False)
    with capturable_on_cpu(), pytest.raises(
            RuntimeError, match=r"AdamW8bit\(fused=True, capturable=True\): fused=True with capturable=True "
                                r"needs the Triton kernel .*the tensors are on cpu"):
        vefsdp_optim.AdamW8bit([nn.Parameter(torch.zeros(300))], capturable=True, fused=True)
    monkeypatch.setenv("VEFSDP_ADAM8BIT_BACKEND", "c")
    with capturable_on_cpu(), pytest.raises(RuntimeError, match=r"VEFSDP_ADAM8BIT_BACKEND=c"):
        vefsdp_optim.Adam8bit([nn.Parameter(torch.zeros(300))], capturable=True, fused=True)
    got, _ = _opt_run(None, steps=2)  # the C++ kernel forced: the eager ops
    monkeypatch.delenv("VEFSDP_ADAM8BIT_BACKEND")
    want, _ = _opt_run(False, steps=2)
    for a, b in zip(got, want, strict=True):
        assert _equal(a, b)


def test_capturable_copies_step_with_the_eager_ops(monkeypatch):
    """bfloat16 parameters: the kernel would step a float32 copy made in each step, whose
    address differs between the eager warm-up steps and a capture (the kernel's address
    table is built on the host before it), so fused=None steps them with the eager ops,
    the same bits, no launch; fused=True names what it needs."""
    from vefsdp_optim._kernels import _quant8_triton as qt

    def run(fused):
        torch.manual_seed(0)
        ps = [nn.Parameter(torch.randn(s).to(torch.bfloat16)) for s in [(70, 10), (333,)]]
        with capturable_on_cpu():
            opt = vefsdp_optim.AdamW8bit(ps, lr=torch.tensor(1e-2), min_8bit_size=100, block_size=64,
                                         capturable=True, fused=fused)
            for step in range(2):
                for p in ps:
                    p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step)).to(p.dtype)
                opt.step()
        return [p.detach().clone() for p in ps]

    with _Backend("triton", interpret=True), _Launches(qt) as spy:
        got = run(None)
        assert spy.launches == 0
        with pytest.raises(ValueError, match="fused=True with capturable=True needs float32 contiguous"):
            run(True)
    want = run(False)
    for a, b in zip(got, want, strict=True):
        assert _equal(a, b)


def test_address_tables_under_capture(monkeypatch):
    """The kernel's address tables (see ``run_triton_steps_`` in vefsdp_optim/_kernels/_quant8_triton.py) with a capture
    under way (``stream_capturing`` patched: no CUDA graphs here): a table the warm-up built is
    kept for good once a capture reads it, even when the cache then drops its oldest; a
    table missing at the capture is a RuntimeError naming the warm-up, not a copy into a
    graph that would replay a freed buffer."""
    from vefsdp_optim._kernels import _quant8_triton as qt

    monkeypatch.setattr(qt, "_tables", {})
    monkeypatch.setattr(qt, "_captured", {})
    capturing = [False]
    monkeypatch.setattr(qt, "stream_capturing", lambda device: capturing[0])

    def tensors(n):
        return [tuple(torch.zeros(n, dtype=dt) for dt in (torch.float32, torch.float32, torch.uint8, torch.float32,
                                                          torch.uint8, torch.float32))]

    kept = tensors(64)
    first = qt._tensor_table(kept)  # the warm-up builds it
    capturing[0] = True
    assert qt._tensor_table(kept)[0] is first[0]  # the capture reads the same table
    capturing[0] = False
    others = [tensors(16 * (i + 1)) for i in range(qt._MAX_TABLES + 2)]  # kept alive: distinct addresses
    for ts in others:
        qt._tensor_table(ts)
    assert len(qt._tables) <= qt._MAX_TABLES
    assert qt._tensor_table(kept)[0] is first[0]  # dropped from the cache, kept for the graph
    capturing[0] = True
    with pytest.raises(RuntimeError, match="was not built before this CUDA graph capture: capture the step after "
                                           "eager warm-up steps"):
        qt._tensor_table(tensors(8))


def _sharded_capturable_triton_vs_one_device(kind):
    """On each rank: AdamW8bit(capturable=True) on the Triton kernel on its shards against
    the one-device capturable run on the eager ops, fed the same full gradients."""
    import torch.distributed as dist

    from vefsdp_optim._kernels import _quant8_triton as qt

    model = _Uneven()
    init = [p.detach().clone() for p in model.parameters()]
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    else:
        vefsdp_optim.fully_shard(model)
    ps = list(model.parameters())
    q = [nn.Parameter(t.clone()) for t in init]
    lr, lr_ref = torch.tensor(1e-2), torch.tensor(1e-2)
    kw = dict(weight_decay=0.1, block_size=64, min_8bit_size=100, capturable=True)
    x = torch.randn(8, 37, generator=torch.Generator().manual_seed(11 + dist.get_rank()))
    with capturable_on_cpu(), _Launches(qt) as spy:
        opt = vefsdp_optim.AdamW8bit(ps, lr=lr, **kw)
        ref = vefsdp_optim.AdamW8bit(q, lr=lr_ref, fused=False, **kw)
        for step in range(3):
            lr.fill_(1e-2 * 0.5**step)
            lr_ref.fill_(1e-2 * 0.5**step)
            opt.zero_grad()
            model(x).backward()  # each rank its own batch; the gradient is their average
            with _Backend("triton", interpret=True):
                opt.step()
            for qi, p in zip(q, ps, strict=True):
                qi.grad = p.grad.full_tensor().clone()
            ref.step()
    for p, qi in zip(ps, q, strict=True):
        assert torch.equal(p.full_tensor(), qi.detach()), tuple(p.shape)
    return spy.launches


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("kind", ["fsdp2", "fully_shard"])
def test_sharded_capturable_triton_bit_identical_to_one_device(kind, world_size):
    """Sharded at W = 2 and 3 on the Triton kernel: bit for bit the one-device eager
    capturable run."""
    launches = run_distributed(_sharded_capturable_triton_vs_one_device, world_size, kind)
    assert all(n >= 3 for n in launches), launches  # the Triton kernel ran on each rank's shards
