"""Data-free pretraining: non-private steps on synthetic shape volumes before private training.

The synthetic task is "segment smooth blobs of distinct intensity": each volume is a label map
of random smooth foreground blobs (:func:`~dpkfc_med.probes.sources.shape_label_maps`) and an
image in which class ``c`` sits ``c`` random contrast steps from the background, plus power-law
texture, standardised like the private volumes' preprocessing. It is generated on the fly from
a seed and the config (patch size, voxel spacing, class count, the modality preset's exponent)
only, so pretraining reads no private data, costs no privacy, and the run's guarantee is
unchanged; the report records it as provenance of the initial weights.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from dpkfc_med.probes.noise import pink_noise
from dpkfc_med.probes.sources import shape_label_maps

__all__ = ["PretrainSpec", "pretrain_synthetic", "synthetic_shapes"]

log = logging.getLogger(__name__)

TEXTURE_AMPLITUDE = 0.5
"""Standard deviation of the texture relative to the spread of the class intensities."""


def synthetic_shapes(
    spatial_shape: Sequence[int],
    *,
    num: int,
    num_classes: int,
    spacing: Sequence[float],
    alpha: float,
    generator: torch.Generator,
    foreground: tuple[float, float] = (0.03, 0.25),
) -> tuple[Tensor, Tensor]:
    """``num`` synthetic image/label pairs for segmentation pretraining.

    Args:
        spatial_shape: ``(D, H, W)`` (or any number of spatial axes).
        num: volumes to draw.
        num_classes: ``K`` including the background (class 0).
        spacing: voxel spacing per axis (the fields' smoothness is isotropic in mm).
        alpha: exponent of the image texture's power spectrum (the modality preset's).
        generator: the CPU generator that draws everything.
        foreground: range of the foreground fraction of a volume (drawn uniformly per volume).

    Returns:
        ``(images [num, 1, *S] float32, labels [num, *S] int64)``; every volume holds every
        foreground class only by chance, background always.
    """
    shape = tuple(int(s) for s in spatial_shape)
    spacing = tuple(float(s) for s in spacing)
    labels = shape_label_maps(
        shape,
        num=num,
        num_classes=num_classes,
        spacing=spacing,
        generator=generator,
        foreground=foreground,
    )
    # Class c sits c contrast steps from the background: a random step size and sign per
    # volume, so the classes are told apart by their ordering, not by one fixed intensity.
    step = 0.5 + torch.rand(num, 1, generator=generator, dtype=torch.float32)
    sign = torch.where(torch.rand(num, 1, generator=generator) < 0.5, -1.0, 1.0).double()
    means = sign * step * torch.arange(num_classes, dtype=torch.float32)
    image = torch.gather(means, 1, labels.flatten(1)).view(num, *shape)
    texture = pink_noise(
        shape, batch=num, alpha=alpha, spacing=spacing, generator=generator, dtype=torch.float32
    )[:, 0]
    image = image + TEXTURE_AMPLITUDE * texture
    dims = tuple(range(1, image.dim()))
    image = (image - image.mean(dims, keepdim=True)) / image.std(dims, keepdim=True).clamp_min(1e-6)
    return image.unsqueeze(1).float(), labels


@dataclass(frozen=True)
class PretrainSpec:
    """What data-free pretraining runs (all from the config).

    Attributes:
        steps: optimizer steps (0 = no pretraining).
        batch_size: synthetic volumes per step.
        lr: Adam learning rate.
        seed: seed of the synthetic data (step ``t`` draws with ``seed + t``).
    """

    steps: int
    batch_size: int
    lr: float
    seed: int

    def describe(
        self, spatial_shape: Sequence[int], alpha: float, seconds: float
    ) -> dict[str, Any]:
        """Provenance record for the privacy report."""
        return {
            "data": "synthetic shape volumes generated from the config (no private or public "
            "data; no privacy cost)",
            "steps": self.steps,
            "batch_size": self.batch_size,
            "optimizer": "adam",
            "lr": self.lr,
            "seed": self.seed,
            "spatial_shape": list(spatial_shape),
            "texture_alpha": alpha,
            "seconds": round(seconds, 1),
        }


def pretrain_synthetic(
    model: nn.Module,
    spec: PretrainSpec,
    *,
    loss: Callable[[Tensor, Tensor], Tensor],
    spatial_shape: Sequence[int],
    num_classes: int,
    spacing: Sequence[float],
    alpha: float,
    device: torch.device,
) -> dict[str, Any]:
    """Train ``model`` in place on :func:`synthetic_shapes` batches; returns the provenance.

    Deterministic for a given ``spec`` and initial model (the data come from seeded CPU
    generators). The model is left in training mode.
    """
    t0 = time.perf_counter()
    opt = torch.optim.Adam(model.parameters(), lr=spec.lr)
    model.train()
    last = float("nan")
    for step in range(spec.steps):
        g = torch.Generator().manual_seed(spec.seed + step)
        x, y = synthetic_shapes(
            spatial_shape,
            num=spec.batch_size,
            num_classes=num_classes,
            spacing=spacing,
            alpha=alpha,
            generator=g,
        )
        opt.zero_grad(set_to_none=True)
        out = loss(model(x.to(device)), y.to(device))
        out.backward()
        opt.step()
        last = float(out.detach())
    seconds = time.perf_counter() - t0
    log.info(
        "data-free pretraining: %d steps on synthetic shapes, last loss %.3f, %.1f s",
        spec.steps,
        last,
        seconds,
    )
    record = spec.describe(spatial_shape, alpha, seconds)
    record["final_loss"] = last
    return record
