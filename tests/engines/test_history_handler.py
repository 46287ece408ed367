"""The history handler and the typed run log it writes (series, diagnostics, checkpoint form)."""

from __future__ import annotations

import math

import pytest
from ignite.engine import Events

from dpkfc_med.engines.handlers import HistoryHandler, RunLog
from dpkfc_med.engines.handlers.history import RunHistory, SelectedEpoch


@pytest.mark.parametrize("private", [True, False])
def test_every_step_appends_its_count_and_mean_loss(trainer, private):
    engine = trainer(private=private, epochs=2)
    log = RunLog(selection_metric="auc")
    HistoryHandler(log).attach(engine)
    losses, units = [], []
    engine.add_event_handler(Events.ITERATION_COMPLETED, lambda e: losses.append(e.state.step_loss))
    if private:
        engine.add_event_handler(
            Events.ITERATION_COMPLETED,
            lambda e: units.append(e.optimizer.last_diagnostics.batch_units),
        )
    engine.run()
    assert log.history.step == list(range(1, 9))
    assert log.history.loss == losses and len(losses) == 8
    if private:  # one diagnostics row per non-empty Poisson batch
        assert len(log.diag) == sum(u > 0 for u in units)
        assert [d["batch_units"] for d in log.diag] == [u for u in units if u > 0]
    else:
        assert log.diag == [] and all(math.isfinite(v) for v in losses)


def test_run_log_round_trips_through_its_checkpoint_form():
    log = RunLog(selection_metric="dice")
    log.history.step += [1, 2]
    log.history.loss += [0.7, 0.5]
    log.history.epsilon_step.append(2)
    log.history.val_epoch.append(1)
    log.history.val_metric.append(0.25)
    log.best = SelectedEpoch(1, 0.25, None)
    log.pretrain = {"steps": 3}
    state = log.state_dict()
    assert state["history"] == {
        "step": [1, 2],
        "epsilon_step": [2],
        "loss": [0.7, 0.5],
        "val_epoch": [1],
        "val_metric": [0.25],
        "val_metric_name": "dice",
    }
    assert state["best"] == {"epoch": 1, "metric": 0.25, "state": None}
    state["history"]["step"].append(99)  # a copy: the live series are not the checkpoint's
    assert log.history.step == [1, 2]
    back = RunLog(selection_metric="dice")
    back.load_state_dict(log.state_dict())
    assert back.history == log.history and back.best == log.best and back.pretrain == {"steps": 3}


def test_a_fresh_log_has_empty_series_and_no_selected_epoch():
    log = RunLog(selection_metric="acc")
    assert log.history == RunHistory("acc")
    assert (log.best.epoch, log.best.metric, log.best.state) == (-1, -math.inf, None)
