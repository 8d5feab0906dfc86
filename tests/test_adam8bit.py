"""AdamW8bit / Adam8bit: bit-identical to their single-device run on sharded params.

References are unsharded: the whole-tensor 8-bit step (``adam8bit_block_step_`` on the
full parameter), the optimizer on plain full tensors (W=1), and torch.optim.AdamW /
Adam for closeness. Sharded runs feed the same full gradients as the reference.
"""

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from torch import nn

import vefsdp_optim
from vefsdp_optim._adam8bit import Adam8bit, AdamW8bit
from vefsdp_optim._math import adam8bit_block_step_, dynamic_code_map, quantize_blockwise

# (7, 300): Shard(0) boundaries at 300-multiples, not block multiples; (1, 600): one
# row; (33, 40): uneven rows; (5000,): 1-D with a short last block; (3, 5) and (10, 20):
# below min_8bit_size, fp32 moments.
SHAPES = [(7, 300), (1, 600), (33, 40), (5000,), (3, 5), (10, 20)]
STEPS = 3
CASES = [
    ("adamw8bit", dict(min_8bit_size=256)),
    ("adamw8bit", dict(block_size=64, lr=0.01, betas=(0.8, 0.9), eps=1e-6, min_8bit_size=100)),
    ("adam8bit", dict(weight_decay=0.1, min_8bit_size=256)),
    ("adamw8bit", dict()),  # default min_8bit_size: only (5000,) is 8-bit
]


def _params(seed=0, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in shapes]


def _grads(step, shapes=SHAPES):
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(s, generator=g) for s in shapes]


def _cls(name):
    return vefsdp_optim.get_optimizer(name)


def _run_plain(name, kw, shapes=SHAPES):
    """The single-device run: the optimizer on plain full tensors."""
    ps = [nn.Parameter(t.clone()) for t in _params(shapes=shapes)]
    opt = _cls(name)(ps, **kw)
    for step in range(STEPS):
        for p, gr in zip(ps, _grads(step, shapes), strict=True):
            p.grad = gr
        opt.step()
    return [p.detach().clone() for p in ps], opt


def _whole_tensor_reference(name, kw, shapes=SHAPES):
    """Independent of the optimizer class: the pure 8-bit step on each whole parameter,
    torch.optim for the fp32-rule tensors."""
    bs = kw.get("block_size", 256)
    min_size = kw.get("min_8bit_size", 4096)
    decoupled = name == "adamw8bit"
    lr, (b1, b2), eps = kw.get("lr", 1e-3), kw.get("betas", (0.9, 0.999)), kw.get("eps", 1e-8)
    wd = kw.get("weight_decay", 1e-2 if decoupled else 0.0)
    signed, unsigned = dynamic_code_map(True), dynamic_code_map(False)
    out = []
    for i, t in enumerate(_params(shapes=shapes)):
        p = t.clone().reshape(-1)
        if p.numel() < min_size:
            q = nn.Parameter(t.clone())
            topt = (torch.optim.AdamW if decoupled else torch.optim.Adam)(
                [q], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, foreach=True)
            for step in range(STEPS):
                q.grad = _grads(step, shapes)[i]
                topt.step()
            out.append(q.detach())
            continue
        zero = torch.zeros_like(p)
        mc, ma = quantize_blockwise(zero, signed, bs)
        vc, va = quantize_blockwise(zero, unsigned, bs)
        for step in range(STEPS):
            adam8bit_block_step_(
                p, _grads(step, shapes)[i].reshape(-1), mc, ma, vc, va, step=step + 1, lr=lr,
                beta1=b1, beta2=b2, eps=eps, weight_decay=wd, decoupled=decoupled,
                block_size=bs, signed_code=signed, unsigned_code=unsigned)
        out.append(p.view(t.shape))
    return out


def _assert_equal(got, want):
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        assert torch.equal(a, b), (a.shape, (a - b).abs().max())


# -- single process ---------------------------------------------------------------------


@pytest.mark.parametrize("name,kw", CASES)
def test_single_device_equals_whole_tensor_math(name, kw):
    got, _ = _run_plain(name, kw)
    _assert_equal(got, _whole_tensor_reference(name, kw))


@pytest.mark.parametrize("signed", [True, False])
def test_table_quantizer_equals_quantize_blockwise(signed):
    from vefsdp_optim._math import TableQuantizer as _TableQuantizer

    code = dynamic_code_map(signed)
    tq = _TableQuantizer(code)
    mid = (code[:-1] + code[1:]) / 2
    g = torch.Generator().manual_seed(2)
    n = 20001
    wide = torch.randn(n, generator=g) * 10.0 ** torch.randint(-9, 2, (n,), generator=g).float()
    ties = torch.cat([code, mid, -mid, torch.nextafter(mid, torch.tensor(2.0)),
                      torch.nextafter(mid, torch.tensor(-2.0)), torch.tensor([0.0, -0.0, 1.0, -1.0])])
    for x in (wide, ties, torch.zeros(300)):
        x = x if signed else x.abs()
        for bs in (256, 7, 1, 4096):
            want, got = quantize_blockwise(x, code, bs), tq(x, bs)
            assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1]), bs


