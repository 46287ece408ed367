"""Segmentation task: NIfTI / PNG folders, one volume or image per privacy unit, Dice by windows.

The trainer (:mod:`.loop`) is generic; this module tells it how to read a segmentation folder
(``imagesTr/`` + ``labelsTr/`` or an MSD ``dataset.json``; ``images/`` + ``masks/`` of PNG),
how to batch patches, which losses to use and how to evaluate. One code path serves 3D
volumes, 2D images and 2D slices of volumes (:mod:`.segmentation_layout`): the number of
spatial axes is a value, as in MONAI.

Privacy unit:
    One item of the training set is one *volume* (one case / patient in MSD data) holding its
    ``k = data.patches_per_unit`` random patches (2D: one image and its patches; slices of
    volumes: one volume and its ``data.slices.per_unit`` slices). Poisson sampling therefore
    draws volumes, and :meth:`SegmentationTask.unpack` hands the trainer one unit id per patch,
    so the optimizer sums the ``k`` per-patch gradients of a volume *before* clipping
    (:meth:`~dpkfc_med.privacy.optimizer.ScaleThenPrivatizeOptimizer.set_unit_ids`): adding or
    removing a patient moves the clipped sum by at most ``C`` whatever ``k`` is.

Random patches:
    Each volume's patches draw from its own random stream, seeded by ``training.seed``, the
    case ID and how often that volume was drawn before
    (:func:`~dpkfc_med.data.units.unit_random_state`), never from one stream shared by all
    volumes, so a volume's patches (and its clipped gradient) do not depend on which other
    volumes the Poisson sampler drew.

Split:
    Each case's train/val/test split is a function of its own ID, the fractions
    ``data.split_fractions`` and ``training.seed`` only (a keyed hash,
    :func:`~dpkfc_med.data.deterministic_split`), so adding or removing one case of the folder
    changes the split of that case only; split sizes are binomial around the fractions.
    ``data.max_train``/``max_eval`` keep the first ``n`` IDs of each split. The split is
    recorded in the privacy report (``data.split``) and written to ``split.json`` in the run
    directory.

Preprocessing uses per-volume statistics only (z-score over nonzero voxels), so no dataset-wide
statistic of the private data is released. Evaluation reads whole volumes (padded to at least
the patch size) with :func:`monai.inferers.sliding_window_inference` and reports Dice per
foreground class (:class:`monai.metrics.DiceMetric`); a 2D network trained on slices predicts
each whole volume slice by slice (:class:`monai.inferers.SliceInferer`), so its Dice and HD95
are per volume (patient), as for a 3D network.
"""

from __future__ import annotations

import hashlib
import logging
import warnings
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset

from dpkfc_med.data import (
    DataNotFoundError,
    DataValidationError,
    SegmentationCases,
    VolumeDataset,
    deterministic_split,
    load_segmentation_folder,
    resolve_data_path,
    save_split,
    segmentation_transforms,
    sha256_file,
)
from dpkfc_med.training.config import ConfigError, RunConfig
from dpkfc_med.training.segmentation_layout import (
    UNIT_VOLUME,
    SegmentationLayout,
    case_shape_problems,
    resolve_layout,
)
from dpkfc_med.training.tasks import TASK_BUILDERS, Task

__all__ = [
    "PRIVACY_UNIT",
    "SegmentationTask",
    "VolumeCollate",
    "build_segmentation_task",
    "dice_scores",
]

log = logging.getLogger("dpkfc_med")

PRIVACY_UNIT = UNIT_VOLUME
"""Name of the privacy unit in reports (one case of the folder)."""

SPLITS = ("train", "val", "test")
NUM_OVERLAYS = 3
SW_OVERLAP = 0.25  # sliding-window overlap used for evaluation and overlays


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


class _CachedVolumes(Dataset):
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


