"""A folder of DICOM series, one per case, as a segmentation dataset.

:func:`load_dicom_segmentation_folder` is reached through
:func:`~dpkfc_med.data.load_segmentation_folder`. Layouts: ``<case>/...*.dcm`` with the label
inside the case folder or at ``labelsTr/<case>.nii.gz``, and ``imagesTr/<case>/...*.dcm`` with
labels in ``labelsTr/`` (NIfTI or DICOM-SEG, matched by file name or referenced series). The
series are checked from their headers (missing slices, uneven positions, mixed spacing,
several series per case), every problem at once and naming the case, then read once with
SimpleITK's ``ImageSeriesReader`` and kept as NIfTI files in a cache outside the data folder.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dpkfc_med.data.cases import (
    SegmentationCase,
    SegmentationCases,
    case_id_from_path,
    header_facts,
    is_nifti_file,
)
from dpkfc_med.data.errors import DataValidationError

__all__ = ["DicomSegmentationCase", "is_dicom_series_folder", "load_dicom_segmentation_folder"]

_SEG_SOP_CLASS = "1.2.840.10008.5.1.4.1.1.66.4"  # Segmentation Storage
_CACHE_VERSION = "1"  # bump when the conversion changes: old cache entries are then ignored
_POSITION_TOL_MM = 0.01  # slice positions in DICOM are decimal strings of up to 16 characters
_temp_cache: Path | None = None


@dataclass(frozen=True)
class DicomSegmentationCase(SegmentationCase):
    """A case whose image is a DICOM series, read once into a cached NIfTI file.

    ``image_path`` (and ``label_path`` for a DICOM-SEG label) point at the cached NIfTI
    conversion, so every reader of :class:`SegmentationCase` (MONAI's ``LoadImaged``, the
    fingerprint, :meth:`SegmentationCases.validate_all`) works unchanged.

    Attributes:
        series_folder: The case's folder of DICOM files.
        series_uid: ``SeriesInstanceUID`` of the series read.
        series_description: Its ``SeriesDescription`` (``""`` if absent).
        label_source: The label as the user gave it (NIfTI file or DICOM-SEG file).
    """

    series_folder: Path = Path()
    series_uid: str = ""
    series_description: str = ""
    label_source: Path = Path()


@dataclass(frozen=True)
class _Slice:
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
class _CaseScan:
    """What one case folder holds: image series, DICOM-SEG files, NIfTI files, notes."""

    series: dict[str, list[_Slice]] = field(default_factory=dict)
    segs: list[Path] = field(default_factory=list)
    niftis: list[Path] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def _looks_dicom(path: Path) -> bool:
    if path.suffix.lower() in (".dcm", ".dicom", ".ima"):
        return True
    try:
        with path.open("rb") as f:
            return f.read(132)[128:132] == b"DICM"
    except OSError:
        return False


def _visible_dirs(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def _files_under(folder: Path) -> list[Path]:
    return sorted(
        p
        for p in folder.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    )


def _image_root(root: Path) -> Path:
    """``imagesTr/`` when it holds one folder per case, else the dataset folder itself."""
    images = root / "imagesTr"
    return images if images.is_dir() else root


def _case_folders(root: Path) -> list[Path]:
    folders = _visible_dirs(_image_root(root))
    return [p for p in folders if p.parent != root or p.name not in ("imagesTr", "labelsTr")]


def is_dicom_series_folder(root: str | Path) -> bool:
    """Whether ``root`` is a segmentation dataset of DICOM series (one sub-folder per case).

    Two layouts are recognised: ``<case>/*.dcm`` (one folder per case, the label inside it or in
    ``labelsTr/``) and ``imagesTr/<case>/*.dcm`` with labels in ``labelsTr/``. A ``dataset.json``
    with a ``training`` list, or NIfTI files directly in ``imagesTr/``, mean a NIfTI dataset.
    Only the first files of the first few folders are looked at.
    """
    root = Path(root)
    if (root / "dataset.json").is_file() or not root.is_dir():
        return False
    image_root = _image_root(root)
    if image_root != root and any(is_nifti_file(p) for p in image_root.iterdir()):
        return False
    for folder in _case_folders(root)[:3]:
        for i, path in enumerate(p for p in folder.rglob("*") if p.is_file()):
            if _looks_dicom(path):
                return True
            if i >= 20:
                break
    return False


def _floats(value: Any, n: int) -> tuple[float, ...] | None:
    try:
        out = tuple(float(v) for v in value)
    except (TypeError, ValueError):
        return None
    return out if len(out) == n else None


def _scan_case(folder: Path, cid: str) -> _CaseScan:
    """Read the headers of every file under ``folder`` and sort them into series and labels."""
    import pydicom
    from pydicom.errors import InvalidDicomError

    scan = _CaseScan()
    for path in _files_under(folder):
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
            _Slice(
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


def _describe(uid: str, slices: Sequence[_Slice]) -> str:
    return f"{uid} ({slices[0].description or 'no SeriesDescription'!r}, {len(slices)} slices)"


def _choose_series(
    cid: str, series: dict[str, list[_Slice]], pattern: str | None
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


def _series_problems(cid: str, uid: str, slices: list[_Slice]) -> tuple[list[_Slice], list[str]]:
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


def _grid_mismatch(cid: str, label: Path, ishape: Sequence[int], lshape: Sequence[int]) -> str:
    return (
        f"case {cid}: series shape {tuple(ishape)} != label {label.name} shape {tuple(lshape)} "
        "(X, Y, Z); image and label must be on the same voxel grid (resample the label onto "
        "the series)"
    )


def _header_grid_problem(cid: str, slices: Sequence[_Slice], label: Path) -> str | None:
    """Compare a NIfTI label's shape with the series' from the headers, before any conversion."""
    if not is_nifti_file(label):
        return None  # a DICOM-SEG is read on the series' slices
    rows, cols = slices[0].size
    ishape = (cols, rows, len(slices))  # NIfTI (X, Y, Z): columns, rows, slices
    try:
        lshape = header_facts(label)[0]
    except Exception as err:  # nibabel raises several types for corrupt / foreign files
        return (
            f"case {cid}: label {label.name} is unreadable or corrupt ({type(err).__name__}: "
            f"{err}); re-export or remove the case"
        )
    return None if tuple(lshape) == ishape else _grid_mismatch(cid, label, ishape, lshape)


def _cache_key(root: Path, uid: str, slices: Sequence[_Slice], label: Path) -> str:
    h = hashlib.sha256(f"{_CACHE_VERSION}\n{root.resolve()}\n{uid}\n".encode())
    for path in (*(s.path for s in slices), label):
        st = path.stat()
        h.update(f"{path.resolve()} {st.st_size} {st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def _default_cache() -> Path:
    """A private temporary folder, removed when the process exits."""
    global _temp_cache
    if _temp_cache is None:
        _temp_cache = Path(tempfile.mkdtemp(prefix="dpkfc-dicom-"))  # mode 0700
        atexit.register(shutil.rmtree, _temp_cache, ignore_errors=True)
    return _temp_cache


def _write_atomic(image: Any, path: Path) -> None:
    import SimpleITK as sitk

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    sitk.WriteImage(image, str(tmp), True)
    os.replace(tmp, path)


def _read_seg(seg_path: Path, slices: Sequence[_Slice]) -> np.ndarray:
    """A DICOM-SEG as label values ``[D, H, W]`` on the slices of the series (segment numbers)."""
    try:
        import highdicom as hd
    except ImportError as err:
        raise ImportError(
            f"{seg_path}: DICOM-SEG labels need highdicom; pip install 'dpkfc-med[dicom]' "
            "(or pip install highdicom)"
        ) from err
    seg = hd.seg.segread(str(seg_path))
    return np.asarray(
        seg.get_pixels_by_source_instance(
            source_sop_instance_uids=[s.sop_uid for s in slices],
            combine_segments=True,
            assert_missing_frames_are_empty=True,
        )
    )


def _seg_series_uids(path: Path) -> set[str]:
    import pydicom

    ds = pydicom.dcmread(str(path), stop_before_pixels=True)
    return {
        str(item.get("SeriesInstanceUID", ""))
        for item in ds.get("ReferencedSeriesSequence", [])
        if item.get("SeriesInstanceUID")
    }


def _convert_case(
    root: Path,
    cid: str,
    uid: str,
    slices: list[_Slice],
    label: Path,
    cache: Path,
) -> SegmentationCase | list[str]:
    """Read the series (and a DICOM-SEG label) into cached NIfTI files and check the label grid."""
    import nibabel as nib
    import SimpleITK as sitk

    key = _cache_key(root, uid, slices, label)
    folder = cache / cid / key
    image_path = folder / f"{cid}.nii.gz"
    label_is_seg = not is_nifti_file(label)
    label_path = folder / f"{cid}_seg.nii.gz" if label_is_seg else label
    if not (image_path.is_file() and label_path.is_file()):
        reader = sitk.ImageSeriesReader()
        reader.SetFileNames([str(s.path) for s in slices])  # sorted along the slice normal
        try:
            image = reader.Execute()
            seg = _read_seg(label, slices) if label_is_seg else None
        except ImportError:
            raise
        except Exception as err:
            kind = "DICOM-SEG label " + label.name if label_is_seg else f"series {uid}"
            return [
                f"case {cid}: {kind} unreadable ({type(err).__name__}: {str(err).strip()[:200]}); "
                "re-export or remove the case"
            ]
        for old in (cache / cid).glob("*"):  # stale conversions of this case
            if old.name != key:
                shutil.rmtree(old, ignore_errors=True)
        _write_atomic(image, image_path)
        if seg is not None:
            lab = sitk.GetImageFromArray(seg.astype(np.uint16 if seg.max() > 255 else np.uint8))
            lab.CopyInformation(image)
            _write_atomic(lab, label_path)
    ishape, izoom, idtype = header_facts(image_path)
    try:
        lshape, lzoom, ldtype = header_facts(label_path)
        laffine = np.asarray(nib.load(str(label_path)).affine)  # type: ignore[attr-defined]
    except Exception as err:
        return [
            f"case {cid}: label {label.name} is unreadable or corrupt ({type(err).__name__}: "
            f"{err}); re-export or remove the case"
        ]
    iaffine = np.asarray(nib.load(str(image_path)).affine)  # type: ignore[attr-defined]
    if tuple(lshape) != tuple(ishape):
        return [_grid_mismatch(cid, label, ishape, lshape)]
    if not np.allclose(izoom, lzoom, rtol=1e-3, atol=1e-4) or not np.allclose(
        iaffine, laffine, atol=1e-2
    ):
        lsp, isp = (tuple(round(float(z), 4) for z in zs) for zs in (lzoom, izoom))
        return [
            f"case {cid}: label {label.name} lies on another grid than the series (spacing "
            f"{lsp} vs {isp} "
            f"mm, origin {laffine[:3, 3].round(3).tolist()} vs {iaffine[:3, 3].round(3).tolist()} "
            "mm RAS, or direction); resample the label onto the series"
        ]
    return DicomSegmentationCase(
        case_id=cid,
        image_path=image_path,
        label_path=label_path,
        shape=(ishape[0], ishape[1], ishape[2]),
        spacing=(izoom[0], izoom[1], izoom[2]),
        image_dtype=idtype,
        label_dtype=ldtype,
        series_folder=slices[0].path.parent,
        series_uid=uid,
        series_description=slices[0].description,
        label_source=label,
    )


def load_dicom_segmentation_folder(
    path: str | Path,
    *,
    num_classes: int | None = None,
    on_unpaired: str = "error",
    case_ids: Sequence[str] | None = None,
    dicom_series: str | None = None,
    cache_dir: str | Path | None = None,
) -> SegmentationCases:
    """Index a segmentation dataset whose images are DICOM series, one series per case.

    Layouts (the case ID is the case folder's name):

    - ``<case>/...*.dcm``: one folder per case holding its series (sub-folders are searched);
      its label is a NIfTI file or a DICOM-SEG file inside it, or ``labelsTr/<case>.nii.gz``.
    - ``imagesTr/<case>/...*.dcm`` with labels in ``labelsTr/``: ``<case>.nii.gz``, or
      DICOM-SEG files named ``<case>.dcm`` or matched by the series they reference
      (``ReferencedSeriesSequence``).

    Slice order, spacing, origin and direction come from the DICOM headers: slices are sorted
    along the normal of ``ImageOrientationPatient`` and read by SimpleITK's
    ``ImageSeriesReader`` (rescale slope and intercept applied). Each series is converted once
    into a NIfTI file under ``cache_dir`` (never into the data folder), keyed by the files'
    paths, sizes and modification times, so the rest of the pipeline (MONAI ``LoadImaged``)
    reads it like any NIfTI case. A DICOM-SEG label (read with ``highdicom``; segment numbers
    become label values) is converted beside it; a NIfTI label is used in place and must lie on
    the series' voxel grid (shape, spacing, origin and direction).

    Every problem is collected and raised at once: a case folder with several series (unless
    ``dicom_series`` picks one), missing slices (gaps in ``InstanceNumber`` or uneven slice
    positions), inconsistent spacing, orientation or size within a series, a case without a
    label or a label without a case, a label off the series' grid. Files that are not DICOM
    images (reports, presentation states, ``DICOMDIR``, screenshots) are skipped with a warning.

    Args:
        path: The dataset folder.
        num_classes: Declared classes (background included); ``None``: undeclared.
        on_unpaired: ``"error"`` or ``"warn"`` (drop) for a case without a label or a label
            without a case.
        case_ids: Only index these cases.
        dicom_series: Regular expression searched in ``SeriesDescription`` that selects one
            series per case folder (``data.dicom_series``); ``None`` requires one series each.
        cache_dir: Where the NIfTI conversions are kept (a run uses its custodian folder
            ``private_not_for_release/dicom_cache``); ``None``: a private temporary folder
            removed when the process exits.

    Returns:
        :class:`SegmentationCases` of :class:`DicomSegmentationCase`, sorted by case ID.

    Raises:
        DataValidationError: Listing every problem, each naming its case and the fix.
    """
    root = Path(path).expanduser()
    if on_unpaired not in ("error", "warn"):
        raise ValueError(f"on_unpaired={on_unpaired!r} is not one of 'error', 'warn'")
    if dicom_series is not None:
        try:
            re.compile(dicom_series)
        except re.error as err:
            raise DataValidationError(
                root, [f"data.dicom_series={dicom_series!r} is not a regular expression ({err})"]
            ) from None
    layout = "imagesTr/<case>/ + labelsTr/" if _image_root(root) != root else "<case>/"
    folders = {p.name: p for p in _case_folders(root)}
    wanted = None if case_ids is None else set(case_ids)
    problems: list[str] = []
    unpaired: list[str] = []
    skipped: list[str] = []
    if wanted is not None:
        problems += [
            f"case {cid}: requested in case_ids but not found in {root}"
            for cid in sorted(wanted - set(folders))
        ]
        folders = {k: v for k, v in folders.items() if k in wanted}

    # Labels in labelsTr/: NIfTI by case ID, DICOM-SEG by file name or referenced series.
    nifti_labels: dict[str, Path] = {}
    seg_labels: dict[Path, set[str]] = {}  # SEG file -> referenced series UIDs
    label_dir = root / "labelsTr"
    if label_dir.is_dir():
        for p in _files_under(label_dir):
            if is_nifti_file(p):
                nifti_labels[case_id_from_path(p)] = p
            elif _looks_dicom(p):
                try:
                    seg_labels[p] = _seg_series_uids(p)
                except Exception:
                    skipped.append(f"labelsTr/{p.name}: not a readable DICOM file")
            else:
                skipped.append(f"labelsTr/{p.name}: neither NIfTI nor DICOM")
    used_labels: set[Path] = set()

    chosen: dict[str, tuple[str, list[_Slice], Path]] = {}
    for cid, folder in sorted(folders.items()):
        scan = _scan_case(folder, cid)
        problems += scan.problems
        skipped += scan.skipped
        uid, problem = _choose_series(cid, scan.series, dicom_series)
        if uid is None:
            problems.append(str(problem))
            continue
        slices, series_problems = _series_problems(cid, uid, scan.series[uid])
        problems += series_problems
        candidates = [*scan.niftis, *scan.segs]
        if cid in nifti_labels:
            candidates.append(nifti_labels[cid])
        candidates += [
            p for p, refs in seg_labels.items() if case_id_from_path(p) == cid or uid in refs
        ]
        candidates = sorted(set(candidates))
        used_labels.update(candidates)
        if not candidates:
            unpaired.append(
                f"case {cid}: series {uid} has no label (expected labelsTr/{cid}.nii.gz, a "
                f"DICOM-SEG referencing the series, or a label file in {folder.name}/)"
            )
            continue
        if len(candidates) > 1:
            names = [str(p.relative_to(root)) for p in candidates]
            problems.append(f"case {cid}: {len(candidates)} labels {names}; keep one per case")
            continue
        if series_problems:
            continue
        grid_problem = _header_grid_problem(cid, slices, candidates[0])
        if grid_problem:
            problems.append(grid_problem)
        else:
            chosen[cid] = (uid, slices, candidates[0])

    for cid, p in sorted(nifti_labels.items()):
        if p not in used_labels and (wanted is None or cid in wanted):
            unpaired.append(f"case {cid}: label labelsTr/{p.name} has no image series folder")
    for p in sorted(seg_labels):
        if p not in used_labels and wanted is None:
            refs = sorted(seg_labels[p]) or ["none"]
            unpaired.append(
                f"label labelsTr/{p.name} (DICOM-SEG of series {refs}) matches no case by name "
                "or referenced series"
            )
    if not folders and not problems:
        problems.append(f"no case folders with DICOM series found ({layout})")
    if unpaired and on_unpaired == "error":
        problems += [
            f"{m} (pair it, delete it, or pass on_unpaired='warn' to skip it)" for m in unpaired
        ]
    elif unpaired:
        warnings.warn(
            f"{root}: skipped {len(unpaired)} unpaired case(s)/label(s): " + "; ".join(unpaired),
            stacklevel=2,
        )
    if skipped:
        shown = "; ".join(skipped[:5]) + (
            f"; ... ({len(skipped)} in all)" if len(skipped) > 5 else ""
        )
        warnings.warn(f"{root}: skipped files that are not DICOM images: {shown}", stacklevel=2)
    if problems:
        raise DataValidationError(root, problems)

    cache = Path(cache_dir) if cache_dir is not None else _default_cache()
    cases: list[SegmentationCase] = []
    for cid, (uid, slices, label) in sorted(chosen.items()):
        try:
            checked = _convert_case(root, cid, uid, slices, label, cache)
        except OSError as err:
            raise DataValidationError(
                cache,
                [
                    f"cannot write the NIfTI conversion of the DICOM series ({err.strerror or err}"
                    "); make the run's output folder writable or choose another --out"
                ],
            ) from err
        if isinstance(checked, list):
            problems += checked
        else:
            cases.append(checked)
    if problems:
        raise DataValidationError(root, problems)
    if not cases:
        raise DataValidationError(root, ["no DICOM series with a label found; check the layout"])
    return SegmentationCases(
        root=root.resolve(),
        cases=cases,
        num_classes=num_classes,
        source=f"DICOM series ({layout})",
        dropped=list(unpaired) if on_unpaired == "warn" else [],
    )
