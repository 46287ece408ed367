"""Small samples of real (private) images, volumes and labels for spectra and oracle factors.

Everything loaded here is private data. Spectra and factors computed from it are research and
custodian diagnostics, not differentially private releases, and never reach a training run's
preconditioner (which takes synthetic probes only).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from dpkfc_med.data import (
    load_medmnist,
    load_segmentation_folder,
    resolve_data_path,
    segmentation_transforms,
)

__all__ = ["RealSample", "medmnist_sample", "segmentation_sample"]


@dataclass(frozen=True)
class RealSample:
    """A few private images with their labels, as the network sees them in training.

    Attributes:
        name: Dataset name, e.g. ``"pneumoniamnist"``.
        images: ``[N, C, *spatial]`` float32.
        labels: ``[N]`` class ids or ``[N, *spatial]`` label maps (int64).
        spacing: Voxel spacing in mm per spatial axis.
        source: The file or folder read.
        uses_private_data: Always True: a reminder carried into every result.
    """

    name: str
    images: Tensor
    labels: Tensor
    spacing: tuple[float, ...]
    source: str
    uses_private_data: bool = True


def medmnist_sample(
    path: str | Path,
    *,
    split: str = "train",
    num: int = 256,
    seed: int = 0,
    spacing: float | Sequence[float] | None = None,
) -> RealSample:
    """A seeded random subset of a MedMNIST-format archive (intensities scaled to [0, 1]).

    Args:
        path: ``.npz`` path or MedMNIST flag (``"pneumoniamnist"``, ``"adrenalmnist3d"``).
        split: ``"train"``, ``"val"`` or ``"test"``.
        num: Images drawn without replacement (capped at the split size).
        seed: Seed of the draw.
        spacing: Voxel spacing in mm (default 1.0: MedMNIST stores no physical spacing).

    Returns:
        :class:`RealSample` with labels ``[N]``.
    """
    data = load_medmnist(resolve_data_path(str(path)), infer_classes=True)  # exploration
    ds = data.subset(split, num, seed=seed)
    nd = data.spatial_dims
    sp = (
        (1.0,) * nd
        if spacing is None
        else ((float(spacing),) * nd if isinstance(spacing, int | float) else tuple(spacing))
    )
    labels = ds.labels.reshape(len(ds.labels), -1)[:, 0] if ds.labels.ndim > 1 else ds.labels
    stem = data.flag or data.path.stem
    return RealSample(stem, ds.images, labels.long(), sp, str(data.path))


def segmentation_sample(
    path: str | Path,
    *,
    num: int = 32,
    patch_size: Sequence[int] = (32, 48, 32),
    seed: int = 0,
) -> RealSample:
    """Centre crops of a seeded random subset of a NIfTI segmentation folder (e.g. MSD Task04).

    Uses the training pipeline's evaluation transforms
    (:func:`~dpkfc_med.data.segmentation_transforms`: per-volume z-score over nonzero voxels,
    padding to at least ``patch_size``, centre crop), so the crops look as the UNet sees them.

    Args:
        path: Dataset folder (``dataset.json`` or ``imagesTr``/``labelsTr``), or its name under
            the data root (``"msd_hippocampus"``).
        num: Cases drawn without replacement (capped at the number of cases).
        patch_size: Crop size ``(X, Y, Z)``.
        seed: Seed of the draw.

    Returns:
        :class:`RealSample` with images ``[N, 1, X, Y, Z]`` and label maps ``[N, X, Y, Z]``; the
        spacing is the first case's header spacing.
    """
    cases = load_segmentation_folder(resolve_data_path(str(path), kind="dir"))
    ids = cases.case_ids
    gen = torch.Generator().manual_seed(seed)
    pick = sorted(torch.randperm(len(ids), generator=gen)[: min(num, len(ids))].tolist())
    chosen = [ids[i] for i in pick]
    tf = segmentation_transforms(spatial_size=tuple(patch_size), train=False, eval_center_crop=True)
    images, labels = [], []
    for record in cases.data_dicts(chosen):
        out = tf(record)
        images.append(torch.as_tensor(out["image"]).as_subclass(Tensor).float())
        labels.append(torch.as_tensor(out["label"]).as_subclass(Tensor).long()[0])
    spacing = tuple(float(s) for s in cases[chosen[0]].spacing)
    return RealSample(
        cases.root.name, torch.stack(images), torch.stack(labels), spacing, str(cases.root)
    )
