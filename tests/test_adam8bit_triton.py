"""The Triton 8-bit Adam kernel (see vefsdp_optim/_kernels/_quant8_triton.py) bit for bit against the C++
kernel and the eager ops, and the backend choice (see vefsdp_optim/_kernels/_backend.py).

On the CPU (the default) the Triton kernel runs under Triton's interpreter
(``TRITON_INTERPRET=1``), so the sizes stay small; with ``VEFSDP_TEST_DEVICE=cuda``
(``make gpu-check``) it runs compiled on the GPU, against the C++ kernel on CPU copies
and the eager ops on the GPU. Without triton installed these tests skip
(``pip install -e '.[triton]'``).
"""

import inspect
import logging
import os
import re

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from torch import nn

import vefsdp_optim
from vefsdp_optim._kernels import _backend as qb
from vefsdp_optim._kernels import _native as qf
from vefsdp_optim._math import adam8bit_block_step_, dynamic_code_map, quantize_blockwise

try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except Exception:  # noqa: BLE001 - any import failure: skip
    HAVE_TRITON = False

SIGNED, UNSIGNED = dynamic_code_map(True), dynamic_code_map(False)

# the interpreter's numpy divides NaN moments of the non-finite cases (zeroed afterwards)
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed: "
                                  "pip install 'torch==2.13.0' -e '.[triton]'")
needs_cxx = pytest.mark.skipif(qf._compiler() is None,
                               reason="no C++ compiler: the C++ kernel cannot be built here")


class _Backend:
    """Sets VEFSDP_ADAM8BIT_BACKEND (and on the CPU TRITON_INTERPRET) while entered."""

    def __init__(self, backend, interpret):
        self.env = {qb.BACKEND_ENV: backend, **({"TRITON_INTERPRET": "1"} if interpret else {})}

    def __enter__(self):
        self.saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _Spy:
    """Counts the tensors one backend's launcher steps while installed (the C++ one takes
    lists, the Triton one a tensor)."""

    def __init__(self, module, name):
        self.module, self.name, self.calls = module, name, 0
        self._orig = getattr(module, name)

    def __enter__(self):
        def spy(*a, **k):
            self.calls += len(a[0]) if isinstance(a[0], list | tuple) else 1
            return self._orig(*a, **k)

        setattr(self.module, self.name, spy)
        return self

    def __exit__(self, *exc):
        setattr(self.module, self.name, self._orig)


def _state(n, bs, device):
    z = torch.zeros(n)
    return [t.to(device) for t in (*quantize_blockwise(z, SIGNED, bs),
                                   *quantize_blockwise(z, UNSIGNED, bs))]


def _hp(bs, decoupled, wd, maximize, device):
    return dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=wd, decoupled=decoupled,
                block_size=bs, signed_code=SIGNED.to(device), unsigned_code=UNSIGNED.to(device),
                maximize=maximize)


def _step(backend, device, p, g, s, step, hp):
    """One step of ``backend`` on ``device`` (the tensors moved there and back)."""
    moved = [t.to(device) for t in (p, g, *s)]
    kw = dict(hp, signed_code=hp["signed_code"].to(device),
              unsigned_code=hp["unsigned_code"].to(device))
    if backend == "eager":
        adam8bit_block_step_(*moved, step=step, fused=False, **kw)
    else:
        with _Backend(backend, interpret=torch.device(device).type == "cpu"):
            adam8bit_block_step_(*moved, step=step, fused=True, **kw)
    for t, m in zip((p, g, *s), moved, strict=True):
        if m.data_ptr() != t.data_ptr():
            t.copy_(m)


def _equal(a, b):
    a, b = a.cpu(), b.cpu()
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.isnan(), b.isnan()) \
        and torch.equal(a.nan_to_num(), b.nan_to_num())


