"""Segmentation data from NIfTI folders and MSD ``dataset.json`` indexes.

:func:`load_segmentation_folder` indexes a dataset folder into
:class:`~dpkfc_med.data.cases.SegmentationCases`, pairing images with labels and checking their
headers. Volumes are 3-D; 2-D images come as 2-D NIfTI (``(X, Y)`` or ``(X, Y, 1)``) or as PNG /
JPEG ``images/`` + ``masks/`` folders (:mod:`.images2d`), and slices of volumes as 2-D samples
of their volume (:mod:`.slices`); folders of DICOM series go to :mod:`.dicom_folders`.

The rest of the segmentation data lives beside this module and is re-exported here: the case
index (:mod:`.cases`), the train/val/test split (:mod:`.splits`), the transform presets with
per-volume normalisation and patch sampling (:mod:`.transforms`) and the dataset whose item,
and privacy unit, is one volume (:mod:`.volumes`).
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from dpkfc_med.data.cases import (
    SegmentationCase,
    SegmentationCases,
    case_id_from_path,
    check_nifti_case,
    collect_cases,
    is_nifti_file,
)
from dpkfc_med.data.dicom_folders import is_dicom_series_folder, load_dicom_segmentation_folder
from dpkfc_med.data.errors import DataValidationError
from dpkfc_med.data.formats import ReadOptions, data_format, detect_format
from dpkfc_med.data.images2d import is_image_mask_folder, load_image_mask_folder
from dpkfc_med.data.splits import deterministic_split, load_split, save_split
from dpkfc_med.data.transforms import CropMode, IntensityNorm, segmentation_transforms
from dpkfc_med.data.volumes import VolumeDataset

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

# nnU-Net names image files "<case>_0000.nii.gz", "<case>_0001.nii.gz", ... (one per modality,
# in channel order) while the label is "<case>.nii.gz".
_MODALITY_SUFFIX = re.compile(r"_(\d{4})$")


def _parse_label_names(raw: Any) -> dict[int, str] | None:
    """MSD ``{"0": "background"}`` or nnU-Net v2 ``{"background": 0}`` -> ``{0: "background"}``."""
    if not isinstance(raw, Mapping) or not raw:
        return None
    if all(str(k).lstrip("-").isdigit() for k in raw):
        return {int(k): str(v) for k, v in raw.items()}
    if all(isinstance(v, int) for v in raw.values()):
        return {int(v): str(k) for k, v in raw.items()}
    return None


# Pairing results: case ID -> (image, label); (case ID, message) for unpaired files and for
# other problems (case ID None when the problem belongs to no case), so that a case_ids filter
# can drop the problems of cases the caller did not ask for.
_Pairs = dict[str, tuple[tuple[Path, ...], Path]]
_Notes = list[tuple[str | None, str]]


def _modality_files(listed: Path, count: int | None) -> tuple[Path, ...]:
    """nnU-Net's per-modality files of a listed image that does not exist itself.

    nnU-Net's ``dataset.json`` lists ``imagesTr/<case>.nii.gz`` while the folder holds
    ``<case>_0000.nii.gz``, ``<case>_0001.nii.gz``, ...: the ``count`` declared modalities,
    else every consecutive one found. Empty when there is none.
    """
    name = listed.name
    suffix = next((x for x in (".nii.gz", ".nii") if name.endswith(x)), listed.suffix)
    stem = name[: len(name) - len(suffix)]
    found: list[Path] = []
    while count is None or len(found) < count:
        candidate = listed.with_name(f"{stem}_{len(found):04d}{suffix}")
        if not candidate.is_file():
            break
        found.append(candidate)
    return tuple(found)


def _pairs_from_index(
    root: Path, training: list[Any], modalities: int | None
) -> tuple[_Pairs, _Notes, _Notes]:
    """Pair images and labels from the ``training`` list of an MSD / nnU-Net ``dataset.json``."""
    pairs: _Pairs = {}
    unpaired: _Notes = []
    problems: _Notes = []
    for i, entry in enumerate(training):
        image_rel = entry.get("image") if isinstance(entry, Mapping) else None
        if not isinstance(image_rel, str):
            problems.append((None, f"dataset.json training[{i}]: no 'image' path; add one"))
            continue
        image_path = (root / image_rel).resolve()
        cid = case_id_from_path(image_path)
        images = _modality_files(image_path, modalities) if not image_path.is_file() else ()
        images = images or (image_path,)
        label_rel = entry.get("label")
        if not isinstance(label_rel, str):
            msg = f"case {cid}: image {image_rel} has no 'label' in dataset.json training[{i}]"
            unpaired.append((cid, msg))
            continue
        label_path = (root / label_rel).resolve()
        for kind, p in (("image", images[0]), ("label", label_path)):
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
        pairs[cid] = (images, label_path)
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
        if is_nifti_file(p):
            cid = case_id_from_path(p)
            if cid in labels:
                problems.append(
                    (cid, f"case {cid}: two label files ({labels[cid].name}, {p.name})")
                )
            labels[cid] = p
    files: dict[str, dict[int, Path]] = {}  # case -> modality index (-1: no suffix) -> file
    for p in sorted(image_dir.iterdir()):
        if not is_nifti_file(p):
            continue
        cid, index = case_id_from_path(p), -1
        suffix = _MODALITY_SUFFIX.search(cid)
        if cid not in labels and suffix is not None and cid[: suffix.start()] in labels:
            cid, index = cid[: suffix.start()], int(suffix.group(1))
        own = files.setdefault(cid, {})
        if index in own or (own and (index == -1 or -1 in own)):
            other = own.get(index) or next(iter(own.values()))
            problems.append((cid, f"case {cid}: two image files ({other.name}, {p.name})"))
            continue
        own[index] = p
    images: dict[str, tuple[Path, ...]] = {}
    for cid, own in files.items():
        order = sorted(own)
        if order != [-1] and order != list(range(len(order))):
            have = ", ".join(own[i].name for i in order)
            gap = f"case {cid}: modality files {have} skip a number; nnU-Net numbers one file "
            problems.append((cid, gap + "per modality _0000, _0001, ... without gaps"))
        images[cid] = tuple(own[i] for i in order)
    if not images and not labels:
        problems.append((None, "imagesTr/ and labelsTr/ hold no .nii / .nii.gz files"))

    pairs: _Pairs = {}
    unpaired: _Notes = []
    for cid in sorted(set(images) | set(labels)):
        if cid in images and cid in labels:
            pairs[cid] = (images[cid], labels[cid])
        elif cid in images:
            msg = f"case {cid}: image imagesTr/{images[cid][0].name} has no label in labelsTr/"
            unpaired.append((cid, msg))
        else:
            msg = f"case {cid}: label labelsTr/{labels[cid].name} has no image in imagesTr/"
            unpaired.append((cid, msg))
    return pairs, unpaired, problems


def load_segmentation_folder(
    path: str | Path,
    *,
    num_classes: int | None = None,
    on_unpaired: str = "error",
    case_ids: Sequence[str] | None = None,
    dicom_series: str | None = None,
    cache_dir: str | Path | None = None,
    channels: Sequence[str] | None = None,
    format: str | None = None,
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
        channels: The input channels' names in order (``data.channels``): for one folder per
            case (BraTS, :mod:`.formats.case_folders`) the modality file suffixes, required;
            for other NIfTI folders the channel count every case must have.
        format: The name of a registered format (:mod:`.formats`) to read the folder as,
            for a folder that several formats recognise; ``None``: the one that recognises it.

    Returns:
        :class:`SegmentationCases`, sorted by case ID.

    Raises:
        DataValidationError: Listing every problem: missing folder or files, unpaired
            files, unreadable headers, image/label shape or spacing mismatch.
        AmbiguousFormatError: Two registered formats recognise the folder (naming both).
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
    options = ReadOptions(num_classes, on_unpaired, case_ids, dicom_series, cache_dir, channels)
    if format is not None:
        return data_format(format).read(root, options)
    if is_image_mask_folder(root) and not (root / "imagesTr").is_dir():
        return load_image_mask_folder(
            root, num_classes=num_classes, on_unpaired=on_unpaired, case_ids=case_ids
        )

    if is_dicom_series_folder(root):
        return load_dicom_segmentation_folder(
            root,
            num_classes=num_classes,
            on_unpaired=on_unpaired,
            case_ids=case_ids,
            dicom_series=dicom_series,
            cache_dir=cache_dir,
        )

    chosen = detect_format(root)
    if chosen is not None:
        return chosen.read(root, options)

    meta: dict[str, Any] = {}
    index = root / "dataset.json"
    if index.is_file():
        try:
            meta = json.loads(index.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise DataValidationError(
                index, [f"not valid JSON ({err}); fix or remove dataset.json"]
            ) from err
    label_names = _parse_label_names(meta.get("labels"))
    # MSD declares {"0": "FLAIR", ...} as "modality", nnU-Net v2 as "channel_names"
    declared_modalities = meta.get("modality", meta.get("channel_names"))
    modalities = len(declared_modalities) if isinstance(declared_modalities, Mapping) else None
    declared_by = "dataset.json"
    conflict: _Notes = []
    if channels:
        if modalities is not None and modalities != len(channels):
            conflict.append((None, f"data.channels lists {len(channels)} channel(s) "
                             f"{list(channels)} but dataset.json declares {modalities} "
                             "modalities; make them agree"))  # fmt: skip
        modalities, declared_by = len(channels), "data.channels"
    if isinstance(meta.get("training"), list):
        source = "dataset.json"
        pairs, unpaired, notes = _pairs_from_index(root, meta["training"], modalities)
    else:
        source = "imagesTr/labelsTr"
        pairs, unpaired, notes = _pairs_from_folders(root)

    notes = conflict + notes
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
        problems += [f"{msg} (pair it, or move it out of the data folder)" for _, msg in unpaired]
    elif unpaired:
        dropped = [msg for _, msg in unpaired]
        warnings.warn(
            f"{root}: skipped {len(dropped)} unpaired file(s): " + "; ".join(dropped),
            stacklevel=2,
        )

    def checked() -> Iterator[SegmentationCase | list[str]]:
        for cid in sorted(pairs):
            images, label_path = pairs[cid]
            if all(p.is_file() for p in (*images, label_path)):  # else reported by the pairing
                yield check_nifti_case(cid, images, label_path, modalities, declared_by)

    if num_classes is not None:
        declared: int | None = num_classes
    else:
        declared = max(label_names) + 1 if label_names else None
    return collect_cases(
        root,
        checked(),
        problems,
        empty="no image/label pairs found; check the folder layout",
        label_names=label_names,
        num_classes=declared,
        source=source,
        dropped=dropped,
    )
