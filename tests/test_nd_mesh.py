"""Every optimizer on N-D meshes: FSDP2 x tensor parallel (x replicate), expert parallel.

The parameters are DTensors placed ``(_StridedShard(0), Shard(0))`` (colwise),
``(Shard(0), Shard(1))`` (rowwise), ``(Shard(0), Replicate())`` (rowwise bias) and
``(Shard(0),)`` on the dp submesh (norms), on uneven shapes. Each step's full gradients
(what FSDP2 + TP computed, gathered) are replayed on one device by an unsharded
optimizer: torch.optim.AdamW for AdamW, our own single-device runs for the others.
The trained parameters must be bitwise equal.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from tp_utils import TP_PLAN, TPBlock, full_grad, gathered, parallelize, set_box_grad

OPTIMIZERS = ("adamw", "muon", "adamw8bit", "adam8bit", "shampoo")


def make_optimizer(name: str, params: list, *, experts: bool = False) -> torch.optim.Optimizer:
    import vefsdp_optim as vo

    params = list(params)
    if name == "adamw":
        return vo.AdamW(params, lr=1e-2, weight_decay=0.1)
    if name == "torch_adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    if name == "torch_sgd":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9, nesterov=True)
    if name == "muon":
        mats = [p for p in params if p.dim() == 2]
        rest = [p for p in params if p.dim() < 2]
        stacks = [p for p in params if p.dim() > 2]  # experts: one matrix each
        groups = [{"params": mats}, {"params": rest, "use_muon": False}]
        if stacks:
            groups.append({"params": stacks, "flatten": False})
        return vo.Muon(groups, lr=2e-2, weight_decay=0.1)
    if name == "adamw8bit":
        return vo.AdamW8bit(params, lr=1e-2, block_size=16, min_8bit_size=16)
    if name == "adam8bit":
        return vo.Adam8bit(params, lr=1e-2, block_size=16, min_8bit_size=16)
    if name == "shampoo":
        return vo.Shampoo(params, lr=1e-2, max_preconditioner_dim=4, precondition_frequency=2)
    raise ValueError(name)


def _train_nd(name: str, mesh_shape: tuple[int, ...], names: tuple[str, ...], steps: int = 3,
              replicate: bool = False, shard: str = "fsdp2") -> dict[str, object]:
    """FSDP2 (or our fully_shard; + HSDP when ``replicate``) + TP on ``mesh_shape``; every
    step's gathered full gradients replayed on one device; returns the largest difference
    and what moved."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import vefsdp_optim

    if shard == "ours":
        fully_shard = vefsdp_optim.fully_shard  # noqa: F811

    torch.manual_seed(0)
    model = TPBlock()
    ref = TPBlock()
    ref.load_state_dict(model.state_dict())
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    parallelize(model, mesh["tp"], TP_PLAN)
    dp = mesh[names[:-1]] if replicate else mesh["dp"]
    fully_shard(model, mesh=dp)
    opt = make_optimizer(name, model.parameters())
    ref_opt = make_optimizer("torch_adamw" if name == "adamw" else name, ref.parameters())
    tp_rank = mesh["tp"].get_local_rank()
    dp_rank = dist.get_rank() // mesh_shape[-1]
    del tp_rank
    worst = 0.0
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + dp_rank)
        x = torch.randn(3, 5, 10, generator=g)
        model(x).pow(2).mean().backward()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            q.grad = gathered(p.grad)
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            worst = max(worst, float((gathered(p) - q.detach()).abs().max()))
    placements = sorted({str(p.placements) if hasattr(p, "placements") else type(p.ragged_layout).__name__
                         for p in model.parameters()})
    return {"worst": worst, "placements": placements}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_fsdp2_tp_2x2_bitwise(name: str) -> None:
    results = run_distributed(_train_nd, 4, name, (2, 2), ("dp", "tp"))
    for r in results:
        assert r["worst"] == 0.0, r
    assert any("_StridedShard" in p for p in results[0]["placements"]), results[0]["placements"]
    assert any("Shard(dim=1)" in p for p in results[0]["placements"]), results[0]["placements"]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_fsdp2_tp_3x2_bitwise(name: str) -> None:
    for r in run_distributed(_train_nd, 6, name, (3, 2), ("dp", "tp")):
        assert r["worst"] == 0.0, r


