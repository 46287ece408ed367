"""The Poisson loader on MONAI-style units (a list of sample dicts per unit)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from dpkfc_med.privacy.loader import poisson_loader


class _Crops(Dataset):
    """Each unit: two crops as dicts, as RandCropByPosNegLabeld(num_samples=2) returns."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> list[dict[str, torch.Tensor]]:
        return [{"image": torch.full((1, 3), float(i)), "label": torch.tensor(i)}] * 2


def _collate(units):
    samples = [s for u in units for s in u]
    if not samples:
        return {"image": torch.zeros(0, 1, 3), "units": 0}
    return {"image": torch.stack([s["image"] for s in samples]), "units": len(units)}


@pytest.mark.parametrize("secure", [False, True])
def test_empty_batches_of_dict_units_reach_the_callers_collate(secure):
    """A rate of 1/4 over 4 units draws empty batches; each is the caller's empty batch."""
    gen = torch.Generator().manual_seed(0)
    base = DataLoader(_Crops(), batch_size=1, collate_fn=_collate)
    loader = poisson_loader(base, generator=None if secure else gen, secure=secure)
    batches = [b for _ in range(40) for b in loader]
    empty = [b for b in batches if b["units"] == 0]
    assert empty and all(b["image"].shape == (0, 1, 3) for b in empty)
    full = [b for b in batches if b["units"]]
    assert all(b["image"].shape[0] == 2 * b["units"] for b in full)
