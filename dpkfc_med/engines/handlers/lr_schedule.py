"""The learning-rate schedule, set before every step from the steps taken and the plan."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ignite.engine import Events

from dpkfc_med.engines.schedule import lr_factor

if TYPE_CHECKING:
    from dpkfc_med.engines.trainer import PrivateTrainer

__all__ = ["LrScheduleHandler"]


class LrScheduleHandler:
    """Set every parameter group's learning rate to ``lr * lr_factor(step, total)``.

    The step is the trainer's ``steps_taken`` (the ledger's, resumed runs included), the
    horizon the plan's steps: config and released counts only.
    """

    def __init__(self, lr: float, total_steps: int, schedule: str, warmup_steps: int = 0) -> None:
        self.lr, self.total_steps = lr, total_steps
        self.schedule, self.warmup_steps = schedule, warmup_steps

    def attach(self, engine: PrivateTrainer) -> None:
        """Attach to a trainer."""
        engine.add_event_handler(Events.ITERATION_STARTED, self)

    def __call__(self, engine: PrivateTrainer) -> None:
        """Set the learning rate of the next step."""
        factor = lr_factor(engine.steps_taken, self.total_steps, self.schedule, self.warmup_steps)
        for group in engine.optimizer.param_groups:
            group["lr"] = self.lr * factor
