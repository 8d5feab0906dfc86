"""8-bit Muon momentum (see vefsdp_optim/_math/_muon_int8.py): ``momentum_dtype=torch.int8``.

One device: equal, bit for bit, to torch.optim.Muon whose momentum buffer is replaced
after every step by its 8-bit value, written here from the rule of vefsdp_optim/_math/_muon_int8.py
(256-element blocks, 8-bit Adam's signed code map, nearest code unless that is the
element's previous code, then a dithered rounding keyed on its flat index and the step), and
about 1.016 bytes of state per element. The rule keeps the increments that rounding to
nearest loses. Sharded (FSDP2, fully_shard; W = 2 and 3; uneven shapes, experts whose
momentum is cut between ranks): equal to one device.
Checkpoints: tests/test_checkpoint.py ("muon8").
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed
from torch import nn

import vefsdp_optim
from vefsdp_optim._math import dequantize_blockwise, dynamic_code_map, quantize_blockwise
from vefsdp_optim._math._muon_int8 import muon_momentum_int8_

# "experts" stays whole on one rank (350-element experts, lcm with 256 above its size);
# "moe" (256-element experts) is cut between experts, so ranks round with offsets
SHAPES = {"a": (37, 29), "b": (300, 11), "experts": (3, 70, 5), "moe": (6, 16, 16)}
EXPERTS = ("experts", "moe")
HP = dict(lr=0.02, weight_decay=0.1)
STEPS = 4
CODE = dynamic_code_map(True)


def _grad(step: int, name: str) -> torch.Tensor:
    return torch.randn(SHAPES[name], generator=torch.Generator().manual_seed(100 * step + ord(name[0])))


def _init() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}


def _groups(params: dict[str, torch.Tensor], **kw: object) -> list[dict]:
    return [{"params": [params["a"], params["b"]], **kw},
            {"params": [params[k] for k in EXPERTS], "flatten": False, **kw}]


def _uniform(index: int, step: int) -> float:
    """The rounding's draw: a hash of the flat index, plus step times 2**32 / golden
    ratio (0x9E3779B9), mod 2**32; its top 24 bits as a fraction."""
    mask = 0xFFFFFFFF
    h = ((index ^ (index >> 32)) & mask) * 0x61C88647 & mask
    for _ in range(2):
        h = (h ^ (h >> 16)) * 0x45D9F3B & mask
    h ^= h >> 16
    h = (h + step * 0x9E3779B9) % 2**32
    return (h >> 8) / 2**24


def _requantize(m: torch.Tensor, prev: torch.Tensor, count: list[int], step: int) -> torch.Tensor:
    """8-bit codes of the 1-D float32 ``m`` whose previous codes are ``prev``: the nearest
    code, or where that is the previous one, the code below or above the normalized value
    x (in blocks of 256, divided by the block's absmax): above where the draw of
    (index, step) is below its distance from the code below over their gap."""
    codes, absmax = quantize_blockwise(m, CODE, 256)
    for i in torch.nonzero(codes == prev).flatten().tolist():
        a = absmax[i // 256]
        x = m[i] / (a if a > 0 else torch.ones_like(a))
        lo = min(int((CODE <= x).sum()) - 1, 254)
        p = (x - CODE[lo]) / (CODE[lo + 1] - CODE[lo])
        codes[i] = lo + int(_uniform(i, step) < float(p))
        count[0] += 1
    return codes


def test_rounding_keeps_increments_nearest_loses() -> None:
    """A slowly varying gradient whose step increments are below half a code spacing:
    rounded to nearest the momentum stays where it was; the 8-bit momentum follows the
    float32 one."""
    gen = torch.Generator().manual_seed(3)
    g0 = torch.randn(1024, generator=gen)
    m0 = 0.9 * g0  # steps of 0.05 (g - m) = 0.005 g: below half a code spacing for most
    g0[::256] = m0[::256] = 4.0  # each block's absmax, constant: the codes' grid stays put
    codes, absmax = quantize_blockwise(m0, CODE, 256)
    nearest = quantize_blockwise(m0, CODE, 256)
    exact = dequantize_blockwise(codes, absmax, CODE, 256)
    for step in range(60):
        g = g0 * (1 + 1e-3 * torch.randn(1024, generator=gen))
        g[::256] = 4.0
        muon_momentum_int8_(g, codes, absmax, momentum=0.95, nesterov=True, code=CODE, step=step)
        m = dequantize_blockwise(*nearest, CODE, 256).lerp_(g, 0.05)
        nearest = quantize_blockwise(m, CODE, 256)
        exact.lerp_(g, 0.05)

    def err(c: tuple[torch.Tensor, torch.Tensor]) -> float:
        return float((dequantize_blockwise(*c, CODE, 256) - exact).norm() / exact.norm())

    assert err(nearest) > 0.08 and err((codes, absmax)) < 0.02, (err(nearest), err((codes, absmax)))


def test_rounding_average_follows_a_constant_momentum() -> None:
    """A constant gradient: the float32 momentum settles on it, and the 8-bit one keeps
    jumping between the two codes around each value. The dither's draws, one
    low-discrepancy sequence per element over the steps, make the average of those
    jumps over 100 steps follow the float32 momentum to 0.25% (seeds 0-5: 0.23-0.26%);
    independent uniform draws in the same rule leave 0.58-0.60%, nearest rounding more."""
    gen = torch.Generator().manual_seed(1)
    g = torch.rand(1024, generator=gen) * 0.8 + 0.1  # the top decade of the code map
    g[::256] = 1.0  # each block's absmax: the codes' grid stays put
    codes, absmax = quantize_blockwise(torch.zeros(1024), CODE, 256)
    exact = torch.zeros(1024)
    total, total_exact = torch.zeros(1024), torch.zeros(1024)
    for step in range(200):
        muon_momentum_int8_(g, codes, absmax, momentum=0.95, nesterov=False, code=CODE, step=step)
        exact.lerp_(g, 0.05)
        if step >= 100:
            total += dequantize_blockwise(codes, absmax, CODE, 256)
            total_exact += exact
    err = float((total - total_exact).norm() / total_exact.norm())
    assert err < 0.004, err


def _reference() -> tuple[dict[str, torch.Tensor], int]:
    """torch.optim.Muon on each matrix (experts one by one), its momentum replaced after
    each step by the 8-bit value; also how many elements were rounded stochastically."""
    init = _init()
    mats = {k: [nn.Parameter(e.clone()) for e in init[k]] if k in EXPERTS else [nn.Parameter(init[k].clone())]
            for k in SHAPES}
    opt = torch.optim.Muon([p for ps in mats.values() for p in ps], **HP)
    prev = {k: quantize_blockwise(torch.zeros(init[k].numel()), CODE, 256)[0] for k in SHAPES}
    count = [0]
    for step in range(STEPS):
        for k, ps in mats.items():
            g = _grad(step, k)
            for p, gi in zip(ps, g if k in EXPERTS else [g], strict=True):
                p.grad = gi.clone()
        opt.step()
        for k, ps in mats.items():  # the 8-bit state: blocks of the parameter's flat order
            bufs = [opt.state[p]["momentum_buffer"] for p in ps]
            m = torch.stack(bufs).reshape(-1)
            prev[k] = _requantize(m, prev[k], count, step)
            q = dequantize_blockwise(prev[k], quantize_blockwise(m, CODE, 256)[1], CODE, 256)
            for buf, qi in zip(bufs, q.view(len(bufs), -1), strict=True):
                buf.copy_(qi.view(buf.shape))
    return {k: torch.stack([p.detach() for p in ps]) if k in EXPERTS else ps[0].detach()
            for k, ps in mats.items()}, count[0]


def test_int8_momentum_equals_torch_muon_with_8bit_buffer() -> None:
    params = {k: nn.Parameter(v.clone()) for k, v in _init().items()}
    opt = vefsdp_optim.Muon(_groups(params, momentum_dtype=torch.int8), **HP)
    for step in range(STEPS):
        for k, p in params.items():
            p.grad = _grad(step, k)
        opt.step()
    want, rounded = _reference()
    n = sum(p.numel() for p in params.values())
    assert rounded > 200, rounded  # the stochastic branch is exercised (448 elements)
    for k in SHAPES:
        assert torch.equal(params[k].detach(), want[k]), (k, (params[k] - want[k]).abs().max())
    state = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values()
                if isinstance(t, torch.Tensor))
    assert state / n <= 1.05, state / n
    fp32 = vefsdp_optim.Muon(_groups({k: nn.Parameter(v.clone()) for k, v in _init().items()}), **HP)
    assert fp32.param_groups[0]["momentum_dtype"] is None


def test_dither_reads_a_tensor_step_with_the_same_bits() -> None:
    """The draw of vefsdp_optim/_math/_muon_int8.py from a step count given as an int (the host's) or
    as a 0-d int64 tensor (capturable: read where it lives): both equal the rule written
    out here, large flat indices and steps included."""
    from vefsdp_optim._math._muon_int8 import _dither

    index = torch.tensor([0, 1, 255, 70_000, 2**33 + 5, 2**40 - 1], dtype=torch.int64)
    for step in (0, 1, 19, 2**20 + 3, 2**31 - 1):
        want = torch.tensor([_uniform(int(i), step) for i in index], dtype=torch.float32)
        assert torch.equal(_dither(index.clone(), step), want), step
        assert torch.equal(_dither(index.clone(), torch.tensor(step)), want), step


def test_momentum_dtype_errors() -> None:
    p = nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="momentum_dtype must be None .* or torch.int8"):
        vefsdp_optim.Muon([p], momentum_dtype=torch.float16)
    with pytest.raises(ValueError, match="momentum_dtype"):
        vefsdp_optim.Muon([{"params": [p], "momentum_dtype": "int8"}])
    codes, absmax = quantize_blockwise(torch.zeros(512), CODE, 256)
    with pytest.raises(ValueError, match="multiple of 256"):
        muon_momentum_int8_(torch.zeros(256), codes[:256], absmax[:1], momentum=0.9, nesterov=False,
                            code=CODE, step=0, offset=100)
    for bad in (-1, 1.0, True):
        with pytest.raises(ValueError, match="step must be an int >= 0"):
            muon_momentum_int8_(torch.zeros(256), codes[:256], absmax[:1], momentum=0.9, nesterov=False,
                                code=CODE, step=bad)
    for bad in (torch.tensor(1.0), torch.tensor([1])):
        with pytest.raises(TypeError, match="step must be an int or a 0-d int64 tensor"):
            muon_momentum_int8_(torch.zeros(256), codes[:256], absmax[:1], momentum=0.9, nesterov=False,
                                code=CODE, step=bad)


def _sharded(kind: str) -> tuple[float, int]:
    from vefsdp_optim import ShardedParameter

    one = {k: nn.Parameter(v.clone()) for k, v in _init().items()}
    ref = vefsdp_optim.Muon(_groups(one, momentum_dtype=torch.int8), **HP)
    model = nn.Module()
    for k, v in _init().items():
        model.register_parameter(k, nn.Parameter(v.clone()))
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        from vefsdp_optim import fully_shard
    fully_shard(model)
    named = dict(model.named_parameters())
    opt = vefsdp_optim.Muon(_groups(named, momentum_dtype=torch.int8), **HP)
    for step in range(STEPS):
        for k, p in named.items():
            g = _grad(step, k)
            one[k].grad = g.clone()
            if isinstance(p, ShardedParameter):
                p.grad = p.with_local(g.reshape(-1)[p.ragged_layout.local_index(p.shard_rank)].clone())
            else:
                from torch.distributed.tensor import distribute_tensor

                p.grad = distribute_tensor(g, p.device_mesh, p.placements)
        opt.step()
        ref.step()
    compute = opt.state[named["moe"]].get("compute")  # where this rank's slice of the experts starts
    offset = compute.local(torch.distributed.get_rank())[0] if compute is not None else 0
    return max(float((p.full_tensor() - one[k].detach()).abs().max()) for k, p in named.items()), offset


def _both() -> dict[str, tuple[float, int]]:
    return {kind: _sharded(kind) for kind in ("fsdp2", "fully_shard")}


@pytest.mark.parametrize("world_size", [2, 3])
def test_int8_momentum_sharded_equals_one_device(world_size: int) -> None:
    results = run_distributed(_both, world_size)
    for kind in ("fsdp2", "fully_shard"):
        assert [r[kind][0] for r in results] == [0.0] * world_size, (kind, results)
    # FSDP2's Shard(0) cuts "moe" between experts: a rank rounds at an offset
    assert any(r["fsdp2"][1] > 0 for r in results), results
