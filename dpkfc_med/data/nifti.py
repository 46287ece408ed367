"""Segmentation data: NIfTI folders and MSD ``dataset.json`` indexes, splits and patch sampling.

Volumes are 3-D; 2-D images come as 2-D NIfTI (``(X, Y)`` or ``(X, Y, 1)``) or as PNG / JPEG
``images/`` + ``masks/`` folders (:mod:`.images2d`), and slices of volumes as 2-D samples of
their volume (:mod:`.slices`).

Privacy unit: one *volume* (one case). :class:`VolumeDataset` returns all ``k`` training
patches of one volume as one item, so a Poisson / uniform sampler over the dataset draws
volumes, and a per-item gradient clip bounds the contribution of a whole volume. Sampling
patches as independent items would make the privacy unit a patch and understate the
privacy loss of a patient by up to a factor ``k``.

Random patches of a volume draw from that volume's own random stream, seeded by (run seed,
case ID, how often the volume was drawn before), so they do not depend on which other volumes
the secret Poisson sampler drew (:func:`~dpkfc_med.data.units.unit_random_state`).

Intensity normalisation uses per-volume statistics only: a dataset-wide mean or percentile
is a function of every private volume and would need its own privacy budget.

The train/val/test split (:func:`deterministic_split`) assigns each case by a keyed hash of its
own ID, so adding or removing a case of the folder changes the split of that case only.
"""

from __future__ import annotations

import hashlib
import json
import re
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from dpkfc_med.data.errors import DataValidationError
from dpkfc_med.data.units import reseed_for_unit

__all__ = [
    "CropMode",
    "IntensityNorm",
    "SegmentationCase",
    "SegmentationCases",
    "VolumeDataset",
    "deterministic_split",
    "load_segmentation_folder",
    "load_split",
    "save_split",
    "segmentation_transforms",
]

_NIFTI_SUFFIXES = (".nii.gz", ".nii")
# nnU-Net names single-modality images "<case>_0000.nii.gz" while the label is "<case>.nii.gz".
_MODALITY_SUFFIX = re.compile(r"_0000$")


class CropMode(str, Enum):
    """How training patches are drawn from a volume."""

    POS_NEG = "pos_neg"  # RandCropByPosNegLabeld: centres balanced between fg and bg voxels
    RANDOM = "random"  # RandSpatialCropSamplesd: uniform centres


class IntensityNorm(str, Enum):
    """Per-volume intensity normalisation."""

    ZSCORE = "zscore"  # NormalizeIntensityd over nonzero voxels, per channel
    PERCENTILE = "percentile"  # ScaleIntensityRangePercentilesd to [0, 1], clipped


def _enum(cls: type[Enum], value: Any, name: str) -> Any:
    try:
        return cls(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in cls)  # type: ignore[attr-defined]
        raise ValueError(f"{name}={value!r} is not one of {allowed}") from None


def _case_id(path: Path) -> str:
    name = path.name
    for suffix in _NIFTI_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return path.stem


def _is_nifti(path: Path) -> bool:
    # macOS "._name" resource forks ship inside the official MSD tarballs; they are not images.
    return path.is_file() and path.name.endswith(_NIFTI_SUFFIXES) and not path.name.startswith(".")


@dataclass(frozen=True)
class SegmentationCase:
    """Header facts of one image/label pair; no voxel data is held.

    Attributes:
        case_id: File name without ``.nii(.gz)``, e.g. ``"hippocampus_001"``.
        image_path: The image file.
        label_path: The label map file.
        shape: Spatial shape ``(X, Y, Z)`` in NIfTI voxel order (MONAI keeps this order, so
            tensors are ``[C, X, Y, Z]``); ``(X, Y)`` for a 2-D image (``(W, H)`` for PNG).
        spacing: Voxel size in mm along each axis of ``shape`` from the header zooms (1.0
            for PNG / JPEG pixels).
        image_dtype: On-disk image dtype, e.g. ``"float32"``.
        label_dtype: On-disk label dtype.
        channels: Image channels (a 4-D NIfTI stores them last; 1 for a 3-D image).
    """

    case_id: str
    image_path: Path
    label_path: Path
    shape: tuple[int, ...]
    spacing: tuple[float, ...]
    image_dtype: str
    label_dtype: str
    channels: int = 1


def _label_value_problem(
    values: np.ndarray, allowed: Sequence[int] | None, case_id: str, file_name: str, source: str
) -> str | None:
    """Describe why the unique label ``values`` of a case are not valid, or return ``None``."""
    if values.dtype.kind == "f" and not np.array_equal(values, np.round(values)):
        bad = values[values != np.round(values)][:5].tolist()
        return (
            f"case {case_id}: {file_name} holds non-integer label values {bad}; "
            "label maps must hold whole class indices"
        )
    ints = values.astype(np.int64)
    if allowed is None:
        if (ints < 0).any():
            return (
                f"case {case_id}: {file_name} holds negative label values "
                f"{ints[ints < 0].tolist()}; class indices start at 0"
            )
        return None
    outside = sorted(set(ints.tolist()) - set(allowed))
    if outside:
        hint = " (a 0/255 mask? store class indices 0..K-1)" if outside == [255] else ""
        return (
            f"case {case_id}: {file_name} holds label value(s) {outside} outside "
            f"the declared classes {sorted(allowed)} ({source}); fix the label map or declare "
            f"the class{hint}"
        )
    return None


