from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pydicom
import pytest
from pydicom.uid import generate_uid

from dpkfc_med.data import (
    DataValidationError,
    list_dicom_series,
    load_segmentation_folder,
    read_dicom_series,
)


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
    (tmp_path / "notes" / "readme.txt").write_text("no images here", encoding="utf-8")
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


# ---------------------------------------------------------- folders of DICOM series, one per case

SPACING = (0.7, 0.8, 1.5)  # (x, y, z) mm, set on the written series (the bundled data is 1 mm)
DIRECTION = (0.0, -1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0)  # a 90 degree turn about z
ORIGIN = (10.0, -5.0, 3.0)


def _hippo_volumes(hippo_root: Path, cid: str):
    """Image (rounded to int16, as DICOM stores it) and label of a bundled case, re-gridded."""
    import SimpleITK as sitk

    image = sitk.ReadImage(str(hippo_root / "imagesTr" / f"{cid}.nii.gz"))
    image = sitk.Cast(sitk.Round(sitk.Cast(image, sitk.sitkFloat32)), sitk.sitkInt16)
    label = sitk.ReadImage(str(hippo_root / "labelsTr" / f"{cid}.nii.gz"))
    for im in (image, label):
        im.SetSpacing(SPACING)
        im.SetDirection(DIRECTION)
        im.SetOrigin(ORIGIN)
    return image, label


def _write_mr_series(image, folder: Path, *, description: str = "T1 MPRAGE") -> str:
    """One file per slice with the tags a series reader needs; files named in reverse order."""
    import SimpleITK as sitk

    folder.mkdir(parents=True, exist_ok=True)
    uid = generate_uid()
    d = image.GetDirection()
    iop = "\\".join(f"{v:.6f}" for v in (d[0], d[3], d[6], d[1], d[4], d[7]))
    sx, sy, sz = image.GetSpacing()
    writer = sitk.ImageFileWriter()
    writer.KeepOriginalImageUIDOn()
    depth = image.GetDepth()
    for k in range(depth):
        sl = image[:, :, k]
        ipp = image.TransformIndexToPhysicalPoint((0, 0, k))
        tags = {
            "0008|0060": "MR",
            "0008|0018": generate_uid(),
            "0020|000d": "1.2.826.0.1.3680043.8.498.1",
            "0020|000e": uid,
            "0008|103e": description,
            "0020|0032": "\\".join(f"{v:.6f}" for v in ipp),
            "0020|0037": iop,
            "0020|0013": str(k + 1),
            "0028|0030": f"{sy:.6f}\\{sx:.6f}",  # row spacing, column spacing
            "0018|0050": f"{sz:.6f}",
        }
        for key, value in tags.items():
            sl.SetMetaData(key, value)
        writer.SetFileName(str(folder / f"IM{depth - k:04d}.dcm"))
        writer.Execute(sl)
    return uid


def _dicom_dataset(hippo_root: Path, root: Path, ids, *, layout: str = "imagesTr") -> Path:
    """Series as ``imagesTr/<case>/`` + ``labelsTr/<case>.nii.gz``, or ``<case>/`` holding both."""
    import SimpleITK as sitk

    for cid in ids:
        image, label = _hippo_volumes(hippo_root, cid)
        if layout == "imagesTr":
            _write_mr_series(image, root / "imagesTr" / cid)
            (root / "labelsTr").mkdir(parents=True, exist_ok=True)
            sitk.WriteImage(label, str(root / "labelsTr" / f"{cid}.nii.gz"))
        else:
            _write_mr_series(image, root / cid / "series")
            sitk.WriteImage(label, str(root / cid / "label.nii.gz"))
    return root


def _nifti_array(path: Path) -> np.ndarray:
    import nibabel as nib

    return np.asanyarray(nib.load(str(path)).dataobj)


def _problems(err: pytest.ExceptionInfo) -> list[str]:
    return list(err.value.problems)


@pytest.mark.parametrize("layout", ["imagesTr", "case folders"])
def test_series_folder_reads_the_source_volumes_and_geometry(
    hippo_root: Path, tmp_path: Path, layout: str
) -> None:
    import nibabel as nib

    ids = ["hippocampus_001", "hippocampus_004"]
    root = _dicom_dataset(hippo_root, tmp_path / "data", ids, layout=layout)
    (root / ids[0] if layout != "imagesTr" else root / "imagesTr" / ids[0]).joinpath(
        "notes.txt"
    ).write_text("scanner notes, not an image", encoding="utf-8")
    before = sorted(p for p in root.rglob("*"))
    with pytest.warns(UserWarning, match=r"skipped files that are not DICOM.*notes.txt"):
        cases = load_segmentation_folder(root, cache_dir=tmp_path / "cache")
    assert cases.case_ids == ids and cases.source.startswith("DICOM series")
    for cid in ids:
        image, label = cases.load_case(cid)
        src_image = _nifti_array(hippo_root / "imagesTr" / f"{cid}.nii.gz")
        src_label = _nifti_array(hippo_root / "labelsTr" / f"{cid}.nii.gz")
        np.testing.assert_array_equal(image, np.round(src_image.astype(np.float64)))
        np.testing.assert_array_equal(label, src_label)
        case = cases[cid]
        assert case.spacing == pytest.approx(SPACING)
        assert case.image_path.is_relative_to(tmp_path / "cache")
        affine = nib.load(str(case.image_path)).affine
        np.testing.assert_allclose(affine, nib.load(str(case.label_path)).affine, atol=1e-4)
        # LPS (DICOM) -> RAS (NIfTI): x and y flip sign
        np.testing.assert_allclose(affine[:3, 3], [-10.0, 5.0, 3.0], atol=1e-4)
    cases.validate_all()
    assert sorted(p for p in root.rglob("*")) == before  # nothing written into the data folder
    again = load_segmentation_folder(root, cache_dir=tmp_path / "cache")  # cached: same files
    assert [c.image_path for c in again] == [c.image_path for c in cases]


