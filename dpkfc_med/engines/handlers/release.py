"""Model release when a run completes with all its steps: the selected weights, evaluated."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ignite.engine import Events

from dpkfc_med.engines.trainer import PrivateTrainer

__all__ = ["ModelReleaseHandler"]


class ModelReleaseHandler:
    """Release the selected model at ``COMPLETED`` when the run is finished.

    A run is released only when ``finished(engine)`` (every epoch done, or the plan's steps
    spent): not after a deliberate early stop (``stop_after_epochs``), an interrupt or an error.
    Every step the model carries is in the ledger before it is taken (the ledger file is
    rewritten before every noisy update), so the spend is on disk before the model is. Attach
    before :class:`~dpkfc_med.engines.handlers.PrivacyReportHandler`: the report lists the
    release's metrics (:attr:`metrics`), and is written after the model.

    Args:
        release: ``() -> metrics``: evaluates the selected weights and writes the model
            (``model.pt``) and the custodian's metrics.
        finished: ``engine -> bool``.
    """

    def __init__(
        self,
        release: Callable[[], dict[str, Any]],
        finished: Callable[[PrivateTrainer], bool],
    ) -> None:
        self.release, self.finished = release, finished
        self.metrics: dict[str, Any] | None = None

    def attach(self, engine: PrivateTrainer) -> None:
        """Attach before the report handler."""
        engine.add_event_handler(Events.COMPLETED, self.completed)

    def completed(self, engine: PrivateTrainer) -> None:
        """The run ended normally: release it when it is finished."""
        if self.finished(engine):
            self.metrics = self.release()
