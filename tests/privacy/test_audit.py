"""The one-run audit: the bound against brute force, the canaries, the mechanism, the CLI."""

from __future__ import annotations

import json
import math
import re
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from scipy import stats
from scipy.ndimage import median_filter
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpkfc_med.cli import main
from dpkfc_med.engines import noise_only_step
from dpkfc_med.privacy import PrivacyEngine
from dpkfc_med.privacy.accounting import GaussianSteps, epsilon_for
from dpkfc_med.privacy.audit import (
    BROKEN_NOISE_SCALE,
    POWER_MARGIN,
    DiracCanaries,
    GaussianPlan,
    Verdict,
    audit_power,
    audit_scores,
    canary_scores,
    default_canaries,
    epsilon_lower_bound,
    fdp_refutes,
    gaussian_tradeoff_inverse,
    guess_counts,
    max_bound,
    one_run_p_value,
    plan_tradeoff_inverse,
    simulated_scores,
    tolerated_wrong,
)
from dpkfc_med.training.audit import (
    AUDIT_FILE,
    DEFAULT_CANARIES,
    audit_run_dir,
    format_audit,
    power_sentence,
    run_audit,
)
from dpkfc_med.training.config import ConfigError, load_config
from tests.conftest import GaussianProbes, per_sample_ce, summed_clipped

# ----------------------------------------------------------------------------- the bound


def _brute_p_value(m: int, r: int, v: int, eps: float, delta: float) -> float:
    """Theorem 3 of Steinke et al. term by term, in exact rational arithmetic for the sums."""
    q = Fraction(math.exp(eps)) / (1 + Fraction(math.exp(eps)))

    def f(u: int) -> Fraction:  # P[Binomial(r, q) >= u]
        if u <= 0:
            return Fraction(1)
        return sum(
            (math.comb(r, k) * q**k * (1 - q) ** (r - k) for k in range(u, r + 1)), Fraction(0)
        )

    if v == 0:
        return 1.0
    alpha = max((f(v - i) - f(v)) / i for i in range(1, m + 1))  # all i, not only i <= v
    return min(float(f(v) + 2 * m * Fraction(delta) * alpha), 1.0)


@pytest.mark.parametrize("eps", [0.0, 0.4, 1.5, 4.0])
@pytest.mark.parametrize("delta", [0.0, 1e-3, 0.02])
def test_p_value_matches_brute_force_binomial_sums(eps, delta):
    mismatches = []
    for m, r in ((5, 5), (12, 7), (30, 20)):
        for v in range(r + 1):
            got = one_run_p_value(canaries=m, guesses=r, correct=v, epsilon=eps, delta=delta)
            want = _brute_p_value(m, r, v, eps, delta)
            if not math.isclose(got, want, rel_tol=1e-10, abs_tol=1e-300):
                mismatches.append((m, r, v, got, want))
    assert not mismatches, "\n".join(map(str, mismatches))


@pytest.mark.parametrize("r", [10, 100, 1000])
def test_all_correct_without_delta_has_the_closed_form(r):
    # p(eps) = q^r, so the bound solves q^r = 1 - confidence: eps = logit(0.05^(1/r)).
    q = 0.05 ** (1 / r)
    want = math.log(q / (1 - q))
    got = epsilon_lower_bound(canaries=r, guesses=r, correct=r, delta=0.0, confidence=0.95)
    assert got == pytest.approx(want, abs=1e-7)