def _read_array(path: Path) -> np.ndarray:
    from dpkfc_med.data.images2d import IMAGE_SUFFIXES, read_image_array

    if path.suffix.lower() in IMAGE_SUFFIXES:
        return read_image_array(path)
    import nibabel as nib

    img: Any = nib.load(str(path))  # typed as the generic FileBasedImage by nibabel
    return np.asanyarray(img.dataobj)


@dataclass
class SegmentationCases:
    """An index of image/label pairs read from headers (voxels are read on demand).

    Attributes:
        root: The dataset folder.
        cases: Cases sorted by ``case_id``.
        label_names: Class index -> name from ``dataset.json`` (``None`` if undeclared).
        num_classes: Declared number of classes, background included (``None`` if undeclared;
            then label maps are only checked to hold non-negative integers).
        source: ``"dataset.json"``, ``"imagesTr/labelsTr"`` or ``"images/masks"``.
        dropped: Messages for unpaired files that were skipped with ``on_unpaired="warn"``.
        reader: The MONAI image reader of the files (``"NibabelReader"``, ``"PILReader"``).
    """

    root: Path
    cases: list[SegmentationCase]
    label_names: dict[int, str] | None = None
    num_classes: int | None = None
    source: str = "imagesTr/labelsTr"
    dropped: list[str] = field(default_factory=list)
    reader: str = "NibabelReader"

    def __post_init__(self) -> None:
        self._by_id = {c.case_id: c for c in self.cases}

    def __len__(self) -> int:
        return len(self.cases)

    def __iter__(self) -> Iterator[SegmentationCase]:
        return iter(self.cases)

    def __getitem__(self, key: int | str) -> SegmentationCase:
        """A case by position or by ``case_id``."""
        if isinstance(key, str):
            if key not in self._by_id:
                raise KeyError(f"{self.root}: no case {key!r} ({len(self)} cases)")
            return self._by_id[key]
        return self.cases[key]

    def __repr__(self) -> str:
        return (
            f"SegmentationCases({self.root}, {len(self)} cases, num_classes={self.num_classes}, "
            f"source={self.source!r})"
        )

    @property
    def case_ids(self) -> list[str]:
        """Sorted case IDs."""
        return [c.case_id for c in self.cases]

    @property
    def label_values(self) -> tuple[int, ...] | None:
        """Allowed label values ``(0, ..., num_classes - 1)``, or ``None`` if undeclared."""
        return None if self.num_classes is None else tuple(range(self.num_classes))

    def _label_source(self) -> str:
        return "dataset.json 'labels'" if self.label_names else "num_classes"

    def select(self, case_ids: Sequence[str]) -> SegmentationCases:
        """The cases named in ``case_ids`` (e.g. one split), keeping everything else.

        Raises:
            KeyError: An ID is not in this index (all unknown IDs are listed).
        """
        unknown = [c for c in case_ids if c not in self._by_id]
        if unknown:
            raise KeyError(f"{self.root}: unknown case IDs {unknown}")
        chosen = sorted(set(case_ids))
        return replace(self, cases=[self._by_id[c] for c in chosen], dropped=list(self.dropped))

    def data_dicts(self, case_ids: Sequence[str] | None = None) -> list[dict[str, str]]:
        """MONAI-style records ``{"image": path, "label": path, "case_id": id}``."""
        chosen = self.cases if case_ids is None else [self[c] for c in case_ids]
        return [
            {"image": str(c.image_path), "label": str(c.label_path), "case_id": c.case_id}
            for c in chosen
        ]

    def load_case(self, case_id: str) -> tuple[np.ndarray, np.ndarray]:
        """Read one case's voxels and check its label values.

        Args:
            case_id: The case to read.

        Returns:
            ``(image, label)``: image ``[X, Y, Z]`` (or ``[X, Y, Z, C]``) in the on-disk dtype
            after NIfTI scaling, label ``[X, Y, Z]`` as int64.

        Raises:
            DataValidationError: The files cannot be read or the label holds undeclared values.
        """
        case = self[case_id]
        try:
            image = _read_array(case.image_path)
            label = _read_array(case.label_path)
        except Exception as err:
            raise DataValidationError(
                self.root,
                [
                    f"case {case_id}: voxel data unreadable ({type(err).__name__}: {err}); "
                    "re-export or remove the case"
                ],
            ) from err
        problem = _label_value_problem(
            np.unique(label),
            self.label_values,
            case_id,
            case.label_path.name,
            self._label_source(),
        )
        if problem:
            raise DataValidationError(self.root, [problem])
        return image, label.astype(np.int64)

    def validate_all(self) -> None:
        """Read every label map (and image) and raise once if any case is bad.

        Header checks already ran at load; this reads voxel data, so it finds truncated files
        and undeclared label values. The hippocampus set (220 cases) takes about a second.

        Raises:
            DataValidationError: Listing every bad case.
        """
        problems: list[str] = []
        for case in self.cases:
            try:
                label = _read_array(case.label_path)
                _read_array(case.image_path)
            except Exception as err:
                problems.append(
                    f"case {case.case_id}: voxel data unreadable ({type(err).__name__}: {err}); "
                    "re-export or remove the case"
                )
                continue
            problem = _label_value_problem(
                np.unique(label),
                self.label_values,
                case.case_id,
                case.label_path.name,
                self._label_source(),
            )
            if problem:
                problems.append(problem)
        if problems:
            raise DataValidationError(self.root, problems)


