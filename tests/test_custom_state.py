"""A custom optimizer's declared state checkpoints across world sizes and shardings.

examples/custom_factored.py (WHOLE row/column state of whole-tensor requirements,
ELEMENTWISE state of vectors) is saved at W = 3 and loaded at W = 2, on fully_shard and
on FSDP2 in every combination, through DCP; the resumed run must equal the
uninterrupted single-device run bit for bit. Every rank sees the same full gradients,
so the single device is fed exactly what the sharded runs see. Undeclared or
mismatched state fails at the first step, naming checkpoint_spec.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from dist_utils import load_example, run_distributed
from torch import nn

import vefsdp_optim

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_factored.py"
STEPS, SPLIT = 5, 2


def _example():
    return load_example("custom_factored.py")


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 37), nn.Linear(37, 29, bias=False), nn.Linear(29, 3))


def _shard(model: nn.Module, kind: str) -> nn.Module:
    if kind == "fully_shard":
        vefsdp_optim.fully_shard(model[1])
        vefsdp_optim.fully_shard(model)
    elif kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model[1])
        fully_shard(model)
    return model


def _set_grads(model: nn.Module, step: int) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    for i, p in enumerate(model.parameters()):
        g = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * step + i))
        if isinstance(p, vefsdp_optim.ShardedParameter):
            s, n = p.ragged_layout.local(p.shard_rank)
            p.grad = p.with_local(g.reshape(-1)[s:s + n].clone())
        elif isinstance(p, DTensor):
            p.grad = distribute_tensor(g, p.device_mesh, p.placements)
        else:
            p.grad = g


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for s in steps:
        _set_grads(model, s)
        opt.step()
        opt.zero_grad()


def _full(model: nn.Module) -> list[torch.Tensor]:
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in model.parameters()]


def _save(kind: str, path: str) -> None:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    model = _shard(_model(1), kind)
    opt = _example().FactoredRMS(model.parameters(), lr=1e-2)
    _train(model, opt, range(SPLIT))
    vefsdp_optim.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                      path)


def _load(kind: str, path: str) -> list[torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model = _shard(_model(2), kind)  # other initial values: everything comes from the checkpoint
    opt = _example().FactoredRMS(model.parameters(), lr=1e-2)
    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    vefsdp_optim.load(sd, path)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])
    _train(model, opt, range(SPLIT, STEPS))
    return _full(model)


def test_whole_state_round_trip_3_to_2_equals_uninterrupted_run(tmp_path) -> None:
    model = _model(1)
    opt = _example().FactoredRMS(model.parameters(), lr=1e-2)
    _train(model, opt, range(STEPS))
    want = _full(model)
    for src in ("fully_shard", "fsdp2"):
        path = os.path.join(tmp_path, src)
        run_distributed(_save, 3, src, path)
        for dst in ("fully_shard", "fsdp2"):
            got = run_distributed(_load, 2, dst, path)[0]
            for a, b in zip(got, want, strict=True):
                assert torch.equal(a, b), (src, dst, (a - b).abs().max())


class _Undeclared(vefsdp_optim.BlockOptimizer):
    def __init__(self, params, spec=None) -> None:
        self._spec = spec
        super().__init__(params, dict(lr=0.1))

    def requirement(self, shape, group):
        from vefsdp_optim.sharding import Elementwise

        return Elementwise()

    def checkpoint_spec(self, shape, group):
        return self._spec

    def init_state(self, p, ctx, group):
        return {"m": torch.zeros_like(p), "blocks": torch.zeros(3)}

    def update_block(self, p, g, state, ctx, group):
        state["m"].add_(g)
        p.add_(state["m"], alpha=-group["lr"])


@pytest.mark.parametrize("spec,match", [
    (None, "declares no checkpoint_spec"),
    ({"m": vefsdp_optim.ELEMENTWISE}, r"does not declare state keys \['blocks'\]"),
    ({"m": vefsdp_optim.ELEMENTWISE, "blocks": 2}, "'blocks'.*declared 2 but has 3 elements"),
    ({"m": vefsdp_optim.WHOLE, "blocks": vefsdp_optim.LOCAL}, "declared WHOLE"),
])
def test_undeclared_or_mismatched_state_fails_at_the_first_step(spec, match) -> None:
    p = nn.Parameter(torch.randn(10))
    opt = _Undeclared([p], spec)
    p.grad = torch.ones(10)
    with pytest.raises(ValueError, match=match):
        opt.step()


def test_block_state_geometry_against_its_definition() -> None:
    """A state kept in blocks of ``kind`` elements follows its layout in blocks: each
    boundary rounded up to blocks, and a layout that cuts a block anywhere but at the
    tensor's end is refused (the one-pass check in _entry_geometry against the rank by
    rank definition, on every layout of up to 4 ranks over 0-9 elements)."""
    import itertools

    from vefsdp_optim._checkpoint._format import _entry_geometry
    from vefsdp_optim.comm import sharded_view
    from vefsdp_optim.sharding import RaggedShard

    view = sharded_view(torch.zeros(1))
    for n in range(10):
        for w in range(1, 5):
            for cuts in itertools.combinations_with_replacement(range(n + 1), w - 1):
                layout = RaggedShard.from_boundaries([0, *cuts, n])
                for kind in (1, 3, 4):
                    cut = any(b % kind and b != n for b in layout.boundaries)
                    if cut:
                        with pytest.raises(AssertionError, match=f"cuts blocks of {kind}"):
                            _entry_geometry(kind, view, layout)
                        continue
                    shape, blocks = _entry_geometry(kind, view, layout)
                    assert blocks.boundaries == tuple(-(-b // kind) for b in layout.boundaries)
                    assert shape == torch.Size((-(-n // kind),))
