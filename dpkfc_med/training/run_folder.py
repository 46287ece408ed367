"""The run folder: its file names, the check that it is writable, and what a stop leaves in it.

A run folder is removed only when it holds nothing spent and nothing trained
(:func:`nothing_spent`); a run that stops keeps its folder, and the console says what was spent
and how to continue (:func:`stopped_message`).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from dpkfc_med.privacy.accounting import PrivacyLedger
from dpkfc_med.report.numbers import format_epsilon
from dpkfc_med.report.render import plural
from dpkfc_med.training.config import ConfigError, RunConfig

__all__ = [
    "CHECKPOINT",
    "CONFIG_HISTORY",
    "LEDGER",
    "PLAN_JSON",
    "RUN_JSON",
    "check_output_dir",
    "discard_run_dir",
    "nothing_spent",
    "now",
    "setup_logging",
    "spent_text",
    "stopped_message",
]

CHECKPOINT = "checkpoint.pt"
LEDGER = "ledger.json"
RUN_JSON = "run.json"
PLAN_JSON = "plan.json"
CONFIG_HISTORY = "config_history.yaml"

log = logging.getLogger("dpkfc_med")


def now() -> str:
    """The UTC time, to the second."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


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
