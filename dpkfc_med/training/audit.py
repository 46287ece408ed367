"""The ``dpkfc-med audit`` run: the configured mechanism with canaries, and its lower bound.

One audit is one training run of the configuration through :func:`~.run.train`, unchanged
(same data, Poisson sampler, clipping unit, preconditioner, noise and accountant), with
:class:`~dpkfc_med.privacy.audit.DiracCanaries` attached to the private optimizer before the
first step. It writes, into its own run directory (``runs/{name}_audit`` by default, never a
training run's):

* everything a training run writes (the model there includes the canaries: not a release);
* ``audit.json``: the empirical lower bound on epsilon next to the accounted epsilon, with
  the counts, the guess rule, the bound used and the audit's power (what a mechanism with 10x
  too little noise would show under the same settings) (:data:`AUDIT_FILE`);
* an ``"audit"`` block with the same numbers in ``privacy_report.json``, whose views are
  re-rendered.

The audit is a check of the implementation, not a privacy claim: a lower bound above the
accounted epsilon refutes the claimed guarantee (at the stated confidence); a lower bound
below it is what a correct implementation must show, and says nothing about how tight the
accounting is beyond the bound itself.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import shutil
import time
from dataclasses import dataclass, field
from decimal import ROUND_FLOOR, Decimal
from pathlib import Path
from typing import Any

import numpy as np

from dpkfc_med.privacy.audit import (
    DEFAULT_CONFIDENCE,
    DiracCanaries,
    GaussianPlan,
    Verdict,
    default_canaries,
)
from dpkfc_med.report import format_delta, load_report, write_report
from dpkfc_med.report.numbers import format_epsilon
from dpkfc_med.training.config import ConfigError, Method, RunConfig
from dpkfc_med.training.run import RunResult, train
from dpkfc_med.training.run_folder import RUN_JSON
from dpkfc_med.utils import write_json

__all__ = [
    "AUDIT_FILE",
    "DEFAULT_CANARIES",
    "AuditRun",
    "audit_run_dir",
    "format_audit",
    "power_sentence",
    "run_audit",
]

AUDIT_FILE = "audit.json"
AUDIT_SCHEMA = "dpkfc_med.audit/3"
DEFAULT_CANARIES = 5000
"""The smallest default ``M``: :func:`~dpkfc_med.privacy.audit.default_canaries` takes more
(10000, 20000, at most one per trainable coordinate) when 5000 would not refute a mechanism with
10x too little noise with a margin."""
NOT_DP = (
    "RESEARCH ONLY, NOT DIFFERENTIALLY PRIVATE: noise_scale={scale:g} multiplied the noise of "
    "this run (the accountant still counts the configured noise), to test that the audit "
    "refutes a broken mechanism"
)

CANARY_DESIGN = (
    "white-box Dirac gradient canaries: canary j owns one coordinate of the flattened vector of "
    "trainable parameters (M distinct coordinates drawn at random among the hidden weights, the "
    ">= 2-D tensors but the first and the last, when they hold M; else among all); each canary "
    "is included "
    "with probability 1/2; in every noisy step each included canary is Poisson-sampled at the "
    "run's sample rate q and, when drawn, adds C e_j (norm exactly the clip norm C) to the "
    "clipped sum (in DP-KFC: the preconditioned gradients) right before the noise"
)
SCORE = (
    "log likelihood ratio 'drawn at rate q' vs 'never drawn' of coordinate j of the released "
    "noisy sums over all noisy steps (Opacus' p.grad after the noise, times the expected batch "
    "size): the residual e after a running median over 21 steps, with its robust spread s, "
    "under a Student-t null with 3 degrees of freedom (data gradients are heavy-tailed), summed "
    "as log(1 - q + q t3((e - C) / s) / t3(e / s)); with preconditioner.step=natural the "
    "released update after its second product with P, a valid but weaker score"
)
RANDOMNESS = (
    "canary inclusion, placement and per-step draws come from a generator seeded with 128 bits "
    "of OS entropy (secrets), independent of training.seed and of the run's own randomness"
)
NOT_A_RELEASE = (
    "This run trained on the data plus the included canaries to measure the mechanism: its model "
    "and report describe the audit, not a release. The bound holds for the mechanism as run "
    "(same sampler, clipping unit, preconditioner, noise and accountant as the configuration)."
)


@dataclass
class AuditRun:
    """What :func:`run_audit` returns.

    Attributes:
        run_dir: the audit's run directory.
        audit: the ``audit.json`` record.
        training: the training run's result (with canaries).
    """

    run_dir: Path
    audit: dict[str, Any]
    training: RunResult = field(repr=False)


def audit_run_dir(cfg: RunConfig, out: str | Path | None = None) -> Path:
    """The audit's run directory: ``out``, else the config's run directory plus ``_audit``."""
    return Path(out) if out else Path(f"{cfg.run_dir()}_audit")


def _problems(cfg: RunConfig, canaries: Any, confidence: Any, run_dir: Path) -> list[str]:
    problems = []
    if not cfg.method_enum.private:
        private = [m.value for m in Method if m.private]
        problems.append(
            f"method={cfg.method_enum.value} (--method): an audit measures a private mechanism "
            f"and a non-private run has none; choose --method {' | '.join(private)}"
        )
    if isinstance(canaries, bool) or not isinstance(canaries, (int, np.integer)) or canaries < 2:
        problems.append(
            f"canaries={canaries!r} (--canaries): the audit needs at least 2 canaries (one guess "
            f"each way); use the default {DEFAULT_CANARIES} or e.g. --canaries 1000"
        )
    if not (isinstance(confidence, (int, float)) and 0 < confidence < 1):
        problems.append(f"confidence={confidence!r} (--confidence): must be in (0, 1), e.g. 0.95")
    if (run_dir / RUN_JSON).is_file():
        problems.append(
            f"output.dir: {run_dir} already holds a run (a training run or an earlier audit); an "
            "audit trains with canaries and never reuses a run directory: choose another --out "
            "or remove that directory"
        )
    return problems


def run_audit(
    cfg: RunConfig,
    *,
    out: str | Path | None = None,
    canaries: int | None = None,
    confidence: float | None = None,
    rng: np.random.Generator | None = None,
    noise_scale: float = 1.0,
) -> AuditRun:
    """Train ``cfg`` once with ``canaries`` canaries and write ``audit.json``.

    Args:
        cfg: the validated configuration (a private method).
        out: the audit's run directory (default :func:`audit_run_dir`).
        canaries: ``M``, at most the model's number of trainable coordinates (default
            :func:`~dpkfc_med.privacy.audit.default_canaries`: 5000, or more when 5000
            could not refute a mechanism with 10x too little noise with a margin).
        confidence: confidence of the lower bound (default 0.95).
        rng: generator for the canaries (tests only); default seeded from OS entropy.
        noise_scale: RESEARCH ONLY, to test the audit: multiplies the noise the run draws
            (the accountant still counts the configured noise), so a value below 1 makes a
            broken, not differentially private, mechanism that the audit should refute.
            Recorded in ``audit.json`` and its verdict.

    Returns:
        The :class:`AuditRun`.

    Raises:
        ConfigError: naming every bad input and its flag (non-private method, too few
            canaries, a confidence outside (0, 1), a run directory that already holds a run).

    Privacy guarantee:
        The audit run executes the configured mechanism on the data plus the included canaries;
        its accounted epsilon is the configuration's. The audit's canaries are random vectors
        independent of the data; the scores and guesses are post-processing of the released
        noisy sums.
    """
    confidence = DEFAULT_CONFIDENCE if confidence is None else confidence
    run_dir = audit_run_dir(cfg, out)
    problems = _problems(
        cfg, DEFAULT_CANARIES if canaries is None else canaries, confidence, run_dir
    )
    if not (isinstance(noise_scale, (int, float)) and 0 < noise_scale <= 1):
        problems.append(
            f"noise_scale={noise_scale!r} (--noise-scale): must be in (0, 1]; 1 audits the real "
            "mechanism, less tests the audit on a broken one"
        )
    if problems:
        raise ConfigError(problems, "audit")
    cfg = dataclasses.replace(cfg, output=dataclasses.replace(cfg.output, dir=str(run_dir)))
    held: dict[str, Any] = {}

    def instrument(engine: Any, optimizer: Any) -> None:
        steps = optimizer.max_steps
        if steps is None:  # pragma: no cover - the loop always plans its steps
            raise RuntimeError("the audit needs the planned number of steps")
        plan = GaussianPlan(
            engine.sample_rate,
            float(optimizer.noise_multiplier),
            int(steps),
            cfg.privacy.accountant,
        )
        held["plan"] = plan
        num = canaries
        if num is None:
            coordinates = sum(p.numel() for p in optimizer.params)
            num = default_canaries(plan, coordinates=coordinates, delta=engine.ledger.delta)
        held["injector"] = injector = DiracCanaries(int(num), rng=rng)
        injector.attach(optimizer, sample_rate=engine.sample_rate)
        # research only: the accountant (engine.noise_multiplier) keeps the configured noise
        optimizer.noise_multiplier = optimizer.noise_multiplier * noise_scale

    new_dirs = [d for d in (run_dir, *run_dir.parents) if not d.exists()]
    t0 = time.perf_counter()
    try:
        result = train(cfg, instrument=instrument)
    except ValueError as err:
        injector = held.get("injector")
        if (
            injector is None
            or injector.steps_injected
            or not str(err).startswith(f"canaries={injector.num}:")
        ):
            raise
        # Refused while attaching, before the first step: nothing was spent, and the folder is
        # this audit's own (it held no run), so no incomplete audit is left behind.
        shutil.rmtree(run_dir, ignore_errors=True)
        for d in new_dirs[1:]:  # the parents this audit created, if left empty
            if d.is_dir() and not any(d.iterdir()):
                d.rmdir()
        raise ConfigError([f"{err} (--canaries)"], "audit") from None
    seconds = time.perf_counter() - t0
    injector, plan = held["injector"], held["plan"]
    privacy = result.report["privacy"]
    delta = float(privacy["delta"])
    accounted = dict(privacy["epsilon"])
    primary = float(accounted[privacy.get("accountant", "prv")])
    # the plan as run (a run stopped early took fewer steps than planned)
    plan = dataclasses.replace(plan, steps=injector.steps_read)
    outcome = injector.result(delta=delta, confidence=confidence, plan=plan)
    lower = outcome.epsilon_lower_bound
    power = outcome.power or {}
    verdict = _verdict(outcome.verdict, lower, power, primary, confidence)
    if noise_scale != 1:
        verdict = f"{NOT_DP.format(scale=noise_scale)}. {verdict}"
    record: dict[str, Any] = {
        "schema": AUDIT_SCHEMA,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "epsilon_lower_bound": lower,
        "power": power,
        "max_bound": outcome.max_bound,
        "verdict_code": outcome.verdict,
        "noise_scale": float(noise_scale),
        "research_only_not_dp": noise_scale != 1,
        "epsilon_accounted": primary,
        "epsilon_accounted_all": accounted,
        "accountant": privacy.get("accountant", "prv"),
        "delta": delta,
        "confidence": confidence,
        "canaries": outcome.canaries,
        "canary_placement": injector.placement,
        "canaries_included": outcome.included,
        "guesses": outcome.guesses,
        "correct": outcome.correct,
        "k_plus": outcome.k_plus,
        "k_minus": outcome.k_minus,
        "guess_rule": outcome.guess_rule,
        "candidates": outcome.candidates,
        "verdict": verdict,
        "test": outcome.test,
        "noise_multiplier_refuted": outcome.noise_multiplier_refuted,
        "steinke_lower_bound": outcome.steinke_lower_bound,
        "steinke_max_bound": outcome.steinke_max_bound,
        "method": cfg.method_enum.value,
        "run": {
            "name": cfg.name,
            "run_dir": str(run_dir),
            "status": result.status,
            "config_sha256": cfg.sha256(),
            "seconds": round(seconds, 1),
        },
        "mechanism": {
            "steps": injector.steps_read,
            "sample_rate": injector.sample_rate,
            "noise_multiplier": privacy.get("noise_multiplier"),
            "noise_multiplier_drawn": float(plan.noise_multiplier) * noise_scale,
            "max_grad_norm": injector.clip_norm,
            "expected_draws_per_included_canary": injector.sample_rate * injector.steps_read,
        },
        "canary_design": CANARY_DESIGN,
        "score": SCORE,
        "randomness": RANDOMNESS,
        "bound": outcome.bound,
        "note": NOT_A_RELEASE,
    }
    write_json(run_dir / AUDIT_FILE, record)
    _add_to_report(run_dir, record)
    return AuditRun(run_dir, record, result)


def _verdict(
    code: str, lower: float, power: dict[str, Any], accounted: float, confidence: float
) -> str:
    if code == Verdict.REFUTED:
        return (
            f"REFUTED: the guesses refute the accounted mechanism (lower bound {lower:.3f}, "
            f"accounted epsilon {format_epsilon(accounted)}); at confidence {confidence:g} the "
            "implementation does not give the stated guarantee"
        )
    if code == Verdict.CANNOT_REFUTE:
        return (
            f"cannot refute: {power_sentence(power, accounted)}; this audit says nothing about "
            "the claim"
        )
    return (
        f"consistent: the lower bound {lower:.3f} does not exceed the accounted epsilon "
        f"{accounted:.3f}" + (f"; {power_sentence(power, accounted)}" if power else "")
    )


def power_sentence(power: dict[str, Any], accounted: float) -> str:
    """What a mechanism with too little noise would show: :attr:`AuditResult.power` in words."""
    times = f"{1 / power['noise_scale']:g}x too little noise"
    bound = power["epsilon_lower_bound"]
    if not power["refutes"]:
        return (
            f"with {times} this audit would show only epsilon >= {bound:.3f} (one simulated run "
            f"from the plan), not refuting the accounted {accounted:.3f}: it cannot catch that "
            "bug (use more canaries, --canaries)"
        )
    return (
        f"with {times} this audit would show epsilon >= {bound:.3f} (one simulated run from the "
        f"plan: {power['correct']}/{power['guesses']} correct) and refute the accounted epsilon "
        f"while at most {power['tolerated_wrong']} of its {power['guesses']} guesses are wrong"
    )


def _add_to_report(run_dir: Path, record: dict[str, Any]) -> None:
    """Put the audit numbers into ``privacy_report.json`` and re-render its views."""
    keys = (
        "epsilon_lower_bound",
        "max_bound",
        "noise_scale",
        "epsilon_accounted",
        "delta",
        "confidence",
        "canaries",
        "guesses",
        "correct",
        "k_plus",
        "k_minus",
        "guess_rule",
        "verdict",
        "method",
        "bound",
        "note",
    )
    report = load_report(run_dir)
    report["audit"] = {k: record[k] for k in keys} | {"file": AUDIT_FILE}
    # write_report validates, writes the JSON atomically and re-renders the views from it
    # (what rerender() does from the file).
    write_report(report, run_dir)


def format_audit(record: dict[str, Any]) -> str:
    """Console lines: the lower bound (rounded down), the audit's power, the accounted epsilon."""
    low = Decimal(repr(float(record["epsilon_lower_bound"])))
    low_text = f"{low.quantize(Decimal('0.001'), rounding=ROUND_FLOOR):f}"
    power = record.get("power")
    return (
        f"audit: epsilon >= {low_text} (empirical lower bound at confidence "
        f"{record['confidence']:g}: {record['correct']}/{record['guesses']} correct guesses on "
        f"{record['canaries']} canaries)\n"
        + (f"power: {power_sentence(power, record['epsilon_accounted'])}\n" if power else "")
        + f"privacy: epsilon <= {format_epsilon(record['epsilon_accounted'])} at delta = "
        f"{format_delta(record['delta'])} (accounted, {record['accountant'].upper()}); "
        f"{record['verdict_code']}"
        + (
            f"\n{NOT_DP.format(scale=record['noise_scale'])}"
            if record["research_only_not_dp"]
            else ""
        )
    )