def _parse_label_names(raw: Any) -> dict[int, str] | None:
    """MSD ``{"0": "background"}`` or nnU-Net v2 ``{"background": 0}`` -> ``{0: "background"}``."""
    if not isinstance(raw, Mapping) or not raw:
        return None
    if all(str(k).lstrip("-").isdigit() for k in raw):
        return {int(k): str(v) for k, v in raw.items()}
    if all(isinstance(v, int) for v in raw.values()):
        return {int(v): str(k) for k, v in raw.items()}
    return None


def _header_facts(path: Path) -> tuple[tuple[int, ...], tuple[float, ...], str]:
    import nibabel as nib

    img: Any = nib.load(str(path))
    zooms = tuple(float(z) for z in img.header.get_zooms())
    return tuple(int(s) for s in img.shape), zooms, str(img.header.get_data_dtype())


# Pairing results: case ID -> (image, label); (case ID, message) for unpaired files and for
# other problems (case ID None when the problem belongs to no case), so that a case_ids filter
# can drop the problems of cases the caller did not ask for.
_Pairs = dict[str, tuple[Path, Path]]
_Notes = list[tuple[str | None, str]]


def _pairs_from_index(root: Path, training: list[Any]) -> tuple[_Pairs, _Notes, _Notes]:
    """Pair images and labels from the ``training`` list of an MSD ``dataset.json``."""
    pairs: _Pairs = {}
    unpaired: _Notes = []
    problems: _Notes = []
    for i, entry in enumerate(training):
        image_rel = entry.get("image") if isinstance(entry, Mapping) else None
        if not isinstance(image_rel, str):
            problems.append((None, f"dataset.json training[{i}]: no 'image' path; add one"))
            continue
        image_path = (root / image_rel).resolve()
        cid = _case_id(image_path)
        label_rel = entry.get("label")
        if not isinstance(label_rel, str):
            msg = f"case {cid}: image {image_rel} has no 'label' in dataset.json training[{i}]"
            unpaired.append((cid, msg))
            continue
        label_path = (root / label_rel).resolve()
        for kind, p in (("image", image_path), ("label", label_path)):
            if not p.is_file():
                problems.append(
                    (
                        cid,
                        f"case {cid}: {kind} file {p} listed in dataset.json does not exist; "
                        "restore it or remove the entry",
                    )
                )
        if cid in pairs:
            problems.append((cid, f"case {cid}: listed twice in dataset.json training"))
        pairs[cid] = (image_path, label_path)
    return pairs, unpaired, problems


def _pairs_from_folders(root: Path) -> tuple[_Pairs, _Notes, _Notes]:
    """Pair ``imagesTr/<case>.nii.gz`` with ``labelsTr/<case>.nii.gz`` by case ID."""
    image_dir, label_dir = root / "imagesTr", root / "labelsTr"
    missing = [d.name + "/" for d in (image_dir, label_dir) if not d.is_dir()]
    if missing:
        raise DataValidationError(
            root,
            [
                f"missing folder(s) {missing} and no dataset.json with a 'training' list; "
                "expected imagesTr/<case>.nii.gz paired with labelsTr/<case>.nii.gz (or, for "
                "2D PNG / JPEG, images/<case>.png paired with masks/<case>.png)"
            ],
        )
    problems: _Notes = []
    labels: dict[str, Path] = {}
    for p in sorted(label_dir.iterdir()):
        if _is_nifti(p):
            cid = _case_id(p)
            if cid in labels:
                problems.append(
                    (cid, f"case {cid}: two label files ({labels[cid].name}, {p.name})")
                )
            labels[cid] = p
    images: dict[str, Path] = {}
    for p in sorted(image_dir.iterdir()):
        if not _is_nifti(p):
            continue
        cid = _case_id(p)
        stripped = _MODALITY_SUFFIX.sub("", cid)
        if cid not in labels and stripped in labels:
            cid = stripped
        if cid in images:
            problems.append((cid, f"case {cid}: two image files ({images[cid].name}, {p.name})"))
        images[cid] = p
    if not images and not labels:
        problems.append((None, "imagesTr/ and labelsTr/ hold no .nii / .nii.gz files"))

    pairs: _Pairs = {}
    unpaired: _Notes = []
    for cid in sorted(set(images) | set(labels)):
        if cid in images and cid in labels:
            pairs[cid] = (images[cid], labels[cid])
        elif cid in images:
            msg = f"case {cid}: image imagesTr/{images[cid].name} has no label in labelsTr/"
            unpaired.append((cid, msg))
        else:
            msg = f"case {cid}: label labelsTr/{labels[cid].name} has no image in imagesTr/"
            unpaired.append((cid, msg))
    return pairs, unpaired, problems


