"""What a run remembers of its steps: losses, validation scores, clipping diagnostics."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ignite.engine import Events
from torch import Tensor

if TYPE_CHECKING:
    from dpkfc_med.engines.trainer import PrivateTrainer

__all__ = ["HistoryHandler", "RunHistory", "RunLog", "SelectedEpoch"]


@dataclass
class RunHistory:
    """The series a run's handlers append to (kept in the checkpoint, shown in the report).

    Attributes:
        val_metric_name: The selection metric's name (``val_metric``'s).
        step: ``steps_taken`` after every step.
        epsilon_step: The steps whose exact epsilon the report lists.
        loss: The mean per-sample loss of every step (un-noised: custodian only).
        val_epoch: The epochs validated.
        val_metric: Their validation scores (un-noised: custodian only).
    """

    val_metric_name: str = "metric"
    step: list[int] = field(default_factory=list)
    epsilon_step: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    val_epoch: list[int] = field(default_factory=list)
    val_metric: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """The checkpoint's and the report's form (a copy of every series)."""
        return {
            "step": list(self.step),
            "epsilon_step": list(self.epsilon_step),
            "loss": list(self.loss),
            "val_epoch": list(self.val_epoch),
            "val_metric": list(self.val_metric),
            "val_metric_name": self.val_metric_name,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunHistory:
        """The inverse of :meth:`as_dict` (a checkpoint's history)."""
        return cls(
            val_metric_name=d["val_metric_name"],
            step=list(d["step"]),
            epsilon_step=list(d.get("epsilon_step", [])),
            loss=list(d["loss"]),
            val_epoch=list(d["val_epoch"]),
            val_metric=list(d["val_metric"]),
        )


@dataclass
class SelectedEpoch:
    """The epoch whose weights are released (``-1`` and no state before any validation).

    Attributes:
        epoch: The epoch.
        metric: Its validation score (un-noised: custodian only).
        state: A copy of the validated network's ``state_dict`` at that epoch.
    """

    epoch: int = -1
    metric: float = -math.inf
    state: dict[str, Tensor] | None = None

    def as_dict(self) -> dict[str, Any]:
        """The checkpoint's form."""
        return {"epoch": self.epoch, "metric": self.metric, "state": self.state}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SelectedEpoch:
        """The inverse of :meth:`as_dict`."""
        return cls(epoch=d["epoch"], metric=d["metric"], state=d["state"])


@dataclass
class RunLog:
    """The typed state a run's handlers share, kept in its checkpoint.

    Attributes:
        selection_metric: The validation metric's name.
        history: The per-step and per-validation series (:class:`RunHistory`).
        diag: Per-step clipping diagnostics (un-noised private statistics: custodian only).
        best: The selected epoch (:class:`SelectedEpoch`).
        bar_epsilon: The progress bar's epsilon fields (``eps_rdp``, ``eps_prv``, ...).
        pretrain: Provenance of data-free pretraining.
    """

    selection_metric: str = "metric"
    history: RunHistory = field(init=False)
    diag: list[dict[str, Any]] = field(default_factory=list)
    best: SelectedEpoch = field(default_factory=SelectedEpoch)
    bar_epsilon: dict[str, str] = field(default_factory=dict)
    pretrain: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.history = RunHistory(self.selection_metric)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps (plain dicts and lists, the format checkpoints have)."""
        return {
            "history": self.history.as_dict(),
            "diag": self.diag,
            "best": self.best.as_dict(),
            "pretrain": self.pretrain,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a checkpoint's history."""
        self.history = RunHistory.from_dict(state["history"])
        self.best = SelectedEpoch.from_dict(state["best"])
        self.diag = state["diag"]
        self.pretrain = state.get("pretrain")


class HistoryHandler:
    """After every step: the step count, the batch's mean loss and the clipping diagnostics."""

    def __init__(self, log: RunLog) -> None:
        self.log = log

    def attach(self, engine: PrivateTrainer) -> None:
        """Attach to a :class:`~dpkfc_med.engines.PrivateTrainer`."""
        engine.add_event_handler(Events.ITERATION_COMPLETED, self)

    def __call__(self, engine: PrivateTrainer) -> None:
        """Record the step just taken."""
        self.log.history.step.append(engine.steps_taken)
        self.log.history.loss.append(engine.state.step_loss)
        popt: Any = engine.optimizer  # the private optimizer when engine.private
        if engine.private and popt.last_diagnostics.batch_units:
            self.log.diag.append(popt.last_diagnostics.as_dict())
