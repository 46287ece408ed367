"""The audit's canary scores, and its power: what it would show on a broken mechanism.

:func:`canary_scores` turns the released noisy sums at the canaries' coordinates into log
likelihood ratios; :func:`audit_power` simulates, from the public plan alone, one run of the
mechanism with a tenth of the accounted noise (:data:`BROKEN_NOISE_SCALE`), scores and guesses
it as a real run is, and says whether the audit refutes it and with what margin;
:func:`default_canaries` sizes the audit by that power. The audit itself is
:mod:`dpkfc_med.privacy.audit`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from dpkfc_med.privacy.audit.bounds import (
    DEFAULT_CONFIDENCE,
    GaussianPlan,
    check_guess_counts,
    fdp_bound,
    fdp_refutes,
    plan_tradeoff_inverse,
    tolerated_wrong,
)

__all__ = [
    "BROKEN_NOISE_SCALE",
    "DEFAULT_CANARY_CHOICES",
    "NULL_DOF",
    "POWER_MARGIN",
    "AuditPower",
    "audit_power",
    "canary_scores",
    "default_canaries",
    "guess_outcomes",
    "simulated_scores",
]


def guess_outcomes(scores: np.ndarray, included: np.ndarray, ks: Sequence[int]) -> list[int]:
    """Correct guesses for each ``k``: the ``k`` highest scores "in", the ``k`` lowest "out"."""
    m = len(scores)
    order = np.argsort(scores, kind="stable")
    return [int(included[order[m - k :]].sum() + (~included[order[:k]]).sum()) for k in ks]


DETREND_WINDOW = 21
"""Steps in the running median that :func:`canary_scores` subtracts."""

SPARSE_RATE = 0.1
"""Largest sample rate ``q`` for which :func:`canary_scores` detrends (else: plain sums)."""

NULL_DOF = 3.0
"""Degrees of freedom of the Student-t null in :func:`canary_scores`.