def _check_pair(cid: str, image_path: Path, label_path: Path) -> SegmentationCase | list[str]:
    """Read both headers and check they describe one voxel grid; problems or the case."""
    facts = {}
    problems = []
    for kind, p in (("image", image_path), ("label", label_path)):
        try:
            facts[kind] = _header_facts(p)
        except Exception as err:  # nibabel raises several types for corrupt / foreign files
            problems.append(
                f"case {cid}: {kind} {p.name} is unreadable or corrupt "
                f"({type(err).__name__}: {err}); re-export or remove the case"
            )
    if problems:
        return problems
    (ishape, izoom, idtype), (lshape, lzoom, ldtype) = facts["image"], facts["label"]
    if len(ishape) not in (2, 3, 4):
        problems.append(
            f"case {cid}: image {image_path.name} has shape {ishape}; expected 3-D (X,Y,Z) or "
            "4-D (X,Y,Z,C), or 2-D (X,Y) / (X,Y,1) for 2D segmentation"
        )
    if len(lshape) not in (2, 3):
        problems.append(
            f"case {cid}: label {label_path.name} has shape {lshape}; expected 3-D (X,Y,Z) "
            "(or 2-D (X,Y))"
        )
    if problems:
        return problems
    n = min(len(ishape), 3)  # spatial axes of the image; a 4th axis holds channels
    if ishape[:n] != lshape:
        return [
            f"case {cid}: image shape {ishape[:n]} != label shape {lshape}; image and label "
            "must be on the same voxel grid (resample the label onto the image)"
        ]
    if not np.allclose(izoom[:n], lzoom[:n], rtol=1e-3, atol=1e-4):
        return [
            f"case {cid}: image spacing {izoom[:n]} != label spacing {lzoom[:n]} mm; fix the "
            "label header"
        ]
    return SegmentationCase(
        case_id=cid,
        image_path=image_path,
        label_path=label_path,
        shape=tuple(ishape[:n]),
        spacing=tuple(izoom[:n]),
        image_dtype=idtype,
        label_dtype=ldtype,
        channels=ishape[3] if len(ishape) == 4 else 1,
    )


