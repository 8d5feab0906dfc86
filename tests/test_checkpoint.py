"""Distributed checkpoints that survive a change of world size.

Each case trains k steps at W=a, saves with DCP (through torch's
``torch.distributed.checkpoint.state_dict`` helpers), loads at W=b into a freshly built
model and optimizer, trains on, and compares with the uninterrupted single-device run
of the same optimizer on plain tensors. Gradients are set directly (the same full
gradient on every rank, sliced), so the sharded runs see exactly the single-device
gradients and AdamW, 8-bit Adam and Muon must match bit for bit.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
from ckpt_harness import (
    OPTIMIZERS,
    SPLIT,
    STEPS,
    _build,
    _compare,
    _full_params,
    _model_load,
    _model_save,
    _optimizer,
    _ref,
    _resume_case,
    _run,
    _shard,
    _train,
)
from dist_utils import run_distributed
from torch import nn


@pytest.mark.parametrize("src, dst", [
    (("fully_shard", 3), ("fully_shard", 2)),
    (("fully_shard", 2), ("fsdp2", 3)),
    (("fully_shard", 4), ("single", "single")),
    (("single", "single"), ("fully_shard", 3)),
    (("fsdp2", 2), ("fully_shard", 4)),
])
def test_model_state_reshards(tmp_path, src, dst):
    (skind, sw), (dkind, dw) = src, dst
    _run(_model_save, sw if skind != "single" else "single", skind, str(tmp_path))
    got = _run(_model_load, dw, dkind, str(tmp_path))
    ref = _full_params(_build(1))
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


def test_flat_range_boxes_tile_the_range():
    from vefsdp_optim._fsdp._sharded_tensor import flat_range_boxes

    for shape in [(5,), (3, 4), (2, 3, 4), (4, 1, 3, 2), (), (1,)]:
        n = math.prod(shape)
        t = torch.arange(n).view(shape)
        for s in range(n + 1):
            for length in range(n - s + 1):
                boxes = flat_range_boxes(shape, s, length)
                assert len(boxes) <= max(1, 2 * len(shape) - 1)
                total = 0
                for off, size, base in boxes:
                    idx = tuple(slice(o, o + z) for o, z in zip(off, size, strict=True))
                    want = torch.arange(s + base, s + base + math.prod(size))
                    assert torch.equal(t[idx].reshape(-1), want), (shape, s, length, off, size)
                    total += math.prod(size)
                assert total == length


# -- optimizer state: every optimizer x {fully_shard, FSDP2} x a change of world size ---

_FAST = [("fully_shard", 2, 3), ("fsdp2", 4, 2)]
_SLOW = [(k, a, b) for k in ("fully_shard", "fsdp2") for a, b in ((4, 2), (2, 3), (3, 1))
         if (k, a, b) not in _FAST]


@pytest.mark.parametrize("kind, a, b", _FAST)
def test_resume_at_other_world_size(tmp_path, kind, a, b):
    _resume_case(tmp_path, kind, a, kind, b)


@pytest.mark.slow
@pytest.mark.parametrize("kind, a, b", _SLOW)
def test_resume_at_other_world_size_matrix(tmp_path, kind, a, b):
    _resume_case(tmp_path, kind, a, kind, b)


@pytest.mark.parametrize("src, dst", [
    (("fully_shard", 3), ("fsdp2", 2)),
    (("fully_shard", 4), ("single", "single")),
    (("single", "single"), ("fully_shard", 3)),
    pytest.param(("fsdp2", 2), ("fully_shard", 4), marks=pytest.mark.slow),  # ~2.6 s
])
def test_resume_across_model_kinds(tmp_path, src, dst):
    _resume_case(tmp_path, src[0], src[1], dst[0], dst[1])


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_torch_save_round_trip_single_device(tmp_path, name):
    model = _build(1)
    opt = _optimizer(name, model)
    _train(model, opt, range(SPLIT))
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path / "ckpt.pt")
    model2 = _build(2)
    opt2 = _optimizer(name, model2)
    sd = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    model2.load_state_dict(sd["model"])
    opt2.load_state_dict(sd["optim"])
    _train(model2, opt2, range(SPLIT, STEPS))
    _compare(name, _full_params(model2), _ref(name))


# -- save/load wrappers: write aside then rename; mismatches named ----------------------


class _Unpicklable:
    def __reduce__(self):  # noqa: ANN204
        raise RuntimeError("disk full (simulated)")


def _wrapped_cases(root: str) -> dict[str, object]:
    """Save A, then a save of B that fails while writing, then load: A comes back.
    Then the mismatch errors of load() and of the optimizers' load_state_dict."""
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    import vefsdp_optim

    path = os.path.join(root, "ckpt")
    out: dict[str, object] = {}
    model = _shard(_build(1), "fully_shard")
    opt = _optimizer("adamw8bit", model)
    _train(model, opt, range(SPLIT))
    vefsdp_optim.save({"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}, path)
    saved = _full_params(model)
    _train(model, opt, range(SPLIT, STEPS))  # B differs from A
    try:
        vefsdp_optim.save({"model": model.state_dict(), "bad": _Unpicklable()}, path)
        out["interrupted"] = "no error"
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        out["interrupted"] = repr(e)
    dist.barrier()
    out["leftovers"] = sorted(n for n in os.listdir(root) if n != "ckpt")
    uninterrupted = _full_params(model)
    fresh = _shard(_build(2), "fully_shard")
    fresh_opt = _optimizer("adamw8bit", fresh)
    sd = {"model": fresh.state_dict(), "optim": get_optimizer_state_dict(fresh, fresh_opt)}
    vefsdp_optim.load(sd, path)  # param groups come back through torch.load(weights_only=True)
    fresh.load_state_dict(sd["model"])
    set_optimizer_state_dict(fresh, fresh_opt, sd["optim"])
    got = _full_params(fresh)
    out["restored"] = all(torch.equal(got[k], saved[k]) for k in saved)
    _train(fresh, fresh_opt, range(SPLIT, STEPS))
    got = _full_params(fresh)
    out["resumed"] = all(torch.equal(got[k], uninterrupted[k]) for k in saved)

    def error(fn) -> str:  # noqa: ANN001
        try:
            fn()
        except (ValueError, TypeError) as e:
            return f"{type(e).__name__}: {e}"
        return "no error"

    # another optimizer: its keys are not in the checkpoint
    m2 = _shard(_build(2), "fully_shard")
    other = _optimizer("adamw", m2)
    out["other_optimizer"] = error(lambda: vefsdp_optim.load(
        {"optim": get_optimizer_state_dict(m2, other)}, path))
    # another block size: the absmax shapes differ
    m3 = _shard(_build(2), "fully_shard")
    o3 = vefsdp_optim.AdamW8bit(m3.parameters(), block_size=16, min_8bit_size=64)
    out["block_size_dcp"] = error(lambda: vefsdp_optim.load({"optim": get_optimizer_state_dict(m3, o3)}, path))
    # other shapes
    m4 = _shard(nn.Sequential(nn.Linear(7, 36)), "single")
    out["shapes"] = error(lambda: vefsdp_optim.load({"model": {"l1.weight": m4[0].weight}}, path))
    # load_state_dict itself: class, structural keys, missing keys
    sd8 = opt.state_dict()
    o5 = _optimizer("adamw", _shard(_build(2), "fully_shard"))
    out["class"] = error(lambda: o5.load_state_dict(sd8))
    o6 = vefsdp_optim.AdamW8bit(_shard(_build(2), "fully_shard").parameters(), block_size=16, min_8bit_size=64)
    out["block_size"] = error(lambda: o6.load_state_dict(sd8))
    first = next(k for k, v in sd8["state"].items() if "exp_avg_codes" in v and v["exp_avg_codes"].numel())
    broken = {"state": {k: dict(v) for k, v in sd8["state"].items()}, "param_groups": sd8["param_groups"]}
    del broken["state"][first]["exp_avg_sq_absmax"]
    o7 = _optimizer("adamw8bit", _shard(_build(2), "fully_shard"))
    out["missing"] = error(lambda: o7.load_state_dict(broken))
    return out


def test_save_is_atomic_and_mismatches_are_named(tmp_path):
    res = run_distributed(_wrapped_cases, 3, str(tmp_path))
    for r in res:
        assert "disk full" in r["interrupted"], r["interrupted"]
        assert r["restored"], "the previous checkpoint did not survive the interrupted save"
        assert r["resumed"], "training resumed from the checkpoint differs from the uninterrupted run"
        assert not any(n.startswith("ckpt.tmp") for n in r["leftovers"]), r["leftovers"]
        assert "missing from the checkpoint" in r["other_optimizer"] and "exp_avg_sq" in r["other_optimizer"]
        assert "absmax" in r["block_size_dcp"] and "shapes differ" in r["block_size_dcp"], r["block_size_dcp"]
        assert "shapes differ" in r["shapes"] and "(36, 7)" in r["shapes"], r["shapes"]
        assert "AdamW8bit" in r["class"] and "AdamW" in r["class"], r["class"]
        assert "block_size=32" in r["block_size"] and "block_size=16" in r["block_size"], r["block_size"]
    assert any("exp_avg_sq_absmax" in r["missing"] for r in res), [r["missing"] for r in res]


# -- full (unsharded) export and import ------------------------------------------------


def _export_run(kind: str, names: list[str], root: str) -> dict[str, dict[str, torch.Tensor]]:
    import vefsdp_optim

    out = {}
    for name in names:
        model = _shard(_build(1), kind)
        opt = _optimizer(name, model)
        _train(model, opt, range(SPLIT))
        vefsdp_optim.export_full(model, opt, path=os.path.join(root, f"{name}.pt"))
        out[name] = _full_params(model)
    return out


def _import_run(kind: str, names: list[str], root: str) -> dict[str, dict[str, torch.Tensor]]:
    import vefsdp_optim

    out = {}
    for name in names:
        model = _shard(_build(2), kind)
        opt = _optimizer(name, model)
        vefsdp_optim.import_full(model, opt, path=os.path.join(root, f"{name}.pt"))
        _train(model, opt, range(SPLIT, STEPS))
        out[name] = _full_params(model)
    return out


@pytest.mark.parametrize("src, dst", [
    (("fully_shard", 3), ("single", "single")),
    (("fully_shard", 2), ("fsdp2", 3)),
])
def test_full_export_import(tmp_path, src, dst):
    names = list(OPTIMIZERS)
    at_export = _run(_export_run, src[1], src[0], names, str(tmp_path))
    for name in names:
        data = torch.load(tmp_path / f"{name}.pt", weights_only=True)
        for k, v in at_export[name].items():
            assert type(data["model"][k]) is torch.Tensor and torch.equal(data["model"][k], v), (name, k)
        assert set(data["optim"]["state"]) <= set(at_export[name])
    got = _run(_import_run, dst[1], dst[0], names, str(tmp_path))
    for name in names:
        _compare(name, got[name], _ref(name))


def test_import_full_names_mismatches(tmp_path):
    import vefsdp_optim

    model = _build(1)
    vefsdp_optim.export_full(model, path=tmp_path / "m.pt")
    other = nn.Sequential(nn.Linear(7, 37))
    with pytest.raises(ValueError, match="missing 0.bias, 0.weight; unexpected l1.bias"):
        vefsdp_optim.import_full(other, path=tmp_path / "m.pt")
    with pytest.raises(ValueError, match="no optimizer state"):
        vefsdp_optim.import_full(_build(2), torch.optim.SGD(model.parameters()), path=tmp_path / "m.pt")
    bad = _build(2)
    bad.t = nn.Parameter(torch.zeros(5, 3, 29))
    with pytest.raises(ValueError, match=r"shapes differ: t: file \(5, 29, 3\), model \(5, 3, 29\)"):
        vefsdp_optim.import_full(bad, path=tmp_path / "m.pt")


def _load_plain_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    model = _shard(_build(2), "fully_shard")
    model.load_state_dict(sd)  # plain full tensors into ShardedParameters: each rank's slice
    return _full_params(model)


def test_plain_state_dict_into_fully_shard(tmp_path):
    ref = _build(1).state_dict()
    got = run_distributed(_load_plain_state_dict, 3, ref)
    for r in got:
        for k, v in r.items():
            assert torch.equal(v, ref[k]), k


def test_load_state_dict_names_what_differs():
    import vefsdp_optim

    def trained(make):  # noqa: ANN001, ANN202
        model = _build(1)
        opt = make(model)
        _train(model, opt, range(2))
        return opt.state_dict()

    sham = trained(lambda m: vefsdp_optim.Shampoo(m.parameters(), max_preconditioner_dim=8,
                                                  precondition_frequency=1, start_preconditioning_step=1))
    with pytest.raises(ValueError, match="max_preconditioner_dim=8.*max_preconditioner_dim=4"):
        vefsdp_optim.Shampoo(_build(2).parameters(), max_preconditioner_dim=4).load_state_dict(sham)
    with pytest.raises(ValueError, match="written by Shampoo, this optimizer is AdamW"):
        vefsdp_optim.AdamW(_build(2).parameters()).load_state_dict(sham)
    sham = trained(lambda m: vefsdp_optim.Shampoo(m.parameters(), max_preconditioner_dim=8))
    del sham["state"][2]["R_inv_root.4.0"]  # parameters(): t, scale, l1.weight (37, 7), ...
    with pytest.raises(ValueError, match=r"lacks tiles \['R_inv_root.4.0'\]"):
        vefsdp_optim.Shampoo(_build(2).parameters(), max_preconditioner_dim=8).load_state_dict(sham)
    adam = trained(lambda m: vefsdp_optim.AdamW(m.parameters()))
    shapes = [(5, 29, 3), (1, 15), (37, 7), (1, 37), (29, 37), (3, 15), (3,)]  # l1.bias as (1, 37)
    params = [nn.Parameter(torch.zeros(s)) for s in shapes]
    with pytest.raises(ValueError, match=r"exp_avg has shape \(37,\), expected \(1, 37\)"):
        vefsdp_optim.AdamW(params).load_state_dict(adam)
    with pytest.raises(ValueError, match="checkpoint has 7 parameters, the optimizer has 6"):
        vefsdp_optim.AdamW(params[:6]).load_state_dict(adam)


def test_load_finds_checkpoint_moved_aside(tmp_path):
    """A save stopped between its two renames leaves the previous checkpoint at .old-*."""
    import vefsdp_optim

    path = tmp_path / "ckpt"
    vefsdp_optim.save({"model": _build(1).state_dict()}, path)
    vefsdp_optim.save({"model": _build(1).state_dict()}, path)  # replaces the first
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    os.rename(path, tmp_path / "ckpt.old-0123")
    model = _build(2)
    sd = {"model": model.state_dict()}
    with pytest.warns(UserWarning, match="left complete by an interrupted save.*is missing"):
        vefsdp_optim.load(sd, path)
    model.load_state_dict(sd["model"])
    ref = _build(1).state_dict()
    assert all(torch.equal(model.state_dict()[k], ref[k]) for k in ref)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        vefsdp_optim.load(sd, tmp_path / "nothing")
