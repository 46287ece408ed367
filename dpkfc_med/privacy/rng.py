"""Random numbers for the private mechanism: seeded for research, OS CSPRNG for production.

Opacus' ``secure_mode`` needs ``torchcsprng``, which is no longer maintained for current
PyTorch. When it is missing we draw the randomness of the mechanism (Poisson sampling and the
Gaussian noise) from the operating system's CSPRNG (``os.urandom``) instead, and keep Opacus'
defence against floating-point attacks (sum of four Gaussians divided by two, after
Holohan & Braghin 2021, as in Opacus' ``_generate_noise``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Sampler

__all__ = ["SecurePoissonSampler", "secure_normal", "secure_uniform"]


def secure_uniform(n: int) -> Tensor:
    """``n`` float64 uniforms in ``[0, 1)`` with 53 random bits each, from ``os.urandom``."""
    if n == 0:
        return torch.zeros(0, dtype=torch.float64)
    words = np.frombuffer(os.urandom(8 * n), dtype=np.uint64) >> np.uint64(11)
    return torch.from_numpy(words.astype(np.float64) * (1.0 / (1 << 53)))


def _secure_standard_normal(shape: tuple[int, ...]) -> Tensor:
    n = math.prod(shape)
    m = (n + 1) // 2
    u1 = 1.0 - secure_uniform(m)  # (0, 1]: log is finite
    u2 = secure_uniform(m)
    r = torch.sqrt(-2.0 * torch.log(u1))
    z = torch.cat([r * torch.cos(2 * math.pi * u2), r * torch.sin(2 * math.pi * u2)])[:n]
    return z.reshape(shape)


def secure_normal(std: float, reference: Tensor) -> Tensor:
    """Gaussian noise shaped like ``reference`` from the OS CSPRNG, float-attack hardened."""
    if std == 0:
        return torch.zeros_like(reference)
    shape = tuple(reference.shape)
    total = torch.stack([_secure_standard_normal(shape) for _ in range(4)]).sum(0)
    noise = std * total / 2  # sum of 4 N(0, s^2) / 2 ~ N(0, s^2)
    return noise.to(device=reference.device, dtype=reference.dtype)


class SecurePoissonSampler(Sampler[list[int]]):
    """Poisson batch sampler driven by the OS CSPRNG.

    Each of ``num_samples`` units enters a batch independently with probability
    ``sample_rate``; ``steps`` batches per epoch.
    """

    def __init__(self, *, num_samples: int, sample_rate: float, steps: int | None = None) -> None:
        self.num_samples = num_samples
        self.sample_rate = sample_rate
        self.steps = steps if steps is not None else int(1 / sample_rate)

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.steps):
            mask = secure_uniform(self.num_samples) < self.sample_rate
            yield mask.nonzero().reshape(-1).tolist()
