"""The lr-schedule handler sets each step's rate to ``lr * factor(step)`` before the step."""

from __future__ import annotations

import math

import pytest
from ignite.engine import Events

from dpkfc_med.engines.handlers import LrScheduleHandler


def _cosine_with_warmup(step: int, total: int, warmup: int) -> float:
    """The schedule written out: linear warm-up, then a half cosine at the step's midpoint."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * min((step - warmup + 0.5) / (total - warmup), 1.0)))


@pytest.mark.parametrize("private", [True, False])
def test_each_step_runs_at_lr_times_the_schedule_factor(trainer, private):
    engine = trainer(private=private, epochs=2)  # 4 steps an epoch, 8 in all
    LrScheduleHandler(lr=0.3, total_steps=8, schedule="cosine", warmup_steps=2).attach(engine)
    seen: list[tuple[int, list[float]]] = []
    engine.add_event_handler(
        Events.ITERATION_STARTED,
        lambda e: seen.append((e.steps_taken, [g["lr"] for g in e.optimizer.param_groups])),
    )
    engine.run()
    assert [s for s, _ in seen] == list(range(8))  # the step about to be taken, 0-based
    for step, rates in seen:
        want = 0.3 * _cosine_with_warmup(step, 8, 2)
        assert rates and all(r == pytest.approx(want, rel=1e-12) for r in rates), step
    assert seen[0][1][0] == pytest.approx(0.15) and seen[-1][1][0] > 0


def test_constant_schedule_after_warmup_and_resumed_step_count(trainer):
    """The factor follows ``steps_taken`` (the ledger's), not the epoch's iteration."""
    engine = trainer(private=True)
    engine.optimizer.steps_taken = 3  # a resumed run: three steps already in the ledger
    LrScheduleHandler(lr=0.5, total_steps=100, schedule="constant", warmup_steps=5).attach(engine)
    rates: list[float] = []
    engine.add_event_handler(
        Events.ITERATION_STARTED, lambda e: rates.append(e.optimizer.param_groups[0]["lr"])
    )
    engine.run()
    assert rates == pytest.approx([0.5 * 4 / 5, 0.5 * 5 / 5, 0.5, 0.5])
