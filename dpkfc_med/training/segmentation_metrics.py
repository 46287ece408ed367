"""Per-case Dice and Hausdorff-95 of label maps (MONAI metrics), in voxels' physical units."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["dice_scores", "hausdorff95_scores", "voxel_spacing"]


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
