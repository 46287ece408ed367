r"""Accounted hyperparameter tuning: a random number of private trials, only the best released.

Papernot & Steinke, "Hyperparameter tuning with Renyi differential privacy" (ICLR 2022,
arXiv:2110.03620): run a random number ``K`` of trials, each a differentially private mechanism
``Q`` that trains with hyperparameters drawn at random and scores the result privately, and
release only the trial with the best noisy score. If ``Q`` is :math:`(\lambda,
\varepsilon_\lambda)`-RDP, the whole procedure is RDP with a bound a small multiple of one
trial's (their Theorems 2 and 6):

* ``K ~ Poisson(mu)``: :math:`\varepsilon'_\lambda = \varepsilon_\lambda + \mu \hat\delta +
  \log(\mu) / (\lambda - 1)`, with :math:`\hat\delta` the trial's delta at
  :math:`\hat\varepsilon = \log(1 + 1/(\lambda - 1))`;
* ``K ~ TNB(eta, gamma)`` (truncated negative binomial; ``eta = 1``: geometric):
  :math:`\varepsilon'_\lambda = \varepsilon_\lambda + (1 + \eta) \min_{\hat\lambda}
  ((1 - 1/\hat\lambda) \varepsilon_{\hat\lambda} + \log(1/\gamma)/\hat\lambda) +
  \log(E[K]) / (\lambda - 1)`.

One trial here is the Poisson-subsampled Gaussian training run (``T`` steps at rate ``q``, noise
multiplier ``sigma``) composed with a Gaussian validation score (noise multiplier
``sigma_score`` on a sum of per-unit scores in ``[0, 1]``). A unit belongs to the training or
the validation split, never both, so charging both to every unit over-counts (parallel
composition would be tighter): the bound is conservative. The trial's hyperparameters are drawn
uniformly from a grid and must not change ``q`` or ``T`` (every trial is then the same
mechanism; the clip norm and the learning rate may vary, ``sigma`` is a multiplier of ``C``).

The bounds come from Google's ``dp_accounting`` (``RepeatAndSelectDpEvent`` in its RDP
accountant, which implements both theorems); ``autodp``'s released versions have no private
selection. The trial count is drawn here from OS entropy, so that nobody can predict or replay
it.
"""

from __future__ import annotations

import logging
import math
import secrets
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

__all__ = [
    "TrialCount",
    "TuningPlan",
    "plan_tuning",
    "trial_event",
    "tuning_epsilon",
]

_SCORE_SHARE = 0.1
"""Share of the target epsilon that one trial's validation score would spend on its own."""


@dataclass(frozen=True)
class TrialCount:
    """The distribution of the number of trials ``K``.

    Attributes:
        kind: ``"poisson"`` (``K`` may be 0: nothing is released then) or ``"tnb"``
            (truncated negative binomial, ``K >= 1``).
        mu: Poisson mean.
        eta: TNB shape (``0``: logarithmic, ``1``: geometric).
        gamma: TNB parameter in ``(0, 1)``; smaller means more trials.
    """

    kind: str
    mu: float = 0.0
    eta: float = 0.0
    gamma: float = 0.0

    @classmethod
    def parse(cls, text: str) -> TrialCount:
        """``"poisson:MU"`` or ``"tnb:ETA,GAMMA"``.

        Raises:
            ValueError: another form, or parameters out of range (named, with the fix).
        """
        kind, _, rest = str(text).partition(":")
        try:
            values = [float(v) for v in rest.split(",")] if rest else []
        except ValueError:
            values = []
        if kind == "poisson" and len(values) == 1 and values[0] > 0:
            return cls("poisson", mu=values[0])
        if kind == "tnb" and len(values) == 2 and values[0] >= 0 and 0 < values[1] < 1:
            return cls("tnb", eta=values[0], gamma=values[1])
        raise ValueError(
            f"--trials {text!r}: use poisson:MU (MU > 0, the expected number of trials) or "
            "tnb:ETA,GAMMA (ETA >= 0, 0 < GAMMA < 1; e.g. tnb:1,0.2 for a geometric count)"
        )

    @property
    def mean(self) -> float:
        """``E[K]``."""
        if self.kind == "poisson":
            return self.mu
        g, eta = self.gamma, self.eta
        if eta == 0:
            return (1 - g) / (g * math.log(1 / g))
        return eta * (1 - g) / (g * (1 - g**eta))

    @property
    def shape(self) -> float:
        """``dp_accounting``'s shape parameter (``inf`` for Poisson)."""
        return math.inf if self.kind == "poisson" else self.eta

    def pmf(self, k: int) -> float:
        """``P[K = k]``."""
        if self.kind == "poisson":
            return math.exp(k * math.log(self.mu) - self.mu - math.lgamma(k + 1))
        if k < 1:
            return 0.0
        g, eta = self.gamma, self.eta
        if eta == 0:
            return (1 - g) ** k / (k * math.log(1 / g))
        log_coef = math.lgamma(k + eta) - math.lgamma(eta) - math.lgamma(k + 1)
        return math.exp(log_coef + k * math.log(1 - g)) / (g**-eta - 1)

    def sample(self, rng: np.random.Generator | None = None) -> int:
        """One draw of ``K`` (from OS entropy unless ``rng`` is given: tests only)."""
        rng = rng if rng is not None else np.random.default_rng(secrets.randbits(128))
        if self.kind == "poisson":
            return int(rng.poisson(self.mu))
        u, k, total = float(rng.random()), 0, 0.0
        while total <= u and k < 100_000:  # inverse CDF; the tail is geometric-light
            k += 1
            total += self.pmf(k)
        return k

    def describe(self) -> str:
        """The distribution in words, e.g. ``Poisson with mean 5``."""
        if self.kind == "poisson":
            return (
                f"Poisson with mean {self.mu:g} (no trial, and no release, with probability "
                f"{math.exp(-self.mu):.2g})"
            )
        return (
            f"truncated negative binomial (eta {self.eta:g}, gamma {self.gamma:g}), mean "
            f"{self.mean:.3g}"
        )