def _grad(n, gen, step):
    g = torch.randn(n, generator=gen) * 10.0 ** torch.randint(-6, 1, (n,), generator=gen)
    if step == 2:  # non-finite gradient elements: a NaN parameter, a zero moment
        g[n // 2] = float("nan")
        g[-1] = float("inf")
        g[0] = float("-inf")
    if step == 3:  # subnormal squares (g * g ~ 1e-44): no flush to zero anywhere
        g[::5] = 1e-22
    return g


@needs_triton
@needs_cxx
@pytest.mark.parametrize("n,bs,decoupled,wd,maximize,off64", [
    (5000, 256, True, 1e-2, False, False),  # 19 blocks and a short tail block of 136
    (5000, 256, True, 1e-2, False, True),  # the same with int64 offsets (tensors >= 2**30)
    (100, 256, False, 0.0, False, False),  # a parameter smaller than one block
    (333, 7, True, 0.0, False, False),  # block size 7 (padded to 8 in the tile), short tail
    (333, 7, True, 0.0, False, True),
    (64, 1, False, 0.5, True, False),  # block size 1, Adam's L2 term, maximize
    (2 * 2048 + 300, 2048, False, 0.1, False, False),  # block size 2048 (one block a program), Adam
])
def test_triton_equals_c_and_eager_bitwise(device, monkeypatch, n, bs, decoupled, wd, maximize, off64):
    gen = torch.Generator().manual_seed(n + bs)
    p = torch.randn(n, generator=gen)
    runs = {b: (p.clone(), _state(n, bs, "cpu")) for b in ("triton", "c", "eager")}
    where = {"triton": device, "c": "cpu", "eager": device}
    hp = _hp(bs, decoupled, wd, maximize, "cpu")
    from vefsdp_optim._kernels import _quant8_triton as qt

    if off64:  # the int64 offsets, which only tensors of 2**30 elements and more take
        monkeypatch.setattr(qt, "_OFF32_LIMIT", 0)
    with _Spy(qt, "run_triton_steps_") as spy:
        for step in range(1, 6):
            g = _grad(n, gen, step)
            for b, (pb, sb) in runs.items():
                _step(b, where[b], pb, g, sb, step, hp)
            for b in ("c", "eager"):
                assert _equal(runs["triton"][0], runs[b][0]), \
                    (b, step, int((runs["triton"][0] != runs[b][0]).sum()))
                for x, y in zip(runs["triton"][1], runs[b][1], strict=True):
                    assert _equal(x, y), (b, step)
    assert spy.calls == 5
    assert runs["triton"][0].isnan().any()  # the non-finite case ran


class _Launches:
    """Counts the Triton kernel's launches while installed."""

    def __init__(self, qt):
        self.qt, self.launches = qt, 0

    def __enter__(self):
        self._orig = self.qt._kernel
        spy = self

        class _Grid:
            def __getitem__(self, grid):
                spy.launches += 1
                return spy._orig()[grid]

        self.qt._kernel = _Grid
        return self

    def __exit__(self, *exc):
        self.qt._kernel = self._orig


@needs_triton
@pytest.mark.parametrize("bs", [7, pytest.param(64, marks=pytest.mark.slow)])
def test_triton_one_launch_for_many_tensors_bitwise(device, bs):
    """One launch for many tensors (``run_triton_steps_`` in
    vefsdp_optim/_kernels/_quant8_triton.py): uneven tensors (a block's tail, one shorter
    than a block, an empty one) in one launch per step count, the bits of one launch per
    tensor and of the eager ops (on ``device``: the GPU check runs it on CUDA)."""
    from vefsdp_optim._kernels import _quant8_triton as qt
    from vefsdp_optim._math import adam8bit_multi_tensor_step_

    ns = [333, 5, 0, 2 * bs + 1, 1, 100]
    gen = torch.Generator().manual_seed(bs)
    init = [torch.randn(n, generator=gen).to(device) for n in ns]
    runs = {how: ([p.clone() for p in init], [_state(n, bs, device) for n in ns]) for how in ("list", "each", "eager")}
    hp = _hp(bs, True, 1e-2, False, device)
    for step in (1, 2, 3):
        gs = [(_grad(n, gen, step) if n > 2 else torch.randn(n, generator=gen)).to(device) for n in ns]
        # the last two tensors a step behind: two step counts, two launches
        steps = [step] * 4 + [max(1, step - 1)] * 2
        with _Backend("triton", interpret=torch.device(device).type == "cpu"), _Launches(qt) as spy:
            ps, ss = runs["list"]
            adam8bit_multi_tensor_step_(ps, gs, ss, steps=steps, fused=True, **hp)
            assert spy.launches == (1 if step == 1 else 2)
            ps, ss = runs["each"]
            for p, g, s, t in zip(ps, gs, ss, steps, strict=True):
                adam8bit_block_step_(p, g, *s, step=t, fused=True, **hp)
        ps, ss = runs["eager"]
        for p, g, s, t in zip(ps, gs, ss, steps, strict=True):
            adam8bit_block_step_(p, g, *s, step=t, fused=False, **hp)
        for how in ("each", "eager"):
            for i in range(len(ns)):
                assert _equal(runs["list"][0][i], runs[how][0][i]), (how, step, i)
                for x, y in zip(runs["list"][1][i], runs[how][1][i], strict=True):
                    assert _equal(x, y), (how, step, i)
    assert runs["list"][0][0].isnan().any()  # the non-finite case ran


@needs_triton
@needs_cxx
def test_triton_bf16_param_and_grad(device):
    p = torch.randn(3, 100).bfloat16()
    g = torch.randn(3, 100).bfloat16()
    hp = _hp(64, True, 0.1, False, "cpu")
    got = {}
    for b, where in (("triton", device), ("c", "cpu"), ("eager", device)):
        pb, sb = p.clone(), _state(300, 64, "cpu")
        for step in (1, 2):
            _step(b, where, pb, g, sb, step, hp)
        got[b] = (pb, sb)
    for b in ("c", "eager"):
        assert got["triton"][0].dtype == torch.bfloat16 and _equal(got["triton"][0], got[b][0])
        for x, y in zip(got["triton"][1], got[b][1], strict=True):
            assert _equal(x, y)


@needs_triton
@pytest.mark.parametrize("block_size,off64,aligned,hp_on_device", [
    (256, False, True, False), (256, False, False, False), (7, False, False, False), (256, True, True, False),
    (256, False, True, True), (7, False, False, True)])  # the coefficients read from a device table
def test_triton_kernel_compiles_for_cuda_without_contraction(block_size, off64, aligned, hp_on_device):
    """Compiled for an H100 (sm_90) with Triton's own ptxas, no GPU needed: every multiply
    and add stays apart (no fma), division and square root are IEEE round-to-nearest, and
    nothing flushes subnormals to zero; an aligned launch loads and stores its float32 rows
    four elements at a time (see ``_adam8bit_step_kernel`` in
    vefsdp_optim/_kernels/_quant8_triton.py); the same with the coefficients of each row
    read on the device (see ``_adam8bit_step_kernel`` in
    vefsdp_optim/_kernels/_quant8_triton.py)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from vefsdp_optim._kernels import _quant8_triton as qt

    cfg = qt.launch_config(block_size)
    sig = {"ptrs": "*i64", "starts": "*i64", "numels": "*i64", "scode_ptr": "*fp32",
           "ucode_ptr": "*fp32", "stab_ptr": "*i32", "utab_ptr": "*i32", "hp_ptr": "*fp32", "T": "i32", "nb": "i32",
           "bs": "i32",
           **dict.fromkeys(("c_wd", "wd", "w1", "beta2", "w2", "bc2", "eps", "neg_step",
                            "FLT_MAX"), "fp32"),
           **dict.fromkeys(("MAXIMIZE", "WD_MODE", "ROWS", "BLOCK", "OFF64", "LOG_T", "ALIGNED", "HP_ON_DEVICE"),
                           "constexpr")}
    # as Triton specializes a launch: pointers and a block size of 256 divisible by 16
    names = list(inspect.signature(qt._adam8bit_step_kernel).parameters)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in sig
             if sig[n].startswith("*") or (n == "bs" and block_size % 16 == 0)}
    src = ASTSource(fn=triton.jit(qt._adam8bit_step_kernel), signature=sig, attrs=attrs,
                    constexprs={"MAXIMIZE": True, "WD_MODE": 2, "ROWS": cfg["ROWS"],
                                "BLOCK": cfg["BLOCK"], "OFF64": off64, "LOG_T": 3, "ALIGNED": aligned,
                                "HP_ON_DEVICE": hp_on_device})
    try:
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": cfg["num_warps"], "enable_fp_fusion": False})
    except Exception as e:  # noqa: BLE001 - e.g. no ptxas for this platform in the wheel
        pytest.skip(f"triton cannot compile for sm_90 here: {type(e).__name__}: {e}")
    ptx = k.asm["ptx"]
    assert not re.search(r"\bfma\.", ptx)
    assert re.search(r"\bmul\.rn\.f32", ptx) and re.search(r"\badd\.rn\.f32", ptx)
    assert re.search(r"\bdiv\.rn\.f32", ptx) and re.search(r"\bsqrt\.rn\.f32", ptx)
    assert not re.search(r"div\.(full|approx)|sqrt\.approx|\.ftz", ptx)
    vector = re.search(r"\bld\.global(\.\w+)*\.v4\.b32", ptx) and re.search(r"\bst\.global(\.\w+)*\.v4\.b32", ptx)
    assert bool(vector) == aligned, re.findall(r"\b(?:ld|st)\.global\S*", ptx)


# -- the backend choice ---------------------------------------------------------------

def _opt_run(steps=2, **kw):
    torch.manual_seed(0)
    ps = [nn.Parameter(torch.randn(s)) for s in [(70, 10), (333,), (10,)]]
    opt = vefsdp_optim.AdamW8bit(ps, min_8bit_size=200, block_size=64, **kw)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return [p.detach() for p in ps]


def test_bad_backend_value_raises(monkeypatch):
    monkeypatch.setenv(qb.BACKEND_ENV, "cuda")
    msg = r"VEFSDP_ADAM8BIT_BACKEND must be one of 'triton', 'c', 'eager' .*got 'cuda'"
    with pytest.raises(ValueError, match=msg):
        vefsdp_optim.AdamW8bit([nn.Parameter(torch.zeros(300))])
    with pytest.raises(ValueError, match=msg):
        adam8bit_block_step_(torch.zeros(8), torch.ones(8), *_state(8, 4, "cpu"), step=1,
                             **_hp(4, True, 0.0, False, "cpu"))


@needs_cxx
def test_backend_env_var_forces_each_path(monkeypatch):
    from vefsdp_optim._kernels import _quant8_triton as qt

    want = _opt_run(fused=False)
    for backend, c_calls, t_calls in (("c", 4, 0), ("eager", 0, 0), ("C ", 4, 0)):
        monkeypatch.setenv(qb.BACKEND_ENV, backend)
        with _Spy(qf, "run_fused_steps_") as c, _Spy(qt, "run_triton_steps_") as t:
            got = _opt_run()
        assert (c.calls, t.calls) == (c_calls, t_calls), backend
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    if HAVE_TRITON:
        monkeypatch.setenv(qb.BACKEND_ENV, "triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        with _Spy(qf, "run_fused_steps_") as c, _Spy(qt, "run_triton_steps_") as t:
            got = _opt_run()
        assert (c.calls, t.calls) == (0, 4)  # 2 steps of 2 8-bit tensors
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        why = "TRITON_INTERPRET=1"
    else:
        monkeypatch.setenv(qb.BACKEND_ENV, "triton")
        why = "triton is not importable"
    with pytest.raises(RuntimeError, match=f"VEFSDP_ADAM8BIT_BACKEND=triton but .*{why}"):
        _opt_run()


@needs_cxx
def test_default_backend_is_logged_once(monkeypatch, caplog):
    monkeypatch.delenv(qb.BACKEND_ENV, raising=False)
    monkeypatch.setattr(qb, "_logged", set())
    with caplog.at_level(logging.INFO, logger=qb.__name__):
        _opt_run(steps=3)
    lines = [r.getMessage() for r in caplog.records if r.name == qb.__name__]
    assert lines == ["8-bit Adam on cpu tensors: c backend (the best available)"]


def test_default_on_cuda_is_triton_else_eager_with_a_reason(monkeypatch, caplog):
    """The choice for CUDA tensors, made without a GPU (it reads no tensor)."""
    from vefsdp_optim._kernels import _quant8_triton as qt

    monkeypatch.delenv(qb.BACKEND_ENV, raising=False)
    monkeypatch.setattr(qb, "_logged", set())
    if HAVE_TRITON:
        assert qb.select_backend("cuda", 256) == "triton"
        assert qb.select_backend("cuda", qt.MAX_BLOCK + 1) == "eager"  # no tile that large
        assert "block_size <= 4096" in caplog.text
    monkeypatch.setattr(qb, "_logged", set())
    monkeypatch.setattr(qt, "_triton", lambda: None)
    monkeypatch.setattr(qt, "_import_error", "triton is not importable (test)")
    with caplog.at_level(logging.WARNING, logger=qb.__name__):
        assert qb.select_backend("cuda", 256) == "eager"
        with pytest.raises(RuntimeError, match="fused=True but triton: triton is not importable"):
            qb.select_backend("cuda", 256, fused=True)
    assert "eager backend (triton: triton is not importable (test); c: the C++ kernel runs on " \
           "CPU tensors, got cuda tensors)" in caplog.text


# -- sharded at W = 2 against a single device fed the same averaged gradients ----------

BS, MIN8 = 256, 100


class _Uneven(nn.Module):
    """a.weight 11100 elements (43 blocks + 92), a.bias 300 (1 + 44), b.weight 5100
    (19 + 236), s 140 (smaller than a block, 8-bit), b.bias 17 (fp32 moments)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.a = nn.Linear(37, 300)
        self.b = nn.Linear(300, 17)
        self.s = nn.Parameter(torch.randn(7, 20) * 0.1)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(h).square().mean() + (h[:, :20] @ self.s.t()).square().mean()


def _sharded_triton_vs_single_device(kind, name):
    from vefsdp_optim._kernels import _quant8_triton as qt

    rank, w = dist.get_rank(), dist.get_world_size()
    model = _Uneven()
    init = [p.detach().clone() for p in model.parameters()]
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (w,)))
    else:
        vefsdp_optim.fully_shard(model)
    ps = list(model.parameters())
    cls = vefsdp_optim.get_optimizer(name)
    kw = dict(lr=1e-2, weight_decay=0.1, block_size=BS, min_8bit_size=MIN8)
    opt = cls(ps, **kw)
    refs = {}
    for backend in ("c", "eager"):  # one device: the C++ kernel and the eager ops
        q = [nn.Parameter(t.clone()) for t in init]
        refs[backend] = (q, cls(q, fused=backend != "eager", **kw))
    x = torch.randn(8, 37, generator=torch.Generator().manual_seed(11 + rank))
    with _Spy(qt, "run_triton_steps_") as spy:
        for _ in range(3):
            opt.zero_grad()
            model(x).backward()  # each rank its own batch; the gradient is their average
            with _Backend("triton", interpret=True):
                opt.step()
            for backend, (q, ref) in refs.items():
                for qi, p in zip(q, ps, strict=True):
                    qi.grad = p.grad.full_tensor().clone()
                with _Backend(backend, interpret=False):
                    ref.step()
    got = [p.full_tensor() for p in ps]
    for q, _ in refs.values():
        for a, b in zip(got, q, strict=True):
            assert torch.equal(a, b.detach()), (tuple(a.shape), (a - b).abs().max())
    return spy.calls, [not torch.equal(a, b) for a, b in zip(got, init, strict=True)]


@needs_triton
@needs_cxx
# FSDP2 in the slow tier: ~5 s of Triton's interpreter each on 2 cores; the Triton kernel's
# code path past the layout is one, and test_adam8bit covers FSDP2's row cuts quickly
@pytest.mark.parametrize("kind", [pytest.param("fsdp2", marks=pytest.mark.slow), "fully_shard"])
def test_sharded_triton_bit_identical_to_single_device(kind):
    for name in ("adamw8bit", "adam8bit"):
        results = run_distributed(_sharded_triton_vs_single_device, 2, kind, name)
        assert all(all(moved) for _, moved in results)
        assert sum(calls for calls, _ in results) >= 3 * 4  # the Triton kernel ran on shards
