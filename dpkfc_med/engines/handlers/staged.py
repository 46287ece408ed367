"""Staged fine-tuning of public weights: the head learns alone first, then the rest joins."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ignite.engine import Events
from torch import nn

from dpkfc_med.models.finetune import parametrised_modules

if TYPE_CHECKING:
    from dpkfc_med.engines.trainer import PrivateTrainer

__all__ = ["HeadFirstHandler", "head_parameters"]


def head_parameters(model: nn.Module, last: int) -> list[nn.Parameter]:
    """The trainable parameters of the last ``last`` modules that have trainable ones.

    Registration order, as ``training.finetune: last_layers`` counts modules (norm layers
    count); only parameters that train in the run's fine-tuning mode are candidates.
    """
    if last < 1:
        raise ValueError(f"training.finetune_last={last}: must be at least 1")
    mods = [
        m
        for _, m in parametrised_modules(model)
        if any(p.requires_grad for p in m.parameters(recurse=False))
    ]
    return [p for m in mods[-last:] for p in m.parameters(recurse=False) if p.requires_grad]


class HeadFirstHandler:
    """For the first ``epochs`` epochs only ``head`` learns; afterwards every trainable one.

    With a private optimizer the others are *held* (``optimizer.hold``): each step still
    clips every unit's gradient to ``C`` and adds the planned noise, over the parameters that
    learn at that step, so the ledger and the privacy plan are the run's. With a plain
    optimizer (non-private runs) the others' ``requires_grad`` is off for the first stage.
    The stage follows the trainer's epoch, so a resumed run continues in the right one.
    """

    def __init__(self, model: nn.Module, head: Sequence[nn.Parameter], epochs: int) -> None:
        self.epochs = epochs
        heads = {id(p) for p in head}
        self.others = [p for p in model.parameters() if p.requires_grad and id(p) not in heads]
        self.held = frozenset(id(p) for p in self.others)

    def attach(self, engine: PrivateTrainer) -> None:
        """Attach to a trainer."""
        engine.add_event_handler(Events.ITERATION_STARTED, self)

    def first_stage(self, epoch: int) -> bool:
        """Whether ``epoch`` (1-based) belongs to the head-only stage."""
        return epoch <= self.epochs

    def __call__(self, engine: PrivateTrainer) -> None:
        """Hold or release the non-head parameters for the coming step."""
        first = self.first_stage(engine.state.epoch)
        opt = engine.optimizer
        if hasattr(opt, "hold"):
            opt.hold = self.held if first else frozenset()
        else:
            for p in self.others:
                p.requires_grad_(not first)
