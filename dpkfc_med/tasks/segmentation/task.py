"""Segmentation task: NIfTI / PNG folders, one volume or image per privacy unit, Dice by windows.

The trainer (:mod:`dpkfc_med.engines.trainer`) is generic; this module tells it how to read a
segmentation folder (``imagesTr/`` + ``labelsTr/`` or an MSD ``dataset.json``; ``images/`` +
``masks/`` of PNG), how to batch patches, which losses to use and how to evaluate. One code
path serves 3D volumes, 2D images and 2D slices of volumes (:mod:`.layout`): the number of
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

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dpkfc_med.data import (
    save_split,
)
from dpkfc_med.tasks.base import Task
from dpkfc_med.tasks.segmentation.batches import CachedVolumes, VolumeCollate
from dpkfc_med.tasks.segmentation.layout import (
    UNIT_VOLUME,
)
from dpkfc_med.tasks.segmentation.metrics import dice_scores, hausdorff95_scores, voxel_spacing

__all__ = [
    "hausdorff95_scores",
    "PRIVACY_UNIT",
    "SegmentationTask",
    "VolumeCollate",
    "dice_scores",
]

log = logging.getLogger("dpkfc_med")

PRIVACY_UNIT = UNIT_VOLUME
"""Name of the privacy unit in reports (one case of the folder)."""

SPLITS = ("train", "val", "test")
NUM_OVERLAYS = 3
SW_OVERLAP = 0.25  # sliding-window overlap used for evaluation and overlays


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
        data: CachedVolumes = self.extra["splits"][split]
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
        data: CachedVolumes = self.extra["splits"][split]
        was = model.training
        model.eval()
        rows, hd_rows = [], []
        try:
            for i in range(len(data)):
                item = data[i]
                pred = self.predict(model, item["image"], device, batch_size)
                rows.append(dice_scores(pred, item["label"], self.num_classes))
                if full:
                    spacing = voxel_spacing(item["image"], self.spacing)
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
        data: CachedVolumes = self.extra["splits"][split]
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
