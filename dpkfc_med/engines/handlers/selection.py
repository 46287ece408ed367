"""Validation after epochs and the choice of the released epoch (custodian-side)."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from ignite.engine import Events
from torch import nn

from dpkfc_med.engines.handlers.history import RunLog, SelectedEpoch

if TYPE_CHECKING:
    from dpkfc_med.engines.trainer import PrivateTrainer

__all__ = ["EpochSelectionHandler"]

log = logging.getLogger("dpkfc_med")


class EpochSelectionHandler:
    """Validate every ``eval_every`` epochs and at the last one; keep the released weights.

    With ``select_epoch="last"`` the last validated epoch's weights are kept (post-processing:
    the score is not used to choose); with ``"best_val"`` the best-scoring epoch's (a choice on
    private validation data, which the report lists as not covered unless the run is a trial of
    an accounted tuning). The scores are un-noised private statistics: custodian only.

    Args:
        run_log: The run's history (``val_epoch``, ``val_metric``, ``best``).
        evaluate: ``model -> score`` on the validation split.
        released: ``() -> model`` whose weights are validated and released (the weight average
            when one is kept).
        eval_every: Validate every this many epochs.
        select_epoch: ``best_val`` or ``last``.
        finished: ``engine -> bool``, whether this epoch is the run's last (epochs done or the
            plan's steps spent).
    """

    def __init__(
        self,
        run_log: RunLog,
        evaluate: Callable[[nn.Module], float],
        released: Callable[[], nn.Module],
        eval_every: int,
        select_epoch: str,
        finished: Callable[[PrivateTrainer], bool],
    ) -> None:
        self.run_log, self.evaluate, self.released = run_log, evaluate, released
        self.eval_every, self.select_epoch, self.finished = eval_every, select_epoch, finished

    def attach(self, engine: PrivateTrainer) -> None:
        """Attach to a trainer (before the checkpoint handler, which saves the choice)."""
        engine.add_event_handler(Events.EPOCH_COMPLETED, self)

    def __call__(self, engine: PrivateTrainer) -> None:
        """Validate at this epoch's end when due, and keep the selected weights."""
        epoch = engine.state.epoch
        if epoch % self.eval_every != 0 and not self.finished(engine):
            return
        model = self.released()
        value = self.evaluate(model)
        history, best = self.run_log.history, self.run_log.best
        history.val_epoch.append(epoch)
        history.val_metric.append(value)
        name = history.val_metric_name
        engine.state.metrics[name if name.startswith("val") else f"val_{name}"] = value
        log.info("epoch %d: val %s = %.4f", epoch, name, value)
        latest = self.select_epoch == "last"
        if latest or not (value <= best.metric):  # nan-safe: first is kept
            self.run_log.best = SelectedEpoch(epoch, value, copy.deepcopy(model.state_dict()))
