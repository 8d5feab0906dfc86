"""The step plan ([Note: step plan] in vefsdp_optim/_step_plan.py): built at the first step,
reused while nothing it depends on changes, rebuilt when something does.

Each case changes one input of the plan between two steps: a parameter's storage or
``.data`` (new storage, a view of another shape), the param list (an entry replaced or
removed), ``add_param_group``, a plan key (Muon's ``num_heads``), which parameters have
gradients, ``load_state_dict``; and, as controls, nothing and an ``lr`` edit (no
rebuild). The reference is the same optimizer whose plan is built afresh before every
step, on its own copies of the parameters; the parameters must agree bit for bit, and
the plan object must be kept exactly where nothing changed. The sharded case runs
``fully_shard`` at W = 2 and 3 (uneven shapes; Muon's whole matrices on owners and 8-bit
Adam's blocks exchanged) against the one-device reference.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dist_utils import average_like_ranks, run_distributed
from torch import nn

import vefsdp_optim

SHAPES = [(8, 5), (13,), (6, 9), (5, 4)]
KWARGS: dict[str, dict[str, Any]] = {
    "AdamW": dict(lr=1e-2, weight_decay=0.1),
    "AdamW8bit": dict(lr=1e-2, weight_decay=0.1, block_size=16, min_8bit_size=16),
    "Muon": dict(lr=1e-2, weight_decay=0.1),
    "Shampoo": dict(lr=1e-2, max_preconditioner_dim=4, precondition_frequency=1,
                    start_preconditioning_step=1),
}
# change -> whether the plan is kept across it
CHANGES = {"none": True, "lr": True, "data_swap": False, "data_view": False, "param_replaced": False,
           "param_removed": False, "add_group": False, "grad_none": False, "plan_key": False,
           "load_state_dict": False}


def _init(i: int, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    return torch.randn(shape or SHAPES[i], generator=torch.Generator().manual_seed(7 + i))


def _grad(k: int, i: int, shape: torch.Size) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 * k + i))


def _make(name: str, params: list[torch.Tensor]) -> vefsdp_optim.BlockOptimizer:
    return getattr(vefsdp_optim, name)([{"params": params[:2]}, {"params": [params[2]], "lr": 2e-2}],
                                       **KWARGS[name])


def _change(change: str, name: str, opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[bool]:
    """Apply ``change``; returns which parameters get gradients from now on."""
    used = [True, True, True, False]
    with torch.no_grad():
        if change == "lr":
            opt.param_groups[0]["lr"] = 5e-3
        elif change == "data_swap":
            params[0].data = params[0].detach() * 0.5 + 0.125
        elif change == "data_view":  # the same storage as another shape
            params[0].data = params[0].data.view(5, 8)
        elif change == "param_replaced":
            params[0] = opt.param_groups[0]["params"][0] = nn.Parameter(_init(9, SHAPES[0]))
        elif change == "param_removed":
            opt.param_groups[0]["params"].pop()
            used[1] = False
        elif change == "add_group":
            opt.add_param_group({"params": [params[3]], "lr": 5e-3})
            used[3] = True
        elif change == "grad_none":
            used[2] = False
        elif change == "plan_key":  # Muon: each matrix of group 0 in two row blocks
            opt.param_groups[0]["num_heads" if name == "Muon" else "lr"] = 2 if name == "Muon" else 5e-3
        elif change == "load_state_dict":
            opt.load_state_dict(opt.state_dict())
    return used


def _run(name: str, change: str, fresh: bool) -> tuple[list[torch.Tensor], list[bool]]:
    """Four steps with ``change`` after the second; ``fresh``: the plan is dropped before
    every step. Returns the parameters and, per step after the first, whether the plan
    object was kept."""
    params = [nn.Parameter(_init(i)) for i in range(len(SHAPES))]
    opt = _make(name, params)
    used = [True, True, True, False]
    kept, last = [], None
    for k in range(4):
        if k == 2:
            used = _change(change, name, opt, params)
        for i, p in enumerate(params):
            p.grad = _grad(k, i, p.shape) if used[i] else None
        if fresh:
            opt._planner.plan = None
        opt.step()
        if k:
            kept.append(opt._planner.plan is last)
        last = opt._planner.plan
    return [p.detach().clone() for p in params], kept


@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "Shampoo" else n for n in KWARGS])
def test_plan_reused_and_rebuilt_as_fresh(name: str, change: str) -> None:
    if change == "plan_key" and name != "Muon":
        pytest.skip("only Muon has a plan key to edit here")
    if change == "data_view" and name == "Shampoo":
        pytest.skip("Shampoo's state is shaped by the matrix: another shape cannot reuse it")
    got, kept = _run(name, change, fresh=False)
    want, _ = _run(name, change, fresh=True)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"{name}, {change}: parameter {i} differs from the fresh plan's"
    # steps 1 and 3 change nothing; step 2 follows the change
    assert kept == [True, CHANGES[change], True], (name, change, kept)


def test_plan_survives_in_place_writes() -> None:
    """In-place writes (p.data.copy_, a scheduler's lr) keep the plan and the bits."""
    params = [nn.Parameter(_init(i)) for i in range(3)]
    opt = vefsdp_optim.AdamW(params, lr=1e-2)
    ref = torch.optim.AdamW([nn.Parameter(_init(i)) for i in range(3)], lr=1e-2, foreach=True)
    plans = []
    for k in range(3):
        for ps in (params, [p for g in ref.param_groups for p in g["params"]]):
            with torch.no_grad():
                ps[0].data.mul_(0.75)
            for i, p in enumerate(ps):
                p.grad = _grad(k, i, p.shape)
        opt.step()
        ref.step()
        plans.append(opt._planner.plan)
    assert plans[0] is plans[1] is plans[2]
    for a, b in zip(params, ref.param_groups[0]["params"], strict=True):
        assert torch.equal(a, b)


OPTIMIZERS = {"AdamW": {}, "AdamW8bit": dict(min_8bit_size=16), "Adam8bit": dict(min_8bit_size=16), "Muon": {},
              "NorMuon": {}, "Shampoo": {}, "SOAP": {}}


def _grads_held(params: list[nn.Parameter]) -> list[int]:
    """After zero_grad(): the references to each last gradient's storage besides ``grads``'s."""
    from vefsdp_optim._torch_compat import storage_use_count

    return [storage_use_count(g) - 2 for g in params]  # (g itself and the storage object asked)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_step_keeps_no_gradient_alive(name: str) -> None:
    """As torch.optim: after a step and zero_grad() (set_to_none), nothing of the optimizer
    holds the step's gradients, 2-D (stepped through a flat view) or 1-D, so their memory
    is free for the next backward; torch.optim.AdamW as the control."""
    for cls in (getattr(vefsdp_optim, name), torch.optim.AdamW):
        params = [nn.Parameter(_init(0, (12, 10))), nn.Parameter(_init(1, (10,)))]
        kw = OPTIMIZERS[name] if cls is not torch.optim.AdamW else {}
        opt = cls(params, lr=1e-2, **kw)
        for k in range(3):
            for i, p in enumerate(params):
                p.grad = _grad(k, i, p.shape)
            opt.step()
        grads = [p.grad for p in params]
        opt.zero_grad()
        assert all(p.grad is None for p in params)
        assert _grads_held(grads) == [0, 0], (cls.__name__, _grads_held(grads))


def test_plan_rebuild_raises_a_bad_gradient() -> None:
    """A gradient the step cannot take, after the plan was built, raises as on a first step."""
    p = nn.Parameter(torch.randn(4, 3))
    opt = vefsdp_optim.AdamW([p], lr=1e-2)
    p.grad = torch.randn(4, 3)
    opt.step()
    p.grad = torch.randn(3, 4).t()
    with pytest.raises(NotImplementedError, match="non-contiguous"):
        opt.step()
    p.grad = torch.randn(4, 3).to_sparse()
    with pytest.raises(NotImplementedError, match="sparse"):
        opt.step()


# -- fully_shard at W = 2 and 3 ------------------------------------------------------------------


class _Bag(nn.Module):
    """forward(gs) = sum(p * g): each used parameter's gradient is g (averaged over ranks)."""

    def __init__(self) -> None:
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(_init(i)) for i in range(len(SHAPES))])

    def forward(self, gs: list[torch.Tensor | None]) -> torch.Tensor:
        return sum((p * g).sum() for p, g in zip(self.ps, gs, strict=True) if g is not None)


