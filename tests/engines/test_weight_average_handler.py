"""The weight-average handler: an exponential moving average of the released weights."""

from __future__ import annotations

import torch
from ignite.engine import Events
from torch import nn

from dpkfc_med.engines.handlers import WeightAverageHandler
from dpkfc_med.engines.schedule import WeightAverage
from dpkfc_med.engines.trainer import unwrapped


def test_average_equals_the_brute_force_ema_of_every_step(trainer):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    average = WeightAverage(model, decay=0.6)
    engine = trainer(private=True, epochs=2, model=model)
    WeightAverageHandler(average).attach(engine)
    after: list[dict[str, torch.Tensor]] = []
    engine.add_event_handler(
        Events.ITERATION_COMPLETED,
        lambda e: after.append(
            {k: v.clone() for k, v in unwrapped(e.network).state_dict().items()}
        ),
    )
    engine.run()
    assert len(after) == 8 and average.updates == 8
    want = {k: v.double() for k, v in initial.items()}
    for t, weights in enumerate(after, start=1):
        d = min(0.6, (1 + t) / (10 + t))
        want = {k: d * want[k] + (1 - d) * weights[k].double() for k in want}
    for k, v in average.module.state_dict().items():
        torch.testing.assert_close(v.double(), want[k], msg=k)
    assert not torch.equal(average.module.weight, model.weight)  # a separate copy


def test_the_average_reads_the_network_inside_the_per_sample_wrapper(trainer):
    engine = trainer(private=True)
    model = unwrapped(engine.network)
    assert model is not engine.network  # Opacus' GradSampleModule
    average = WeightAverage(model, decay=0.9)
    WeightAverageHandler(average).attach(engine)
    engine.run()
    assert set(average.module.state_dict()) == set(model.state_dict()) == {"weight", "bias"}
