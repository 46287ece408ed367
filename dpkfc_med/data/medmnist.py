"""Read MedMNIST-format ``.npz`` archives (2D and 3D) into validated, channel-first tensors.

A MedMNIST archive holds ``{split}_images`` and ``{split}_labels`` for the splits ``train``,
``val`` and ``test``. Any file in that layout works, not only the official ones; metadata
(label names, declared number of classes) comes from ``medmnist.INFO`` when the file name
matches a MedMNIST flag. An optional ``{split}_unit_ids`` array gives each image's patient id
(the privacy unit; :mod:`dpkfc_med.data.units`).

Classes: labels must lie in ``0..num_classes-1`` of the declared classes: ``num_classes=``, the
``medmnist.INFO`` entry of the file's flag, or a ``classes`` array of class names stored in the
file. The class count shapes the released model's output layer and the probes, so it is never
read off the labels (one training image with a new label would change it): a file without a
declaration is refused, naming what to set, unless ``infer_classes=True`` (public data,
exploration), which takes ``max(label) + 1`` and refuses labels that skip a class no split uses
(0, 1 and 5 in a binary file) rather than reading them as extra classes.

Layout rule for ``{split}_images`` (used unless ``spatial_dims`` is given):

============================  ============  ==========================
array shape                   spatial dims  read as
============================  ============  ==========================
``(N, H, W)``                 2             one channel
``(N, H, W, C)``, C in {1,3}  2             channels last
``(N, D, H, W)``, W not 1/3   3             one channel
``(N, D, H, W, C)``           3             channels last
============================  ============  ==========================

With ``spatial_dims=2`` a 4-D array is always ``(N, H, W, C)``; with ``spatial_dims=3`` it is
always ``(N, D, H, W)``.

Intensities: ``uint8`` images are divided by 255 so they lie in ``[0, 1]``; ``bool`` images
become 0/1; other dtypes are cast to ``float32`` unchanged (their scale is the caller's
business; MedMNIST itself only ships ``uint8``). Float32 output costs 4 bytes per voxel, so
``adrenalmnist3d_64`` (1584 volumes of 64^3) needs about 1.7 GB; use ``max_per_split`` for
quick runs.
"""

from __future__ import annotations

import functools
import importlib.util
import re
import sys
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from dpkfc_med.data.classes import (
    CLASSES_KEY,
    class_counts,
    declared_class_names,
    label_values,
    undeclared_gap_problems,
    undeclared_problem,
)
from dpkfc_med.data.errors import DataValidationError
from dpkfc_med.data.paths import sha256_file
from dpkfc_med.data.units import as_unit_id_strings, unit_id_array_problems
from dpkfc_med.utils import did_you_mean

__all__ = [
    "CLASSES_KEY",
    "DEFAULT_SPLITS",
    "MedMNISTDataset",
    "UNIT_IDS_SUFFIX",
    "Task",
    "TensorImageDataset",
    "load_medmnist",
    "medmnist_info",
]

DEFAULT_SPLITS = ("train", "val", "test")
UNIT_IDS_SUFFIX = "_unit_ids"
"""Optional ``{split}_unit_ids`` arrays give each image's patient id (privacy unit)."""


class Task(str, Enum):
    """Classification task of a dataset; compares equal to its plain string value."""

    MULTICLASS = "multiclass"
    BINARY = "binary"
    MULTILABEL = "multilabel"

    def __str__(self) -> str:
        return self.value