def _remove_slice(folder: Path, name: str = "IM0010.dcm") -> None:
    (folder / name).unlink()


def test_missing_slice_and_inconsistent_spacing_name_the_case(
    hippo_root: Path, tmp_path: Path
) -> None:
    ids = ["hippocampus_001", "hippocampus_004", "hippocampus_006"]
    root = _dicom_dataset(hippo_root, tmp_path / "data", ids)
    _remove_slice(root / "imagesTr" / ids[0])
    odd = root / "imagesTr" / ids[1] / "IM0005.dcm"
    ds = pydicom.dcmread(odd)
    ds.PixelSpacing = [0.5, 0.5]
    ds.save_as(odd)
    with pytest.raises(DataValidationError, match="2 problems") as err:
        load_segmentation_folder(root, cache_dir=tmp_path / "cache")
    missing, spacing = _problems(err)
    assert missing.startswith(f"case {ids[0]}: series ") and "missing slice(s)" in missing
    assert "InstanceNumber(s) [" in missing and "uneven slice positions: 3 mm" in missing
    assert spacing.startswith(f"case {ids[1]}: series ")
    assert "inconsistent PixelSpacing" in spacing and "re-export the series" in spacing
    assert not (tmp_path / "cache").exists()  # nothing converted from a refused folder


def test_two_series_in_one_case_need_data_dicom_series(hippo_root: Path, tmp_path: Path) -> None:
    import SimpleITK as sitk

    ids = ["hippocampus_001", "hippocampus_004"]
    root = _dicom_dataset(hippo_root, tmp_path / "data", ids)
    for cid in ids:  # a second, brighter series of each case
        image, _ = _hippo_volumes(hippo_root, cid)
        _write_mr_series(
            sitk.Cast(image * 2, sitk.sitkInt16),
            root / "imagesTr" / cid / "t2",
            description="T2 SPACE",
        )
    with pytest.raises(DataValidationError) as err:
        load_segmentation_folder(root, cache_dir=tmp_path / "cache")
    first = _problems(err)[0]
    assert first.startswith(f"case {ids[0]}: 2 DICOM series in one case folder")
    assert "'T1 MPRAGE'" in first and "'T2 SPACE'" in first and "data.dicom_series" in first
    assert first.count("1.2.826.0.1.3680043.8.498.") == 2  # both SeriesInstanceUIDs named
    cases = load_segmentation_folder(root, dicom_series="^T2", cache_dir=tmp_path / "cache")
    image, _ = cases.load_case(ids[0])
    src = np.round(_nifti_array(hippo_root / "imagesTr" / f"{ids[0]}.nii.gz").astype(np.float64))
    np.testing.assert_array_equal(image, 2 * src)
    assert cases[ids[0]].series_description == "T2 SPACE"
    with pytest.raises(
        DataValidationError, match=r"case hippocampus_001: data.dicom_series='T' matches 2"
    ):
        load_segmentation_folder(root, dicom_series="T", cache_dir=tmp_path / "cache")


def test_case_label_mismatches_name_the_case(hippo_root: Path, tmp_path: Path) -> None:
    import SimpleITK as sitk

    ids = ["hippocampus_001", "hippocampus_004", "hippocampus_006"]
    root = _dicom_dataset(hippo_root, tmp_path / "data", ids)
    (root / "labelsTr" / f"{ids[0]}.nii.gz").unlink()  # a case without a label
    _, other = _hippo_volumes(hippo_root, "hippocampus_007")  # a label without a case
    sitk.WriteImage(other, str(root / "labelsTr" / "hippocampus_007.nii.gz"))
    sitk.WriteImage(other, str(root / "labelsTr" / f"{ids[2]}.nii.gz"))  # another grid
    with pytest.raises(DataValidationError) as err:
        load_segmentation_folder(root, cache_dir=tmp_path / "cache")
    problems = _problems(err)
    assert any(p.startswith(f"case {ids[0]}: series ") and "has no label" in p for p in problems)
    assert any(
        p.startswith("case hippocampus_007: label labelsTr/hippocampus_007.nii.gz has no image")
        for p in problems
    )
    assert any(
        p.startswith(f"case {ids[2]}: series shape") and "resample the label" in p for p in problems
    )
    (root / "labelsTr" / f"{ids[2]}.nii.gz").unlink()
    with pytest.warns(UserWarning, match="skipped 3 unpaired"):
        cases = load_segmentation_folder(root, on_unpaired="warn", cache_dir=tmp_path / "cache")
    assert cases.case_ids == [ids[1]]