# -- checkpoints across meshes: dp 2 x tp 2 <-> a 1-D mesh of 3 <-> one device ------------------


@pytest.mark.parametrize("src, dst", [
    # the quick tier saves from each 2-D mesh and loads onto FSDP2 x TP; the rest ~3 s each
    pytest.param(("fsdp2_tp", 4), ("fsdp2", 3), marks=pytest.mark.slow),
    (("fsdp2_tp", 4), ("single", "single")),
    (("fsdp2", 3), ("fsdp2_tp", 4)),
    (("fully_shard_tp", 4), ("fully_shard", 3)),
    pytest.param(("fully_shard", 3), ("fully_shard_tp", 4), marks=pytest.mark.slow),
])
def test_checkpoint_across_meshes(tmp_path, src, dst):
    from ckpt_harness import _resume_case

    _resume_case(tmp_path, src[0], src[1], dst[0], dst[1])


# FSDP2 at dp 3 x tp 2 is left out: torch 2.13's DTensor describes the uneven
# _StridedShard boxes of FSDP2 + TP's *model* parameters (37 rows: tp 19 / 18, then dp
# 7 / 7 / 5) as overlapping 6-row chunks, and DCP refuses the model state before the
# optimizer's. Our fully_shard describes its boxes itself, so it saves there.
@pytest.mark.slow
@pytest.mark.parametrize("src, dst", [(("single", "single"), ("fsdp2_tp", 4)),
                                      (("fully_shard_tp", 4), ("single", "single")),
                                      (("fsdp2_tp", 4), ("fully_shard_tp", 4)),
                                      (("fully_shard_tp", 6), ("fully_shard", 2))])
def test_checkpoint_across_meshes_more(tmp_path, src, dst):
    from ckpt_harness import _resume_case

    _resume_case(tmp_path, src[0], src[1], dst[0], dst[1])


# -- synthetic gradients: any placements, expert parallel, a 3-D mesh ---------------------------


def _synthetic_run(name: str, build: str, steps: int = 3, seed: int = 0, **kw: object) -> float:
    """Build a model with ``build`` (DTensor parameters on some mesh), step ``name`` on
    seeded full gradients, replay them on one device; the largest difference."""
    torch.manual_seed(seed)
    model, ref = BUILDS[build](**kw)
    opt = make_optimizer(name, model.parameters(), **({"experts": True} if build == "ep" else {}))
    ref_opt = make_optimizer("torch_adamw" if name == "adamw" else name, ref.parameters(),
                             **({"experts": True} if build == "ep" else {}))
    worst = 0.0
    named_ref = dict(ref.named_parameters())
    for step in range(steps):
        for n, p in model.named_parameters():
            full = full_grad(step, n, p.shape)
            set_box_grad(p, full)
            named_ref[n].grad = full.clone()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for n, p in model.named_parameters():
        worst = max(worst, float((gathered(p).detach() - named_ref[n].detach()).abs().max()))
    return worst


class Experts(nn.Module):
    """An MoE layer's expert weights, stacked: (experts, out, in)."""

    def __init__(self, experts: int = 4, d: int = 10, h: int = 8) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(experts, h, d) * 0.3)
        self.w2 = nn.Parameter(torch.randn(experts, d, h) * 0.3)
        self.router = nn.Linear(d, experts)