Data gradients at a coordinate are heavy-tailed (a few units now and then move it by more than
``C``). Under a Gaussian null the credit of a residual ``e`` grows like ``C e / s^2`` without
limit, so one data spike of ``2 C`` on a quiet coordinate counts as three canary draws and a
few such spikes put an excluded canary among the most confident guesses; under a Student-t null
a residual far from ``C`` earns almost nothing, and only residuals near ``C`` count as draws."""

DEFAULT_CANARY_CHOICES = (5000, 10000, 20000)
"""Canary counts tried, in order, by :func:`default_canaries`."""

BROKEN_NOISE_SCALE = 0.1
"""The broken mechanism the audit is sized to refute draws this fraction of the accounted noise."""

POWER_MARGIN = 0.002
"""Wrong-guess fraction the simulated broken run must survive for :func:`default_canaries`."""

_POWER_SEED = 0  # one fixed simulated run: the power is a function of the public settings
_SIM_BLOCK = 4_000_000  # released values simulated at once (T x canaries), ~32 MB


def canary_scores(released: np.ndarray, *, sample_rate: float, clip_norm: float) -> np.ndarray:
    r"""``[M]`` log likelihood ratios "drawn at rate ``q``" against "never drawn".

    The released value at a canary's coordinate is the data's clipped gradient there plus noise
    plus ``C`` in the steps that drew the canary. The score removes each coordinate's slow drift
    (a running median over :data:`DETREND_WINDOW` steps), takes the residual's spread ``s``
    (1.4826 times its median absolute deviation over the steps) and sums, over the steps, the
    log likelihood ratio of a Poisson-drawn spike of ``C`` under a Student-t null with
    :data:`NULL_DOF` degrees of freedom and scale ``s``:

    .. math::

        \sum_t \log\Big(1 - q + q\, \frac{p_\nu((e_t - C) / s)}{p_\nu(e_t / s)}\Big),
        \qquad \log \frac{p_\nu(a)}{p_\nu(b)} = \frac{\nu + 1}{2}
        \log \frac{1 + b^2 / \nu}{1 + a^2 / \nu}.

    Quiet coordinates show each draw plainly; loud ones (large data gradients) score near the
    middle, where the auditor abstains. A function of the released outputs and public settings
    only (never of the inclusion), so the bound stays valid. It needs sparse draws
    (``q <=`` :data:`SPARSE_RATE`, at most ~2 spikes per window); above that, and for runs of
    fewer than 3 steps, the score is the plain sum over the steps.

    Args:
        released: ``[T, M]`` released noisy sums at the canaries' coordinates, per noisy step.
        sample_rate: ``q``.
        clip_norm: ``C``, what a drawn canary adds.

    Returns:
        ``[M]`` scores, higher for canaries more likely included.
    """
    released = np.asarray(released, dtype=np.float64)
    if len(released) < 3 or sample_rate > SPARSE_RATE:
        return released.sum(axis=0)  # dense draws: the median would follow the spikes
    from scipy.ndimage import median_filter

    window = min(DETREND_WINDOW, len(released) | 1)
    left = released - median_filter(released, size=(window, 1), mode="nearest")
    mad = np.median(np.abs(left - np.median(left, axis=0)), axis=0)
    spread = np.maximum(1.4826 * mad, 1e-6 * clip_norm)
    c, q, nu = clip_norm, min(sample_rate, 1 - 1e-12), NULL_DOF
    ratio = (
        (nu + 1)
        / 2
        * (np.log1p((left / spread) ** 2 / nu) - np.log1p(((left - c) / spread) ** 2 / nu))
    )
    return np.logaddexp(math.log1p(-q), math.log(q) + ratio).sum(axis=0)


def simulated_scores(
    plan: GaussianPlan, canaries: int, *, noise_scale: float = 1.0, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """``([M] scores, [M] inclusion)`` of one simulated run of ``plan``'s mechanism.

    Each canary is included with probability 1/2; in each of the ``T`` steps an included canary
    is drawn with probability ``q`` and adds ``C = 1`` to its coordinate, and every coordinate
    carries Gaussian noise of std ``noise_scale * sigma``; no data gradient. The values are
    scored by :func:`canary_scores`, as a real run's are.

    Args:
        plan: the mechanism (``q``, ``sigma``, ``T``).
        canaries: ``M``.
        noise_scale: fraction of ``sigma`` drawn (``1``: the accounted mechanism).
        seed: seed of the simulation.

    Returns:
        The scores and the inclusion.
    """
    rng = np.random.default_rng(seed)
    t, q = int(plan.steps), float(plan.sample_rate)
    std = noise_scale * float(plan.noise_multiplier)
    included = rng.random(canaries) < 0.5
    scores = np.zeros(canaries)
    block = max(1, _SIM_BLOCK // max(t, 1))
    for lo in range(0, canaries, block):
        n = min(canaries, lo + block) - lo
        released = ((rng.random((t, n)) < q) & included[lo : lo + n]) + rng.normal(0, std, (t, n))
        scores[lo : lo + n] = canary_scores(released, sample_rate=q, clip_norm=1.0)
    return scores, included


@dataclass(frozen=True)
class AuditPower:
    """What an audit with these settings would show on a mechanism with too little noise.

    Attributes:
        noise_scale: fraction of the accounted noise the simulated broken mechanism draws.
        epsilon_lower_bound: the f-DP lower bound its simulated run reaches.
        refutes: whether that run refutes the accounted plan (else the audit cannot refute).
        k: the guess count (per side) with the largest margin.
        guesses: ``2 k``.
        correct: the simulated run's correct guesses at ``k``.
        tolerated_wrong: the margin: the most wrong guesses out of ``guesses`` at which the
            accounted plan is still refuted; ``None`` when no guess count can refute it.
        candidates: per guess count: ``k``, ``guesses``, simulated ``correct`` and
            ``tolerated_wrong``.
        simulation: how the broken run was simulated (for the record).
    """

    noise_scale: float
    epsilon_lower_bound: float
    refutes: bool
    k: int
    guesses: int
    correct: int
    tolerated_wrong: int | None
    candidates: tuple[dict[str, Any], ...] = ()
    simulation: str = ""

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict."""
        return asdict(self) | {"candidates": [dict(c) for c in self.candidates]}


