"""The budget-safe checkpoint: what it holds, what a restore brings back, the ledger's say."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from ignite.engine import Events
from torch import nn

from dpkfc_med.engines.handlers import BudgetSafeCheckpointer, HistoryHandler, RunLog
from dpkfc_med.engines.schedule import WeightAverage
from dpkfc_med.engines.trainer import unwrapped
from dpkfc_med.privacy.accounting import PrivacyLedger


def _interrupt_at(step: int):
    def handler(engine) -> None:
        if engine.steps_taken == step:
            raise KeyboardInterrupt

    return handler


def test_restore_brings_back_weights_history_average_and_random_states(trainer, tmp_path):
    path = tmp_path / "checkpoint.pt"
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    engine = trainer(epochs=2, model=model)
    log, average = RunLog(), WeightAverage(model, 0.5)
    HistoryHandler(log).attach(engine)
    BudgetSafeCheckpointer(path, log, model, average).attach(engine)
    engine.run()
    ck = torch.load(path, weights_only=False)
    assert (ck["epoch"], ck["mid_epoch"]) == (2, False)
    assert ck["history"]["step"] == list(range(1, 9)) and ck["engine"]["ledger"] is not None
    with torch.random.fork_rng():  # the checkpoint's random states, drawn after a restore
        state = random.getstate(), np.random.get_state()
        torch.set_rng_state(ck["torch_rng"])
        np.random.set_state(ck["numpy_rng"])
        random.setstate(ck["python_rng"])
        draws = torch.rand(3), np.random.rand(), random.random()
        torch.manual_seed(123)
        fresh_model = nn.Linear(3, 2)
        fresh = trainer(epochs=2, model=fresh_model, seed=1)
        fresh_log, fresh_average = RunLog(), WeightAverage(fresh_model, 0.5)
        epochs = BudgetSafeCheckpointer(path, fresh_log, fresh_model, fresh_average).restore(
            fresh, None, tmp_path / "ledger2.json"
        )
        again = torch.rand(3), np.random.rand(), random.random()
        random.setstate(state[0])
        np.random.set_state(state[1])
    assert torch.equal(draws[0], again[0]) and draws[1:] == again[1:]
    assert epochs == 2 and fresh.state.epoch == 2 and fresh.state.iteration == 8
    for k, v in model.state_dict().items():
        assert torch.equal(fresh_model.state_dict()[k], v), k
        assert torch.equal(fresh_average.module.state_dict()[k], average.module.state_dict()[k])
    assert fresh_log.history == log.history and fresh_average.updates == 0  # no handler: 0
    assert fresh.privacy_engine.ledger.steps == 8 and fresh.steps_taken == 8
    assert PrivacyLedger.load(tmp_path / "ledger2.json").steps == 8


def test_an_interrupt_saves_mid_epoch_and_the_ledger_on_disk_wins(trainer, tmp_path):
    path = tmp_path / "checkpoint.pt"
    engine = trainer(epochs=2)
    model = unwrapped(engine.network)
    checkpointer = BudgetSafeCheckpointer(path, RunLog(), model, None)
    checkpointer.attach(engine)
    engine.add_event_handler(Events.ITERATION_COMPLETED, _interrupt_at(6))
    with pytest.raises(KeyboardInterrupt):
        engine.run()
    ck = torch.load(path, weights_only=False)
    assert (ck["epoch"], ck["mid_epoch"]) == (1, True)  # epoch 2 repeats from its start
    ledger = engine.privacy_engine.ledger
    assert ledger.steps == 6
    ledger.record(ledger.events[-1].sample_rate, 1.0, steps=3)  # spent after the checkpoint
    fresh = trainer(epochs=2, seed=1)
    fresh_model = unwrapped(fresh.network)
    with torch.random.fork_rng():
        state = random.getstate(), np.random.get_state()
        epochs = BudgetSafeCheckpointer(path, RunLog(), fresh_model, None).restore(
            fresh, ledger, tmp_path / "ledger2.json"
        )
        random.setstate(state[0])
        np.random.set_state(state[1])
    assert epochs == 1
    assert fresh.privacy_engine.ledger.steps == fresh.steps_taken == 9  # never under-reports
