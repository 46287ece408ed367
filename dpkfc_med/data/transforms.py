"""MONAI transform presets for segmentation: loading, label check, normalisation, patches.

Intensity normalisation uses per-volume statistics only: a dataset-wide mean or percentile
is a function of every private volume and would need its own privacy budget.

MONAI is imported lazily (inside :func:`segmentation_transforms`): its import costs seconds.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from enum import Enum
from pathlib import Path
from typing import Any

import torch

from dpkfc_med.data.cases import case_id_from_path, label_value_problem
from dpkfc_med.data.errors import DataValidationError

__all__ = ["CropMode", "IntensityNorm", "segmentation_transforms"]


class CropMode(str, Enum):
    """How training patches are drawn from a volume."""

    POS_NEG = "pos_neg"  # RandCropByPosNegLabeld: centres balanced between fg and bg voxels
    RANDOM = "random"  # RandSpatialCropSamplesd: uniform centres


class IntensityNorm(str, Enum):
    """Per-volume intensity normalisation."""

    ZSCORE = "zscore"  # NormalizeIntensityd over nonzero voxels, per channel
    PERCENTILE = "percentile"  # ScaleIntensityRangePercentilesd to [0, 1], clipped


def _enum(cls: type[Enum], value: Any, name: str) -> Any:
    try:
        return cls(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in cls)  # type: ignore[attr-defined]
        raise ValueError(f"{name}={value!r} is not one of {allowed}") from None


class _CheckLabelValues:
    """Transform that fails on undeclared label values right after a volume is loaded.

    A plain callable (MONAI's ``Compose`` accepts any) so this module imports MONAI lazily.
    """

    def __init__(self, allowed: Sequence[int] | None, label_key: str = "label") -> None:
        self.allowed = None if allowed is None else tuple(int(v) for v in allowed)
        self.label_key = label_key

    def __call__(self, data: Mapping[str, Any]) -> Mapping[str, Any]:
        label = data[self.label_key]
        values = torch.unique(torch.as_tensor(label)).cpu().numpy()
        meta = getattr(label, "meta", {}) or {}
        label_path = Path(str(meta.get("filename_or_obj", "unknown label file")))
        case_id = str(data.get("case_id", case_id_from_path(label_path)))
        problem = label_value_problem(
            values, self.allowed, case_id, label_path.name, "label_values"
        )
        if problem:
            raise DataValidationError(label_path, [problem])
        return data


def segmentation_transforms(
    *,
    spatial_size: int | Sequence[int],
    train: bool,
    num_patches_per_volume: int = 1,
    intensity: IntensityNorm | str = IntensityNorm.ZSCORE,
    crop: CropMode | str = CropMode.POS_NEG,
    pos: float = 1.0,
    neg: float = 1.0,
    percentiles: tuple[float, float] = (0.5, 99.5),
    label_values: Sequence[int] | None = None,
    eval_center_crop: bool = False,
    reader: str = "NibabelReader",
    slices: Any = None,
) -> Callable[[dict[str, Any]], Any]:
    """MONAI dictionary-transform preset for 3D or 2D segmentation (keys ``image``, ``label``).

    Pipeline: ``LoadImaged`` (``reader``) -> ``EnsureChannelFirstd`` -> 2D: trailing size-1
    axes dropped -> label value check (if ``label_values``) -> label cast to int64 -> per-volume
    (per-image) intensity normalisation -> ``SpatialPadd`` to at least ``spatial_size`` ->
    training only: ``k`` random patches (``RandCropByPosNegLabeld`` or
    ``RandSpatialCropSamplesd``). Evaluation is deterministic: the whole padded volume, or its
    centre crop with ``eval_center_crop``. With ``slices`` the volume is normalised whole, then
    training takes the rule's slices of a draw (:class:`~dpkfc_med.data.slices.RandSlicesd`),
    each padded to the 2D ``spatial_size`` and cropped to it at a random position; evaluation
    keeps the whole volume, padded in-plane (a slice-by-slice inferer predicts it).

    Args:
        spatial_size: Patch size ``(X, Y, Z)`` or ``(X, Y)`` (an int means a cube).
        train: Training pipeline (random patches) or evaluation pipeline (no randomness).
        num_patches_per_volume: ``k`` patches per volume in training.
        intensity: ``"zscore"`` (mean/std over nonzero voxels) or ``"percentile"`` (robust
            min-max to [0, 1] at ``percentiles``).
        crop: ``"pos_neg"`` (centres on foreground with probability ``pos / (pos + neg)``) or
            ``"random"`` (uniform).
        pos: Foreground weight for ``"pos_neg"``.
        neg: Background weight for ``"pos_neg"``.
        percentiles: Lower and upper percentile for ``"percentile"``.
        label_values: Allowed label values; a volume holding others raises
            :class:`DataValidationError` naming the case. ``None`` skips the check.
        eval_center_crop: In evaluation, centre-crop to ``spatial_size`` so volumes batch.
        reader: MONAI reader of the files (``"NibabelReader"``; ``"PILReader"`` for PNG).
        slices: A :class:`~dpkfc_med.data.slices.SliceRule`: 2D samples are slices of the
            3-D volumes (``spatial_size`` is in-plane).

    Returns:
        A ``monai.transforms.Compose``. In training it maps a record to a list of ``k``
        dicts, each with ``image [C, *spatial_size]`` float32 and ``label [1, *spatial_size]``
        int64; in evaluation to one dict.
    """
    from monai.transforms import (  # lazy: MONAI's import costs seconds
        CastToTyped,
        CenterSpatialCropd,
        Compose,
        EnsureChannelFirstd,
        EnsureTyped,
        LoadImaged,
        NormalizeIntensityd,
        RandCropByPosNegLabeld,
        RandSpatialCropSamplesd,
        ScaleIntensityRangePercentilesd,
        SpatialPadd,
    )

    intensity = _enum(IntensityNorm, intensity, "intensity")
    crop = _enum(CropMode, crop, "crop")
    if num_patches_per_volume < 1:
        raise ValueError(f"num_patches_per_volume={num_patches_per_volume} must be >= 1")
    size = (spatial_size,) * 3 if isinstance(spatial_size, int) else tuple(spatial_size)
    if len(size) not in (2, 3) or any(int(s) < 1 for s in size):
        raise ValueError(f"spatial_size={spatial_size!r} must be an int or 2 or 3 positive ints")
    if slices is not None and len(size) != 2:
        raise ValueError(f"spatial_size={spatial_size!r}: slices need an in-plane (2D) size")
    keys = ["image", "label"]

    with warnings.catch_warnings():
        # LoadImaged always instantiates MONAI's optional GPU DICOM reader, which warns when
        # nvImageCodec is absent; NIfTI loading never uses it.
        warnings.filterwarnings("ignore", message="NvImgCodecPydicomReader")
        load = LoadImaged(keys=keys, reader=reader, image_only=True)
    steps: list[Any] = [load, EnsureChannelFirstd(keys=keys)]
    if len(size) == 2 and slices is None:
        from dpkfc_med.data.slices import SqueezeToSpatialDims

        steps.append(SqueezeToSpatialDims(2, keys))
    if label_values is not None:
        steps.append(_CheckLabelValues(label_values))
    steps += [
        EnsureTyped(keys="image", dtype=torch.float32, track_meta=True),
        CastToTyped(keys="label", dtype=torch.int64),
    ]
    if intensity is IntensityNorm.ZSCORE:
        steps.append(NormalizeIntensityd(keys="image", nonzero=True, channel_wise=True))
    else:
        steps.append(
            ScaleIntensityRangePercentilesd(
                keys="image",
                lower=percentiles[0],
                upper=percentiles[1],
                b_min=0.0,
                b_max=1.0,
                clip=True,
                channel_wise=True,
            )
        )
    if slices is not None:
        from monai.transforms import RandSpatialCropd

        from dpkfc_med.data.slices import RandSlicesd

        if train:
            steps += [
                RandSlicesd(slices, keys),
                SpatialPadd(keys=keys, spatial_size=size),
                RandSpatialCropd(keys=keys, roi_size=size, random_size=False),
            ]
        else:  # in-plane padding only (-1 keeps the slice axis)
            whole = [int(v) for v in size]
            whole.insert(slices.axis, -1)
            steps.append(SpatialPadd(keys=keys, spatial_size=whole))
        return Compose(steps)
    steps.append(SpatialPadd(keys=keys, spatial_size=size))
    if train:
        if crop is CropMode.POS_NEG:
            steps.append(
                RandCropByPosNegLabeld(
                    keys=keys,
                    label_key="label",
                    spatial_size=size,
                    pos=pos,
                    neg=neg,
                    num_samples=num_patches_per_volume,
                    image_key="image",
                    image_threshold=0.0,
                )
            )
        else:
            steps.append(
                RandSpatialCropSamplesd(
                    keys=keys, roi_size=size, num_samples=num_patches_per_volume, random_size=False
                )
            )
    elif eval_center_crop:
        steps.append(CenterSpatialCropd(keys=keys, roi_size=size))
    return Compose(steps)