def test_bound_is_zero_at_chance_and_grows_with_correct_guesses():
    r = 200
    bounds = [
        epsilon_lower_bound(canaries=1000, guesses=r, correct=v, delta=1e-5) for v in range(r + 1)
    ]
    assert all(b == 0.0 for b in bounds[: r // 2 + 1])  # at or below chance: nothing refuted
    assert all(b2 >= b1 for b1, b2 in zip(bounds, bounds[1:])), "not monotone in correct"
    assert bounds[-1] > bounds[-20] > bounds[-60] > 0


def test_bound_shrinks_with_delta_and_confidence():
    kw = {"canaries": 5000, "guesses": 400, "correct": 340}
    by_delta = [epsilon_lower_bound(delta=d, **kw) for d in (0.0, 1e-6, 1e-5, 1e-4)]
    assert by_delta == sorted(by_delta, reverse=True) and by_delta[-1] < by_delta[0]
    by_conf = [epsilon_lower_bound(delta=1e-5, confidence=c, **kw) for c in (0.5, 0.9, 0.99)]
    assert by_conf == sorted(by_conf, reverse=True) and by_conf[-1] < by_conf[0]


@pytest.mark.parametrize(("eps", "r"), [(0.5, 60), (1.0, 60), (2.0, 150)])
def test_bound_exceeds_the_true_epsilon_at_most_five_percent_of_the_time(eps, r):
    # Randomized response is exactly eps-DP: each guess is right with probability
    # e^eps / (1 + e^eps), independently. The bound exceeds eps exactly when the number of
    # correct guesses reaches v*, so P[bound > eps] is a binomial tail, computed exactly.
    q = 1 / (1 + math.exp(-eps))
    above = [
        epsilon_lower_bound(canaries=r, guesses=r, correct=v, delta=0.0) > eps for v in range(r + 1)
    ]
    v_star = above.index(True)
    assert all(above[v_star:])  # the rejection region is an upper set
    false_alarm = float(stats.binom.sf(v_star - 1, r, q))
    assert false_alarm <= 0.05
    assert false_alarm > 0.02  # and the bound is not needlessly loose (discreteness only)


def test_guess_counts_and_the_guess_rule():
    assert guess_counts(DEFAULT_CANARIES) == (10, 20, 50, 100, 200, 500, 1000, 2000)
    assert guess_counts(10) == (5,)
    with pytest.raises(ValueError, match="at least 2 canaries"):
        guess_counts(1)
    rng = np.random.default_rng(0)
    included = rng.random(1000) < 0.5
    perfect = audit_scores(included.astype(float) + 1e-3 * rng.random(1000), included, delta=1e-5)
    fits = [c for c in perfect.candidates if c["k_plus"] <= min(included.sum(), (~included).sum())]
    assert len(fits) == len(perfect.candidates) - 1  # k = 500 needs exactly 500 included
    assert all(c["correct"] == c["guesses"] == 2 * c["k_plus"] for c in fits)
    assert perfect.guesses == perfect.k_plus + perfect.k_minus
    assert "Bonferroni" in perfect.guess_rule and perfect.included == int(included.sum())
    # the reported bound is the best candidate, each tested at 1 - 0.05 / (number of k)
    best = max(c["epsilon"] for c in perfect.candidates)
    assert perfect.epsilon_lower_bound == best
    n = len(perfect.candidates)
    assert best == epsilon_lower_bound(
        canaries=1000,
        guesses=perfect.guesses,
        correct=perfect.correct,
        delta=1e-5,
        confidence=1 - 0.05 / n,
    )
    chance = audit_scores(rng.normal(size=1000), included, delta=1e-5)
    assert chance.epsilon_lower_bound < 0.5
    reverse = audit_scores(-included.astype(float), included, delta=1e-5)
    assert reverse.epsilon_lower_bound == 0.0 and reverse.correct == 0


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"scores": [1.0, 2.0], "included": [True]}, "one length"),
        ({"scores": [1.0, float("nan")], "included": [True, False]}, "non-finite"),
        ({"confidence": 1.0}, r"confidence=1.0: must be a number in \(0, 1\)"),
        ({"counts": [3]}, r"1 <= k <= M/2 = 2"),
    ],
)
def test_audit_scores_rejects_bad_input(kwargs, pattern):
    args = {"scores": [0.1, 0.2, 0.3, 0.4], "included": [True, False, True, False], "delta": 1e-5}
    with pytest.raises(ValueError, match=pattern):
        audit_scores(**{**args, **kwargs})


# ------------------------------------------------------------- the ceiling and the f-DP test

# The README demo at epsilon 8: q = 1/ceil(4708 / 256), 10 epochs, the calibrated sigma.
_DEMO8 = GaussianPlan(1 / 19, 0.79681396484375, 190)
_SMALL_CNN_COORDINATES = 25746  # trainable parameters of small_cnn (2D, 1 channel, 2 classes)


def test_the_ceiling_is_the_all_correct_bound_at_the_best_guess_count():
    rng = np.random.default_rng(0)
    included = rng.random(DEFAULT_CANARIES) < 0.5
    result = audit_scores(rng.normal(size=DEFAULT_CANARIES), included, delta=1e-5)
    ks = guess_counts(DEFAULT_CANARIES)
    want = max(
        epsilon_lower_bound(
            canaries=DEFAULT_CANARIES,
            guesses=2 * k,
            correct=2 * k,
            delta=1e-5,
            confidence=1 - 0.05 / len(ks),
        )
        for k in ks
    )
    assert result.max_bound == want == max_bound(DEFAULT_CANARIES, delta=1e-5)
    assert want == pytest.approx(5.92, abs=0.01)  # the auditor's figure: Theorem 3 tops out