class _CachedPrefix:
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

    def set_random_state(self, seed: int | None = None, state: Any = None) -> _CachedPrefix:
        """Seed the random (patch-sampling) part."""
        self.suffix.set_random_state(seed=seed, state=state)
        return self

    def __call__(self, record: dict[str, Any]) -> Any:
        key = record["case_id"]
        if key not in self._cache:
            self._cache[key] = self.prefix(dict(record))
        return self.suffix(dict(self._cache[key]))


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


def _voxel_spacing(image: Tensor, fallback: Sequence[float] | None) -> list[float] | None:
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


class SegmentationTask(Task):
    """Dense segmentation of 3D volumes or 2D images; the unit is the volume (patient) or image.

    A 2D network trained on slices (``extra["slices"]``, a
    :class:`~dpkfc_med.data.slices.SliceRule`) is evaluated on whole volumes, slice by slice.
    """

    _loss_fn: Any = None

    @property
    def slices(self) -> Any:
        """The slice rule of a run on slices of volumes, else ``None``."""
        return self.extra.get("slices")

    def per_sample_loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
        """Dice + cross-entropy of each patch ``[N]`` (MONAI ``DiceLoss``, ``batch=False``).

        Each patch's term is its soft Dice loss averaged over classes plus its cross-entropy
        averaged over voxels; their batch mean is MONAI's ``DiceCELoss(batch=False)``. The
        optimizer sums the ``k`` patches of a volume before clipping. The Dice term keeps the
        small foreground classes from being swamped by background voxels, which otherwise
        stalls noisy training at "all background".

        Args:
            outputs: logits ``[N, K, *p]``.
            targets: class ids ``[N, *p]``.
        """
        if self._loss_fn is None:
            from monai.losses import DiceLoss

            self._loss_fn = DiceLoss(to_onehot_y=True, softmax=True, batch=False, reduction="none")
        dice = self._loss_fn(outputs, targets.unsqueeze(1)).flatten(1).mean(1)
        ce = F.cross_entropy(outputs, targets, reduction="none").flatten(1).mean(1)
        return dice + ce

    def unit_scores(
        self, model: nn.Module, split: str, device: torch.device, batch_size: int
    ) -> np.ndarray:
        """Each case's Dice of ``split``, averaged over the foreground classes it defines.

        A class absent from both ground truth and prediction does not count; a case with no
        foreground anywhere scores 1.
        """
        data: _CachedVolumes = self.extra["splits"][split]
        was = model.training
        model.eval()
        scores = []
        try:
            for i in range(len(data)):
                item = data[i]
                pred = self.predict(model, item["image"], device, batch_size)
                row = dice_scores(pred, item["label"], self.num_classes).numpy()[0]
                finite = row[np.isfinite(row)]
                scores.append(float(np.clip(finite.mean(), 0, 1)) if finite.size else 1.0)
        finally:
            model.train(was)
        return np.array(scores)

    def probe_loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
        """Per-probe loss ``[M]``: mean over voxels of the cross-entropy."""
        return F.cross_entropy(outputs, targets, reduction="none").flatten(1).mean(1)

    def unpack(self, batch: Any) -> tuple[Tensor, Tensor, Tensor | None]:
        """Flatten ``B`` volumes of ``k`` patches into ``B * k`` samples with unit ids.

        Returns:
            inputs ``[B*k, C, *p]`` float, targets ``[B*k, *p]`` int64 and unit ids ``[B*k]``
            (``arange(B).repeat_interleave(k)``: the patches of volume ``b`` share id ``b``).
            A batch of volumes with different ``k`` (:class:`VolumeCollate` with ``None``)
            is already flat and brings its ``unit`` ids.
        """
        if "unit" in batch:
            return batch["image"], batch["label"].squeeze(1).long(), batch["unit"]
        image, label = batch["image"], batch["label"]
        b, k = image.shape[0], image.shape[1]
        x = image.flatten(0, 1)
        y = label.flatten(0, 1).squeeze(1).long()
        units = torch.arange(b).repeat_interleave(k)
        return x, y, units

    @property
    def patch_size(self) -> tuple[int, ...]:
        """Training patch (and sliding-window) size."""
        return tuple(self.spatial_shape)

    @torch.no_grad()
    def predict(
        self, model: nn.Module, image: Tensor, device: torch.device, batch_size: int
    ) -> Tensor:
        """Class ids ``[N, 1, *S]`` of whole volumes ``[N, C, *S]`` by sliding windows.

        A 2D network on slices predicts each slice across the slice axis
        (:class:`monai.inferers.SliceInferer`), each with 2D sliding windows.
        """
        from monai.inferers import SliceInferer, sliding_window_inference

        sw = max(1, int(batch_size))
        if self.slices is not None:
            inferer = SliceInferer(
                spatial_dim=self.slices.axis,
                roi_size=self.patch_size,
                sw_batch_size=sw,
                overlap=SW_OVERLAP,
                progress=False,
            )
            logits = inferer(image.to(device), model)
        else:
            logits = sliding_window_inference(
                image.to(device),
                roi_size=self.patch_size,
                sw_batch_size=sw,
                predictor=model,
                overlap=SW_OVERLAP,
            )
        return torch.as_tensor(logits).argmax(1, keepdim=True).cpu()

    def evaluate(
        self,
        model: nn.Module,
        split: str,
        device: torch.device,
        batch_size: int,
        *,
        full: bool = False,
    ) -> dict[str, Any]:
        """Dice (and optionally Hausdorff-95) per foreground class on the volumes of ``split``.

        Args:
            model: the network (evaluated in eval mode; its mode is restored afterwards).
            split: ``"train"``, ``"val"``, ``"test"`` or ``"all"`` (every case of the folder).
            device: where the model lives.
            batch_size: windows per forward pass of the sliding-window inferer.
            full: the final evaluation: also the symmetric 95th-percentile Hausdorff distance
                per class, in mm (:func:`hausdorff95_scores`).

        Returns:
            ``{"mean_dice", "dice_per_class": {name: dice}, "n": cases}``; a class's Dice is the
            mean over the cases that contain it, ``mean_dice`` the mean over classes. With
            ``full``: ``hd95_per_class`` (mean over the cases where both prediction and
            ground truth hold the class) and ``hd95_missed_cases`` (cases whose prediction
            misses a class that the ground truth holds).
        """
        data: _CachedVolumes = self.extra["splits"][split]
        was = model.training
        model.eval()
        rows, hd_rows = [], []
        try:
            for i in range(len(data)):
                item = data[i]
                pred = self.predict(model, item["image"], device, batch_size)
                rows.append(dice_scores(pred, item["label"], self.num_classes))
                if full:
                    spacing = _voxel_spacing(item["image"], self.spacing)
                    hd_rows.append(
                        hausdorff95_scores(pred, item["label"], self.num_classes, spacing)
                    )
        finally:
            model.train(was)
        names = self._foreground_names()
        if rows:
            per_case = torch.cat(rows).numpy().astype(np.float64)
            with np.errstate(all="ignore"):
                per_class = [
                    float(np.nanmean(col)) if np.isfinite(col).any() else float("nan")
                    for col in per_case.T
                ]
        else:
            per_class = [float("nan")] * len(names)
        finite = [v for v in per_class if np.isfinite(v)]
        out: dict[str, Any] = {
            "mean_dice": float(np.mean(finite)) if finite else float("nan"),
            "dice_per_class": dict(zip(names, per_class)),
            "n": len(data),
        }
        if hd_rows:
            hd = torch.cat(hd_rows).numpy().astype(np.float64)
            hd95, missed = [], []
            for col in hd.T:
                ok = col[np.isfinite(col)]
                hd95.append(float(ok.mean()) if len(ok) else float("nan"))
                missed.append(int(np.isinf(col).sum()))
            out["hd95_per_class"] = dict(zip(names, hd95))
            out["hd95_missed_cases"] = dict(zip(names, missed))
            out["hd95_unit"] = (
                "pixels (PNG / JPEG carry no pixel size)"
                if self.extra.get("reader") == "PILReader"
                else "mm (voxel spacing of each volume's header)"
            )
        if self.slices is not None:
            out["per"] = "volume (each patient's slices predicted and scored together)"
        return out

    def _foreground_names(self) -> list[str]:
        names = self.label_names or [f"class_{c}" for c in range(self.num_classes)]
        return list(names[1:])

    def after_training(self, model: nn.Module, run_dir: Path, device: torch.device) -> None:
        """Write ``split.json`` and PNG overlays of a few validation cases into ``run_dir``.

        The overlays show private images: they are for the data custodian, are not covered by
        the privacy guarantee, and must not be released with the model.
        """
        save_split(self.extra["split_ids"], Path(run_dir) / "split.json")
        try:
            self.write_overlays(model, Path(run_dir) / "overlays", device)
        except Exception as err:  # figures are a convenience; never fail a finished run on them
            log.warning("overlays not written: %s: %s", type(err).__name__, err)

    def write_overlays(
        self, model: nn.Module, out_dir: Path, device: torch.device, num: int = NUM_OVERLAYS
    ) -> list[Path]:
        """PNG overlays (a 2D image whole, a volume's middle slice) of the first ``num`` cases.

        Each figure shows the image in grey, the ground truth, and the prediction (filled
        colours, with the ground-truth contours drawn over the prediction).

        Returns:
            The written files (``out_dir/<case_id>.png``).
        """
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import ListedColormap

        split = "val" if len(self.extra["splits"]["val"]) else "test"
        data: _CachedVolumes = self.extra["splits"][split]
        out_dir.mkdir(parents=True, exist_ok=True)
        k = self.num_classes
        palette = ["#000000", "#e6194b", "#3cb44b", "#4363d8", "#f58231", "#911eb4", "#46f0f0"]
        colours = [palette[1 + (c - 1) % (len(palette) - 1)] for c in range(1, k)]
        cmap = ListedColormap(colours)
        names = self._foreground_names()
        # pictures have their first row at the top; NIfTI volumes are shown radiologically
        origin = "upper" if self.extra.get("reader") == "PILReader" else "lower"
        written = []
        was = model.training
        model.eval()
        try:
            for i in range(min(num, len(data))):
                item = data[i]
                pred = self.predict(model, item["image"], device, 4)
                dice = dice_scores(pred, item["label"], k)[0].tolist()
                image = item["image"][0, 0].numpy()
                label = item["label"][0, 0].numpy()
                guess = pred[0, 0].numpy()
                # volumes: the middle slice across the slice axis (default the last NIfTI
                # voxel axis, axial in RAS volumes); 2D images whole
                axis = self.slices.axis if self.slices is not None else 2
                z = image.shape[axis] // 2 if image.ndim == 3 else None
                img, gt, pr = (
                    (a if z is None else np.take(a, z, axis=axis)).T for a in (image, label, guess)
                )
                fig, axes = plt.subplots(1, 3, figsize=(9, 3.4))
                for ax, title, mask in (
                    (axes[0], "image", None),
                    (axes[1], "ground truth", gt),
                    (axes[2], "prediction (GT contours)", pr),
                ):
                    ax.imshow(img, cmap="gray", origin=origin)
                    if mask is not None:
                        shown = np.ma.masked_where(mask == 0, mask - 1)
                        ax.imshow(
                            shown,
                            cmap=cmap,
                            vmin=0,
                            vmax=max(k - 2, 1),
                            alpha=0.5,
                            origin=origin,
                            interpolation="nearest",
                        )
                    ax.set_title(title, fontsize=9)
                    ax.axis("off")
                for c in range(1, k):
                    if (gt == c).any() and (gt != c).any():
                        axes[2].contour(
                            gt == c, levels=[0.5], colors=[colours[c - 1]], linewidths=0.8
                        )
                scores = ", ".join(f"{n} {d:.3f}" for n, d in zip(names, dice))
                where = "" if z is None else f", slice {'xyz'[axis]}={z}"
                fig.suptitle(f"{data.case_ids[i]} ({split}){where}: Dice {scores}", fontsize=9)
                fig.tight_layout()
                path = out_dir / f"{data.case_ids[i]}.png"
                fig.savefig(path, dpi=100)
                plt.close(fig)
                written.append(path)
        finally:
            model.train(was)
        return written


