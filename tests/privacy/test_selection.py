"""Accounted tuning: the Papernot-Steinke bound, the trial count and the plan."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dpkfc_med.privacy.selection import TrialCount, plan_tuning, trial_event, tuning_epsilon

Q, T, DELTA = 0.05, 120, 1e-5


def _trial_rdp(orders, sigma, score):
    from dp_accounting.rdp import RdpAccountant

    acc = RdpAccountant(orders)
    acc.compose(trial_event(Q, T, sigma, score))
    return np.asarray(acc._rdp)  # the single trial's RDP curve at these orders


def _rdp_to_eps(orders, rdp, delta):
    """Mironov's conversion, looser than dp_accounting's: an upper bound to compare with."""
    return min(r + math.log(1 / delta) / (a - 1) for a, r in zip(orders, rdp) if a > 1)


def _independent_tnb(orders, rdp, eta, gamma, mean):
    """Theorem 2 of Papernot & Steinke (2022), written out here from the paper."""
    orders, rdp = np.asarray(orders), np.asarray(rdp)
    c = (1 + eta) * min((1 - 1 / lh) * eh + math.log(1 / gamma) / lh for lh, eh in zip(orders, rdp))
    return rdp + c + np.log(mean) / (orders - 1)


def _independent_poisson(orders, rdp, mu):
    """Theorem 6 of Papernot & Steinke (2022): eps + mu * delta_hat + log(mu) / (lambda - 1)."""
    from dp_accounting.rdp.rdp_privacy_accountant import compute_delta

    out = []
    for a, r in zip(orders, rdp):
        eps_hat = math.log1p(1 / (a - 1))
        delta_hat, _ = compute_delta(orders, rdp, eps_hat)
        out.append(r + mu * delta_hat + math.log(mu) / (a - 1))
    return np.asarray(out)


@pytest.mark.parametrize("count", ["poisson:4", "tnb:1,0.25", "tnb:0.5,0.1"])
def test_tuning_bound_equals_an_independent_recomputation(count):
    from dp_accounting import dp_event as de
    from dp_accounting.rdp import RdpAccountant

    tc = TrialCount.parse(count)
    orders = [1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
    sigma, score = 1.2, 6.0
    rdp = _trial_rdp(orders, sigma, score)
    if tc.kind == "poisson":
        mine = _independent_poisson(orders, rdp, tc.mu)
    else:
        mine = _independent_tnb(orders, rdp, tc.eta, tc.gamma, tc.mean)
    acc = RdpAccountant(orders)
    acc.compose(de.RepeatAndSelectDpEvent(trial_event(Q, T, sigma, score), tc.mean, tc.shape))
    lib = np.asarray(acc._rdp)
    # the library's bound is the theorem's, tightened only by RDP monotonicity in the order
    assert np.all(lib <= mine + 1e-9)
    assert np.allclose(lib[-1], mine[-1], rtol=1e-9)
    # and the epsilon the planner reports is at most the theorem's through Mironov's conversion
    eps = tuning_epsilon(Q, T, sigma, score, tc, DELTA)
    assert eps <= _rdp_to_eps(orders, mine, DELTA) + 1e-9
    assert eps > _rdp_to_eps(orders, rdp, DELTA) * 0.999 - 1  # more than a single trial, roughly


def test_trial_count_follows_its_distribution():
    rng = np.random.default_rng(0)
    for text in ("poisson:3", "tnb:1,0.3", "tnb:0,0.2"):
        tc = TrialCount.parse(text)
        draws = np.array([tc.sample(rng) for _ in range(20000)])
        assert abs(draws.mean() - tc.mean) < 0.05 * tc.mean + 0.03, text
        for k in (0, 1, 2, 3):
            assert abs((draws == k).mean() - tc.pmf(k)) < 0.015, (text, k)
        assert abs(sum(tc.pmf(k) for k in range(400)) - 1) < 1e-6, text
    assert TrialCount.parse("tnb:1,0.25").mean == pytest.approx(1 / 0.25)  # geometric


def test_plan_spends_at_most_the_target_and_refuses_the_impossible():
    tc = TrialCount.parse("poisson:3")
    plan = plan_tuning(8.0, DELTA, Q, T, tc)
    assert plan.epsilon <= 8.0 and plan.epsilon > 7.9
    assert plan.trial_epsilon < plan.epsilon and plan.training_epsilon < plan.trial_epsilon
    from dp_accounting import dp_event as de
    from dp_accounting.rdp import RdpAccountant

    acc = RdpAccountant()
    acc.compose(de.GaussianDpEvent(plan.score_noise))
    assert acc.get_epsilon(DELTA) == pytest.approx(0.8, rel=1e-3)  # 10 % of the target
    slightly_less = tuning_epsilon(Q, T, plan.noise_multiplier * 0.99, plan.score_noise, tc, DELTA)
    assert slightly_less > 8.0  # the noise is the smallest that fits
    with pytest.raises(ValueError, match=r"poisson:MU"):
        TrialCount.parse("uniform:3")
    with pytest.raises(ValueError, match=r"cannot stay within epsilon"):
        plan_tuning(0.01, DELTA, 1.0, 10_000, TrialCount.parse("poisson:50"))
