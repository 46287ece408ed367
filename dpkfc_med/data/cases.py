"""Segmentation cases: the index of image/label pairs, read from their file headers.

A :class:`SegmentationCases` holds header facts only (shape, spacing, dtypes); voxels are read
on demand (:meth:`SegmentationCases.load_case`) or all at once to check every label map
(:meth:`SegmentationCases.validate_all`). The folder readers that build it are
:mod:`.formats.nifti` (NIfTI folders, MSD ``dataset.json``), :mod:`.formats.dicom_series`
(DICOM series) and :mod:`.formats.images2d` (PNG / JPEG), registered in :mod:`.formats`.
Problems are collected and raised once, each naming its case.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from dpkfc_med.data.errors import DataValidationError
from dpkfc_med.data.paths import sha256_file

__all__ = [
    "IMAGE_SUFFIXES",
    "SegmentationCase",
    "SegmentationCases",
    "case_id_from_path",
    "check_nifti_case",
    "collect_cases",
    "read_headers",
    "header_facts",
    "image_digest",
    "is_nifti_file",
    "label_value_problem",
    "read_array",
    "read_case_image",
    "read_image_array",
]

_NIFTI_SUFFIXES = (".nii.gz", ".nii")


def case_id_from_path(path: Path) -> str:
    """The case ID of a file: its name without ``.nii(.gz)`` (else without its suffix)."""
    name = path.name
    for suffix in _NIFTI_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return path.stem


def is_nifti_file(path: Path) -> bool:
    """Whether ``path`` is a visible ``.nii`` / ``.nii.gz`` file."""
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
        channels: Image channels (a 4-D NIfTI stores them last; one file per modality gives
            one channel each; 1 for a 3-D image).
        modality_files: One file per modality, in channel order (nnU-Net's
            ``<case>_0000.nii.gz``, ``<case>_0001.nii.gz``, ...), when the image is stored that
            way; empty when ``image_path`` holds every channel. ``image_path`` is then the
            first of them.
    """

    case_id: str
    image_path: Path
    label_path: Path
    shape: tuple[int, ...]
    spacing: tuple[float, ...]
    image_dtype: str
    label_dtype: str
    channels: int = 1
    modality_files: tuple[Path, ...] = ()

    @property
    def image_files(self) -> tuple[Path, ...]:
        """Every file of the image, in channel order (one unless stored per modality)."""
        return self.modality_files or (self.image_path,)


def label_value_problem(
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


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".tif", ".tiff", ".bmp")
"""File name endings read as 2D images (case-insensitive)."""


def read_image_array(path: str | Path) -> np.ndarray:
    """Pixels of a PNG / JPEG / TIFF / BMP file as ``[W, H]`` or ``[W, H, C]`` (MONAI's order).

    A palette PNG gives its palette indices (the class ids of a palette mask).
    """
    from PIL import Image

    with Image.open(path) as img:
        array = np.asarray(img)
    return np.swapaxes(array, 0, 1)


def read_array(path: Path) -> np.ndarray:
    """The voxels of a NIfTI file (after its scaling) or the pixels of a PNG / JPEG file."""
    if path.suffix.lower() in IMAGE_SUFFIXES:
        return read_image_array(path)
    import nibabel as nib

    img: Any = nib.load(str(path))  # typed as the generic FileBasedImage by nibabel
    return np.asanyarray(img.dataobj)


def read_case_image(case: SegmentationCase) -> np.ndarray:
    """A case's image voxels; modality files are stacked last (``[X, Y, Z, C]``, as 4-D NIfTI)."""
    if not case.modality_files:
        return read_array(case.image_path)
    return np.stack([read_array(p) for p in case.modality_files], axis=-1)


def image_digest(case: SegmentationCase) -> str:
    """SHA-256 of a case's image: of its file, or of its modality files' digests in order."""
    digests = [sha256_file(p) for p in case.image_files]
    if len(digests) == 1:
        return digests[0]
    return hashlib.sha256(" ".join(digests).encode()).hexdigest()


