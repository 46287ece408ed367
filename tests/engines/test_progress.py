"""The progress bar owns its console line: log lines of other libraries print above it."""

from __future__ import annotations

import io
import logging
import sys
from types import SimpleNamespace

from dpkfc_med.engines.handlers.history import RunLog
from dpkfc_med.engines.handlers.progress import ProgressBarHandler


def _engine():
    state = SimpleNamespace(epoch_length=2, epoch=1, max_epochs=1, step_samples=3, step_loss=1.0)
    return SimpleNamespace(state=state)


def test_console_log_lines_go_through_the_bar_while_it_is_open(monkeypatch):
    console = io.StringIO()
    monkeypatch.setattr(sys, "stderr", console)
    logger = logging.getLogger("monai_like_stats")
    logger.propagate = False  # its own console handler only, as MONAI's StatsHandler logger
    handler = logging.StreamHandler(sys.stderr)
    logger.addHandler(handler)
    try:
        bar = ProgressBarHandler(RunLog(), enabled=True)
        engine = _engine()
        bar.open(engine)
        assert handler not in logger.handlers  # replaced by tqdm's writer for the epoch
        logger.warning("Epoch: 1/1, Iter: 1/2 -- train_loss: 1.0")
        bar.update(engine)
        bar.close(engine)
        assert logger.handlers == [handler]  # restored after the epoch
        lines = console.getvalue().replace("\r", "\n").splitlines()
        logged = [line for line in lines if "train_loss" in line]
        assert logged == ["Epoch: 1/1, Iter: 1/2 -- train_loss: 1.0"]  # a line of its own
    finally:
        logger.removeHandler(handler)


def test_a_disabled_bar_leaves_the_loggers_alone():
    logger = logging.getLogger("monai_like_stats_off")
    handler = logging.StreamHandler(sys.stderr)
    logger.addHandler(handler)
    try:
        bar = ProgressBarHandler(RunLog(), enabled=False)
        bar.open(_engine())
        assert logger.handlers == [handler]
        bar.close(_engine())
    finally:
        logger.removeHandler(handler)
