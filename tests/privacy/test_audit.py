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
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpkfc_med.cli import main
from dpkfc_med.engines import noise_only_step
from dpkfc_med.privacy import PrivacyEngine
from dpkfc_med.privacy.accounting import GaussianSteps, epsilon_for
from dpkfc_med.privacy.audit import (
    DiracCanaries,
    audit_scores,
    epsilon_lower_bound,
    guess_counts,
    one_run_p_value,
)
from dpkfc_med.training.audit import (
    AUDIT_FILE,
    DEFAULT_CANARIES,
    audit_run_dir,
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
