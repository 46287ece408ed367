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
preconditioned per-unit gradient is ``C e_{c_j}``. The canary's score (:func:`canary_scores`) is
a log likelihood ratio "drawn at rate ``q``" against "never drawn" of the released noisy sums at
``c_j`` over all noisy steps, robust to heavy-tailed data gradients.

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

That bound alone cannot refute large epsilons: with ``M = 5000`` canaries and ``delta = 1e-5``
even all-correct guesses give at most 5.92, and no ``M`` gives much more than 8. When the
accounted mechanism is known (:class:`GaussianPlan`: ``T`` Poisson-subsampled Gaussian steps),
the audit therefore tests the plan's whole trade-off curve (:func:`fdp_refutes`, Mahloujifar,
Melis & Chaudhuri, "Auditing f-differential privacy in one run", ICML 2025, arXiv:2410.22235):
for ``f``-DP, each guess is wrong with probability at least ``f(1 - p)`` when right with
probability ``p``, and their recursion over the number of correct guesses bounds how likely
``v`` of ``r`` correct guesses are. The claim tested is "the run is the subsampled Gaussian
mechanism with the plan's ``q`` and ``T`` and noise multiplier ``sigma'``"; the lower bound is
the epsilon (at the run's delta, by the run's accountant) of the noisiest such plan that the
guesses refute, and the verdict is the test of the accounted ``sigma`` itself.

Power (:func:`audit_power`): what the audit as sized would show on a mechanism that draws a
tenth of the accounted noise (:data:`BROKEN_NOISE_SCALE`), computed from public settings only:
one simulated run of the plan's mechanism at that noise, canary coordinates carrying the noise
and the drawn canaries only, scored and guessed as a real run is. It reports the bound that run
reaches and the audit's margin: the most wrong guesses at which the accounted plan is still
refuted. When the simulated broken run does not refute the accounted plan the audit *cannot
refute* (verdict ``"cannot refute"``): it would pass a mechanism with 10x too little noise.
The all-correct bound (``max_bound``) is kept as a cross-check; it overstates the power, since a
handful of wrong guesses among thousands already brings the bound below epsilon 8.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from dpkfc_med.privacy.audit.bounds import (
    BOUND_SOURCE,
    DEFAULT_CONFIDENCE,
    FDP_BOUND_SOURCE,
    GaussianPlan,
    Verdict,
    check_guess_counts,
    check_probability,
    epsilon_lower_bound,
    fdp_bound,
    fdp_refutes,
    gaussian_tradeoff_inverse,
    guess_counts,
    max_bound,
    one_run_p_value,
    plan_tradeoff_inverse,
    tolerated_wrong,
    verdict_of,
)
from dpkfc_med.privacy.audit.power import (
    BROKEN_NOISE_SCALE,
    NULL_DOF,
    AuditPower,
    audit_power,
    canary_scores,
    default_canaries,
    guess_outcomes,
    simulated_scores,
)

