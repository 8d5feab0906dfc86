"""fully_shard'd modules are torch FSDPModules, and FSDP2's methods do what FSDP2's do.

Each check runs the same model, data and loss with torch's FSDP2 and with
vefsdp_optim.fully_shard, applies the same FSDPModule calls to both, and compares the
full gradients (and a plain single-device reference where one exists).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from torch import nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

import vefsdp_optim
from vefsdp_optim._torch_compat import ALL_GATHER_NAME

RTOL = 1e-6


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.blocks = nn.Sequential(nn.Linear(6, 13), nn.Tanh(), nn.Linear(13, 6))
        self.out = nn.Linear(6, 5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.emb(tokens)))


def _pair() -> tuple[nn.Module, nn.Module, nn.Module]:
    from torch.distributed.fsdp import fully_shard as fsdp2

    torch.manual_seed(0)
    ref = Net()
    ours, theirs = copy.deepcopy(ref), copy.deepcopy(ref)
    for m, shard in ((ours, vefsdp_optim.fully_shard), (theirs, fsdp2)):
        shard(m.emb)
        shard(m.blocks)
        shard(m)
    return ref, ours, theirs


def _grads(m: nn.Module) -> list[torch.Tensor]:
    return [(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
            for p in m.parameters()]


def _rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max() / y.abs().max().clamp_min(1e-30)) for x, y in zip(a, b, strict=True))


def _backward(m: nn.Module, step: int = 0) -> None:
    tokens = torch.randint(0, 11, (4, 3), generator=torch.Generator().manual_seed(step))
    m(tokens).square().sum().backward()


def _api() -> dict[str, object]:
    w = dist.get_world_size()
    out: dict[str, object] = {}
    ref, ours, theirs = _pair()
    out["isinstance"] = all(isinstance(m, TorchFSDPModule) for m in (ours, ours.emb, ours.blocks))
    out["container_index"] = type(ours.blocks[0:2]) is nn.Sequential  # torch's __new__ rule
    # summed gradients, as frameworks that normalize the loss themselves ask for. FSDP2
    # reduces with PREMUL_SUM then, which gloo lacks ("Cannot use ReduceOp.PREMUL_SUM with
    # Gloo"): the reference is the single device (every rank has the same data, so the
    # sum is W times its gradient)
    for sub in ours.modules():
        if isinstance(sub, TorchFSDPModule):
            sub.set_gradient_divide_factor(1.0)
    for m in (ref, ours):
        _backward(m)
    g_ref = [w * g for g in _grads(ref)]
    out["sum_vs_single_bitwise"] = all(torch.equal(a, b) for a, b in zip(_grads(ours), g_ref, strict=True))
    # any other factor (FSDP2 needs PREMUL_SUM for it, which gloo lacks: against the single
    # device); and forced SUM collectives
    ref, ours, theirs = _pair()
    ours.set_gradient_divide_factor(3.5)
    ours.emb.set_gradient_divide_factor(3.5)
    ours.blocks.set_force_sum_reduction_for_comms(True)
    for m in (ref, ours):
        _backward(m, 1)
    want = _grads(ref)
    n_emb = len(list(ref.emb.parameters()))
    n_blocks = len(list(ref.blocks.parameters()))
    scale = [w / 3.5] * n_emb + [1.0] * n_blocks + [w / 3.5] * (len(want) - n_emb - n_blocks)
    out["factor_vs_single"] = _rel(_grads(ours), [s * g for s, g in zip(scale, want, strict=True)])
    # an all-reduce hook sees the reduced shard before it becomes .grad
    ref, ours, theirs = _pair()
    calls: list[int] = []

    def hook(t: torch.Tensor) -> None:
        calls.append(t.numel())
        t.mul_(2.0)

    for m in (ours, theirs):
        m.set_all_reduce_hook(hook)
    for m in (ours, theirs):
        _backward(m, 2)
    out["hook_vs_fsdp2"] = _rel(_grads(ours), _grads(theirs))
    out["hook_called"] = len(calls) >= 2
    # no reshard after backward; no unshard in backward for the embedding
    ref, ours, theirs = _pair()
    for m in (ours, theirs):
        m.blocks.set_reshard_after_backward(False)
        m.emb.set_unshard_in_backward(False)
    for m in (ref, ours, theirs):
        _backward(m, 3)
    from vefsdp_optim._fsdp._module import state_of

    out["kept_gathered"] = state_of(ours.blocks).shard_group.gathered
    for m in (ours, theirs):
        m.blocks.reshard()  # FSDP2 registers the sharded parameters (and their grads) again
    out["knobs_vs_fsdp2"] = _rel(_grads(ours), _grads(theirs))
    # an exception mid-forward, then reset_iter_state on the root: the next step is clean
    ref, ours, theirs = _pair()
    bad = torch.tensor([[99]])  # out of the embedding's range
    try:
        ours(bad)
    except IndexError:
        pass
    ours.reset_iter_state()
    for m in (ours, theirs):
        _backward(m, 4)
    out["after_reset_vs_fsdp2"] = _rel(_grads(ours), _grads(theirs))
    # what has no meaning here says so
    errs = []
    for call in (lambda: ours.set_custom_all_gather(None), lambda: ours.set_custom_reduce_scatter(None),
                 lambda: ours.set_symm_mem_for_comm(), lambda: ours.blocks.reset_iter_state()):
        try:
            call()
            errs.append(False)
        except (NotImplementedError, RuntimeError):
            errs.append(True)
    out["refusals"] = all(errs)
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_fsdp_module_api_matches_fsdp2(world_size: int) -> None:
    for res in run_distributed(_api, world_size):
        assert res["isinstance"] and res["container_index"], res
        assert res["sum_vs_single_bitwise"], res
        assert res["factor_vs_single"] < RTOL and res["hook_vs_fsdp2"] < RTOL and res["hook_called"], res
        assert res["kept_gathered"] and res["knobs_vs_fsdp2"] < RTOL, res
        assert res["after_reset_vs_fsdp2"] < RTOL and res["refusals"], res


def _module_list() -> dict[str, object]:
    from torch.distributed.fsdp import fully_shard as fsdp2

    out: dict[str, object] = {}
    torch.manual_seed(0)
    ref = Net()
    models = {"ours": copy.deepcopy(ref), "fsdp2": copy.deepcopy(ref)}
    for kind, m in models.items():
        shard = vefsdp_optim.fully_shard if kind == "ours" else fsdp2
        shard(m.blocks)
        got = shard([m.emb, m.out])  # one shard group of two modules, as frameworks shard norm + output together
        shard(m)
        out[f"{kind}_returns_list"] = isinstance(got, list) and len(got) == 2
    out["is_fsdp"] = isinstance(models["ours"].emb, TorchFSDPModule) and isinstance(models["ours"].out, TorchFSDPModule)
    calls: list[int] = []
    orig = getattr(torch.distributed, ALL_GATHER_NAME)

    def counted(*a, **k):  # noqa: ANN002, ANN003, ANN202
        calls.append(1)
        return orig(*a, **k)

    opts = {k: vefsdp_optim.AdamW(m.parameters(), lr=1e-2) for k, m in models.items()}
    for step in range(3):
        for k, m in models.items():
            opts[k].zero_grad()
            if k == "ours" and step == 2:
                setattr(torch.distributed, ALL_GATHER_NAME, counted)
            try:
                _backward(m, step)
            finally:
                setattr(torch.distributed, ALL_GATHER_NAME, orig)
            opts[k].step()
    out["gathers_per_step"] = len(calls)  # blocks and the [emb, out] group, forward + backward
    out["vs_fsdp2"] = max(float((a.full_tensor() - b.full_tensor()).abs().max())
                          for a, b in zip(models["ours"].parameters(), models["fsdp2"].parameters(), strict=True))
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_list_of_modules_is_one_group(world_size: int) -> None:
    for res in run_distributed(_module_list, world_size):
        assert res["ours_returns_list"] and res["fsdp2_returns_list"] and res["is_fsdp"], res
        assert res["vs_fsdp2"] < 1e-6, res
        assert res["gathers_per_step"] <= 4, res  # each group once in forward, once in backward


def _signature() -> dict[str, object]:
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
    from torch.distributed.tensor import Replicate, Shard

    out: dict[str, object] = {}
    m = Net()
    keep = m.out.bias
    vefsdp_optim.fully_shard(m.blocks, shard_placement_fn=lambda p: Shard(0), offload_policy=OffloadPolicy())
    vefsdp_optim.fully_shard(m, offload_policy=CPUOffloadPolicy(), ignored_params={keep},
                             reshard_after_forward=None)
    out["ignored_kept_plain"] = m.out.bias is keep and not isinstance(keep, vefsdp_optim.ShardedParameter)
    out["sharded"] = isinstance(m.out.weight, vefsdp_optim.ShardedParameter)
    # ``_check_placement`` in vefsdp_optim/_fsdp/_placement.py: Shard(d) of a dim of the parameter
    # is accepted, stored ragged
    out["shard1_accepted"] = isinstance(
        vefsdp_optim.fully_shard(nn.Linear(3, 4), shard_placement_fn=lambda p: Shard(p.dim() - 1)).weight,
        vefsdp_optim.ShardedParameter)
    for bad, err, words in ((Shard(2), ValueError, "dim 2 is out of range"),
                            (Replicate(), NotImplementedError, "accepts None, Shard(0) or Shard(d)")):
        try:
            vefsdp_optim.fully_shard(nn.Linear(3, 4), shard_placement_fn=lambda p, bad=bad: bad)
            out[f"{bad}_refused"] = False
        except err as e:
            out[f"{bad}_refused"] = words in str(e) and "weight" in str(e)
    try:  # FSDP2's per-parameter result (torch >= 2.13): its mesh, this call's or another
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp._fully_shard._fsdp_common import (
            FSDPMeshInfo,
            ShardPlacementResult,
        )
        from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info
    except ImportError:
        ShardPlacementResult = None
    if ShardPlacementResult is not None:
        here = init_device_mesh("cpu", (2,))
        two = init_device_mesh("cpu", (2, 1), mesh_dim_names=("a", "b"))
        from torch.distributed.fsdp._fully_shard._fsdp_common import HSDPMeshInfo

        hsdp = HSDPMeshInfo(two, shard_mesh_dim=1, replicate_mesh_dim=0)  # replicate 2, shard 1
        for key, info in (("here", _get_mesh_info(here)), ("other", _get_mesh_info(two["b"])),
                          ("hsdp", hsdp)):
            result = ShardPlacementResult(placement=Shard(0), mesh_info=info)
            lin = vefsdp_optim.fully_shard(nn.Linear(3, 4), mesh=here, shard_placement_fn=lambda p, r=result: r)
            out[f"result_{key}_accepted"] = lin.weight.ragged_layout.world_size == info.shard_mesh_size
        # a 2-D mesh whose dims are not (replicate, shard)
        result = ShardPlacementResult(placement=Shard(0), mesh_info=FSDPMeshInfo(two, shard_mesh_dim=0))
        try:
            vefsdp_optim.fully_shard(nn.Linear(3, 4), mesh=here, shard_placement_fn=lambda p, r=result: r)
            out["result_bad_dims_refused"] = False
        except NotImplementedError as e:
            out["result_bad_dims_refused"] = "replicate_mesh_dim=0, shard_mesh_dim=1" in str(e)
    _backward(m)
    out["trains"] = all(p.grad is not None for p in m.parameters())
    return out


def test_fully_shard_accepts_fsdp2_arguments() -> None:
    for res in run_distributed(_signature, 2):
        assert all(res.values()), res


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torchtitan's checkpoint ModelWrapper test (components/checkpointer/base.py):
    DTensors are looked through to their local tensor, any other tensor asked directly."""
    from torch.distributed.tensor import DTensor

    a = a._local_tensor if isinstance(a, DTensor) else a
    b = b._local_tensor if isinstance(b, DTensor) else b
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _storage() -> dict[str, object]:
    out: dict[str, object] = {}
    _, ours, theirs = _pair()
    for kind, m in (("ours", ours), ("fsdp2", theirs)):
        # a state-dict hook that makes a new tensor each call (a fused QKV split on save)
        m.out.register_state_dict_post_hook(
            lambda mod, sd, prefix, meta: sd.__setitem__(prefix + "weight_t", sd[prefix + "weight"].t() * 1))
        opt = vefsdp_optim.AdamW(m.parameters(), lr=1e-2)
        cached = m.state_dict()  # ModelWrapper's cache
        _backward(m)
        opt.step()
        fresh = m.state_dict()
        out[f"{kind}_params_shared"] = all(_shares_storage(cached[k], fresh[k]) for k in fresh if k != "out.weight_t")
        out[f"{kind}_hook_not_shared"] = not _shares_storage(cached["out.weight_t"], fresh["out.weight_t"])
        cached["out.weight_t"].copy_(fresh["out.weight_t"])  # what ModelWrapper does then
        out[f"{kind}_hook_copied"] = torch.equal(cached["out.weight_t"], fresh["out.weight_t"])
        out[f"{kind}_data_ptr"] = {p.data_ptr() for p in m.parameters()}
        out[f"{kind}_grad_storage"] = all(p.grad.untyped_storage().nbytes() >= 0 for p in m.parameters())
    local = [p.to_local() for p in ours.parameters()]
    out["ours_is_local_storage"] = all(
        p.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() and p.untyped_storage().nbytes() > 0
        for p, t in zip(ours.parameters(), local, strict=True))
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_storage_of_sharded_parameters_is_the_local_shard(world_size: int) -> None:
    """torchtitan's CheckpointManager compares the storages of two state dicts; ours must
    answer as FSDP2's DTensors do (no "invalid python storage" error)."""
    for res in run_distributed(_storage, world_size):
        for kind in ("ours", "fsdp2"):
            assert res[f"{kind}_params_shared"] and res[f"{kind}_hook_not_shared"], res
            assert res[f"{kind}_hook_copied"] and res[f"{kind}_grad_storage"], res
        assert res["ours_data_ptr"] == res["fsdp2_data_ptr"] == {0}, res
        assert res["ours_is_local_storage"], res


def test_the_fsdp_module_class_has_type_hints_a_subclass_can_evaluate() -> None:
    # fully_shard makes a subclass of the module's class and FSDPModule; Hugging Face's
    # PreTrainedModel.__init_subclass__ evaluates typing.get_type_hints over that MRO, so a
    # hint naming a type-checking-only import failed there (a NameError from fully_shard)
    import typing

    from vefsdp_optim._fsdp._module import FSDPModule

    for cls in FSDPModule.__mro__:
        typing.get_type_hints(cls)
