"""Probes from a public MedMNIST-format archive: the ``dp-kfc-public`` baseline's probe source.

The proxy is checked against the private training split before a run starts: an archive that
shares images with it is refused (unless ``probes.allow_public_overlap``, which the report then
states as not covered).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dpkfc_med.data import MedMNISTDataset, load_medmnist, resolve_data_path
from dpkfc_med.data.fingerprint import count_shared, image_digests
from dpkfc_med.errors import ConfigError
from dpkfc_med.tasks.kinds import TaskKind

__all__ = ["PublicProbeSource"]


def _match_dims(images: Tensor, spatial_shape: tuple[int, ...], path: Path) -> Tensor:
    """A 3D proxy for a 2D task becomes its central slices along every axis; 2D for 3D fails."""
    have, want = images.ndim - 2, len(spatial_shape)
    if have == want:
        return images
    if have == 3 and want == 2:
        # each axis' slices at the task's size (the volumes may not be cubes)
        return torch.cat(
            [
                F.interpolate(
                    images.select(2 + axis, images.shape[2 + axis] // 2),
                    size=spatial_shape,
                    mode="bilinear",
                    align_corners=False,
                )
                for axis in range(3)
            ]
        )
    raise ConfigError(
        [
            f"probes.public_data={str(path)!r} holds {have}D images but the private task is "
            f"{want}D: a {have}D proxy cannot give {want}D probes; use a {want}D public "
            "archive (a 3D proxy serves a 2D task through its central slices)"
        ],
        "probes",
    )


class PublicProbeSource:
    """Probes drawn from a public MedMNIST-format archive (the ``dp-kfc-public`` baseline).

    Images are resized to the private spatial shape and channel count; targets are uniform
    random classes. A 3D proxy for a 2D task contributes the central slice of each volume along
    each of its three axes (3 images per volume); a 2D proxy cannot stand in for a 3D task. The
    report names the file.

    Privacy guarantee:
        The preconditioner is post-processing only if the proxy holds no private data. The
        proxy's training images are therefore compared with the private training split by
        content (SHA-256 of each image after loading, :func:`~dpkfc_med.data.fingerprint.
        image_digests`), and a proxy that shares images with it -- or carries the same
        MedMNIST flag, whose training split holds the same patients at any resolution -- is
        refused. With ``allow_overlap`` it is used, and :meth:`describe` records the overlap:
        the preconditioner then depends on private data and is not covered by the guarantee.

    Args:
        path: The public ``.npz`` (a path or MedMNIST flag).
        spatial_shape: Private spatial shape the probes are resized to.
        channels: Private channel count.
        num_classes: Classes of the private task (for the random targets).
        task: ``"classification"`` (the only supported task).
        private: The private dataset (its ``train`` split is compared); ``None`` skips the
            check, which :meth:`describe` then states.
        allow_overlap: Use a proxy that overlaps the private data anyway
            (``probes.allow_public_overlap``).

    Raises:
        ConfigError: ``task`` is not classification, or the proxy overlaps the private
            training data without ``allow_overlap`` (naming both files and the count).
    """

    def __init__(
        self,
        path: str,
        *,
        spatial_shape: tuple[int, ...],
        channels: int,
        num_classes: int,
        task: TaskKind | str,
        private: MedMNISTDataset | None = None,
        allow_overlap: bool = False,
    ) -> None:
        if task != TaskKind.CLASSIFICATION:
            raise ConfigError(["method dp-kfc-public supports classification only"])
        self.path = resolve_data_path(path)
        data = load_medmnist(self.path, infer_classes=True)  # public proxy data
        images = data.splits["train"][0]
        self.private_path = None if private is None else str(private.path)
        self.overlap: int | None = None
        self.same_flag: str | None = None
        if private is not None:
            self.overlap = count_shared(
                image_digests(images), image_digests(private.splits["train"][0])
            )
            if data.flag is not None and data.flag == private.flag:
                self.same_flag = data.flag
            if (self.overlap or self.same_flag) and not allow_overlap:
                raise ConfigError(
                    [
                        f"probes.public_data={str(self.path)!r} overlaps the private training "
                        f"split of {private.path} ({len(private.splits['train'][0])} images): "
                        f"{self._overlap_words()}; a preconditioner built from it depends on "
                        "private data, which the privacy guarantee does not cover. Use public "
                        "data disjoint from the private data, another method (dp-kfc: "
                        "synthetic probes), or set probes.allow_public_overlap: true to run "
                        "anyway (the report then marks "
                        "the preconditioner as NOT covered by the guarantee)"
                    ],
                    "probes",
                )
        images = _match_dims(images, tuple(spatial_shape), self.path)
        self.sliced = images.shape[0] != data.splits["train"][0].shape[0]
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

    def _overlap_words(self) -> str:
        parts = []
        if self.overlap:
            parts.append(f"{self.overlap} of its training images are identical to private ones")
        if self.same_flag:
            parts.append(
                f"it is the same MedMNIST dataset ({self.same_flag!r}), whose training split "
                "holds the same patients' images at any resolution (which content hashes "
                "cannot match)"
            )
        return "; ".join(parts)

    @property
    def uses_private_data(self) -> bool:
        """Whether the proxy is known to share data with the private training split."""
        return bool(self.overlap or self.same_flag)

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
        """Provenance for the report, with the overlap with the private training split.

        ``overlap_with_private_train`` is the number of proxy training images identical to
        private training images (``None``: not checked); ``same_dataset_as_private`` the shared
        MedMNIST flag or ``None``; ``uses_private_data`` whether either is set, in which case
        ``note`` says the preconditioner is NOT covered by the guarantee.
        """
        if self.overlap is None:
            note = "external public data; overlap with the private training set NOT checked"
        elif self.uses_private_data:
            what = []
            if self.overlap:
                what.append(f"shares {self.overlap} images with the private training set")
            if self.same_flag:
                what.append(f"is the same MedMNIST dataset ({self.same_flag}) as the private data")
            note = (
                f"{' and '.join(what)}: the preconditioner depends on private data; NOT covered "
                "by the guarantee (allowed by probes.allow_public_overlap)"
            )
        else:
            note = "external public data (no image in common with the private training set)"
        return {
            "kind": "public-data",
            "path": str(self.path),
            "sha256": self.sha256,
            "note": note,
            "targets": "uniform random classes",
            "images": (
                "central slice of each volume along each axis, resized"
                if self.sliced
                else "training images, resized"
            ),
            "private_train": self.private_path,
            "overlap_with_private_train": self.overlap,
            "same_dataset_as_private": self.same_flag,
            "uses_private_data": self.uses_private_data,
        }
