"""Exponential moving average of the released weights after every step (post-processing)."""

from __future__ import annotations

from ignite.engine import Events

from dpkfc_med.engines.schedule import WeightAverage
from dpkfc_med.engines.trainer import PrivateTrainer, unwrapped

__all__ = ["WeightAverageHandler"]


class WeightAverageHandler:
    """Update a :class:`~dpkfc_med.engines.schedule.WeightAverage` after every noisy step.

    The average only reads released parameters, so it is post-processing of the mechanism.
    """

    def __init__(self, average: WeightAverage) -> None:
        self.average = average

    def attach(self, engine: PrivateTrainer) -> None:
        """Attach to a trainer."""
        engine.add_event_handler(Events.ITERATION_COMPLETED, self)

    def __call__(self, engine: PrivateTrainer) -> None:
        """Fold the released parameters into the average."""
        self.average.update(unwrapped(engine.network))
