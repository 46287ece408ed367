"""Learning-rate schedules and the weight average: functions of step counts and released weights.

Both are post-processing under differential privacy. The schedule reads only the step index
and the config (``training.lr``, ``training.lr_schedule``, ``training.warmup_steps``) and the
planned number of steps; the average reads only the parameters after each noisy step, which
the mechanism releases anyway.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import nn

__all__ = ["WeightAverage", "lr_factor"]


def lr_factor(step: int, total_steps: int, schedule: str, warmup_steps: int = 0) -> float:
    """Multiplier of the base learning rate for the optimizer step with 0-based index ``step``.

    Args:
        step: index of the step about to be taken (0 for the first).
        total_steps: steps the run plans in all (the privacy plan's step count).
        schedule: ``"constant"`` or ``"cosine"`` (half cosine from 1 down to 0 at
            ``total_steps``).
        warmup_steps: linear warm-up: step ``t < warmup_steps`` gets ``(t + 1) / warmup_steps``.

    Returns:
        The factor in ``(0, 1]`` (a cosine schedule's last steps approach 0 but stay > 0).

    Raises:
        ValueError: unknown ``schedule``.
    """
    if schedule not in ("constant", "cosine"):
        raise ValueError(f"lr schedule {schedule!r}: choose constant or cosine")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    span = max(total_steps - warmup_steps, 1)
    # evaluated at the middle of the step's interval so the last step keeps a positive rate
    progress = min((step - warmup_steps + 0.5) / span, 1.0)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


class WeightAverage:
    """Exponential moving average of a network's weights, kept in a separate copy of it.

    After step ``t`` (1-based) the average moves toward the weights with rate ``1 - d_t``,
    ``d_t = min(decay, (1 + t) / (10 + t))``: the warm-up keeps the first steps from being
    dominated by the initial weights. Floating-point buffers (normalisation statistics) are
    averaged the same way; integer buffers are copied.

    Args:
        model: the network to average; copied at construction (before any wrapper hooks it).
        decay: the long-run decay ``d`` in ``(0, 1)``.
    """

    def __init__(self, model: nn.Module, decay: float) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay={decay!r} must be in (0, 1)")
        self.decay = float(decay)
        self.module = copy.deepcopy(model)
        self.module.requires_grad_(False)
        self.updates = 0

    def rate(self, t: int) -> float:
        """The decay ``d_t`` used at update ``t`` (1-based)."""
        return min(self.decay, (1.0 + t) / (10.0 + t))

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Move the average toward ``model``'s current weights (call after every step)."""
        self.updates += 1
        d = self.rate(self.updates)
        avg = self.module.state_dict()
        for name, value in model.state_dict().items():
            target = avg[name]
            if target.is_floating_point():
                target.mul_(d).add_(value.detach().to(target.dtype), alpha=1.0 - d)
            else:
                target.copy_(value)

    def state_dict(self) -> dict[str, Any]:
        """Averaged weights and the update count (for checkpoints)."""
        return {"module": self.module.state_dict(), "updates": self.updates, "decay": self.decay}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.module.load_state_dict(state["module"])
        self.updates = int(state["updates"])
        self.decay = float(state["decay"])
