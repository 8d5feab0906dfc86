"""torch's own optimizers on fully_shard parameters equal them on FSDP2 DTensors.

Every configuration torch's optimizer test database (optim_db, through
tests/torch_optim_db.py) generates for CPU float32 runs a few steps three times on the
same model, data and loss (the same on every rank): on vefsdp_optim.fully_shard
parameters, on torch's FSDP2 (torch.distributed.fsdp.fully_shard) DTensors, and on a
single device fed gradients rounded as the W-rank average rounds them. The full
parameters must agree: bit for bit where the optimizer is elementwise (its fused,
foreach and for-loop forms alike), within a stated tolerance where a reduction is
ordered differently ([Note: sharded dispatch] gathers, DTensor sums partials).
"""

from __future__ import annotations

import copy
import functools
import math
from typing import Any

import pytest
import torch
from dist_utils import run_distributed
from torch import nn
from torch_optim_db import OptimConfig, cpu_float32_configs

STEPS = 3

# Where the result may differ from bit-for-bit, the tolerance (max |a - b| / max |b| over
# each parameter) and why; every other configuration must be bitwise equal.
# vs FSDP2:
#   Muon: Newton-Schulz in bfloat16. fully_shard gathers the matrix and runs exactly the
#     single-device matmuls; DTensor multiplies row shards and sums partial norms, and a
#     flipped bf16 rounding moves an update element by 2^-8 (observed: 1e-4 to 4e-3).
# vs FSDP2 and the single device:
#   fused=True: torch's CPU fused kernels (Adam, AdamW, SGD, Adagrad) compute the vector
#     body and the scalar tail of each tensor slightly differently, so an element's last
#     bit depends on its position in the tensor it is stepped in: a slice moves it (about
#     1 trial in 100 flips an element of a 65-element tensor cut at 52). Observed: FSDP2
#     off by 1e-9 in one element; fully_shard bitwise equal to the single device so far.
# vs the single device:
#   Adafactor: the parameter's RMS (alpha) is a partial-sum norm on the slices.
# LBFGS, Adafactor, Rprop and the fused SGD / Adagrad raise on FSDP2 (uneven flatten,
# in-place ops on partial norms, boolean-mask index_put_, no sharding strategy for
# _fused_sgd_ / _fused_adagrad_ / _foreach_copy_): there only the single device is compared.
FSDP2_RAISES = {"LBFGS", "Adafactor", "Rprop"}
FSDP2_RAISES_FUSED = {"SGD", "Adagrad"}
FSDP2_TOL = {"Muon": 2e-2}
FUSED_TOL = 1e-6
SINGLE_TOL = {"Adafactor": 1e-6}


def _model(two_d_only: bool) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 13, bias=not two_d_only), nn.Tanh(),
                         nn.Linear(13, 5, bias=not two_d_only))


def _average_like_ranks(model: nn.Module, w: int) -> None:
    """Round each gradient as the average of w ranks' identical gradients rounds it."""
    for p in model.parameters():
        if p.grad is not None:
            s = p.grad.clone()
            for _ in range(w - 1):
                s = s + p.grad
            p.grad = s / w


def _train(model: nn.Module, cfg: OptimConfig, data: torch.Tensor, average_over: int = 1) -> list[torch.Tensor]:
    opt = getattr(torch.optim, cfg.optim)(model.parameters(), **copy.deepcopy(cfg.kwargs))
    for x in data:
        def closure(x: torch.Tensor = x) -> torch.Tensor:
            opt.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            if average_over > 1:
                _average_like_ranks(model, average_over)
            return loss

        if cfg.needs_closure:
            opt.step(closure)  # as torch's own tests step LBFGS
        else:
            closure()
            opt.step()
    return [p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone() for p in model.parameters()]


def _attempt(fn: Any, *args: Any) -> tuple[list[torch.Tensor] | None, str | None]:
    try:
        return fn(*args), None
    except Exception as e:  # noqa: BLE001 - recorded and asserted on by the test
        return None, f"{type(e).__name__}: {str(e)[:400]}"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _diff(a: list[torch.Tensor] | None, b: list[torch.Tensor] | None) -> tuple[float, bool] | None:
    """(max relative difference, bit for bit). Bits, not torch.equal: a run that diverges
    to NaN on both sides alike (torch 2.14's LBFGS [maximize] maximizes a square) is equal."""
    if a is None or b is None:
        return None
    if all(torch.equal(_bits(x), _bits(y)) for x, y in zip(a, b, strict=True)):
        return 0.0, True
    rel = max(((x - y).abs().max() / y.abs().max().clamp(min=1e-30)).item() for x, y in zip(a, b, strict=True))
    return rel, False


