"""Synthetic shape volumes: smooth shapes of distinct intensity on a textured background.

The inputs of ``kind="shapes"`` probes and of data-free pretraining; their label maps are
:func:`~dpkfc_med.probes.targets.shape_label_maps`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from dpkfc_med.probes.noise import pink_noise
from dpkfc_med.probes.targets import shape_label_maps

__all__ = ["TEXTURE_AMPLITUDE", "shape_volumes"]

TEXTURE_AMPLITUDE = 0.5
"""Standard deviation of the shape volumes' texture relative to the class contrast step."""


def shape_volumes(
    shape: Sequence[int],
    *,
    num: int,
    channels: int = 1,
    num_classes: int,
    spacing: Sequence[float],
    alpha: float,
    generator: torch.Generator,
    foreground: tuple[float, float] = (0.03, 0.25),
) -> tuple[Tensor, Tensor]:
    """Synthetic segmentation volumes: smooth shapes of distinct intensity on textured background.

    Each label map is :func:`shape_label_maps`; in every channel, class ``c`` sits ``c``
    random contrast steps (step in [0.5, 1.5), random sign, drawn per volume and channel) from
    the background, plus power-law texture of exponent ``alpha`` and relative amplitude
    :data:`TEXTURE_AMPLITUDE`; each volume and channel is then standardised. The classes are
    told apart by their ordering, not by one fixed intensity. Drawn from ``generator`` only:
    labels, then per channel the step, the sign and the texture.

    Args:
        shape: spatial shape ``(D, H, W)`` (any number of spatial axes).
        num: volumes to draw.
        channels: image channels (one label map, independent contrasts and textures).
        num_classes: ``K`` including the background (class 0).
        spacing: voxel spacing per axis (the fields' smoothness is isotropic in mm).
        alpha: exponent of the texture's power spectrum.
        generator: the CPU generator that draws everything.
        foreground: range of the foreground fraction of a volume.

    Returns:
        ``(images [num, C, *S] float64, labels [num, *S] int64)``.
    """
    shape = tuple(int(s) for s in shape)
    spacing = tuple(float(s) for s in spacing)
    labels = shape_label_maps(
        shape,
        num=num,
        num_classes=num_classes,
        spacing=spacing,
        generator=generator,
        foreground=foreground,
    )
    dims = tuple(range(1, len(shape) + 1))
    images = []
    for _ in range(channels):
        step = 0.5 + torch.rand(num, 1, generator=generator, dtype=torch.float32)
        sign = torch.where(torch.rand(num, 1, generator=generator) < 0.5, -1.0, 1.0).double()
        means = sign * step * torch.arange(num_classes, dtype=torch.float32)
        image = torch.gather(means, 1, labels.flatten(1)).view(num, *shape)
        texture = pink_noise(
            shape, batch=num, alpha=alpha, spacing=spacing, generator=generator, dtype=torch.float32
        )[:, 0]
        image = image + TEXTURE_AMPLITUDE * texture
        image = (image - image.mean(dims, keepdim=True)) / image.std(dims, keepdim=True).clamp_min(
            1e-6
        )
        images.append(image)
    return torch.stack(images, dim=1), labels
