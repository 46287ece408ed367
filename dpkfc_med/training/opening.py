"""How a run opens -- fresh, from its checkpoint or from its ledger alone -- and its privacy plan.

Nothing is written before the run's input is validated and its :class:`RunPlan` decided: a run
that would overspend, a complete run, or a resume whose configuration changed what may not
change is refused with the fix.

A run's privacy plan (delta, sample rate, planned steps, noise multiplier) is part of its
identity: the report's guarantee is a statement about that plan. A resumed run therefore either
continues the plan exactly, or -- when the user changes ``training.epochs`` or
``privacy.noise_multiplier`` -- re-plans only what is *left*: the new noise multiplier is
calibrated on the composed ledger (the steps already spent followed by the remaining steps),
so the whole run still spends at most ``privacy.target_epsilon``. Any other change to a field
that shapes the mechanism, the model or the data is refused, naming the fields.

Every plan a run was given is appended to ``plan.json`` (never overwritten), and every config
it was started or resumed with to ``config_history.yaml``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from dpkfc_med.privacy.accounting import (
    GaussianSteps,
    PrivacyLedger,
    calibrate_noise_multiplier,
    calibrate_remaining,
    epsilon_for,
)
from dpkfc_med.report.numbers import format_epsilon
from dpkfc_med.report.render import plural
from dpkfc_med.report.status import RunStatus
from dpkfc_med.tasks.base import Task
from dpkfc_med.training.config import ConfigError, RunConfig, config_from_dict
from dpkfc_med.training.config_checks import config_changes, settings
from dpkfc_med.training.run_folder import (
    CHECKPOINT,
    CONFIG_HISTORY,
    LEDGER,
    PLAN_JSON,
    RUN_JSON,
    now,
    spent_text,
)
from dpkfc_med.utils import atomic_write_bytes, write_json

if TYPE_CHECKING:
    from dpkfc_med.privacy.engine import PrivacyEngine

__all__ = [
    "OPERATIONAL_FIELDS",
    "REPLANNABLE_FIELDS",
    "Change",
    "OpeningKind",
    "PlanError",
    "PrivacyPlan",
    "RunPlan",
    "carry_ledger",
    "open_run",
    "plan_privacy",
    "resume_replans",
    "start_run_files",
    "stored_plans",
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

Change = tuple[str, Any, Any]
"""One changed config field of a resume: ``(dotted.field, old, new)``."""

log = logging.getLogger("dpkfc_med")


class PlanError(ValueError):
    """The privacy plan is impossible or exceeds the target."""


class OpeningKind(str, Enum):
    """How a run opens (``kind`` of its ``plan.json`` entries and its config history).

    Attributes:
        START: From the initial model (a new run, or a resume of a run that stopped
            before anything was spent or checkpointed).
        CHECKPOINT: From the last checkpoint: model, optimizer, ledger and schedule.
        LEDGER: From the initial model, with the steps the run spent before it stopped carried in
            the ledger (it stopped before its first checkpoint).
    """

    START = "start"
    CHECKPOINT = "checkpoint"
    LEDGER = "ledger"

    def __str__(self) -> str:
        """The plain value, as stored (``"checkpoint"``), also inside f-strings."""
        return self.value


@dataclass(frozen=True)
class PrivacyPlan:
    """What a private run may spend: the mechanism's parameters over the whole run and its resumes.

    Stored as the ``plan`` of each ``plan.json`` entry (:meth:`to_dict`, read back with
    :meth:`from_dict`); the report's plan history shows the same entries.

    Attributes:
        delta: The run's delta (``privacy.delta``, or ``min(1e-5, 1/N)``).
        sample_rate: ``q = 1 / ceil(N / B)``, the Poisson sampling rate of every step.
        planned_steps: Noisy steps of the whole run, those spent before a resume included.
        noise_multiplier: ``sigma`` of the steps still to take.
        spent_steps: Noisy steps the run spent before this resume.
        steps_remaining: Noisy steps still to take from this start.
    """

    delta: float
    sample_rate: float
    planned_steps: int
    noise_multiplier: float
    spent_steps: int
    steps_remaining: int

    def to_dict(self) -> dict[str, Any]:
        """The plan as ``plan.json`` stores it (keys in the order of the fields)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PrivacyPlan:
        """The plan of one ``plan.json`` entry (:meth:`to_dict` of what was stored).

        Raises:
            PlanError: the entry lacks one of the fields, naming them.
        """
        missing = [f.name for f in fields(cls) if f.name not in data]
        if missing:
            raise PlanError(
                f"{PLAN_JSON}: the stored plan lacks {missing}; resume needs the plan the run "
                "was started with (start a new run with --out)"
            )
        return cls(**{f.name: data[f.name] for f in fields(cls)})

    def continued(self, spent_steps: int) -> PrivacyPlan:
        """The same plan, resumed after ``spent_steps`` noisy steps."""
        remaining = max(0, int(self.planned_steps) - spent_steps)
        return replace(self, spent_steps=spent_steps, steps_remaining=remaining)

    def describe(self) -> str:
        """One line for logs: steps, sigma, and how much of the plan is already spent."""
        tail = f", {self.spent_steps} already spent" if self.spent_steps else ""
        return (
            f"{self.planned_steps} noisy steps at q = {self.sample_rate:.4g}, sigma = "
            f"{self.noise_multiplier:.4g} for the remaining {self.steps_remaining}{tail}; "
            f"delta = {self.delta:g}"
        )


