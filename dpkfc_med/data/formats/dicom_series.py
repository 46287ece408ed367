"""A folder of DICOM series, one per case, as a segmentation dataset.

:func:`load_dicom_segmentation_folder` is reached through
:func:`~dpkfc_med.data.load_segmentation_folder`. Layouts: ``<case>/...*.dcm`` with the label
inside the case folder or at ``labelsTr/<case>.nii.gz``, and ``imagesTr/<case>/...*.dcm`` with
labels in ``labelsTr/`` (NIfTI or DICOM-SEG, matched by file name or referenced series). The
series are checked from their headers (missing slices, uneven positions, mixed spacing,
several series per case), every problem at once and naming the case, then read once with
SimpleITK's ``ImageSeriesReader`` and kept as NIfTI files in a cache outside the data folder.
The header scan and the series checks live in :mod:`dpkfc_med.data.dicom.scan`, the conversion
and its cache in :mod:`dpkfc_med.data.dicom.convert`. Registered as the ``dicom-series`` format.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

from dpkfc_med.data.cases import (
    SegmentationCase,
    SegmentationCases,
    case_id_from_path,
    collect_cases,
    is_nifti_file,
)
from dpkfc_med.data.dicom.convert import (
    DicomSegmentationCase,
    convert_case,
    default_cache,
    header_grid_problem,
)
from dpkfc_med.data.dicom.scan import (
    DicomSlice,
    check_series,
    choose_series,
    files_under,
    looks_dicom,
    scan_case,
    seg_series_uids,
)
from dpkfc_med.data.errors import DataValidationError
from dpkfc_med.data.formats.registry import ReadOptions, register_format

__all__ = [
    "DicomSegmentationCase",
    "is_dicom_series_folder",
    "load_dicom_segmentation_folder",
    "read_dicom_series_folder",
]


def _visible_dirs(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


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
    Only the first files of the first few folders are looked at: by name (``.dcm``, ``.dicom``,
    ``.ima``), else by the 4-byte ``DICM`` marker of the file header (never pixel data).
    """
    root = Path(root)
    if (root / "dataset.json").is_file() or not root.is_dir():
        return False
    image_root = _image_root(root)
    if image_root != root and any(is_nifti_file(p) for p in image_root.iterdir()):
        return False
    for folder in _case_folders(root)[:3]:
        for i, path in enumerate(p for p in folder.rglob("*") if p.is_file()):
            if looks_dicom(path):
                return True
            if i >= 20:
                break
    return False


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
        for p in files_under(label_dir):
            if is_nifti_file(p):
                nifti_labels[case_id_from_path(p)] = p
            elif looks_dicom(p):
                try:
                    seg_labels[p] = seg_series_uids(p)
                except Exception:
                    skipped.append(f"labelsTr/{p.name}: not a readable DICOM file")
            else:
                skipped.append(f"labelsTr/{p.name}: neither NIfTI nor DICOM")
    used_labels: set[Path] = set()

    chosen: dict[str, tuple[str, list[DicomSlice], Path]] = {}
    for cid, folder in sorted(folders.items()):
        scan = scan_case(folder, cid)
        problems += scan.problems
        skipped += scan.skipped
        uid, problem = choose_series(cid, scan.series, dicom_series)
        if uid is None:
            problems.append(str(problem))
            continue
        slices, series_problems = check_series(cid, uid, scan.series[uid])
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
        grid_problem = header_grid_problem(cid, slices, candidates[0])
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
        problems += [f"{m} (pair it, or move it out of the data folder)" for m in unpaired]
    elif unpaired:
        warnings.warn(
            f"{root}: skipped {len(unpaired)} unpaired case(s)/label(s): " + "; ".join(unpaired),
            stacklevel=4,
        )
    if skipped:
        shown = "; ".join(skipped[:5]) + (
            f"; ... ({len(skipped)} in all)" if len(skipped) > 5 else ""
        )
        warnings.warn(f"{root}: skipped files that are not DICOM images: {shown}", stacklevel=4)
    if problems:
        raise DataValidationError(root, problems)

    cache = Path(cache_dir) if cache_dir is not None else default_cache()

    def converted() -> Iterator[SegmentationCase | list[str]]:
        for cid, (uid, slices, label) in sorted(chosen.items()):
            try:
                yield convert_case(root, cid, uid, slices, label, cache)
            except OSError as err:
                raise DataValidationError(
                    cache,
                    [
                        "cannot write the NIfTI conversion of the DICOM series "
                        f"({err.strerror or err}); make the run's output folder writable or "
                        "choose another --out"
                    ],
                ) from err

    return collect_cases(
        root,
        converted(),
        problems,
        empty="no DICOM series with a label found; check the layout",
        num_classes=num_classes,
        source=f"DICOM series ({layout})",
        dropped=list(unpaired) if on_unpaired == "warn" else [],
    )


@register_format(
    "dicom-series",
    recognise=is_dicom_series_folder,
    layout="<case>/...*.dcm or imagesTr/<case>/...*.dcm, one DICOM series per case",
)
def read_dicom_series_folder(root: Path, options: ReadOptions) -> SegmentationCases:
    """Read a folder of DICOM series: :func:`load_dicom_segmentation_folder` with ``options``."""
    return load_dicom_segmentation_folder(
        root,
        num_classes=options.num_classes,
        on_unpaired=options.on_unpaired,
        case_ids=options.case_ids,
        dicom_series=options.dicom_series,
        cache_dir=options.cache_dir,
    )
