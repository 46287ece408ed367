"""A progress bar per epoch: loss, the spent epsilon and images per second."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from ignite.engine import Events

from dpkfc_med.engines.handlers.history import RunLog
from dpkfc_med.engines.trainer import PrivacyEvents, PrivateTrainer

__all__ = ["ProgressBarHandler"]

log = logging.getLogger("dpkfc_med")


class ProgressBarHandler:
    """A tqdm bar over each epoch's steps, its postfix the loss, epsilon fields and img/s.

    Args:
        log: The run's history (its ``bar_epsilon`` fields are shown).
        enabled: ``training.progress``; off, only the log's epoch lines remain.
    """

    def __init__(self, run_log: RunLog, enabled: bool = True) -> None:
        self.run_log, self.enabled = run_log, enabled
        self.bar: Any = None
        self.t0, self.seen = 0.0, 0
        self._redirect: Any = None

    def attach(self, engine: PrivateTrainer) -> None:
        """Attach to a trainer."""
        engine.add_event_handler(Events.EPOCH_STARTED, self.open)
        engine.add_event_handler(Events.ITERATION_COMPLETED, self.update)
        engine.add_event_handler(Events.EPOCH_COMPLETED, self.close)
        engine.add_event_handler(Events.TERMINATE, self.close)
        engine.add_event_handler(PrivacyEvents.RUN_STOPPED, self.close)

    def open(self, engine: PrivateTrainer) -> None:
        """A fresh bar for the epoch."""
        from tqdm import tqdm

        self.t0, self.seen = time.perf_counter(), 0
        if self.enabled and self._redirect is None:
            # console log lines (a bundle's StatsHandler, MONAI's) print above the bar, not
            # into its line: tqdm's own redirection of every logger that writes to the console
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._redirect = logging_redirect_tqdm(loggers=_console_loggers())
            self._redirect.__enter__()
        self.bar = tqdm(
            total=engine.state.epoch_length,
            desc=f"epoch {engine.state.epoch}/{engine.state.max_epochs}",
            disable=not self.enabled,
            leave=False,
            dynamic_ncols=True,
        )

    def update(self, engine: PrivateTrainer) -> None:
        """One step done."""
        self.seen += engine.state.step_samples
        loss = engine.state.step_loss
        rate = self.seen / max(time.perf_counter() - self.t0, 1e-9)
        if self.bar is not None:
            self.bar.set_postfix(
                loss=f"{loss:.3f}", **self.run_log.bar_epsilon, img_s=f"{rate:.0f}"
            )
            self.bar.update(1)

    def close(self, engine: PrivateTrainer) -> None:
        """Close the bar; one line in the log."""
        if self.bar is None:
            return
        self.bar.close()
        self.bar = None
        if self._redirect is not None:
            self._redirect.__exit__(None, None, None)
            self._redirect = None
        log.info(
            "epoch %d done: %d samples, %.1f s",
            engine.state.epoch,
            self.seen,
            time.perf_counter() - self.t0,
        )


def _console_loggers() -> list[logging.Logger]:
    """The root logger and every logger with a handler writing to the console."""
    found = [logging.getLogger()]
    for logger in list(logging.Logger.manager.loggerDict.values()):
        if isinstance(logger, logging.Logger) and any(
            isinstance(h, logging.StreamHandler) and getattr(h, "stream", None) in (
                sys.stdout, sys.stderr
            )
            for h in logger.handlers
        ):  # fmt: skip
            found.append(logger)
    return found