def load_segmentation_folder(
    path: str | Path,
    *,
    num_classes: int | None = None,
    on_unpaired: str = "error",
    case_ids: Sequence[str] | None = None,
    dicom_series: str | None = None,
    cache_dir: str | Path | None = None,
) -> SegmentationCases:
    """Index a segmentation dataset folder from its NIfTI (or PNG / JPEG) headers.

    The folder either has an MSD-style ``dataset.json`` (its ``training`` list pairs images
    with labels and its ``labels`` dict declares the classes) or ``imagesTr/`` and
    ``labelsTr/`` folders whose files pair by case ID (the file name without ``.nii(.gz)``;
    an image named ``<case>_0000`` in nnU-Net style pairs with label ``<case>``; hidden files
    such as macOS ``._*`` forks are ignored). A folder of DICOM series goes to
    :mod:`.dicom_folders`, one of ``images/`` + ``masks/`` (PNG / JPEG) to :mod:`.images2d`.
    Header checks run for every case; voxel checks run lazily
    (:meth:`SegmentationCases.load_case`, the label check in :func:`segmentation_transforms`)
    or all at once with :meth:`SegmentationCases.validate_all`.

    Unpaired files are an error by default: silently dropping a case changes ``N``, which
    enters the sampling rate of the privacy accounting and the dataset record of the report.
    ``on_unpaired="warn"`` drops them with a warning instead.

    Args:
        path: The dataset folder.
        num_classes: Declared classes (background included); overrides ``dataset.json``.
        on_unpaired: ``"error"`` or ``"warn"`` for an image without a label or vice versa.
        case_ids: Only index these cases; problems of other cases are not reported.
        dicom_series: For a folder of DICOM series (one per case, handed to
            :func:`~dpkfc_med.data.dicom_folders.load_dicom_segmentation_folder`): regex of
            the ``SeriesDescription`` to read where a case has several.
        cache_dir: For DICOM series: where their NIfTI conversions are kept.

    Returns:
        :class:`SegmentationCases`, sorted by case ID.

    Raises:
        DataValidationError: Listing every problem: missing folder or files, unpaired
            files, unreadable headers, image/label shape or spacing mismatch.
    """
    root = Path(path).expanduser()
    if on_unpaired not in ("error", "warn"):
        raise ValueError(f"on_unpaired={on_unpaired!r} is not one of 'error', 'warn'")
    if not root.is_dir():
        raise DataValidationError(
            root,
            [
                "folder not found; pass a folder with imagesTr/ + labelsTr/ or a dataset.json "
                "(--data PATH, or resolve_data_path(..., kind='dir'))"
            ],
        )
    from dpkfc_med.data import dicom_folders, images2d  # lazy: they build on this module

    if images2d.is_image_mask_folder(root) and not (root / "imagesTr").is_dir():
        return images2d.load_image_mask_folder(
            root, num_classes=num_classes, on_unpaired=on_unpaired, case_ids=case_ids
        )

    if dicom_folders.is_dicom_series_folder(root):
        return dicom_folders.load_dicom_segmentation_folder(
            root,
            num_classes=num_classes,
            on_unpaired=on_unpaired,
            case_ids=case_ids,
            dicom_series=dicom_series,
            cache_dir=cache_dir,
        )

    meta: dict[str, Any] = {}
    index = root / "dataset.json"
    if index.is_file():
        try:
            meta = json.loads(index.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise DataValidationError(
                index, [f"not valid JSON ({err}); fix or remove dataset.json"]
            ) from err
    label_names = _parse_label_names(meta.get("labels"))
    if isinstance(meta.get("training"), list):
        source = "dataset.json"
        pairs, unpaired, notes = _pairs_from_index(root, meta["training"])
    else:
        source = "imagesTr/labelsTr"
        pairs, unpaired, notes = _pairs_from_folders(root)

    if case_ids is not None:
        wanted = set(case_ids)
        known = set(pairs) | {cid for cid, _ in unpaired}
        notes = [(cid, m) for cid, m in notes if cid is None or cid in wanted]
        notes += [
            (cid, f"case {cid}: requested in case_ids but not found in {root}")
            for cid in sorted(wanted - known)
        ]
        pairs = {k: v for k, v in pairs.items() if k in wanted}
        unpaired = [(cid, m) for cid, m in unpaired if cid in wanted]
    problems = [m for _, m in notes]

    dropped: list[str] = []
    if unpaired and on_unpaired == "error":
        problems += [
            f"{msg} (pair it, delete it, or pass on_unpaired='warn' to skip it)"
            for _, msg in unpaired
        ]
    elif unpaired:
        dropped = [msg for _, msg in unpaired]
        warnings.warn(
            f"{root}: skipped {len(dropped)} unpaired file(s): " + "; ".join(dropped),
            stacklevel=2,
        )

    cases: list[SegmentationCase] = []
    for cid in sorted(pairs):
        image_path, label_path = pairs[cid]
        if not (image_path.is_file() and label_path.is_file()):
            continue  # already reported by the pairing step
        checked = _check_pair(cid, image_path, label_path)
        if isinstance(checked, list):
            problems += checked
        else:
            cases.append(checked)

    if problems:
        raise DataValidationError(root, problems)
    if not cases:
        raise DataValidationError(root, ["no image/label pairs found; check the folder layout"])
    if num_classes is not None:
        declared: int | None = num_classes
    else:
        declared = max(label_names) + 1 if label_names else None
    return SegmentationCases(
        root=root.resolve(),
        cases=cases,
        label_names=label_names,
        num_classes=declared,
        source=source,
        dropped=dropped,
    )


def _split_uniform(case_id: str, seed: int) -> float:
    """A uniform number in ``[0, 1)`` from a BLAKE2b hash of ``case_id`` keyed by ``seed``."""
    key = int(seed).to_bytes(16, "little", signed=True)
    digest = hashlib.blake2b(
        case_id.encode("utf-8"), digest_size=8, key=key, person=b"dpkfc-split"
    ).digest()
    return (int.from_bytes(digest, "little") >> 11) / float(1 << 53)  # 53 bits: exact float


def deterministic_split(
    case_ids: Sequence[str],
    fractions: Sequence[float] = (0.7, 0.15, 0.15),
    seed: int = 0,
    names: Sequence[str] = ("train", "val", "test"),
    *,
    allow_empty: bool = False,
) -> dict[str, list[str]]:
    """Split case IDs reproducibly, each case by a keyed hash of its own ID.

    Case ``c`` gets ``u = blake2b(c, key=seed)`` read as a uniform number in ``[0, 1)`` and
    joins the first split ``i`` with ``u < f_1 + ... + f_i``. Its split is a function of its
    own ID and the seed only: adding a case to the folder or removing one changes the split of
    that case and of no other (a permutation of all IDs cut by fractions would move many), and
    the file-system listing order plays no part. Counts are therefore random, binomial around
    ``f * n`` (for 220 cases and ``f = 0.15``: 33 +- 5.3), not ``floor(f * n)``. Write the
    result into the run directory (:func:`save_split`) so evaluation uses the same cases.

    Privacy guarantee:
        The split is stable in the neighbouring relation of the folder: adding or removing one
        case changes at most that case's membership in the training split, so a guarantee about
        the training split's units is one about the folder's cases.

    Args:
        case_ids: Unique case IDs.
        fractions: One non-negative fraction per split, summing to 1.
        seed: Key of the hash (any integer in ``[-2**127, 2**127)``).
        names: Split names, as many as ``fractions``.
        allow_empty: Return a split with a positive fraction that drew no case instead of
            raising (a caller that reports other problems of the folder first).

    Returns:
        ``{name: sorted case IDs}`` in the order of ``names``.

    Raises:
        ValueError: Duplicate IDs, fractions that are negative or do not sum to 1, a
            ``names`` / ``fractions`` length mismatch, or (unless ``allow_empty``) a split with
            a positive fraction that drew no case (a folder too small for its fractions).

    Examples:
        >>> deterministic_split([f"c{i}" for i in range(10)], seed=1)["val"]
        ['c4', 'c6']
        >>> deterministic_split([f"c{i}" for i in range(11)], seed=1)["val"]  # c10 added
        ['c4', 'c6']
    """
    ids = sorted(case_ids)
    problems = []
    if len(set(ids)) != len(ids):
        dup = sorted({c for c in ids if ids.count(c) > 1})
        problems.append(f"duplicate case IDs {dup}")
    if len(fractions) != len(names):
        problems.append(f"{len(fractions)} fractions for {len(names)} names {list(names)}")
    if any(f < 0 for f in fractions) or not np.isclose(sum(fractions), 1.0):
        problems.append(f"fractions {list(fractions)} must be >= 0 and sum to 1")
    if problems:
        raise ValueError("deterministic_split: " + "; ".join(problems))

    bounds = np.cumsum(np.asarray(fractions, dtype=np.float64))
    bounds /= bounds[-1]  # exactly 1.0 at the end: rounding of the sum leaves no case out
    out: dict[str, list[str]] = {name: [] for name in names}
    for cid in ids:
        u = _split_uniform(cid, seed)
        # first split whose upper bound exceeds u (zero-fraction splits have an empty range)
        out[names[int(np.searchsorted(bounds, u, side="right"))]].append(cid)
    empty = [
        f"split {name!r} (fraction {f:g}) drew none of the {len(ids)} cases"
        for name, f in zip(names, fractions)
        if f > 0 and not out[name]
    ]
    if empty and not allow_empty:
        raise ValueError(
            "deterministic_split: "
            + "; ".join(empty)
            + " (each case joins a split with probability equal to its fraction, by a hash of "
            "its ID); add cases, raise the fraction, or set it to 0 if the split is not needed"
        )
    return out


def save_split(split: Mapping[str, Sequence[str]], path: str | Path) -> Path:
    """Write a split as JSON (``{name: [case IDs]}``) so a run records which cases it used."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({k: list(v) for k, v in split.items()}, indent=1) + "\n")
    return path


def load_split(path: str | Path) -> dict[str, list[str]]:
    """Read a split written by :func:`save_split`."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or not all(isinstance(v, list) for v in data.values()):
        raise DataValidationError(path, ["expected a JSON object {split: [case IDs]}"])
    return {str(k): [str(c) for c in v] for k, v in data.items()}


class _CheckLabelValues:
    """Transform that fails on undeclared label values right after a volume is loaded.

    A plain callable (MONAI's ``Compose`` accepts any) so this module imports MONAI lazily.
    """

    def __init__(self, allowed: Sequence[int] | None, label_key: str = "label") -> None:
        self.allowed = None if allowed is None else tuple(int(v) for v in allowed)
        self.label_key = label_key

    def __call__(self, data: Mapping[str, Any]) -> Mapping[str, Any]:
        label = data[self.label_key]
        values = torch.unique(torch.as_tensor(label)).cpu().numpy()
        meta = getattr(label, "meta", {}) or {}
        label_path = Path(str(meta.get("filename_or_obj", "unknown label file")))
        case_id = str(data.get("case_id", _case_id(label_path)))
        problem = _label_value_problem(
            values, self.allowed, case_id, label_path.name, "label_values"
        )
        if problem:
            raise DataValidationError(label_path, [problem])
        return data


def segmentation_transforms(
    *,
    spatial_size: int | Sequence[int],
    train: bool,
    num_patches_per_volume: int = 1,
    intensity: IntensityNorm | str = IntensityNorm.ZSCORE,
    crop: CropMode | str = CropMode.POS_NEG,
    pos: float = 1.0,
    neg: float = 1.0,
    percentiles: tuple[float, float] = (0.5, 99.5),
    label_values: Sequence[int] | None = None,
    eval_center_crop: bool = False,
    reader: str = "NibabelReader",
    slices: Any = None,
) -> Callable[[dict[str, Any]], Any]:
    """MONAI dictionary-transform preset for 3D or 2D segmentation (keys ``image``, ``label``).

    Pipeline: ``LoadImaged`` (``reader``) -> ``EnsureChannelFirstd`` -> 2D: trailing size-1
    axes dropped -> label value check (if ``label_values``) -> label cast to int64 -> per-volume
    (per-image) intensity normalisation -> ``SpatialPadd`` to at least ``spatial_size`` ->
    training only: ``k`` random patches (``RandCropByPosNegLabeld`` or
    ``RandSpatialCropSamplesd``). Evaluation is deterministic: the whole padded volume, or its
    centre crop with ``eval_center_crop``. With ``slices`` the volume is normalised whole, then
    training takes the rule's slices of a draw (:class:`~dpkfc_med.data.slices.RandSlicesd`),
    each padded to the 2D ``spatial_size`` and cropped to it at a random position; evaluation
    keeps the whole volume, padded in-plane (a slice-by-slice inferer predicts it).

    Args:
        spatial_size: Patch size ``(X, Y, Z)`` or ``(X, Y)`` (an int means a cube).
        train: Training pipeline (random patches) or evaluation pipeline (no randomness).
        num_patches_per_volume: ``k`` patches per volume in training.
        intensity: ``"zscore"`` (mean/std over nonzero voxels) or ``"percentile"`` (robust
            min-max to [0, 1] at ``percentiles``).
        crop: ``"pos_neg"`` (centres on foreground with probability ``pos / (pos + neg)``) or
            ``"random"`` (uniform).
        pos: Foreground weight for ``"pos_neg"``.
        neg: Background weight for ``"pos_neg"``.
        percentiles: Lower and upper percentile for ``"percentile"``.
        label_values: Allowed label values; a volume holding others raises
            :class:`DataValidationError` naming the case. ``None`` skips the check.
        eval_center_crop: In evaluation, centre-crop to ``spatial_size`` so volumes batch.
        reader: MONAI reader of the files (``"NibabelReader"``; ``"PILReader"`` for PNG).
        slices: A :class:`~dpkfc_med.data.slices.SliceRule`: 2D samples are slices of the
            3-D volumes (``spatial_size`` is in-plane).

    Returns:
        A ``monai.transforms.Compose``. In training it maps a record to a list of ``k``
        dicts, each with ``image [C, *spatial_size]`` float32 and ``label [1, *spatial_size]``
        int64; in evaluation to one dict.
    """
    from monai.transforms import (  # lazy: MONAI's import costs seconds
        CastToTyped,
        CenterSpatialCropd,
        Compose,
        EnsureChannelFirstd,
        EnsureTyped,
        LoadImaged,
        NormalizeIntensityd,
        RandCropByPosNegLabeld,
        RandSpatialCropSamplesd,
        ScaleIntensityRangePercentilesd,
        SpatialPadd,
    )

    intensity = _enum(IntensityNorm, intensity, "intensity")
    crop = _enum(CropMode, crop, "crop")
    if num_patches_per_volume < 1:
        raise ValueError(f"num_patches_per_volume={num_patches_per_volume} must be >= 1")
    size = (spatial_size,) * 3 if isinstance(spatial_size, int) else tuple(spatial_size)
    if len(size) not in (2, 3) or any(int(s) < 1 for s in size):
        raise ValueError(f"spatial_size={spatial_size!r} must be an int or 2 or 3 positive ints")
    if slices is not None and len(size) != 2:
        raise ValueError(f"spatial_size={spatial_size!r}: slices need an in-plane (2D) size")
    keys = ["image", "label"]

    with warnings.catch_warnings():
        # LoadImaged always instantiates MONAI's optional GPU DICOM reader, which warns when
        # nvImageCodec is absent; NIfTI loading never uses it.
        warnings.filterwarnings("ignore", message="NvImgCodecPydicomReader")
        load = LoadImaged(keys=keys, reader=reader, image_only=True)
    steps: list[Any] = [load, EnsureChannelFirstd(keys=keys)]
    if len(size) == 2 and slices is None:
        from dpkfc_med.data.slices import SqueezeToSpatialDims

        steps.append(SqueezeToSpatialDims(2, keys))
    if label_values is not None:
        steps.append(_CheckLabelValues(label_values))
    steps += [
        EnsureTyped(keys="image", dtype=torch.float32, track_meta=True),
        CastToTyped(keys="label", dtype=torch.int64),
    ]
    if intensity is IntensityNorm.ZSCORE:
        steps.append(NormalizeIntensityd(keys="image", nonzero=True, channel_wise=True))
    else:
        steps.append(
            ScaleIntensityRangePercentilesd(
                keys="image",
                lower=percentiles[0],
                upper=percentiles[1],
                b_min=0.0,
                b_max=1.0,
                clip=True,
                channel_wise=True,
            )
        )
    if slices is not None:
        from monai.transforms import RandSpatialCropd

        from dpkfc_med.data.slices import RandSlicesd

        if train:
            steps += [
                RandSlicesd(slices, keys),
                SpatialPadd(keys=keys, spatial_size=size),
                RandSpatialCropd(keys=keys, roi_size=size, random_size=False),
            ]
        else:  # in-plane padding only (-1 keeps the slice axis)
            whole = [int(v) for v in size]
            whole.insert(slices.axis, -1)
            steps.append(SpatialPadd(keys=keys, spatial_size=whole))
        return Compose(steps)
    steps.append(SpatialPadd(keys=keys, spatial_size=size))
    if train:
        if crop is CropMode.POS_NEG:
            steps.append(
                RandCropByPosNegLabeld(
                    keys=keys,
                    label_key="label",
                    spatial_size=size,
                    pos=pos,
                    neg=neg,
                    num_samples=num_patches_per_volume,
                    image_key="image",
                    image_threshold=0.0,
                )
            )
        else:
            steps.append(
                RandSpatialCropSamplesd(
                    keys=keys, roi_size=size, num_samples=num_patches_per_volume, random_size=False
                )
            )
    elif eval_center_crop:
        steps.append(CenterSpatialCropd(keys=keys, roi_size=size))
    return Compose(steps)


def _plain(x: Any, dtype: torch.dtype) -> torch.Tensor:
    """MetaTensor / array -> plain tensor; Opacus hooks and collation need no metadata."""
    if hasattr(x, "as_tensor"):
        x = x.as_tensor()
    return torch.as_tensor(x).to(dtype)


def _unwrap_transform_error(err: BaseException) -> BaseException | None:
    """MONAI wraps transform errors in RuntimeError; find our own error in the cause chain."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, DataValidationError):
            return seen
        seen = seen.__cause__
    return None


class VolumeDataset(Dataset):
    """One item per volume, holding all of that volume's patches: the volume is the privacy unit.

    Item ``i`` is ``{"image": [k, C, *patch] float32, "label": [k, 1, *patch] int64,
    "case_id": str}``; the default collate turns a batch of ``B`` volumes into
    ``[B, k, C, *patch]``. In evaluation (``train=False``) ``k`` is 1 and ``patch`` is the
    padded volume shape (or ``spatial_size`` with ``eval_center_crop=True``).

    Privacy guarantee:
        A sampler over this dataset includes or excludes whole volumes, and a per-item
        gradient (the loss summed over the ``k`` patches) is clipped as one unit, so the
        neighbouring relation is add/remove one volume (one case / patient in MSD data).
        Before each item the transform is reseeded with that volume's own random state, a
        function of ``(seed, case_id, draws of this volume so far)``
        (:func:`~dpkfc_med.data.units.unit_random_state`): a volume's patches do not depend
        on which other volumes were drawn before it, so its clipped gradient depends on its
        own data and sampling history only.

    Args:
        cases: The indexed dataset.
        case_ids: The cases of this dataset (e.g. one split); all cases by default.
        transform: A callable mapping ``{"image", "label", "case_id"}`` file records to a dict
            or list of dicts; by default :func:`segmentation_transforms` with the arguments
            below and ``label_values=cases.label_values``. A random transform must own its
            random state (``set_random_state``, as MONAI's ``Compose`` does) so that it can be
            reseeded per volume; one drawing from a global generator would share it.
        spatial_size: Patch size for the default transform.
        train: Training (random patches) or evaluation pipeline for the default transform.
        num_patches_per_volume: ``k`` for the default transform.
        seed: Run seed of the per-volume random streams: the ``d``-th draw of case ``c``
            (counted per process; in a ``DataLoader`` worker the worker's seed is hashed in)
            gets the same patches in every run and whatever else was drawn. ``None`` draws
            each item's random state from OS entropy (independent, not reproducible).
        **transform_kwargs: Further arguments of :func:`segmentation_transforms`.
    """

    def __init__(
        self,
        cases: SegmentationCases,
        *,
        case_ids: Sequence[str] | None = None,
        transform: Callable[[dict[str, Any]], Any] | None = None,
        spatial_size: int | Sequence[int] | None = None,
        train: bool = True,
        num_patches_per_volume: int = 1,
        seed: int | None = None,
        **transform_kwargs: Any,
    ) -> None:
        self.cases = cases if case_ids is None else cases.select(case_ids)
        self.records = self.cases.data_dicts()
        self.num_patches = num_patches_per_volume if train else 1
        if transform is None:
            if spatial_size is None:
                raise ValueError("VolumeDataset: pass spatial_size or a transform")
            transform_kwargs.setdefault("label_values", cases.label_values)
            transform = segmentation_transforms(
                spatial_size=spatial_size,
                train=train,
                num_patches_per_volume=num_patches_per_volume,
                **transform_kwargs,
            )
        self.transform = transform
        self.seed = seed
        self._draws = [0] * len(self.records)  # per volume: times drawn in this process

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict[str, Any]:
        record = dict(self.records[index])
        # The volume's own stream, never one shared by all volumes: with a shared stream its
        # patches would depend on how many other volumes the secret sampler drew before it.
        reseed_for_unit(self.transform, self.seed, record["case_id"], self._draws[index])
        self._draws[index] += 1
        try:
            out = self.transform(record)
        except Exception as err:
            ours = _unwrap_transform_error(err)
            if ours is not None:
                raise ours from err
            raise DataValidationError(
                self.cases.root,
                [
                    f"case {record['case_id']}: transform failed ({type(err).__name__}: "
                    f"{err.__cause__ or err}); check the files or run validate_all()"
                ],
            ) from err
        patches = out if isinstance(out, list) else [out]
        image = torch.stack([_plain(p["image"], torch.float32) for p in patches])
        label = torch.stack([_plain(p["label"], torch.int64) for p in patches])
        return {"image": image, "label": label, "case_id": record["case_id"]}
