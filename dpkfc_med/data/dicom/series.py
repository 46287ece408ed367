"""Read DICOM files and series into float32 volumes in physical units (e.g. CT Hounsfield units).

SimpleITK (GDCM) reads the pixels and applies ``RescaleSlope`` / ``RescaleIntercept``; pydicom
is the fallback for files GDCM cannot open. Arrays are ``[D, H, W]`` (slice, row, column) and
spacing is ``(z, y, x)`` in mm, matching the array axes.

A folder of DICOM series, one per case, is a segmentation dataset too
(:mod:`dpkfc_med.data.formats.dicom_series`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from dpkfc_med.data.errors import DataValidationError

__all__ = ["list_dicom_series", "read_dicom_series"]

# DICOM tags as SimpleITK metadata keys.
_SPACING_BETWEEN_SLICES = "0018|0088"
_SLICE_THICKNESS = "0018|0050"


def list_dicom_series(folder: str | Path) -> list[str]:
    """Series instance UIDs of the DICOM series found directly in ``folder`` (GDCM's view)."""
    import SimpleITK as sitk  # lazy: optional at import time of the package

    return list(sitk.ImageSeriesReader.GetGDCMSeriesIDs(str(folder)))


def _single_slice_z(image: Any) -> float | None:
    """Slice spacing for a one-slice image, which GDCM cannot derive from slice positions.

    GDCM then reports 1 mm unless ``SpacingBetweenSlices`` is set; ``SliceThickness`` is the
    better physical answer for one slice.
    """
    for key in (_SPACING_BETWEEN_SLICES, _SLICE_THICKNESS):
        if image.HasMetaDataKey(key):
            try:
                value = float(image.GetMetaData(key).strip())
            except ValueError:
                continue
            if value > 0:
                return value
    return None


def _read_with_pydicom(path: Path) -> tuple[np.ndarray, tuple[float, float, float]]:
    import pydicom

    ds = pydicom.dcmread(str(path))
    pixels = ds.pixel_array.astype(np.float32)
    slope = float(getattr(ds, "RescaleSlope", 1.0) or 1.0)
    intercept = float(getattr(ds, "RescaleIntercept", 0.0) or 0.0)
    volume = pixels * np.float32(slope) + np.float32(intercept)
    if volume.ndim == 2:
        volume = volume[None]
    row, col = (float(v) for v in getattr(ds, "PixelSpacing", (1.0, 1.0)))
    z = float(getattr(ds, "SpacingBetweenSlices", 0) or getattr(ds, "SliceThickness", 0) or 1.0)
    return volume, (z, row, col)


def _read_file(path: Path) -> tuple[np.ndarray, list[float]]:
    """One DICOM file -> ``([D, H, W] float32, spacing (x, y, z))``."""
    import SimpleITK as sitk

    try:
        image = sitk.ReadImage(str(path))
    except RuntimeError as sitk_err:
        # GDCM lacks some transfer syntaxes and tolerates fewer malformed files.
        try:
            volume, (z, y, x) = _read_with_pydicom(path)
        except Exception as err:
            raise DataValidationError(
                path,
                [
                    f"not a readable DICOM file (SimpleITK: {str(sitk_err).strip()[:200]}; "
                    f"pydicom: {type(err).__name__}: {err}); check the file is DICOM"
                ],
            ) from err
        return volume, [x, y, z]
    spacing_xyz = [float(v) for v in image.GetSpacing()]
    if image.GetDimension() == 3 and image.GetSize()[2] == 1:
        slice_z = _single_slice_z(image)
        if slice_z is not None:
            spacing_xyz[2] = slice_z
    volume = sitk.GetArrayFromImage(image).astype(np.float32)
    if volume.ndim == 2:
        volume, spacing_xyz = volume[None], [*spacing_xyz, 1.0]
    return volume, spacing_xyz


def read_dicom_series(
    path: str | Path, *, series_id: str | None = None
) -> tuple[np.ndarray, tuple[float, float, float]]:
    """Read a DICOM series (folder) or one DICOM file as a float32 volume in rescaled units.

    Args:
        path: A folder holding one series (or several, with ``series_id``), or a single file.
        series_id: The series instance UID to read when the folder holds several
            (see :func:`list_dicom_series`).

    Returns:
        ``(volume, spacing)``: ``volume`` float32 ``[D, H, W]`` with ``RescaleSlope`` and
        ``RescaleIntercept`` applied (so CT is in HU), slices sorted by position;
        ``spacing`` ``(z, y, x)`` in mm. A single slice gives ``D = 1``, with ``z`` from
        ``SpacingBetweenSlices`` or else ``SliceThickness``.

    Raises:
        DataValidationError: Missing path, empty folder, no DICOM series, several series and no
            ``series_id``, or an unreadable file.
    """
    import SimpleITK as sitk

    path = Path(path).expanduser()
    if not path.exists():
        raise DataValidationError(
            path, ["does not exist; pass a DICOM file or a folder holding one series"]
        )

    if path.is_file():
        volume, spacing_xyz = _read_file(path)
    else:
        entries = [p for p in path.iterdir() if not p.name.startswith(".")]
        if not entries:
            raise DataValidationError(path, ["folder is empty; put the series' .dcm files in it"])
        series = list_dicom_series(path)
        if not series:
            names = sorted(p.name for p in entries)[:10]
            raise DataValidationError(
                path,
                [
                    f"no DICOM series found among {len(entries)} entries (e.g. {names}); pass a "
                    "folder holding the .dcm files of one series (subfolders are not searched)"
                ],
            )
        if series_id is None:
            if len(series) > 1:
                raise DataValidationError(
                    path,
                    [
                        f"folder holds {len(series)} DICOM series {series}; pass series_id=... "
                        "to choose one"
                    ],
                )
            series_id = series[0]
        elif series_id not in series:
            raise DataValidationError(
                path, [f"series_id {series_id!r} not found; the folder holds {series}"]
            )
        files = list(sitk.ImageSeriesReader.GetGDCMSeriesFileNames(str(path), series_id))
        if len(files) == 1:
            # The series reader cannot derive a slice spacing from one slice; the file path can.
            volume, spacing_xyz = _read_file(Path(files[0]))
        else:
            reader = sitk.ImageSeriesReader()
            reader.SetFileNames(files)
            try:
                image = reader.Execute()
            except RuntimeError as err:
                raise DataValidationError(
                    path,
                    [f"series {series_id} unreadable ({str(err).strip()[:200]}); check its files"],
                ) from err
            spacing_xyz = [float(v) for v in image.GetSpacing()]
            volume = sitk.GetArrayFromImage(image).astype(np.float32)

    if volume.ndim != 3:
        raise DataValidationError(
            path,
            [
                f"decoded to shape {volume.shape}; expected a grey-level volume [D, H, W] "
                "(colour DICOM is not supported)"
            ],
        )
    x, y, z = spacing_xyz[:3]
    return volume, (float(z), float(y), float(x))


# --------------------------------------------------------------------------------------------
# Folders of DICOM series as a segmentation dataset (one series per case)
# --------------------------------------------------------------------------------------------
