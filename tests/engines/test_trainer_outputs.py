"""What the private trainer hands a bundle's handlers, for every batch the sampler draws."""

from __future__ import annotations

import math
import warnings

import torch
from ignite.engine import Events
from monai.handlers import StatsHandler, from_engine
from torch import nn

from dpkfc_med.engines import PrivateTrainer


def test_an_empty_poisson_batch_gives_handlers_a_per_sample_loss_they_can_read():
    """Decollated output (MONAI's per-sample list) also for a batch with no sample."""
    net = nn.Linear(3, 2)
    empty = (torch.zeros(0, 3), torch.zeros(0, dtype=torch.int64))
    full = (torch.randn(2, 3), torch.tensor([0, 1]))
    trainer = PrivateTrainer(
        device="cpu",
        max_epochs=1,
        train_data_loader=[full, empty],
        network=net,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
        per_sample_loss=lambda out, y: nn.functional.cross_entropy(out, y, reduction="none"),
        decollate=True,
    )
    seen: list[float] = []
    StatsHandler(name="t", output_transform=from_engine(["loss"], first=True)).attach(trainer)
    trainer.add_event_handler(
        Events.ITERATION_COMPLETED,
        lambda e: seen.append(float(from_engine(["loss"], first=True)(e.state.output))),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # StatsHandler's "ignoring non-scalar output"
        trainer.run()
    assert len(seen) == 2 and math.isfinite(seen[0]) and math.isnan(seen[1])
