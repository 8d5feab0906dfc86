"""The fused 8-bit Adam kernel (see vefsdp_optim/_kernels/_native.py): the same bits as the eager
torch ops, on whole tensors and on runs of blocks, the eager fallback where the kernel
is off or cannot be built, and bit-identity of sharded runs (FSDP2 and fully_shard,
W = 2 and 3, uneven shapes) with a single-device run fed the same averaged gradients.
"""

import logging
import platform
import shutil

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from torch import nn

import vefsdp_optim
from vefsdp_optim._kernels import BACKEND_ENV
from vefsdp_optim._kernels import _native as qf
from vefsdp_optim._math import adam8bit_block_step_, dynamic_code_map, quantize_blockwise

SIGNED, UNSIGNED = dynamic_code_map(True), dynamic_code_map(False)

needs_cc = pytest.mark.skipif(qf._compiler() is None and shutil.which("cc") is None,
                              reason="no C compiler: the fused kernel cannot be built here")


def _state(n, bs):
    z = torch.zeros(n)
    return [*quantize_blockwise(z, SIGNED, bs), *quantize_blockwise(z, UNSIGNED, bs)]


def _equal(a, b):
    return a.shape == b.shape and torch.equal(a.nan_to_num(), b.nan_to_num()) and \
        torch.equal(a.isnan(), b.isnan())


def _hp(bs, decoupled, wd, maximize):
    return dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=wd, decoupled=decoupled,
                block_size=bs, signed_code=SIGNED, unsigned_code=UNSIGNED, maximize=maximize)


class _Spy:
    """Counts the kernel's calls (run_fused_steps_) and the tensors they step while installed."""

    def __init__(self):
        self.calls = self.tensors = 0
        self._orig = qf.run_fused_steps_

    def __enter__(self):
        def spy(*a, **k):
            self.calls += 1
            self.tensors += len(a[0])
            return self._orig(*a, **k)

        qf.run_fused_steps_ = spy
        return self

    def __exit__(self, *exc):
        qf.run_fused_steps_ = self._orig


