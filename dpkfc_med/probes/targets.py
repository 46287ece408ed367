"""Probe target rules: uniform class ids, label maps, or labels sampled from the model.

Targets never depend on private data: they are uniform random class ids, spatially coherent
random label maps (:func:`uniform_label_maps`, :func:`shape_label_maps`), or labels sampled
from the model's own predictive distribution on the probes (:func:`sample_model_targets`; the
parameters are already-released outputs of earlier private steps).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum

import torch
from torch import Tensor, nn

from dpkfc_med.probes.noise import pink_noise
from dpkfc_med.utils import check_choice

__all__ = [
    "LABEL_FIELD_ALPHA",
    "TargetRule",
    "Task",
    "sample_model_targets",
    "shape_label_maps",
    "uniform_label_maps",
]

LABEL_FIELD_ALPHA = 4.0
"""Power-spectrum exponent of the fields whose per-voxel argmax gives uniform segmentation labels.

Much steeper than image probes (alpha about 2), so each label region spans many voxels.
"""


class Task(str, Enum):
    """Shape of the targets: ``[M]`` class ids or ``[M, *spatial]`` label maps."""

    CLASSIFICATION = "classification"
    SEGMENTATION = "segmentation"


class TargetRule(str, Enum):
    """How probe targets are drawn.

    Attributes:
        UNIFORM: Independent of the inputs and the model (classification: uniform class ids;
            segmentation: random spatially coherent regions).
        MODEL: Sampled from the model's softmax on the probes (the "true Fisher" labels of
            KFAC), computed under ``torch.no_grad()`` in the model's current train/eval mode.
        SHAPES: Segmentation only: smooth foreground blobs on a dominant background
            (:func:`shape_label_maps`), independent of the inputs and the model.
    """

    UNIFORM = "uniform"
    MODEL = "model"
    SHAPES = "shapes"


def sample_model_targets(
    model: nn.Module | None,
    inputs: Tensor,
    *,
    num_classes: int,
    task: Task | str,
    generator: torch.Generator,
) -> Tensor:
    """Sample targets from the model's predictive distribution on ``inputs``.

    The logits are computed under ``torch.no_grad()`` without changing the model's train/eval
    mode; the softmax over dim 1 is moved to the CPU in float64 and one class is drawn per
    sample (classification) or per voxel (segmentation) by inverse-CDF sampling with the CPU
    ``generator``, so the result does not depend on the device. A single-logit output
    ``[M, 1, ...]`` with ``num_classes == 2`` is read as a sigmoid (binary) logit.

    Args:
        model: Network mapping ``inputs`` to logits ``[M, K]`` or ``[M, K, *spatial]``.
        inputs: ``[M, C, *spatial]`` images or ``[M, T]`` token ids, on the model's device.
        num_classes: K.
        task: ``"classification"`` (targets ``[M]``) or ``"segmentation"`` (``[M, *spatial]``).
        generator: CPU generator for the sampling.

    Returns:
        int64 targets on the CPU, ``[M]`` or ``[M, *spatial]``.

    Raises:
        ValueError: If ``model`` is None, the output is not a tensor of the expected shape, or
            the logits are not finite.
    """
    task = check_choice("task", task, Task)
    if model is None:
        raise ValueError(
            "target='model' samples probe labels from the model's softmax, but sample() got "
            "model=None; pass model=... to sample() or use target='uniform'"
        )
    with torch.no_grad():
        logits = model(inputs)
    if not isinstance(logits, Tensor):
        raise ValueError(
            f"target='model' needs the model to return a logits tensor, got "
            f"{type(logits).__name__}; wrap the model so it returns the main output"
        )
    m = inputs.shape[0]
    if task is Task.CLASSIFICATION:
        expected = f"[{m}, {num_classes}]"
        ok = logits.ndim == 2
    else:
        spatial = tuple(inputs.shape[2:])
        expected = f"[{m}, {num_classes}, {', '.join(map(str, spatial))}]"
        ok = tuple(logits.shape[2:]) == spatial
    binary = num_classes == 2 and logits.ndim >= 2 and logits.shape[1] == 1
    ok = ok and logits.shape[0] == m and (logits.shape[1] == num_classes or binary)
    if not ok:
        raise ValueError(
            f"target='model' for {task.value}: expected model output {expected} "
            f"(logits over dim 1), got {list(logits.shape)}"
        )
    logits = logits.detach().to(device="cpu", dtype=torch.float64)
    if not bool(torch.isfinite(logits).all()):
        raise ValueError("target='model': the model returned NaN or inf logits on the probes")
    if binary:
        p1 = torch.sigmoid(logits)
        probs = torch.cat([1.0 - p1, p1], dim=1)
    else:
        probs = torch.softmax(logits, dim=1)
    rows = probs.movedim(1, -1).reshape(-1, num_classes)
    cdf = rows.cumsum(dim=-1)
    u = torch.rand((rows.shape[0], 1), generator=generator, dtype=torch.float64)
    # Inverse CDF: the class is the number of cumulative probabilities strictly below u; the
    # clamp guards against a last cumulative value that rounds to just below 1.
    labels = (cdf < u).sum(dim=-1).clamp_(max=num_classes - 1)
    return labels.reshape(probs.shape[0], *probs.shape[2:])


def uniform_label_maps(
    shape: tuple[int, ...],
    *,
    num: int,
    num_classes: int,
    spacing: tuple[float, ...],
    generator: torch.Generator,
) -> Tensor:
    """``[M, *spatial]`` random label maps: per-voxel argmax of ``num_classes`` smooth fields.

    Each class gets an independent standardised pink-noise field with exponent
    :data:`LABEL_FIELD_ALPHA` (honouring ``spacing``); the label of a voxel is the class whose
    field is largest there. The steep spectrum makes the regions spatially coherent, and the
    exchangeable fields make every class equally likely a priori.
    """
    fields = pink_noise(
        shape,
        batch=num,
        channels=num_classes,
        alpha=LABEL_FIELD_ALPHA,
        spacing=spacing,
        generator=generator,
        dtype=torch.float64,
    )
    return fields.argmax(dim=1)


def shape_label_maps(
    shape: Sequence[int],
    *,
    num: int,
    num_classes: int,
    spacing: Sequence[float],
    generator: torch.Generator,
    foreground: tuple[float, float] = (0.03, 0.25),
) -> Tensor:
    """``[M, *spatial]`` label maps of smooth foreground blobs on a background (class 0).

    The blobs are where a smooth power-law field (exponent :data:`LABEL_FIELD_ALPHA`) exceeds
    its ``1 - f`` quantile, ``f`` drawn uniformly from ``foreground`` per map; inside them the
    class is the argmax of ``K - 1`` further smooth fields. So the background dominates, as in
    medical segmentation, and the foreground classes form adjacent coherent parts.
    """
    shape = tuple(int(s) for s in shape)
    fields = pink_noise(
        shape,
        batch=num,
        channels=num_classes,
        alpha=LABEL_FIELD_ALPHA,
        spacing=tuple(float(s) for s in spacing),
        generator=generator,
        dtype=torch.float32,
    )
    blob = fields[:, 0].flatten(1)
    lo, hi = foreground
    frac = lo + (hi - lo) * torch.rand(num, generator=generator, dtype=torch.float32)
    threshold = torch.stack([torch.quantile(b, 1.0 - f) for b, f in zip(blob, frac)])
    inside = (fields[:, 0] > threshold.view(-1, *([1] * len(shape)))).long()
    if num_classes > 2:
        # argmax over a trailing contiguous axis: the same indices, about 10x faster on the CPU
        # than over the strided channel axis (it dominated data-free pretraining's draws)
        return inside * (1 + fields[:, 1:].movedim(1, -1).contiguous().argmax(dim=-1))
    return inside
