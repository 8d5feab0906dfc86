"""Bundled toy runs: ``python -m vefsdp_optim.toy`` (see README "Toy runs").

In code: ``train_all([RunConfig("gpt", "muon", "none", 50)])`` on one process, or
``launch(configs, world_size=2)`` on spawned gloo ranks; ``check_results`` compares
sharded runs with their single-device references and the task thresholds;
``launch_ep_check(EPCheckConfig(), world_size=4)`` is the expert-parallel MoE run.
"""

from ._moe_ep import EPCheckConfig, EPCheckResult, launch_ep_check, run_ep_check
from ._report import CheckFailure, check_results, curve_departure, format_table, write_outputs
from ._runner import (
    BUILTIN_OPTIMIZERS,
    SHARDINGS,
    RunConfig,
    RunResult,
    build_optimizer,
    check_tolerance,
    default_lr,
    launch,
    train,
    train_all,
)
from ._tasks import TASKS, MarkovLanguage, Task, ToyProblem, get_task, markov_entropy_rate

__all__ = [
    "TASKS",
    "Task",
    "ToyProblem",
    "get_task",
    "MarkovLanguage",
    "markov_entropy_rate",
    "RunConfig",
    "RunResult",
    "SHARDINGS",
    "BUILTIN_OPTIMIZERS",
    "build_optimizer",
    "default_lr",
    "check_tolerance",
    "train",
    "train_all",
    "launch",
    "EPCheckConfig",
    "EPCheckResult",
    "run_ep_check",
    "launch_ep_check",
    "CheckFailure",
    "check_results",
    "curve_departure",
    "format_table",
    "write_outputs",
]
