"""The report handler: one report at the end of every run, whatever ended it, seen last."""

from __future__ import annotations

import pytest
from ignite.engine import Events

from dpkfc_med.engines.handlers import HistoryHandler, PrivacyReportHandler, RunLog


def _reporter(engine, finished=lambda e: e.state.epoch >= e.state.max_epochs):
    calls: list[tuple[str, int]] = []

    def finish(status: str) -> str:
        calls.append((status, engine.steps_taken))
        return f"result {len(calls)}"

    log = RunLog()
    HistoryHandler(log).attach(engine)
    reporter = PrivacyReportHandler(finish, finished)
    reporter.attach(engine)  # last, as a run attaches it
    return reporter, calls, log


def test_a_finished_run_is_complete_and_reported_once(trainer):
    engine = trainer(epochs=2)
    reporter, calls, log = _reporter(engine)
    engine.run()
    assert calls == [("complete", 8)] and reporter.result == "result 1"
    assert log.history.step[-1] == 8  # the other handlers' state was final when it ran


def test_a_deliberate_stop_before_the_last_epoch_is_incomplete(trainer):
    engine = trainer(epochs=3)
    reporter, calls, _ = _reporter(engine)
    engine.add_event_handler(Events.EPOCH_COMPLETED(once=1), lambda e: e.terminate())
    engine.run()
    assert calls == [("incomplete", 4)]


@pytest.mark.parametrize("stop", [KeyboardInterrupt, RuntimeError])
def test_an_interrupt_or_error_reports_what_was_spent_then_raises(trainer, stop):
    engine = trainer(epochs=2)
    reporter, calls, _ = _reporter(engine)

    def fail(e) -> None:
        if e.steps_taken == 3:
            raise stop("stop")

    engine.add_event_handler(Events.ITERATION_COMPLETED, fail)
    with pytest.raises(stop):
        engine.run()
    assert calls == [("incomplete", 3)] and reporter.result == "result 1"
    assert engine.privacy_engine.ledger.steps == 3
