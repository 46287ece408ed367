"""Task adapters: what the generic trainer needs to know about classification or segmentation.

A task owns the private datasets, the training loss, the probe source and its per-sample
probe loss, and evaluation. The trainer (:mod:`.loop`) only talks to this interface.

Privacy unit of classification:
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

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from dpkfc_med.data import MedMNISTDataset, load_medmnist, resolve_data_path, sha256_file
from dpkfc_med.data.errors import DataNotFoundError, DataValidationError
from dpkfc_med.data.medmnist import TensorImageDataset
from dpkfc_med.data.units import (
    UnitCollate,
    UnitImageDataset,
    group_by_unit,
    read_unit_ids_csv,
    same_grouping,
)
from dpkfc_med.probes import ImageProbeSource
from dpkfc_med.training.config import ConfigError, Method, RunConfig
from dpkfc_med.training.metrics import classification_metrics
from dpkfc_med.training.public_probes import PublicProbeSource
from dpkfc_med.units import unit_note_for

__all__ = ["ClassificationTask", "PublicProbeSource", "Task", "classification_task"]


@dataclass
class Task:
    """Interface between the data/loss/metrics of a task and the generic trainer.

    Attributes:
        privacy_unit: What one item of ``train_set`` is, in words (``"image"``,
            ``"patient (unit ids from FILE)"``, ``"patient/volume"``); the neighbouring
            relation is adding or removing one of them.
        max_samples_per_unit: The most samples (images, patches) one unit contributes.
        max_samples_public: Whether ``max_samples_per_unit`` is fixed by the config or the
            unit's definition (patches per volume, one image) rather than read off the private
            data (the most images one patient has); only a public value enters the shareable
            report.
        unit_note: ``None``, or a machine-readable statement that the unit is smaller than a
            patient (several images per patient), from :func:`dpkfc_med.units.unit_note_for`:
            ``{"unit", "dataset", "group", "images_per_patient" (k or None),
            "mean_images_per_patient", "images", "patients", "source", "quote", "statement"}``.
    """

    kind: str
    spatial_dims: int
    in_channels: int
    num_classes: int
    spatial_shape: tuple[int, ...]
    label_names: list[str] | None
    train_set: Dataset
    data_record: dict[str, Any]
    selection_metric: str = "auroc"
    privacy_unit: str = "image"
    max_samples_per_unit: int = 1
    spacing: tuple[float, ...] | None = None
    intensity: str = "unit_range"
    extra: dict[str, Any] = field(default_factory=dict)
    unit_note: dict[str, Any] | None = None
    max_samples_public: bool = True

    def per_sample_loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
        """Training loss of each sample ``[M]``, a function of that sample alone.

        Private training backpropagates the *sum* of these, so every sample's output error is
        its own loss gradient, whatever the (secret) batch size; a batch-mean loss would pass
        ``(1/B) g`` through the network, which under bfloat16 autocast rounds differently for
        every ``B``.
        """
        raise NotImplementedError

    def loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
        """Batch-mean training loss (non-private training, pretraining, logging)."""
        return self.per_sample_loss(outputs, targets).mean()

    def unit_scores(
        self, model: nn.Module, split: str, device: torch.device, batch_size: int
    ) -> np.ndarray:
        """One score in ``[0, 1]`` per unit of ``split`` (the input of a DP validation score).

        Each unit's score depends on that unit alone, so their sum has sensitivity 1 under
        adding or removing a unit.
        """
        raise NotImplementedError

    def probe_loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
        """Per-sample loss on probes ``[M]``."""
        raise NotImplementedError

    def unpack(self, batch: Any) -> tuple[Tensor, Tensor, Tensor | None]:
        """``(inputs, targets, unit_ids or None)`` of a training batch."""
        x, y = batch
        return x, y, None

    def evaluate(
        self,
        model: nn.Module,
        split: str,
        device: torch.device,
        batch_size: int,
        *,
        full: bool = False,
    ) -> dict[str, Any]:
        """Metrics on ``split``; ``full``: the final evaluation, with metrics too slow per epoch."""
        raise NotImplementedError

    def probe_source(self, cfg: RunConfig) -> Any:
        """Probe source for the configured method (never private data).

        For ``dp-kfc-public`` the public proxy is checked against the private training split
        (:class:`PublicProbeSource`); :func:`~.task_build.build_task` does this before a run
        starts and keeps the source in ``extra["public_source"]``.
        """
        method = cfg.method_enum
        if method is Method.DP_KFC_PUBLIC:
            if self.extra.get("public_source") is not None:
                return self.extra["public_source"]
            return PublicProbeSource(
                cfg.probes.public_data or "",
                spatial_shape=self.spatial_shape,
                channels=self.in_channels,
                num_classes=self.num_classes,
                task=self.kind,
                private=self.extra.get("dataset"),
                allow_overlap=cfg.probes.allow_public_overlap,
            )
        return ImageProbeSource(
            self.spatial_shape,
            channels=self.in_channels,
            num_classes=self.num_classes,
            task=self.kind,
            kind="white" if method is Method.DP_KFC_WHITE else cfg.probes.kind,
            alpha=None if method is Method.DP_KFC_WHITE else cfg.probes.alpha,
            preset=cfg.probes.preset,
            spacing=self.spacing,
            intensity=self.intensity,
            target=cfg.probes.target,
        )


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
    record["splits"] = {k: len(v) for k, v in splits.items()}  # type: ignore[arg-type]
    if units is not None:  # N units is treated as public; the image count of patients is not
        record["units"]["train_images"] = record["splits"]["train"]
        record["splits"]["train"] = len(train_set)  # type: ignore[arg-type]
    record["class_counts"] = data.class_counts
    return ClassificationTask(
        kind="classification",
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