@functools.lru_cache(maxsize=1)
def medmnist_info() -> Mapping[str, Mapping[str, Any]]:
    """The ``medmnist.INFO`` metadata table, or ``{}`` when ``medmnist`` is not installed.

    ``import medmnist`` pulls in torchvision and the dataset classes (about 2 s); the table
    lives in the dependency-free ``medmnist/info.py``, so that file is loaded on its own.
    """
    if "medmnist" in sys.modules:
        return sys.modules["medmnist"].INFO
    try:
        spec = importlib.util.find_spec("medmnist")
        locations = list(spec.submodule_search_locations or []) if spec else []
        info_file = Path(locations[0]) / "info.py" if locations else None
        if info_file is None or not info_file.is_file():
            return {}
        mod_spec = importlib.util.spec_from_file_location("_dpkfc_medmnist_info", info_file)
        if mod_spec is None or mod_spec.loader is None:
            return {}
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
        return module.INFO
    except Exception:  # metadata is optional: fall back to the normal import, then to nothing
        try:
            import medmnist

            return medmnist.INFO
        except Exception:
            return {}


_SIZE_SUFFIX = re.compile(r"_(\d+)$")


def _flag_from_stem(stem: str, info: Mapping[str, Any]) -> str | None:
    """``pneumoniamnist_64`` -> ``pneumoniamnist``; ``pneumoniamnist_balanced`` -> same."""
    stem = stem.lower()
    base = _SIZE_SUFFIX.sub("", stem)
    if base in info:
        return base
    # A derived file (e.g. a class-balanced subset) keeps the flag as its first word.
    head = stem.split("_", 1)[0]
    return head if head in info else None


@dataclass(frozen=True)
class _Layout:
    spatial_dims: int
    channels_last: bool


def _infer_layout(shape: tuple[int, ...], spatial_dims: int | None) -> _Layout | str:
    """Apply the module's layout rule; returns an error string on an impossible shape."""
    ndim = len(shape)
    if spatial_dims is None:
        if ndim == 3:
            return _Layout(2, False)
        if ndim == 4:
            # A trailing 1 or 3 is a channel axis (grey / RGB); a 3D volume is never that thin.
            return _Layout(2, True) if shape[-1] in (1, 3) else _Layout(3, False)
        if ndim == 5:
            return _Layout(3, True)
        return f"has shape {shape}; expected (N,H,W), (N,H,W,C), (N,D,H,W) or (N,D,H,W,C)"
    if spatial_dims == 2 and ndim in (3, 4):
        return _Layout(2, ndim == 4)
    if spatial_dims == 3 and ndim in (4, 5):
        return _Layout(3, ndim == 5)
    return f"has shape {shape}, which does not fit spatial_dims={spatial_dims}; expected " + (
        "(N,H,W) or (N,H,W,C)" if spatial_dims == 2 else "(N,D,H,W) or (N,D,H,W,C)"
    )


def _to_channel_first_float(images: np.ndarray, layout: _Layout) -> torch.Tensor:
    """``[N, *spatial(, C)]`` array -> float32 tensor ``[N, C, *spatial]`` (uint8 scaled /255)."""
    if images.dtype == np.uint8:
        out = images.astype(np.float32)
        out *= np.float32(1.0 / 255.0)
    else:
        out = images.astype(np.float32, copy=False)
    out = np.moveaxis(out, -1, 1) if layout.channels_last else out[:, None]
    return torch.from_numpy(np.ascontiguousarray(out))


class TensorImageDataset(Dataset):
    """Map-style dataset over in-memory images and labels.

    Each item is ``(image, label)``: the image ``[C, *spatial]`` (after ``transform``) and the
    label, a 0-d ``int64`` tensor (multi-class) or ``[K]`` tensor (multi-label). Sampling
    items samples images: when a patient has several images, train on
    :class:`~dpkfc_med.data.units.UnitImageDataset` instead.

    Args:
        images: ``[N, C, *spatial]`` tensor.
        labels: ``[N]`` or ``[N, K]`` tensor.
        transform: Optional callable applied to each image tensor.

    Raises:
        ValueError: ``images`` and ``labels`` have different lengths.
    """

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        if len(images) != len(labels):
            raise ValueError(
                f"TensorImageDataset: {len(images)} images but {len(labels)} labels; "
                "pass arrays with one label per image"
            )
        self.images = images
        self.labels = labels
        self.transform = transform

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = self.images[index]
        if self.transform is not None:
            image = self.transform(image)
        return image, self.labels[index]


