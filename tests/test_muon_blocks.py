"""Muon's block structure: ``flatten`` and ``split_sizes``.

``flatten=False``: each [..., m, n] slice of a >= 3-D parameter (MoE experts) is updated
exactly as a separate 2-D parameter; ``split_sizes``: each row block of a matrix (a fused
QKV projection) exactly as a separate parameter. The reference is torch.optim.Muon run
on the separate slices / blocks as their own parameters, bit for bit, on one device and
sharded (FSDP2 and fully_shard, W = 2 and 3, expert counts that do not divide W), and
through a checkpoint saved at W = 3 and loaded at W = 2.
"""

from __future__ import annotations

import os
from functools import partial

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from sharded_bag import Bag, full_params, set_full_grads, shard_bag
from torch import nn

import vefsdp_optim
from vefsdp_optim.sharding import FlatBlocks, RowBlocks, WholeTensor

STEPS = 3

# name -> (shape, group keys); a grouped-query fused QKV (8 q rows, 4 k, 4 v), MoE experts
# (5 experts: divides neither 2 nor 3), experts with fused gate/up blocks, an equal split
PARAMS = {
    "qkv": ((16, 8), dict(split_sizes=[8, 4, 4])),
    "experts": ((5, 6, 4), dict(flatten=False)),
    "gate_up": ((3, 12, 5), dict(flatten=False, split_sizes=[6, 3, 3])),
    "equal": ((12, 7), dict(split_sizes=[4, 4, 4])),
    "dense": ((9, 6), {}),
    "bias": ((9,), {}),
}
HP = dict(lr=0.02, weight_decay=0.1)


def _blocks(shape, keys):
    """(flat slices of) the separate parameters a reference run optimizes: list of
    (index tuple into the parameter, shape)."""
    sizes = keys.get("split_sizes")
    if keys.get("flatten") is False:
        lead = shape[:-2]
        grid = torch.cartesian_prod(*[torch.arange(d) for d in lead]).reshape(-1, len(lead))
        mats = [tuple(ix) for ix in grid.tolist()]
        m, n = shape[-2:]
    else:
        mats, (m, n) = [()], shape
    sizes = sizes or [m]
    out = []
    for ix in mats:
        r = 0
        for s in sizes:
            out.append((ix + (slice(r, r + s),), (s, n)))
            r += s
    return out


def _init(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, (s, _) in PARAMS.items()}


def _grad(step, name):
    g = torch.Generator().manual_seed(1000 * step + sum(map(ord, name)))
    return torch.randn(PARAMS[name][0], generator=g)


def _groups(params: dict[str, torch.Tensor], hp=HP):
    groups = [{"params": [params[k]], **keys} for k, (s, keys) in PARAMS.items() if len(s) >= 2]
    groups.append({"params": [params["bias"]], "use_muon": False})
    return groups


def _torch_reference(init, steps=STEPS, hp=HP, **extra):
    """torch.optim.Muon on every block as its own parameter; torch AdamW on the bias."""
    out = {k: v.clone() for k, v in init.items()}
    pieces = {k: [(ix, nn.Parameter(init[k][ix].clone())) for ix, _ in _blocks(s, keys)]
              for k, (s, keys) in PARAMS.items() if len(s) >= 2}
    muon = torch.optim.Muon([p for ps in pieces.values() for _, p in ps], **hp, **extra)
    bias = nn.Parameter(init["bias"].clone())
    adam = torch.optim.AdamW([bias], lr=hp["lr"], betas=(0.9, 0.95), eps=1e-8,
                             weight_decay=hp["weight_decay"])
    for step in range(steps):
        for k, ps in pieces.items():
            g = _grad(step, k)
            for ix, p in ps:
                p.grad = g[ix].clone()
        bias.grad = _grad(step, "bias")
        muon.step()
        adam.step()
    for k, ps in pieces.items():
        for ix, p in ps:
            out[k][ix] = p.detach()
    out["bias"] = bias.detach()
    return out


# -- one process ----------------------------------------------------------------------


