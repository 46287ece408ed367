r"""The statistics of the one-run audit: the bounds, the f-DP test of the plan, the guess grid.

Two tests turn ``v`` correct guesses out of ``r`` (on ``M`` canaries) into a refutation:

* Theorem 3 of Steinke, Nasr & Jagielski (2023) for an ``(epsilon, delta)`` claim
  (:func:`one_run_p_value`, :func:`epsilon_lower_bound`);
* the f-DP recursion of Mahloujifar, Melis & Chaudhuri (2025) against the trade-off curve of
  the accounted Poisson-subsampled Gaussian plan (:class:`GaussianPlan`,
  :func:`plan_tradeoff_inverse`, :func:`fdp_refutes`).

:mod:`dpkfc_med.privacy.audit` places the canaries, scores them and reports with these.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats
from scipy.special import ndtr, ndtri

__all__ = [
    "BOUND_SOURCE",
    "DEFAULT_CONFIDENCE",
    "FDP_BOUND_SOURCE",
    "GUESS_GRID",
    "GaussianPlan",
    "TradeoffInverse",
    "Verdict",
    "check_guess_counts",
    "check_probability",
    "epsilon_lower_bound",
    "fdp_bound",
    "fdp_refutes",
    "gaussian_tradeoff_inverse",
    "guess_counts",
    "max_bound",
    "one_run_p_value",
    "plan_tradeoff_inverse",
    "tolerated_wrong",
    "verdict_of",
]

DEFAULT_CONFIDENCE = 0.95
"""Probability that the reported lower bound does not exceed the mechanism's true epsilon."""

