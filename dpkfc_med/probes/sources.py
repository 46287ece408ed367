"""Probe sources: seeded batches of synthetic inputs and targets for the curvature estimator.

The curvature estimator accepts a :class:`ProbeSource`, never a private data loader. A probe
source sees no private data: its inputs are noise with a fixed (cited) spectrum and intensity
rule, and its targets are either uniform random labels or labels sampled from the model's own
predictive distribution on the probes. The model's parameters are already-released outputs of
earlier private steps, so probes built from them are post-processing and cost no privacy budget.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import Enum
from typing import NamedTuple, Protocol, runtime_checkable

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from dpkfc_med.probes.noise import (
    SPECTRUM_CONVENTION,
    IntensityMode,
    _check_positive_int,
    _check_spacing,
    _check_spatial_shape,
    match_intensity,
    pink_noise,
    white_noise,
)
from dpkfc_med.probes.presets import ModalityPreset, get_preset
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

LABEL_FIELD_ALPHA = 4.0
"""Power-spectrum exponent of the fields whose per-voxel argmax gives uniform segmentation labels.

Much steeper than image probes (alpha about 2), so each label region spans many voxels.
"""

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


def _check_seed(seed: int) -> int:
    """Return ``seed`` if it is a non-negative int (what ``Generator.manual_seed`` accepts)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise ValueError(f"seed={seed!r} must be an int in [0, 2**64)")
    return seed


def _check_num_classes(num_classes: int) -> int:
    """Return ``num_classes`` if it is an int >= 2."""
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
        raise ValueError(f"num_classes={num_classes!r} must be an int >= 2")
    return num_classes


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


def _uniform_label_maps(
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


TEXTURE_AMPLITUDE = 0.5
"""Standard deviation of the shape volumes' texture relative to the class contrast step."""


def shape_volumes(
    shape: Sequence[int],
    *,
    num: int,
    channels: int = 1,
    num_classes: int,
    spacing: Sequence[float],
    alpha: float,
    generator: torch.Generator,
    foreground: tuple[float, float] = (0.03, 0.25),
) -> tuple[Tensor, Tensor]:
    """Synthetic segmentation volumes: smooth shapes of distinct intensity on textured background.

    Each label map is :func:`shape_label_maps`; in every channel, class ``c`` sits ``c``
    random contrast steps (step in [0.5, 1.5), random sign, drawn per volume and channel) from
    the background, plus power-law texture of exponent ``alpha`` and relative amplitude
    :data:`TEXTURE_AMPLITUDE`; each volume and channel is then standardised. The classes are
    told apart by their ordering, not by one fixed intensity. Drawn from ``generator`` only:
    labels, then per channel the step, the sign and the texture.

    Args:
        shape: spatial shape ``(D, H, W)`` (any number of spatial axes).
        num: volumes to draw.
        channels: image channels (one label map, independent contrasts and textures).
        num_classes: ``K`` including the background (class 0).
        spacing: voxel spacing per axis (the fields' smoothness is isotropic in mm).
        alpha: exponent of the texture's power spectrum.
        generator: the CPU generator that draws everything.
        foreground: range of the foreground fraction of a volume.

    Returns:
        ``(images [num, C, *S] float64, labels [num, *S] int64)``.
    """
    shape = tuple(int(s) for s in shape)
    spacing = tuple(float(s) for s in spacing)
    labels = shape_label_maps(
        shape,
        num=num,
        num_classes=num_classes,
        spacing=spacing,
        generator=generator,
        foreground=foreground,
    )
    dims = tuple(range(1, len(shape) + 1))
    images = []
    for _ in range(channels):
        step = 0.5 + torch.rand(num, 1, generator=generator, dtype=torch.float32)
        sign = torch.where(torch.rand(num, 1, generator=generator) < 0.5, -1.0, 1.0).double()
        means = sign * step * torch.arange(num_classes, dtype=torch.float32)
        image = torch.gather(means, 1, labels.flatten(1)).view(num, *shape)
        texture = pink_noise(
            shape, batch=num, alpha=alpha, spacing=spacing, generator=generator, dtype=torch.float32
        )[:, 0]
        image = image + TEXTURE_AMPLITUDE * texture
        image = (image - image.mean(dims, keepdim=True)) / image.std(dims, keepdim=True).clamp_min(
            1e-6
        )
        images.append(image)
    return torch.stack(images, dim=1), labels


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
        self.spatial_shape = _check_spatial_shape(spatial_shape)
        self.preset = get_preset(preset)
        # The data's channel count wins over the preset's usual one (e.g. 4-sequence MRI).
        self.channels = _check_positive_int(
            self.preset.channels if channels is None else channels, "channels"
        )
        self.num_classes = _check_num_classes(num_classes)
        self.task = check_choice("task", task, Task)
        self.kind = check_choice("kind", kind, NoiseKind)
        self.spacing = _check_spacing(spacing, len(self.spatial_shape))
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
        _check_positive_int(num, "num")
        _check_seed(seed)
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
            targets = _uniform_label_maps(
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
