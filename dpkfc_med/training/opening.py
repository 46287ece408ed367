"""How a run opens: fresh, from its checkpoint or from its ledger alone, and its working files.

Nothing is written before the run's input is validated and its opening decided: a run that
would overspend, a complete run, or a resume whose configuration changed what may not change
is refused with the fix. A resume that changes ``training.epochs`` or
``privacy.noise_multiplier`` re-plans the remaining steps within the target (:mod:`.plan`).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import logging
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from dpkfc_med.privacy.accounting import PrivacyLedger
from dpkfc_med.report.numbers import format_epsilon
from dpkfc_med.report.render import plural
from dpkfc_med.report.status import RunStatus
from dpkfc_med.tasks.base import Task
from dpkfc_med.training.config import ConfigError, RunConfig, config_from_dict
from dpkfc_med.training.plan import (
    PlanError,
    config_changes,
    describe_plan,
    plan_privacy,
    resume_replans,
)
from dpkfc_med.utils import atomic_write_bytes, write_json

if TYPE_CHECKING:
    from dpkfc_med.privacy.engine import PrivacyEngine

__all__ = [
    "CHECKPOINT",
    "CONFIG_HISTORY",
    "LEDGER",
    "PLAN_JSON",
    "RUN_JSON",
    "Opening",
    "carry_ledger",
    "check_output_dir",
    "discard_run_dir",
    "nothing_spent",
    "now",
    "open_run",
    "setup_logging",
    "spent_text",
    "start_run_files",
    "stopped_message",
    "stored_plans",
]

CHECKPOINT = "checkpoint.pt"
LEDGER = "ledger.json"
RUN_JSON = "run.json"
PLAN_JSON = "plan.json"
CONFIG_HISTORY = "config_history.yaml"

log = logging.getLogger("dpkfc_med")


@dataclass
class Opening:
    """How a run starts: fresh, from its checkpoint, or from its ledger alone."""

    kind: str  # "start" | "checkpoint" | "ledger"
    plan: dict[str, Any] | None
    previous: PrivacyLedger | None = None
    changes: list[tuple[str, Any, Any]] = field(default_factory=list)


def spent_text(run_dir: Path) -> str:
    """What the run in ``run_dir`` has spent, in words (from its ledger)."""
    ledger_path = run_dir / LEDGER
    if not ledger_path.is_file():
        return "no privacy budget spent"
    ledger = PrivacyLedger.load(ledger_path)
    if ledger.steps == 0:
        return "no noisy step taken yet"
    eps = ledger.epsilon()
    spent = plural("noisy step", ledger.steps)
    return f"{spent} already spent, epsilon {format_epsilon(eps)} (PRV)"


def open_run(
    cfg: RunConfig,
    task: Task,
    run_dir: Path,
    resume: bool,
    n_units: int,
    steps_per_epoch: int,
) -> Opening:
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
        return Opening("start", plan)
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
    changes: list[tuple[str, Any, Any]] = []
    original_path = run_dir / "config.yaml"
    if original_path.is_file():
        original = config_from_dict(
            yaml.safe_load(original_path.read_text(encoding="utf-8")), str(original_path)
        )
        changes = config_changes(original, cfg)
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
        return Opening("checkpoint", None, changes=changes)
    previous = PrivacyLedger.load(ledger_path) if ledger_path.is_file() else None
    spent = list(previous.events) if previous is not None else []
    done = sum(e.steps for e in spent)
    full = int(cfg.training.epochs * steps_per_epoch)
    if ckpt_path.is_file():
        stored = stored_plans(run_dir)
        if not replan and stored:
            # the same plan, continued: record the steps already spent when it resumes
            plan = {**stored[-1]["plan"], "spent_steps": done}
            plan["steps_remaining"] = max(0, int(plan["planned_steps"]) - done)
        else:
            plan = plan_privacy(
                cfg, n_units, steps_per_epoch, spent=spent, steps=max(0, full - done)
            )
            text = f"--resume {run_dir}: re-planned within the target: {describe_plan(plan)}"
            print(text, file=sys.stderr, flush=True)
            log.warning(text)
        return Opening("checkpoint", plan, previous, changes)
    # Stopped before the first checkpoint: restart from the initial model; the steps already
    # spent stay in the ledger and the new plan fits in what is left of the target.
    plan = plan_privacy(cfg, n_units, steps_per_epoch, spent=spent, steps=full)
    if previous is None:
        return Opening("start", plan, None, changes)
    if previous.delta != plan["delta"]:
        raise PlanError(
            f"the ledger's delta {previous.delta:g} differs from the plan's {plan['delta']:g}; "
            "resume with the original data and privacy.delta"
        )
    return Opening("ledger", plan, previous, changes)


def _announce_changes(changes: list[tuple[str, Any, Any]], run_dir: Path) -> None:
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


def _check_same_data(changes: list[tuple[str, Any, Any]], task: Task, run_dir: Path) -> None:
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
    """Every start's and resume's plan entry of ``plan.json``."""
    path = run_dir / PLAN_JSON
    if not path.is_file():
        return []
    return list(json.loads(path.read_text(encoding="utf-8")).get("plans", []))


def check_output_dir(run_dir: Path) -> None:
    """Refuse an output directory the run cannot write, before anything is written.

    Creates ``run_dir`` (and missing parents) and writes and removes one probe file; on failure
    removes the folders it created and raises, so a refused run leaves nothing behind.

    Raises:
        ConfigError: naming ``output.dir`` / ``--out``, the directory, the operating system's
            reason and the fix.
    """
    created: list[Path] = []
    node = run_dir
    while not node.exists() and node != node.parent:
        created.append(node)
        node = node.parent
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=run_dir)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        for folder in created:  # deepest first; only the empty folders made here
            with contextlib.suppress(OSError):
                folder.rmdir()
        reason = err.strerror or type(err).__name__
        where = f" ({err.filename})" if err.filename and str(err.filename) != str(run_dir) else ""
        raise ConfigError(
            [
                f"output.dir: cannot write the run directory {run_dir}: {reason}{where}; "
                "choose a writable folder with --out (or output.dir in the config), or make "
                "this one writable (e.g. chmod u+w on it or its parent); nothing was written"
            ]
        ) from None


def nothing_spent(run_dir: Path, iterations: int) -> bool:
    """Whether a run folder holds neither spent budget nor anything trained.

    True when its ledger records no noisy step (a run without a ledger, non-private: no
    iteration began) and it holds no checkpoint and no model: removing such a folder loses
    nothing and under-reports nothing.
    """
    if (run_dir / CHECKPOINT).exists() or (run_dir / "model.pt").exists():
        return False
    ledger = run_dir / LEDGER
    if ledger.is_file():
        try:
            return int(json.loads(ledger.read_text(encoding="utf-8")).get("steps", 1)) == 0
        except (OSError, ValueError, TypeError):
            return False  # unreadable: keep it, it may record spent budget
    return iterations == 0


def discard_run_dir(run_dir: Path) -> None:
    """Remove a run folder that holds nothing spent (:func:`nothing_spent`), log file included."""
    for h in list(log.handlers):  # the run's train.log is open in it
        if isinstance(h, logging.FileHandler) and Path(h.baseFilename).parent == run_dir.resolve():
            log.removeHandler(h)
            h.close()
    shutil.rmtree(run_dir, ignore_errors=True)


def stopped_message(out: Path, cfg: RunConfig, trainer: Any, how: str) -> str:
    """What a stopped run spent and how to continue it (the console's last words)."""
    engine = trainer.privacy_engine if trainer is not None else None
    if engine is None or engine.ledger is None:
        return (
            f"{how}: the non-private run in {out} is marked incomplete; continue it with "
            f"`dpkfc-med train --resume --out {out}`"
        )
    return (
        f"{how}: {plural('noisy step', engine.ledger.steps)} spent, epsilon "
        f"{format_epsilon(engine.ledger.epsilon())} of the target "
        f"{cfg.privacy.target_epsilon:g} (PRV; {out / LEDGER}). The run is marked incomplete "
        f"and keeps its budget: continue it as it was with `dpkfc-med train --resume --out "
        f"{out}` (its own stored configuration). Starting it again elsewhere spends a new budget "
        "on the same data."
    )


def start_run_files(cfg: RunConfig, task: Task, run_dir: Path, opening: Opening) -> None:
    """Mark the run incomplete and append (never overwrite) its config and plan history."""
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
    text = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    # the configuration the run now follows (every start's and resume's is kept in the config
    # history); `train --resume --out DIR` continues from it
    atomic_write_bytes(run_dir / "config.yaml", text.encode())
    plans = stored_plans(run_dir)
    session = len(plans)
    changed = [f"{p}: {a!r} -> {b!r}" for p, a, b in opening.changes]
    header = (
        f"# session {session} ({opening.kind}) at {now()}"
        + (f"; changed: {'; '.join(changed)}" if changed else "")
        + "\n"
    )
    with open(run_dir / CONFIG_HISTORY, "a", encoding="utf-8") as fh:
        fh.write(("---\n" if session else "") + header + text)
        fh.flush()
        os.fsync(fh.fileno())
    entry = {
        "session": session,
        "kind": opening.kind,
        "time": now(),
        "changed_fields": [p for p, _, _ in opening.changes],
        "plan": opening.plan,
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


def now() -> str:
    """The UTC time, to the second."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def setup_logging(run_dir: Path) -> None:
    """Send the ``dpkfc_med`` log to ``train.log`` in the run directory, not the console."""
    log.setLevel(logging.INFO)
    log.propagate = False  # the progress bar owns the console; the log goes to the run dir
    for h in list(log.handlers):
        if isinstance(h, logging.FileHandler):
            log.removeHandler(h)
    fh = logging.FileHandler(run_dir / "train.log")
    fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log.addHandler(fh)
