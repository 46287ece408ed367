"""Adapters and Opacus grad samplers registered after import reach the per-sample hooks."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from opacus.grad_sample import GradSampleModule, register_grad_sampler
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpkfc_med.curvature import adapters
from dpkfc_med.curvature.preconditioner import PreconditionerConfig
from dpkfc_med.privacy.engine import PrivacyEngine
from tests.conftest import GaussianProbes, per_sample_ce


class LateLinear(nn.Linear):
    """A Linear subclass: adapters match exact types, so it is uncovered until registered."""


class Shift(nn.Module):
    """A leaf with a raw parameter and a grad sampler registered below, after import."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.shift = nn.Parameter(torch.zeros(n))

    def forward(self, x):
        return x + self.shift


calls = {"shift": 0}


@register_grad_sampler(Shift)
def _shift_grad_sample(module, activations, backprops):
    calls["shift"] += 1
    return {module.shift: backprops}


def _make_private(model, x, y):
    eng = PrivacyEngine(seed=0)
    out = eng.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=8),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        delta=1e-5,
        method="dp-kfc",
        probe_source=GaussianProbes((6,), num_classes=3),
        probe_loss=per_sample_ce,
        preconditioner=PreconditionerConfig(factors="ag", rank_a=None, num_probes=16),
        loss_reduction="sum",
    )
    return eng, out


def test_adapter_and_sampler_registered_after_import_are_used(float64, monkeypatch):
    monkeypatch.setitem(adapters._ADAPTERS, LateLinear, adapters.LINEAR)
    torch.manual_seed(0)
    model = nn.Sequential(Shift(6), LateLinear(6, 3))
    reference = copy.deepcopy(model)
    x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))
    eng, (pm, popt, _) = _make_private(model, x, y)
    block = eng.preconditioner.blocks["1"]  # the LateLinear got a K-FAC block
    assert type(block.module) is LateLinear
    calls["shift"] = 0
    F.cross_entropy(pm(x), y, reduction="sum").backward()
    assert calls["shift"] == 1  # Opacus' table was read after the registration
    raw = torch.stack(
        [
            torch.cat(
                [
                    g.flatten()
                    for g in torch.autograd.grad(
                        F.cross_entropy(reference(x[i : i + 1]), y[i : i + 1], reduction="sum"),
                        [reference[1].weight, reference[1].bias],
                    )
                ]
            )
            for i in range(5)
        ]
    )
    # the transform the hook applied equals the block's own transform of the true gradients
    w, b = raw[:, :18].reshape(5, 3, 6), raw[:, 18:]
    expected = block.transform_grads(torch.cat([w, b.unsqueeze(-1)], -1).unsqueeze(1))
    got = torch.cat([model[1].weight.grad_sample, model[1].bias.grad_sample.unsqueeze(-1)], -1)
    torch.testing.assert_close(got, expected[:, 0])
    block_scale = eng.preconditioner.fallbacks["0.shift"].scale
    expected_shift = torch.stack(
        [
            torch.autograd.grad(
                F.cross_entropy(reference(x[i : i + 1]), y[i : i + 1], reduction="sum"),
                reference[0].shift,
            )[0]
            for i in range(5)
        ]
    )
    # the raw per-sample gradient; the fallback scale is applied with the other transforms
    # in the optimizer
    torch.testing.assert_close(model[0].shift.grad_sample, expected_shift)
    assert block_scale > 0
    assert Shift in GradSampleModule.GRAD_SAMPLERS
