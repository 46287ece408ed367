"""The epoch-selection handler: validation on schedule and the released epoch's weights."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
from ignite.engine import Events

from dpkfc_med.engines.handlers import EpochSelectionHandler, RunLog
from dpkfc_med.engines.trainer import unwrapped


def _attach(engine, scores: list[float], **kw) -> tuple[RunLog, list[dict[str, torch.Tensor]]]:
    """Selection with scripted scores; the weights at every epoch's end kept beside it."""
    log = RunLog(selection_metric=kw.pop("metric", "dice"))
    it: Iterator[float] = iter(scores)
    model = unwrapped(engine.network)
    weights: list[dict[str, torch.Tensor]] = []
    engine.add_event_handler(
        Events.EPOCH_COMPLETED,
        lambda e: weights.append({k: v.clone() for k, v in model.state_dict().items()}),
    )
    EpochSelectionHandler(
        log,
        evaluate=lambda m: next(it),
        released=lambda: model,
        eval_every=kw.pop("eval_every", 1),
        select_epoch=kw.pop("select_epoch", "best_val"),
        finished=lambda e: e.state.epoch >= e.state.max_epochs,
    ).attach(engine)
    return log, weights


def test_best_val_keeps_the_best_epochs_weights(trainer):
    engine = trainer(epochs=3)
    log, weights = _attach(engine, [0.5, 0.9, 0.7])
    engine.run()
    assert (log.history.val_epoch, log.history.val_metric) == ([1, 2, 3], [0.5, 0.9, 0.7])
    assert (log.best.epoch, log.best.metric) == (2, 0.9)
    assert log.best.state is not None
    for k, v in log.best.state.items():
        torch.testing.assert_close(v, weights[1][k], rtol=0, atol=0)
    assert engine.state.metrics["val_dice"] == 0.7  # the last validation's score


def test_last_keeps_the_last_validated_epoch_whatever_its_score(trainer):
    engine = trainer(epochs=3, private=False)
    log, weights = _attach(engine, [0.9, 0.5, 0.1], select_epoch="last")
    engine.run()
    assert (log.best.epoch, log.best.metric) == (3, 0.1)
    for k, v in log.best.state.items():
        torch.testing.assert_close(v, weights[2][k], rtol=0, atol=0)


def test_every_second_epoch_and_the_last_are_validated(trainer):
    engine = trainer(epochs=5, private=False, batch_size=8)
    log, _ = _attach(engine, [0.1, 0.2, 0.3], eval_every=2, metric="val_loss_neg")
    engine.run()
    assert log.history.val_epoch == [2, 4, 5]
    assert engine.state.metrics["val_loss_neg"] == 0.3  # a name starting with val kept as is


@pytest.mark.parametrize("first", [math.nan, -math.inf])
def test_a_nan_or_minus_inf_first_score_gives_way_to_the_next(trainer, first):
    engine = trainer(epochs=2, private=False, batch_size=8)
    log, _ = _attach(engine, [first, 0.3])
    engine.run()
    assert log.best.epoch == 2 and log.best.metric == 0.3
