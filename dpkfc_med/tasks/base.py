"""The task interface: what the generic trainer needs to know about a task.

A task owns the private datasets, the training loss, the probe source and its per-sample
probe loss, and evaluation. The trainer (:mod:`dpkfc_med.engines.trainer`) only talks to this
interface; :mod:`.classification` and :mod:`.segmentation` implement it, and :mod:`.build`
holds each task kind's builder.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.data import Dataset

from dpkfc_med.methods import Method
from dpkfc_med.probes import ImageProbeSource
from dpkfc_med.tasks.classification.public_probes import PublicProbeSource
from dpkfc_med.tasks.kinds import TaskKind

# the run config (dpkfc_med.training.config.RunConfig), typed Any here: tasks sit below
# training, which imports them
RunConfig = Any

__all__ = ["Task"]


@dataclass
class Task:
    """Interface between the data/loss/metrics of a task and the generic trainer.

    Attributes:
        kind: A :class:`TaskKind` value, kept as its plain string (it enters pickled and
            YAML records: ``model.pt``, reports), so it compares equal to the enum member.
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

    def __post_init__(self) -> None:
        self.kind = TaskKind(self.kind).value  # ValueError for a kind TaskKind does not know

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
        (:class:`PublicProbeSource`); :func:`~dpkfc_med.tasks.build.build_task` does this
        before a run starts and keeps the source in ``extra["public_source"]``.
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
