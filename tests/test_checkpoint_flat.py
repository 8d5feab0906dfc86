"""Flattened optimizer state (torchtitan's flow) across a change of world size.

``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` with
``StateDictOptions(flatten_optimizer_state_dict=True)`` store each parameter's state as
flat keys ``state.{fqn}.{key}`` and rebuild it from the keys of the LIVE state
(``optim.state[param]``): a saved key that the live state does not show is dropped on
load. So every built-in optimizer must keep, after construction (DCP's zero step) and
after a real step, the same keys that its ``state_dict()`` saves.

One spawned job per world size: every optimizer, on fully_shard and on FSDP2, trains
SPLIT steps at W=3 and saves flattened; a fresh model and optimizer at W=2 load it
flattened, train on, and match the uninterrupted single-device run (bit for bit; Shampoo
within the tolerance of tests/test_checkpoint.py).
"""

from __future__ import annotations

import os

import torch
from ckpt_harness import (
    OPTIMIZERS,
    SPLIT,
    STEPS,
    _build,
    _compare,
    _full_params,
    _optimizer,
    _reference,
    _shard,
    _train,
)
from dist_utils import run_distributed

KINDS = ("fully_shard", "fsdp2")


def _options():  # noqa: ANN202
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def _live_keys(opt: torch.optim.Optimizer) -> list[set[str]]:
    return [set(opt.state[p]) for g in opt.param_groups for p in g["params"] if opt.state.get(p)]


def _saved_keys_match_live(opt: torch.optim.Optimizer, what: str) -> None:
    """Every key state_dict() saves for a parameter is a key of its live state."""
    live = [set(opt.state[p]) for g in opt.param_groups for p in g["params"]]
    for i, entry in opt.state_dict()["state"].items():
        extra = set(entry) - live[i]
        assert not extra, f"{type(opt).__name__} {what}: param {i} saves {sorted(extra)} not in its live state"


def _save_flat(root: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    for kind in KINDS:
        for name in OPTIMIZERS:
            model = _shard(_build(1), kind)
            opt = _optimizer(name, model)
            _train(model, opt, range(SPLIT))
            _saved_keys_match_live(opt, "after steps")
            osd = get_optimizer_state_dict(model, opt, options=_options())
            assert "state" not in osd and any(k.startswith("state.") for k in osd), sorted(osd)[:4]
            dcp.save({"model": get_model_state_dict(model), "optim": osd},
                     checkpoint_id=os.path.join(root, kind, name))


def _load_flat(root: str) -> dict[str, dict[str, torch.Tensor]]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    out = {}
    for kind in KINDS:
        for name in OPTIMIZERS:
            model = _shard(_build(2), kind)  # other initial values: all must come from the checkpoint
            opt = _optimizer(name, model)
            sd = {"model": get_model_state_dict(model),
                  "optim": get_optimizer_state_dict(model, opt, options=_options())}
            _saved_keys_match_live(opt, "after construction (DCP's zero step)")
            keys_before = _live_keys(opt)
            dcp.load(sd, checkpoint_id=os.path.join(root, kind, name))
            set_model_state_dict(model, sd["model"])
            set_optimizer_state_dict(model, opt, sd["optim"], options=_options())
            assert _live_keys(opt) == keys_before, name
            _train(model, opt, range(SPLIT, STEPS))
            out[f"{kind}/{name}"] = _full_params(model)
    return out


def test_flattened_state_resumes_at_other_world_size(tmp_path):
    refs = {name: _reference(name) for name in OPTIMIZERS}
    run_distributed(_save_flat, 3, str(tmp_path))
    got = run_distributed(_load_flat, 2, str(tmp_path))[0]
    for kind in KINDS:
        for name in OPTIMIZERS:
            _compare(name, got[f"{kind}/{name}"], refs[name])
