"""Learning-rate schedule and weight average: closed forms and their use in a training run."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from dpkfc_med.engines.schedule import WeightAverage, lr_factor


def test_constant_and_warmup_factors():
    assert [lr_factor(t, 10, "constant") for t in range(10)] == [1.0] * 10
    assert [lr_factor(t, 10, "constant", warmup_steps=4) for t in range(6)] == [
        0.25,
        0.5,
        0.75,
        1.0,
        1.0,
        1.0,
    ]
    with pytest.raises(ValueError, match="cosine"):
        lr_factor(0, 10, "linear")


def test_cosine_factor_is_the_half_cosine_at_step_midpoints():
    total, warm = 40, 5
    got = np.array([lr_factor(t, total, "cosine", warm) for t in range(total)])
    t = np.arange(warm, total)
    expected = 0.5 * (1 + np.cos(np.pi * (t - warm + 0.5) / (total - warm)))
    np.testing.assert_allclose(got[warm:], expected, rtol=0, atol=1e-15)
    np.testing.assert_allclose(got[:warm], (np.arange(warm) + 1) / warm)
    assert np.all(np.diff(got[warm:]) < 0) and got[-1] > 0
    assert got[warm:].mean() == pytest.approx(0.5, abs=1e-12)  # symmetric about 1/2


def test_weight_average_equals_the_explicit_weighted_sum(float64):
    """After T updates the average is prod(d) w_0 + sum_t (1 - d_t) prod_{s>t} d_s w_t."""
    torch.manual_seed(0)
    net = nn.Linear(3, 2)
    avg = WeightAverage(net, decay=0.9)
    snapshots = [torch.cat([p.detach().flatten().clone() for p in net.parameters()])]
    for _ in range(25):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn_like(p))
        snapshots.append(torch.cat([p.detach().flatten().clone() for p in net.parameters()]))
        avg.update(net)
    d = [min(0.9, (1 + t) / (10 + t)) for t in range(1, 26)]
    expected = math.prod(d) * snapshots[0]
    for t in range(1, 26):
        expected = expected + (1 - d[t - 1]) * math.prod(d[t:]) * snapshots[t]
    got = torch.cat([p.flatten() for p in avg.module.parameters()])
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    assert not any(p.requires_grad for p in avg.module.parameters())
    clone = WeightAverage(nn.Linear(3, 2), decay=0.5)
    clone.load_state_dict(avg.state_dict())
    assert clone.updates == 25 and clone.decay == 0.9
    for a, b in zip(clone.module.parameters(), avg.module.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="decay"):
        WeightAverage(net, decay=1.0)
