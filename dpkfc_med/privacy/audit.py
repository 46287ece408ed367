r"""Empirical privacy audit in one training run: white-box gradient canaries and the bound.

Steinke, Nasr & Jagielski, "Privacy auditing with one (1) training run", NeurIPS 2023
(arXiv:2305.08846). ``M`` canaries are each included in the training set with probability 1/2,
independently; after training, an auditor that sees only the released outputs guesses which
canaries were included. Under ``(epsilon, delta)``-DP no auditor can guess much better than a
coin that is right with probability :math:`e^\varepsilon / (1 + e^\varepsilon)`, so many correct
guesses refute small epsilons. The largest refuted epsilon is an empirical *lower* bound on the
mechanism's epsilon, to be read next to the accountant's *upper* bound: a lower bound above the
accounted epsilon means the implementation is broken (or the accounting is wrong).

Canaries (:class:`DiracCanaries`): white-box gradient canaries that are Dirac vectors in the
clipped coordinates. Canary ``j`` owns one coordinate ``c_j`` of the flattened vector of all
trainable parameters (``M`` distinct coordinates, drawn at random). At every noisy step each
*included* canary is Poisson-sampled at the run's sample rate ``q``, like every unit, and when
drawn adds ``C e_{c_j}`` (norm exactly the clip norm ``C``) to the clipped sum before the noise.
In DP-KFC the clipped quantity is the preconditioned gradient, so this is exactly a unit whose
preconditioned per-unit gradient is ``C e_{c_j}``. The canary's score is the sum over all noisy
steps of coordinate ``c_j`` of the released noisy sum.

Guesses (:func:`audit_scores`): the ``k`` highest scores are guessed "included", the ``k``
lowest "excluded", the rest abstain (``k+ = k- = k``). ``k`` is chosen from a small grid fixed
before the run (:func:`guess_counts`); the confidence is split equally over the grid
(Bonferroni), and the best bound over the grid is reported, so the reported bound holds at the
stated confidence overall.

Bound (:func:`one_run_p_value`, :func:`epsilon_lower_bound`): Theorem 3 of Steinke et al. With
``r`` guesses of which ``v`` are correct and ``f(v) = P[Binomial(r, e^eps/(1+e^eps)) >= v]``,
an ``(epsilon, delta)``-DP mechanism gives

.. math::

    P[W \ge v] \le f(v) + 2 M \delta \max_{i = 1..v} \frac{f(v - i) - f(v)}{i},

and every epsilon whose right-hand side is at most ``1 - confidence`` is refuted.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from scipy import stats
from torch import Tensor

__all__ = [
    "DEFAULT_CONFIDENCE",
    "AuditResult",
    "DiracCanaries",
    "audit_scores",
    "epsilon_lower_bound",
    "guess_counts",
    "one_run_p_value",
]

DEFAULT_CONFIDENCE = 0.95
"""Probability that the reported lower bound does not exceed the mechanism's true epsilon."""