def header_facts(path: Path) -> tuple[tuple[int, ...], tuple[float, ...], str]:
    """``(shape, zooms, on-disk dtype)`` of a NIfTI file, read from its header only."""
    import nibabel as nib

    img: Any = nib.load(str(path))
    zooms = tuple(float(z) for z in img.header.get_zooms())
    return tuple(int(s) for s in img.shape), zooms, str(img.header.get_data_dtype())


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

    def data_dicts(self, case_ids: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """MONAI-style records ``{"image": path, "label": path, "case_id": id}``.

        An image stored one file per modality gives the list of its files (MONAI's
        ``LoadImaged`` stacks them as channels, in that order).
        """
        chosen = self.cases if case_ids is None else [self[c] for c in case_ids]
        return [
            {
                "image": [str(p) for p in c.modality_files] or str(c.image_path),
                "label": str(c.label_path),
                "case_id": c.case_id,
            }
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
            image = read_case_image(case)
            label = read_array(case.label_path)
        except Exception as err:
            raise DataValidationError(
                self.root,
                [
                    f"case {case_id}: voxel data unreadable ({type(err).__name__}: {err}); "
                    "re-export or remove the case"
                ],
            ) from err
        problem = label_value_problem(
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
                label = read_array(case.label_path)
                read_case_image(case)
            except Exception as err:
                problems.append(
                    f"case {case.case_id}: voxel data unreadable ({type(err).__name__}: {err}); "
                    "re-export or remove the case"
                )
                continue
            problem = label_value_problem(
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


def _modality_problems(cid: str, images: tuple[Path, ...], facts: dict[str, Any]) -> list[str]:
    """Per-modality files must each hold one channel on one voxel grid."""
    (shape, zoom, _), first = facts["image"], images[0].name
    problems = []
    for i, path in enumerate(images):
        ishape, izoom, _ = facts["image" if i == 0 else f"modality {i:04d}"]
        if len(ishape) not in (2, 3):
            problems.append(
                f"case {cid}: modality file {path.name} has shape {ishape}; each per-modality "
                "file holds one 3-D (X,Y,Z) or 2-D channel (a 4-D image goes in one file alone)"
            )
        elif ishape != shape or not np.allclose(izoom, zoom, rtol=1e-3, atol=1e-4):
            problems.append(
                f"case {cid}: modality file {path.name} is {ishape} at {izoom} mm but {first} "
                f"is {shape} at {zoom} mm; register every modality onto one voxel grid"
            )
    return problems


def check_nifti_case(
    cid: str,
    images: tuple[Path, ...],
    label_path: Path,
    modalities: int | None,
    declared_by: str = "dataset.json",
) -> SegmentationCase | list[str]:
    """Read a NIfTI case's headers and check they describe one voxel grid: the case, or problems.

    ``images`` is one file (3-D, or 4-D with channels last) or one file per modality;
    ``modalities`` is the channel count ``declared_by`` (``dataset.json``, ``data.channels``)
    declares, if one does.
    """
    image_path = images[0]
    files = {"image": image_path, **{f"modality {i:04d}": p for i, p in enumerate(images) if i}}
    facts, problems = read_headers(cid, {**files, "label": label_path}, header_facts)
    if problems:
        return problems
    if len(images) > 1:
        problems = _modality_problems(cid, images, facts)
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
    channels = len(images) if len(images) > 1 else (ishape[3] if len(ishape) == 4 else 1)
    if modalities is not None and channels != modalities:
        names = ", ".join(p.name for p in images)
        return [
            f"case {cid}: {channels} channel(s) ({names}) but {declared_by} declares "
            f"{modalities} modalit{'y' if modalities == 1 else 'ies'}; every case needs each "
            "declared modality (one 4-D file, or <case>_0000, <case>_0001, ... one file per "
            "modality)"
        ]
    return SegmentationCase(
        case_id=cid,
        image_path=image_path,
        label_path=label_path,
        shape=tuple(ishape[:n]),
        spacing=tuple(izoom[:n]),
        image_dtype=idtype,
        label_dtype=ldtype,
        channels=channels,
        modality_files=images if len(images) > 1 else (),
    )


def collect_cases(
    root: Path,
    checked: Iterable[SegmentationCase | list[str]],
    problems: list[str],
    *,
    empty: str,
    **fields: Any,
) -> SegmentationCases:
    """The cases of a folder from each case's check: the case, or its problems.

    Every problem (``problems`` found before, then each case's) is raised at once; a folder
    without a case is refused with ``empty``.

    Args:
        root: The folder (named in the error).
        checked: Each case's :class:`SegmentationCase` or its list of problems.
        problems: Problems found before the cases were checked (pairing, unreadable files).
        empty: The refusal of a folder with no case, with its fix.
        **fields: The other :class:`SegmentationCases` fields (``num_classes``, ``source``...).

    Raises:
        DataValidationError: Naming every problem, or ``empty``.
    """
    cases: list[SegmentationCase] = []
    problems = list(problems)
    for case in checked:
        if isinstance(case, list):
            problems += case
        else:
            cases.append(case)
    if problems:
        raise DataValidationError(root, problems)
    if not cases:
        raise DataValidationError(root, [empty])
    return SegmentationCases(root=root.resolve(), cases=cases, **fields)


def read_headers(
    cid: str,
    files: Mapping[str, Path],
    read: Callable[[Path], Any],
    shown: Callable[[Path], str] = lambda p: p.name,
) -> tuple[dict[str, Any], list[str]]:
    """Each file's header facts by ``read``, and a problem for each file it cannot read.

    Args:
        cid: The case (named in every problem).
        files: Kind (``image``, ``label``, ``mask``) -> file.
        read: The header reader; any exception means a corrupt or foreign file (the readers
            raise several types).
        shown: How a file is named in a problem.
    """
    facts: dict[str, Any] = {}
    problems: list[str] = []
    for kind, path in files.items():
        try:
            facts[kind] = read(path)
        except Exception as err:
            problems.append(
                f"case {cid}: {kind} {shown(path)} is unreadable or corrupt "
                f"({type(err).__name__}: {err}); re-export or remove the case"
            )
    return facts, problems