@dataclass(frozen=True)
class RunPlan:
    """How a run opens and what it may spend, decided before anything is written.

    Attributes:
        kind: Fresh, from the checkpoint, or from the ledger alone.
        privacy: The privacy plan; ``None`` for a non-private method.
        previous: The ledger the run left when it stopped (steps already spent), if any.
        changes: Config fields this resume changes against the run's stored config.
    """

    kind: OpeningKind
    privacy: PrivacyPlan | None
    previous: PrivacyLedger | None = None
    changes: tuple[Change, ...] = ()

    @property
    def from_checkpoint(self) -> bool:
        """Whether the run continues from its checkpoint (which holds its weights)."""
        return self.kind is OpeningKind.CHECKPOINT

    def all_spent(self, steps_taken: int) -> bool:
        """Whether ``steps_taken`` noisy steps use up the plan (never, for a non-private run)."""
        return self.privacy is not None and steps_taken >= self.privacy.planned_steps


def open_run(
    cfg: RunConfig,
    task: Task,
    run_dir: Path,
    resume: bool,
    n_units: int,
    steps_per_epoch: int,
) -> RunPlan:
    """Decide how the run starts and with which plan; refuse anything that would overspend."""
    private = cfg.method_enum.private
    ckpt_path, ledger_path, run_json = run_dir / CHECKPOINT, run_dir / LEDGER, run_dir / RUN_JSON
    exists = run_json.is_file() or ledger_path.is_file()
    if not resume:
        if exists:
            status = (
                json.loads(run_json.read_text(encoding="utf-8")).get("status")
                if run_json.is_file()
                else None
            )
            raise ConfigError(
                [
                    f"output.dir: {run_dir} already holds a run (status {status!r}; "
                    f"{spent_text(run_dir)}); pass --resume to continue it within its budget, "
                    "or choose another --out (a new run on the same data spends a new budget "
                    "on top of this one)"
                ]
            )
        plan = plan_privacy(cfg, n_units, steps_per_epoch) if private else None
        return RunPlan(OpeningKind.START, plan)
    if not exists and not ckpt_path.is_file():
        raise ConfigError(
            [
                f"--resume: nothing to resume in {run_dir} (no {LEDGER}, no {CHECKPOINT}); start "
                "the run without --resume"
            ]
        )
    if (
        run_json.is_file()
        and json.loads(run_json.read_text(encoding="utf-8")).get("status") == RunStatus.COMPLETE
    ):
        raise ConfigError(
            [
                f"--resume: the run in {run_dir} is already complete ({spent_text(run_dir)}); "
                "its model and report are final. Train more by starting a new run with --out "
                "(it spends a new budget on the same data)"
            ]
        )
    changes: tuple[Change, ...] = ()
    original_path = run_dir / "config.yaml"
    if original_path.is_file():
        original = config_from_dict(
            yaml.safe_load(original_path.read_text(encoding="utf-8")), str(original_path)
        )
        changes = tuple(config_changes(original, cfg))
        _check_same_data(changes, task, run_dir)
    replan = resume_replans(changes, str(run_dir))
    _announce_changes(changes, run_dir)
    if not private:
        if not ckpt_path.is_file():
            raise ConfigError(
                [
                    f"--resume: no checkpoint at {ckpt_path} (the non-private run stopped before "
                    "its first epoch ended; it spent no privacy budget); start it again without "
                    "--resume after removing the folder, or choose another --out"
                ]
            )
        return RunPlan(OpeningKind.CHECKPOINT, None, changes=changes)
    previous = PrivacyLedger.load(ledger_path) if ledger_path.is_file() else None
    spent = list(previous.events) if previous is not None else []
    done = sum(e.steps for e in spent)
    full = int(cfg.training.epochs * steps_per_epoch)
    if ckpt_path.is_file():
        stored = stored_plans(run_dir)
        if not replan and stored:
            # the same plan, continued: record the steps already spent when it resumes
            plan = PrivacyPlan.from_dict(stored[-1]["plan"]).continued(done)
        else:
            plan = plan_privacy(
                cfg, n_units, steps_per_epoch, spent=spent, steps=max(0, full - done)
            )
            text = f"--resume {run_dir}: re-planned within the target: {plan.describe()}"
            print(text, file=sys.stderr, flush=True)
            log.warning(text)
        return RunPlan(OpeningKind.CHECKPOINT, plan, previous, changes)
    # Stopped before the first checkpoint: restart from the initial model; the steps already
    # spent stay in the ledger and the new plan fits in what is left of the target.
    plan = plan_privacy(cfg, n_units, steps_per_epoch, spent=spent, steps=full)
    if previous is None:
        return RunPlan(OpeningKind.START, plan, None, changes)
    if previous.delta != plan.delta:
        raise PlanError(
            f"the ledger's delta {previous.delta:g} differs from the plan's {plan.delta:g}; "
            "resume with the original data and privacy.delta"
        )
    return RunPlan(OpeningKind.LEDGER, plan, previous, changes)