def test_dicom_seg_label_matched_by_referenced_series(hippo_root: Path, tmp_path: Path) -> None:
    hd = pytest.importorskip("highdicom")
    import SimpleITK as sitk

    cid = "hippocampus_001"
    root = tmp_path / "data"
    image, label = _hippo_volumes(hippo_root, cid)
    uid = _write_mr_series(image, root / "imagesTr" / cid)
    sources = sorted(
        (pydicom.dcmread(p) for p in (root / "imagesTr" / cid).glob("*.dcm")),
        key=lambda ds: int(ds.InstanceNumber),
    )
    frame_uid = generate_uid()
    for ds in sources:  # highdicom needs the patient/study modules the writer left empty
        ds.FrameOfReferenceUID = frame_uid
        ds.PatientID, ds.PatientName, ds.StudyID = "p1", "anon^", "1"
        ds.AccessionNumber, ds.StudyDate, ds.StudyTime, ds.ReferringPhysicianName = "1", "", "", ""
    segments = [
        hd.seg.SegmentDescription(
            segment_number=n,
            segment_label=name,
            segmented_property_category=hd.sr.CodedConcept(
                "91723000", "SCT", "Anatomical Structure"
            ),
            segmented_property_type=hd.sr.CodedConcept("17561000", "SCT", "Hippocampus"),
            algorithm_type=hd.seg.SegmentAlgorithmTypeValues.MANUAL,
        )
        for n, name in ((1, "anterior"), (2, "posterior"))
    ]
    seg = hd.seg.Segmentation(
        source_images=sources,
        pixel_array=sitk.GetArrayFromImage(label).astype(np.uint8),  # [D, H, W] label map
        segmentation_type=hd.seg.SegmentationTypeValues.BINARY,
        segment_descriptions=segments,
        series_instance_uid=generate_uid(),
        series_number=2,
        sop_instance_uid=generate_uid(),
        instance_number=1,
        manufacturer="test",
        manufacturer_model_name="test",
        software_versions="0",
        device_serial_number="0",
    )
    (root / "labelsTr").mkdir()
    seg.save_as(root / "labelsTr" / "segmentation_from_pacs.dcm")  # not named by case id
    cases = load_segmentation_folder(root, cache_dir=tmp_path / "cache")
    assert cases[cid].series_uid == uid and cases[cid].label_path.is_relative_to(tmp_path / "cache")
    _, got = cases.load_case(cid)
    np.testing.assert_array_equal(got, _nifti_array(hippo_root / "labelsTr" / f"{cid}.nii.gz"))


def test_cli_trains_on_a_dicom_series_folder(hippo_root: Path, tmp_path: Path) -> None:
    from dpkfc_med.cli import main
    from tests.training.test_segmentation import CONFIG, TINY, _sets

    # 6 cases split 4/1/1 by seed 0 at [0.5, 0.25, 0.25]
    ids = [f"hippocampus_0{n}" for n in (33, 34, 35, 36, 37, 38)]
    root = _dicom_dataset(hippo_root, tmp_path / "data", ids, layout="case folders")
    run = tmp_path / "run"
    sets = [*TINY, "data.split_fractions=[0.5,0.25,0.25]", "data.num_classes=3"]
    args = ["train", str(CONFIG), "--data", str(root), "--out", str(run), "--method", "dp-sgd"]
    assert main([*args, *_sets(sets)]) == 0
    private = run / "private_not_for_release"
    split = json.loads((private / "split.json").read_text(encoding="utf-8"))
    assert {k: len(v) for k, v in split.items()} == {"train": 4, "val": 1, "test": 1}
    assert sorted(p.name for p in (private / "dicom_cache").glob("*/*/*.nii.gz")) == [
        f"{c}.nii.gz" for c in ids
    ]
    metrics = json.loads((private / "metrics.json").read_text(encoding="utf-8"))
    assert 0.0 <= metrics["test"]["mean_dice"] <= 1.0


def test_a_dicom_case_folder_with_a_case_seg_label_stays_dicom(
    hippo_root: Path, tmp_path: Path
) -> None:
    """``<case>/series/*.dcm`` + ``<case>/<case>_seg.nii.gz`` is DICOM, not the BraTS layout."""
    ids = ["hippocampus_001", "hippocampus_004"]
    root = _dicom_dataset(hippo_root, tmp_path / "data", ids, layout="case")
    for cid in ids:
        (root / cid / "label.nii.gz").rename(root / cid / f"{cid}_seg.nii.gz")
    cases = load_segmentation_folder(root, cache_dir=tmp_path / "cache")
    assert cases.case_ids == ids and cases.source.startswith("DICOM series")
