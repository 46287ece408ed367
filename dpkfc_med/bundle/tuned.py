"""The released model of an accounted tuning (``dpkfc-med tune``) as a bundle's input.

A tuning's folder holds the released model (``model.pt``, the best trial's weights) and the
shareable ``tuning_report.{json,md}``; its ledger (every trial's values and noisy score) and
every trial's own run sit in the custodian folder. :func:`check_tuning` reads both and refuses,
naming every problem at once, a tuning that is not finished, that released nothing, whose
``model.pt`` is not the selected trial's, or whose trials ran a mechanism other than the
planned one. :func:`tuning_dp_block` is the bundle's ``differential_privacy`` block: the
guarantee of the whole tuning (the random number of trials, every trial's training and noisy
score, the selection and the released model), with the mechanism in plain words in its
``tuning`` entry.

Privacy guarantee:
    The block states the tuning's total epsilon (recomputed here from the plan with
    :func:`~dpkfc_med.privacy.selection.tuning_epsilon`), never one trial's. The number of
    trials that ran, the released trial's index (which bounds it from below), the other trials
    and their scores are not released: the bound covers the best trial's output alone
    (revealing the count would condition the analysis on it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from dpkfc_med.bundle.metadata import MECHANISM, preconditioner_block, sha256_file
from dpkfc_med.report.numbers import format_epsilon

__all__ = [
    "TUNING_REPORT_FILES",
    "TunedRelease",
    "check_tuning",
    "is_tuning",
    "tuning_dp_block",
    "tuning_in_words",
]

TUNING_REPORT_FILES = ("tuning_report.json", "tuning_report.md")
"""The tuning's shareable report (written by :mod:`dpkfc_med.training.tune`), shipped in docs/."""

EPS_SLACK = 1e-6  # float noise of recomputing the plan's epsilon
COVERS = (
    "the random number of trials, every trial's private training and noisy validation score, "
    "the selection of the best trial, and the released model with its hyperparameters and "
    "noisy score"
)


@dataclass(frozen=True)
class TunedRelease:
    """What :func:`check_tuning` read from a finished tuning.

    Attributes:
        record: the tuning's ledger (custodian only: never shipped).
        report: its shareable ``tuning_report.json``.
        trial_dir: the released trial's run folder (custodian only).
        config: the released trial's run config as a mapping, under the tuning's name.
        trial_report: the released trial's ``privacy_report.json`` (custodian only).
        epsilon: the tuning's total epsilon, recomputed from its plan.
    """

    record: dict[str, Any]
    report: dict[str, Any]
    trial_dir: Path
    config: dict[str, Any]
    trial_report: dict[str, Any]
    epsilon: float


def is_tuning(folder: str | Path) -> bool:
    """Whether ``folder`` is a ``dpkfc-med tune`` output (it holds the tuning's ledger)."""
    from dpkfc_med.training.tune import TUNING_LEDGER

    return (Path(folder) / TUNING_LEDGER).is_file()


def _trial_problems(record: Mapping[str, Any], folder: Path) -> list[str]:
    """Every trial whose ledger is not the planned mechanism (or is missing)."""
    from dpkfc_med.privacy.accounting import PrivacyLedger
    from dpkfc_med.training.tune import TRIALS_DIR

    p = record["plan"]
    problems = []
    for trial in record["trials"]:
        path = folder / TRIALS_DIR / f"trial_{trial['index']}" / "ledger.json"
        if not path.is_file():
            problems.append(
                f"{path}: missing; every trial's ledger is part of the tuning's guarantee "
                "(restore it from the backup of the tuning folder)"
            )
            continue
        ledger = PrivacyLedger.from_dict(json.loads(path.read_text(encoding="utf-8")))
        off = [
            e
            for e in ledger.events
            if abs(e.sample_rate - p["sample_rate"]) > 1e-12
            or e.noise_multiplier < p["noise_multiplier"] * (1 - 1e-9)
        ]
        if off or ledger.steps > int(p["steps"]):
            problems.append(
                f"{path}: {ledger.steps} steps, events {[vars(e) for e in ledger.events]}; the "
                f"tuning planned at most {p['steps']} steps at rate {p['sample_rate']:.6g} and "
                f"noise multiplier {p['noise_multiplier']:.6g}, so its bound does not cover this "
                "trial (run a new tuning)"
            )
    return problems