def plan_privacy(
    cfg: RunConfig,
    num_units: int,
    steps_per_epoch: int,
    *,
    spent: Sequence[GaussianSteps] = (),
    steps: int | None = None,
) -> PrivacyPlan:
    """The privacy plan: delta, sample rate, planned steps and the noise multiplier.

    Args:
        cfg: the run configuration.
        num_units: ``N``, privacy units in the training set.
        steps_per_epoch: ``ceil(N / B)``; the sample rate is its inverse.
        spent: steps a resumed run has already spent (its ledger); the plan covers them and
            ``steps`` more, and the composed epsilon stays within the target.
        steps: noisy steps still to take (default: ``training.epochs`` epochs).

    Returns:
        The plan; its ``planned_steps`` counts the spent steps too.

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
    return PrivacyPlan(
        delta=delta,
        sample_rate=q,
        planned_steps=done + todo,
        noise_multiplier=float(sigma),
        spent_steps=done,
        steps_remaining=todo,
    )


def resume_replans(changes: Sequence[Change], run_dir: str) -> bool:
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


def _announce_changes(changes: Sequence[Change], run_dir: Path) -> None:
    """Say on the console (and in the log) every field a resume changes against the run's."""
    if not changes:
        return
    lines = [f"  {path}: {before!r} -> {after!r}" for path, before, after in changes]
    text = (
        f"--resume {run_dir}: this resume changes {plural('field', len(changes))} of the "
        "run's stored configuration:\n" + "\n".join(lines) + "\n(to continue the run exactly as "
        f"it was, use `dpkfc-med train --resume --out {run_dir}` without a config)"
    )
    print(text, file=sys.stderr, flush=True)
    log.warning(text)


