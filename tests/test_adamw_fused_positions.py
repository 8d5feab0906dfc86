"""AdamW(fused=True) on flat buffers of slices equals torch's fused kernel on whole
parameters, bit for bit (see ``FUSED_BLOCK`` in vefsdp_optim/_math/_adam.py).

torch's fused CPU kernel rounds an element by where it sits in its tensor (vector body
or scalar tail), so stepping a flat buffer of slices in one call is not enough. Pure
tier: ``fused_pieces`` + ``adam_fused_pieces_`` on random cuts, orders, gaps and boxes
against torch.optim.AdamW(fused=True) on the whole tensors. Distributed tier: AdamW on
fully_shard parameters at W = 1..4 against torch on one device.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import vefsdp_optim
from vefsdp_optim._math._adam import FUSED_BLOCK, LocalSlice, adam_fused_pieces_, fused_pieces

STEPS = 3
HP = dict(lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, maximize=False, decoupled=True)


def _torch_fused(params, grads, amsgrad):
    ps = [nn.Parameter(p.clone()) for p in params]
    opt = torch.optim.AdamW(ps, lr=HP["lr"], weight_decay=HP["weight_decay"], amsgrad=amsgrad, fused=True)
    for g in grads:
        for p, gi in zip(ps, g, strict=True):
            p.grad = gi.clone()
        opt.step()
    return ps, opt


def test_body_elements_round_alike_at_any_address():
    """The kernel's result for an element depends on its index in its tensor, not on the
    tensor's address: the same values as views at every offset of a cache line agree."""
    torch.manual_seed(0)
    n = 5 * FUSED_BLOCK
    p0, g = torch.randn(n) * 0.3, torch.randn(n) * 1e-2
    want = _torch_fused([p0], [[g]] * STEPS, False)[0][0].detach()
    for k in range(1, 16):
        buf, gbuf = torch.zeros(n + k), torch.zeros(n + k)
        buf[k:], gbuf[k:] = p0, g
        p = nn.Parameter(buf[k:])  # a view whose data pointer is k elements past an aligned one
        opt = torch.optim.AdamW([p], lr=HP["lr"], weight_decay=HP["weight_decay"], fused=True)
        for _ in range(STEPS):
            p.grad = gbuf[k:].clone()
            opt.step()
        assert torch.equal(p.detach(), want), k


def _layout(draw, numels, world):
    """Per rank, LocalSlices of ragged cuts of each parameter in a flat buffer, members in
    a random order with random gaps; returns [(m, [(param index, global start, slice)])]."""
    cuts = [sorted(draw(st.lists(st.integers(0, n), min_size=world - 1, max_size=world - 1))) for n in numels]
    ranks = []
    for r in range(world):
        order = draw(st.permutations(range(len(numels))))
        off, members = 0, []
        for i in order:
            n = numels[i]
            b = [0, *cuts[i], n]
            start, length = b[r], b[r + 1] - b[r]
            off += draw(st.integers(0, 3))  # padding
            first = n - n % FUSED_BLOCK
            last = tuple(range(max(start, first), start + length))
            members.append((i, start, LocalSlice(off, length, n, last)))
            off += length
        ranks.append((off + draw(st.integers(0, 5)), members))
    return ranks


@settings(max_examples=40, deadline=None)
@given(st.data(), st.booleans())
def test_pieces_equal_torch_fused_on_whole_parameters(data, amsgrad):
    numels = data.draw(st.lists(st.sampled_from([1, 3, 7, 8, 13, 63, 64, 65, 91, 128, 200, 517, 1000]),
                                min_size=1, max_size=6))
    world = data.draw(st.integers(1, 4))
    seed = data.draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=gen) * 0.3 for n in numels]
    grads = [[torch.randn(n, generator=gen) * 1e-2 for n in numels] for _ in range(STEPS)]
    ref, ref_opt = _torch_fused(params, grads, amsgrad)
    for m, members in _layout(data.draw, numels, world):
        flat = torch.zeros(m)
        state = [torch.zeros(m) for _ in range(3)]
        for i, start, sl in members:
            flat[sl.offset:sl.offset + sl.length] = params[i][start:start + sl.length]
        pieces = fused_pieces([sl for _, _, sl in members])
        for s in range(STEPS):
            g = torch.zeros(m)
            for i, start, sl in members:
                g[sl.offset:sl.offset + sl.length] = grads[s][i][start:start + sl.length]
            adam_fused_pieces_(pieces, flat, g, *state, step=float(s), amsgrad=amsgrad, **HP)
        used = torch.zeros(m, dtype=torch.bool)
        for i, start, sl in members:
            seg = slice(sl.offset, sl.offset + sl.length)
            used[seg] = True
            want = ref_opt.state[ref[i]]
            assert torch.equal(flat[seg], ref[i].detach()[start:start + sl.length]), (numels, i, start, sl)
            assert torch.equal(state[0][seg], want["exp_avg"][start:start + sl.length])
            assert torch.equal(state[1][seg], want["exp_avg_sq"][start:start + sl.length])
            if amsgrad:
                assert torch.equal(state[2][seg], want["max_exp_avg_sq"][start:start + sl.length])
        assert not flat[~used].count_nonzero() and not any(t[~used].count_nonzero() for t in state)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 9), st.integers(1, 70), st.data())