def test_close_to_fp32_but_not_equal():
    """8-bit moments change the bits (the path is really quantized) but stay close."""
    got, opt = _run_plain("adamw8bit", dict(min_8bit_size=256))
    ps = [nn.Parameter(t.clone()) for t in _params()]
    ref = torch.optim.AdamW(ps)
    for step in range(STEPS):
        for p, gr in zip(ps, _grads(step), strict=True):
            p.grad = gr
        ref.step()
    for a, b, s in zip(got, ps, SHAPES, strict=True):
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=3e-4)
        if a.numel() >= 256:
            assert not torch.equal(a, b), s


def test_quantization_rule_uses_global_numel():
    _, opt = _run_plain("adamw8bit", dict(min_8bit_size=256))
    for p in opt.param_groups[0]["params"]:
        st = opt.state[p]
        if p.numel() >= 256:
            assert st["exp_avg_codes"].dtype == torch.uint8 and "exp_avg" not in st
            assert st["exp_avg_sq_codes"].dtype == torch.uint8
        else:
            assert st["exp_avg"].dtype == torch.float32 and "exp_avg_codes" not in st


def test_state_bytes_per_parameter():
    shapes = [(512, 512), (1000, 301), (70001,)]
    ps = [nn.Parameter(torch.randn(s)) for s in shapes]
    opt = AdamW8bit(ps)  # block_size 256
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()
    for p in ps:
        st = opt.state[p]
        nbytes = sum(st[k].numel() * st[k].element_size() for k in
                     ("exp_avg_codes", "exp_avg_absmax", "exp_avg_sq_codes", "exp_avg_sq_absmax"))
        other = [k for k in st if k not in ("step", "exp_avg_codes", "exp_avg_absmax",
                                            "exp_avg_sq_codes", "exp_avg_sq_absmax")]
        assert not other, other
        per = nbytes / p.numel()
        assert 2.0 < per <= 2.04, (tuple(p.shape), per)


def _regression_loss(opt_fn, steps=150):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(256, 64, generator=g)
    w_true = torch.randn(64, 1, generator=g)
    y = torch.tanh(x @ w_true) + 0.05 * torch.randn(256, 1, generator=g)
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 1))
    opt = opt_fn(model.parameters())
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
    with torch.no_grad():
        return nn.functional.mse_loss(model(x), y).item(), opt


@pytest.mark.parametrize("ours,theirs", [(AdamW8bit, torch.optim.AdamW), (Adam8bit, torch.optim.Adam)])
def test_regression_close_to_fp32(ours, theirs):
    start = _regression_loss(lambda ps: torch.optim.SGD(ps, lr=0.0), steps=1)[0]
    ref, _ = _regression_loss(lambda ps: theirs(ps, lr=3e-3))
    got, opt = _regression_loss(lambda ps: ours(ps, lr=3e-3))
    assert any("exp_avg_codes" in s for s in opt.state.values())  # the 64x128 weight is 8-bit
    assert ref < 0.2 * start
    assert abs(got - ref) <= 0.05 * ref, (got, ref)


def test_registry_and_signature():
    import inspect

    assert vefsdp_optim.get_optimizer("adamw8bit") is AdamW8bit
    assert vefsdp_optim.get_optimizer("Adam8bit") is Adam8bit
    for cls, wd in ((AdamW8bit, 1e-2), (Adam8bit, 0.0)):
        sig = inspect.signature(cls).parameters
        assert [n for n in sig][:7] == ["params", "lr", "betas", "eps", "weight_decay",
                                        "block_size", "min_8bit_size"]
        assert sig["weight_decay"].default == wd and sig["block_size"].default == 256
        assert sig["min_8bit_size"].default == 4096


def test_bad_arguments_raise():
    p = [nn.Parameter(torch.zeros(3, 3))]
    for kw, match in [(dict(lr=-1.0), "learning rate"), (dict(betas=(1.0, 0.9)), "beta"),
                      (dict(betas=(0.9, -0.1)), "beta"), (dict(eps=-1.0), "epsilon"),
                      (dict(weight_decay=-0.5), "weight_decay"), (dict(block_size=0), "block_size"),
                      (dict(block_size=2.5), "block_size"), (dict(block_size=True), "block_size"),
                      (dict(min_8bit_size=-1), "min_8bit_size")]:
        for cls in (AdamW8bit, Adam8bit):
            with pytest.raises(ValueError, match=match):
                cls(p, **kw)
    with pytest.raises(ValueError, match="block_size must be a positive int, got 0"):
        AdamW8bit([{"params": p, "block_size": 0}])
    with pytest.raises(NotImplementedError, match="non-contiguous"):
        AdamW8bit([nn.Parameter(torch.zeros(4, 3).t())])


