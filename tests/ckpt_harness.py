"""The harness of the checkpoint tests (tests/test_checkpoint.py and the files that
resume its runs): a model, its optimizers, sharding, gradients and the single-device
reference."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from dist_utils import run_distributed
from torch import nn

STEPS, SPLIT = 5, 3  # total steps; steps before the checkpoint

OPTIMIZERS = {
    "adamw": ("AdamW", dict(lr=1e-2, weight_decay=0.1)),
    "muon": ("Muon", dict(lr=2e-2, weight_decay=0.1, flatten=True)),
    "muon8": ("Muon", dict(lr=2e-2, weight_decay=0.1, flatten=True, momentum_dtype=torch.int8)),
    "adamw8bit": ("AdamW8bit", dict(lr=1e-2, weight_decay=0.1, block_size=32, min_8bit_size=64)),
    "adam8bit": ("Adam8bit", dict(lr=1e-2, weight_decay=0.01, block_size=16, min_8bit_size=64)),
    "shampoo": ("Shampoo", dict(lr=1e-2, weight_decay=0.01, max_preconditioner_dim=8,
                                precondition_frequency=2, start_preconditioning_step=2)),
}
EXACT = {"adamw", "muon", "muon8", "adamw8bit", "adam8bit"}


class Net(nn.Module):
    """Uneven shapes: a 3-D weight, a (1, n) row, odd sizes everywhere."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(7, 37)
        self.l2 = nn.Linear(37, 29, bias=False)
        self.t = nn.Parameter(torch.randn(5, 29, 3) * 0.1)
        self.scale = nn.Parameter(torch.randn(1, 15))
        self.l3 = nn.Linear(15, 3)


def _build(seed: int) -> Net:
    torch.manual_seed(seed)
    return Net()


def _optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    import vefsdp_optim

    cls_name, kw = OPTIMIZERS[name]
    cls = getattr(vefsdp_optim, cls_name)
    if name.startswith("muon"):  # Muon with an AdamW part (the 1-D parameters and the (1, n) row)
        named = dict(model.named_parameters())
        adam = [named[k] for k in ("scale", "l1.bias", "l3.bias")]
        muon = [p for k, p in named.items() if k not in ("scale", "l1.bias", "l3.bias")]
        return cls([{"params": muon}, {"params": adam, "use_muon": False}], **kw)
    return cls(model.parameters(), **kw)


def _shard(model: nn.Module, kind: str) -> nn.Module:
    if kind == "single":
        return model
    if kind == "fsdp2_tp":  # FSDP2 x tensor parallel on a (dp, tp = 2) mesh
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = init_device_mesh("cpu", (dist.get_world_size() // 2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"l1": ColwiseParallel(), "l2": RowwiseParallel(),
                                               "l3": ColwiseParallel()})
        fully_shard(model.l2, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        return model
    if kind == "fully_shard":
        from vefsdp_optim import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    fully_shard(model.l2)
    fully_shard(model)
    return model


def _grad(step: int, name: str, shape: torch.Size) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + sum(map(ord, name)))
    return torch.randn(shape, generator=g)


def _set_grads(model: nn.Module, step: int) -> None:
    """Every parameter's .grad: this rank's slice of the same full gradient."""
    from torch.distributed.tensor import DTensor

    from vefsdp_optim import ShardedParameter

    for name, p in model.named_parameters():
        g = _grad(step, name, p.shape)
        if isinstance(p, ShardedParameter):
            lay = p.ragged_layout  # a RaggedShard, or a BoxShard under tensor parallel
            p.grad = ShardedParameter(g.reshape(-1)[lay.local_index(p._rank)].clone(), lay, p.process_group,
                                      p.shape, p._rank)
        elif isinstance(p, DTensor):  # this rank's box of g, whatever the placements
            from vefsdp_optim.comm import sharded_view
            from vefsdp_optim.sharding import RaggedShard

            p.grad = torch.zeros_like(p)
            view = sharded_view(p.grad)
            lay = view.layout
            if isinstance(lay, RaggedShard):
                s, n = lay.local(view.rank)
                view.local.copy_(g.reshape(-1)[s: s + n])
            else:
                view.local.copy_(g.reshape(-1)[lay.flat_indices(view.rank, 0, view.local.numel())])
        else:
            p.grad = g


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for s in steps:
        _set_grads(model, s)
        opt.step()
        opt.zero_grad()


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: (p.full_tensor().detach() if hasattr(p, "full_tensor") else p.detach().clone())
            for k, p in model.named_parameters()}


def _reference(name: str) -> dict[str, torch.Tensor]:
    model = _build(1)
    opt = _optimizer(name, model)
    _train(model, opt, range(STEPS))
    return _full_params(model)


def _compare(name: str, got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert got.keys() == ref.keys()
    for k in ref:
        if name in EXACT:
            assert torch.equal(got[k], ref[k]), (name, k, (got[k] - ref[k]).abs().max())
        else:
            torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6, msg=f"{name} {k}")


# -- rank functions --------------------------------------------------------------------


def _save_run(kind: str, names: list[str], root: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    for name in names:
        model = _shard(_build(1), kind)
        opt = _optimizer(name, model)
        _train(model, opt, range(SPLIT))
        sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.save(sd, checkpoint_id=os.path.join(root, name))


def _load_run(kind: str, names: list[str], root: str) -> dict[str, dict[str, torch.Tensor]]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    out = {}
    for name in names:
        model = _shard(_build(2), kind)  # other initial values: all must come from the checkpoint
        opt = _optimizer(name, model)
        before = _full_params(model)
        sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        after_init = _full_params(model)
        for k in before:  # DCP's _init_optim_state step (zero grads, lr 0) changed nothing
            assert torch.equal(before[k], after_init[k]), (name, k)
        dcp.load(sd, checkpoint_id=os.path.join(root, name))
        set_model_state_dict(model, sd["model"])
        set_optimizer_state_dict(model, opt, sd["optim"])
        _train(model, opt, range(SPLIT, STEPS))
        out[name] = _full_params(model)
    return out


def _in_process(fn, *args):  # noqa: ANN001, ANN202
    """Run a rank function in this process, without a process group (single device)."""
    if dist.is_initialized():
        raise AssertionError("the test process has a process group")
    torch.manual_seed(0)
    return fn(*args)


def _run(fn, world: int | str, *args):  # noqa: ANN001, ANN202
    return _in_process(fn, *args) if world == "single" else run_distributed(fn, world, *args)[0]


# -- model state: fully_shard boxes through DCP ----------------------------------------


def _model_save(kind: str, root: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    model = _shard(_build(1), kind)
    dcp.save(get_model_state_dict(model), checkpoint_id=root)


def _model_load(kind: str, root: str) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    model = _shard(_build(2), kind)
    sd = get_model_state_dict(model)
    dcp.load(sd, checkpoint_id=root)
    set_model_state_dict(model, sd)
    return _full_params(model)


_REFS: dict[str, dict[str, torch.Tensor]] = {}


def _ref(name: str) -> dict[str, torch.Tensor]:
    if name not in _REFS:
        _REFS[name] = _reference(name)
    return _REFS[name]


def _resume_case(tmp_path, src_kind: str, a: int | str, dst_kind: str, b: int | str) -> None:
    names = list(OPTIMIZERS)
    _run(_save_run, a, src_kind, names, str(tmp_path))
    got = _run(_load_run, b, dst_kind, names, str(tmp_path))
    for name in names:
        _compare(name, got[name], _ref(name))
