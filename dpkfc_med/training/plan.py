"""The privacy plan of a run, and what a resumed run may change about it.

A run's plan (delta, sample rate, planned steps, noise multiplier) is part of its identity: the
report's guarantee is a statement about that plan. A resumed run therefore either continues
the plan exactly, or -- when the user changes ``training.epochs`` or
``privacy.noise_multiplier`` -- re-plans only what is *left*: the new noise multiplier is
calibrated on the composed ledger (the steps already spent followed by the remaining steps),
so the whole run still spends at most ``privacy.target_epsilon``. Any other change to a field
that shapes the mechanism, the model or the data is refused, naming the fields.

Every plan a run was given is appended to ``plan.json`` (never overwritten), and every config
it was started or resumed with to ``config_history.yaml``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dpkfc_med.privacy.accounting import (
    GaussianSteps,
    calibrate_noise_multiplier,
    calibrate_remaining,
    epsilon_for,
)
from dpkfc_med.report.numbers import format_epsilon
from dpkfc_med.training.config import ConfigError, RunConfig
from dpkfc_med.training.config_checks import flatten

__all__ = [
    "OPERATIONAL_FIELDS",
    "PlanError",
    "REPLANNABLE_FIELDS",
    "config_changes",
    "describe_plan",
    "plan_privacy",
    "resume_replans",
]

OPERATIONAL_FIELDS = frozenset(
    {
        "training.progress",
        "training.threads",
        "training.device",
        "training.eval_batch_size",
        "output.dir",
        "pretrain.cache_dir",  # where identical pretrained weights are kept, not what they are
        "data.path",  # allowed only when the data's fingerprint is unchanged (checked by the loop)
        # where the run's tracking streams go: observers of the run, not part of it
        "tracking.backend",
        "tracking.uri",
        "tracking.custodian_uri",
        "tracking.experiment",
    }
)
"""Fields a resumed run may change freely: they touch neither the mechanism nor the model."""

REPLANNABLE_FIELDS = frozenset({"training.epochs", "privacy.noise_multiplier"})
"""Fields whose change re-plans the remaining steps within the original target."""


class PlanError(ValueError):
    """The privacy plan is impossible or exceeds the target."""


def plan_privacy(
    cfg: RunConfig,
    num_units: int,
    steps_per_epoch: int,
    *,
    spent: Sequence[GaussianSteps] = (),
    steps: int | None = None,
) -> dict[str, Any]:
    """The privacy plan: delta, sample rate, planned steps and the noise multiplier.

    Args:
        cfg: the run configuration.
        num_units: ``N``, privacy units in the training set.
        steps_per_epoch: ``ceil(N / B)``; the sample rate is its inverse.
        spent: steps a resumed run has already spent (its ledger); the plan covers them and
            ``steps`` more, and the composed epsilon stays within the target.
        steps: noisy steps still to take (default: ``training.epochs`` epochs).

    Returns:
        ``{"delta", "sample_rate", "planned_steps", "noise_multiplier", "spent_steps",
        "steps_remaining"}``; ``planned_steps`` counts the spent steps too.

    Raises:
        PlanError: the target cannot be met (naming the field and the fix), or a given noise
            multiplier would exceed the target.
    """
    p = cfg.privacy
    q = 1.0 / steps_per_epoch
    todo = int(cfg.training.epochs * steps_per_epoch) if steps is None else int(steps)
    spent = [e for e in spent if e.steps > 0]
    done = sum(e.steps for e in spent)
    delta = p.delta if p.delta is not None else min(1e-5, 1.0 / num_units)
    if delta > 1.0 / num_units:
        raise PlanError(
            f"privacy.delta={delta:g} exceeds 1/N = {1.0 / num_units:.3g} for N={num_units} "
            "training units; such a delta permits leaking a whole record: use delta <= 1/N"
        )
    already = f"the {done} steps already spent and " if done else ""
    if todo == 0:
        sigma = spent[-1].noise_multiplier if spent else (p.noise_multiplier or 1.0)
    elif p.noise_multiplier is not None:
        events = [*spent, GaussianSteps(q, p.noise_multiplier, todo)]
        eps = epsilon_for(events, delta, p.accountant)
        if eps > p.target_epsilon:
            raise PlanError(
                f"the plan ({already}{todo} steps at sample rate {q:.4g}, noise_multiplier "
                f"{p.noise_multiplier}) spends epsilon {format_epsilon(eps)} > "
                "privacy.target_epsilon="
                f"{p.target_epsilon}; raise the noise multiplier, train fewer epochs, or set "
                "privacy.noise_multiplier: null to calibrate it"
            )
        sigma = p.noise_multiplier
    else:
        try:
            if spent:
                sigma = calibrate_remaining(
                    spent=spent,
                    target_epsilon=p.target_epsilon,
                    delta=delta,
                    sample_rate=q,
                    steps=todo,
                    accountant=p.accountant,
                )
            else:
                sigma = calibrate_noise_multiplier(
                    target_epsilon=p.target_epsilon,
                    delta=delta,
                    sample_rate=q,
                    steps=todo,
                    accountant=p.accountant,
                )
        except Exception as err:  # Opacus raises a bare ValueError when no sigma fits
            raise PlanError(
                f"no noise multiplier reaches privacy.target_epsilon={p.target_epsilon} at "
                f"delta={delta:g} with {already}{todo} steps at sample rate {q:.4g} ({err}); "
                "raise the target epsilon, lower training.epochs or training.batch_size"
            ) from None
        if sigma > 1e3:
            raise PlanError(
                f"privacy.target_epsilon={p.target_epsilon} needs noise multiplier {sigma:.3g} "
                f"for {already}{todo} steps: the updates would be pure noise; raise the target "
                "epsilon, train fewer epochs or use more data"
            )
    return {
        "delta": delta,
        "sample_rate": q,
        "planned_steps": done + todo,
        "noise_multiplier": float(sigma),
        "spent_steps": done,
        "steps_remaining": todo,
    }


def config_changes(original: RunConfig, new: RunConfig) -> list[tuple[str, Any, Any]]:
    """Fields whose values differ between two configs, as ``(dotted.field, old, new)``."""
    a, b = flatten(original.to_dict()), flatten(new.to_dict())
    return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def resume_replans(changes: list[tuple[str, Any, Any]], run_dir: str) -> bool:
    """Whether the changes of a resumed run re-plan it; refuse those that may not change.

    Raises:
        ConfigError: naming every changed field that shapes the mechanism, the model or the
            data, with its original and new value and the fix.
    """
    refused = [
        f"{path}: {old!r} -> {new!r}"
        for path, old, new in changes
        if path not in OPERATIONAL_FIELDS and path not in REPLANNABLE_FIELDS
    ]
    if refused:
        raise ConfigError(
            [
                f"--resume {run_dir}: these fields differ from the run's original config and "
                "would change its mechanism, model or data (the plan is part of the run's "
                "identity): " + "; ".join(refused),
                "resume with the original values (config.yaml in the run directory), or start "
                "a new run with --out (a new run on the same data spends a new budget); only "
                f"{sorted(REPLANNABLE_FIELDS)} may change on resume, and they re-plan the "
                "remaining steps within the original target epsilon",
            ]
        )
    return any(path in REPLANNABLE_FIELDS for path, _, _ in changes)


def describe_plan(plan: dict[str, Any]) -> str:
    """One line for logs: steps, sigma, and how much of the plan is already spent."""
    spent = plan.get("spent_steps", 0)
    tail = f", {spent} already spent" if spent else ""
    return (
        f"{plan['planned_steps']} noisy steps at q = {plan['sample_rate']:.4g}, sigma = "
        f"{plan['noise_multiplier']:.4g} for the remaining {plan['steps_remaining']}{tail}; "
        f"delta = {plan['delta']:g}"
    )