GUESS_GRID = (10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
"""Candidate guess counts ``k`` per side (``k+ = k- = k``), before limiting to ``2 k <= M``."""

_EPS_STEP = 0.05  # grid step of the scan for the first epsilon that is not refuted
_EPS_MAX = 100.0  # far beyond anything M <= 10^6 guesses can refute
_BISECTIONS = 30

BOUND_SOURCE = (
    "Steinke, Nasr & Jagielski 2023, 'Privacy auditing with one (1) training run' "
    "(arXiv:2305.08846), Theorem 3 (approximate DP: binomial tail plus the 2 M delta term); "
    "computed with scipy.stats.binom in dpkfc_med.privacy.audit"
)
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


def _check_probability(name: str, value: float, *, open_low: bool) -> None:
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
    _check_probability("delta", delta, open_low=False)
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
    _check_probability("confidence", confidence, open_low=True)
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


@dataclass(frozen=True)
class AuditResult:
    """Outcome of a one-run audit (all counts are over canaries).

    Attributes:
        epsilon_lower_bound: the reported empirical lower bound on epsilon (best over the
            guess counts, at the overall ``confidence``).
        confidence: probability that ``epsilon_lower_bound`` does not exceed the true epsilon.
        delta: the delta of the claim under test.
        canaries: ``M``, canaries drawn (included or not).
        included: canaries that were included (secret until the guesses were made).
        guesses: guesses made at the reported guess count (``k_plus + k_minus``).
        correct: correct guesses among them.
        k_plus: highest scores guessed "included".
        k_minus: lowest scores guessed "excluded".
        candidates: every guess count tried, with its guesses, correct guesses and bound.
        guess_rule: how guesses and the guess count were chosen (for the record).
        bound: the theorem and implementation used.
    """

    epsilon_lower_bound: float
    confidence: float
    delta: float
    canaries: int
    included: int
    guesses: int
    correct: int
    k_plus: int
    k_minus: int
    candidates: list[dict[str, Any]] = field(default_factory=list)
    guess_rule: str = ""
    bound: str = BOUND_SOURCE

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict."""
        return asdict(self)


def audit_scores(
    scores: Sequence[float] | np.ndarray,
    included: Sequence[bool] | np.ndarray,
    *,
    delta: float,
    confidence: float = DEFAULT_CONFIDENCE,
    counts: Sequence[int] | None = None,
) -> AuditResult:
    """Guess from canary scores and bound epsilon from the correct guesses.

    For each ``k`` in ``counts`` the ``k`` highest scores are guessed included and the ``k``
    lowest excluded; each ``k`` is tested at significance ``(1 - confidence) / len(counts)``
    (Bonferroni) and the best bound is reported. Ties are broken by canary index, which is
    independent of inclusion.

    Args:
        scores: ``[M]`` canary scores (higher: more likely included).
        included: ``[M]`` booleans, the secret inclusion of each canary.
        delta: the delta of the claim under test.
        confidence: overall confidence of the reported bound.
        counts: guess counts per side; default :func:`guess_counts` of ``M``.

    Returns:
        The :class:`AuditResult`.
    """
    s = np.asarray(scores, dtype=np.float64)
    inc = np.asarray(included, dtype=bool)
    m = len(s)
    if s.shape != (m,) or inc.shape != (m,):
        raise ValueError(
            f"scores {list(s.shape)} and included {list(inc.shape)} must be 1-D of one length"
        )
    if not np.all(np.isfinite(s)):
        raise ValueError("scores: non-finite values (the training run diverged?)")
    _check_probability("confidence", confidence, open_low=True)
    ks = tuple(guess_counts(m) if counts is None else counts)
    bad = [k for k in ks if not (isinstance(k, (int, np.integer)) and 1 <= k and 2 * k <= m)]
    if not ks or bad:
        raise ValueError(
            f"counts={list(ks)}: each must be an integer k with 1 <= k <= M/2 = {m // 2}"
        )
    per_choice = 1.0 - (1.0 - confidence) / len(ks)
    order = np.argsort(s, kind="stable")
    candidates = []
    for k in ks:
        k = int(k)
        correct = int(inc[order[m - k :]].sum() + (~inc[order[:k]]).sum())
        eps = epsilon_lower_bound(
            canaries=m, guesses=2 * k, correct=correct, delta=delta, confidence=per_choice
        )
        candidates.append(
            {"k_plus": k, "k_minus": k, "guesses": 2 * k, "correct": correct, "epsilon": eps}
        )
    best = max(candidates, key=lambda c: (c["epsilon"], -c["guesses"]))
    rule = (
        f"k+ = k- = k highest / lowest scores, abstain on the rest; k in {list(ks)} fixed "
        f"before the run; each k tested at confidence {per_choice:.6g} (Bonferroni split of "
        f"{confidence:g} over {len(ks)} choices); the best bound is reported"
    )
    return AuditResult(
        epsilon_lower_bound=float(best["epsilon"]),
        confidence=confidence,
        delta=delta,
        canaries=m,
        included=int(inc.sum()),
        guesses=int(best["guesses"]),
        correct=int(best["correct"]),
        k_plus=int(best["k_plus"]),
        k_minus=int(best["k_minus"]),
        candidates=candidates,
        guess_rule=rule,
    )


def _os_rng() -> np.random.Generator:
    # 128 bits of OS entropy: never the run's seed, so the training run cannot know (or be
    # seeded into) which canaries were included.
    return np.random.default_rng(secrets.randbits(128))


class DiracCanaries:
    """White-box Dirac gradient canaries added to the clipped sum of a private optimizer.

    Attach to a :class:`~dpkfc_med.privacy.optimizer.ScaleThenPrivatizeOptimizer` before the
    first step (``train(..., instrument=...)`` does this). Inclusion, coordinates and the
    per-step Poisson draws come from ``rng``, by default seeded from OS entropy.

    Two hooks do the work: a ``pre_noise_hooks`` entry adds the drawn canaries to
    ``p.summed_grad``; Opacus' step hook (chained after the one already attached, the ledger's)
    reads the released ``p.grad`` after the noise and before the base optimizer's step. With
    ``preconditioner.step="natural"`` that ``p.grad`` has already been multiplied by ``P`` once
    more: the score is still a function of the released output (the bound stays valid) but the
    Dirac signal is spread over the layer, so the audit is weaker.

    Attributes:
        included: ``[M]`` booleans, the secret inclusion of each canary.
        coordinates: ``[M]`` flat indices into the concatenated trainable parameters (in the
            optimizer's order), sorted.
        scores: ``[M]`` running sums of the released noisy sum at each canary's coordinate.
        draws: ``[M]`` how often each canary was drawn (zero for excluded canaries).

    Args:
        num: ``M``, the number of canaries (at most the number of trainable coordinates).
        rng: generator for inclusion, placement and per-step draws (tests); default: seeded
            with 128 bits from :mod:`secrets`, never from the run's seed.

    Privacy guarantee:
        Each included canary is one extra unit: Poisson-sampled at rate ``q`` per step and
        contributing a vector of norm exactly ``C`` in the clipped (preconditioned)
        coordinates, independent of the private data. The run therefore executes the same
        mechanism on the data plus the included canaries, and its accounted epsilon covers
        each canary as it covers each real unit. The model of an audit run contains the
        canaries and is not meant for release.
    """

    def __init__(self, num: int, *, rng: np.random.Generator | None = None) -> None:
        if not (isinstance(num, (int, np.integer)) and num >= 2):
            raise ValueError(f"canaries={num!r}: must be an integer >= 2 (e.g. 5000)")
        self.num = int(num)
        self.rng = rng if rng is not None else _os_rng()
        self.included = self.rng.random(self.num) < 0.5
        self.scores = np.zeros(self.num)
        self.coordinates = np.zeros(self.num, dtype=np.int64)
        self.sample_rate = 0.0
        self.clip_norm = 0.0
        self.steps_injected = 0
        self.steps_read = 0
        self.draws = np.zeros(self.num, dtype=np.int64)
        # (parameter, its canary coordinates [n] as a tensor on its device, canary indices [n]);
        # parameters are Any: Opacus adds summed_grad/grad_sample to them at run time
        self._slots: list[tuple[Any, Tensor, np.ndarray]] = []
        self._previous_hook: Any = None
        self._score_scale = 1.0

    def attach(self, optimizer: Any, *, sample_rate: float) -> DiracCanaries:
        """Place the canaries and register the pre-noise and read-out hooks.

        Args:
            optimizer: the private optimizer (``pre_noise_hooks``, Opacus' step hook).
            sample_rate: the run's Poisson sample rate ``q``.

        Returns:
            ``self``.
        """
        if self._slots:
            raise RuntimeError("these canaries are already attached to an optimizer")
        if not (0 < sample_rate <= 1):
            raise ValueError(f"sample_rate={sample_rate!r}: must be in (0, 1]")
        params = list(optimizer.params)
        sizes = np.array([p.numel() for p in params], dtype=np.int64)
        total = int(sizes.sum())
        if self.num > total:
            raise ValueError(
                f"canaries={self.num}: the model has only {total} trainable coordinates and "
                f"each canary needs its own; use at most {total} canaries"
            )
        self.coordinates = np.sort(self.rng.choice(total, size=self.num, replace=False))
        starts = np.concatenate([[0], np.cumsum(sizes)])
        owner = np.searchsorted(starts, self.coordinates, side="right") - 1
        for i, p in enumerate(params):
            pos = np.flatnonzero(owner == i)
            if len(pos):
                local = torch.as_tensor(self.coordinates[pos] - starts[i], device=p.device)
                self._slots.append((p, local, pos))
        self.sample_rate = float(sample_rate)
        self.clip_norm = float(optimizer.max_grad_norm)
        # p.grad after Opacus' scale_grad is the noisy sum / (expected batch size): scores
        # are kept in units of the noisy sum (an included canary gains C per draw).
        if optimizer.loss_reduction == "mean":
            self._score_scale = float(optimizer.expected_batch_size)
        optimizer.pre_noise_hooks.append(self._add)
        self._previous_hook = optimizer.step_hook
        optimizer.attach_step_hook(self._read)
        return self

    def _add(self, optimizer: Any) -> None:
        """Pre-noise hook: add ``C e_j`` to the clipped sum for each drawn included canary."""
        drawn = self.included & (self.rng.random(self.num) < self.sample_rate)
        self.draws += drawn
        for p, local, pos in self._slots:
            hit = torch.as_tensor(drawn[pos], device=p.device)
            if not bool(hit.any()):
                continue
            idx = local[hit]
            add = torch.full(
                (len(idx),), self.clip_norm, dtype=p.summed_grad.dtype, device=p.device
            )
            flat = p.summed_grad.reshape(-1).index_add(0, idx, add)
            p.summed_grad = flat.view_as(p.summed_grad)
        self.steps_injected += 1

    def _read(self, optimizer: Any) -> None:
        """Step hook (after noise, before the base step): add the released coordinates."""
        if self._previous_hook is not None:
            self._previous_hook(optimizer)
        for p, local, pos in self._slots:
            if p.grad is None:  # pragma: no cover - Opacus sets p.grad in every noisy step
                raise RuntimeError("a canary parameter has no released gradient in this step")
            released = p.grad.reshape(-1)[local].detach().double().cpu().numpy()
            self.scores[pos] += released * self._score_scale
        self.steps_read += 1

    def result(self, *, delta: float, confidence: float = DEFAULT_CONFIDENCE) -> AuditResult:
        """Guess from the scores and bound epsilon (see :func:`audit_scores`)."""
        if self.steps_injected != self.steps_read:
            raise RuntimeError(
                f"canaries were added in {self.steps_injected} steps but read in "
                f"{self.steps_read}; the audit needs both hooks in every noisy step"
            )
        return audit_scores(self.scores, self.included, delta=delta, confidence=confidence)
