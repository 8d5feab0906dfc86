"""torch's optimizer test database, for tests: the one import of torch.testing._internal.

``cpu_float32_configs()`` lists every configuration that
``torch.testing._internal.common_optimizers.optim_db`` generates for device "cpu" and
dtype float32, as picklable :class:`OptimConfig` rows: each optimizer's
``optim_inputs_func`` crossed with the implementation flags torch's own tests cross it
with on the CPU (``_get_optim_inputs_including_global_cliquey_kwargs``: all flags off,
then ``fused=True`` where torch has a CPU fused kernel), plus ``foreach=True`` where
supported (torch leaves it out on the CPU, where it has no foreach kernels, but the flag
is legal there and training frameworks pass it). Rows a test cannot run carry the
reason in ``skip``.
"""

from __future__ import annotations

import copy
import sys
import types
import unittest
from typing import Any, NamedTuple

import torch


class OptimConfig(NamedTuple):
    optim: str  # class name in torch.optim
    desc: str  # optim_db's description, with the implementation flags
    kwargs: dict[str, Any]
    needs_closure: bool
    skip: str | None  # why this configuration cannot run on sharded parameters


def _optim_db() -> tuple[list[Any], Any]:
    if "expecttest" not in sys.modules:
        try:
            import expecttest  # noqa: F401
        except ImportError:
            # common_utils imports expecttest only for its TestCase base class; the
            # database itself does not need it (it is not a dependency of this project).
            stub = types.ModuleType("expecttest")
            stub.TestCase = unittest.TestCase  # type: ignore[attr-defined]
            sys.modules["expecttest"] = stub
    from torch.testing._internal.common_optimizers import (
        _get_optim_inputs_including_global_cliquey_kwargs,
        optim_db,
    )

    return optim_db, _get_optim_inputs_including_global_cliquey_kwargs


def cpu_float32_configs() -> list[OptimConfig]:
    optim_db, with_flags = _optim_db()
    rows: list[OptimConfig] = []
    for info in optim_db:
        name = info.optim_cls.__name__
        skip = None
        if info.only_supports_sparse_grads:
            skip = "needs sparse gradients; FSDP2 and fully_shard produce dense ones"
        # differentiable=True runs the step under autograd, where an in-place update of a
        # leaf parameter that requires grad raises in torch itself: torch tests it on
        # non-leaf clones only, which no FSDP gives
        inputs = with_flags("cpu", torch.float32, info, skip=("differentiable",))
        for inp in inputs:
            if inp.params is not None:
                raise AssertionError(f"{name} {inp.desc}: optim_db now passes params; build them here")
            rows.append(OptimConfig(name, inp.desc, copy.deepcopy(inp.kwargs), info.step_requires_closure, skip))
        if "foreach" in info.supported_impls:
            for inp in info.optim_inputs_func("cpu"):
                kw = {**copy.deepcopy(inp.kwargs), "foreach": True}
                rows.append(OptimConfig(name, inp.desc + ", foreach", kw, info.step_requires_closure, skip))
    return rows