@dataclass(eq=False)  # tensors make field-wise == ambiguous; compare sha256 instead
class MedMNISTDataset:
    """A validated MedMNIST-format archive held in memory.

    Attributes:
        splits: Split name -> ``(images, labels)``; images float32 ``[N, C, *spatial]``,
            labels int64 ``[N]`` (multi-class / binary) or ``[N, K]`` 0/1 (multi-label).
        task: :class:`Task` (``"binary"`` is multi-class with exactly two classes).
        num_classes: Number of classes (multi-label: number of label columns).
        label_names: One name per class, from ``medmnist.INFO`` if known, else ``"0"``, ...
        spatial_dims: 2 or 3.
        channels: ``C``.
        spatial_shape: ``(H, W)`` or ``(D, H, W)``.
        path: The archive that was read.
        sha256: SHA-256 of the archive (fingerprint for run records and privacy reports).
        class_counts: Split -> count per class (multi-label: positives per column).
        flag: The ``medmnist.INFO`` key used for metadata, or ``None``.
        unit_ids: Split -> one privacy-unit (patient) id per image, for the splits whose
            ``{split}_unit_ids`` array is in the file (see :mod:`dpkfc_med.data.units`).
        num_classes_source: Where ``num_classes`` came from (``"num_classes"``,
            ``"medmnist.INFO['flag']"``, or the largest label + 1 when undeclared).
    """

    splits: dict[str, tuple[torch.Tensor, torch.Tensor]]
    task: Task
    num_classes: int
    label_names: list[str]
    spatial_dims: int
    channels: int
    spatial_shape: tuple[int, ...]
    path: Path
    sha256: str
    class_counts: dict[str, list[int]] = field(default_factory=dict)
    flag: str | None = None
    unit_ids: dict[str, list[str]] = field(default_factory=dict)
    num_classes_source: str = ""

    def __repr__(self) -> str:
        sizes = ", ".join(f"{k}={len(v[1])}" for k, v in self.splits.items())
        return (
            f"MedMNISTDataset({self.path.name}: {sizes}; task={self.task.value}, "
            f"num_classes={self.num_classes}, shape=[{self.channels}, "
            f"{', '.join(map(str, self.spatial_shape))}])"
        )

    def _split(self, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        if split not in self.splits:
            raise KeyError(f"{self.path.name}: no split {split!r}; available: {list(self.splits)}")
        return self.splits[split]

    def dataset(
        self, split: str, transform: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> TensorImageDataset:
        """A torch dataset over one split (no copy).

        Args:
            split: ``"train"``, ``"val"`` or ``"test"``.
            transform: Optional per-image callable.

        Returns:
            :class:`TensorImageDataset` yielding ``(image [C, *spatial], label)``.
        """
        images, labels = self._split(split)
        return TensorImageDataset(images, labels, transform)

    def subset(
        self,
        split: str,
        n: int,
        seed: int = 0,
        transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> TensorImageDataset:
        """A reproducible random subset of ``n`` items of one split, drawn without replacement.

        Args:
            split: Split name.
            n: Number of items; capped at the split size.
            seed: Seed of the ``torch.Generator`` that draws the indices.
            transform: Optional per-image callable.

        Returns:
            :class:`TensorImageDataset` with ``min(n, len(split))`` items.
        """
        images, labels = self._split(split)
        if n < 0:
            raise ValueError(f"subset: n={n} must be >= 0")
        gen = torch.Generator().manual_seed(seed)
        index = torch.randperm(len(labels), generator=gen)[: min(n, len(labels))]
        index, _ = torch.sort(index)  # keep file order so subsets of one seed nest predictably
        return TensorImageDataset(images[index], labels[index], transform)


def load_medmnist(
    path: str | Path,
    *,
    splits: Sequence[str] = DEFAULT_SPLITS,
    spatial_dims: int | None = None,
    num_classes: int | None = None,
    flag: str | None = None,
    max_per_split: int | None = None,
    infer_classes: bool = False,
) -> MedMNISTDataset:
    """Read and validate a MedMNIST-format ``.npz`` archive.

    Every problem in the file is collected and reported in one :class:`DataValidationError`.

    Args:
        path: The ``.npz`` file (use :func:`~dpkfc_med.data.paths.resolve_data_path` to turn a
            flag such as ``"pneumoniamnist"`` into a path).
        splits: Splits that must be present.
        spatial_dims: 2 or 3 to override the layout rule of the module docstring.
        num_classes: Declared number of classes; labels must lie in ``[0, num_classes)``.
            Defaults to the ``medmnist.INFO`` entry for the flag, else the length of the
            file's ``classes`` array of class names.
        flag: ``medmnist.INFO`` key for metadata; by default taken from the file name
            (``pneumoniamnist_64.npz`` -> ``pneumoniamnist``).
        max_per_split: Keep only the first ``max_per_split`` items of each split (after
            validating the whole file); for quick tests.
        infer_classes: Without any declaration, take ``max(label) + 1`` classes instead of
            refusing the file. Only for data that is not private (a public proxy, exploration):
            the count then depends on every label in the file.

    Returns:
        :class:`MedMNISTDataset` with images ``[N, C, *spatial]`` float32 and int64 labels.

    Raises:
        DataValidationError: Missing or unreadable file, missing keys, length mismatches,
            empty splits, non-finite pixels, undeclared classes (unless ``infer_classes``),
            bad labels (outside the declared classes, or skipping a class when inferred), bad
            ``{split}_unit_ids``, or shapes that differ between splits.
        ValueError: ``spatial_dims`` not in (2, 3) or an unknown ``flag``.
    """
    path = Path(path).expanduser()
    if spatial_dims not in (None, 2, 3):
        raise ValueError(f"load_medmnist: spatial_dims={spatial_dims!r} must be 2, 3 or None")
    if max_per_split is not None and max_per_split < 1:
        raise ValueError(f"load_medmnist: max_per_split={max_per_split} must be >= 1 or None")

    info_table = medmnist_info()
    if flag is not None and flag not in info_table and info_table:
        hint = did_you_mean(flag, info_table)
        raise ValueError(f"load_medmnist: flag={flag!r} is not a medmnist.INFO key{hint}")
    flag = flag or _flag_from_stem(path.stem, info_table)
    info = info_table.get(flag) if flag else None

    if not path.is_file():
        raise DataValidationError(
            path,
            [
                "file not found; pass an existing .npz (--data PATH) or a MedMNIST flag "
                "resolved with dpkfc_med.data.resolve_data_path"
            ],
        )
    if not zipfile.is_zipfile(path):
        raise DataValidationError(
            path,
            [
                "not a .npz (zip) archive; MedMNIST files are written by numpy.savez with keys "
                "{split}_images / {split}_labels - re-download or re-save the file"
            ],
        )

    try:
        with np.load(path, allow_pickle=False) as archive:
            present = sorted(archive.files)
            arrays = {k: archive[k] for k in present if k.endswith(("_images", "_labels"))}
            unit_arrays: dict[str, np.ndarray] = {}
            problems: list[str] = []
            file_classes = declared_class_names(archive, problems)
            for s in splits:
                key = f"{s}{UNIT_IDS_SUFFIX}"
                if key in present:
                    try:
                        unit_arrays[s] = archive[key]
                    except ValueError as err:  # object arrays need pickle, which is refused
                        problems.append(
                            f"{key} could not be read without pickle ({err}); save unit ids as "
                            "integers or strings (np.asarray(ids, dtype=str))"
                        )
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as err:
        raise DataValidationError(
            path, [f"could not be read by numpy.load ({err}); re-download or re-save the file"]
        ) from err

    missing = [
        f"{s}_{part}"
        for s in splits
        for part in ("images", "labels")
        if f"{s}_{part}" not in arrays
    ]
    if missing:
        problems.append(
            f"missing keys {missing}; present keys: {present}. A MedMNIST archive needs "
            f"{{split}}_images and {{split}}_labels for splits {list(splits)}"
        )
    usable = [s for s in splits if f"{s}_images" in arrays and f"{s}_labels" in arrays]

    # Layout comes from the first usable split; the others must match it.
    layout: _Layout | None = None
    ref_split: str | None = None
    ref_sample_shape: tuple[int, ...] | None = None
    ref_label_cols: int | None = None
    label_arrays: dict[str, np.ndarray] = {}
    for s in usable:
        img, lab = arrays[f"{s}_images"], arrays[f"{s}_labels"]
        key_img, key_lab = f"{s}_images", f"{s}_labels"
        if len(img) == 0 or len(lab) == 0:
            problems.append(
                f"{key_img} / {key_lab}: split {s!r} is empty ({len(img)} images, {len(lab)} "
                "labels); every split needs at least one example"
            )
            continue
        if len(img) != len(lab):
            problems.append(
                f"{key_img} has {len(img)} items but {key_lab} has {len(lab)}; they must pair "
                "one label with each image"
            )
        if layout is None:
            got = _infer_layout(img.shape, spatial_dims)
            if isinstance(got, str):
                problems.append(f"{key_img} {got}")
                continue
            layout, ref_split, ref_sample_shape = got, s, tuple(img.shape[1:])
        elif tuple(img.shape[1:]) != ref_sample_shape:
            problems.append(
                f"{key_img} has per-image shape {tuple(img.shape[1:])} but "
                f"{ref_split}_images has {ref_sample_shape}; all splits must share one shape"
            )
        if img.dtype.kind == "f" and not np.isfinite(img).all():
            bad = int((~np.isfinite(img)).sum())
            problems.append(
                f"{key_img} has {bad} non-finite pixel value(s) (NaN/inf); clean or re-export "
                "the images"
            )
        elif img.dtype.kind not in "fuib":
            problems.append(f"{key_img} has dtype {img.dtype}; expected uint8 or a float type")

        # Labels: (N,) or (N,1) is one class index; (N,K>1) is a 0/1 multi-label matrix.
        if lab.ndim == 2 and lab.shape[1] == 1:
            lab = lab[:, 0]
        if lab.ndim not in (1, 2):
            problems.append(
                f"{key_lab} has shape {lab.shape}; expected (N,), (N,1) or (N,K) indicators"
            )
            continue
        if lab.dtype.kind not in "uifb":
            problems.append(f"{key_lab} has dtype {lab.dtype}; expected an integer type")
            continue
        if lab.dtype.kind == "f" and (
            not np.isfinite(lab).all() or not np.array_equal(lab, np.round(lab))
        ):
            problems.append(
                f"{key_lab} holds non-integer values; labels must be whole class indices"
            )
            continue
        cols = 1 if lab.ndim == 1 else lab.shape[1]
        if ref_label_cols is None:
            ref_label_cols = cols
        elif cols != ref_label_cols:
            problems.append(
                f"{key_lab} has {cols} label column(s) but other splits have {ref_label_cols}"
            )
            continue
        if lab.ndim == 1 and (neg := int((lab < 0).sum())):
            problems.append(
                f"{key_lab} has {neg} negative label(s) (min {lab.min()}); class indices start at 0"
            )
        if lab.ndim == 2 and not np.isin(lab, (0, 1)).all():
            problems.append(
                f"{key_lab} has {cols} columns but values other than 0/1 "
                f"({np.unique(lab)[:10].tolist()}); multi-label targets must be 0/1 indicators, "
                "and multi-class labels must be one column"
            )
        label_arrays[s] = lab
        if s in unit_arrays:
            problems.extend(
                unit_id_array_problems(f"{s}{UNIT_IDS_SUFFIX}", unit_arrays[s], len(img))
            )

    # Number of classes: explicit > medmnist.INFO > data; labels must fit the declared range.
    multilabel = ref_label_cols is not None and ref_label_cols > 1
    classes_from = "label columns (multi-label)"
    info_labels = dict(info["label"]) if info else {}
    if info is not None and "multi-label" in str(info.get("task", "")) and not multilabel:
        if label_arrays:
            problems.append(
                f"medmnist.INFO[{flag!r}] declares a multi-label task but the labels have one "
                "column; pass flag=... for the right dataset or fix the labels"
            )
    if multilabel:
        n_classes = int(ref_label_cols or 0)
        if num_classes is not None and num_classes != n_classes:
            problems.append(
                f"num_classes={num_classes} but the multi-label matrices have {n_classes} columns"
            )
        elif num_classes is None and file_classes and len(file_classes) != n_classes:
            problems.append(
                f"the multi-label matrices have {n_classes} columns but the file's "
                f"{CLASSES_KEY!r} array names {len(file_classes)} classes; they must agree"
            )
    else:
        if num_classes is not None and (isinstance(num_classes, bool) or num_classes < 1):
            problems.append(f"num_classes={num_classes!r}: must be an integer >= 1")
            num_classes = None
        if num_classes is not None:
            declared, source = num_classes, "num_classes"
        elif info_labels:
            declared, source = len(info_labels), f"medmnist.INFO[{flag!r}]"
        elif file_classes:
            declared, source = len(file_classes), f"the file's {CLASSES_KEY!r} array"
            info_labels = {str(i): name for i, name in enumerate(file_classes)}
        else:
            declared, source = None, ""
        observed_max = max((int(a.max()) for a in label_arrays.values() if a.size), default=-1)
        n_classes = declared if declared is not None else observed_max + 1
        if declared is not None:
            classes_from = source
            for s, lab in label_arrays.items():
                if (over := int((lab >= declared).sum())) > 0:
                    problems.append(
                        f"{s}_labels has {over} label(s) >= {declared} (offending values "
                        f"{label_values(lab[lab >= declared])}), outside the {declared} classes "
                        f"0..{declared - 1} declared by {source}; fix the labels or declare the "
                        "right classes (num_classes, data.num_classes in a run config, or flag)"
                    )
        elif infer_classes:
            classes_from = "largest label + 1 (classes not declared)"
            problems.extend(undeclared_gap_problems(label_arrays, observed_max))
        elif label_arrays:
            problems.append(undeclared_problem(observed_max + 1))

    if problems:
        raise DataValidationError(path, problems)
    assert layout is not None and ref_sample_shape is not None  # guaranteed when no problems

    out_splits: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    counts: dict[str, list[int]] = {}
    unit_ids: dict[str, list[str]] = {}
    for s in usable:
        img, lab = arrays[f"{s}_images"], label_arrays[s]
        if max_per_split is not None:
            img, lab = img[:max_per_split], lab[:max_per_split]
        if s in unit_arrays:
            unit_ids[s] = as_unit_id_strings(unit_arrays[s])[: len(lab)]
        images = _to_channel_first_float(img, layout)
        labels = torch.from_numpy(np.ascontiguousarray(lab).astype(np.int64))
        out_splits[s] = (images, labels)
        counts[s] = class_counts(labels, n_classes, multilabel)

    channels = ref_sample_shape[-1] if layout.channels_last else 1
    spatial_shape = ref_sample_shape[:-1] if layout.channels_last else ref_sample_shape
    if multilabel:
        task = Task.MULTILABEL
    else:
        task = Task.BINARY if n_classes == 2 else Task.MULTICLASS
    names = [str(info_labels.get(str(i), i)) for i in range(n_classes)]

    return MedMNISTDataset(
        splits=out_splits,
        task=task,
        num_classes=n_classes,
        label_names=names,
        spatial_dims=layout.spatial_dims,
        channels=int(channels),
        spatial_shape=tuple(int(v) for v in spatial_shape),
        path=path.resolve(),
        sha256=sha256_file(path),
        class_counts=counts,
        flag=flag,
        unit_ids=unit_ids,
        num_classes_source=classes_from,
    )
