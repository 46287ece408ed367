"""2D samples from NIfTI files: slices of a 3D volume, and 2-D images stored as ``(X, Y, 1)``.

Slices of volumes keep the volume (patient) as the privacy unit. :class:`RandSlicesd` turns one
volume into the ``k`` slices of one draw, so :class:`~dpkfc_med.data.volumes.VolumeDataset` still
returns one item per volume holding all of its samples, the sampler draws volumes, and the
trainer sums a volume's per-slice gradients before clipping (as it sums the patches of a 3D
volume). Which slices a draw takes is a function of the rule (a config constant), the volume's
own extent along the axis and the volume's own random stream, never of the labels or of any
other volume.

This module imports MONAI at import time; the segmentation readers import it lazily.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from monai.transforms import Randomizable, SqueezeDim

__all__ = ["RandSlicesd", "SliceRule", "SqueezeToSpatialDims"]

PICKS = ("random", "even")
"""How the positions of a draw are chosen (``data.slices.pick``)."""


@dataclass(frozen=True)
class SliceRule:
    """Which slices of a volume one draw trains on.

    Attributes:
        axis: Voxel axis of the volume the slices are cut across (0, 1 or 2 of ``[X, Y, Z]``).
        per_unit: Slices per draw ``k``; ``None`` = every slice of the volume.
        pick: ``"random"``: ``k`` distinct uniform positions per draw (all positions plus
            repeats when the volume has fewer than ``k``); ``"even"``: the centres of ``k``
            equal bins of the axis, the same on every draw.
    """

    axis: int
    per_unit: int | None = None
    pick: str = "random"

    def __post_init__(self) -> None:
        if self.axis not in (0, 1, 2):
            raise ValueError(f"axis={self.axis!r} must be 0, 1 or 2 (a voxel axis of [X, Y, Z])")
        if self.per_unit is not None and self.per_unit < 1:
            raise ValueError(f"per_unit={self.per_unit!r} must be >= 1 (or None: every slice)")
        if self.pick not in PICKS:
            raise ValueError(f"pick={self.pick!r} is not one of {PICKS}")

    def positions(self, depth: int, rng: np.random.RandomState | None = None) -> list[int]:
        """Slice indices ``[k]`` along ``axis`` of a volume with ``depth`` slices, sorted.

        Examples:
            >>> SliceRule(axis=2, per_unit=4, pick="even").positions(10)
            [1, 3, 6, 8]
            >>> SliceRule(axis=2).positions(3)
            [0, 1, 2]
        """
        if depth < 1:
            raise ValueError(f"a volume with {depth} slices along axis {self.axis}")
        if self.per_unit is None:
            return list(range(depth))
        k = self.per_unit
        if self.pick == "even":
            return [min(depth - 1, int((i + 0.5) * depth / k)) for i in range(k)]
        rng = rng if rng is not None else np.random.RandomState()
        if k <= depth:
            chosen = rng.choice(depth, size=k, replace=False)
        else:
            chosen = np.concatenate([np.arange(depth), rng.choice(depth, size=k - depth)])
        return sorted(int(i) for i in chosen)

    def describe(self) -> str:
        """The rule in words (the run's data record)."""
        which = (
            "every slice"
            if self.per_unit is None
            else f"{self.per_unit} slices per draw, "
            + ("at uniform random positions" if self.pick == "random" else "evenly spaced")
        )
        return f"slices across voxel axis {self.axis}: {which} (chosen without the labels)"


def _plain(x: Any) -> torch.Tensor:
    return x.as_tensor() if hasattr(x, "as_tensor") else torch.as_tensor(x)


class RandSlicesd(Randomizable):
    """Dictionary transform: ``[C, X, Y, Z]`` volume -> list of ``k`` 2D slice records.

    Each record copies the input record with ``keys`` replaced by one slice ``[C, *plane]``
    (a plain tensor: the volume's affine does not describe a slice) and adds ``slice_index``.
    Positions come from :meth:`SliceRule.positions` with this transform's own random state,
    which :class:`~dpkfc_med.data.volumes.VolumeDataset` reseeds per volume and draw.

    Args:
        rule: The slice rule.
        keys: Keys of the volumes to slice (image and label, sliced alike).
    """

    def __init__(self, rule: SliceRule, keys: Sequence[str] = ("image", "label")) -> None:
        self.rule = rule
        self.keys = tuple(keys)
        self._positions: list[int] = []

    def randomize(self, data: int) -> None:
        """Draw the positions of a volume with ``data`` slices along the axis."""
        self._positions = self.rule.positions(int(data), self.R)

    def __call__(self, data: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The slice records of one draw of the volume ``data``."""
        dim = 1 + self.rule.axis  # after the channel axis
        volume = data[self.keys[0]]
        if volume.ndim != 4:
            raise ValueError(
                f"slices need a volume [C, X, Y, Z]; got shape {tuple(volume.shape)} for "
                f"{self.keys[0]!r}"
            )
        self.randomize(volume.shape[dim])
        out = []
        for z in self._positions:
            item = dict(data)
            for key in self.keys:
                item[key] = _plain(data[key]).select(dim, z).clone()
            item["slice_index"] = z
            out.append(item)
        return out


class SqueezeToSpatialDims:
    """Dictionary transform: drop trailing size-1 axes until ``[C, *S]`` has ``spatial_dims``.

    A 2-D image written to NIfTI often has the shape ``(X, Y, 1)``; after ``LoadImaged`` and
    ``EnsureChannelFirstd`` it is ``[C, X, Y, 1]`` and becomes ``[C, X, Y]`` (MONAI
    ``SqueezeDim``, which also drops the axis from the affine).

    Args:
        spatial_dims: Spatial axes wanted.
        keys: Keys to squeeze.
    """

    def __init__(self, spatial_dims: int, keys: Sequence[str] = ("image", "label")) -> None:
        self.spatial_dims = int(spatial_dims)
        self.keys = tuple(keys)

    def __call__(self, data: Mapping[str, Any]) -> dict[str, Any]:
        """``data`` with the ``keys`` squeezed."""
        out = dict(data)
        for key in self.keys:
            x = out[key]
            while x.ndim > 1 + self.spatial_dims and x.shape[-1] == 1:
                x = SqueezeDim(dim=x.ndim - 1)(x)
            out[key] = x
        return out