def test_cannot_refute_when_even_a_ten_times_broken_mechanism_would_pass():
    rng = np.random.default_rng(1)
    included = rng.random(DEFAULT_CANARIES) < 0.5
    perfect = included.astype(float)  # every guess right: the best any run can do
    steinke = audit_scores(perfect, included, delta=1e-5, epsilon_accounted=8.0)
    assert steinke.max_bound < 8 and steinke.verdict == Verdict.CANNOT_REFUTE == "cannot refute"
    assert audit_scores(perfect, included, delta=1e-5, epsilon_accounted=2.0).verdict == (
        Verdict.REFUTED
    )
    # the f-DP test with 20 canaries: a mechanism with 10x too little noise passes the demo's
    # epsilon-8 audit, so the audit cannot refute (and says so)
    few = rng.random(20) < 0.5
    fdp = audit_scores(few.astype(float), few, delta=1e-5, plan=_DEMO8)
    assert fdp.power is not None and not fdp.power["refutes"]
    assert fdp.power["epsilon_lower_bound"] <= fdp.epsilon_accounted
    assert fdp.verdict == Verdict.CANNOT_REFUTE
    text = format_audit(
        {
            "epsilon_lower_bound": fdp.epsilon_lower_bound,
            "epsilon_accounted": fdp.epsilon_accounted,
            "power": fdp.power,
            "max_bound": fdp.max_bound,
            "verdict_code": fdp.verdict,
            "confidence": 0.95,
            "correct": fdp.correct,
            "guesses": fdp.guesses,
            "canaries": 20,
            "delta": 1e-5,
            "accountant": "prv",
            "noise_scale": 1.0,
            "research_only_not_dp": False,
        }
    )
    assert "cannot refute" in text and "power: with 10x too little noise" in text
    assert "cannot catch that bug (use more canaries, --canaries)" in text
    assert "ceiling" not in text


def test_default_canaries_are_sized_to_refute_ten_times_too_little_noise_on_the_demo():
    m = default_canaries(_DEMO8, coordinates=_SMALL_CNN_COORDINATES, delta=1e-5)
    assert 2 <= m <= _SMALL_CNN_COORDINATES
    accounted = _DEMO8.epsilon(1e-5)
    assert accounted == pytest.approx(8.0, abs=0.3)
    power = audit_power(_DEMO8, m, delta=1e-5)
    assert power.noise_scale == BROKEN_NOISE_SCALE == 0.1
    assert power.refutes and power.epsilon_lower_bound > accounted
    assert power.tolerated_wrong >= POWER_MARGIN * power.guesses
    ceiling = max_bound(m, delta=1e-5, plan=_DEMO8)
    assert accounted < power.epsilon_lower_bound <= ceiling
    # an independent recomputation: all-correct guesses at some k refute the accounted plan,
    # and refute no plan whose epsilon is above the ceiling
    ks = guess_counts(m)
    at_plan = plan_tradeoff_inverse(_DEMO8.sample_rate, _DEMO8.noise_multiplier, _DEMO8.steps)
    tau = 0.05 / len(ks)
    kw = {"canaries": m, "significance": tau}
    assert any(fdp_refutes(at_plan, guesses=2 * k, correct=2 * k, **kw) for k in ks)
    sigma = 0.97 * _DEMO8.noise_multiplier
    while _DEMO8.epsilon(1e-5, sigma) <= ceiling * 1.02:
        sigma *= 0.97
    beyond = plan_tradeoff_inverse(_DEMO8.sample_rate, sigma, _DEMO8.steps)
    assert not any(fdp_refutes(beyond, guesses=2 * k, correct=2 * k, **kw) for k in ks)


def test_fdp_test_rarely_refutes_a_true_claim_on_randomized_response():
    # eps-DP randomized response: each guess right with probability e^eps / (1 + e^eps),
    # independently; its trade-off curve gives f(1 - x) = max(0, 1 - e^eps (1 - x), e^-eps x).
    # The refutation region is an upper set in the correct count, so the false alarm rate is
    # an exact binomial tail.
    eps, r = 1.0, 200
    p = 1 / (1 + math.exp(-eps))

    def inverse(x):
        return np.maximum(0.0, np.maximum(1 - math.exp(eps) * (1 - x), x * math.exp(-eps)))

    refuted = [
        fdp_refutes(inverse, canaries=r, guesses=r, correct=v, significance=0.05)
        for v in range(r + 1)
    ]
    v_star = refuted.index(True)
    assert all(refuted[v_star:])
    assert float(stats.binom.sf(v_star - 1, r, p)) <= 0.05


def test_fdp_test_rarely_refutes_a_true_gaussian_claim():
    # mu-GDP exactly: an included canary's score is mu + N(0, 1), an excluded one's N(0, 1)
    mu, m, k, trials = 2.0, 1000, 100, 200
    rng = np.random.default_rng(7)
    inverse = gaussian_tradeoff_inverse(mu)
    false = power = 0
    for _ in range(trials):
        inc = rng.random(m) < 0.5
        order = np.argsort(mu * inc + rng.normal(size=m))
        correct = int(inc[order[-k:]].sum() + (~inc[order[:k]]).sum())
        kw = {"canaries": m, "guesses": 2 * k, "correct": correct, "significance": 0.05}
        false += fdp_refutes(inverse, **kw)
        power += fdp_refutes(gaussian_tradeoff_inverse(mu / 2), **kw)  # a false, stronger claim
    assert false / trials <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / trials)
    assert power / trials > 0.9


