"""The budget handler: the spent epsilon after every step, its exact listing, the plan's stop."""

from __future__ import annotations

import pytest

from dpkfc_med.engines.handlers import PrivacyBudgetHandler, RunLog
from dpkfc_med.privacy.accounting import rdp_epsilon
from dpkfc_med.report.numbers import format_epsilon


def test_the_run_stops_at_the_planned_step_and_lists_every_step_under_rdp(trainer):
    engine = trainer(epochs=3)  # 12 steps possible
    log = RunLog()
    budget = PrivacyBudgetHandler(log, planned_steps=6)
    budget.attach(engine)
    engine.run()
    ledger = engine.privacy_engine.ledger
    assert ledger.steps == engine.steps_taken == 6 and budget.exhausted(engine)
    assert engine.state.epoch == 2  # the second epoch ended at the plan, no third began
    assert log.history.epsilon_step == [1, 2, 3, 4, 5, 6]  # RDP: every step
    rdp = rdp_epsilon(ledger.events, ledger.delta)
    assert engine.state.metrics["epsilon_rdp"] == rdp
    assert engine.state.metrics["epsilon"] == pytest.approx(engine.privacy_engine.get_epsilon())
    assert log.bar_epsilon == {"eps_rdp": format_epsilon(rdp)}


def test_a_geometric_accountant_lists_powers_of_two_and_epoch_ends(trainer, monkeypatch):
    engine = trainer(epochs=3, accountant="prv", batch_size=2)  # 8 steps an epoch
    pe = engine.privacy_engine
    asked: list[int] = []

    def epsilon() -> float:  # PRV's figures are the accountant tests' (0.5 s a call)
        asked.append(pe.ledger.steps)
        return 0.1 * pe.ledger.steps

    monkeypatch.setattr(pe, "get_epsilon", epsilon)
    log = RunLog()
    PrivacyBudgetHandler(log, planned_steps=11).attach(engine)
    engine.run()
    assert engine.steps_taken == 11 and engine.state.epoch == 2
    # steps 1, 2, 4, 8 on the grid (8 also ends epoch 1); 11: the plan's last, at its stop
    assert log.history.epsilon_step == asked == [1, 2, 4, 8, 11]
    assert engine.state.metrics["epsilon"] == pytest.approx(1.1)
    assert log.bar_epsilon["eps_prv"] == f"{format_epsilon(1.1)}@11"
    assert set(log.bar_epsilon) == {"eps_rdp", "eps_prv"}


def test_a_resumed_run_already_spent_takes_no_step(trainer):
    engine = trainer(epochs=1)
    engine.optimizer.steps_taken = 5
    PrivacyBudgetHandler(RunLog(), planned_steps=5).attach(engine)
    engine.run()
    assert engine.privacy_engine.ledger.steps == 0  # the plan was spent before this run