__all__ = [
    "BROKEN_NOISE_SCALE",
    "NULL_DOF",
    "DEFAULT_CONFIDENCE",
    "AuditPower",
    "AuditResult",
    "DiracCanaries",
    "GaussianPlan",
    "Verdict",
    "audit_power",
    "audit_scores",
    "canary_scores",
    "default_canaries",
    "epsilon_lower_bound",
    "fdp_refutes",
    "gaussian_tradeoff_inverse",
    "guess_counts",
    "max_bound",
    "one_run_p_value",
    "plan_tradeoff_inverse",
    "simulated_scores",
    "tolerated_wrong",
    "verdict_of",
]


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
        max_bound: the bound if every guess at the best guess count were correct (the largest
            these settings can ever report; a few wrong guesses bring it down fast, so
            :attr:`power` is what says whether the audit can refute).
        epsilon_accounted: the accounted epsilon compared with, when given.
        verdict: :class:`Verdict` ``REFUTED`` / ``consistent`` / ``cannot refute`` (``""``
            without an accounted epsilon).
        test: ``"f-DP"`` (the plan's trade-off curve) or ``"Steinke"`` (Theorem 3 only).
        steinke_lower_bound: Theorem 3's bound on the same guesses (a cross-check).
        steinke_max_bound: Theorem 3's ceiling.
        noise_multiplier_refuted: with the f-DP test, the noisiest plan (same ``q``, ``T``)
            that the guesses refute; ``None`` when none is.
        power: with the f-DP test, :meth:`AuditPower.to_dict` of :func:`audit_power` for these
            settings (what a mechanism with 10x too little noise would show); else ``None``.
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
    max_bound: float = math.nan
    epsilon_accounted: float | None = None
    verdict: str = ""
    test: str = "Steinke"
    steinke_lower_bound: float = math.nan
    steinke_max_bound: float = math.nan
    noise_multiplier_refuted: float | None = None
    power: dict[str, Any] | None = None

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
    plan: GaussianPlan | None = None,
    epsilon_accounted: float | None = None,
) -> AuditResult:
    """Guess from canary scores and bound epsilon from the correct guesses.

    For each ``k`` in ``counts`` the ``k`` highest scores are guessed included and the ``k``
    lowest excluded; each ``k`` is tested at significance ``(1 - confidence) / len(counts)``
    (Bonferroni) and the best bound is reported. Ties are broken by canary index, which is
    independent of inclusion.

    With ``plan`` (the accounted mechanism), the test is the f-DP one against the plan's
    trade-off curve (module docstring); the verdict is the test of the plan itself ("cannot
    refute" when :func:`audit_power` says a mechanism with 10x too little noise would not be
    refuted either) and the accounted epsilon defaults to the plan's. Without it, Theorem 3 of
    Steinke et al. bounds epsilon, and the verdict compares the bound with
    ``epsilon_accounted`` when given ("cannot refute" when all-correct guesses could not).

    Args:
        scores: ``[M]`` canary scores (higher: more likely included).
        included: ``[M]`` booleans, the secret inclusion of each canary.
        delta: the delta of the claim under test.
        confidence: overall confidence of the reported bound.
        counts: guess counts per side; default :func:`guess_counts` of ``M``.
        plan: the accounted Poisson-subsampled Gaussian mechanism (f-DP test).
        epsilon_accounted: the accounted epsilon at ``delta`` (default: the plan's).

    Returns:
        The :class:`AuditResult`, with the verdict and, with ``plan``, the audit's power.
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
    check_probability("confidence", confidence, open_low=True)
    ks = check_guess_counts(m, counts)
    per_choice = 1.0 - (1.0 - confidence) / len(ks)
    significance = 1.0 - per_choice
    candidates: list[dict[str, Any]] = []
    for k, correct in zip(ks, guess_outcomes(s, inc, ks)):
        eps = epsilon_lower_bound(
            canaries=m, guesses=2 * k, correct=correct, delta=delta, confidence=per_choice
        )
        candidates.append(
            {"k_plus": k, "k_minus": k, "guesses": 2 * k, "correct": correct, "epsilon": eps}
        )
    steinke_best = max(candidates, key=lambda c: (c["epsilon"], -c["guesses"]))
    steinke_lower = float(steinke_best["epsilon"])
    steinke_ceiling = max_bound(m, delta=delta, confidence=confidence, counts=ks)
    rule = (
        f"k+ = k- = k highest / lowest scores, abstain on the rest; k in {list(ks)} fixed "
        f"before the run; each k tested at confidence {per_choice:.6g} (Bonferroni split of "
        f"{confidence:g} over {len(ks)} choices); the best bound is reported"
    )
    common: dict[str, Any] = {
        "confidence": confidence,
        "delta": delta,
        "canaries": m,
        "included": int(inc.sum()),
        "guess_rule": rule,
        "steinke_lower_bound": steinke_lower,
        "steinke_max_bound": steinke_ceiling,
    }
    if plan is None:
        verdict = ""
        if epsilon_accounted is not None:
            verdict = verdict_of(
                refuted=steinke_lower > epsilon_accounted,
                can_refute=steinke_ceiling > epsilon_accounted,
            )
        return AuditResult(
            epsilon_lower_bound=steinke_lower,
            guesses=int(steinke_best["guesses"]),
            correct=int(steinke_best["correct"]),
            k_plus=int(steinke_best["k_plus"]),
            k_minus=int(steinke_best["k_minus"]),
            candidates=candidates,
            max_bound=steinke_ceiling,
            epsilon_accounted=epsilon_accounted,
            verdict=verdict,
            **common,
        )
    accounted = plan.epsilon(delta) if epsilon_accounted is None else epsilon_accounted
    outcomes = [(c["guesses"], c["correct"]) for c in candidates]
    lower, sigma_hat = fdp_bound(plan, m, outcomes, significance, delta)
    ceiling = max_bound(m, delta=delta, confidence=confidence, counts=ks, plan=plan)
    sigma0 = plan.noise_multiplier
    at_plan = plan_tradeoff_inverse(plan.sample_rate, sigma0, plan.steps)
    at_bound = plan_tradeoff_inverse(plan.sample_rate, sigma_hat, plan.steps) if sigma_hat else None
    for c in candidates:
        c["epsilon_steinke"] = c.pop("epsilon")
        kw: dict[str, Any] = {"canaries": m, "guesses": c["guesses"], "correct": c["correct"]}
        c["refutes_plan"] = fdp_refutes(at_plan, significance=significance, **kw)
        c["refutes_bound"] = at_bound is not None and fdp_refutes(
            at_bound, significance=significance, **kw
        )
    best = next((c for c in candidates if c["refutes_bound"]), steinke_best)
    power = audit_power(plan, m, delta=delta, confidence=confidence, counts=ks)
    return AuditResult(
        epsilon_lower_bound=lower,
        guesses=int(best["guesses"]),
        correct=int(best["correct"]),
        k_plus=int(best["k_plus"]),
        k_minus=int(best["k_minus"]),
        candidates=candidates,
        bound=FDP_BOUND_SOURCE,
        max_bound=ceiling,
        epsilon_accounted=accounted,
        verdict=verdict_of(
            refuted=any(c["refutes_plan"] for c in candidates), can_refute=power.refutes
        ),
        test="f-DP",
        noise_multiplier_refuted=sigma_hat,
        power=power.to_dict(),
        **common,
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
        self._released: list[np.ndarray] = []  # [M] per noisy step, for the detrended score
        self.coordinates = np.zeros(self.num, dtype=np.int64)
        self.placement = ""
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
        starts = np.concatenate([[0], np.cumsum(sizes)])
        # Hidden weights (>= 2-D tensors but the first and the last) when they hold enough
        # coordinates: the input layer, the output layer and the biases carry large data
        # gradients that drown a canary; a structural, data-independent choice.
        matrices = [i for i, p in enumerate(params) if p.dim() >= 2]
        hidden = matrices[1:-1]
        pool = np.concatenate(
            [np.arange(starts[i], starts[i + 1]) for i in hidden] or [np.zeros(0, np.int64)]
        )
        if len(pool) < self.num:
            pool = np.arange(total)
        self.placement = "hidden weights" if len(pool) < total else "all trainable coordinates"
        self.coordinates = np.sort(self.rng.choice(pool, size=self.num, replace=False))
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
        step = np.zeros(self.num)
        for p, local, pos in self._slots:
            if p.grad is None:  # pragma: no cover - Opacus sets p.grad in every noisy step
                raise RuntimeError("a canary parameter has no released gradient in this step")
            step[pos] = p.grad.reshape(-1)[local].detach().double().cpu().numpy()
        step *= self._score_scale
        self.scores += step
        self._released.append(step)
        self.steps_read += 1

    def detrended_scores(self) -> np.ndarray:
        """``[M]`` :func:`canary_scores` of the released values read so far."""
        released = np.stack(self._released) if self._released else np.zeros((0, self.num))
        return canary_scores(released, sample_rate=self.sample_rate, clip_norm=self.clip_norm)

    def result(
        self,
        *,
        delta: float,
        confidence: float = DEFAULT_CONFIDENCE,
        plan: GaussianPlan | None = None,
        epsilon_accounted: float | None = None,
    ) -> AuditResult:
        """Guess from the scores and bound epsilon (see :func:`audit_scores`)."""
        if self.steps_injected != self.steps_read:
            raise RuntimeError(
                f"canaries were added in {self.steps_injected} steps but read in "
                f"{self.steps_read}; the audit needs both hooks in every noisy step"
            )
        return audit_scores(
            self.detrended_scores(),
            self.included,
            delta=delta,
            confidence=confidence,
            plan=plan,
            epsilon_accounted=epsilon_accounted,
        )
