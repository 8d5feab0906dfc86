"""Toy training tasks with known loss floors, deterministic from a seed, CPU-sized.

Every task gives the same model initialization and the same batch at a given step on
every rank and in every process (data is generated from ``(seed, step)`` alone), so a
sharded run and its single-device reference see the same data; each rank trains on the
whole global batch (replicated data), and the averaged gradient equals the
single-device gradient.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ._models import TinyGPT, TinyMoEGPT

__all__ = [
    "Task",
    "ToyProblem",
    "TASKS",
    "get_task",
    "MarkovLanguage",
    "markov_entropy_rate",
    "stationary_distribution",
]

# The loss floor of each task:
# gpt: next-token cross-entropy (nats) on sequences of an order-1 Markov chain whose
#   first token is drawn from the stationary distribution; every target then has the
#   previous token as context, so no model beats the entropy rate
#   H = -sum_i pi_i sum_j P_ij log P_ij (exact, from P and pi).
# mlp, conv: mean squared error against a teacher's output plus Gaussian noise of
#   standard deviation sigma, fresh batches: the expected loss of the teacher is sigma^2.
# illcond: full-batch least squares on a fixed data set: the floor is the residual of
#   the least-squares solution, computed in float64.


def _gen(seed: int, *salt: int) -> torch.Generator:
    """A CPU generator determined by ``seed`` and a salt (task id, step)."""
    s = seed
    for x in salt:
        s = (s * 1_000_003 + x) % (2**62)
    return torch.Generator().manual_seed(s)


# -- the synthetic language -------------------------------------------------------------


def stationary_distribution(P: torch.Tensor) -> torch.Tensor:
    """pi with pi P = pi, sum(pi) = 1, for a row-stochastic irreducible P (float64)."""
    if P.ndim != 2 or P.shape[0] != P.shape[1]:
        raise ValueError(f"P must be a square matrix, got shape {tuple(P.shape)}")
    P = P.to(torch.float64)
    n = P.shape[0]
    # solve (P^T - I) pi = 0 with the normalization sum(pi) = 1 appended
    A = torch.cat([P.T - torch.eye(n, dtype=torch.float64), torch.ones(1, n, dtype=torch.float64)])
    b = torch.zeros(n + 1, 1, dtype=torch.float64)
    b[-1] = 1.0
    pi = torch.linalg.lstsq(A, b).solution[:, 0]
    if (pi < -1e-12).any():
        raise AssertionError(f"stationary distribution has negative entries: {pi.min().item()}")
    return pi.clamp_min(0) / pi.clamp_min(0).sum()


def markov_entropy_rate(P: torch.Tensor) -> float:
    """Entropy rate in nats per token of the stationary order-1 chain P."""
    P = P.to(torch.float64)
    pi = stationary_distribution(P)
    plogp = torch.where(P > 0, P * P.clamp_min(1e-300).log(), torch.zeros_like(P))
    return float(-(pi * plogp.sum(1)).sum())


@dataclass(frozen=True, slots=True)
class MarkovLanguage:
    """A sparse random order-1 Markov chain over ``vocab`` tokens.

    Each token has ``branching`` possible successors (one of them ``(i + 1) % vocab``,
    which makes the chain irreducible; a few random self-loops make it aperiodic) with
    probabilities proportional to ``exp(spread * N(0, 1))``.
    """

    vocab: int = 64
    branching: int = 4
    spread: float = 1.0
    seed: int = 0
    P: torch.Tensor = field(init=False, repr=False, compare=False)  # (vocab, vocab) float64
    _cum: torch.Tensor = field(init=False, repr=False, compare=False)  # (vocab, vocab) row CDFs
    _pi_cum: torch.Tensor = field(init=False, repr=False, compare=False)  # (vocab,) CDF of pi

    def __post_init__(self) -> None:
        if self.vocab < 2:
            raise ValueError(f"vocab must be >= 2, got {self.vocab}")
        if not 1 <= self.branching <= self.vocab:
            raise ValueError(f"branching must be in [1, vocab={self.vocab}], got {self.branching}")
        if not self.spread >= 0:
            raise ValueError(f"spread must be >= 0, got {self.spread}")
        g = _gen(self.seed, 17)
        V, k = self.vocab, self.branching
        P = torch.zeros(V, V, dtype=torch.float64)
        for i in range(V):
            others = torch.randperm(V, generator=g)
            succ = [(i + 1) % V] + [int(j) for j in others if int(j) != (i + 1) % V][: k - 1]
            if i % 7 == 0 and i not in succ:  # self-loops: aperiodic
                succ[-1] = i
            w = (self.spread * torch.randn(k, generator=g, dtype=torch.float64)).exp()
            P[i, succ] = w / w.sum()
        object.__setattr__(self, "P", P)
        cum = P.cumsum(1)
        cum[:, -1] = 1.0 + 1e-9  # every uniform draw lands on a column
        pi_cum = stationary_distribution(P).cumsum(0)
        pi_cum[-1] = 1.0 + 1e-9
        object.__setattr__(self, "_cum", cum)
        object.__setattr__(self, "_pi_cum", pi_cum)

    @property
    def entropy_rate(self) -> float:
        return markov_entropy_rate(self.P)

    def sample(self, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
        """(batch, length) int64 tokens, the first one from the stationary distribution."""
        cum, pi_cum = self._cum, self._pi_cum
        u = torch.rand(batch, length, generator=generator, dtype=torch.float64)
        out = torch.empty(batch, length, dtype=torch.int64)
        out[:, 0] = torch.searchsorted(pi_cum, u[:, 0].contiguous())
        for t in range(1, length):
            rows = cum[out[:, t - 1]]  # (batch, V)
            out[:, t] = (u[:, t : t + 1] >= rows).sum(1).clamp_max(self.vocab - 1)
        return out


class _MLP(nn.Module):
    def __init__(self, d_in: int, hidden: int, d_out: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(d_in, hidden), nn.Linear(hidden, hidden)])
        self.head = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


class _ConvNet(nn.Module):
    def __init__(self, c_in: int, width: int, size: int, d_out: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([
            nn.Conv2d(c_in, width, 3, padding=1),
            nn.Conv2d(width, width, 3, stride=2, padding=1),
        ])
        self.head = nn.Linear(width * ((size + 1) // 2) ** 2, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x.flatten(1))


class _Linear(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList()
        self.weight = nn.Parameter(torch.zeros(d_out, d_in))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T


# -- problems -------------------------------------------------------------------------------


@dataclass
class ToyProblem:
    """One instance of a task: a fresh model, a batch function and a loss.

    ``model.layers`` are the sub-modules sharded one by one before the root (FSDP2's
    per-block pattern); parameter names containing ``embed`` or ``head`` are the ones
    Muon leaves to AdamW.
    """

    model: nn.Module
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # step -> (inputs, targets)
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (output, targets) -> scalar
    floor: float | None


_BUILTINS = ("adamw", "adamw8bit", "adam8bit", "muon", "normuon", "shampoo", "soap")


@dataclass(frozen=True, slots=True)
class Task:
    """A named toy task, its default steps and its documented ``--check`` thresholds.

    A run passes its threshold when its final loss (mean of the last 10 steps) after at
    least ``steps`` steps, at the default learning rate, is at most ``floor +
    max_excess[optimizer]``; ``"*"`` is the allowance of any other (custom) optimizer.
    The built-ins' allowances are at least twice the excess each reached at seed 0 (and
    AdamW at seeds 1 and 2; on illcond also Muon and Shampoo).
    """

    name: str
    description: str
    steps: int
    max_excess: dict[str, float]
    build: Callable[[int], ToyProblem]

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if "*" not in self.max_excess or any(v <= 0 for v in self.max_excess.values()):
            raise ValueError(f"task {self.name!r}: max_excess needs a '*' entry and positive "
                             f"values, got {self.max_excess}")

    def threshold(self, optimizer: str, floor: float) -> float:
        """Highest final loss that passes --check for ``optimizer`` given the floor."""
        key = optimizer.strip().lower()
        return floor + self.max_excess.get(key, self.max_excess["*"])


GPT_VOCAB, GPT_SEQ, GPT_BATCH = 64, 64, 16


def _build_gpt(seed: int) -> ToyProblem:
    lang = MarkovLanguage(vocab=GPT_VOCAB, seed=seed)
    torch.manual_seed(seed)
    model = TinyGPT(GPT_VOCAB, GPT_SEQ, d=64, n_layers=2, heads=4)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        toks = lang.sample(GPT_BATCH, GPT_SEQ + 1, _gen(seed, 1, step))
        return toks[:, :-1], toks[:, 1:]

    def loss(out: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), tgt.reshape(-1))

    return ToyProblem(model, batch, loss, lang.entropy_rate)


MOE_EXPERTS = 5  # divides neither W = 2 nor 3: whole experts on ranks, unevenly


def _build_moe(seed: int) -> ToyProblem:
    lang = MarkovLanguage(vocab=GPT_VOCAB, seed=seed)
    torch.manual_seed(seed)
    model = TinyMoEGPT(GPT_VOCAB, GPT_SEQ, d=64, n_layers=2, heads=4, kv_heads=2,
                       experts=MOE_EXPERTS, d_ff=64)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        toks = lang.sample(GPT_BATCH, GPT_SEQ + 1, _gen(seed, 5, step))
        return toks[:, :-1], toks[:, 1:]

    def loss(out: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), tgt.reshape(-1))

    return ToyProblem(model, batch, loss, lang.entropy_rate)


def _teacher_student(seed: int, salt: int, teacher: nn.Module, student: nn.Module,
                     make_x: Callable[[torch.Generator], torch.Tensor], sigma: float) -> ToyProblem:
    teacher.requires_grad_(False)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = _gen(seed, salt, step)
        x = make_x(g)
        with torch.no_grad():
            y = teacher(x)
        return x, y + sigma * torch.randn(y.shape, generator=g)

    return ToyProblem(student, batch, F.mse_loss, sigma**2)


MLP_SIGMA = 0.1


def _build_mlp(seed: int) -> ToyProblem:
    torch.manual_seed(seed + 101)
    teacher = _MLP(32, 32, 8)
    for m in teacher.modules():  # outputs of order 1
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=1.5 / math.sqrt(m.in_features))
    torch.manual_seed(seed)
    student = _MLP(32, 96, 8)
    return _teacher_student(seed, 2, teacher, student,
                            lambda g: torch.randn(128, 32, generator=g), MLP_SIGMA)


CONV_SIGMA = 0.1


def _build_conv(seed: int) -> ToyProblem:
    torch.manual_seed(seed + 202)
    teacher = _ConvNet(3, 4, 8, 4)
    for m in teacher.modules():
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            fan_in = m.weight[0].numel()
            nn.init.normal_(m.weight, std=1.5 / math.sqrt(fan_in))
    torch.manual_seed(seed)
    student = _ConvNet(3, 16, 8, 4)
    return _teacher_student(seed, 3, teacher, student,
                            lambda g: torch.randn(64, 3, 8, 8, generator=g), CONV_SIGMA)


ILL_N, ILL_IN, ILL_OUT, ILL_COND = 512, 32, 16, 1e2


def _build_illcond(seed: int) -> ToyProblem:
    """Least squares with a rotated feature covariance of condition number ILL_COND**2."""
    g = _gen(seed, 4)
    Q, _ = torch.linalg.qr(torch.randn(ILL_IN, ILL_IN, generator=g, dtype=torch.float64))
    s = torch.logspace(0, -math.log10(ILL_COND), ILL_IN, dtype=torch.float64)
    X = torch.randn(ILL_N, ILL_IN, generator=g, dtype=torch.float64) @ torch.diag(s) @ Q.T
    W_star = torch.randn(ILL_OUT, ILL_IN, generator=g, dtype=torch.float64) / math.sqrt(ILL_IN)
    Y = X @ W_star.T + 0.05 * torch.randn(ILL_N, ILL_OUT, generator=g, dtype=torch.float64)
    W_opt = torch.linalg.lstsq(X, Y).solution  # (ILL_IN, ILL_OUT)
    floor = float(((X @ W_opt - Y) ** 2).mean())
    X32, Y32 = X.float(), Y.float()
    torch.manual_seed(seed)
    return ToyProblem(_Linear(ILL_IN, ILL_OUT), lambda step: (X32, Y32), F.mse_loss, floor)


def _excess(builtin: float, custom: float, **per_optimizer: float) -> dict[str, float]:
    out = {o: builtin for o in _BUILTINS}
    out.update(per_optimizer)
    out["*"] = custom
    return out


TASKS: dict[str, Task] = {
    t.name: t
    for t in [
        Task("gpt", f"tiny GPT (2 layers, d=64) on an order-1 Markov language, vocab {GPT_VOCAB}; "
             "floor = entropy rate", 200, _excess(0.15, 1.0), _build_gpt),
        Task("mlp", "teacher-student tanh MLP regression; floor = noise variance", 600,
             _excess(0.05, 0.5), _build_mlp),
        Task("conv", "teacher-student conv net (4-D weights) on random 3x8x8 images; "
             "floor = noise variance", 600, _excess(0.03, 0.5), _build_conv),
        Task("illcond", f"least squares, rotated features of condition number {ILL_COND:g}^2; "
             "floor = least-squares residual", 300, _excess(2e-3, 0.05, muon=0.02, shampoo=5e-4),
             _build_illcond),
        Task("moe",
             f"tiny MoE GPT (2 layers, d=64, {MOE_EXPERTS} experts top-2 as [experts, out, in] "
             "weights, grouped-query attention with a fused QKV) on the gpt task's language; floor "
             "= entropy rate; not in the default run", 200, _excess(0.15, 1.0), _build_moe),
    ]
}


def get_task(name: str) -> Task:
    """The task called ``name``; ValueError listing the known tasks otherwise."""
    if not isinstance(name, str):
        raise TypeError(f"task name must be a str, got {name!r}")
    key = name.strip().lower()
    if key not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {sorted(TASKS)} (or 'all')")
    return TASKS[key]