def _simulated_scores(plan: GaussianPlan, m: int, seed: int, noise_scale: float):
    """Canary scores of the plan's mechanism, no training: an included canary is drawn
    Binomial(T, q) times and adds C = 1 each time; every score sums T noises N(0, sigma^2)."""
    rng = np.random.default_rng(seed)
    included = rng.random(m) < 0.5
    draws = rng.binomial(plan.steps, plan.sample_rate, m) * included
    noise = rng.normal(0.0, plan.noise_multiplier * noise_scale * math.sqrt(plan.steps), m)
    return draws + noise, included


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fdp_audit_refutes_ten_times_too_little_noise_and_not_the_real_mechanism(seed):
    plan = GaussianPlan(0.1, 0.9, 60)  # epsilon ~6.9 at 1e-5: small enough to be quick
    accounted = plan.epsilon(1e-5)
    real = audit_scores(*_simulated_scores(plan, 2000, seed, 1.0), delta=1e-5, plan=plan)
    broken = audit_scores(*_simulated_scores(plan, 2000, seed, 0.1), delta=1e-5, plan=plan)
    assert real.max_bound == broken.max_bound > accounted  # the settings can refute
    assert real.verdict == Verdict.CONSISTENT, real.candidates
    assert real.epsilon_lower_bound <= accounted
    assert broken.verdict == Verdict.REFUTED, broken.candidates
    assert broken.epsilon_lower_bound > accounted
    # Theorem 3 alone could not: its ceiling is below the accounted epsilon
    assert broken.steinke_max_bound < accounted and broken.steinke_lower_bound < accounted


def _fdp_refutes_full_walk(inverse, *, canaries, guesses, correct, significance):
    """The recursion of Mahloujifar et al. walked down to zero correct guesses (no stop at a
    fixed point); it stops only once the mass needed exceeds the total, as it only grows."""
    total = guesses / canaries
    r = significance * total * correct / guesses
    h = significance * total * (guesses - correct) / guesses
    for i in range(correct - 1, -1, -1):
        h_next = max(h, float(inverse(np.array(r))))
        r, h = r + i / (guesses - i) * (h_next - h), h_next
        if r + h > total:
            return True
    return False


def test_fdp_test_agrees_with_the_full_walk_and_tolerated_wrong_is_its_edge():
    eps = 1.0

    def rr(x):  # eps-DP randomized response
        return np.maximum(0.0, np.maximum(1 - math.exp(eps) * (1 - x), x * math.exp(-eps)))

    cases = [
        (rr, 200, 200),
        (rr, 1000, 300),
        (gaussian_tradeoff_inverse(1.0), 500, 500),
        (gaussian_tradeoff_inverse(2.0), 500, 200),  # even all-correct guesses do not refute
    ]
    for inverse, m, r in cases:
        kw = {"canaries": m, "guesses": r, "significance": 0.05}
        full = [_fdp_refutes_full_walk(inverse, correct=v, **kw) for v in range(r + 1)]
        fast = [fdp_refutes(inverse, correct=v, **kw) for v in range(r + 1)]
        bad = [v for v in range(r + 1) if full[v] != fast[v]]
        assert not bad, [(v, full[v], fast[v]) for v in bad]
        if not full[-1]:  # even all-correct guesses do not refute
            assert tolerated_wrong(inverse, **kw) is None and not any(full)
            continue
        edge = full.index(True)  # fewest correct guesses that refute
        assert all(full[edge:])
        assert tolerated_wrong(inverse, **kw) == r - edge
    at_plan = plan_tradeoff_inverse(_DEMO8.sample_rate, _DEMO8.noise_multiplier, _DEMO8.steps)
    kw = {"canaries": 5000, "guesses": 4000, "significance": 0.05 / 8}
    w = tolerated_wrong(at_plan, **kw)
    assert w is not None and w > 0
    assert _fdp_refutes_full_walk(at_plan, correct=4000 - w, **kw)
    assert not _fdp_refutes_full_walk(at_plan, correct=4000 - w - 1, **kw)
    assert tolerated_wrong(at_plan, canaries=5000, guesses=400, significance=0.05 / 8) is None