@pytest.mark.parametrize("extra", [{}, dict(nesterov=False, adjust_lr_fn="match_rms_adamw")])
def test_plain_equals_torch_on_separate_blocks(extra):
    init = _init()
    params = {k: nn.Parameter(v.clone()) for k, v in init.items()}
    opt = vefsdp_optim.Muon(_groups(params), **HP, **extra)
    for step in range(STEPS):
        for k, p in params.items():
            p.grad = _grad(step, k)
        opt.step()
    want = _torch_reference(init, **extra)
    for k in PARAMS:
        assert torch.equal(params[k].detach(), want[k]), (k, (params[k] - want[k]).abs().max())


def test_flatten_false_differs_from_flatten_true():
    """The (dim 0, rest) matrix mixes experts: the two meanings really differ."""
    outs = []
    for flatten in (True, False):
        p = nn.Parameter(_init()["experts"].clone())
        opt = vefsdp_optim.Muon([{"params": [p], "flatten": flatten}], lr=0.02)
        p.grad = _grad(0, "experts")
        opt.step()
        outs.append(p.detach())
    assert not torch.allclose(outs[0], outs[1])


def test_requirements_declared_to_the_planner():
    opt = vefsdp_optim.Muon(_groups({k: nn.Parameter(v) for k, v in _init().items()}))
    req = {k: opt.requirement(torch.Size(s), opt.param_groups[i]) for i, (k, (s, _)) in
           enumerate(x for x in PARAMS.items() if len(x[1][0]) >= 2)}
    assert req == {"qkv": WholeTensor(), "experts": RowBlocks(1), "gate_up": RowBlocks(1),
                   "equal": FlatBlocks(4 * 7), "dense": WholeTensor()}
    opt2 = vefsdp_optim.Muon([{"params": [nn.Parameter(torch.zeros(2, 3, 4, 5))], "flatten": False}])
    assert opt2.requirement(torch.Size((2, 3, 4, 5)), opt2.param_groups[0]) == FlatBlocks(20)


def test_bad_keys_raise_at_construction():
    p3 = nn.Parameter(torch.zeros(4, 3, 2))
    with pytest.raises(ValueError, match=r"'flatten'.*flatten=True.*\(dim 0, rest\).*flatten=False"):
        vefsdp_optim.Muon([p3])
    vefsdp_optim.Muon([{"params": [p3], "use_muon": False}])  # AdamW: no matrix, no question
    vefsdp_optim.Muon([p3], flatten=True)  # the constructor's default counts
    with pytest.raises(TypeError, match="flatten must be"):
        vefsdp_optim.Muon([{"params": [p3], "flatten": "no"}])
    p2 = nn.Parameter(torch.zeros(16, 8))
    with pytest.raises(ValueError, match=r"split_sizes \[8, 4, 3\] sum to 15.*16 rows"):
        vefsdp_optim.Muon([{"params": [p2], "split_sizes": [8, 4, 3]}])
    with pytest.raises(ValueError, match="positive ints"):
        vefsdp_optim.Muon([{"params": [p2], "split_sizes": [8, 0, 8]}])
    with pytest.raises(TypeError, match="split_sizes must be a sequence"):
        vefsdp_optim.Muon([{"params": [p2], "split_sizes": 8}])
    with pytest.raises(ValueError, match=r"shape \(4, 3, 2\).*3 x 2"):  # flatten=False: rows of each slice
        vefsdp_optim.Muon([{"params": [p3], "flatten": False, "split_sizes": [2, 2]}])
    opt = vefsdp_optim.Muon([p2])
    with pytest.raises(ValueError, match="split_sizes"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(6, 8))], "split_sizes": [4, 4]})
    assert len(opt.param_groups) == 1


# -- sharded: FSDP2 and fully_shard ----------------------------------------------------


def _sharded_run(kind):
    model = shard_bag(kind, _init())
    opt = vefsdp_optim.Muon(_groups(dict(model.named_parameters())), **HP)
    for step in range(STEPS):
        set_full_grads(model, partial(_grad, step))
        opt.step()
    layouts = {k: p.ragged_layout.boundaries if hasattr(p, "ragged_layout") else None
               for k, p in model.named_parameters()}
    return full_params(model), layouts


def _sharded_both():
    return {kind: _sharded_run(kind) for kind in ("fsdp2", "fully_shard")}