# -- FSDP2 / HSDP (DTensor) and plain parameters on W ranks ----------------------------


class _Bag(nn.Module):
    def __init__(self, init):
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(t.clone()) for t in init])


def _kinds(opt, ps):
    """Per parameter: '8bit', 'fp32' or 'none' (this rank holds no compute slice)."""
    out = []
    for p in ps:
        st = opt.state.get(p, {})
        out.append("8bit" if "exp_avg_codes" in st else "fp32" if "exp_avg" in st else "none")
    return out


def _fsdp2_case(name, kw, hsdp):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    w = dist.get_world_size()
    if hsdp:
        mesh = init_device_mesh("cpu", (2, w // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (w,))
    model = _Bag(_params())
    fully_shard(model, mesh=mesh)
    ps = list(model.ps)
    opt = _cls(name)(ps, **kw)
    for step in range(STEPS):
        for p, gr in zip(ps, _grads(step), strict=True):
            p.grad = distribute_tensor(gr, mesh, p.placements)
        opt.step()
    _assert_equal([p.full_tensor() for p in ps], _run_plain(name, kw)[0])
    return _kinds(opt, ps)


def _plain_case(name, kw):
    got, opt = _run_plain(name, kw)
    ref = _whole_tensor_reference(name, kw)
    _assert_equal(got, ref)
    return _kinds(opt, opt.param_groups[0]["params"])


def _all_cases(hsdp=False):
    calls = {"a2a": 0}
    orig = dist.all_to_all_single

    def a2a(*a, **k):
        calls["a2a"] += 1
        return orig(*a, **k)

    kinds = []
    dist.all_to_all_single = a2a
    try:
        for name, kw in CASES:
            kinds.append(_fsdp2_case(name, kw, hsdp))
            kinds.append(_plain_case(name, kw))
    finally:
        dist.all_to_all_single = orig
    return kinds, calls["a2a"]


def _expected_kind(kw, shape):
    n = torch.Size(shape).numel()
    return "8bit" if n >= kw.get("min_8bit_size", 4096) else "fp32"


def _check_kinds(results, w):
    for c, (_, kw) in enumerate(CASES):
        for i, shape in enumerate(SHAPES):
            want = _expected_kind(kw, shape)
            per_rank = {kinds[2 * c][i] for kinds, _ in results} - {"none"}
            assert per_rank == {want}, (c, shape, per_rank)  # same decision on every rank
            assert all(kinds[2 * c + 1][i] == want for kinds, _ in results)
    if w > 1:  # the row shards cut blocks: the boundary exchange really ran
        assert all(n > 0 for _, n in results)


@pytest.mark.parametrize("world_size", [1, 2, 3, pytest.param(4, marks=pytest.mark.slow)])  # W = 4: ~2.6 s
def test_fsdp2_and_plain_params_bit_identical_to_single_device(world_size):
    _check_kinds(run_distributed(_all_cases, world_size), world_size)


def test_hsdp_2x2_params_bit_identical_to_single_device():
    _check_kinds(run_distributed(_all_cases, 4, True), 4)


# -- the library's own fully_shard parameters -----------------------------------------


class _Lin(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.a = nn.Linear(40, 300)
        self.b = nn.Linear(300, 17)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _fully_shard_case(name, kw):
    w = dist.get_world_size()
    model = _Lin()
    init = [p.detach().clone() for p in model.parameters()]
    vefsdp_optim.fully_shard(model)
    ps = list(model.parameters())
    opt = _cls(name)(ps, **kw)
    ref_ps = [nn.Parameter(t.clone()) for t in init]
    ref = _cls(name)(ref_ps, **kw)
    x = torch.randn(8, 40, generator=torch.Generator().manual_seed(11))
    for _ in range(STEPS):
        opt.zero_grad()
        model(x).square().mean().backward()
        for q, p in zip(ref_ps, ps, strict=True):
            q.grad = p.grad.full_tensor().clone()  # the very gradients the sharded run sees
        opt.step()
        ref.step()
    _assert_equal([p.full_tensor() for p in ps], [q.detach() for q in ref_ps])
    return w


@pytest.mark.parametrize("world_size", [2, 3])
def test_fully_shard_params_bit_identical_to_single_device(world_size):
    for name, kw in CASES[:3]:
        run_distributed(_fully_shard_case, world_size, name, kw)
