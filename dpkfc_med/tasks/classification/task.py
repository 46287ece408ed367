"""The classification task: MedMNIST-format images (2D or 3D), one label each.

Privacy unit:
    With patient ids for the training images (``data.unit_ids``, a CSV ``index,unit_id``, or a
    ``train_unit_ids`` array in the ``.npz``; :mod:`dpkfc_med.data.units`) the training set
    has one item per patient holding all of that patient's images: Poisson sampling draws
    patients at rate ``q = expected batch / N_patients`` and :meth:`ClassificationTask.unpack`
    returns one unit index per image, so the optimizer sums a patient's per-image gradients
    before clipping and adding or removing a patient moves the clipped sum by at most ``C``.
    Without ids the unit is one image; for a MedMNIST set known to hold several images per
    patient, ``Task.unit_note`` says so (:func:`dpkfc_med.units.unit_note_for`). Evaluation is
    always per image.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from dpkfc_med.data import MedMNISTDataset, load_medmnist, resolve_data_path, sha256_file
from dpkfc_med.data.augment import AugmentedUnits, RandomShiftFlip
from dpkfc_med.data.errors import DataNotFoundError, DataValidationError
from dpkfc_med.data.medmnist import TensorImageDataset
from dpkfc_med.data.units import (
    UnitCollate,
    UnitImageDataset,
    group_by_unit,
    read_unit_ids_csv,
    same_grouping,
)
from dpkfc_med.errors import ConfigError
from dpkfc_med.tasks.base import RunConfig, Task
from dpkfc_med.tasks.classification.metrics import classification_metrics
from dpkfc_med.tasks.kinds import TaskKind
from dpkfc_med.units import unit_note_for

__all__ = ["ClassificationTask", "ResizeImage", "classification_task"]


class ClassificationTask(Task):
    """Multi-class / binary classification of MedMNIST-format images (2D or 3D)."""

    def per_sample_loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
        """Cross-entropy of each image ``[M]``."""
        return F.cross_entropy(outputs, targets, reduction="none")

    def unit_scores(
        self, model: nn.Module, split: str, device: torch.device, batch_size: int
    ) -> np.ndarray:
        """The fraction of a unit's images of ``split`` classified correctly.

        Images group into units by the file's ``{split}_unit_ids`` when it has them (a patient
        with several images is one unit), else each image is a unit.
        """
        data = self.extra["splits"][split]
        probs, labels = self.predict(model, data, device, batch_size)
        correct = (probs.argmax(1) == labels.reshape(-1)).double().numpy()
        ids = getattr(self.extra.get("dataset"), "unit_ids", {}).get(split)
        if ids is None or len(ids) != len(correct):
            return correct
        groups: dict[str, list[float]] = {}
        for uid, ok in zip(ids, correct):
            groups.setdefault(uid, []).append(float(ok))
        return np.array([np.mean(v) for v in groups.values()])

    def probe_loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
        """Per-sample cross-entropy."""
        return F.cross_entropy(outputs, targets, reduction="none")

    def unpack(self, batch: Any) -> tuple[Tensor, Tensor, Tensor | None]:
        """``(images [M, C, *S], labels [M], unit index per image [M] or None)``.

        A batch of patients (from :class:`~dpkfc_med.data.units.UnitCollate`) gives the unit
        index of every image (``arange(B).repeat_interleave(k)``), so the optimizer sums the
        images of a patient before clipping; a batch of images (one image per unit) gives
        ``None``.
        """
        if isinstance(batch, dict):
            return batch["image"], batch["label"], batch["unit"]
        x, y = batch
        return x, y, None

    @torch.no_grad()
    def predict(
        self, model: nn.Module, data: Dataset, device: torch.device, batch_size: int
    ) -> tuple[Tensor, Tensor]:
        """Class probabilities and labels of a dataset."""
        was = model.training
        model.eval()
        probs, labels = [], []
        for x, y in DataLoader(data, batch_size=batch_size):
            probs.append(torch.softmax(model(x.to(device)).float(), 1).cpu())
            labels.append(y)
        model.train(was)
        return torch.cat(probs), torch.cat(labels)

    def evaluate(
        self,
        model: nn.Module,
        split: str,
        device: torch.device,
        batch_size: int,
        *,
        full: bool = False,
    ) -> dict[str, Any]:
        """Accuracy, balanced accuracy, AUROC, per-class sensitivity/specificity, confusion."""
        data = self.extra["splits"][split]
        probs, labels = self.predict(model, data, device, batch_size)
        return classification_metrics(probs, labels, self.label_names)


class ResizeImage:
    """Resize one image ``[C, *spatial] -> [C, *size]`` with MONAI ``Resize``.

    Bilinear (2D) or trilinear (3D); the result is a plain tensor. Picklable for loader workers.
    """

    def __init__(self, size: tuple[int, ...]) -> None:
        from monai.transforms import Resize

        self.size = size
        self._resize = Resize(size, mode="bilinear" if len(size) == 2 else "trilinear")

    def __call__(self, image: Tensor) -> Tensor:
        """The image ``[C, *spatial]`` resized to ``[C, *size]``."""
        out = self._resize(image)
        return out.as_tensor() if hasattr(out, "as_tensor") else torch.as_tensor(out)


def _resize_transform(size: list[int] | None, spatial_dims: int) -> ResizeImage | None:
    if size is None:
        return None
    if len(size) != spatial_dims or not all(isinstance(v, int) and v > 0 for v in size):
        raise ConfigError(
            [
                f"data.resize={size!r}: must be {spatial_dims} positive integers (one per "
                f"spatial axis of the data), e.g. {[64] * spatial_dims}"
            ]
        )
    return ResizeImage(tuple(size))


def _unit_ids(cfg: RunConfig, data: MedMNISTDataset) -> tuple[list[str], str, Path | None] | None:
    """The patient id of every training image, where it came from, and the CSV (if any).

    Raises:
        ConfigError: ``data.unit_ids`` names no file.
        DataValidationError: a bad mapping, or a CSV and a ``train_unit_ids`` array that
            group the images differently.
    """
    n = len(data.splits["train"][1])
    in_file = data.unit_ids.get("train")
    csv_path: Path | None = None
    from_csv: list[str] | None = None
    if cfg.data.unit_ids:
        try:
            csv_path = resolve_data_path(cfg.data.unit_ids)
        except DataNotFoundError as err:
            raise ConfigError(
                [f"data.unit_ids={cfg.data.unit_ids!r}: {err}"], "data.unit_ids"
            ) from None
        from_csv = read_unit_ids_csv(csv_path, n, images_file=data.path.name)
    if from_csv is not None and in_file is not None and not same_grouping(from_csv, in_file):
        raise DataValidationError(
            csv_path or data.path,
            [
                f"groups the training images differently from train_unit_ids in {data.path}; "
                "keep one mapping (drop data.unit_ids or the array) or make them agree"
            ],
        )
    if from_csv is not None:
        return from_csv, f"unit ids from {csv_path.name if csv_path else ''}", csv_path
    if in_file is not None:
        return list(in_file), f"train_unit_ids in {data.path.name}", None
    return None


def classification_task(cfg: RunConfig, data_path: str | None = None) -> ClassificationTask:
    """The classification task of ``cfg`` (its ``.npz``, or ``data_path``), every field checked."""
    spec = data_path or cfg.data.path
    path = resolve_data_path(spec, download=cfg.data.download)
    data = load_medmnist(path, spatial_dims=cfg.data.spatial_dims, num_classes=cfg.data.num_classes)
    if data.task == "multilabel":
        raise DataValidationError(
            str(path),
            [
                f"labels have {data.num_classes} columns (multi-label); this pipeline trains "
                "single-label (binary / multi-class) classifiers: pass a file whose labels are "
                "shaped (N,) or (N, 1)"
            ],
        )
    resize = _resize_transform(cfg.data.resize, data.spatial_dims)
    spatial_shape = tuple(data.spatial_shape) if resize is None else resize.size
    units = _unit_ids(cfg, data)
    splits: dict[str, Dataset] = {}
    for name in ("train", "val", "test"):
        if name == "train" and cfg.data.max_train and units is None:
            splits[name] = data.subset(
                name, cfg.data.max_train, seed=cfg.training.seed, transform=resize
            )
        elif name != "train" and cfg.data.max_eval:
            splits[name] = data.subset(
                name, cfg.data.max_eval, seed=cfg.training.seed, transform=resize
            )
        else:
            splits[name] = data.dataset(name, transform=resize)
    record: dict[str, Any] = {
        "path": str(path),
        "sha256": {path.name: data.sha256},
        "format": "medmnist-npz",
        "num_classes_source": data.num_classes_source,
        "subset": {"max_train": cfg.data.max_train, "max_eval": cfg.data.max_eval},
        "resize": None if resize is None else list(resize.size),
    }
    extra: dict[str, Any] = {"splits": splits, "dataset": data}
    unit_note = None
    if units is None:
        train_set: Dataset = splits["train"]
        privacy_unit, max_per_unit = "image", 1
        unit_note = unit_note_for(data.flag)
    else:
        ids, source, csv_path = units
        images, labels = data.splits["train"]
        names, groups = group_by_unit(ids)
        if cfg.data.max_train:  # keep max_train whole units (seeded like the image subset)
            gen = torch.Generator().manual_seed(cfg.training.seed)
            keep = torch.randperm(len(groups), generator=gen)[: cfg.data.max_train]
            chosen = sorted(int(i) for i in keep)
            names, groups = [names[i] for i in chosen], [groups[i] for i in chosen]
        units_set = UnitImageDataset(images, labels, groups, names, transform=resize)
        rows = torch.as_tensor(np.sort(np.concatenate(groups)), dtype=torch.int64)
        splits["train"] = TensorImageDataset(images[rows], labels[rows], resize)
        train_set, privacy_unit = units_set, f"patient ({source})"
        max_per_unit = units_set.max_images_per_unit
        sizes = [len(g) for g in groups]
        record["units"] = {
            "source": source,
            "file": None if csv_path is None else str(csv_path),
            "units_in_file": len(set(ids)),
            "units_used": len(groups),
            "images_per_unit": {
                "min": min(sizes),
                "max": max(sizes),
                "mean": float(np.mean(sizes)),
            },
        }
        if csv_path is not None:
            record["sha256"][csv_path.name] = sha256_file(csv_path)
        extra["collate"] = UnitCollate(data.channels, spatial_shape)
    if cfg.data.augmentations_per_unit > 1:  # k views per image, summed before clipping
        views = cfg.data.augmentations_per_unit
        train_set = AugmentedUnits(train_set, views, RandomShiftFlip(), seed=cfg.training.seed)
        max_per_unit *= views
        extra["collate"] = UnitCollate(data.channels, spatial_shape)
    record["splits"] = {k: len(v) for k, v in splits.items()}  # type: ignore[arg-type]
    if units is not None:  # N units is treated as public; the image count of patients is not
        record["units"]["train_images"] = record["splits"]["train"]
        record["splits"]["train"] = len(train_set)  # type: ignore[arg-type]
    record["class_counts"] = data.class_counts
    return ClassificationTask(
        kind=TaskKind.CLASSIFICATION,
        spatial_dims=data.spatial_dims,
        in_channels=data.channels,
        num_classes=data.num_classes,
        spatial_shape=spatial_shape,
        label_names=list(data.label_names),
        train_set=train_set,
        data_record=record,
        selection_metric="auroc",
        privacy_unit=privacy_unit,
        max_samples_per_unit=max_per_unit,
        intensity="unit_range",
        extra=extra,
        unit_note=unit_note,
        max_samples_public=units is None,
    )