def test_simulated_scores_follow_the_plan_mechanism():
    # q = 1/2 > SPARSE_RATE: the score is the plain sum over the T steps, so an included
    # canary scores Binomial(T, q) + N(0, T sigma^2) and an excluded one N(0, T sigma^2)
    plan = GaussianPlan(0.5, 2.0, 40)
    scores, included = simulated_scores(plan, 20000, noise_scale=0.5, seed=3)
    t, q, var_noise = 40, 0.5, 40 * (0.5 * 2.0) ** 2
    n_in, n_out = int(included.sum()), int((~included).sum())
    assert abs(n_in - 10000) < 4 * math.sqrt(5000)
    for x, mean, var, n in (
        (scores[included], t * q, t * q * (1 - q) + var_noise, n_in),
        (scores[~included], 0.0, var_noise, n_out),
    ):
        assert abs(x.mean() - mean) < 4 * math.sqrt(var / n), (x.mean(), mean)
        assert abs(x.var() / var - 1) < 4 * math.sqrt(2 / n), (x.var(), var)


def test_power_is_one_simulated_run_of_the_broken_plan_tested_as_an_audit():
    m = 5000
    power = audit_power(_DEMO8, m, delta=1e-5)
    scores, included = simulated_scores(_DEMO8, m, noise_scale=0.1, seed=0)
    ks = guess_counts(m)
    order = np.argsort(scores, kind="stable")
    at_plan = plan_tradeoff_inverse(_DEMO8.sample_rate, _DEMO8.noise_multiplier, _DEMO8.steps)
    tau = 0.05 / len(ks)
    for k, c in zip(ks, power.candidates, strict=True):
        correct = int(included[order[-k:]].sum() + (~included[order[:k]]).sum())
        assert (c["k"], c["guesses"], c["correct"]) == (k, 2 * k, correct)
        w = tolerated_wrong(at_plan, canaries=m, guesses=2 * k, significance=tau)
        assert c["tolerated_wrong"] == w
    refutes = [
        fdp_refutes(
            at_plan, canaries=m, guesses=c["guesses"], correct=c["correct"], significance=tau
        )
        for c in power.candidates
    ]
    assert power.refutes == any(refutes) is True
    # the reported guess count is the one whose refutation survives the most wrong guesses
    rates = [c["tolerated_wrong"] / c["guesses"] for c in power.candidates if c["tolerated_wrong"]]
    assert power.tolerated_wrong / power.guesses == max(rates)
    # the simulated broken run is what audit_scores reports on the same scores
    direct = audit_scores(scores, included, delta=1e-5, plan=_DEMO8)
    assert direct.epsilon_lower_bound == power.epsilon_lower_bound
    assert direct.verdict == Verdict.REFUTED and direct.power == power.to_dict()
    assert power_sentence(power.to_dict(), _DEMO8.epsilon(1e-5)) == (
        f"with 10x too little noise this audit would show epsilon >= "
        f"{power.epsilon_lower_bound:.3f} (one simulated run from the plan: "
        f"{power.correct}/{power.guesses} correct) and refute the accounted epsilon while at "
        f"most {power.tolerated_wrong} of its {power.guesses} guesses are wrong"
    )


def _with_data_spikes(plan: GaussianPlan, m: int, seed: int, noise_scale: float):
    """Released values at canary coordinates with heavy-tailed data gradients: every coordinate
    jitters (std 0.05-0.2 C) and 3 % of them burst (in 4 % of the steps a data spike of
    0.5 C + Exp(0.7 C)), as the hidden weights of the demo CNN do."""
    rng = np.random.default_rng(seed)
    t = plan.steps
    included = rng.random(m) < 0.5
    jitter = rng.normal(size=(t, m)) * rng.uniform(0.05, 0.2, m)
    spikes = (rng.random((t, m)) < 0.04) & (rng.random(m) < 0.03)
    data = jitter + spikes * (0.5 + rng.exponential(0.7, (t, m)))
    canaries = (rng.random((t, m)) < plan.sample_rate) & included
    noise = rng.normal(0.0, noise_scale * plan.noise_multiplier, (t, m))
    return canaries + data + noise, included


def _gaussian_null_scores(released, q, c=1.0):
    """The score with a Gaussian null: credit (C e - C^2/2) / s^2 for any residual e."""
    left = released - median_filter(released, size=(21, 1), mode="nearest")
    mad = np.median(np.abs(left - np.median(left, axis=0)), axis=0)
    z = (c * left - c * c / 2) / (1.4826 * mad) ** 2
    return np.logaddexp(math.log1p(-q), math.log(q) + z).sum(axis=0)


