"""The volume dataset: one item per volume holding all of its patches (the privacy unit).

Privacy unit: one *volume* (one case). :class:`VolumeDataset` returns all ``k`` training
patches of one volume as one item, so a Poisson / uniform sampler over the dataset draws
volumes, and a per-item gradient clip bounds the contribution of a whole volume. Sampling
patches as independent items would make the privacy unit a patch and understate the
privacy loss of a patient by up to a factor ``k``.

Random patches of a volume draw from that volume's own random stream, seeded by (run seed,
case ID, how often the volume was drawn before), so they do not depend on which other volumes
the secret Poisson sampler drew (:func:`~dpkfc_med.data.units.unit_random_state`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from dpkfc_med.data.cases import SegmentationCases
from dpkfc_med.data.errors import DataValidationError
from dpkfc_med.data.transforms import segmentation_transforms
from dpkfc_med.data.units import UnitDraws

__all__ = ["VolumeDataset"]


def _plain(x: Any, dtype: torch.dtype) -> torch.Tensor:
    """MetaTensor / array -> plain tensor; Opacus hooks and collation need no metadata."""
    if hasattr(x, "as_tensor"):
        x = x.as_tensor()
    return torch.as_tensor(x).to(dtype)


def _unwrap_transform_error(err: BaseException) -> BaseException | None:
    """MONAI wraps transform errors in RuntimeError; find our own error in the cause chain."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, DataValidationError):
            return seen
        seen = seen.__cause__
    return None


class VolumeDataset(Dataset):
    """One item per volume, holding all of that volume's patches: the volume is the privacy unit.

    Item ``i`` is ``{"image": [k, C, *patch] float32, "label": [k, 1, *patch] int64,
    "case_id": str}``; the default collate turns a batch of ``B`` volumes into
    ``[B, k, C, *patch]``. In evaluation (``train=False``) ``k`` is 1 and ``patch`` is the
    padded volume shape (or ``spatial_size`` with ``eval_center_crop=True``).

    Privacy guarantee:
        A sampler over this dataset includes or excludes whole volumes, and a per-item
        gradient (the loss summed over the ``k`` patches) is clipped as one unit, so the
        neighbouring relation is add/remove one volume (one case / patient in MSD data).
        Before each item the transform is reseeded with that volume's own random state, a
        function of ``(seed, case_id, draws of this volume so far)``
        (:func:`~dpkfc_med.data.units.unit_random_state`): a volume's patches do not depend
        on which other volumes were drawn before it, so its clipped gradient depends on its
        own data and sampling history only.

    Args:
        cases: The indexed dataset.
        case_ids: The cases of this dataset (e.g. one split); all cases by default.
        transform: A callable mapping ``{"image", "label", "case_id"}`` file records to a dict
            or list of dicts; by default :func:`segmentation_transforms` with the arguments
            below and ``label_values=cases.label_values``. A random transform must own its
            random state (``set_random_state``, as MONAI's ``Compose`` does) so that it can be
            reseeded per volume; one drawing from a global generator would share it.
        spatial_size: Patch size for the default transform.
        train: Training (random patches) or evaluation pipeline for the default transform.
        num_patches_per_volume: ``k`` for the default transform.
        seed: Run seed of the per-volume random streams: the ``d``-th draw of case ``c``
            (counted per process; in a ``DataLoader`` worker the worker's seed is hashed in)
            gets the same patches in every run and whatever else was drawn. ``None`` draws
            each item's random state from OS entropy (independent, not reproducible).
        **transform_kwargs: Further arguments of :func:`segmentation_transforms`.
    """

    def __init__(
        self,
        cases: SegmentationCases,
        *,
        case_ids: Sequence[str] | None = None,
        transform: Callable[[dict[str, Any]], Any] | None = None,
        spatial_size: int | Sequence[int] | None = None,
        train: bool = True,
        num_patches_per_volume: int = 1,
        seed: int | None = None,
        **transform_kwargs: Any,
    ) -> None:
        self.cases = cases if case_ids is None else cases.select(case_ids)
        self.records = self.cases.data_dicts()
        self.num_patches = num_patches_per_volume if train else 1
        if transform is None:
            if spatial_size is None:
                raise ValueError("VolumeDataset: pass spatial_size or a transform")
            transform_kwargs.setdefault("label_values", cases.label_values)
            transform = segmentation_transforms(
                spatial_size=spatial_size,
                train=train,
                num_patches_per_volume=num_patches_per_volume,
                **transform_kwargs,
            )
        self.transform = transform
        self.seed = seed
        self.draws = UnitDraws(seed)  # per volume: times drawn in this process

    def __len__(self) -> int:
        return len(self.records)

    def peek(self, index: int) -> dict[str, Any]:
        """Item ``index`` drawn from the look stream, counting no draw (its structure only)."""
        with self.draws.looking():
            return self[index]

    def __getitem__(self, index: int) -> dict[str, Any]:
        record = dict(self.records[index])
        # The volume's own stream, never one shared by all volumes: with a shared stream its
        # patches would depend on how many other volumes the secret sampler drew before it.
        self.draws.reseed(self.transform, record["case_id"])
        try:
            out = self.transform(record)
        except Exception as err:
            ours = _unwrap_transform_error(err)
            if ours is not None:
                raise ours from err
            raise DataValidationError(
                self.cases.root,
                [
                    f"case {record['case_id']}: transform failed ({type(err).__name__}: "
                    f"{err.__cause__ or err}); check the files or run validate_all()"
                ],
            ) from err
        patches = out if isinstance(out, list) else [out]
        image = torch.stack([_plain(p["image"], torch.float32) for p in patches])
        label = torch.stack([_plain(p["label"], torch.int64) for p in patches])
        return {"image": image, "label": label, "case_id": record["case_id"]}
