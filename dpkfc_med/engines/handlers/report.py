"""The run's privacy report when it completes, stops early, is interrupted or fails."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ignite.engine import Events

from dpkfc_med.engines.trainer import PrivacyEvents, PrivateTrainer
from dpkfc_med.report.status import RunStatus

__all__ = ["PrivacyReportHandler"]


class PrivacyReportHandler:
    """Write the report at the end of every run, whatever ended it.

    At ``COMPLETED`` the run is ``complete`` when ``finished(engine)`` (all epochs, or the
    plan's steps spent; the :class:`~dpkfc_med.engines.handlers.ModelReleaseHandler` attached
    before it has then released the model); otherwise (``stop_after_epochs``) it is
    ``incomplete``. An interrupt or error writes an ``incomplete`` report of what the ledger
    holds before the exception leaves the trainer.

    Args:
        finish: ``status -> result``: writes the report built from the frozen run record
            (:mod:`dpkfc_med.report.record`); its value is kept in :attr:`result`.
        finished: ``engine -> bool``.
    """

    def __init__(
        self, finish: Callable[[RunStatus], Any], finished: Callable[[PrivateTrainer], bool]
    ) -> None:
        self.finish, self.finished = finish, finished
        self.result: Any = None

    def attach(self, engine: PrivateTrainer) -> None:
        """Attach last: the report sees every other handler's state."""
        engine.add_event_handler(Events.COMPLETED, self.completed)
        engine.add_event_handler(PrivacyEvents.RUN_STOPPED, self.stopped)

    def completed(self, engine: PrivateTrainer) -> None:
        """The run ended normally (all epochs, the plan spent, or a deliberate stop)."""
        done = self.finished(engine)
        self.result = self.finish(RunStatus.COMPLETE if done else RunStatus.INCOMPLETE)

    def stopped(self, engine: PrivateTrainer) -> None:
        """An interrupt or error: what was spent, no evaluation."""
        self.result = self.finish(RunStatus.INCOMPLETE)