def _sharded(name: str) -> dict[str, Any]:
    import torch.distributed as dist

    torch.set_num_threads(1)
    world = dist.get_world_size()
    model = vefsdp_optim.fully_shard(_Bag())
    params = list(model.ps)
    ref_params = [nn.Parameter(_init(i)) for i in range(len(SHAPES))]
    opt, ref = _make(name, params), _make(name, ref_params)
    kept, last = [], None
    for k in range(5):
        used = [True, True, k != 2, False]  # parameter 2 without a gradient at step 2
        if k == 3 and name == "Muon":  # a plan key
            for o in (opt, ref):
                o.param_groups[0]["num_heads"] = 2
        if k == 4:  # drops the plan
            opt.load_state_dict(opt.state_dict())
        gs = [_grad(k, i, torch.Size(SHAPES[i])) if u else None for i, u in enumerate(used)]
        model(gs).backward()
        for p, g in zip(ref_params, gs, strict=True):
            p.grad = None if g is None else average_like_ranks(g, world)
        opt.step()
        ref._planner.plan = None
        ref.step()
        opt.zero_grad()
        if k:
            kept.append(opt._planner.plan is last)
        last = opt._planner.plan
    full = [p.full_tensor() for p in params]
    return dict(equal=[torch.equal(a, b.detach()) for a, b in zip(full, ref_params, strict=True)], kept=kept)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", ["Muon", "AdamW8bit"])
