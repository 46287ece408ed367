"""The typed sections of a run record: what a stopped run states, frozen, in report/'s terms.

A training run fills these from its config, task, model and engine state once it stops; the
report (:func:`dpkfc_med.report.record.build_report`) turns each into its JSON section with
``as_dict``. The sentences the report states about a section (how the epoch was chosen, what
the weight average is) are composed here, not by the run. History and ledger are snapshots:
nothing in a record changes after the run hands it over.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dpkfc_med.privacy.accounting import PrivacyLedger

__all__ = [
    "DataSection",
    "HistorySnapshot",
    "ModelSection",
    "RunSection",
    "TaskSection",
    "TrainingSection",
    "snapshot_ledger",
]

WEIGHT_AVERAGE_NOTE = (
    "exponential moving average of the released weights after each noisy step "
    "(post-processing); validated, selected and released"
)


def snapshot_ledger(ledger: PrivacyLedger) -> PrivacyLedger:
    """An in-memory copy of ``ledger`` (no file): later steps of the live one do not reach it."""
    return PrivacyLedger.from_dict(ledger.to_dict())


@dataclass(frozen=True)
class RunSection:
    """Which run: its name, folder, config and digest, seed and where it ran."""

    name: str
    run_dir: str
    config_sha256: str
    config: Mapping[str, Any]
    seed: int
    device: str
    precision: str = "fp32"
    backends: Mapping[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        """The report's ``run`` section."""
        out = {
            "name": self.name,
            "run_dir": self.run_dir,
            "config_sha256": self.config_sha256,
            "config": dict(self.config),
            "seed": self.seed,
            "device": self.device,
            "precision": self.precision,
        }
        if self.backends:
            out["backends"] = dict(self.backends)
        return out


@dataclass(frozen=True)
class TaskSection:
    """What the network predicts."""

    kind: str
    spatial_dims: int
    num_classes: int
    label_names: Sequence[str] | None = None

    def as_dict(self) -> dict[str, Any]:
        """The report's ``task`` section."""
        names = None if self.label_names is None else list(self.label_names)
        return {
            "kind": str(self.kind),
            "spatial_dims": self.spatial_dims,
            "num_classes": self.num_classes,
            "label_names": names,
        }


@dataclass(frozen=True)
class DataSection:
    """The data the run trained on, as the task describes it, with its unit count.

    Attributes:
        record: The task's data record (fingerprint, source, splits, format-specific fields).
        num_train_units: N, the training units (public by the guarantee's own statement).
        privacy_unit: What one unit is, in words.
        max_samples_per_unit: The public bound on samples per unit; ``None`` when the bound
            was read off the private data (it then stays with the custodian).
    """

    record: Mapping[str, Any]
    num_train_units: int
    privacy_unit: str
    max_samples_per_unit: int | None = None

    def as_dict(self) -> dict[str, Any]:
        """The report's ``data`` section (the unit note is added by the report)."""
        return {
            **self.record,
            "num_train_units": self.num_train_units,
            "privacy_unit": self.privacy_unit,
            "max_samples_per_unit": self.max_samples_per_unit,
        }


@dataclass(frozen=True)
class ModelSection:
    """The network: name, size, the DP fixes (one record each) and how it was fine-tuned."""

    name: str
    num_params: int
    fixes: Sequence[Mapping[str, Any]] = ()
    finetune: Mapping[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """The report's ``model`` section."""
        return {
            "name": self.name,
            "num_params": self.num_params,
            "fixes": [dict(f) for f in self.fixes],
            **self.finetune,
        }


@dataclass(frozen=True)
class TrainingSection:
    """How the run trained: optimizer, schedule, recipe, weight average and epoch selection.

    Attributes:
        recipe_mode: ``training.recipe`` (``manual`` or ``auto``).
        recipe_fields: One row per recipe field: its value and who set it.
        average_decay: The weight average's decay; ``None`` when no average is kept.
        selection_metric: The validation metric a ``best`` selection maximises.
    """

    optimizer: str
    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    pretraining: Mapping[str, Any] | None = None
    recipe_mode: str = "manual"
    recipe_fields: Sequence[Mapping[str, Any]] = ()
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    average_decay: float | None = None
    epochs_planned: int = 0
    batch_size: int = 0
    selected_epoch: int | None = None
    select_epoch: str = "best"
    selection_metric: str = "metric"

    def as_dict(self) -> dict[str, Any]:
        """The report's ``training`` section, with its two sentences."""
        average = None
        if self.average_decay is not None:
            average = {"decay": self.average_decay, "note": WEIGHT_AVERAGE_NOTE}
        return {
            "optimizer": self.optimizer,
            "lr": self.lr,
            "momentum": self.momentum,
            "weight_decay": self.weight_decay,
            "pretraining": None if self.pretraining is None else dict(self.pretraining),
            "recipe": {"mode": self.recipe_mode, "fields": [dict(r) for r in self.recipe_fields]},
            "lr_schedule": self.lr_schedule,
            "warmup_steps": self.warmup_steps,
            "weight_average": average,
            "epochs_planned": self.epochs_planned,
            "batch_size": self.batch_size,  # B; the expected batch is privacy's q N
            "selected_epoch": self.selected_epoch,
            "select_epoch": self.select_epoch,
            "model_selection": (
                "the last epoch (post-processing)"
                if self.select_epoch == "last"
                else f"best validation {self.selection_metric} over epochs"
            ),
        }


@dataclass(frozen=True)
class HistorySnapshot:
    """The run's curves when it stopped: steps, losses, validation metric per epoch.

    ``epsilon_step`` lists the steps whose epsilon the report states (the report computes
    those epsilons from the ledger).
    """

    step: tuple[int, ...] = ()
    epsilon_step: tuple[int, ...] = ()
    loss: tuple[float, ...] = ()
    val_epoch: tuple[int, ...] = ()
    val_metric: tuple[float, ...] = ()
    val_metric_name: str = "metric"

    @classmethod
    def of(cls, history: Mapping[str, Any]) -> HistorySnapshot:
        """A snapshot of a history in its checkpoint form (``RunHistory.as_dict()``)."""
        return cls(
            step=tuple(history.get("step", ())),
            epsilon_step=tuple(history.get("epsilon_step", ())),
            loss=tuple(history.get("loss", ())),
            val_epoch=tuple(history.get("val_epoch", ())),
            val_metric=tuple(history.get("val_metric", ())),
            val_metric_name=str(history.get("val_metric_name", "metric")),
        )

    def as_dict(self) -> dict[str, Any]:
        """The report's series (without ``epsilon_step``, which the report resolves)."""
        return {
            "step": list(self.step),
            "loss": list(self.loss),
            "val_epoch": list(self.val_epoch),
            "val_metric": list(self.val_metric),
            "val_metric_name": self.val_metric_name,
        }