def _one(cfg: OptimConfig) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard as fsdp2_shard

    import vefsdp_optim

    data = torch.randn(STEPS, 4, 7, generator=torch.Generator().manual_seed(1))
    base = _model(two_d_only=cfg.optim == "Muon")  # torch's Muon takes 2-D parameters only
    ours, theirs, ref = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    vefsdp_optim.fully_shard(ours[0])
    vefsdp_optim.fully_shard(ours)
    fsdp2_shard(theirs[0])
    fsdp2_shard(theirs)
    got, ours_err = _attempt(_train, ours, cfg, data)
    fsdp2, fsdp2_err = _attempt(_train, theirs, cfg, data)
    single, single_err = _attempt(_train, ref, cfg, data, dist.get_world_size())
    return {"cfg": f"{cfg.optim} [{cfg.desc}]", "optim": cfg.optim,
            "fused": bool(cfg.kwargs.get("fused")), "ours_err": ours_err, "single_err": single_err,
            "fsdp2_err": fsdp2_err, "vs_fsdp2": _diff(got, fsdp2), "vs_single": _diff(got, single)}


def _run(configs: list[OptimConfig]) -> list[dict[str, Any]]:
    return [_one(c) for c in configs]


def _check(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["ours_err"] is None and r["single_err"] is None, (r["cfg"], r["ours_err"], r["single_err"])
        if r["fsdp2_err"] is not None:  # only where FSDP2 is known to raise, else we'd compare less
            assert r["optim"] in FSDP2_RAISES or (r["fused"] and r["optim"] in FSDP2_RAISES_FUSED), r
        fused_tol = FUSED_TOL if r["fused"] else 0.0
        for key, tol in (("vs_fsdp2", FSDP2_TOL.get(r["optim"], fused_tol)),
                         ("vs_single", SINGLE_TOL.get(r["optim"], fused_tol))):
            if r[key] is None:  # FSDP2 raised: compared with the single device only
                continue
            rel, bitwise = r[key]
            assert bitwise if tol == 0.0 else (math.isfinite(rel) and rel <= tol), (r["cfg"], key, rel)


@functools.cache
def _tiers() -> dict[str, list[OptimConfig]]:
    """Read once, in the test process only: the ranks get the rows they run (importing
    torch.testing._internal in every spawned rank would cost seconds)."""
    runnable = [c for c in cpu_float32_configs() if c.skip is None]
    base = [c for c in runnable if not c.kwargs.get("foreach")]  # torch's own configurations
    # the first configuration of each optimizer and implementation: the quick tier (W = 2, 3)
    firsts = list({(c.optim, bool(c.kwargs.get("fused"))): c for c in reversed(base)}.values())[::-1]
    return {"torch": base, "firsts": firsts, "foreach": [c for c in runnable if c.kwargs.get("foreach")]}


def test_database_is_covered() -> None:
    configs = cpu_float32_configs()
    assert {"AdamW", "Muon", "LBFGS", "Adafactor", "SGD", "Rprop"} <= {c.optim for c in configs}
    assert {c.optim for c in configs if c.skip} == {"SparseAdam"}
    assert any(c.kwargs.get("fused") for c in _tiers()["torch"]) and _tiers()["foreach"]


@pytest.mark.parametrize(("world_size", "tier"), [
    pytest.param(2, "firsts", marks=pytest.mark.slow),  # W = 3 (uneven) stays quick
    (3, "firsts"),
    # every configuration: ~25 s at W = 2 on 2 cores, in the full tier (make test-fast's budget)
    pytest.param(2, "torch", marks=pytest.mark.slow),
    pytest.param(3, "torch", marks=pytest.mark.slow),
    pytest.param(2, "foreach", marks=pytest.mark.slow),
    pytest.param(3, "foreach", marks=pytest.mark.slow),
])
def test_optim_db_on_fully_shard(world_size: int, tier: str) -> None:
    configs = _tiers()[tier]
    for rank_results in run_distributed(_run, world_size, configs, timeout=600):
        assert len(rank_results) == len(configs)
        _check(rank_results)


# -- the dispatch rules themselves ([Note: sharded dispatch]) -------------------------------

def _rules() -> dict[str, Any]:
    import vefsdp_optim
    from vefsdp_optim import ShardedParameter

    model = _model(two_d_only=False)
    ref = copy.deepcopy(model)
    vefsdp_optim.fully_shard(model)
    p, w = model[0].weight, ref[0].weight.detach()  # (13, 7), a ragged slice on each rank
    out: dict[str, Any] = {}
    with torch.no_grad():
        v = p.view(-1)  # rule 2: flat order kept, a true view
        out["flat_view"] = isinstance(v, ShardedParameter) and v.to_local().data_ptr() == p.to_local().data_ptr()
        v.mul_(2.0)
        out["flat_view_writes"] = torch.equal(p.full_tensor(), w * 2)
        p.copy_(w)
        full = torch.randn(13, 7, generator=torch.Generator().manual_seed(2))
        p.add_(full)  # rule 1: a plain operand of the global shape gives this rank's slice
        out["plain_operand"] = torch.equal(p.full_tensor(), w + full)
        p.copy_(w)
        out["broadcast_operand"] = torch.equal((p * w[0]).full_tensor(), w * w[0])
        t = p.t()  # rule 5: gathered, a plain copy
        out["transpose"] = type(t) is torch.Tensor and torch.equal(t, w.t())
        out["mm"] = torch.equal(torch.mm(p, p.t()), w @ w.t())
        out["dim_reductions"] = (torch.equal(p.sum(0), w.sum(0))
                                 and torch.equal(p.mean(-1, keepdim=True), w.mean(-1, keepdim=True))
                                 and torch.equal(torch.linalg.vector_norm(p, dim=1),
                                                 torch.linalg.vector_norm(w, dim=1)))
        q = torch.zeros_like(p)
        a, b = torch.randn(13, 4), torch.randn(4, 7)
        r = torch.mm(a, b, out=q)  # a sharded out= gets its slice of the result
        out["out_sharded"] = r is q and torch.equal(q.full_tensor(), a @ b)
        q.copy_(w)
        q[q > 0] = 0.5  # boolean-mask index_put_ of the same layout: local
        out["mask_put"] = torch.equal(q.full_tensor(), torch.where(w > 0, 0.5, w))
        out["item"] = p.sum().item() == w.sum().item() and p.max().item() == w.max().item()
        out["new_zeros"] = type(p.new_zeros(13, 1)) is torch.Tensor
        # an in-place random fill draws what one device draws (rule 6), then keeps the slice
        torch.manual_seed(7)
        q.normal_()
        torch.manual_seed(7)
        out["random_fill"] = torch.equal(q.full_tensor(), torch.empty(q.shape).normal_())
        out["norms"] = (torch.equal(torch.linalg.vector_norm(p, -math.inf), w.abs().min())
                        and torch.linalg.vector_norm(p, keepdim=True).shape == (1, 1))
        refusals = {
            "t_": lambda: p.t_(),
            "bernoulli": lambda: torch.bernoulli(p.abs().clamp(0, 1)),
            "fused_plain": lambda: torch._fused_sgd_([p], [full], [], weight_decay=0.0, momentum=0.0, lr=0.1,
                                                      dampening=0.0, nesterov=False, maximize=False,
                                                      is_first_step=False),
        }
        for name, fn in refusals.items():
            try:
                fn()
                out[name] = "no error"
            except NotImplementedError as e:
                out[name] = str(e)
        try:
            p + model[2].weight
            out["mixed_layouts"] = "no error"
        except ValueError as e:
            out["mixed_layouts"] = str(e)
    # a fused kernel's lists may mix sharded and plain parameters (one param group)
    extra, extra_ref = nn.Parameter(torch.randn(6)), nn.Parameter(torch.randn(6))
    with torch.no_grad():
        extra_ref.copy_(extra)
    x = torch.randn(4, 7)
    for net, e in ((model, extra), (ref, extra_ref)):
        (net(x).square().mean() + e.square().sum()).backward()
    _average_like_ranks(ref, torch.distributed.get_world_size())
    torch.optim.AdamW([*model.parameters(), extra], fused=True).step()
    torch.optim.AdamW([*ref.parameters(), extra_ref], fused=True).step()
    out["fused_mixed"] = torch.equal(extra, extra_ref) and all(
        torch.equal(a.full_tensor(), b) for a, b in zip(model.parameters(), ref.parameters(), strict=True))
    return out


def test_dispatch_rules() -> None:
    for res in run_distributed(_rules, 3):
        assert all(v is True for v in res.values() if isinstance(v, bool)), res
        assert "aten.t_" in res["t_"] and "supported" in res["t_"], res["t_"]
        assert "aten.bernoulli" in res["bernoulli"] and "random" in res["bernoulli"], res["bernoulli"]
        assert "_fused_sgd_" in res["fused_plain"] and "plain tensor" in res["fused_plain"], res["fused_plain"]
        assert "differ in shape or layout" in res["mixed_layouts"], res["mixed_layouts"]