def _build_ep(fsdp_dim: int = 0) -> tuple[nn.Module, nn.Module]:
    """Experts Shard(0) over ``ep`` (2), FSDP2 over ``dp`` (2) on dim ``fsdp_dim`` (torchtitan
    shards dim 1 when experts are fewer than the ranks), the router FSDP only."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    model, ref = Experts(), Experts()
    ref.load_state_dict(model.state_dict())
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    for k in ("w1", "w2"):
        setattr(model, k, nn.Parameter(distribute_tensor(getattr(model, k).detach(), mesh["ep"], [Shard(0)])))
    fully_shard(model, mesh=mesh["dp"], shard_placement_fn=lambda p: Shard(fsdp_dim if p.dim() == 3 else 0))
    return model, ref


def _build_3d(ours: bool = False) -> tuple[nn.Module, nn.Module]:
    """HSDP + TP on replicate 2 x dp 2 x tp 2 (FSDP2's or our fully_shard)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if ours:
        from vefsdp_optim import fully_shard  # noqa: F811

    model, ref = TPBlock(), TPBlock()
    ref.load_state_dict(model.state_dict())
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("rep", "dp", "tp"))
    parallelize(model, mesh["tp"], TP_PLAN)
    fully_shard(model, mesh=mesh["rep", "dp"])
    return model, ref


def _build_random(shapes: list, plans: list) -> tuple[nn.Module, nn.Module]:
    """Parameters of random ``shapes``: plan (tp placement dim or None, FSDP2 dim)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    model, ref = nn.Module(), nn.Module()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dims = {}
    for i, (shape, (tp_dim, dp_dim)) in enumerate(zip(shapes, plans, strict=True)):
        w = torch.randn(shape)
        ref.register_parameter(f"p{i}", nn.Parameter(w.clone()))
        t = distribute_tensor(w, mesh["tp"], [Replicate() if tp_dim is None else Shard(tp_dim)],
                              src_data_rank=None)
        model.register_parameter(f"p{i}", nn.Parameter(t))
        dims[f"p{i}"] = dp_dim
    by_id = {id(p): dims[n] for n, p in model.named_parameters()}
    fully_shard(model, mesh=mesh["dp"], shard_placement_fn=lambda p: Shard(by_id[id(p)]))
    return model, ref


BUILDS = {"ep": _build_ep, "3d": _build_3d, "random": _build_random}


@pytest.mark.parametrize("fsdp_dim", [0, 1])
def test_expert_parallel_bitwise(fsdp_dim: int) -> None:
    def check(name: str) -> None:
        for worst in run_distributed(_synthetic_run, 4, name, "ep", fsdp_dim=fsdp_dim):
            assert worst == 0.0, (name, worst)

    for name in ("adamw", "muon", "adamw8bit", "shampoo"):
        check(name)


def _two_optimizers_3d() -> dict[str, float]:
    return {f"{name}_{kind}": _synthetic_run(name, "3d", ours=kind == "ours")
            for name in ("adamw", "muon") for kind in ("fsdp2", "ours")}


@pytest.mark.slow  # 8 ranks: ~50 s on 2 cores (the 2x2 and 3x2 meshes run in the quick tier)
def test_hsdp_tp_3d_mesh_w8() -> None:
    for r in run_distributed(_two_optimizers_3d, 8):
        assert r == {"adamw_fsdp2": 0.0, "adamw_ours": 0.0, "muon_fsdp2": 0.0, "muon_ours": 0.0}, r


def _random_case(name: str, shapes: list, plans: list) -> float:
    return _synthetic_run(name, "random", steps=2, shapes=shapes, plans=plans)


@st.composite
def _params(draw: st.DrawFn) -> tuple[list, list]:
    shapes, plans = [], []
    for _ in range(draw(st.integers(1, 4))):
        shape = tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=3)))
        tp_dim = draw(st.one_of(st.none(), st.integers(0, len(shape) - 1)))
        local = list(shape)
        if tp_dim is not None:
            local[tp_dim] = -(-local[tp_dim] // 2)
        # FSDP2 shards dims other than 0 only evenly
        dp_dims = [0] + [d for d in range(1, len(shape)) if local[d] % 2 == 0 and shape[d] % 2 == 0]
        shapes.append(shape)
        plans.append((tp_dim, draw(st.sampled_from(dp_dims))))
    return shapes, plans


@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_params(), name=st.sampled_from(["adamw", "muon", "adamw8bit", "shampoo"]))
def test_random_shapes_and_placements(case: tuple[list, list], name: str) -> None:
    shapes, plans = case
    for worst in run_distributed(_random_case, 4, name, shapes, plans):
        assert worst == 0.0, (name, shapes, plans, worst)


# -- our fully_shard composed with tensor parallel ----------------------------------------------


def _ours_vs_fsdp2_tp(name: str, mesh_shape: tuple[int, int], steps: int = 3, ac: bool = False) -> dict:
    """The same TP model under our fully_shard and under FSDP2 (both over dp), the same
    tokens: losses and parameters after ``steps`` steps of ``name`` (FSDP2's side steps
    torch's AdamW for "adamw", ours on FSDP2 + TP otherwise)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as fsdp2_shard
    from torch.distributed.tensor import DTensor

    import vefsdp_optim

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp"))
    runs = {}
    for kind, shard in (("ours", vefsdp_optim.fully_shard), ("fsdp2", fsdp2_shard)):
        torch.manual_seed(0)
        model = TPBlock()
        parallelize(model, mesh["tp"], TP_PLAN)
        if ac:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                checkpoint_wrapper,
            )

            model.up2 = checkpoint_wrapper(model.up2)
        shard(model, mesh=mesh["dp"])
        opt = make_optimizer("torch_adamw" if name == "adamw" and kind == "fsdp2" else name,
                             model.parameters())
        losses = []
        inside = set()
        for step in range(steps):
            g = torch.Generator().manual_seed(100 * step + dist.get_rank() // mesh_shape[1])
            x = torch.randn(3, 5, 10, generator=g)
            hook = model.up.register_forward_pre_hook(
                lambda m, a, seen=inside: seen.add(type(m.weight).__name__))
            loss = model(x).pow(2).mean()
            hook.remove()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach().full_tensor() if isinstance(loss, DTensor) else loss))
        runs[kind] = (losses, [gathered(p).detach() for p in model.parameters()], sorted(inside))
    (lo, po, io), (lf, pf, _) = runs["ours"], runs["fsdp2"]
    return {"losses": (lo, lf), "params_equal": all(torch.equal(a, b) for a, b in zip(po, pf, strict=True)),
            "max_diff": max(float((a - b).abs().max()) for a, b in zip(po, pf, strict=True)),
            "forward_sees": io}


