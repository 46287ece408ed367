"""Batches of volumes for the private step: patches of a unit stacked, whole volumes cached."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from dpkfc_med.data import (
    VolumeDataset,
)

__all__ = ["CachedPrefix", "CachedVolumes", "VolumeCollate"]


class VolumeCollate:
    """Stack volume items into ``{"image": [B, k, C, *p], "label": [B, k, 1, *p]}``.

    Poisson sampling can draw an empty batch; it is returned as zero-size tensors with the right
    trailing shape, so the trainer can still take its (noise-only) step. With
    ``patches_per_unit=None`` (every slice of a volume: ``k`` differs between volumes) the
    samples are concatenated, ``{"image": [N, C, *p], "label": [N, 1, *p], "unit": [N]}``
    with the index of each sample's volume in ``unit``.

    Args:
        patches_per_unit: ``k``, or ``None`` for a count that differs between items.
        channels: image channels ``C``.
        patch_size: spatial patch shape ``p``.
    """

    def __init__(
        self, patches_per_unit: int | None, channels: int, patch_size: Sequence[int]
    ) -> None:
        self.k = None if patches_per_unit is None else int(patches_per_unit)
        self.channels = int(channels)
        self.patch_size = tuple(int(s) for s in patch_size)

    def __call__(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        """Collate ``items`` (each from :class:`~dpkfc_med.data.VolumeDataset`)."""
        if self.k is None:
            sizes = torch.tensor([len(it["image"]) for it in items], dtype=torch.int64)
            empty = torch.zeros(0, self.channels, *self.patch_size)
            return {
                "image": torch.cat([it["image"] for it in items]) if items else empty,
                "label": torch.cat([it["label"] for it in items])
                if items
                else torch.zeros(0, 1, *self.patch_size, dtype=torch.int64),
                "unit": torch.arange(len(items)).repeat_interleave(sizes),
                "case_id": [it["case_id"] for it in items],
            }
        if not items:
            return {
                "image": torch.zeros(0, self.k, self.channels, *self.patch_size),
                "label": torch.zeros(0, self.k, 1, *self.patch_size, dtype=torch.int64),
                "case_id": [],
            }
        return {
            "image": torch.stack([it["image"] for it in items]),
            "label": torch.stack([it["label"] for it in items]),
            "case_id": [it["case_id"] for it in items],
        }


class CachedVolumes(Dataset):
    """Deterministic evaluation items, read once and kept in memory (volumes are small)."""

    def __init__(self, data: VolumeDataset) -> None:
        self.data = data
        self.case_ids = [r["case_id"] for r in data.records]
        self._cache: dict[int, dict[str, Any]] = {}

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if index not in self._cache:
            self._cache[index] = self.data[index]
        return self._cache[index]


class CachedPrefix:
    """A MONAI ``Compose`` whose deterministic prefix (load, normalise, pad) runs once per case.

    Like :class:`monai.data.CacheDataset`, but for the file records of
    :class:`~dpkfc_med.data.VolumeDataset`: everything before the first random transform is
    cached per case; the random patch sampling runs on every call.
    """

    def __init__(self, transform: Any) -> None:
        from monai.transforms import Compose, Randomizable

        steps = list(transform.transforms)
        cut = next((i for i, t in enumerate(steps) if isinstance(t, Randomizable)), len(steps))
        self.prefix, self.suffix = Compose(steps[:cut]), Compose(steps[cut:])
        self._cache: dict[str, dict[str, Any]] = {}

    def set_random_state(self, seed: int | None = None, state: Any = None) -> CachedPrefix:
        """Seed the random (patch-sampling) part."""
        self.suffix.set_random_state(seed=seed, state=state)
        return self

    def __call__(self, record: dict[str, Any]) -> Any:
        """The record through the cached deterministic prefix, then the random rest."""
        key = record["case_id"]
        if key not in self._cache:
            self._cache[key] = self.prefix(dict(record))
        return self.suffix(dict(self._cache[key]))