def _check_same_data(changes: Sequence[Change], task: Task, run_dir: Path) -> None:
    """A moved data folder/file is fine; different data is not."""
    if not any(path == "data.path" for path, _, _ in changes):
        return
    plans = stored_plans(run_dir)
    before = plans[0].get("data_sha256") if plans else None
    now = task.data_record.get("sha256")
    if before is None or before != now:
        raise ConfigError(
            [
                f"--resume {run_dir}: data.path changed and the data's fingerprint differs from "
                "the one the run started with (or was not recorded); resume with the original "
                "data, or start a new run with --out"
            ]
        )


def stored_plans(run_dir: Path) -> list[dict[str, Any]]:
    """Every start's and resume's entry of ``plan.json`` (the report's plan history)."""
    path = run_dir / PLAN_JSON
    if not path.is_file():
        return []
    return list(json.loads(path.read_text(encoding="utf-8")).get("plans", []))


def start_run_files(cfg: RunConfig, task: Task, run_dir: Path, plan: RunPlan) -> None:
    """Mark the run incomplete and append (never overwrite) its config and plan history."""
    plans = stored_plans(run_dir)
    session = len(plans)
    run_dir.mkdir(parents=True, exist_ok=True)
    run_json = run_dir / RUN_JSON
    started = (
        json.loads(run_json.read_text(encoding="utf-8")).get("started")
        if run_json.is_file()
        else None
    ) or now()
    write_json(
        run_json, {"status": RunStatus.INCOMPLETE.value, "started": started, "name": cfg.name}
    )
    text = yaml.safe_dump(settings(cfg), sort_keys=False)
    # the configuration the run now follows (every start's and resume's is kept in the config
    # history); `train --resume --out DIR` continues from it
    atomic_write_bytes(run_dir / "config.yaml", text.encode())
    changed = [f"{p}: {a!r} -> {b!r}" for p, a, b in plan.changes]
    header = (
        f"# session {session} ({plan.kind.value}) at {now()}"
        + (f"; changed: {'; '.join(changed)}" if changed else "")
        + "\n"
    )
    with open(run_dir / CONFIG_HISTORY, "a", encoding="utf-8") as fh:
        fh.write(("---\n" if session else "") + header + text)
        fh.flush()
        os.fsync(fh.fileno())
    entry = {
        "session": session,
        "kind": plan.kind.value,
        "time": now(),
        "changed_fields": [p for p, _, _ in plan.changes],
        "plan": plan.privacy.to_dict() if plan.privacy is not None else None,
        "data_sha256": task.data_record.get("sha256"),
    }
    write_json(run_dir / PLAN_JSON, {"plans": [*plans, entry]})


def carry_ledger(
    engine: PrivacyEngine, popt: Any, previous: PrivacyLedger, ledger_path: Path
) -> None:
    """Continue the on-disk ledger (a run that stopped before its first checkpoint)."""
    assert engine.ledger is not None
    meta = dict(engine.ledger.meta)
    engine.ledger = PrivacyLedger(previous.delta, ledger_path)
    engine.ledger.events = list(previous.events)
    engine.ledger.meta = {**previous.meta, **meta}
    popt.steps_taken = previous.steps
    engine.ledger.save()
    log.info(
        "resumed from the ledger alone: %d noisy steps already spent; training restarts from "
        "the initial model",
        previous.steps,
    )