def test_plan_on_fully_shard_equals_one_device(name: str, world: int) -> None:
    for rank, res in enumerate(run_distributed(_sharded, world, name)):
        assert all(res["equal"]), (name, world, rank, res)
        # step 1 keeps it; 2 (a gradient fewer), 3 (one more again; Muon: num_heads) and 4
        # (load_state_dict) rebuild it
        assert res["kept"] == [True, False, False, False], (name, world, rank, res)


def _fsdp2_grads_held() -> dict[str, list[int]]:
    from sharded_bag import set_full_grads, shard_bag

    out = {}
    for name in ("AdamW", "Muon", "AdamW8bit", "torch"):  # torch.optim.AdamW: the control
        model = shard_bag("fsdp2", {"a": _init(0, (12, 10)), "b": _init(1, (7, 5)), "c": _init(2, (10,))})
        opt = (torch.optim.AdamW(model.parameters(), lr=1e-2) if name == "torch" else
               getattr(vefsdp_optim, name)(model.parameters(), lr=1e-2, **OPTIMIZERS[name]))
        shapes = {key: p.shape for key, p in model.named_parameters()}
        for k in range(2):
            set_full_grads(model, lambda key, k=k, shapes=shapes: _grad(k, ord(key), shapes[key]))
            opt.step()
        grads = [p.grad.to_local() for p in model.parameters()]
        opt.zero_grad()
        out[name] = _grads_held(grads)
    return out


@pytest.mark.slow
def test_step_keeps_no_fsdp2_gradient_alive() -> None:
    """The same on FSDP2 parameters at W = 3 (uneven shards; Muon's matrices moved to
    owners): after zero_grad() each rank's local gradient shards are held by as many
    references as with torch.optim.AdamW (FSDP2's own), none of ours."""
    for rank, held in enumerate(run_distributed(_fsdp2_grads_held, 3)):
        assert all(h == held["torch"] for h in held.values()), (rank, held)


# -- FSDP2 at W = 3: the identities of ``identity`` in vefsdp_optim/_step_plan.py ----------------------------


