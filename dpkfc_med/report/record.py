"""The privacy report of a run, built from its frozen run record.

A :class:`RunRecord` is what a training run hands to the report once it stops: typed, frozen
sections (:mod:`dpkfc_med.report.sections`), a snapshot of its history and of its
:class:`~dpkfc_med.privacy.accounting.PrivacyLedger`, in the spirit of dp_accounting's
``DpEvent``: the record says what mechanism ran, the report decides how to state it (the
not-covered list included). Nothing here reads a config object, a task or a trainer, so the
report cannot depend on how the run was driven (``dpkfc-med train``, a bundle, a tuning trial).
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dpkfc_med.privacy.accounting import PrivacyLedger
from dpkfc_med.report.custodian import not_covered
from dpkfc_med.report.history import epsilon_history
from dpkfc_med.report.numbers import format_epsilon
from dpkfc_med.report.sections import (
    DataSection,
    HistorySnapshot,
    ModelSection,
    RunSection,
    TaskSection,
    TrainingSection,
)
from dpkfc_med.report.status import RunStatus
from dpkfc_med.report.wording import NO_GUARANTEE, NOT_VALID, PRIVATE_PRECONDITIONER

__all__ = [
    "GUARANTEE",
    "SEEDED_GUARANTEE",
    "Mechanism",
    "RunRecord",
    "build_report",
    "unit_statement",
]

GUARANTEE = (
    "Each training step adds Gaussian noise of standard deviation sigma*C to the sum of "
    "per-unit gradients clipped to L2 norm C (after the probe-only preconditioner), with units "
    "drawn by Poisson sampling at rate q. The released model and everything derived from it are "
    "({eps}, {delta})-differentially private with respect to adding or removing one {unit} "
    "({accountant} accountant, which planned the run). The preconditioner is computed from "
    "synthetic probes and previously released parameters only, so it is post-processing and "
    "costs no budget."
)
SEEDED_GUARANTEE = (
    f"{NOT_VALID}: no differential-privacy guarantee holds. The noise and the Poisson "
    "sampling were seeded from training.seed = {seed} (privacy.reproducible_noise: true), which "
    "this report publishes, so anyone can replay them. Research use only."
)
TUNING_LAST = (
    "Hyperparameters (learning rate, clip norm, damping, epochs) were set in the configuration "
    "before this run, and the last epoch's weights are released (no epoch was chosen on the "
    "validation split). Any tuning done by looking at results on the private data is NOT "
    "covered by the stated epsilon, unless the run is a trial of `dpkfc-med tune`, whose own "
    "report covers the tuning."
)
TUNING = (
    "Hyperparameters (learning rate, clip norm, damping, epochs) were set in the configuration "
    "before this run. Any tuning done by looking at results on the private data (including this "
    "run's validation split, which is also used here to select the reported epoch) is NOT "
    "covered by the stated epsilon."
)
_RANDOMNESS = {
    "os-entropy": "PyTorch generators seeded from OS entropy; the seeds are never written anywhere",
    "os-csprng": "every draw from the OS CSPRNG (os.urandom), with floating-point hardening",
    "seeded": "seeded from the published training.seed: replayable",
}


@dataclass(frozen=True)
class Mechanism:
    """What the private mechanism executed: the ledger and the settings that define it.

    Attributes:
        ledger: Every noisy step, as accounted (the report's epsilon comes from it): a
            snapshot (:func:`~dpkfc_med.report.sections.snapshot_ledger`), not the live ledger.
        accountant: The stated accountant's name (``prv``, ``rdp``, ``gdp``).
        target_epsilon: The target the plan was calibrated to.
        planned_steps: The plan's step cap.
        sample_rate: Poisson rate q.
        noise_multiplier: The engine's sigma (used when the ledger holds no step yet).
        max_grad_norm: The clip norm C.
        randomness: ``os-entropy``, ``os-csprng`` or ``seeded``.
        batch_size: The configured batch B (the expected batch is q N).
        seed: ``training.seed`` (named only when the noise was seeded from it).
        provenance: The preconditioner's provenance (probe source, refreshes, coverage);
            ``None`` for DP-SGD.
        public_probes: Whether the probes are a public proxy (``dp-kfc-public``).
    """

    ledger: PrivacyLedger
    accountant: str
    target_epsilon: float
    planned_steps: int
    sample_rate: float
    noise_multiplier: float
    max_grad_norm: float
    randomness: str
    batch_size: int
    seed: int
    provenance: Mapping[str, Any] | None = None
    public_probes: bool = False


@dataclass(frozen=True)
class RunRecord:
    """A stopped run, as plain data: everything the report states and nothing it computes from.

    Attributes:
        status: How the run ended (a :class:`~dpkfc_med.report.status.RunStatus` or its
            value; stored as the member).
        method: The method's name (``dp-kfc``, ``dp-sgd``, ``nonprivate``, ...).
        accountant: The stated accountant (``privacy.accountant``).
        privacy_unit: What one unit is, in words.
        run: Name, directory, config and its digest, seed, device, precision, backends.
        task: Kind, spatial dims, classes, label names.
        data: The data record (fingerprint, source) with the unit count and unit statements.
        model: Name, parameter count, DP fixes, fine-tuning record.
        training: Optimizer settings, schedule, recipe, weight average, epoch selection,
            pretraining.
        history: Steps, losses, validation metric per epoch and the steps whose epsilon is
            listed (``epsilon_step``), as they were when the run stopped.
        metrics: Final ``val`` / ``test`` metrics (``None`` when not evaluated).
        diagnostics: Per-step clipping diagnostics (un-noised; custodian only).
        plan_history: Every start's and resume's plan.
        environment: Versions and hardware.
        mechanism: The executed mechanism; ``None`` for a non-private run.
        secure_rng: ``privacy.secure_rng`` as configured.
        unit_note: The task's statement about several images per patient, if any.
        epochs: Epochs completed (non-private runs; private runs state ``steps * q``).
    """

    status: RunStatus
    method: str
    accountant: str
    privacy_unit: str
    run: RunSection
    task: TaskSection
    data: DataSection
    model: ModelSection
    training: TrainingSection
    history: HistorySnapshot
    metrics: Mapping[str, Any]
    diagnostics: list[dict[str, Any]] = field(default_factory=list)
    plan_history: list[dict[str, Any]] = field(default_factory=list)
    environment: Mapping[str, Any] = field(default_factory=dict)
    mechanism: Mechanism | None = None
    secure_rng: bool = False
    unit_note: Mapping[str, Any] | None = None
    epochs: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", RunStatus(self.status))  # refuses any other value


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def unit_statement(
    note: Mapping[str, Any] | None, epsilon: float | None, delta: float | None
) -> dict[str, Any] | None:
    """The unit note (several images per patient) with its group-privacy figures."""
    if not note:
        return None
    out = dict(note)
    k = int(out.get("images_per_patient") or 1)
    if k > 1 and epsilon is not None and delta is not None:
        from dpkfc_med.units import group_privacy

        eps_k, delta_k = group_privacy(epsilon, delta, k)
        out["per_patient"] = {"epsilon": eps_k, "delta": delta_k, "images_per_patient": k}
        out["statement"] = (
            f"The privacy unit is one image, but {out.get('dataset', 'this dataset')} holds up "
            f"to {k} images per patient ({out.get('source', 'see the dataset description')}). "
            f"Per patient, group privacy gives only about (epsilon, delta) = "
            f"({format_epsilon(eps_k)}, {delta_k:.3g}) = (k eps, k e^((k-1) eps) delta) with "
            f"k = {k}. Give a unit-id mapping (data.unit_ids) to protect patients directly."
        )
    return out


def _diagnostics(diag: list[dict[str, Any]]) -> dict[str, Any] | None:
    if not diag:
        return None
    keys = ("clipped_fraction", "median_transformed_norm", "median_raw_norm")
    out: dict[str, Any] = {f"mean_{k}": float(np.nanmean([d[k] for d in diag])) for k in keys}
    for src, dst in (("layer_share", "mean_layer_share"), ("layer_snr", "mean_layer_snr")):
        values: dict[str, list[float]] = {}
        for d in diag:
            for k, v in d.get(src, {}).items():
                values.setdefault(k, []).append(v)
        out[dst] = {k: float(np.mean(v)) for k, v in values.items()}
    out["steps"] = len(diag)
    out["note"] = (
        "computed from un-noised private statistics; not covered by the privacy guarantee; "
        "for the data custodian only"
    )
    return out


def _history(record: RunRecord) -> dict[str, Any]:
    """The run's history, its epsilon curves rebuilt from the ledger (report.history)."""
    history = record.history.as_dict()
    mech = record.mechanism
    if mech is None:
        return {**history, "epsilon": [], "epsilon_step": [], "epsilon_rdp": []}
    from dpkfc_med.privacy.accounting import Accountant

    curves = epsilon_history(
        mech.ledger,
        list(record.history.step),
        list(record.history.epsilon_step),
        Accountant(mech.accountant),
    )
    return {**history, **curves}


def _preconditioner(mech: Mechanism, warnings: list[str]) -> dict[str, Any] | None:
    prov = mech.provenance
    if prov is None:
        return None
    src = prov.get("probe_source") or {}
    overlap = bool(src.get("uses_private_data"))
    if overlap:
        warnings.append(
            f"{PRIVATE_PRECONDITIONER}: the public proxy shares images with the private training "
            "set (probes.allow_public_overlap: true); the preconditioner depends on private "
            "records, which the stated guarantee does NOT cover."
        )
    pre = prov.get("preconditioner") or {}
    return {
        "uses_private_data": overlap,
        "external_data": (
            {"path": src.get("path"), "sha256": src.get("sha256"), "note": src.get("note")}
            if mech.public_probes
            else None
        ),
        "probe_source": src,
        "refresh_every": prov["refresh_every"],
        "refresh_plan": prov.get("refresh_plan", {}),
        "refreshes": prov["refreshes"],
        "covered_layers": prov["covered_layers"],
        "config": pre.get("config", {}),
        "coverage": pre.get("coverage", []),
        "coverage_shares": pre.get("coverage_shares"),
        "eig_fallbacks": [
            {**fb, "refresh_step": r["step"]}
            for r in prov["refreshes"]
            for fb in r.get("eig_fallbacks", [])
        ],
    }


def _privacy(record: RunRecord) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The report's ``privacy`` section and its ``preconditioner`` section."""
    mech = record.mechanism
    n_units = int(record.data.num_train_units)
    last = record.training.select_epoch == "last"
    privacy: dict[str, Any] = {
        "method": record.method,
        "private": mech is not None,
        "accountant": record.accountant,
        "epsilon": None,
        "target_epsilon": mech.target_epsilon if mech is not None else None,
        "delta": None,
        "sampler": None,
        "sample_rate": None,
        "expected_batch_size": None,
        "noise_multiplier": None,
        "max_grad_norm": None,
        "steps": len(record.history.step),
        "planned_steps": None,
        "epochs": record.epochs,
        "secure_rng": bool(record.secure_rng and mech is not None),
        "randomness": {"source": "none", "valid_dp_release": False},
        "neighbouring_relation": f"add or remove one {record.privacy_unit}",
        "guarantee": f"{NO_GUARANTEE}: non-private training.",
        "hyperparameter_tuning": TUNING_LAST if last else TUNING,
        "ledger": {"events": [], "steps": 0, "note": "non-private run: no mechanism was executed"},
        "plan_history": [  # the data fingerprint stays in the run's working files
            {k: v for k, v in e.items() if k != "data_sha256"} for e in record.plan_history
        ],
        "headline_warnings": [],
    }
    if mech is None:
        return privacy, None
    ledger = mech.ledger
    eps = ledger.all_epsilons()
    sigmas = [e.noise_multiplier for e in ledger.events] or [mech.noise_multiplier]
    source = mech.randomness
    warnings: list[str] = []
    if source == "seeded":
        warnings.append(
            f"{NOT_VALID}: the noise and the Poisson sampling were seeded from "
            f"training.seed = {mech.seed} (privacy.reproducible_noise: true), which this report "
            "publishes; anyone can replay them. Research use only."
        )
    # The looser cross-check accountants (RDP above PRV on every run calibrated to PRV) are not
    # a warning: the report states them on a neutral line under the verdict.
    batch = min(mech.batch_size, n_units)
    privacy.update(
        {
            "randomness": {
                "source": source,
                "valid_dp_release": source != "seeded",
                "note": _RANDOMNESS[source],
            },
            "headline_warnings": warnings,
            "epsilon": eps,
            "delta": ledger.delta,
            "sampler": "poisson",
            # One definition everywhere: q = 1/ceil(N/B), expected batch round(q N).
            "sample_rate": mech.sample_rate,
            "batch_size": batch,
            "steps_per_epoch": -(-n_units // batch),
            "expected_batch_size": ledger.meta.get("expected_batch_size"),
            "noise_multiplier": min(sigmas),
            "noise_multipliers": sorted(set(sigmas)),
            "max_grad_norm": mech.max_grad_norm,
            "processes": {
                "world_size": int(ledger.meta.get("world_size", 1)),
                "backend": ledger.meta.get("backend"),
            },
            "steps": ledger.steps,
            "planned_steps": mech.planned_steps,
            "epochs": ledger.steps * mech.sample_rate,
            "guarantee": (
                SEEDED_GUARANTEE.format(seed=mech.seed)
                if source == "seeded"
                else GUARANTEE.format(
                    eps=format_epsilon(eps.get(record.accountant, eps["max"])),
                    delta=f"{ledger.delta:g}",
                    unit=record.privacy_unit,
                    accountant=record.accountant.upper(),
                )
            ),
            "ledger": ledger.to_dict(),
        }
    )
    return privacy, _preconditioner(mech, warnings)


def build_report(record: RunRecord) -> dict[str, Any]:
    """The privacy-report dict (schema ``dpkfc_med.privacy_report/2``) of a stopped run.

    Complete as built: ``privacy.not_covered`` lists what the stated guarantee does not cover
    for this report (:func:`~dpkfc_med.report.custodian.not_covered`).
    """
    from dpkfc_med.report.schema.privacy_report import REPORT_SCHEMA

    privacy, pre = _privacy(record)
    eps = (privacy.get("epsilon") or {}).get(privacy.get("accountant") or "prv")
    report = {
        "schema": REPORT_SCHEMA,
        "status": record.status.value,
        "created": _now(),
        "run": record.run.as_dict(),
        "task": record.task.as_dict(),
        "data": {
            **record.data.as_dict(),
            "unit_note": unit_statement(record.unit_note, eps, privacy.get("delta")),
        },
        "model": record.model.as_dict(),
        "privacy": privacy,
        "preconditioner": pre,
        "training": record.training.as_dict(),
        "history": _history(record),
        "metrics": {"val": record.metrics.get("val"), "test": record.metrics.get("test")},
        "diagnostics": _diagnostics(record.diagnostics),
        "environment": dict(record.environment),
    }
    privacy["not_covered"] = not_covered(report)
    return report