def check_tuning(folder: str | Path) -> TunedRelease:
    """Read a finished tuning's release; raise with every reason it cannot be exported.

    Raises:
        BundleExportError: unfinished or empty tuning, a ``model.pt`` that is not the selected
            trial's, a trial outside the plan, or an epsilon above the target.
    """
    from dpkfc_med.bundle.errors import BundleExportError
    from dpkfc_med.privacy.selection import TrialCount, tuning_epsilon
    from dpkfc_med.training.tune import TRIALS_DIR, TUNING_LEDGER

    folder = Path(folder)
    record = json.loads((folder / TUNING_LEDGER).read_text(encoding="utf-8"))
    resume = (
        f"finish it with `dpkfc-med tune CONFIG --epsilon {record['plan']['target_epsilon']:g} "
        f"... --resume --out {folder}` (the same grid and trials), then export"
    )
    problems: list[str] = []
    pending = [t["index"] for t in record["trials"] if t["status"] != "scored"]
    if pending or "finished" not in record:
        problems.append(
            f"{folder / TUNING_LEDGER}: the tuning stopped before every trial was scored; only "
            f"the best of all its trials is covered by its guarantee; {resume}"
        )
    elif record.get("selected") is None:
        problems.append(
            f"{folder}: the tuning drew no trial and released nothing (a Poisson count of 0); "
            "its budget is spent: a new tuning spends a new budget"
        )
    for name in ("model.pt", TUNING_REPORT_FILES[0]):
        if not (folder / name).is_file() and not pending and "finished" in record:
            problems.append(f"{folder / name}: missing; {resume}")
    trial_dir = folder / TRIALS_DIR / f"trial_{record.get('selected')}"
    if not problems:
        src = trial_dir / "model.pt"
        if not src.is_file() or sha256_file(src) != sha256_file(folder / "model.pt"):
            problems.append(
                f"{folder / 'model.pt'}: not the selected trial's model ({src}); the guarantee "
                "covers that model only (copy it back, or run a new tuning)"
            )
        for name in ("config.yaml", "privacy_report.json"):
            if not (trial_dir / name).is_file():
                problems.append(f"{trial_dir / name}: missing; restore the tuning folder")
    problems += _trial_problems(record, folder)
    p = record["plan"]
    t = p["trials"]
    count = TrialCount(t["kind"], mu=t["mu"], eta=t["eta"], gamma=t["gamma"])
    eps = tuning_epsilon(
        p["sample_rate"], p["steps"], p["noise_multiplier"], p["score_noise"], count, p["delta"]
    )
    if eps > p["target_epsilon"] + EPS_SLACK:
        problems.append(
            f"{folder / TUNING_LEDGER}: the plan spends epsilon {eps:.4f} (RDP, delta "
            f"{p['delta']:g}), above its target {p['target_epsilon']:g}; the model must not be "
            "released under that target"
        )
    if problems:
        raise BundleExportError(problems, folder)
    config = yaml.safe_load((trial_dir / "config.yaml").read_text(encoding="utf-8"))
    # the tuning's name, never a trial's: a name like "<name>_trial_5" would show K >= 6
    config["name"] = record["config"].get("name", "run")
    return TunedRelease(
        record=record,
        report=json.loads((folder / TUNING_REPORT_FILES[0]).read_text(encoding="utf-8")),
        trial_dir=trial_dir,
        config=config,
        trial_report=json.loads((trial_dir / "privacy_report.json").read_text(encoding="utf-8")),
        epsilon=eps,
    )


def tuning_in_words(t: Mapping[str, Any]) -> str:
    """One sentence on the tuning mechanism, from a ``tuning`` block (see :func:`tuning_dp_block`).

    Example: ``Accounted hyperparameter tuning: the best of a random number of trials (...,
    expected 2), each trial alone epsilon 6.3; the total (epsilon 8, delta 1e-05) covers ...``.
    """
    return (
        f"Accounted hyperparameter tuning (dpkfc-med tune, Papernot & Steinke 2022): the best of "
        f"a random number of private trials ({t['trials_distribution']}; expected "
        f"{t['expected_trials']:.3g} trials), each trial alone epsilon "
        f"{format_epsilon(t['epsilon_one_trial'])} (its training alone "
        f"{format_epsilon(t['epsilon_one_trial_training'])}); the total (epsilon "
        f"{format_epsilon(t['epsilon_total'])}, delta {t['delta']:g}) covers {COVERS}."
    )


def tuning_dp_block(release: TunedRelease, *, report_sha256: str) -> dict[str, Any]:
    """The ``differential_privacy`` block of a tuning's released model.

    Args:
        release: what :func:`check_tuning` read.
        report_sha256: SHA-256 of the shipped ``docs/tuning_report.json``.

    Returns:
        The keys of :func:`~dpkfc_med.bundle.metadata.dp_block` with the tuning's figures
        (epsilon: the whole tuning's, RDP; noise and steps: every trial's), and ``tuning``:
        the trial-count distribution, the expected number of trials, one trial's epsilon, the
        total and what it covers, the grid and the released values.
    """
    p, r, trial = release.record["plan"], release.report, release.trial_report
    tp = trial["privacy"]
    unit = trial["data"].get("privacy_unit")
    tuning = {
        "mechanism": (
            "Papernot & Steinke (ICLR 2022) private selection: a random number K of trials, "
            "each a private training run with hyperparameters drawn uniformly from the grid, "
            "scored by the sum of per-unit validation scores in [0, 1] plus Gaussian noise; "
            "only the best trial's model, hyperparameters and noisy score are released"
        ),
        "trials_distribution": p["trials_in_words"],
        "expected_trials": p["trials"]["mean"],
        "epsilon_one_trial": p["trial_epsilon"],
        "epsilon_one_trial_training": p["training_epsilon"],
        "score_noise_multiplier": p["score_noise"],
        "epsilon_total": release.epsilon,
        "delta": p["delta"],
        "covers": COVERS,
        "grid": r["grid"],
        "released": r["released"],
    }
    tuning["in_words"] = tuning_in_words(tuning)
    return {
        "private": True,
        "guarantee": r["guarantee"],
        "valid_dp_release": bool((tp.get("randomness") or {}).get("valid_dp_release")),
        "headline_warnings": list(tp.get("headline_warnings") or []),
        "mechanism": f"{tuning['mechanism']}; each trial's training: {MECHANISM}",
        "method": tp.get("method"),
        "preconditioner": preconditioner_block(trial),
        "accountant": "rdp",
        "delta": p["delta"],
        "epsilon_target": p["target_epsilon"],
        "epsilon_spent": {"rdp": release.epsilon},
        "unit_of_privacy": unit,
        "neighbouring_relation": f"add or remove one {unit} of the training or validation split",
        "sampler": "poisson",
        "sample_rate": p["sample_rate"],
        "expected_batch_size": tp.get("expected_batch_size"),
        "noise_multiplier": p["noise_multiplier"],
        "max_grad_norm": tp.get("max_grad_norm"),
        "steps": p["steps"],
        "not_covered": list(r.get("not_covered") or []),
        "privacy_report": {"file": "docs/tuning_report.json", "sha256": report_sha256},
        "tuning": tuning,
    }
