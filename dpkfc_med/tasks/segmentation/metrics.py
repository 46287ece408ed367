"""Per-case Dice and Hausdorff-95 of label maps (MONAI metrics), in voxels' physical units.

Also their per-case files in the layout of MONAI's ``MetricsSaver`` (:func:`write_metric_reports`)
and label maps saved on the input's grid (:func:`save_label_map`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "dice_scores",
    "hausdorff95_scores",
    "save_label_map",
    "summarise_cases",
    "voxel_spacing",
    "write_metric_reports",
]


def dice_scores(pred: Tensor, label: Tensor, num_classes: int) -> Tensor:
    """Dice of each foreground class for one or more volumes.

    Args:
        pred: predicted class ids ``[N, 1, *S]``.
        label: true class ids ``[N, 1, *S]``.
        num_classes: ``K`` (background included).

    Returns:
        ``[N, K - 1]`` Dice per case and foreground class (``nan`` where the class is absent
        from the ground truth, following MONAI's ``ignore_empty``).
    """
    from monai.metrics import DiceMetric
    from monai.networks.utils import one_hot

    metric = DiceMetric(include_background=False, reduction="none", ignore_empty=True)
    scores = metric(one_hot(pred, num_classes), one_hot(label, num_classes))
    return torch.as_tensor(scores).float()


def hausdorff95_scores(
    pred: Tensor, label: Tensor, num_classes: int, spacing: Sequence[float] | None = None
) -> Tensor:
    """Symmetric 95th-percentile Hausdorff distance of each foreground class (MONAI metrics).

    Args:
        pred: predicted class ids ``[N, 1, *S]``.
        label: true class ids ``[N, 1, *S]``.
        num_classes: ``K`` (background included).
        spacing: voxel spacing (distances in its unit, mm for NIfTI); ``None`` = voxels.

    Returns:
        ``[N, K - 1]`` distances; ``nan`` where the class is absent from the ground truth,
        ``inf`` where it is present but the prediction misses it entirely.
    """
    from monai.metrics import compute_hausdorff_distance
    from monai.networks.utils import one_hot

    p, t = one_hot(pred, num_classes), one_hot(label, num_classes)
    with warnings.catch_warnings():
        # empty classes are handled below (nan / inf); MONAI's own deprecation is internal
        warnings.filterwarnings("ignore", message=".*may result in nan/inf distance")
        warnings.filterwarnings(
            "ignore", message=".*always_return_as_numpy", category=FutureWarning
        )
        out = torch.as_tensor(
            compute_hausdorff_distance(
                p, t, include_background=False, percentile=95, spacing=spacing
            )
        ).float()
    present = t[:, 1:].flatten(2).any(-1)
    missed = present & ~p[:, 1:].flatten(2).any(-1)
    out = torch.where(present, out, torch.full_like(out, float("nan")))
    return torch.where(missed, torch.full_like(out, float("inf")), out)


def voxel_spacing(image: Tensor, fallback: Sequence[float] | None) -> list[float] | None:
    """Spacing of each spatial axis of ``image [N, C, *S]`` from its header, else ``fallback``."""
    n = image.ndim - 2
    pixdim = getattr(image, "pixdim", None)  # MONAI MetaTensor from the NIfTI header
    try:
        values = [float(v) for v in pixdim][-n:] if pixdim is not None else None
    except TypeError:
        values = None
    if values and len(values) == n and all(v > 0 for v in values):
        return values
    return list(fallback) if fallback is not None and len(fallback) == n else None


def summarise_cases(
    dice: np.ndarray, hd95: np.ndarray | None, names: Sequence[str]
) -> dict[str, Any]:
    """The figures of ``dpkfc-med evaluate`` from per-case rows.

    Args:
        dice: ``[N, K - 1]`` Dice per case and foreground class (``nan``: class absent from
            the ground truth).
        hd95: ``[N, K - 1]`` Hausdorff-95 (``nan`` absent, ``inf`` missed), or ``None``.
        names: The ``K - 1`` foreground class names.

    Returns:
        ``{"mean_dice", "dice_per_class", "n"}``: a class's Dice is the mean over the cases
        that hold it, ``mean_dice`` the mean over classes; with ``hd95``: ``hd95_per_class``
        (mean over the cases where prediction and ground truth hold the class) and
        ``hd95_missed_cases`` (cases whose prediction misses a class the ground truth holds).
    """
    per_class = [
        _finite_mean(col) for col in np.asarray(dice, np.float64).reshape(-1, len(names)).T
    ]
    finite = [v for v in per_class if math.isfinite(v)]
    out: dict[str, Any] = {
        "mean_dice": float(np.mean(finite)) if finite else float("nan"),
        "dice_per_class": dict(zip(names, per_class)),
        "n": int(len(dice)),
    }
    if hd95 is not None:
        hd = np.asarray(hd95, np.float64).reshape(-1, len(names))
        out["hd95_per_class"] = dict(zip(names, (_finite_mean(col) for col in hd.T)))
        out["hd95_missed_cases"] = dict(zip(names, (int(np.isinf(col).sum()) for col in hd.T)))
    return out


def _finite_mean(values: np.ndarray) -> float:
    ok = values[np.isfinite(values)]
    return float(ok.mean()) if ok.size else float("nan")


def write_metric_reports(
    save_dir: str | Path,
    filenames: Sequence[str],
    metrics: Mapping[str, float],
    details: Mapping[str, np.ndarray | Tensor],
    class_names: Sequence[str] | None = None,
) -> list[Path]:
    """Per-case metrics in the files MONAI's ``MetricsSaver`` writes, at full precision.

    ``metrics.csv`` holds one ``name,value`` line per overall figure; ``<name>_raw.csv`` one
    row per case of each metric in ``details``: ``filename``, one column per class and their
    ``mean`` (``nanmean`` over the classes, as MONAI computes it). Values are written as Python
    floats (``repr``, so ``nan`` and ``inf`` stay readable), not rounded to 4 decimals as
    :func:`monai.handlers.utils.write_metrics_reports` does, so a figure recomputed from the
    rows matches the reported one to float precision.

    Args:
        save_dir: The folder (created).
        filenames: The input of each case (one per row of every detail).
        metrics: Overall figures.
        details: Metric name -> ``[N, C]`` values per case and class.
        class_names: Column names of the classes (default MONAI's ``class0``, ``class1``, ...).

    Returns:
        The written files.
    """
    out = Path(save_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    if metrics:
        path = out / "metrics.csv"
        path.write_text(
            "".join(f"{k},{_number(v)}\n" for k, v in metrics.items()), encoding="utf-8"
        )
        written.append(path)
    for name, raw in details.items():
        values = np.asarray(raw.detach().cpu() if isinstance(raw, Tensor) else raw, np.float64)
        values = values.reshape(len(filenames), -1)
        if len(values) != len(filenames):
            raise ValueError(f"{name}: {len(values)} rows for {len(filenames)} files")
        labels = list(class_names or [f"class{i}" for i in range(values.shape[1])])
        with warnings.catch_warnings():  # a case with no class present: its mean is nan
            warnings.simplefilter("ignore", RuntimeWarning)
            means = np.nanmean(values, axis=1, keepdims=True)
        rows = np.concatenate([values, means], axis=1)
        lines = [",".join(["filename", *labels, "mean"])]
        lines += [
            ",".join([_csv_field(f), *(_number(v) for v in row)]) for f, row in zip(filenames, rows)
        ]
        path = out / f"{name}_raw.csv"
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        written.append(path)
    return written


def _number(value: Any) -> str:
    return repr(float(value))


def _csv_field(text: str) -> str:
    return f'"{text.replace(chr(34), chr(34) * 2)}"' if any(c in text for c in ',"\n') else text


def save_label_map(label_map: Any, path: str | Path) -> Path:
    """Write a label map ``[1, *S]`` as NIfTI with its meta data's affine (MONAI ``SaveImage``).

    Args:
        label_map: A MONAI ``MetaTensor`` of class ids on the input's grid (e.g. after
            ``Invertd``), so the file lies on the input image.
        path: The file, without extension (``.nii.gz`` is added).

    Returns:
        The written file.
    """
    from monai.transforms import SaveImage

    meta = getattr(label_map, "meta", {}) or {}
    shape = [int(v) for v in np.asarray(meta.get("spatial_shape", ())).ravel()]
    if len(shape) > label_map.ndim - 1 and math.prod(shape) == label_map[0].numel():
        # a 2-D case stored (X, Y, 1) was squeezed to 2-D: its map takes the file's shape back
        # (else SaveImage reads the channel as a spatial axis); the file is then (X, Y)
        label_map = label_map.reshape(1, *shape)
    values = label_map.max().item() if label_map.numel() else 0
    saver = SaveImage(
        output_ext=".nii.gz",
        output_dtype=np.uint8 if values < 256 else np.uint16,
        resample=False,
        separate_folder=False,
        print_log=False,
    )
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    saver(label_map, filename=str(path))
    return Path(f"{path}.nii.gz")
