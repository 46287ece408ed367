"""Task adapters: what the generic trainer needs to know about classification or segmentation.

A task owns the private datasets, the training loss, the probe source and its per-sample
probe loss, and evaluation. The trainer (:mod:`.loop`) only talks to this interface.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from dpkfc_med.data import load_medmnist, resolve_data_path
from dpkfc_med.data.errors import DataValidationError
from dpkfc_med.probes import ImageProbeSource
from dpkfc_med.training.config import ConfigError, Method, RunConfig
from dpkfc_med.training.metrics import classification_metrics

__all__ = ["ClassificationTask", "PublicProbeSource", "Task", "build_task"]


@dataclass
class Task:
    """Interface between the data/loss/metrics of a task and the generic trainer."""

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

    def loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
        """Batch-mean training loss."""
        raise NotImplementedError

    def probe_loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
        """Per-sample loss on probes ``[M]``."""
        raise NotImplementedError

    def unpack(self, batch: Any) -> tuple[Tensor, Tensor, Tensor | None]:
        """``(inputs, targets, unit_ids or None)`` of a training batch."""
        x, y = batch
        return x, y, None

    def evaluate(
        self, model: nn.Module, split: str, device: torch.device, batch_size: int
    ) -> dict[str, Any]:
        """Metrics on ``split``."""
        raise NotImplementedError

    def probe_source(self, cfg: RunConfig) -> Any:
        """Probe source for the configured method (never private data)."""
        method = cfg.method_enum
        if method is Method.DP_KFC_PUBLIC:
            return PublicProbeSource(
                cfg.probes.public_data or "",
                spatial_shape=self.spatial_shape,
                channels=self.in_channels,
                num_classes=self.num_classes,
                task=self.kind,
            )
        return ImageProbeSource(
            self.spatial_shape,
            channels=self.in_channels,
            num_classes=self.num_classes,
            task=self.kind,
            kind="white" if method is Method.DP_KFC_WHITE else "pink",
            alpha=None if method is Method.DP_KFC_WHITE else cfg.probes.alpha,
            preset=cfg.probes.preset,
            spacing=self.spacing,
            intensity=self.intensity,
            target=cfg.probes.target,
        )


class PublicProbeSource:
    """Probes drawn from a public MedMNIST-format archive (the ``dp-kfc-public`` baseline).

    Images are resized to the private spatial shape and channel count; targets are uniform
    random classes. The data is external (public), never private: the report names the file.
    """

    def __init__(
        self,
        path: str,
        *,
        spatial_shape: tuple[int, ...],
        channels: int,
        num_classes: int,
        task: str,
    ) -> None:
        self.path = resolve_data_path(path)
        data = load_medmnist(self.path)
        images = data.splits["train"][0]
        if images.shape[1] != channels:
            images = images.mean(1, keepdim=True).expand(-1, channels, *images.shape[2:])
        if tuple(images.shape[2:]) != tuple(spatial_shape):
            mode = "bilinear" if len(spatial_shape) == 2 else "trilinear"
            images = F.interpolate(
                images, size=tuple(spatial_shape), mode=mode, align_corners=False
            )
        self.images = images.contiguous()
        self.sha256 = data.sha256
        self.num_classes = num_classes
        if task != "classification":
            raise ConfigError(["method dp-kfc-public supports classification only"])

    def sample(
        self,
        num: int,
        *,
        seed: int,
        model: nn.Module | None = None,
        device=None,
        dtype=torch.float32,
    ):
        """``num`` public images (with replacement) and uniform random classes."""
        g = torch.Generator().manual_seed(seed)
        idx = torch.randint(0, len(self.images), (num,), generator=g)
        y = torch.randint(0, self.num_classes, (num,), generator=g)
        return self.images[idx].to(device=device, dtype=dtype), y.to(device)

    def describe(self) -> dict[str, Any]:
        """Provenance for the report."""
        return {
            "kind": "public-data",
            "path": str(self.path),
            "sha256": self.sha256,
            "note": "external public data (not the private training set)",
            "targets": "uniform random classes",
        }


class ClassificationTask(Task):
    """Multi-class / binary classification of MedMNIST-format images (2D or 3D)."""

    def loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
        """Cross-entropy, mean over the batch."""
        return F.cross_entropy(outputs, targets)

    def probe_loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
        """Per-sample cross-entropy."""
        return F.cross_entropy(outputs, targets, reduction="none")

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
        self, model: nn.Module, split: str, device: torch.device, batch_size: int
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


def _classification_task(cfg: RunConfig, data_path: str | None = None) -> ClassificationTask:
    spec = data_path or cfg.data.path
    path = resolve_data_path(spec, download=cfg.data.download)
    data = load_medmnist(path, spatial_dims=cfg.data.spatial_dims)
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
    splits: dict[str, Dataset] = {}
    for name in ("train", "val", "test"):
        if name == "train" and cfg.data.max_train:
            splits[name] = data.subset(
                name, cfg.data.max_train, seed=cfg.training.seed, transform=resize
            )
        elif name != "train" and cfg.data.max_eval:
            splits[name] = data.subset(
                name, cfg.data.max_eval, seed=cfg.training.seed, transform=resize
            )
        else:
            splits[name] = data.dataset(name, transform=resize)
    record = {
        "path": str(path),
        "sha256": {path.name: data.sha256},
        "format": "medmnist-npz",
        "splits": {k: len(v) for k, v in splits.items()},  # type: ignore[arg-type]
        "class_counts": data.class_counts,
        "subset": {"max_train": cfg.data.max_train, "max_eval": cfg.data.max_eval},
        "resize": None if resize is None else list(resize.size),
    }
    return ClassificationTask(
        kind="classification",
        spatial_dims=data.spatial_dims,
        in_channels=data.channels,
        num_classes=data.num_classes,
        spatial_shape=tuple(data.spatial_shape) if resize is None else resize.size,
        label_names=list(data.label_names),
        train_set=splits["train"],
        data_record=record,
        selection_metric="auroc",
        privacy_unit="image (one record per patient in MedMNIST)",
        intensity="unit_range",
        extra={"splits": splits, "dataset": data},
    )


TASK_BUILDERS: dict[str, Callable[[RunConfig, str | None], Task]] = {
    "classification": _classification_task,
}


def build_task(cfg: RunConfig, data_path: str | Path | None = None) -> Task:
    """Load and validate the private data of ``cfg`` into a task."""
    if cfg.data.task == "segmentation" and "segmentation" not in TASK_BUILDERS:
        # Imported lazily: MONAI transforms and readers are only needed for segmentation.
        from dpkfc_med.training import segmentation  # noqa: F401  (registers the builder)
    builder = TASK_BUILDERS.get(cfg.data.task)
    if builder is None:
        raise ConfigError([f"data.task={cfg.data.task!r}: no pipeline registered"])
    return builder(cfg, None if data_path is None else str(data_path))