@pytest.mark.parametrize("seed", [0, 1])
def test_data_spikes_do_not_hide_ten_times_too_little_noise_at_epsilon_8(seed):
    m, q = 5000, _DEMO8.sample_rate
    accounted = _DEMO8.epsilon(1e-5)
    released, included = _with_data_spikes(_DEMO8, m, seed, 0.1)
    broken = audit_scores(
        canary_scores(released, sample_rate=q, clip_norm=1.0), included, delta=1e-5, plan=_DEMO8
    )
    assert broken.verdict == Verdict.REFUTED, broken.candidates
    assert broken.epsilon_lower_bound > accounted
    # a Gaussian null credits every data spike beyond C/2 as a draw: tens of wrong guesses,
    # and the broken mechanism passes
    gauss = audit_scores(_gaussian_null_scores(released, q), included, delta=1e-5, plan=_DEMO8)
    assert gauss.verdict == Verdict.CONSISTENT and gauss.epsilon_lower_bound < accounted
    at_500 = [
        next(c["guesses"] - c["correct"] for c in r.candidates if c["k_plus"] == 500)
        for r in (broken, gauss)
    ]
    assert at_500[0] <= 1 and at_500[1] >= 10, at_500  # of 1000 guesses
    # the real mechanism with the same data gradients is not refuted
    released, included = _with_data_spikes(_DEMO8, m, seed, 1.0)
    real = audit_scores(
        canary_scores(released, sample_rate=q, clip_norm=1.0), included, delta=1e-5, plan=_DEMO8
    )
    assert real.verdict == Verdict.CONSISTENT and real.epsilon_lower_bound <= accounted


# ----------------------------------------------------------------------------- canaries


def _mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 2)
    )


def _private(method, seed, *, sigma, n=64, batch=32, steps=None, clip=1.0):
    torch.manual_seed(seed)
    x, y = torch.randn(n, 16), torch.randint(0, 2, (n,))  # random labels: incoherent gradients
    model = _mlp()
    kw = {}
    if method == "dp-kfc":
        kw = {
            "probe_source": GaussianProbes((16,)),
            "probe_loss": per_sample_ce,
            "refresh_every": 0,
        }
    engine = PrivacyEngine(seed=seed)
    pmodel, popt, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=batch),
        noise_multiplier=sigma,
        max_grad_norm=clip,
        delta=1e-5,
        method=method,
        max_steps=steps,
        **kw,
    )
    return engine, pmodel, popt, loader, (x, y)


def _train_steps(pmodel, popt, loader, steps: int) -> None:
    while popt.steps_taken < steps:
        for xb, yb in loader:
            if popt.steps_taken >= steps:
                return
            popt.zero_grad()
            if not len(xb):  # an empty Poisson batch is still a noisy step
                noise_only_step(popt)
                continue
            F.cross_entropy(pmodel(xb), yb).backward()
            popt.step()


@pytest.mark.parametrize("method", ["dp-sgd", "dp-kfc"])
def test_each_drawn_canary_adds_exactly_C_on_its_coordinate_before_noise(method):
    engine, pmodel, popt, _, (x, y) = _private(method, 0, sigma=0.0, clip=0.7)

    def backward():
        F.cross_entropy(pmodel(x[:8]), y[:8]).backward()

    clean = summed_clipped(popt, backward)
    canaries = DiracCanaries(300, rng=np.random.default_rng(1)).attach(popt, sample_rate=0.5)
    popt.zero_grad()
    backward()
    popt.step()  # sigma = 0: the released sum is the clipped sum plus the drawn canaries
    released = torch.cat([p.grad.flatten() for p in popt.params]) * popt.expected_batch_size
    extra = (released - clean).double()
    drawn = np.flatnonzero(canaries.draws)
    assert set(drawn) <= set(np.flatnonzero(canaries.included)) and len(drawn) > 50
    want = torch.zeros_like(extra)
    want[canaries.coordinates[drawn]] = 0.7  # one unit of norm exactly C each
    bad = torch.nonzero((extra - want).abs() > 1e-5).flatten().tolist()
    assert not bad, [(i, float(extra[i]), float(want[i])) for i in bad[:20]]
    # the score is the released coordinate (times the expected batch size)
    np.testing.assert_allclose(
        canaries.scores, released[canaries.coordinates].double().numpy(), rtol=1e-12
    )
    assert engine.ledger.steps == 1  # the ledger's step hook still runs (chained)


def test_canaries_are_added_in_empty_steps_and_counted_per_step():
    _, pmodel, popt, loader, _ = _private("dp-sgd", 0, sigma=1.0, n=8, batch=1)
    canaries = DiracCanaries(50, rng=np.random.default_rng(0)).attach(popt, sample_rate=1 / 8)
    _train_steps(pmodel, popt, loader, 40)  # q = 1/8: several empty batches among 40 steps
    assert canaries.steps_injected == canaries.steps_read == popt.steps_taken == 40
    drawn = canaries.draws[canaries.included]
    assert canaries.draws[~canaries.included].sum() == 0
    # each included canary is drawn Binomial(40, q) times, q = 1/8: the total over the n
    # included canaries lies within 4 standard deviations of 5 n (a wrong rate, e.g. q = 1/2
    # or 1/40, lands 20 or more deviations away)
    n, q = len(drawn), 1 / 8
    assert n > 10 and drawn.max() <= 40
    assert abs(drawn.sum() - 40 * q * n) < 4 * np.sqrt(40 * q * (1 - q) * n), (drawn.sum(), n)