@pytest.mark.parametrize("world_size", [2, 3])
def test_sharded_equals_torch_on_separate_blocks(world_size):
    got = run_distributed(_sharded_both, world_size)[0]
    want = _torch_reference(_init())
    for kind, (full, layouts) in got.items():
        for k in PARAMS:
            assert torch.equal(full[k], want[k]), (kind, k, (full[k] - want[k]).abs().max())
        if kind == "fully_shard":  # the planner kept whole experts / whole blocks on single ranks
            for k, unit in (("experts", 24), ("gate_up", 60), ("equal", 28)):
                assert all(b % unit == 0 for b in layouts[k]), (k, layouts[k])


def _experts_fsdp2_no_exchange():
    """FSDP2's Shard(0) keeps whole experts on ranks: the experts' step moves nothing."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    model = Bag({"experts": _init()["experts"]})
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    opt = vefsdp_optim.Muon([{"params": [model.experts], "flatten": False}], lr=0.02)
    calls = []
    orig = dist.all_to_all_single
    dist.all_to_all_single = lambda *a, **k: calls.append(1) or orig(*a, **k)
    try:
        for k in range(2):
            model.experts.grad = distribute_tensor(_grad(k, "experts"), model.experts.device_mesh,
                                                   model.experts.placements)
            opt.step()
    finally:
        dist.all_to_all_single = orig
    return len(calls)


def test_fsdp2_experts_step_without_exchange():
    assert run_distributed(_experts_fsdp2_no_exchange, 3) == [0, 0, 0]


# -- checkpoint: saved at W = 3, loaded at W = 2 ----------------------------------------

SPLIT = 2


def _ckpt_save(kind, root):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    model = shard_bag(kind, _init())
    opt = vefsdp_optim.Muon(_groups(dict(model.named_parameters())), **HP)
    for step in range(SPLIT):
        set_full_grads(model, partial(_grad, step))
        opt.step()
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=os.path.join(root, kind))


def _ckpt_load(kind, root):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model = shard_bag(kind, _init(seed=7))  # other values: all must come from the checkpoint
    opt = vefsdp_optim.Muon(_groups(dict(model.named_parameters())), **HP)
    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(sd, checkpoint_id=os.path.join(root, kind))
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])
    for step in range(SPLIT, STEPS):
        set_full_grads(model, partial(_grad, step))
        opt.step()
    return full_params(model)


@pytest.mark.parametrize("kind", ["fully_shard", "fsdp2"])
def test_checkpoint_resharded_3_to_2(kind, tmp_path):
    run_distributed(_ckpt_save, 3, kind, str(tmp_path))
    got = run_distributed(_ckpt_load, 2, kind, str(tmp_path))[0]
    want = _torch_reference(_init())
    for k in PARAMS:
        assert torch.equal(got[k], want[k]), (kind, k, (got[k] - want[k]).abs().max())


def test_toy_moe_task_declares_both_keys():
    from vefsdp_optim.toy import RunConfig, train
    from vefsdp_optim.toy._runner import build_optimizer
    from vefsdp_optim.toy._tasks import get_task

    model = get_task("moe").build(0).model
    opt = build_optimizer("muon", model, 0.02)
    keys = {(g.get("flatten"), g.get("split_sizes")): len(g["params"]) for g in opt.param_groups
            if g["use_muon"]}
    assert keys == {(False, None): 4, (True, (64, 32, 32)): 2, (True, None): 4}, keys
    losses = train(RunConfig("moe", "muon", "none", 3)).losses
    assert len(losses) == 3 and losses[-1] < losses[0]


@pytest.mark.parametrize("tall", [True, False])
@pytest.mark.parametrize("into", [False, True])
def test_flat_copy_gives_row_major_order(tall, into):
    """A batch's flat row-major copy, also from a transposed (tall) Newton-Schulz result
    copied one matrix at a time, equals torch's own reshape."""
    from vefsdp_optim._math._muon import _flat_copy

    wide = torch.randn(4, 5, 7, generator=torch.Generator().manual_seed(3)).bfloat16()
    batch = wide.mT if tall else wide
    want = batch.reshape(-1).clone()
    if into:
        out = torch.full((batch.numel(),), float("nan"), dtype=batch.dtype)
        assert _flat_copy(batch, out=out) is out
    else:
        out = _flat_copy(batch)
    assert torch.equal(out, want)
    assert out.is_contiguous()


