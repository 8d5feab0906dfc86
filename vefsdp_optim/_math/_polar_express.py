"""Polar Express (Amsel, Persson, Musco, Gower; arXiv 2505.16932): per-iteration
coefficients of the quintic polar-factor iteration, as the paper's Algorithm 1 gives them.

Iteration ``t`` applies ``X <- a_t X + (b_t A + c_t A^2) X`` with
``A = X X^T``: the odd quintic ``p_t(x) = a_t x + b_t x^3 + c_t x^5`` on every singular
value. The paper's ``p_t`` are the minimax-optimal odd quintics for a sign
approximation on the singular-value interval ``[l_t, u_t]`` left by ``p_{t-1}`` (from
``l_0 = 1e-3``); the eighth onwards is the degree-5 Newton-Schulz map
``(15 x - 10 x^3 + 3 x^5) / 8``. For bfloat16, Algorithm 1 divides every polynomial but
the last by a safety factor (``p_t(x / 1.01)``: ``a / 1.01, b / 1.01^3, c / 1.01^5``)
and scales the input by ``1 / (1.01 ||X||_F + 1e-7)``, so that rounding cannot push a
singular value past the interval each polynomial was built for. Dion's and
modded-nanogpt's ``polar_express`` use another table (5 polynomials computed with
a 2e-2 safety factor, a cushion, input scale ``1 / (1.02 ||X||_F + eps)``); this one is
the paper's.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "POLAR_EXPRESS",
    "POLAR_EXPRESS_COEFFICIENTS",
    "POLAR_EXPRESS_SAFETY",
    "polar_express_coefficients",
]

#: the ``ns_coefficients`` value that selects this schedule
POLAR_EXPRESS: Final = "polar_express"

#: the paper's unscaled (a, b, c) of iterations 1-8 (Algorithm 1); later ones repeat the 8th
POLAR_EXPRESS_COEFFICIENTS: Final[tuple[tuple[float, float, float], ...]] = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)

#: the safety factor of Algorithm 1: of every polynomial but the last, and of the input scale
POLAR_EXPRESS_SAFETY: Final = 1.01


def _scaled() -> tuple[tuple[float, float, float], ...]:
    s = POLAR_EXPRESS_SAFETY
    head = tuple((a / s, b / s**3, c / s**5) for a, b, c in POLAR_EXPRESS_COEFFICIENTS[:-1])
    return head + (POLAR_EXPRESS_COEFFICIENTS[-1],)


_SCALED = _scaled()


def polar_express_coefficients(ns_steps: int) -> tuple[tuple[float, float, float], ...]:
    """The safety-scaled ``(a, b, c)`` of each of ``ns_steps`` iterations
    (see the module docstring): the paper's first ``ns_steps`` polynomials, the last one
    repeated beyond the eighth."""
    if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or ns_steps < 0:
        raise ValueError(f"ns_steps must be an int >= 0, got {ns_steps!r}")
    return _SCALED[:ns_steps] + (_SCALED[-1],) * max(0, ns_steps - len(_SCALED))