def test_canaries_default_to_os_entropy_not_the_run_seed():
    torch.manual_seed(0)
    np.random.seed(0)
    a = DiracCanaries(256)
    torch.manual_seed(0)
    np.random.seed(0)
    b = DiracCanaries(256)
    assert not np.array_equal(a.included, b.included)  # equal with probability 2^-256


def test_canary_errors_name_the_fix():
    _, _, popt, _, _ = _private("dp-sgd", 0, sigma=1.0)
    total = sum(p.numel() for p in popt.params)
    with pytest.raises(ValueError, match=f"only {total} trainable coordinates"):
        DiracCanaries(total + 1).attach(popt, sample_rate=0.5)
    with pytest.raises(ValueError, match=r"canaries=0: must be an integer >= 2"):
        DiracCanaries(0)
    canaries = DiracCanaries(10).attach(popt, sample_rate=0.5)
    with pytest.raises(RuntimeError, match="already attached"):
        canaries.attach(popt, sample_rate=0.5)


# ---------------------------------------------------------------------- the mechanism

# q = 1/2, 40 steps, sigma 6.5: epsilon ~2.0 at delta 1e-5 (PRV)
_SIGMA, _STEPS = 6.5, 40


def _audit_mechanism(method: str, seed: int, *, noise_scale: float = 1.0):
    """The audit's result, the engine's epsilon, and that epsilon from the plan alone."""
    engine, pmodel, popt, loader, _ = _private(method, seed, sigma=_SIGMA, steps=_STEPS)
    # The broken mechanism draws less noise than the engine accounts for (the ledger records
    # engine.noise_multiplier, the optimizer adds noise_multiplier * C).
    popt.noise_multiplier = _SIGMA * noise_scale
    canaries = DiracCanaries(1000, rng=np.random.default_rng(100 + seed))
    canaries.attach(popt, sample_rate=engine.sample_rate)
    _train_steps(pmodel, popt, loader, _STEPS)
    planned = epsilon_for([GaussianSteps(engine.sample_rate, _SIGMA, _STEPS)], 1e-5)
    return canaries.result(delta=1e-5), engine.get_epsilon(), planned


@pytest.mark.parametrize(
    ("method", "seed"), [("dp-sgd", 0), ("dp-sgd", 1), ("dp-sgd", 2), ("dp-kfc", 0), ("dp-kfc", 1)]
)
def test_lower_bound_never_exceeds_the_accounted_epsilon(method, seed):
    result, accounted, planned = _audit_mechanism(method, seed)
    assert accounted == planned  # the canaries' stage leaves the ledger exactly the plan's
    assert result.epsilon_lower_bound < accounted, result.candidates
    assert result.correct > result.guesses / 2  # the canaries are seen (the audit has power)


@pytest.mark.parametrize("method", ["dp-sgd", "dp-kfc"])
def test_lower_bound_exceeds_the_accounted_epsilon_of_a_broken_mechanism(method):
    result, accounted, _ = _audit_mechanism(method, 0, noise_scale=0.1)
    assert result.epsilon_lower_bound > 1.5 * accounted, result.candidates


# ------------------------------------------------------------------------- runner and CLI


def _tiny_npz(tmp_path: Path, n: int = 64) -> Path:
    rng = np.random.default_rng(0)
    data = {}
    for split, size in (("train", n), ("val", 16), ("test", 16)):
        data[f"{split}_images"] = rng.integers(0, 256, (size, 28, 28), dtype=np.uint8)
        data[f"{split}_labels"] = rng.integers(0, 2, (size, 1), dtype=np.uint8)
    path = tmp_path / "pneumoniamnist.npz"  # the name tells the loader it is a 2-class task
    np.savez(path, **data)
    return path