@pytest.mark.parametrize("name, ac", [("adamw", False), ("adamw", True), ("muon", False)])
def test_fully_shard_tp_2x2_equals_fsdp2_tp(name: str, ac: bool) -> None:
    for r in run_distributed(_ours_vs_fsdp2_tp, 4, name, (2, 2), 3, ac):
        assert r["forward_sees"] == ["DTensor"], r
        assert r["losses"][0] == r["losses"][1], r
        assert r["params_equal"], r


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_fully_shard_tp_3x2_bitwise_vs_one_device(name: str) -> None:
    for r in run_distributed(_train_nd, 6, name, (3, 2), ("dp", "tp"), 3, False, "ours"):
        assert r["worst"] == 0.0, r
        assert r["placements"] == ["BoxShard", "RaggedShard"], r


def _meta_and_dims() -> dict[str, object]:
    """Our fully_shard over TP from the meta device (then a full state dict loaded) and
    through dp_mesh_dims on the SPMD mesh (on a torch that has DataParallelMeshDims,
    2.12 on), against the eager build with mesh['dp']; and FSDPModule's methods (unshard /
    reshard, reshard_after_forward=False) on the way."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    import vefsdp_optim
    from vefsdp_optim._torch_compat import DataParallelMeshDims

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    full = {k: v.clone() for k, v in TPBlock().state_dict().items()}

    def build(kind: str) -> nn.Module:
        if kind == "meta":
            with torch.device("meta"):
                model = TPBlock()
        else:
            torch.manual_seed(0)
            model = TPBlock()
        parallelize(model, mesh["tp"], TP_PLAN)
        if kind == "dims":
            vefsdp_optim.fully_shard(model, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"),
                                     reshard_after_forward=False)
        else:
            vefsdp_optim.fully_shard(model, mesh=mesh["dp"])
        if kind == "meta":
            model.to_empty(device="cpu")
            set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))
        return model

    out: dict[str, object] = {}
    params = {}
    for kind in ("eager", "meta", "dims") if DataParallelMeshDims is not None else ("eager", "meta"):
        model = build(kind)
        model.unshard()
        model.reshard()
        opt = make_optimizer("muon", model.parameters())
        for step in range(2):
            x = torch.randn(3, 5, 10, generator=torch.Generator().manual_seed(step + dist.get_rank() // 2))
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        params[kind] = [gathered(p).detach() for p in model.parameters()]
    out["meta_equal"] = all(torch.equal(a, b) for a, b in zip(params["meta"], params["eager"], strict=True))
    if "dims" in params:
        out["dims_equal"] = all(torch.equal(a, b) for a, b in zip(params["dims"], params["eager"], strict=True))
    return out


def test_fully_shard_tp_meta_init_dp_mesh_dims_module_api() -> None:
    from vefsdp_optim._torch_compat import DataParallelMeshDims

    # torch 2.11 has no DataParallelMeshDims (tests/test_dp_mesh_dims.py tests its error)
    expect = {"meta_equal": True} | ({"dims_equal": True} if DataParallelMeshDims is not None else {})
    for r in run_distributed(_meta_and_dims, 4):
        assert r == expect, r


@pytest.mark.parametrize("name", ["torch_adamw", "torch_sgd"])
def test_torch_optimizers_on_fully_shard_tp(name: str) -> None:
    """torch's own optimizers step our fully_shard + TP parameters (elementwise ops on the
    local runs), equal to one device."""
    for r in run_distributed(_train_nd, 4, name, (2, 2), ("dp", "tp"), 3, False, "ours"):
        assert r["worst"] == 0.0, r


def _partial_refused() -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard

    import vefsdp_optim as vo

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    good = nn.Parameter(DTensor.from_local(torch.zeros(3, 4), mesh, [Shard(0), Shard(1)]))
    bad = nn.Parameter(DTensor.from_local(torch.zeros(3, 4), mesh, [Shard(0), Partial()]))
    out = []
    for cls in (vo.AdamW, vo.Muon, vo.AdamW8bit, vo.Shampoo):
        try:
            cls([("good", good), ("up.weight", bad)])
            out.append("no error")
        except ValueError as e:
            out.append(str(e))
    return out


def test_unsupported_placement_named_at_construction() -> None:
    for msgs in run_distributed(_partial_refused, 4):
        for m in msgs:
            assert "'up.weight'" in m and "P(sum)" in m and "not supported" in m, m


def _sequence_parallel_grads() -> dict[str, bool]:
    """A sequence-parallel norm (its weight's gradient is a Partial sum over tp) under our
    fully_shard, with the gradient copy-in (the default) and in place, against FSDP2."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as fsdp2_shard
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    import vefsdp_optim

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    grads = {}
    for kind in ("fsdp2", "copy_in", "in_place"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.RMSNorm(8), nn.Linear(8, 16, bias=False), nn.Linear(16, 8, bias=False))
        parallelize_module(model, mesh["tp"], {"0": SequenceParallel(),
                                               "1": ColwiseParallel(input_layouts=Shard(1)),
                                               "2": RowwiseParallel(output_layouts=Shard(1))})
        (fsdp2_shard if kind == "fsdp2" else vefsdp_optim.fully_shard)(model, mesh=mesh["dp"])
        if kind == "in_place":
            model.set_gradient_copy_in(False)
        x = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(torch.distributed.get_rank()))
        model(x).pow(2).sum().backward()
        grads[kind] = [p.grad.full_tensor() for p in model.parameters()]
    return {kind: all(torch.equal(a, b) for a, b in zip(grads[kind], grads["fsdp2"], strict=True))
            for kind in ("copy_in", "in_place")}


def test_fully_shard_tp_sequence_parallel_norm_grads() -> None:
    for r in run_distributed(_sequence_parallel_grads, 4):
        assert r == {"copy_in": True, "in_place": True}, r
