"""Segmentation data as one folder per case, one NIfTI file per modality (the BraTS layout).

The BraTS challenges ship ``<root>/<case>/<case>_<modality>.nii.gz`` with the label as
``<case>_seg.nii.gz`` (2021: ``BraTS2021_00000_flair.nii.gz``; 2023 joins with ``-``:
``BraTS-GLI-00000-000-t2f.nii.gz``). Which files are the channels, and in which order, comes from
the config (``data.channels``, e.g. ``[t1n, t1c, t2w, t2f]``), never from the files found, so
that the network's input does not depend on what one case happens to hold.

This module is the worked example of a data format: one reader registered with
:func:`~dpkfc_med.data.formats.registry.register_format` (its name, how to recognise the
layout from file names, how to read it), and one import line in
:mod:`dpkfc_med.data.formats`.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from pathlib import Path

from dpkfc_med.data.cases import (
    SegmentationCase,
    SegmentationCases,
    check_nifti_case,
    collect_cases,
    is_nifti_file,
)
from dpkfc_med.data.errors import DataValidationError
from dpkfc_med.data.formats.registry import ReadOptions, register_format

__all__ = ["is_case_folder_layout", "load_case_folders", "read_case_folders"]

LABEL_SUFFIX = "seg"
_SUFFIXES = (".nii.gz", ".nii")


def _suffix(case: str, path: Path) -> str | None:
    """``flair`` of ``<case>_flair.nii.gz`` (or ``<case>-flair.nii``); ``None`` if not so named."""
    name = path.name
    for ending in _SUFFIXES:
        if name.endswith(ending):
            match = re.fullmatch(re.escape(case) + r"[_-](.+)", name[: -len(ending)])
            return match.group(1) if match else None
    return None


def _case_dirs(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def is_case_folder_layout(root: Path) -> bool:
    """Whether ``root`` holds one folder per case with NIfTI files named after the case.

    A case folder of this layout holds its label ``<case>_seg.nii(.gz)`` and at least one
    channel ``<case>_<modality>.nii(.gz)``; a folder of DICOM series with its label as
    ``<case>_seg.nii.gz`` has no such channel file. Only the names in the first few case
    folders are looked at; ``imagesTr/`` or a ``dataset.json`` mean another layout.
    """
    if (root / "imagesTr").is_dir() or (root / "dataset.json").is_file():
        return False
    for folder in _case_dirs(root)[:3]:
        suffixes = {_suffix(folder.name, p) for p in folder.iterdir()} - {None}
        if LABEL_SUFFIX in suffixes and len(suffixes) > 1:
            return True
    return False


def _files(folder: Path) -> dict[str, Path]:
    """Suffix -> file of a case folder's NIfTI files named after the case."""
    out: dict[str, Path] = {}
    for path in sorted(folder.iterdir()):
        suffix = _suffix(folder.name, path) if is_nifti_file(path) else None
        if suffix is not None:
            out[suffix] = path
    return out


def load_case_folders(
    root: Path,
    *,
    channels: Sequence[str] | None,
    num_classes: int | None = None,
    on_unpaired: str = "error",
    case_ids: Sequence[str] | None = None,
) -> SegmentationCases:
    """Index ``<root>/<case>/<case>_<channel>.nii.gz`` + ``<case>_seg.nii.gz`` from headers.

    Args:
        root: The dataset folder (one sub-folder per case).
        channels: The modality suffixes, in channel order (``data.channels``); required.
        num_classes: Declared classes (background included).
        on_unpaired: ``"error"`` or ``"warn"`` (skip) for a case folder without a label.
        case_ids: Only index these cases.

    Raises:
        DataValidationError: ``channels`` unset (listing the suffixes of the first case), a
            case missing a channel or its label (each named), or header mismatches.
    """
    folders = {f.name: f for f in _case_dirs(root)}
    if case_ids is not None:
        wanted = set(case_ids)
        folders = {c: f for c, f in folders.items() if c in wanted}
    if not channels:
        first = next(iter(folders.values()), None)
        found = sorted(s for s in (_files(first) if first else {}) if s != LABEL_SUFFIX)
        raise DataValidationError(
            root,
            [
                "one folder per case with one file per modality (BraTS layout): set "
                f"data.channels to the modality suffixes in channel order, e.g. {found} "
                f"(the files of case {first.name if first else '?'})"
            ],
        )
    problems = [
        f"case {c}: requested in case_ids but not found in {root}"
        for c in sorted(set(case_ids or ()) - set(folders))
    ]
    dropped: list[str] = []
    checked: list[SegmentationCase | list[str]] = []
    for cid, folder in folders.items():
        files = _files(folder)
        if LABEL_SUFFIX not in files:
            msg = f"case {cid}: no label {cid}_{LABEL_SUFFIX}.nii.gz in {folder.name}/"
            if on_unpaired == "warn":
                dropped.append(msg)
            else:
                problems.append(f"{msg} (add it, or remove the folder)")
            continue
        missing = [c for c in channels if c not in files]
        if missing:
            have = sorted(s for s in files if s != LABEL_SUFFIX)
            problems.append(
                f"case {cid}: no file for channel(s) {missing} in {folder.name}/ (it has "
                f"{have}); data.channels lists every case's modality suffixes in order"
            )
            continue
        images = tuple(files[c] for c in channels)
        label = files[LABEL_SUFFIX]
        checked.append(check_nifti_case(cid, images, label, len(channels), "data.channels"))
    if dropped:
        warnings.warn(
            f"{root}: skipped {len(dropped)} case(s): " + "; ".join(dropped), stacklevel=4
        )
    return collect_cases(
        root,
        checked,
        problems,
        empty=f"no case folder with a <case>_{LABEL_SUFFIX} label; check the folder layout",
        num_classes=num_classes,
        source="case folders",
        dropped=dropped,
    )


@register_format(
    "case-folders",
    recognise=is_case_folder_layout,
    layout="<case>/<case>_<modality>.nii.gz + <case>_seg.nii.gz, the BraTS layout",
)
def read_case_folders(root: Path, options: ReadOptions) -> SegmentationCases:
    """Read a BraTS-style folder: :func:`load_case_folders` with ``options``."""
    return load_case_folders(
        root,
        channels=options.channels,
        num_classes=options.num_classes,
        on_unpaired=options.on_unpaired,
        case_ids=options.case_ids,
    )