def _fsdp2_identities(name: str) -> dict[str, Any]:
    """FSDP2 parameters stepped after real backwards (each gradient on its parameter's
    spec object, as FSDP2 builds them) against one device fed the averaged gradients:
    per step, the fresh views the plan asked for and whether it kept the plan. Step 3
    gives every parameter a new local tensor over the same storage (kept, its identity
    taken afresh); step 4 is steady again."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import vefsdp_optim._step_plan as step_plan
    from vefsdp_optim._torch_compat import dtensor_local

    torch.set_num_threads(1)
    world = dist.get_world_size()
    model = _Bag()
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    params = list(model.ps)
    ref_params = [nn.Parameter(_init(i)) for i in range(len(SHAPES))]
    opt, ref = _make(name, params), _make(name, ref_params)
    views = [0]
    real_view, real_grad_view = step_plan.sharded_view, step_plan.step_grad_view

    def counted(fn):
        def wrapper(t):
            views[0] += 1
            return fn(t)
        return wrapper

    step_plan.sharded_view, step_plan.step_grad_view = counted(real_view), counted(real_grad_view)
    try:
        counts, kept, last = [], [], None
        for k in range(5):
            used = [True, True, True, False]
            if k == 3:
                for p in params:
                    local = dtensor_local(p)
                    p._local_tensor = local.view(local.shape)  # a new object, the same storage
            gs = [_grad(k, i, torch.Size(SHAPES[i])) if u else None for i, u in enumerate(used)]
            model(gs).backward()
            for p, g in zip(ref_params, gs, strict=True):
                p.grad = None if g is None else average_like_ranks(g, world)
            views[0] = 0
            opt.step()
            counts.append(views[0])
            ref.step()
            opt.zero_grad()
            ref.zero_grad()
            if k:
                kept.append(opt._planner.plan is last)
            last = opt._planner.plan
    finally:
        step_plan.sharded_view, step_plan.step_grad_view = real_view, real_grad_view
    full = [p.full_tensor() for p in params]
    return dict(equal=[torch.equal(a, b.detach()) for a, b in zip(full, ref_params, strict=True)], kept=kept,
                counts=counts)


@pytest.mark.parametrize("name", ["Muon", "AdamW"])
def test_plan_identities_on_fsdp2(name: str) -> None:
    """On FSDP2 parameters a steady step takes no fresh view of a parameter or of its
    gradient; a parameter's new local tensor over the same storage keeps the plan (one
    step of fresh views), and the bits equal one device's throughout."""
    for rank, res in enumerate(run_distributed(_fsdp2_identities, 3, name)):
        assert all(res["equal"]), (name, rank, res)
        assert res["kept"] == [True, True, True, True], (name, rank, res)
        counts = res["counts"]
        # step 0 builds (views of every parameter and gradient); step 1 views the
        # gradients once more (their spec not yet known); then none, but at step 3
        assert counts[2] == counts[4] == 0 and counts[1] > 0 and counts[3] > 0, (name, rank, counts)


def _fsdp2_bad_grad() -> list[str]:
    """A gradient on its parameter's own spec object but with a local tensor of another
    shape, after the plan was built: the error of a first step, from both."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from vefsdp_optim._torch_compat import dtensor_local, dtensor_spec

    model = _Bag()
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    p = model.ps[0]
    errors = []
    for fresh in (False, True):
        opt = vefsdp_optim.AdamW(model.parameters(), lr=1e-2)
        gs = [_grad(0, i, torch.Size(SHAPES[i])) for i in range(len(SHAPES))]
        if not fresh:
            for _ in range(2):
                model(gs).backward()
                opt.step()
        model(gs).backward()
        local = dtensor_local(p.grad)
        p.grad = DTensor(local.new_zeros(local.numel() + 1), dtensor_spec(p), requires_grad=False)
        try:
            opt.step()
        except NotImplementedError as e:
            errors.append(str(e))
        opt.zero_grad()
    return errors


def test_plan_on_fsdp2_raises_a_bad_gradient_on_its_spec() -> None:
    for rank, errors in enumerate(run_distributed(_fsdp2_bad_grad, 3)):
        assert len(errors) == 2 and errors[0] == errors[1] and "padded local tensors" in errors[0], (rank, errors)
