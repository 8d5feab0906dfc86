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
            opt._step_plan = None
        opt.step()
        if k:
            kept.append(opt._step_plan is last)
        last = opt._step_plan
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
        plans.append(opt._step_plan)
    assert plans[0] is plans[1] is plans[2]
    for a, b in zip(params, ref.param_groups[0]["params"], strict=True):
        assert torch.equal(a, b)


def test_kept_gradients_written_and_moved_in_place() -> None:
    """A .grad kept between steps (zero_grad(set_to_none=False), static CUDA-graph
    gradients) reuses its flat view; written in place, given another storage in place
    (``.data =``, ``set_``), or made another shape of the same elements: every step still
    reads this step's values, bit for bit torch.optim.AdamW's."""
    shapes = [(6, 7), (5,), (4, 3, 2)]
    params = [nn.Parameter(_init(i, s)) for i, s in enumerate(shapes)]
    refs = [nn.Parameter(_init(i, s)) for i, s in enumerate(shapes)]
    opt = vefsdp_optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(refs, lr=1e-2, weight_decay=0.1, foreach=True)
    for p in params:
        p.grad = torch.zeros_like(p)
    for k in range(7):
        new = [_grad(k, i, p.shape) for i, p in enumerate(params)]
        with torch.no_grad():
            for p, g in zip(params, new, strict=True):
                if k in (0, 1, 2, 6):  # written in place
                    p.grad.copy_(g)
                elif k == 3:  # another storage, the same tensor object
                    p.grad.data = g.clone()
                elif k == 4:
                    p.grad.set_(g.clone())
                else:  # k == 5: the elements in another shape, then back in place
                    p.grad.set_(g.clone().view(-1))
                    p.grad.set_(p.grad.view(g.shape))
        for r, g in zip(refs, new, strict=True):
            r.grad = g
        opt.step()
        ref.step()
        for i, (a, b) in enumerate(zip(params, refs, strict=True)):
            assert torch.equal(a, b), f"step {k}, parameter {i}"


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
        ref._step_plan = None
        ref.step()
        opt.zero_grad()
        if k:
            kept.append(opt._step_plan is last)
        last = opt._step_plan
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