def _audit_config(tmp_path: Path, **privacy) -> Path:
    cfg = {
        "name": "tiny",
        "method": "dp-kfc",
        "data": {"path": str(_tiny_npz(tmp_path))},
        "model": {"name": "small_cnn"},
        # a fixed sigma skips the (slow) calibration; epsilon is checked against the target
        "privacy": {"target_epsilon": 50.0, "noise_multiplier": 1.0, **privacy},
        "training": {"epochs": 1, "batch_size": 16, "lr": 0.05, "progress": False},
        "probes": {"preset": "xray", "num_probes": 16, "refresh_every": 0},
        "preconditioner": {"calibration_samples": 4},
        "output": {"dir": str(tmp_path / "runs" / "{name}")},
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


def test_cli_audit_writes_audit_json_and_the_report_block(tmp_path, capsys):
    cfg_path = _audit_config(tmp_path)
    assert main(["audit", str(cfg_path), "--canaries", "400", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    run_dir = tmp_path / "runs" / "tiny_audit"  # default: the config's run dir + _audit
    assert audit_run_dir(load_config(cfg_path)) == run_dir
    record = json.loads((run_dir / AUDIT_FILE).read_text(encoding="utf-8"))
    for key in (
        "epsilon_lower_bound",
        "epsilon_accounted",
        "delta",
        "canaries",
        "confidence",
        "guesses",
        "correct",
        "k_plus",
        "k_minus",
        "guess_rule",
        "method",
        "note",
        "bound",
    ):
        assert key in record, key
    assert record["canaries"] == 400 and record["confidence"] == 0.95
    assert record["method"] == "dp-kfc" and record["mechanism"]["steps"] == 4
    assert 0 <= record["epsilon_lower_bound"] <= record["epsilon_accounted"]
    assert "not a release" in record["note"]
    assert record["test"] == "f-DP" and record["max_bound"] >= record["epsilon_lower_bound"]
    assert record["verdict"].startswith(record["verdict_code"])
    assert record["noise_scale"] == 1.0 and record["research_only_not_dp"] is False
    report = json.loads((run_dir / "privacy_report.json").read_text(encoding="utf-8"))
    assert report["audit"]["epsilon_lower_bound"] == record["epsilon_lower_bound"]
    assert report["audit"]["epsilon_accounted"] == report["privacy"]["epsilon"]["prv"]
    assert "epsilon >=" in out and "epsilon <=" in out and "not a release" in out
    # the power, not the all-correct ceiling: 4 steps at q = 1/4 cannot catch 10x too little
    # noise (one simulated run from the public plan, so the same every time)
    power = record["power"]
    assert power["noise_scale"] == 0.1 and power["refutes"] is False
    assert record["verdict_code"] == "cannot refute"
    assert "power: with 10x too little noise this audit would show only epsilon >= " in out
    assert f"{power['epsilon_lower_bound']:.3f}" in out and record["verdict_code"] in out
    assert "ceiling" not in out and "the most these settings could show" not in out
    assert report["audit"]["max_bound"] == record["max_bound"]
    # the same directory is never reused, for an audit or a training run
    assert main(["audit", str(cfg_path), "--canaries", "400"]) == 2
    assert "already holds a run" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        (["--canaries", "0"], r"canaries=0 \(--canaries\): the audit needs at least 2 canaries"),
        (["--method", "nonprivate"], r"method=nonprivate \(--method\): .*choose --method dp-sgd"),
        (["--confidence", "1.5"], r"confidence=1.5 \(--confidence\): must be in \(0, 1\)"),
        (["--noise-scale", "2"], r"noise_scale=2.0 \(--noise-scale\): must be in \(0, 1\]"),
        # found only once the model is built: the audit's folder is removed again (no step)
        (["--canaries", "10000000"], r"only \d+ trainable coordinates.*\(--canaries\)"),
    ],
)
def test_cli_audit_bad_input_names_the_flag_and_the_fix(tmp_path, capsys, args, pattern):
    assert main(["audit", str(_audit_config(tmp_path)), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:")
    assert re.search(pattern, err), err
    assert not (tmp_path / "runs").exists()  # nothing that looks like a run was left


def test_cli_audit_noise_scale_is_recorded_as_research_only(tmp_path, capsys):
    cfg_path = _audit_config(tmp_path)
    args = ["audit", str(cfg_path), "--canaries", "400", "--noise-scale", "0.1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    record = json.loads((tmp_path / "runs" / "tiny_audit" / AUDIT_FILE).read_text(encoding="utf-8"))
    assert record["noise_scale"] == 0.1 and record["research_only_not_dp"] is True
    assert record["verdict"].startswith("RESEARCH ONLY, NOT DIFFERENTIALLY PRIVATE")
    assert record["mechanism"]["noise_multiplier_drawn"] == pytest.approx(0.1)
    assert "NOT DIFFERENTIALLY PRIVATE" in out


def test_audit_refuses_a_training_run_directory(tmp_path):
    cfg = load_config(_audit_config(tmp_path))
    run_dir = tmp_path / "trained"
    run_dir.mkdir()
    (run_dir / "run.json").write_text('{"status": "complete"}', encoding="utf-8")
    with pytest.raises(ConfigError, match="never reuses a run directory"):
        run_audit(cfg, out=run_dir, canaries=100)