@needs_cc
@pytest.mark.parametrize("n,bs,decoupled,wd,maximize", [
    (70001, 256, True, 1e-2, False),  # short last block
    (1001, 64, False, 0.1, True),  # Adam's L2 term, maximize
    (333, 7, True, 0.0, False),  # block size not a multiple of any vector width
    (100, 256, False, 0.0, False),  # smaller than one block
    (64, 1, True, 0.5, True),
])
def test_kernel_equals_eager_bitwise(n, bs, decoupled, wd, maximize):
    gen = torch.Generator().manual_seed(n)
    p = torch.randn(n, generator=gen)
    pe = p.clone()
    s, se = _state(n, bs), _state(n, bs)
    with _Spy() as spy:
        for step in range(1, 7):
            g = torch.randn(n, generator=gen) * 10.0 ** torch.randint(-6, 1, (n,), generator=gen)
            if step == 3:  # non-finite gradient elements: NaN parameter, zero moment
                g[n // 2] = float("nan")
                g[-1] = float("inf")
            if step == 4:
                g[: min(n, bs)] = 0.0  # a block whose moments decay toward zero
            adam8bit_block_step_(p, g, *s, step=step, fused=True, **_hp(bs, decoupled, wd, maximize))
            adam8bit_block_step_(pe, g, *se, step=step, fused=False, **_hp(bs, decoupled, wd, maximize))
            assert _equal(p, pe), (step, (p != pe).sum())
            for a, b in zip(s, se, strict=True):
                assert torch.equal(a, b), step
    assert spy.calls == 6
    assert p.isnan().sum() >= 1 and s[1].abs().min() >= 0  # the non-finite case ran


def _hard_grad(n, bs, step, gen):
    """Gradients over many decades per block, with NaN / inf, subnormal, huge and zero
    blocks, so that moments' scales span subnormal to near-overflow values."""
    g = torch.randn(n, generator=gen) * 10.0 ** torch.randint(-8, 1, (n,), generator=gen)
    nb = -(-n // bs)
    blocks = torch.randperm(nb, generator=gen)[: max(1, nb // 8)]
    for k, b in enumerate(blocks.tolist()):
        lo, hi = b * bs, min(n, (b + 1) * bs)
        g[lo:hi] *= (1e-41, 1e30, 0.0, 1e-38)[k % 4]  # subnormal, huge, zero, near FLT_MIN
    if step == 2:
        g[torch.randint(0, n, (17,), generator=gen)] = float("nan")
        g[torch.randint(0, n, (17,), generator=gen)] = float("inf")
        g[torch.randint(0, n, (17,), generator=gen)] = -float("inf")
    return g


@needs_cc
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("bs,decoupled,wd,maximize", [
    (1, True, 0.1, False), (7, False, 0.1, True), (256, True, 1e-2, False), (2048, False, 0.0, False)])
def test_kernel_threads_equal_eager_bitwise(threads, bs, decoupled, wd, maximize):
    """Threads over blocks (``adam8bit_steps_cpu`` in
    vefsdp_optim/_kernels/csrc/quant8_adam_op.cpp): at 1, 2 and 3 intra-op threads the
    kernel gives the eager ops' bits (a size with a short last block, split across
    threads at any block size); moments from the whole float range exercise ``QPlan``
    in vefsdp_optim/_kernels/csrc/quant8_adam.cpp, including its exact fallbacks."""
    n = 200_003
    gen = torch.Generator().manual_seed(bs)
    p = torch.randn(n, generator=gen)
    pe = p.clone()
    s, se = _state(n, bs), _state(n, bs)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for step in range(1, 5):
            g = _hard_grad(n, bs, step, gen)
            adam8bit_block_step_(p, g, *s, step=step, fused=True, **_hp(bs, decoupled, wd, maximize))
            adam8bit_block_step_(pe, g, *se, step=step, fused=False, **_hp(bs, decoupled, wd, maximize))
            assert _equal(p, pe), (step, (p != pe).sum())
            for a, b in zip(s, se, strict=True):
                assert torch.equal(a, b), step
    finally:
        torch.set_num_threads(saved)


@needs_cc
@pytest.mark.parametrize("fused", [True, False])
def test_block_runs_equal_whole_tensor(fused):
    """Runs of whole blocks (as shards hand them to the kernel) give the whole tensor's bits."""
    gen = torch.Generator().manual_seed(9)
    n, bs = 5000, 256  # 19 full blocks and one of 136
    p_whole = torch.randn(n, generator=gen)
    p_runs = p_whole.clone()
    s_whole, s_runs = _state(n, bs), _state(n, bs)
    runs = [(0, 1), (1, 8), (8, 19), (19, 20)]  # in blocks; the last one is the short block
    for step in range(1, 5):
        g = torch.randn(n, generator=gen)
        adam8bit_block_step_(p_whole, g, *s_whole, step=step, fused=fused, **_hp(bs, True, 0.1, False))
        for a, b in runs:
            lo, hi = a * bs, min(b * bs, n)
            sl = [s_runs[0][lo:hi], s_runs[1][a:b], s_runs[2][lo:hi], s_runs[3][a:b]]
            adam8bit_block_step_(p_runs[lo:hi], g[lo:hi], *sl, step=step, fused=fused,
                                 **_hp(bs, True, 0.1, False))
    assert torch.equal(p_whole, p_runs)
    for a, b in zip(s_whole, s_runs, strict=True):
        assert torch.equal(a, b)


@needs_cc
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("fused", [True, False])
def test_multi_tensor_step_equals_one_call_per_tensor(threads, fused):
    """One call for many tensors (``adam8bit_steps_cpu`` in
    vefsdp_optim/_kernels/csrc/quant8_adam_op.cpp): adam8bit_multi_tensor_step_ gives each
    tensor the bits of its own adam8bit_block_step_: tensors of uneven sizes (short last
    blocks, an empty one, one smaller than a block), their own step counts, a bfloat16
    parameter and a non-contiguous absmax, on runs of blocks that span tensors at 2 and 3
    threads."""
    from vefsdp_optim._math import adam8bit_multi_tensor_step_

    bs = 256
    sizes = [70_001, 0, 100, 90_000, 30_003]  # 752 blocks: runs of 256 blocks a thread
    gen = torch.Generator().manual_seed(5)
    ps = [torch.randn(n, generator=gen) for n in sizes]
    ps[3] = ps[3].bfloat16()
    refs = [p.clone() for p in ps]
    states = [_state(n, bs) for n in sizes]
    ref_states = [[t.clone() for t in st] for st in states]
    wide = torch.zeros(-(-sizes[4] // bs), 2)
    states[4][3] = wide[:, 0]  # tensor 4's exp_avg_sq absmax: a non-contiguous view
    steps = [3, 1, 7, 2, 5]
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for k in range(3):
            gs = [_hard_grad(max(n, 1), bs, k + 1, gen)[:n] for n in sizes]
            gs[3] = gs[3].bfloat16()
            now = [s + k for s in steps]
            adam8bit_multi_tensor_step_(ps, gs, states, steps=now, fused=fused, **_hp(bs, True, 1e-2, False))
            for p, g, st, step in zip(refs, gs, ref_states, now, strict=True):
                adam8bit_block_step_(p, g, *st, step=step, fused=fused, **_hp(bs, True, 1e-2, False))
            for i in range(len(sizes)):
                assert _equal(ps[i].float(), refs[i].float()), (k, i)
                for a, b in zip(states[i], ref_states[i], strict=True):
                    assert torch.equal(a, b), (k, i)
    finally:
        torch.set_num_threads(saved)
    assert not torch.equal(states[4][3], torch.zeros_like(states[4][3]))  # written through the view


def test_multi_tensor_step_rejects_mismatched_lists():
    from vefsdp_optim._math import adam8bit_multi_tensor_step_

    p, g = torch.zeros(300), torch.zeros(300)
    with pytest.raises(ValueError, match="one entry per tensor"):
        adam8bit_multi_tensor_step_([p], [g], [_state(300, 256)], steps=[1, 2], **_hp(256, True, 0.0, False))
    with pytest.raises(ValueError, match="4 tensors"):
        adam8bit_multi_tensor_step_([p], [g], [_state(300, 256)[:3]], steps=[1], **_hp(256, True, 0.0, False))
    with pytest.raises(ValueError, match="step must be an int >= 1"):
        adam8bit_multi_tensor_step_([p], [g], [_state(300, 256)], steps=[True], **_hp(256, True, 0.0, False))


@needs_cc
def test_kernel_bf16_param_and_grad():
    p = torch.randn(3, 100).bfloat16()
    pe = p.clone()
    s, se = _state(300, 64), _state(300, 64)
    g = torch.randn(3, 100).bfloat16()
    adam8bit_block_step_(p, g, *s, step=1, fused=True, **_hp(64, True, 0.1, False))
    adam8bit_block_step_(pe, g, *se, step=1, fused=False, **_hp(64, True, 0.1, False))
    assert p.dtype == torch.bfloat16 and torch.equal(p, pe)


def _opt_run(fused, steps=3, **kw):
    torch.manual_seed(0)
    ps = [nn.Parameter(torch.randn(s)) for s in [(70, 100), (333,), (10, 10)]]
    opt = vefsdp_optim.AdamW8bit(ps, min_8bit_size=200, block_size=64, fused=fused, **kw)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return [p.detach() for p in ps]


@needs_cc
def test_optimizer_uses_kernel_by_default_and_env_var_turns_it_off(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    # the switch before VEFSDP_ADAM8BIT_BACKEND is gone, not an alias: it changes nothing
    monkeypatch.setenv("VEFSDP_ADAM8BIT_FUSED", "0")
    with _Spy() as spy:
        got = _opt_run(None)
    # two 8-bit tensors (the 10x10 one keeps fp32 moments), one kernel call a step
    assert (spy.calls, spy.tensors) == (3, 3 * 2)
    monkeypatch.setenv(BACKEND_ENV, "eager")
    with _Spy() as spy:
        off = _opt_run(None)
        forced = _opt_run(True)  # fused=True wins over the environment variable
    assert (spy.calls, spy.tensors) == (3, 3 * 2)
    for a, b, c in zip(got, off, forced, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_eager_fallback_when_the_kernel_cannot_be_built(monkeypatch, caplog):
    """No compiler: a logged reason, the eager ops, the same bits; fused=True raises."""
    want = _opt_run(False)

    def no_compiler():
        raise RuntimeError("no C compiler found ($CC, cc, gcc, clang)")

    monkeypatch.setattr(qf, "_build", no_compiler)
    monkeypatch.setattr(qf, "_tried", False)
    monkeypatch.setattr(qf, "_kernel", None)
    monkeypatch.setattr(qf, "_reason", None)
    with caplog.at_level(logging.WARNING, logger=qf.__name__), _Spy() as spy:
        got = _opt_run(None)
    assert spy.calls == 0
    assert "no C compiler found" in caplog.text and "eager" in caplog.text
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="fused=True.*no C compiler found"):
        vefsdp_optim.AdamW8bit([nn.Parameter(torch.zeros(300))], fused=True)
    with pytest.raises(RuntimeError, match="fused=True but .*no C compiler found"):
        adam8bit_block_step_(torch.zeros(8), torch.ones(8), *_state(8, 4), step=1, fused=True,
                             **_hp(4, True, 0.0, False))


def test_bad_fused_argument_raises():
    for bad in (1, "yes", 0.0):
        with pytest.raises(ValueError, match=f"fused must be None, True or False, got {bad!r}"):
            vefsdp_optim.Adam8bit([nn.Parameter(torch.zeros(3))], fused=bad)


# -- sharded runs against a single device fed the same averaged gradients -------------

BS, MIN8 = 256, 100


class _Uneven(nn.Module):
    """a.weight 11100 elements (43 blocks + 92), a.bias 300 (1 block + 44), b.weight 5100
    (19 + 236), s 140 (smaller than one block, 8-bit), b.bias 17 (fp32 moments)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.a = nn.Linear(37, 300)
        self.b = nn.Linear(300, 17)
        self.s = nn.Parameter(torch.randn(7, 20) * 0.1)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(h).square().mean() + (h[:, :20] @ self.s.t()).square().mean()


def _sharded_vs_single_device(kind, name):
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
    opt = cls(ps, fused=True, **kw)
    refs = []
    for fused in (True, False):  # the same kernel on one device, and the eager ops
        q = [nn.Parameter(t.clone()) for t in init]
        refs.append((q, cls(q, fused=fused, **kw)))
    x = torch.randn(8, 37, generator=torch.Generator().manual_seed(11 + rank))
    calls = 0  # tensors the sharded optimizer's kernel calls stepped on this rank
    with _Spy() as spy:
        for _ in range(3):
            opt.zero_grad()
            model(x).backward()  # each rank its own batch; the gradient is their average
            before = spy.tensors
            opt.step()
            calls += spy.tensors - before
            for q, ref in refs:
                for qi, p in zip(q, ps, strict=True):
                    qi.grad = p.grad.full_tensor().clone()
                ref.step()
    got = [p.full_tensor() for p in ps]
    for q, _ in refs:
        for a, b in zip(got, q, strict=True):
            assert torch.equal(a, b.detach()), (tuple(a.shape), (a - b).abs().max())
    moved = [not torch.equal(a, b) for a, b in zip(got, init, strict=True)]
    return calls, moved


@needs_cc
@pytest.mark.parametrize("kind", ["fsdp2", "fully_shard"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_sharded_fused_bit_identical_to_single_device(kind, world_size):
    for name in ("adamw8bit", "adam8bit"):
        results = run_distributed(_sharded_vs_single_device, world_size, kind, name)
        assert all(all(moved) for _, moved in results)
        assert sum(calls for calls, _ in results) >= 3 * 4  # the kernel ran on the shards


@pytest.mark.parametrize("signed", [True, False])
def test_packed_bucket_table_gives_the_reference_codes(signed):
    """The packed bucket table (``_pack_buckets`` in
    vefsdp_optim/_math/_quant8.py), evaluated with torch ops, against
    quantize_blockwise's binary search on values at, just above and just
    below every midpoint."""
    from vefsdp_optim._math import TableQuantizer

    code = dynamic_code_map(signed)
    mid = (code[:-1] + code[1:]) / 2
    x = torch.cat([code, mid, torch.nextafter(mid, torch.tensor(2.0)),
                   torch.nextafter(mid, torch.tensor(-2.0)), torch.tensor([0.0, -0.0]),
                   torch.rand(5000, generator=torch.Generator().manual_seed(3)) * 2 - 1])
    x = x.clamp(-1, 1) if signed else x.abs().clamp(0, 1)
    packed = TableQuantizer(code).packed.to(torch.int64) & 0xFFFFFFFF
    u = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    e = packed[u >> 16]
    xl, t = u & 0xFFFF, e & 0xFFFF
    up = torch.where(u >> 31 == 1, xl < t, xl > t)
    want = torch.searchsorted(mid, x)  # the reference rule: midpoints strictly below x
    assert torch.equal((e >> 16) + up.long(), want)


def _fresh_build(monkeypatch, tmp_path, arch_flag: str) -> None:
    """Build the kernel anew with ``arch_flag`` in place of -march=native, into a fresh
    cache, and make it the one the step runs."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(qf, "_NATIVE", arch_flag)
    monkeypatch.setattr(qf, "_tried", False)
    monkeypatch.setattr(qf, "_kernel", None)
    assert qf.fused_kernel() is not None, qf.fused_unavailable_reason()
    assert len(list(tmp_path.rglob("adam8bit_*.so"))) == 1  # really a fresh build


@pytest.mark.slow  # a fresh C++ build, ~10 s: the fast tier keeps the native build's tests
@needs_cc
def test_portable_build_gives_the_same_bits(monkeypatch, tmp_path):
    """The kernel built without AVX-512 (the portable C loops only) equals the eager ops
    and so the AVX-512 build: the instruction set changes the speed, never the bits."""
    _fresh_build(monkeypatch, tmp_path, "-mno-avx512f")
    test_kernel_equals_eager_bitwise(1001, 64, False, 0.1, True)
    test_kernel_equals_eager_bitwise(70001, 256, True, 1e-2, False)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(ln.split(":", 1)[1].split()) for ln in f if ln.startswith("flags")), set())
    except OSError:
        return set()


@needs_cc
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 only: AVX2")
@pytest.mark.skipif("avx2" in _cpu_flags() and "avx512f" not in _cpu_flags(),
                    reason="this CPU has AVX2 and no AVX-512: the native build the other tests "
                    "use is the AVX2 build")
@pytest.mark.slow  # a fresh C++ build, ~10 s
def test_avx2_build_gives_the_same_bits(monkeypatch, tmp_path):
    """The kernel built for AVX2 without AVX-512 (the 8-lane paths: gathers for the code
    maps, vector masks) equals the eager ops, also where the CPU has AVX-512; on a CPU
    without AVX2 the build falls back to the portable loops and this still holds."""
    _fresh_build(monkeypatch, tmp_path, "-march=haswell")
    test_kernel_equals_eager_bitwise(70001, 256, True, 1e-2, False)
    test_kernel_equals_eager_bitwise(333, 7, True, 0.0, False)
    test_kernel_threads_equal_eager_bitwise(2, 256, True, 1e-2, False)