def trial_event(sample_rate: float, steps: int, noise_multiplier: float, score_noise: float) -> Any:
    """One trial as a ``dp_accounting`` event: training steps, then the noisy validation score."""
    from dp_accounting import dp_event as de

    train = de.SelfComposedDpEvent(
        de.PoissonSampledDpEvent(sample_rate, de.GaussianDpEvent(noise_multiplier)), steps
    )
    return de.ComposedDpEvent([train, de.GaussianDpEvent(score_noise)])


def _epsilon(event: Any, delta: float) -> float:
    from dp_accounting.rdp import RdpAccountant

    # dp_accounting logs (through absl) each order it drops when a series does not converge;
    # a dropped order only loosens the bound, so the message is not a warning for the user
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        acc = RdpAccountant()
        acc.compose(event)
        return float(acc.get_epsilon(delta))
    finally:
        absl.setLevel(level)


def tuning_epsilon(
    sample_rate: float,
    steps: int,
    noise_multiplier: float,
    score_noise: float,
    count: TrialCount,
    delta: float,
) -> float:
    """Epsilon of the whole tuning (RDP accountant, Papernot-Steinke) at ``delta``."""
    from dp_accounting import dp_event as de

    one = trial_event(sample_rate, steps, noise_multiplier, score_noise)
    return _epsilon(de.RepeatAndSelectDpEvent(one, count.mean, count.shape), delta)


@dataclass(frozen=True)
class TuningPlan:
    """Noise of every trial so that the whole tuning spends at most the target.

    Attributes:
        target_epsilon: what the whole tuning may spend.
        epsilon: what it spends (at most the target).
        delta: the delta of both.
        sample_rate: ``q`` of every trial.
        steps: ``T`` of every trial.
        noise_multiplier: ``sigma`` of every trial's training.
        score_noise: noise multiplier of the validation score (std on the sum of per-unit
            scores, each in ``[0, 1]``: sensitivity 1).
        trial_epsilon: one trial alone (training and score), for comparison.
        training_epsilon: one trial's training alone (what its own run reports).
        trials: the distribution of ``K``.
    """

    target_epsilon: float
    epsilon: float
    delta: float
    sample_rate: float
    steps: int
    noise_multiplier: float
    score_noise: float
    trial_epsilon: float
    training_epsilon: float
    trials: TrialCount

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON)."""
        out = asdict(self)
        out["trials"] = {**asdict(self.trials), "mean": self.trials.mean}
        out["trials_in_words"] = self.trials.describe()
        return out


def _search(lo: float, hi: float, ok: Any, iters: int = 60) -> float:
    """The smallest value in ``[lo, hi]`` with ``ok(value)`` (``ok`` monotone), to rel 1e-4."""
    if not ok(hi):
        raise ValueError("no noise level in the search range meets the target")
    for _ in range(iters):
        mid = math.sqrt(lo * hi)
        if ok(mid):
            hi = mid
        else:
            lo = mid
        if hi / lo < 1 + 1e-4:
            break
    return hi


def plan_tuning(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    count: TrialCount,
    *,
    score_share: float = _SCORE_SHARE,
) -> TuningPlan:
    """Calibrate the score's and the training's noise to the tuning's total target.

    The score's noise is the smallest whose Gaussian alone spends ``score_share`` of the
    target; the training's noise is then the smallest for which the whole tuning
    (:func:`tuning_epsilon`) stays within the target.

    Raises:
        ValueError: the target cannot be met (e.g. a tiny epsilon with many expected trials).
    """
    from dp_accounting import dp_event as de

    if not (target_epsilon > 0 and 0 < delta < 1 and 0 < sample_rate <= 1 and steps >= 1):
        raise ValueError(
            f"plan_tuning: target_epsilon={target_epsilon}, delta={delta}, "
            f"sample_rate={sample_rate}, steps={steps} out of range"
        )
    budget = score_share * target_epsilon

    def fits(sigma: float) -> bool:
        eps = tuning_epsilon(sample_rate, steps, sigma, score_noise, count, delta)
        return eps <= target_epsilon

    try:
        score_noise = _search(0.05, 1e4, lambda s: _epsilon(de.GaussianDpEvent(s), delta) <= budget)
        sigma = _search(0.05, 1e3, fits)
    except ValueError:
        raise ValueError(
            f"a tuning with {count.describe()} trials cannot stay within epsilon "
            f"{target_epsilon:g} at delta {delta:g}: expect fewer trials (--trials) or raise "
            "the target"
        ) from None
    return TuningPlan(
        target_epsilon=target_epsilon,
        epsilon=tuning_epsilon(sample_rate, steps, sigma, score_noise, count, delta),
        delta=delta,
        sample_rate=sample_rate,
        steps=steps,
        noise_multiplier=sigma,
        score_noise=score_noise,
        trial_epsilon=_epsilon(trial_event(sample_rate, steps, sigma, score_noise), delta),
        training_epsilon=_epsilon(
            de.SelfComposedDpEvent(
                de.PoissonSampledDpEvent(sample_rate, de.GaussianDpEvent(sigma)), steps
            ),
            delta,
        ),
        trials=count,
    )