# ------------------------------------------------------------------------------- builder
# The probes' shape and voxel spacing and the number of classes shape the preconditioner and
# the refresh schedule. Taken from the private cases (the largest volume, the median header
# spacing, the largest label value) they would differ between two datasets that differ in one
# patient, so the preconditioner would no longer be post-processing. They come from the config
# (or the folder's declared task description); the data only *suggests* values, printed for the
# custodian in the error, never used silently.
def _patch_size(
    cfg: RunConfig, cases: SegmentationCases, layout: SegmentationLayout, problems: list[str]
) -> tuple[int, ...]:
    """The configured training patch (required), one size per spatial axis of the layout."""
    n = layout.spatial_dims
    if cfg.data.patch_size is None:
        biggest = np.max([layout.plane(c.shape) for c in cases if len(c.shape) >= n], axis=0)
        hint = [int(-(-s // 16) * 16) for s in biggest]
        what = "slices" if layout.slices is not None else ("volumes" if n == 3 else "images")
        problems.append(
            "data.patch_size: required for segmentation (the probes' shape must come from the "
            f"config, not from the private {what}); whole {what} padded to the largest case "
            f"here would be {hint} (for the custodian: derived from the private data, not used)"
        )
        return (16,) * n
    p = list(cfg.data.patch_size)
    if len(p) != n or any(not isinstance(s, int) or s < 1 for s in p):
        if len(p) in (2, 3) and len(p) != n:
            return (16,) * n  # the layout already named the length
        problems.append(f"data.patch_size={p!r}: must be {n} positive integers, e.g. {[32] * n}")
        return (16,) * n
    return tuple(p)


def _spacing(
    cfg: RunConfig, cases: SegmentationCases, layout: SegmentationLayout, problems: list[str]
) -> tuple[tuple[float, ...], str]:
    """The configured voxel spacing of the probes (required), in-plane for slices."""
    n = layout.spatial_dims
    if cfg.data.spacing is not None:
        s = [float(v) for v in cfg.data.spacing]
        if len(s) != n or any(not v > 0 for v in s):
            where = " (in-plane: the slices' two axes)" if layout.slices is not None else ""
            problems.append(f"data.spacing={s!r}: must be {n} positive numbers in mm{where}")
        return tuple(s), "data.spacing"
    rows = [layout.plane(c.spacing) for c in cases if len(c.spacing) >= n]
    med = np.median(np.asarray(rows, dtype=np.float64), axis=0)
    hint = [round(float(v), 3) for v in med]
    problems.append(
        "data.spacing: required for segmentation (the probes' voxel spacing in mm must come "
        "from the config or the protocol, not from the private NIfTI headers); the headers' "
        f"median here is {hint} (for the custodian: derived from the private data, not used)"
    )
    return (1.0,) * n, "unset"


def _label_names(cases: SegmentationCases, num_classes: int) -> list[str]:
    declared = cases.label_names or {}
    return [declared.get(c, "background" if c == 0 else f"class_{c}") for c in range(num_classes)]


def _undeclared_num_classes(cases: SegmentationCases) -> int:
    """Classes of a folder without declared labels: the largest label value + 1."""
    from dpkfc_med.data.nifti import _read_array

    top = 0
    for case in cases:
        top = max(top, int(_read_array(case.label_path).max()))
    return max(2, top + 1)


def _fingerprint(cases: SegmentationCases) -> str:
    """SHA-256 of the manifest ``case_id image_sha256 label_sha256`` of ``cases`` (sorted)."""
    lines = [
        f"{c.case_id} {sha256_file(c.image_path)} {sha256_file(c.label_path)}\n" for c in cases
    ]
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def _same_folder(a: Path, spec: str) -> bool:
    try:
        return resolve_data_path(spec, kind="dir") == a
    except (DataNotFoundError, ValueError):
        return False


def build_segmentation_task(cfg: RunConfig, data_path: str | None = None) -> SegmentationTask:
    """Read and validate a segmentation folder into a :class:`SegmentationTask`.

    Every case in use is checked before anything is written (pairing, headers, image/label
    shape, readability, label values against the declared classes, and whether its image fits
    the run's 2D / 3D layout); errors name the case and the file.

    Args:
        cfg: the run configuration (``data.*``, ``training.seed``).
        data_path: another folder of the same task (evaluation); default ``cfg.data.path``.

    Returns:
        The task; ``extra["splits"]`` holds evaluation datasets ``train``/``val``/``test`` and
        ``all`` (every case of the folder), ``extra["split_ids"]`` the case IDs per split.

    Raises:
        DataValidationError: a bad case (named) or folder layout.
        DataNotFoundError: the folder does not exist.
        ConfigError: bad ``data.patch_size`` / ``data.spacing`` / ``data.split_fractions`` /
            ``data.spatial_dims`` / ``data.slices``.
    """
    if cfg.data.resize is not None:
        raise ConfigError(
            [
                "data.resize applies to classification images; segmentation trains on "
                "data.patch_size patches of the volumes at their own voxel grid: drop data.resize"
            ]
        )
    spec = data_path or cfg.data.path
    root = resolve_data_path(spec, kind="dir")
    # A folder of DICOM series is converted once into NIfTI in the run's custodian folder.
    dicom_cache = cfg.run_dir() / "private_not_for_release" / "dicom_cache"
    cases = load_segmentation_folder(
        root, dicom_series=cfg.data.dicom_series, cache_dir=dicom_cache
    )
    if cases.num_classes is None and cfg.data.num_classes is not None:
        # classes declared in the config: every case's label values are checked against them
        # now, before any pretraining or training (naming the case), not mid-run
        cases = replace(cases, num_classes=cfg.data.num_classes)
    fractions, seed = cfg.data.split_fractions, cfg.training.seed
    try:  # an empty split is reported below, after the cases: a bad case is named first
        split_ids = deterministic_split(cases.case_ids, fractions, seed, allow_empty=True)
    except ValueError as err:
        raise ConfigError([f"data.split_fractions={fractions!r}: {err}"]) from None
    caps = {"train": cfg.data.max_train, "val": cfg.data.max_eval, "test": cfg.data.max_eval}
    for name, cap in caps.items():
        if cap is not None:
            split_ids[name] = split_ids[name][:cap]
    used = sorted({c for ids in split_ids.values() for c in ids})
    own_data = data_path is None or _same_folder(root, cfg.data.path)
    # Foreign data is evaluated on every case; the run's own data only on the cases in use.
    checked = cases if not own_data else cases.select(used)
    problems: list[str] = []  # every config problem is reported at once
    layout = resolve_layout(cfg, cases, problems)
    if not problems and (misfits := case_shape_problems(layout, checked)):
        raise DataValidationError(root, misfits)
    checked.validate_all()
    if own_data:  # other data is evaluated whole ("all"), whatever its split
        try:
            deterministic_split(cases.case_ids, fractions, seed)  # a split too small?
        except ValueError as err:
            problems.append(f"data.split_fractions={fractions!r}: {err}")
    declared = cfg.data.num_classes
    num_classes = cases.num_classes if cases.label_names else None  # dataset.json's
    classes_from = "dataset.json 'labels' (the task's declared classes)"
    if declared is not None:
        if num_classes is not None and num_classes != declared:
            problems.append(
                f"data.num_classes={declared} disagrees with the {num_classes} labels declared "
                f"in {root}/dataset.json; fix one of them"
            )
        num_classes, classes_from = declared, "data.num_classes"
    elif num_classes is None:
        top = _undeclared_num_classes(checked)
        if own_data:
            problems.append(
                "data.num_classes: required (the folder has no dataset.json 'labels'; the class "
                "count must not come from the private label values); the largest label value "
                f"here suggests {top} (for the custodian: derived from the private data, not "
                "used)"
            )
        num_classes = top
        classes_from = "largest label value in the data + 1 (evaluation of other data)"
    by_channels: dict[int, list[str]] = {}
    for case in cases:
        by_channels.setdefault(case.channels, []).append(case.image_path.name)
    if len(by_channels) != 1:
        groups = "; ".join(
            f"{n} channel(s): {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}"
            for n, names in sorted(by_channels.items())
        )
        raise DataValidationError(
            root,
            [
                f"cases have different channel counts ({groups}); every case needs the same "
                "modalities in the same order: fix or remove the odd files"
            ],
        )
    in_channels = next(iter(by_channels))
    patch = _patch_size(cfg, cases, layout, problems)
    spacing, spacing_from = _spacing(cfg, cases, layout, problems)
    if problems:
        raise ConfigError(problems)
    rule = layout.slices
    k = int(cfg.data.patches_per_unit) if rule is None else rule.per_unit
    if k is None and rule is not None:
        # every slice of a volume: the count is each volume's extent, for the custodian only
        max_per_unit = max(cases[c].shape[rule.axis] for c in split_ids["train"] or used)
    else:
        max_per_unit = int(k or 1)
    reading: dict[str, Any] = {
        "label_values": cases.label_values,
        "reader": cases.reader,
        "slices": rule,
    }

    train_transform = segmentation_transforms(
        spatial_size=patch,
        train=True,
        num_patches_per_volume=k or 1,
        intensity="zscore",
        **reading,
    )
    train_set = VolumeDataset(
        cases,
        case_ids=split_ids["train"],
        transform=_CachedPrefix(train_transform),
        num_patches_per_volume=k or 1,
        seed=cfg.training.seed,
    )
    # One deterministic evaluation pipeline for every split: the whole volume, padded.
    eval_transform = segmentation_transforms(
        spatial_size=patch, train=False, intensity="zscore", **reading
    )
    splits: dict[str, Any] = {
        name: _CachedVolumes(VolumeDataset(cases, case_ids=ids, transform=eval_transform))
        for name, ids in {**split_ids, "all": cases.case_ids if not own_data else used}.items()
    }
    record = {
        "path": str(root),
        "format": (
            f"{'image' if cases.reader == 'PILReader' else 'nifti'}-folder ({cases.source})"
        ),
        "sha256": {
            f"{root.name} (manifest of {len(checked)} image/label pairs)": _fingerprint(checked)
        },
        "num_cases": len(cases),
        "splits": {name: len(ids) for name, ids in split_ids.items()},
        "split": split_ids,
        "split_rule": (
            f"deterministic_split(case ids, fractions={list(cfg.data.split_fractions)}, "
            f"seed={cfg.training.seed}): each case by a hash of its id keyed by the seed; "
            "max_train/max_eval keep the first n ids of a split"
        ),
        "subset": {"max_train": cfg.data.max_train, "max_eval": cfg.data.max_eval},
        "num_classes_source": classes_from,
        "patch_size": list(patch),
        "patches_per_unit": k,
        **layout.describe(),
        "spacing_mm": list(spacing),
        "spacing_source": spacing_from,
        "intensity": "z-score per volume over nonzero voxels (no dataset-wide statistic)",
    }
    return SegmentationTask(
        kind="segmentation",
        spatial_dims=layout.spatial_dims,
        in_channels=in_channels,
        num_classes=num_classes,
        spatial_shape=patch,
        label_names=_label_names(cases, num_classes),
        train_set=train_set,
        data_record=record,
        selection_metric="mean_dice",
        privacy_unit=layout.privacy_unit,
        max_samples_per_unit=max_per_unit,
        max_samples_public=k is not None,
        spacing=spacing,
        intensity="zscore",
        extra={
            "splits": splits,
            "split_ids": split_ids,
            "cases": cases,
            "own_data": own_data,
            "collate": VolumeCollate(k, in_channels, patch),
            "slices": rule,
            "reader": cases.reader,
        },
    )


TASK_BUILDERS["segmentation"] = build_segmentation_task
