"""What a case folder of DICOM files holds, read from headers only, and its series' checks.

:func:`scan_case` sorts the files of one case folder into image series (one
:class:`DicomSlice` per single-frame image), DICOM-SEG files and NIfTI files, and notes what it
skips; :func:`choose_series` picks the case's series and :func:`check_series` sorts its
slices along the slice normal and describes missing slices, uneven positions and mixed spacing,
orientation or size. No pixels are read here (:mod:`.convert` reads them).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dpkfc_med.data.cases import is_nifti_file

__all__ = [
    "CaseScan",
    "DicomSlice",
    "check_series",
    "choose_series",
    "files_under",
    "looks_dicom",
    "scan_case",
    "seg_series_uids",
]

_SEG_SOP_CLASS = "1.2.840.10008.5.1.4.1.1.66.4"  # Segmentation Storage
_POSITION_TOL_MM = 0.01  # slice positions in DICOM are decimal strings of up to 16 characters


@dataclass(frozen=True)
class DicomSlice:
    """Header facts of one single-frame DICOM image (no pixels are read)."""

    path: Path
    sop_uid: str
    series_uid: str
    description: str
    instance: int | None
    position: tuple[float, float, float]
    orientation: tuple[float, ...]
    pixel_spacing: tuple[float, float]
    thickness: float | None
    size: tuple[int, int]


@dataclass
class CaseScan:
    """What one case folder holds: image series, DICOM-SEG files, NIfTI files, notes."""

    series: dict[str, list[DicomSlice]] = field(default_factory=dict)
    segs: list[Path] = field(default_factory=list)
    niftis: list[Path] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def looks_dicom(path: Path) -> bool:
    """Whether ``path`` is a DICOM file: by its suffix or the ``DICM`` marker at byte 128."""
    if path.suffix.lower() in (".dcm", ".dicom", ".ima"):
        return True
    try:
        with path.open("rb") as f:
            return f.read(132)[128:132] == b"DICM"
    except OSError:
        return False


def files_under(folder: Path) -> list[Path]:
    """The files below ``folder``, sorted, skipping hidden files and folders."""
    return sorted(
        p
        for p in folder.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    )


def _floats(value: Any, n: int) -> tuple[float, ...] | None:
    try:
        out = tuple(float(v) for v in value)
    except (TypeError, ValueError):
        return None
    return out if len(out) == n else None


def scan_case(folder: Path, cid: str) -> CaseScan:
    """Read the headers of every file under ``folder`` and sort them into series and labels."""
    import pydicom
    from pydicom.errors import InvalidDicomError

    scan = CaseScan()
    for path in files_under(folder):
        rel = f"{cid}/{path.relative_to(folder)}"
        if is_nifti_file(path):
            scan.niftis.append(path)
            continue
        try:
            ds = pydicom.dcmread(str(path), stop_before_pixels=True)
        except (InvalidDicomError, OSError, ValueError, EOFError, AttributeError):
            scan.skipped.append(f"{rel}: not a DICOM file")
            continue
        sop_class = str(ds.get("SOPClassUID", ""))
        modality = str(ds.get("Modality", ""))
        if sop_class == _SEG_SOP_CLASS or modality == "SEG":
            scan.segs.append(path)
            continue
        if "Rows" not in ds or "Columns" not in ds:
            what = modality or sop_class or "unknown"
            scan.skipped.append(f"{rel}: DICOM without an image (modality {what})")
            continue
        position = _floats(ds.get("ImagePositionPatient"), 3)
        orientation = _floats(ds.get("ImageOrientationPatient"), 6)
        if position is None or orientation is None:
            scan.skipped.append(
                f"{rel}: image without ImagePositionPatient/ImageOrientationPatient (e.g. a "
                "screenshot or secondary capture), not part of a volume"
            )
            continue
        frames = int(ds.get("NumberOfFrames", 1) or 1)
        if frames > 1:
            scan.problems.append(
                f"case {cid}: {rel} is a multi-frame (enhanced) DICOM image with {frames} frames; "
                "only single-frame series are read: export the series as one file per slice"
            )
            continue
        spacing = _floats(ds.get("PixelSpacing"), 2) or (1.0, 1.0)
        thickness = ds.get("SliceThickness")
        instance = ds.get("InstanceNumber")
        uid = str(ds.get("SeriesInstanceUID", "")) or "(no SeriesInstanceUID)"
        scan.series.setdefault(uid, []).append(
            DicomSlice(
                path=path,
                sop_uid=str(ds.get("SOPInstanceUID", "")),
                series_uid=uid,
                description=str(ds.get("SeriesDescription", "")).strip(),
                instance=None if instance in (None, "") else int(instance),
                position=(position[0], position[1], position[2]),
                orientation=orientation,
                pixel_spacing=(spacing[0], spacing[1]),
                thickness=None if thickness in (None, "") else float(thickness),
                size=(int(ds.Rows), int(ds.Columns)),
            )
        )
    return scan


def _describe(uid: str, slices: Sequence[DicomSlice]) -> str:
    return f"{uid} ({slices[0].description or 'no SeriesDescription'!r}, {len(slices)} slices)"


def choose_series(
    cid: str, series: dict[str, list[DicomSlice]], pattern: str | None
) -> tuple[str | None, str | None]:
    """``(series UID, None)`` or ``(None, problem)`` for the series of one case."""
    if not series:
        return None, f"case {cid}: no DICOM image series in the folder; put the case's .dcm in it"
    listing = "; ".join(_describe(uid, s) for uid, s in sorted(series.items()))
    if pattern is None:
        if len(series) == 1:
            return next(iter(series)), None
        return None, (
            f"case {cid}: {len(series)} DICOM series in one case folder: {listing}; keep one "
            "series per case or choose one with data.dicom_series: <regex of SeriesDescription>"
        )
    chosen = [uid for uid, s in series.items() if re.search(pattern, s[0].description)]
    if len(chosen) == 1:
        return chosen[0], None
    return None, (
        f"case {cid}: data.dicom_series={pattern!r} matches {len(chosen)} of its series "
        f"({listing}); it must match exactly one SeriesDescription per case"
    )


def check_series(
    cid: str, uid: str, slices: list[DicomSlice]
) -> tuple[list[DicomSlice], list[str]]:
    """Sort the slices along the slice normal and describe gaps and inconsistencies."""
    where = f"case {cid}: series {uid}"
    problems: list[str] = []
    for name, values in (
        ("ImageOrientationPatient", {tuple(round(v, 4) for v in s.orientation) for s in slices}),
        ("PixelSpacing", {tuple(round(v, 4) for v in s.pixel_spacing) for s in slices}),
        (
            "SliceThickness",
            {None if s.thickness is None else round(s.thickness, 4) for s in slices},
        ),
        ("Rows x Columns", {s.size for s in slices}),
    ):
        if len(values) > 1:
            shown = sorted(values, key=str)[:4]
            problems.append(
                f"{where}: inconsistent {name} within the series ({len(values)} values, e.g. "
                f"{shown}); a volume needs one voxel grid: re-export the series or remove the odd "
                "slices"
            )
    if problems:
        return slices, problems
    if len(slices) < 2:
        return slices, [f"{where}: only one slice; a 3-D segmentation case needs a volume"]
    row, col = np.asarray(slices[0].orientation[:3]), np.asarray(slices[0].orientation[3:])
    normal = np.cross(row, col)
    depth = np.asarray([np.dot(s.position, normal) for s in slices])
    order = np.argsort(depth, kind="stable")
    slices = [slices[i] for i in order]
    depth = depth[order]
    gaps = np.diff(depth)
    if (gaps < _POSITION_TOL_MM).any():
        i = int(np.argmax(gaps < _POSITION_TOL_MM))
        problems.append(
            f"{where}: two slices at the same position ({slices[i].path.name}, "
            f"{slices[i + 1].path.name}); remove the duplicate"
        )
        return slices, problems
    step = float(np.min(gaps))
    uneven = np.flatnonzero(np.abs(gaps - step) > max(_POSITION_TOL_MM, 1e-3 * step))
    numbers = [s.instance for s in slices]
    missing: list[int] = []
    if all(n is not None for n in numbers):
        present = sorted({int(n) for n in numbers if n is not None})
        missing = sorted(set(range(present[0], present[-1] + 1)) - set(present))
    if uneven.size or missing:
        facts = []
        if missing:
            facts.append(f"InstanceNumber(s) {missing[:10]} absent")
        if uneven.size:
            i = int(uneven[0])
            facts.append(
                f"uneven slice positions: {gaps[i]:.4g} mm between {slices[i].path.name} and "
                f"{slices[i + 1].path.name} where the series steps {step:.4g} mm "
                f"({uneven.size} uneven gap(s))"
            )
        problems.append(
            f"{where}: missing slice(s): {'; '.join(facts)}; re-export the complete series"
        )
    return slices, problems


def seg_series_uids(path: Path) -> set[str]:
    """The ``SeriesInstanceUID`` s a DICOM-SEG file references (``ReferencedSeriesSequence``)."""
    import pydicom

    ds = pydicom.dcmread(str(path), stop_before_pixels=True)
    return {
        str(item.get("SeriesInstanceUID", ""))
        for item in ds.get("ReferencedSeriesSequence", [])
        if item.get("SeriesInstanceUID")
    }