def test_pieces_on_boxes(rows, cols, data):
    """A tensor-parallel box (columns c0:c1 of every row) as a local slice: its elements
    in row-major order, those in the last partial block at the end."""
    c0 = data.draw(st.integers(0, cols - 1))
    c1 = data.draw(st.integers(c0 + 1, cols))
    n = rows * cols
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    p0 = torch.randn(n, generator=gen) * 0.3
    grads = [[torch.randn(n, generator=gen) * 1e-2] for _ in range(STEPS)]
    ref = _torch_fused([p0], grads, False)[0][0].detach()
    index = torch.tensor([r * cols + c for r in range(rows) for c in range(c0, c1)])
    first = n - n % FUSED_BLOCK
    last = tuple(i for i in index.tolist() if i >= first)
    assert list(last) == index.tolist()[len(index) - len(last):]
    flat, state = p0[index].clone(), [torch.zeros(len(index)) for _ in range(3)]
    pieces = fused_pieces([LocalSlice(0, len(index), n, last)])
    for s in range(STEPS):
        adam_fused_pieces_(pieces, flat, grads[s][0][index], *state, step=float(s), amsgrad=False, **HP)
    assert torch.equal(flat, ref[index])


def test_local_slice_checks():
    with pytest.raises(ValueError, match="last"):
        LocalSlice(0, 2, 70, (10,))  # not in the last partial block [64, 70)
    with pytest.raises(ValueError, match="last"):
        LocalSlice(0, 3, 70, (66, 65))
    with pytest.raises(ValueError, match="length"):
        LocalSlice(0, 5, 4, ())


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)  # sizes on both sides of multiples of 8 and 64, a 0-d scalar
        self.a = nn.Linear(37, 29)
        self.b = nn.Linear(29, 65)
        self.c = nn.Linear(65, 3)
        self.s = nn.Parameter(torch.tensor(0.75))

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))) * self.s


def _fully_shard_vs_one_device(kw):
    w = dist.get_world_size()
    model = _Net()
    ref_ps = [nn.Parameter(p.detach().clone()) for p in model.parameters()]
    vefsdp_optim.fully_shard(model.b)
    vefsdp_optim.fully_shard(model)
    ps = list(model.parameters())
    opt = vefsdp_optim.AdamW(ps, **kw)
    ref = torch.optim.AdamW(ref_ps, **kw)
    x = torch.randn(16, 37, generator=torch.Generator().manual_seed(1))
    for _ in range(STEPS):
        opt.zero_grad()
        model(x).square().mean().backward()
        for q, p in zip(ref_ps, ps, strict=True):
            q.grad = p.grad.full_tensor().detach().clone()
        opt.step()
        ref.step()
    bad = [i for i, (p, q) in enumerate(zip(ps, ref_ps, strict=True))
           if not torch.equal(p.full_tensor().detach(), q.detach())]
    for i, (p, q) in enumerate(zip(ps, ref_ps, strict=True)):
        start, length = p.ragged_layout.local(dist.get_rank())
        for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if k in ref.state[q] and not torch.equal(opt.state[p][k],
                                                     ref.state[q][k].reshape(-1)[start:start + length]):
                bad.append((i, k))
    return w, bad, opt.fused_updates


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_fully_shard_fused_equals_torch_fused_on_one_device(world_size):
    for kw in (dict(fused=True), dict(fused=True, lr=0.01, amsgrad=True, weight_decay=0.1)):
        for w, bad, fused_updates in run_distributed(_fully_shard_vs_one_device, world_size, kw):
            assert not bad, (w, kw, bad)
            assert fused_updates == 2 * STEPS  # both stores took the flat path
