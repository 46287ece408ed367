"""Probe sources: seeded batches of synthetic inputs and targets for the curvature estimator.

The curvature estimator accepts a :class:`ProbeSource`, never a private data loader. A probe
source sees no private data: its inputs are noise with a fixed (cited) spectrum and intensity
rule, and its targets are either uniform random labels or labels sampled from the model's own
predictive distribution on the probes. The model's parameters are already-released outputs of
earlier private steps, so probes built from them are post-processing and cost no privacy budget.

This module holds the contract (:class:`ProbeSource`, :class:`ProbeBatch` and their checks) and
the image source; the target rules are :mod:`dpkfc_med.probes.targets`, the shape volumes
:mod:`dpkfc_med.probes.shapes`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import Enum
from typing import NamedTuple, Protocol, runtime_checkable

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from dpkfc_med.probes.checks import (
    check_num_classes,
    check_positive_int,
    check_seed,
    check_spacing,
    check_spatial_shape,
)
from dpkfc_med.probes.noise import (
    SPECTRUM_CONVENTION,
    IntensityMode,
    match_intensity,
    pink_noise,
    white_noise,
)
from dpkfc_med.probes.presets import ModalityPreset, get_preset
from dpkfc_med.probes.shapes import shape_volumes
from dpkfc_med.probes.targets import (
    LABEL_FIELD_ALPHA,
    TargetRule,
    Task,
    sample_model_targets,
    shape_label_maps,
    uniform_label_maps,
)
from dpkfc_med.utils import check_choice

__all__ = [
    "LABEL_FIELD_ALPHA",
    "ImageProbeSource",
    "NoiseKind",
    "ProbeBatch",
    "ProbeSource",
    "TargetRule",
    "Task",
    "check_probe_batch",
    "sample_model_targets",
    "shape_label_maps",
    "shape_volumes",
]

_CLIP_SD = 3.0  # half-width (in sd) of the clamp used by range intensity mappings


class ProbeBatch(NamedTuple):
    """One batch of probes.

    Attributes:
        inputs: ``[M, C, *spatial]`` float images / volumes, or ``[M, T]`` int64 token ids.
        targets: ``[M]`` int64 class ids, or ``[M, *spatial]`` int64 label maps.
    """

    inputs: Tensor
    targets: Tensor


@runtime_checkable
class ProbeSource(Protocol):
    """Anything that produces seeded probe batches and describes how it made them."""

    def sample(
        self,
        num: int,
        *,
        seed: int,
        model: nn.Module | None = None,
        device: torch.device | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> ProbeBatch:
        """Draw ``num`` probes; ``seed`` (and ``model`` for model-sampled targets) fixes them."""
        ...

    def describe(self) -> dict[str, object]:
        """JSON-serialisable provenance of the probes, for the privacy report."""
        ...


def probe_source_problems(
    source: object,
    *,
    field: str = "probe_source",
    fix: str = "pass a dpkfc_med.probes.ImageProbeSource (or another ProbeSource) and keep the "
    "data in the training loader",
) -> list[str]:
    """Refuse anything but a :class:`ProbeSource`, naming data containers as such.

    Curvature estimates that claim to cost no privacy may only come from probes: a
    ``DataLoader``, ``Dataset`` or tensor (private data, or data of unknown provenance) is
    refused with ``fix``; any other object without ``sample`` and ``describe`` is refused as
    not a probe source.

    Returns:
        Problems as ``"<field> ...; <fix>"`` lines (empty when ``source`` is a probe source).
    """
    kind = type(source).__name__
    if isinstance(source, (DataLoader, Dataset, Tensor)):
        return [
            f"{field} is a {kind}: curvature may only be estimated from synthetic or public "
            f"probes (no private data); {fix}"
        ]
    if not isinstance(source, ProbeSource):
        return [
            f"{field} ({kind}) must have sample(num, *, seed, model, device, dtype) and "
            "describe() (the dpkfc_med.probes.ProbeSource protocol)"
        ]
    return []


class NoiseKind(str, Enum):
    """What image probes look like.

    Attributes:
        PINK: power-law noise (power proportional to f^(-alpha)).
        WHITE: flat-spectrum noise.
        SHAPES: synthetic shape volumes (:func:`shape_volumes`): smooth blobs whose classes
            sit at random contrast steps from the background, plus power-law texture; the
            volumes data-free pretraining trains on. Segmentation targets are then the label
            maps the volumes were drawn from.
    """

    PINK = "pink"
    WHITE = "white"
    SHAPES = "shapes"


def _check_finite(inputs: Tensor, *, source: str) -> None:
    """Raise ValueError if floating ``inputs`` contain NaN or inf."""
    if inputs.is_floating_point() and not bool(torch.isfinite(inputs).all()):
        bad = int((~torch.isfinite(inputs)).sum())
        raise ValueError(
            f"{source}: {bad} of {inputs.numel()} probe input values are NaN or inf; check "
            "alpha, spacing, the intensity range and the dtype (float16 overflows beyond 65504)"
        )


def check_probe_batch(batch: ProbeBatch, *, source: str = "probe source") -> ProbeBatch:
    """Validate a probe batch: finite floating inputs (or int64 ids) and int64 targets.

    Args:
        batch: The batch to check.
        source: Name used in error messages.

    Returns:
        ``batch`` unchanged.

    Raises:
        ValueError: If the inputs contain NaN or inf, the targets are not int64, or the batch
            sizes of inputs and targets differ.
    """
    inputs, targets = batch
    _check_finite(inputs, source=source)
    if targets.dtype != torch.int64:
        raise ValueError(f"{source}: targets must be int64 class ids, got {targets.dtype}")
    if inputs.shape[0] != targets.shape[0]:
        raise ValueError(
            f"{source}: {inputs.shape[0]} inputs but {targets.shape[0]} targets in one batch"
        )
    return batch


class ImageProbeSource:
    """Pink- or white-noise images / volumes with uniform or model-sampled targets.

    Every call to :meth:`sample` seeds a fresh CPU ``torch.Generator`` with ``seed``, so
    ``(seed, num)`` (and, for ``target="model"``, the model's parameters and mode) fully
    determine the batch on every device. Inputs are drawn first, then targets.

    Args:
        spatial_shape: ``(W,)``, ``(H, W)`` or ``(D, H, W)`` of the private data.
        channels: Number of input channels C of the private data (independent noise fields);
            None uses the preset's usual count (1, or 3 for RGB presets).
        num_classes: Number of classes K (>= 2; include the background for segmentation).
        task: ``"classification"`` (targets ``[M]``) or ``"segmentation"``
            (targets ``[M, *spatial]``).
        kind: ``"pink"`` (power law), ``"white"`` or ``"shapes"`` (:func:`shape_volumes`,
            segmentation only; targets are the volumes' own label maps unless
            ``target="model"``).
        alpha: Power-spectrum exponent (power proportional to f^(-alpha)) of the noise or of
            the shapes' texture; default: the preset's. Not for ``kind="white"``.
        preset: Modality preset name or :class:`~dpkfc_med.probes.presets.ModalityPreset`
            supplying the default exponent and intensity mapping.
        spacing: Voxel spacing in mm per spatial axis (default 1.0).
        intensity: Override of the preset's intensity mapping: ``"zscore"``, ``"unit_range"``
            or a ``(low, high)`` pair (clamp to +-3 sd, then map affinely onto the range).
        target: ``"uniform"`` or ``"model"`` (see :class:`TargetRule`).

    Raises:
        ValueError: On any invalid option; the message names the field and the allowed values.

    Example:
        >>> src = ImageProbeSource((32, 48), channels=1, num_classes=3, preset="xray")
        >>> batch = src.sample(4, seed=0)
        >>> tuple(batch.inputs.shape), tuple(batch.targets.shape)
        ((4, 1, 32, 48), (4,))
    """

    def __init__(
        self,
        spatial_shape: Sequence[int],
        *,
        channels: int | None,
        num_classes: int,
        task: Task | str = Task.CLASSIFICATION,
        kind: NoiseKind | str = NoiseKind.PINK,
        alpha: float | None = None,
        preset: str | ModalityPreset = "natural",
        spacing: float | Sequence[float] | None = None,
        intensity: IntensityMode | str | tuple[float, float] | None = None,
        target: TargetRule | str = TargetRule.UNIFORM,
    ) -> None:
        self.spatial_shape = check_spatial_shape(spatial_shape)
        self.preset = get_preset(preset)
        # The data's channel count wins over the preset's usual one (e.g. 4-sequence MRI).
        self.channels = check_positive_int(
            self.preset.channels if channels is None else channels, "channels"
        )
        self.num_classes = check_num_classes(num_classes)
        self.task = check_choice("task", task, Task)
        self.kind = check_choice("kind", kind, NoiseKind)
        self.spacing = check_spacing(spacing, len(self.spatial_shape))
        self.target = check_choice("target", target, TargetRule)
        if self.target is TargetRule.SHAPES and self.task is not Task.SEGMENTATION:
            raise ValueError(
                "target='shapes' draws label maps and applies to task='segmentation'; use "
                "'uniform' or 'model' for classification"
            )
        if self.kind is NoiseKind.SHAPES and self.task is not Task.SEGMENTATION:
            raise ValueError(
                "kind='shapes' draws segmentation volumes with their label maps and applies to "
                "task='segmentation'; use kind='pink' or 'white' for classification"
            )

        if self.kind is NoiseKind.WHITE:
            if alpha is not None:
                raise ValueError(
                    f"alpha={alpha!r} applies only to kind='pink'; white noise has alpha 0 "
                    "(drop alpha or use kind='pink')"
                )
            self.alpha: float | None = None
        else:
            self.alpha = self.preset.alpha if alpha is None else float(alpha)
            if not math.isfinite(self.alpha):
                raise ValueError(f"alpha={alpha!r} must be a finite number")

        self.intensity_mode, self.low, self.high = self._resolve_intensity(intensity)

    def _resolve_intensity(
        self, intensity: IntensityMode | str | tuple[float, float] | None
    ) -> tuple[IntensityMode, float | None, float | None]:
        """Intensity mapping ``(mode, low, high)`` from the override or the preset."""
        if intensity is None:
            return self.preset.intensity, self.preset.low, self.preset.high
        if isinstance(intensity, IntensityMode | str):
            mode = check_choice("intensity", intensity, IntensityMode)
            if mode is IntensityMode.RANGE:
                raise ValueError(
                    "intensity='range' needs bounds; pass intensity=(low, high) instead"
                )
            if mode is IntensityMode.UNIT_RANGE:
                return mode, 0.0, 1.0
            return mode, None, None
        if isinstance(intensity, Sequence) and len(intensity) == 2:
            low, high = (float(v) for v in intensity)
            if not (math.isfinite(low) and math.isfinite(high) and low < high):
                raise ValueError(
                    f"intensity={intensity!r} must be a finite (low, high) pair with low < high"
                )
            return IntensityMode.RANGE, low, high
        raise ValueError(
            f"intensity={intensity!r} must be None (use the preset), one of "
            f"{[m.value for m in IntensityMode if m is not IntensityMode.RANGE]} "
            "or a (low, high) pair"
        )

    def sample(
        self,
        num: int,
        *,
        seed: int,
        model: nn.Module | None = None,
        device: torch.device | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> ProbeBatch:
        """Draw ``num`` probes.

        Args:
            num: Number of probes M.
            seed: Seed of the CPU generator that draws this batch (inputs, then targets).
            model: Required for ``target="model"``: maps ``[M, C, *spatial]`` to logits
                ``[M, K]`` (classification) or ``[M, K, *spatial]`` (segmentation); it must
                live on ``device``. Ignored otherwise.
            device: Device of the returned tensors (default CPU).
            dtype: Floating dtype of the inputs.

        Returns:
            ``ProbeBatch(inputs [M, C, *spatial], targets [M] or [M, *spatial] int64)``.

        Raises:
            ValueError: On invalid arguments, a missing or mismatching model, or non-finite
                probes.
        """
        check_positive_int(num, "num")
        check_seed(seed)
        if not dtype.is_floating_point:
            raise ValueError(f"dtype={dtype} must be a floating dtype for image probes")
        generator = torch.Generator().manual_seed(seed)
        drawn_labels = None
        if self.kind is NoiseKind.SHAPES:
            assert self.alpha is not None
            noise, drawn_labels = shape_volumes(
                self.spatial_shape,
                num=num,
                channels=self.channels,
                num_classes=self.num_classes,
                spacing=self.spacing,
                alpha=self.alpha,
                generator=generator,
            )
        elif self.kind is NoiseKind.PINK and self.alpha is not None:
            noise = pink_noise(
                self.spatial_shape,
                batch=num,
                channels=self.channels,
                alpha=self.alpha,
                spacing=self.spacing,
                generator=generator,
                dtype=torch.float64,
            )
        else:
            noise = white_noise(
                self.spatial_shape,
                batch=num,
                channels=self.channels,
                generator=generator,
                dtype=torch.float64,
            )
        inputs = match_intensity(
            noise, low=self.low, high=self.high, mode=self.intensity_mode, clip_sd=_CLIP_SD
        ).to(device=device, dtype=dtype)
        # Checked before any model sees the probes, so NaNs never reach the target sampler.
        _check_finite(inputs, source=repr(self))

        if self.target is TargetRule.MODEL:
            targets = sample_model_targets(
                model, inputs, num_classes=self.num_classes, task=self.task, generator=generator
            )
        elif self.task is Task.CLASSIFICATION:
            targets = torch.randint(self.num_classes, (num,), generator=generator)
        elif drawn_labels is not None:  # shape volumes: the label maps they were drawn from
            targets = drawn_labels
        elif self.target is TargetRule.SHAPES:
            targets = shape_label_maps(
                self.spatial_shape,
                num=num,
                num_classes=self.num_classes,
                spacing=self.spacing,
                generator=generator,
            )
        else:
            targets = uniform_label_maps(
                self.spatial_shape,
                num=num,
                num_classes=self.num_classes,
                spacing=self.spacing,
                generator=generator,
            )
        return check_probe_batch(ProbeBatch(inputs, targets.to(device=device)), source=repr(self))

    def describe(self) -> dict[str, object]:
        """JSON-serialisable provenance of the probes, for the privacy report."""
        if self.intensity_mode is IntensityMode.ZSCORE:
            rule = "standardised noise left as is (zero mean, unit std per sample and channel)"
        else:
            rule = (
                f"clamp standardised noise to +-{_CLIP_SD:g} sd, then map "
                f"[-{_CLIP_SD:g}, {_CLIP_SD:g}] affinely onto [{self.low:g}, {self.high:g}]"
            )
        if self.target is TargetRule.MODEL:
            target_rule = (
                "sampled from softmax(model(probes)) over dim 1 under torch.no_grad() in the "
                "model's current mode (model parameters are already-released outputs)"
            )
        elif self.task is Task.CLASSIFICATION:
            target_rule = "uniform random class ids"
        elif self.kind is NoiseKind.SHAPES:
            target_rule = "the label maps the shape volumes were drawn from"
        elif self.target is TargetRule.SHAPES:
            target_rule = (
                "smooth foreground blobs (3-25 % of voxels) on a background, split between the "
                f"foreground classes by smooth fields (alpha={LABEL_FIELD_ALPHA:g})"
            )
        else:
            target_rule = (
                f"per-voxel argmax of {self.num_classes} independent standardised pink-noise "
                f"fields with alpha={LABEL_FIELD_ALPHA:g} (spatially coherent random regions)"
            )
        return {
            "source": type(self).__name__,
            "uses_private_data": False,
            "task": self.task.value,
            "kind": self.kind.value,
            "alpha": self.alpha,
            "spectrum_convention": SPECTRUM_CONVENTION,
            "spatial_shape": list(self.spatial_shape),
            "channels": self.channels,
            "num_classes": self.num_classes,
            "spacing_mm": list(self.spacing),
            "preset": self.preset.name,
            "preset_citation": self.preset.citation,
            "intensity": {
                "mode": self.intensity_mode.value,
                "low": self.low,
                "high": self.high,
                "clip_sd": None if self.intensity_mode is IntensityMode.ZSCORE else _CLIP_SD,
                "rule": rule,
            },
            "target": self.target.value,
            "target_rule": target_rule,
            "seed_rule": "each sample(num, seed=s) call draws from torch.Generator('cpu') "
            "seeded with s: inputs first, then targets",
        }

    def __repr__(self) -> str:
        return (
            f"ImageProbeSource(spatial_shape={self.spatial_shape}, channels={self.channels}, "
            f"num_classes={self.num_classes}, task={self.task.value!r}, "
            f"kind={self.kind.value!r}, alpha={self.alpha}, preset={self.preset.name!r}, "
            f"target={self.target.value!r})"
        )
