"""Augmentation multiplicity for classification: ``k`` random views of every drawn image.

``data.augmentations_per_unit: k`` turns a classification training set into one whose unit
(an image, or a patient's images) is drawn as ``k`` random shifts and flips of each of its
images (:class:`RandomShiftFlip`); :class:`~dpkfc_med.data.units.UnitCollate` gives every view
its unit's index, so the optimizer sums the views' gradients before clipping, as the
segmentation crops of one volume already are ("augmentation multiplicity", De et al. 2022,
arXiv 2204.13650).

Privacy guarantee:
    The views of a unit are summed before clipping, so adding or removing a unit still moves
    the clipped sum by at most ``C`` (the guarantee is the same whatever ``k``). The views are
    drawn from the unit's own random stream (:class:`~dpkfc_med.data.units.UnitDraws`: run
    seed, unit id, how often the unit was drawn), never from a stream shared by all units, and
    the transform reads the image only, never its label.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from dpkfc_med.data.units import UnitDraws

__all__ = ["MAX_SHIFT", "AugmentedUnits", "RandomShiftFlip"]

MAX_SHIFT = 2
"""Largest shift in pixels (voxels) along each spatial axis: small against a 28-pixel image."""


class RandomShiftFlip:
    """Shift one image ``[C, *spatial]`` by a few pixels (zero filled) and flip it at random.

    Each spatial axis shifts by an integer in ``[-max_shift, max_shift]``; each axis of
    ``flip_axes`` (spatial axes, default the last: left-right) flips with probability 1/2.
    The random state is the transform's own (``set_random_state``, as MONAI's ``Randomizable``),
    so a dataset can give each unit its own stream.

    Args:
        max_shift: Largest shift along each spatial axis.
        flip_axes: Spatial axes (0-based, negative from the end) that may flip.
    """

    def __init__(self, max_shift: int = MAX_SHIFT, flip_axes: Sequence[int] = (-1,)) -> None:
        if max_shift < 0:
            raise ValueError(f"max_shift={max_shift}: must be >= 0")
        self.max_shift = int(max_shift)
        self.flip_axes = tuple(int(a) for a in flip_axes)
        self.R = np.random.RandomState()

    def set_random_state(
        self, seed: int | None = None, state: np.random.RandomState | None = None
    ) -> RandomShiftFlip:
        """Draw from ``state`` (or a new state seeded by ``seed``) from now on."""
        self.R = state if state is not None else np.random.RandomState(seed)
        return self

    def __call__(self, image: Tensor) -> Tensor:
        """The shifted, possibly flipped image ``[C, *spatial]`` (same shape and dtype)."""
        dims = image.ndim - 1
        shifts = self.R.randint(-self.max_shift, self.max_shift + 1, size=dims)
        flips = self.R.rand(len(self.flip_axes)) < 0.5
        axes = [1 + (a % dims) for a, f in zip(self.flip_axes, flips) if f]
        out = torch.flip(image, axes) if axes else image
        return _shift(out, [int(s) for s in shifts])


def _shift(image: Tensor, shifts: Sequence[int]) -> Tensor:
    """``image`` moved by ``shifts`` along its spatial axes, the uncovered border zero."""
    if not any(shifts):
        return image
    out = torch.zeros_like(image)
    src: list[slice] = [slice(None)]
    dst: list[slice] = [slice(None)]
    for s, n in zip(shifts, image.shape[1:]):
        s = max(-n, min(n, s))
        src.append(slice(max(0, -s), n - max(0, s)))
        dst.append(slice(max(0, s), n - max(0, -s)))
    out[tuple(dst)] = image[tuple(src)]
    return out


class AugmentedUnits(Dataset):
    """Every unit of ``base`` drawn as ``k`` random views of each of its images.

    Item ``u`` is ``{"image": [k m_u, C, *spatial], "label": [k m_u], "index": [k m_u],
    "unit_id": str}`` (:class:`~dpkfc_med.data.units.UnitCollate`'s input), the ``k`` views
    of an image next to each other; ``m_u`` is 1 for a dataset of ``(image, label)`` pairs
    (the unit is one image, its id its position) and the unit's image count for a
    :class:`~dpkfc_med.data.units.UnitImageDataset`.

    Args:
        base: The training set: ``(image, label)`` items, or unit dicts.
        k: Views per image (``>= 1``).
        augment: The random transform of one image (owns its random state).
        seed: Run seed of the per-unit streams (``None``: OS entropy).
    """

    def __init__(
        self, base: Dataset, k: int, augment: RandomShiftFlip, seed: int | None = None
    ) -> None:
        if k < 1:
            raise ValueError(f"data.augmentations_per_unit={k}: must be >= 1")
        self.base, self.k, self.augment = base, int(k), augment
        self.draws = UnitDraws(seed)

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    @property
    def max_images_per_unit(self) -> int:
        """``k`` times the largest image count of one unit of ``base``."""
        return self.k * int(getattr(self.base, "max_images_per_unit", 1))

    def peek(self, unit: int) -> dict[str, Any]:
        """Item ``unit`` from the look stream, counting no draw (its structure only)."""
        with self.draws.looking():
            peek = getattr(self.base, "peek", None)
            return self._views(peek(unit) if callable(peek) else self.base[unit], unit)

    def __getitem__(self, unit: int) -> dict[str, Any]:
        return self._views(self.base[unit], unit)

    def _views(self, item: Any, unit: int) -> dict[str, Any]:
        if isinstance(item, dict):
            images, labels, index, uid = (
                item["image"],
                item["label"],
                item["index"],
                item["unit_id"],
            )
        else:
            image, label = item
            images, labels = image[None], torch.as_tensor(label).reshape(1)
            index, uid = torch.tensor([unit]), str(unit)
        self.draws.reseed(self.augment, uid)
        views = [self.augment(im) for im in images for _ in range(self.k)]
        return {
            "image": torch.stack(views),
            "label": labels.repeat_interleave(self.k),
            "index": index.repeat_interleave(self.k),
            "unit_id": uid,
        }
