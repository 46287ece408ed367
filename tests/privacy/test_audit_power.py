"""The audit's power: canary scores, simulated broken runs, and the canary count they size.

A mechanism with 10x too little noise must be refuted at epsilon 8 and 1, data-gradient spikes
must not hide it, and a true claim must rarely be refuted (f-DP test against brute force).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats
from scipy.ndimage import median_filter

from dpkfc_med.privacy.audit import (
    BROKEN_NOISE_SCALE,
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
    plan_tradeoff_inverse,
    simulated_scores,
    tolerated_wrong,
)
from dpkfc_med.privacy.audit.power import POWER_MARGIN
from dpkfc_med.training.audit import (
    DEFAULT_CANARIES,
    format_audit,
    power_sentence,
)

# ----------------------------------------------------------------------------- the bound


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
