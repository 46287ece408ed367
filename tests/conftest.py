"""Shared fixtures: tiny 2D/3D nets, a deterministic probe source, thread limits."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

# pytest-xdist runs two workers (pyproject addopts): one thread each, so they share the two
# cores instead of oversubscribing them.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1) // _WORKERS))

SHARED_DATA = os.environ.get(
    "DPKFC_MED_DATA", os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data")
)


class GaussianProbes:
    """Minimal probe source for engine tests (real probe generators are tested separately)."""

    def __init__(self, shape: tuple[int, ...], num_classes: int = 2) -> None:
        self.shape, self.num_classes = shape, num_classes

    def sample(self, num, *, seed, model=None, device=None, dtype=torch.float32):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(num, *self.shape, generator=g).to(device=device, dtype=dtype)
        y = torch.randint(0, self.num_classes, (num,), generator=g).to(device)
        return x, y

    def describe(self):
        return {"kind": "gaussian-test"}


def per_sample_ce(outputs, targets):
    return F.cross_entropy(outputs, targets, reduction="none")


def tiny_cnn_2d(num_classes: int = 3) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, stride=2, padding=1),
        nn.Tanh(),
        nn.Conv2d(4, 6, 3, padding=1, bias=False),
        nn.GroupNorm(2, 6),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(6 * 4 * 4, num_classes),
    )


def tiny_cnn_3d(num_classes: int = 2) -> nn.Module:
    return nn.Sequential(
        nn.Conv3d(1, 3, 3, stride=2, padding=1),
        nn.Tanh(),
        nn.Conv3d(3, 4, 2, stride=2, bias=False),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(4 * 1 * 2 * 2, num_classes),
    )


@pytest.fixture
def float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def summed_clipped(popt, backward, units=None) -> torch.Tensor:
    """Sum of transformed, per-unit clipped gradients before noise (the DP sensitivity target).

    ``backward()`` runs the forward/backward pass of one batch; ``units`` are its unit ids.
    """
    popt.zero_grad()
    backward()
    popt.set_unit_ids(units)
    for p in popt.params:
        p.summed_grad = None
    popt.clip_and_accumulate()
    out = torch.cat([p.summed_grad.flatten() for p in popt.params])
    popt.zero_grad()
    return out
