"""What a run remembers of its steps: losses, validation scores, clipping diagnostics."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ignite.engine import Events

__all__ = ["HistoryHandler", "RunLog"]


@dataclass
class RunLog:
    """The history shared by a run's handlers and kept in its checkpoint.

    Attributes:
        history: ``step`` and ``loss`` per step, ``val_epoch``/``val_metric`` per validation,
            ``epsilon_step`` (steps whose exact epsilon the report lists).
        diag: Per-step clipping diagnostics (un-noised private statistics: custodian only).
        best: The selected epoch: ``{"epoch", "metric", "state"}``.
        bar_epsilon: The progress bar's epsilon fields.
        pretrain: Provenance of data-free pretraining.
    """

    selection_metric: str = "metric"
    history: dict[str, Any] = field(default_factory=dict)
    diag: list[dict[str, Any]] = field(default_factory=list)
    best: dict[str, Any] = field(default_factory=dict)
    bar_epsilon: dict[str, str] = field(default_factory=dict)
    pretrain: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.history = self.history or {
            "step": [],
            "epsilon_step": [],
            "loss": [],
            "val_epoch": [],
            "val_metric": [],
            "val_metric_name": self.selection_metric,
        }
        self.best = self.best or {"epoch": -1, "metric": -math.inf, "state": None}

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps."""
        return {
            "history": self.history,
            "diag": self.diag,
            "best": self.best,
            "pretrain": self.pretrain,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a checkpoint's history."""
        self.history, self.diag, self.best = state["history"], state["diag"], state["best"]
        self.pretrain = state.get("pretrain")


class HistoryHandler:
    """After every step: the step count, the batch's mean loss and the clipping diagnostics."""

    def __init__(self, log: RunLog) -> None:
        self.log = log

    def attach(self, engine: Any) -> None:
        """Attach to a :class:`~dpkfc_med.engines.PrivateTrainer`."""
        engine.add_event_handler(Events.ITERATION_COMPLETED, self)

    def __call__(self, engine: Any) -> None:
        """Record the step just taken."""
        self.log.history["step"].append(engine.steps_taken)
        self.log.history["loss"].append(engine.state.step_loss)
        if engine.private and engine.optimizer.last_diagnostics.batch_units:
            self.log.diag.append(engine.optimizer.last_diagnostics.as_dict())
