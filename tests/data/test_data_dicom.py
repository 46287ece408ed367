from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pydicom
import pytest
from pydicom.uid import generate_uid

from dpkfc_med.data import DataValidationError, list_dicom_series, read_dicom_series


def test_ct_single_file_in_hounsfield_units(dicom_dir: Path) -> None:
    volume, spacing = read_dicom_series(dicom_dir / "CT_small.dcm")
    assert volume.shape == (1, 128, 128) and volume.dtype == np.float32
    # Raw 128..2191 with RescaleIntercept -1024 -> HU.
    assert volume.min() == -896.0 and volume.max() == 2191.0 - 1024.0
    assert spacing == pytest.approx((5.0, 0.661468, 0.661468))


def test_mr_single_file(dicom_dir: Path) -> None:
    volume, spacing = read_dicom_series(dicom_dir / "MR_small.dcm")
    assert volume.shape == (1, 64, 64)
    assert (volume.min(), volume.max()) == (127.0, 2145.0)  # no rescale tags
    assert spacing == pytest.approx((0.8, 0.3125, 0.3125))  # z from SliceThickness


def test_pydicom_fallback(dicom_dir: Path, monkeypatch) -> None:
    reference, ref_spacing = read_dicom_series(dicom_dir / "CT_small.dcm")
    import SimpleITK as sitk

    def fail(*args, **kwargs):
        raise RuntimeError("GDCM cannot decode this")

    monkeypatch.setattr(sitk, "ReadImage", fail)
    volume, spacing = read_dicom_series(dicom_dir / "CT_small.dcm")
    np.testing.assert_array_equal(volume, reference)
    assert spacing == pytest.approx(ref_spacing)


def _write_series(src: Path, folder: Path, n: int = 3) -> None:
    """n slices 5 mm apart, slice i has raw pixels + 10*i; files named in reverse order."""
    folder.mkdir(parents=True)
    base = pydicom.dcmread(src)
    raw = base.pixel_array.copy()
    series_uid = generate_uid()
    for i in range(n):
        ds = pydicom.dcmread(src)  # fresh copy: Dataset.copy() is shallow
        ds.SeriesInstanceUID = series_uid
        ds.SOPInstanceUID = generate_uid()
        ds.file_meta.MediaStorageSOPInstanceUID = ds.SOPInstanceUID
        ds.InstanceNumber = i + 1
        x, y, z = (float(v) for v in base.ImagePositionPatient)
        ds.ImagePositionPatient = [x, y, z + 5.0 * i]
        ds.PixelData = (raw + 10 * i).astype(raw.dtype).tobytes()
        ds.save_as(folder / f"slice_{n - i:02d}.dcm")


def test_series_folder_sorted_by_position(dicom_dir: Path, tmp_path: Path) -> None:
    _write_series(dicom_dir / "CT_small.dcm", tmp_path / "series")
    volume, spacing = read_dicom_series(tmp_path / "series")
    assert volume.shape == (3, 128, 128)
    assert [float(s.min()) for s in volume] == [-896.0, -886.0, -876.0]
    assert spacing == pytest.approx((5.0, 0.661468, 0.661468))


def test_folder_errors(dicom_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(DataValidationError, match="does not exist"):
        read_dicom_series(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataValidationError, match="folder is empty"):
        read_dicom_series(tmp_path / "empty")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("no images here")
    with pytest.raises(DataValidationError, match=r"no DICOM series found among 1 entries"):
        read_dicom_series(tmp_path / "notes")
    with pytest.raises(DataValidationError, match="not a readable DICOM file"):
        read_dicom_series(tmp_path / "notes" / "readme.txt")


def test_several_series_need_series_id(dicom_dir: Path, tmp_path: Path) -> None:
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for name in ("CT_small.dcm", "MR_small.dcm"):
        shutil.copy(dicom_dir / name, mixed / name)
    series = list_dicom_series(mixed)
    assert len(series) == 2
    with pytest.raises(DataValidationError, match="folder holds 2 DICOM series.*series_id"):
        read_dicom_series(mixed)
    mr_uid = str(pydicom.dcmread(dicom_dir / "MR_small.dcm").SeriesInstanceUID)
    volume, spacing = read_dicom_series(mixed, series_id=mr_uid)
    assert volume.shape == (1, 64, 64) and spacing == pytest.approx((0.8, 0.3125, 0.3125))
    with pytest.raises(DataValidationError, match="series_id 'x' not found"):
        read_dicom_series(mixed, series_id="x")
