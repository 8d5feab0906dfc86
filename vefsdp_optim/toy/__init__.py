"""Bundled toy runs: ``python -m vefsdp_optim.toy`` (see README "Toy runs")."""

from ._tasks import TASKS, MarkovLanguage, Task, ToyProblem, get_task, markov_entropy_rate

__all__ = ["TASKS", "Task", "ToyProblem", "get_task", "MarkovLanguage", "markov_entropy_rate"]