def audit_power(
    plan: GaussianPlan,
    canaries: int,
    *,
    delta: float,
    confidence: float = DEFAULT_CONFIDENCE,
    counts: Sequence[int] | None = None,
    noise_scale: float = BROKEN_NOISE_SCALE,
) -> AuditPower:
    """The audit's power against ``plan`` run with ``noise_scale`` times its noise.

    Public settings only: one simulated run (:func:`simulated_scores`, fixed seed) of the
    broken mechanism with ``canaries`` canaries, guessed with the audit's guess counts and
    tested at its Bonferroni significance against the accounted plan; the lower bound it
    reaches; and, per guess count, how many wrong guesses the refutation of the accounted plan
    survives. The simulation has no data gradient, so a real run sees more wrong guesses: the
    margin says how many it can afford.

    Args:
        plan: the accounted mechanism.
        canaries: ``M``.
        delta: the delta of the claim under test.
        confidence: the audit's overall confidence.
        counts: guess counts per side; default :func:`guess_counts` of ``M``.
        noise_scale: fraction of the accounted noise the broken mechanism draws.

    Returns:
        The :class:`AuditPower`.
    """
    ks = check_guess_counts(canaries, counts)
    return _audit_power(plan, canaries, float(delta), float(confidence), ks, float(noise_scale))


@functools.lru_cache(maxsize=64)
def _audit_power(
    plan: GaussianPlan,
    canaries: int,
    delta: float,
    confidence: float,
    ks: tuple[int, ...],
    noise_scale: float,
) -> AuditPower:
    significance = (1.0 - confidence) / len(ks)
    scores, included = simulated_scores(plan, canaries, noise_scale=noise_scale, seed=_POWER_SEED)
    correct = guess_outcomes(scores, included, ks)
    lower, _ = fdp_bound(
        plan, canaries, [(2 * k, c) for k, c in zip(ks, correct)], significance, delta
    )
    at_plan = plan_tradeoff_inverse(plan.sample_rate, plan.noise_multiplier, plan.steps)
    candidates: list[dict[str, Any]] = []
    for k, c in zip(ks, correct):
        kw: dict[str, Any] = {"canaries": canaries, "guesses": 2 * k, "significance": significance}
        candidates.append(
            {
                "k": k,
                "guesses": 2 * k,
                "correct": c,
                "tolerated_wrong": tolerated_wrong(at_plan, **kw),
            }
        )
    refutes = any(
        fdp_refutes(at_plan, canaries=canaries, guesses=2 * k, correct=c, significance=significance)
        for k, c in zip(ks, correct)
    )
    # the guess count whose refutation survives the largest fraction of wrong guesses
    best = max(
        candidates,
        key=lambda c: (
            -1 if c["tolerated_wrong"] is None else c["tolerated_wrong"] / c["guesses"],
            c["k"],
        ),
    )
    return AuditPower(
        noise_scale=noise_scale,
        epsilon_lower_bound=lower,
        refutes=refutes,
        k=best["k"],
        guesses=best["guesses"],
        correct=best["correct"],
        tolerated_wrong=best["tolerated_wrong"],
        candidates=tuple(candidates),
        simulation=(
            f"one simulated run (seed {_POWER_SEED}) of the plan (q={plan.sample_rate:.6g}, "
            f"T={plan.steps}) drawing {noise_scale:g} x sigma={plan.noise_multiplier:.6g}: "
            f"{canaries} canaries, each included with probability 1/2 and adding C to its "
            "coordinate when drawn, Gaussian noise, no data gradient; scored and guessed as a "
            "real run"
        ),
    )


def default_canaries(
    plan: GaussianPlan,
    *,
    coordinates: int,
    delta: float,
    confidence: float = DEFAULT_CONFIDENCE,
) -> int:
    """The fewest canaries of :data:`DEFAULT_CANARY_CHOICES` sized to refute a broken ``plan``.

    Public settings only: the first ``M`` (at most ``coordinates``, one per trainable
    coordinate) whose :func:`audit_power` refutes the accounted plan with a margin of at least
    :data:`POWER_MARGIN` of the guesses wrong; else the largest that fits.
    """
    fits = [m for m in DEFAULT_CANARY_CHOICES if m <= coordinates] or [coordinates]
    for m in fits:
        if m < 2:
            break
        power = audit_power(plan, m, delta=delta, confidence=confidence)
        if power.refutes and (power.tolerated_wrong or 0) >= POWER_MARGIN * power.guesses:
            return m
    return fits[-1]