GUESS_GRID = (10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
"""Candidate guess counts ``k`` per side (``k+ = k- = k``), before limiting to ``2 k <= M``."""

_FDP_EPS_GRID = np.arange(0.0, 60.0001, 0.1)  # epsilons of the plan's delta(eps) profile
_FDP_DISCRETIZATION = 1e-2  # PLD value discretization (pessimistic: coarser only weakens the test)
_FDP_SIGMA_RANGE = (1 / 8, 64.0)  # searched noise multipliers, relative to the plan's
_FDP_BISECTIONS = 14  # in log(sigma): relative precision ~ 2^-14 * log(512) ~ 0.04 %
_EPS_STEP = 0.05  # grid step of the scan for the first epsilon that is not refuted
_EPS_MAX = 100.0  # far beyond anything M <= 10^6 guesses can refute
_BISECTIONS = 30

BOUND_SOURCE = (
    "Steinke, Nasr & Jagielski 2023, 'Privacy auditing with one (1) training run' "
    "(arXiv:2305.08846), Theorem 3 (approximate DP: binomial tail plus the 2 M delta term); "
    "computed with scipy.stats.binom in dpkfc_med.privacy.audit.bounds"
)
FDP_BOUND_SOURCE = (
    "Mahloujifar, Melis & Chaudhuri 2025, 'Auditing f-differential privacy in one run' "
    "(arXiv:2410.22235), the recursion with abstentions, tested against the trade-off curve of "
    "the accounted Poisson-subsampled Gaussian plan (dp_accounting PLD, pessimistic) with the "
    "plan's q and T and the noise multiplier varied; computed in dpkfc_med.privacy.audit.bounds"
)
# Why not a library for the f-DP test: the authors' implementation ships in Meta's PrivacyGuard
# (PyPI ``privacyguard-platform`` 0.0.x), which pulls transformers, plotly, ipywidgets and
# pytest as run-time dependencies and tests Gaussian (mu-GDP) curves only, on a fixed linear
# grid of noises; jax_privacy 2.0's ``auditing`` module has the same recursion as a private
# helper, against the curve of the one Gaussian mechanism with the claimed (epsilon, delta)
# (dp_accounting.get_sigma_gaussian): the same mu-GDP reading. That reading is not sound here:
# the subsampled Gaussian at epsilon 8 is not mu-GDP for the mu that matches its
# (epsilon, delta) (its tail is heavier), so a correct run could read "refuted". The recursion
# is a dozen lines of numpy; tests check its false-refutation rate exactly on randomized
# response and by simulation on Gaussian mechanisms, and its shortcuts against the full walk.

# Why not a library: jax_privacy.auditing implements this bound but ``import
# jax_privacy.auditing`` runs jax_privacy/__init__.py, which imports JAX (a ~600 MB install
# this project does not otherwise need), and its one-run audit guesses one side only (k- = 0);
# dp_accounting (installed) has no auditing. The statistics are a few lines of scipy, tested
# against brute-force binomial sums in tests/privacy/test_audit.py.


def _check_counts(canaries: int, guesses: int, correct: int) -> None:
    problems = []
    if not (isinstance(canaries, (int, np.integer)) and canaries >= 1):
        problems.append(f"canaries={canaries!r}: must be an integer >= 1")
    if not (isinstance(guesses, (int, np.integer)) and 0 <= guesses <= max(canaries, 0)):
        problems.append(f"guesses={guesses!r}: must be an integer in [0, canaries={canaries}]")
    if not (isinstance(correct, (int, np.integer)) and 0 <= correct <= max(guesses, 0)):
        problems.append(f"correct={correct!r}: must be an integer in [0, guesses={guesses}]")
    if problems:
        raise ValueError("invalid audit counts:\n  " + "\n  ".join(problems))


def check_probability(name: str, value: float, *, open_low: bool) -> None:
    """Refuse a probability outside ``(0, 1)`` (``open_low``) or ``[0, 1)``, naming the argument.

    Raises:
        ValueError: ``name=value: must be a number in (0, 1)`` (or ``[0, 1)``).
    """
    ok = (0 < value < 1) if open_low else (0 <= value < 1)
    if not (isinstance(value, (int, float)) and ok):
        interval = "(0, 1)" if open_low else "[0, 1)"
        raise ValueError(f"{name}={value!r}: must be a number in {interval}")


def one_run_p_value(
    *, canaries: int, guesses: int, correct: int, epsilon: float, delta: float
) -> float:
    """P-value of ``correct`` or more correct guesses under ``(epsilon, delta)``-DP.

    Theorem 3 of Steinke, Nasr & Jagielski (2023): with ``r = guesses``, ``v = correct``,
    ``m = canaries`` and ``f(u) = P[Binomial(r, e^eps / (1 + e^eps)) >= u]``, the probability
    of at least ``v`` correct guesses is at most
    ``f(v) + 2 m delta max_{i=1..v} (f(v - i) - f(v)) / i`` (capped at 1). The maximum over
    ``i > v`` is never larger than at ``i = v`` (``f(v - i) = 1`` there), so ``1..v`` suffices.

    Args:
        canaries: ``m``, the number of canaries (included or not).
        guesses: ``r``, the number of canaries guessed (not abstained on).
        correct: ``v``, the number of correct guesses.
        epsilon: the epsilon being tested, ``>= 0``.
        delta: the delta being tested, in ``[0, 1)``.

    Returns:
        The p-value in ``[0, 1]``.
    """
    _check_counts(canaries, guesses, correct)
    check_probability("delta", delta, open_low=False)
    if not (epsilon >= 0):
        raise ValueError(f"epsilon={epsilon!r}: must be >= 0")
    if correct == 0:
        return 1.0
    q = 1.0 / (1.0 + math.exp(-epsilon))
    tail = float(stats.binom.sf(correct - 1, guesses, q))  # f(v)
    if delta == 0:
        return min(tail, 1.0)
    # f(v - i) - f(v) = P[v - i <= W < v]: cumulative pmf downwards from v - 1.
    below = stats.binom.pmf(np.arange(correct - 1, -1, -1), guesses, q)
    ratio = np.cumsum(below) / np.arange(1, correct + 1)
    return min(tail + 2.0 * canaries * delta * float(ratio.max()), 1.0)


def epsilon_lower_bound(
    *,
    canaries: int,
    guesses: int,
    correct: int,
    delta: float,
    confidence: float = DEFAULT_CONFIDENCE,
) -> float:
    """The largest epsilon that ``correct`` out of ``guesses`` refutes at ``confidence``.

    Every ``epsilon`` below the returned value has :func:`one_run_p_value` at most
    ``1 - confidence``: if the mechanism were ``(epsilon, delta)``-DP for such an epsilon, a
    result at least this good would have had probability at most ``1 - confidence``. The first
    epsilon that is not refuted is found by a scan on a 0.05 grid (which does not assume the
    p-value grows with epsilon) refined by bisection to about ``1e-10``.

    Args:
        canaries: the number of canaries ``m``.
        guesses: the number of guesses ``r`` (``k+ + k-``).
        correct: the number of correct guesses ``v``.
        delta: the delta of the claim under test (the run's delta).
        confidence: ``1 -`` the allowed probability of a wrong (too high) bound.

    Returns:
        The lower bound, ``0.0`` when nothing is refuted (e.g. guesses at chance).
    """
    check_probability("confidence", confidence, open_low=True)
    significance = 1.0 - confidence

    def refuted(eps: float) -> bool:
        p = one_run_p_value(
            canaries=canaries, guesses=guesses, correct=correct, epsilon=eps, delta=delta
        )
        return p <= significance

    if not refuted(0.0):
        return 0.0
    lo = 0.0
    while lo < _EPS_MAX and refuted(lo + _EPS_STEP):
        lo += _EPS_STEP
    hi = lo + _EPS_STEP
    for _ in range(_BISECTIONS):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if refuted(mid) else (lo, mid)
    return lo


class Verdict:
    """The three readings of an audit (plain strings in the records)."""

    REFUTED = "REFUTED"
    CONSISTENT = "consistent"
    CANNOT_REFUTE = "cannot refute"


@dataclass(frozen=True)
class GaussianPlan:
    """The accounted mechanism: ``steps`` Poisson-subsampled Gaussian steps (public settings).

    Attributes:
        sample_rate: ``q``, the Poisson sample rate.
        noise_multiplier: ``sigma``, the accounted noise std over the clip norm.
        steps: ``T``, the number of noisy steps.
        accountant: the accountant that turns a plan into epsilon (``prv``, ``rdp``, ``pld``).
    """

    sample_rate: float
    noise_multiplier: float
    steps: int
    accountant: str = "prv"

    def epsilon(self, delta: float, noise_multiplier: float | None = None) -> float:
        """Epsilon at ``delta`` of this plan, or of it with another noise multiplier."""
        from dpkfc_med.privacy.accounting import GaussianSteps, epsilon_for

        sigma = self.noise_multiplier if noise_multiplier is None else noise_multiplier
        return float(
            epsilon_for(
                [GaussianSteps(self.sample_rate, float(sigma), int(self.steps))],
                delta,
                self.accountant,
            )
        )


TradeoffInverse = Callable[[np.ndarray], np.ndarray]
"""``x -> f(1 - x)`` for a symmetric trade-off curve ``f``: the least probability of a wrong
guess on one canary for a mechanism that is ``f``-DP, given the probability ``x`` of a right one
(convex and increasing)."""


def gaussian_tradeoff_inverse(mu: float) -> TradeoffInverse:
    """``x -> Phi(Phi^-1(x) - mu)``: :data:`TradeoffInverse` of ``mu``-GDP (Dong, Roth & Su)."""
    return lambda x: ndtr(ndtri(np.clip(x, 0.0, 1.0)) - mu)


@functools.lru_cache(maxsize=512)
def _plan_pieces(sample_rate: float, sigma: float, steps: int) -> tuple[np.ndarray, np.ndarray]:
    from dp_accounting.pld import privacy_loss_distribution as pld

    dist = pld.from_gaussian_mechanism(
        standard_deviation=sigma,
        sampling_prob=sample_rate,
        value_discretization_interval=_FDP_DISCRETIZATION,
    ).self_compose(steps)
    # max over the add and the remove direction: valid for both, as the lemma needs
    delta = np.asarray(dist.get_delta_for_epsilon(_FDP_EPS_GRID), dtype=np.float64)
    return _FDP_EPS_GRID.copy(), np.minimum(delta, 1.0)


@functools.lru_cache(maxsize=512)
def plan_tradeoff_inverse(
    sample_rate: float, noise_multiplier: float, steps: int
) -> TradeoffInverse:
    r""":data:`TradeoffInverse` of ``steps`` Poisson-subsampled Gaussian steps.

    From the mechanism's privacy profile ``delta(eps)`` (both neighbouring directions) on a grid
    of epsilons: every event ``E`` has
    :math:`P_0(E) \ge e^{-\varepsilon}(P_1(E) - \delta(\varepsilon))` and
    :math:`P_0(E) \ge 1 - \delta(\varepsilon) - e^{\varepsilon}(1 - P_1(E))`, so

    .. math::

        f(1 - x) \ge \max\Big(0, \max_{\varepsilon} e^{-\varepsilon}(x - \delta(\varepsilon)),
        \max_{\varepsilon} 1 - \delta(\varepsilon) - e^{\varepsilon}(1 - x)\Big).

    A finite grid and a pessimistic ``delta`` only lower this curve, which weakens the test and
    never makes a correct mechanism look refuted.
    """
    eps, delta = _plan_pieces(float(sample_rate), float(noise_multiplier), int(steps))
    shrink, grow = np.exp(-eps), np.exp(eps)
    keep = grow < 1e300
    # keep the pieces that are the maximum somewhere on a dense grid of x (a subset of the
    # pieces only lowers the curve, so the test stays valid; it is ~10x faster)
    x = np.concatenate([np.geomspace(1e-12, 0.5, 4000), 1.0 - np.geomspace(1e-12, 0.5, 4000)])
    a = (x[:, None] - delta) * shrink
    b = np.where(keep, 1.0 - delta - grow * (1.0 - x[:, None]), -np.inf)
    use_a = np.unique(a.argmax(axis=1))
    use_b = np.unique(b.argmax(axis=1))
    delta_a, shrink = delta[use_a], shrink[use_a]
    delta_b, grow = delta[use_b], grow[use_b]

    def inverse(x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)[..., None]
        a = ((x - delta_a) * shrink).max(axis=-1)
        b = (1.0 - delta_b - grow * (1.0 - x)).max(axis=-1)
        return np.maximum(np.maximum(a, b), 0.0)

    return inverse


def fdp_refutes(
    inverse: TradeoffInverse, *, canaries: int, guesses: int, correct: int, significance: float
) -> bool:
    """Whether ``correct`` of ``guesses`` refutes ``f``-DP at ``significance``.

    The numerical test of Mahloujifar, Melis & Chaudhuri (2025) with abstentions, for a binary
    secret per canary: suppose ``P[at least v correct] >= significance``; spread that mass over
    the right (``r``) and wrong (``h``) guesses, per canary, in the proportions observed
    (``r_v = t v / r'``, ``h_v = t (r' - v) / r'`` with ``t = significance * r' / m``), then
    walk down to zero correct guesses, each step needing at least
    ``h_i = max(h_{i+1}, f(1 - r_{i+1}))`` wrong-guess mass and
    ``r_i = r_{i+1} + i / (r' - i) * (h_i - h_{i+1})`` right-guess mass. If the mass needed,
    ``r_0 + h_0``, exceeds what ``r'`` guesses on ``m`` canaries hold (``r' / m``), no ``f``-DP
    mechanism makes the outcome that likely: the claim is refuted.

    Args:
        inverse: :data:`TradeoffInverse` of the claim under test.
        canaries: ``m``.
        guesses: ``r'``, guesses made (abstentions excluded).
        correct: ``v``, correct guesses among them.
        significance: the allowed probability of refuting a true claim.

    Returns:
        ``True`` when the claim is refuted.
    """
    _check_counts(canaries, guesses, correct)
    check_probability("significance", significance, open_low=True)
    if correct == 0:
        return False
    total = guesses / canaries
    mass = significance * total
    r = mass * correct / guesses
    h = mass * (guesses - correct) / guesses
    for i in range(correct - 1, -1, -1):
        h_next = max(h, float(inverse(np.array(r))))
        if h_next == h:  # r stays too: a fixed point, and r + h is still within the total
            return False
        r += i / (guesses - i) * (h_next - h)
        h = h_next
        if r + h > total:  # the mass only grows on the way down
            return True
    return False


def tolerated_wrong(
    inverse: TradeoffInverse, *, canaries: int, guesses: int, significance: float
) -> int | None:
    """The most wrong guesses out of ``guesses`` that still refute ``f``-DP (:func:`fdp_refutes`).

    ``None`` when even all-correct guesses do not refute it. The refuted outcomes form an upper
    set in the number of correct guesses (more correct guesses need more mass on the way down),
    so a bisection over the correct count finds the edge.

    Args:
        inverse: :data:`TradeoffInverse` of the claim under test.
        canaries: ``m``.
        guesses: ``r'``, guesses made.
        significance: the allowed probability of refuting a true claim.

    Returns:
        ``w`` such that ``guesses - w`` correct guesses refute the claim and
        ``guesses - w - 1`` do not; ``None`` if ``guesses`` correct do not.
    """

    def refutes(wrong: int) -> bool:
        return fdp_refutes(
            inverse,
            canaries=canaries,
            guesses=guesses,
            correct=guesses - wrong,
            significance=significance,
        )

    if not refutes(0):
        return None
    lo, hi = 0, guesses  # lo wrong refutes; hi wrong (no correct guess) never does
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if refutes(mid) else (lo, mid)
    return lo


def guess_counts(canaries: int) -> tuple[int, ...]:
    """The guess counts ``k`` (per side) tried for ``canaries`` canaries.

    :data:`GUESS_GRID` limited to ``2 k <= canaries``; ``(canaries // 2,)`` when even the
    smallest grid entry does not fit. Fixed before the run, so that the Bonferroni split over
    them is valid.
    """
    if canaries < 2:
        raise ValueError(
            f"canaries={canaries}: at least 2 canaries are needed (one guess on each side)"
        )
    grid = tuple(k for k in GUESS_GRID if 2 * k <= canaries)
    return grid or (canaries // 2,)


def verdict_of(*, refuted: bool, can_refute: bool) -> str:
    """:class:`Verdict` from whether the claim is refuted and whether it could have been."""
    if refuted:
        return Verdict.REFUTED
    return Verdict.CONSISTENT if can_refute else Verdict.CANNOT_REFUTE


def max_bound(
    canaries: int,
    *,
    delta: float,
    confidence: float = DEFAULT_CONFIDENCE,
    counts: Sequence[int] | None = None,
    plan: GaussianPlan | None = None,
) -> float:
    """The audit's ceiling: its bound when every guess at the best guess count is correct.

    Decided by public settings only (``M``, the guess grid, ``delta``, the confidence and, for
    the f-DP test, the plan's ``q`` and ``T``). When it does not exceed the accounted epsilon
    the audit cannot refute the claim, whatever the run does.
    """
    return _max_bound(
        canaries, float(delta), float(confidence), check_guess_counts(canaries, counts), plan
    )


@functools.lru_cache(maxsize=64)
def _max_bound(
    canaries: int, delta: float, confidence: float, ks: tuple[int, ...], plan: GaussianPlan | None
) -> float:
    per_choice = 1.0 - (1.0 - confidence) / len(ks)
    if plan is None:
        return max(
            epsilon_lower_bound(
                canaries=canaries, guesses=2 * k, correct=2 * k, delta=delta, confidence=per_choice
            )
            for k in ks
        )
    outcomes = [(2 * k, 2 * k) for k in ks]
    return fdp_bound(plan, canaries, outcomes, 1.0 - per_choice, delta)[0]


def check_guess_counts(m: int, counts: Sequence[int] | None) -> tuple[int, ...]:
    """The guess counts ``k`` to test on ``m`` canaries (default :func:`guess_counts`).

    Raises:
        ValueError: a count that is not an integer with ``1 <= k <= m / 2``.
    """
    ks = tuple(guess_counts(m) if counts is None else counts)
    bad = [k for k in ks if not (isinstance(k, (int, np.integer)) and 1 <= k and 2 * k <= m)]
    if not ks or bad:
        raise ValueError(
            f"counts={list(ks)}: each must be an integer k with 1 <= k <= M/2 = {m // 2}"
        )
    return tuple(int(k) for k in ks)


def _refutes_plan(
    plan: GaussianPlan,
    sigma: float,
    canaries: int,
    outcomes: Sequence[tuple[int, int]],
    significance: float,
) -> bool:
    inverse = plan_tradeoff_inverse(plan.sample_rate, sigma, plan.steps)
    return any(
        fdp_refutes(inverse, canaries=canaries, guesses=g, correct=c, significance=significance)
        for g, c in outcomes
    )


def fdp_bound(
    plan: GaussianPlan,
    canaries: int,
    outcomes: Sequence[tuple[int, int]],
    significance: float,
    delta: float,
) -> tuple[float, float | None]:
    """(epsilon of the noisiest refuted plan, its noise multiplier); ``(0, None)`` if none.

    More noise is a stronger claim, easier to refute, so the refuted noise multipliers form
    an interval upwards; the bisection (in log sigma) keeps a refuted ``hi``, and the bound is
    the epsilon of ``hi``: never more than the epsilon of the exact boundary.
    """

    def refuted(sigma: float) -> bool:
        return _refutes_plan(plan, sigma, canaries, outcomes, significance)

    sigma0 = float(plan.noise_multiplier)
    lo, hi = sigma0 * _FDP_SIGMA_RANGE[0], sigma0 * _FDP_SIGMA_RANGE[1]
    if refuted(sigma0):
        hi = sigma0
        if refuted(lo):  # beyond the searched range: report its (huge) epsilon, an underestimate
            return _plan_epsilon(plan, delta, lo), lo
    else:
        lo = sigma0
        if not refuted(hi):
            return 0.0, None
    for _ in range(_FDP_BISECTIONS):
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if refuted(mid) else (mid, hi)
    return _plan_epsilon(plan, delta, hi), hi


def _plan_epsilon(plan: GaussianPlan, delta: float, sigma: float) -> float:
    try:
        return plan.epsilon(delta, sigma)
    except Exception:  # pragma: no cover - an accountant outside its domain: the PLD answers
        return GaussianPlan(plan.sample_rate, sigma, plan.steps, "pld").epsilon(delta)