# -- balanced compute cuts on FSDP2 (see ``balanced_compute`` in vefsdp_optim/_compute_layouts.py)
# ----------------------------


@pytest.mark.parametrize("world", [2, 3, 4])
def test_balanced_compute_cuts(world):
    """Each boundary at one of its two nearest legal cuts, legal and in order; layers that
    tie alike (3 row blocks over 2 ranks) alternate, so the ranks compute even shares."""
    from vefsdp_optim._compute_layouts import balanced_compute
    from vefsdp_optim.sharding import RaggedShard, RowBlocks

    shape, req = torch.Size((12, 5)), RowBlocks(4)
    unit, n = 20, 60
    storage = RaggedShard.from_boundaries([round(k * n / world) for k in range(world + 1)])
    load = [0] * world
    for _ in range(6):
        before = list(load)
        got = balanced_compute(storage, req, shape, load)
        assert got.satisfies(req, shape) and got.numel == n
        for b, c in zip(storage.boundaries, got.boundaries, strict=True):
            assert c % unit == 0 and abs(c - b) < unit, (storage, got)
        assert [a - x for a, x in zip(load, before, strict=True)] == [m for _, m in got.extents]
    assert max(load) - min(load) <= unit * (1 if world == 2 else 2), load  # even within a block or two
    if world == 2:  # 30 | 30 ties: the snapped layout gives rank 1 two blocks of every layer
        assert load == [180, 180], load


def _balanced_fsdp2(kind):
    """Two fused matrices of W + 1 row blocks of 16 x 16 (one 8-bit momentum block each) on
    FSDP2: the compute cuts of each, and the bits against one device."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    torch.set_num_threads(1)
    rows = 16 * (dist.get_world_size() + 1)
    init = {f"qkv{i}": torch.randn(rows, 16, generator=torch.Generator().manual_seed(i)) for i in range(2)}
    model = Bag(init)
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    ref = Bag(init)
    cls = vefsdp_optim.NorMuon if kind == "normuon" else vefsdp_optim.Muon
    extra = dict(momentum_dtype=torch.int8) if kind == "int8" else {}
    opts = [cls([{"params": list(m.parameters()), "split_sizes": [16] * (rows // 16)}], lr=0.02, **extra)
            for m in (model, ref)]
    for k in range(3):
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            g = torch.randn(rows, 16, generator=torch.Generator().manual_seed(10 * k + int(name[-1])))
            p.grad = distribute_tensor(g, p.device_mesh, p.placements)
            q.grad = g
        for o in opts:
            o.step()
    cuts = [list(it.compute.boundaries) for it in opts[0]._planner.plan.items]
    equal = all(torch.equal(p.full_tensor(), q.detach()) for p, q in zip(model.parameters(), ref.parameters(),
                                                                           strict=True))
    return cuts, equal


# world -> (the nearest cuts, the balanced cuts of the two layers), in elements (16 x 16 = 256
# a block): at W = 2 (3 blocks, FSDP2 rows 24 | 24) the nearest give rank 1 two blocks of
# each layer, balanced 3 | 3 in all; at W = 3 (4 blocks, rows 22 | 22 | 20) the nearest give
# 1 | 2 | 1 of each, balanced 3 | 2 | 3 in all
BALANCED_CUTS = {2: ([0, 256, 768], [[0, 256, 768], [0, 512, 768]]),
                 3: ([0, 256, 768, 1024], [[0, 256, 512, 1024], [0, 512, 768, 1024]])}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", ["float", "int8", "normuon"])
def test_fsdp2_split_blocks_balanced_across_layers(kind, world):
    """Muon's float momentum (kept with the storage): the layers' cuts balance the ranks'
    blocks. 8-bit momentum (kept on the compute slices) and NorMuon (its row moments where
    a block is computed): the nearest cuts, stable. All equal one device bit for bit."""
    nearest, balanced = BALANCED_CUTS[world]
    for cuts, equal in run_distributed(_balanced_fsdp2, world, kind):
        assert equal
        assert cuts == (balanced if kind == "float" else [nearest] * 2), cuts
