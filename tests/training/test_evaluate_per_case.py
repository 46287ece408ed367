"""``dpkfc-med evaluate`` per case: MONAI MetricsSaver CSV files and saved label maps.

Brute force: the figures recomputed from the per-case rows equal the reported ones, and the saved
label maps, read back and scored with numpy against the label files, give the rows' Dice.
"""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from dpkfc_med.cli import main
from tests.bundle.conftest import SEG_TINY, bundle_train
from tests.conftest import SHARED_DATA
from tests.training.test_segmentation import _sets

HIPPO = Path(SHARED_DATA) / "msd_hippocampus"
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "hippocampus_unet_3d_eps8.yaml"
BUNDLE = Path(__file__).resolve().parents[1] / "bundle" / "zoo_bundle"
# the bundle tests' tiny segmentation run, smaller still (later settings win)
TINY = [
    *SEG_TINY,
    "data.max_train=4",
    "data.max_eval=2",
    "data.patches_per_unit=1",
    "training.batch_size=2",
]


def _nifti(path: Path) -> tuple[np.ndarray, np.ndarray]:
    import nibabel as nib

    img = nib.load(str(path))
    return np.asanyarray(img.dataobj), np.asarray(img.affine)


def _rows(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with path.open(encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def _dice(pred: np.ndarray, label: np.ndarray, c: int) -> float:
    """Dice of class ``c`` in float64 (nan where the label lacks it, as MONAI's ignore_empty)."""
    p, t = pred == c, label == c
    if not t.any():
        return math.nan
    return 2.0 * float((p & t).sum()) / float(p.sum() + t.sum())


def _close(a: float, b: float, tol: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or abs(a - b) <= tol


def _images() -> list[str]:
    return sorted(p.name for p in (HIPPO / "imagesTr").glob("hippocampus_*.nii.gz"))


def _folder(tmp_path: Path, names: list[str]) -> Path:
    """A folder of new cases: links to bundled hippocampus cases."""
    other = tmp_path / "new_cases"
    for sub in ("imagesTr", "labelsTr"):
        (other / sub).mkdir(parents=True)
        for name in names:
            os.symlink(HIPPO / sub / name, other / sub / name)
    return other


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    assert (HIPPO / "imagesTr").is_dir(), f"no msd_hippocampus data at {HIPPO}; set DPKFC_MED_DATA"
    out = tmp_path_factory.mktemp("per_case") / "run"
    args = ["train", str(CONFIG), "--out", str(out), "--method", "dp-sgd", *_sets(TINY)]
    assert main(args) == 0
    return out


def test_per_case_csv_gives_the_reported_figures_and_the_saved_maps_its_dice(run, tmp_path):
    other = _folder(tmp_path, _images()[-3:])
    assert main(["evaluate", str(run), "--data", str(other), "--save-predictions"]) == 0
    evals = run / "private_not_for_release" / "evaluations"
    result = evals / "new_cases_all.json"
    out = json.loads(result.read_text(encoding="utf-8"))
    folder = evals / result.stem
    assert out["per_case"]["predictions"] == str(folder.relative_to(run) / "predictions")
    names = list(out["dice_per_class"])
    # MetricsSaver's layout: filename, one column per class, their mean
    header, rows = _rows(folder / "mean_dice_raw.csv")
    assert header == ["filename", *names, "mean"] and len(rows) == out["n"] == 3
    dice = np.array([[float(r[n]) for n in names] for r in rows])
    per_class = [float(np.nanmean(col)) for col in dice.T]
    for n, v in zip(names, per_class):
        assert _close(v, out["dice_per_class"][n], 1e-12), (n, v, out["dice_per_class"][n])
    assert out["mean_dice"] == pytest.approx(float(np.nanmean(per_class)), abs=1e-12)
    for r, row in zip(rows, dice):
        assert _close(float(r["mean"]), float(np.nanmean(row)), 1e-12)
    _, hd_rows = _rows(folder / "hd95_raw.csv")
    hd = np.array([[float(r[n]) for n in names] for r in hd_rows])
    for n, col in zip(names, hd.T):
        ok = col[np.isfinite(col)]
        want = float(ok.mean()) if ok.size else math.nan
        assert _close(want, out["hd95_per_class"][n], 1e-9)
        assert out["hd95_missed_cases"][n] == int(np.isinf(col).sum())
    figures = dict(
        line.split(",") for line in (folder / "metrics.csv").read_text(encoding="utf-8").split()
    )
    assert float(figures["mean_dice"]) == out["mean_dice"]
    # the saved label maps lie on the input images and re-score to the rows' Dice
    for r in rows:
        image = Path(r["filename"])
        saved, affine = _nifti(folder / "predictions" / image.name)
        source, source_affine = _nifti(image)
        label, _ = _nifti(other / "labelsTr" / image.name)
        assert saved.shape == source.shape and np.allclose(affine, source_affine)
        assert saved.dtype == np.uint8 and set(np.unique(saved)) <= {0, 1, 2}
        for c, n in enumerate(names, start=1):
            assert _close(_dice(saved, label, c), float(r[n]), 1e-6), (image.name, n)
    # nothing of it is named in the shareable report
    shareable = (run / "privacy_report.json").read_text(encoding="utf-8")
    assert "evaluations" not in shareable and "mean_dice_raw" not in shareable


def test_a_second_evaluation_replaces_the_first_without_label_maps(run, tmp_path):
    other = _folder(tmp_path, _images()[-5:-3])
    assert main(["evaluate", str(run), "--data", str(other), "--save-predictions"]) == 0
    assert main(["evaluate", str(run), "--data", str(other)]) == 0
    folder = run / "private_not_for_release" / "evaluations" / "new_cases_all"
    out = json.loads(folder.with_suffix(".json").read_text(encoding="utf-8"))
    assert out["per_case"]["predictions"] is None and not (folder / "predictions").exists()
    _, rows = _rows(folder / "mean_dice_raw.csv")
    assert sorted(Path(r["filename"]).name for r in rows) == _images()[-5:-3]


@pytest.fixture(scope="module")
def bundle_run(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("bundle_per_case")
    bundle = tmp / "bundle"
    shutil.copytree(BUNDLE, bundle)
    out = tmp / "run"
    overrides = [f"dataset_dir={HIPPO}", "num_train=4", "train#trainer#max_epochs=1"]
    bundle_train(bundle, out, overrides)
    return out


def test_a_bundle_run_evaluates_new_cases_per_case_with_label_maps(bundle_run, tmp_path):
    images = _images()
    trained, new = images[1], images[-4:-2]  # the bundle trains on its first 4 images
    other = _folder(tmp_path, [trained, *new])
    args = ["evaluate", str(bundle_run), "--data", str(other), "--save-predictions"]
    assert main(args) == 0
    evals = bundle_run / "private_not_for_release" / "evaluations"
    out = json.loads((evals / "new_cases_all.json").read_text(encoding="utf-8"))
    # the overlap is stated (by image content, whatever the path), nothing refused
    assert out["overlap_with_training"]["shared"] == 1 and out["not_dp"] is True
    assert "1 of the 3 evaluated items" in out["warning"] and out["n"] == 3
    folder = evals / "new_cases_all"
    header, rows = _rows(folder / "all_mean_dice_raw.csv")
    assert header == ["filename", "anterior", "posterior", "mean"] and len(rows) == 3
    # MONAI's MeanDice: the mean over cases of each case's mean over classes (the CSV's mean)
    means = [float(r["mean"]) for r in rows]
    assert out["all_mean_dice"] == pytest.approx(float(np.nanmean(means)), abs=1e-6)
    figures = dict(
        line.split(",") for line in (folder / "metrics.csv").read_text(encoding="utf-8").split()
    )
    assert float(figures["all_mean_dice"]) == out["all_mean_dice"]
    for r in rows:
        image = Path(r["filename"])
        saved, affine = _nifti(folder / "predictions" / image.name)
        source, source_affine = _nifti(image)
        label, _ = _nifti(HIPPO / "labelsTr" / image.name)
        assert saved.shape == source.shape and np.allclose(affine, source_affine)
        for c, n in enumerate(("anterior", "posterior"), start=1):
            assert _close(_dice(saved, label, c), float(r[n]), 1e-6), (image.name, n)


def test_dicom_series_get_a_dicom_seg_on_their_own_slices(run, tmp_path):
    """A DICOM input: the DICOM-SEG, read back on the series' slices, is the NIfTI label map."""
    import highdicom as hd

    from dpkfc_med.data.dicom.scan import check_series, scan_case
    from tests.data.test_data_dicom import _dicom_dataset

    ids = [Path(n).name.removesuffix(".nii.gz") for n in _images()[-2:]]
    import pydicom
    from pydicom.uid import generate_uid

    root = _dicom_dataset(HIPPO, tmp_path / "dicom_cases", ids)  # re-gridded, turned 90 deg
    frame = generate_uid()  # a real series has one; the test writer leaves it out
    for path in (root / "imagesTr" / ids[0]).glob("*.dcm"):
        ds = pydicom.dcmread(str(path))
        ds.FrameOfReferenceUID = frame
        ds.save_as(str(path))
    assert main(["evaluate", str(run), "--data", str(root), "--save-predictions"]) == 0
    folder = run / "private_not_for_release" / "evaluations" / "dicom_cases_all"
    out = json.loads(folder.with_suffix(".json").read_text(encoding="utf-8"))
    # the second series cannot carry a DICOM-SEG: said, its NIfTI map written all the same
    (problem,) = out["per_case"]["dicom_seg_not_written"]
    assert f"case {ids[1]}:" in problem and "FrameOfReferenceUID" in problem
    assert not (folder / "predictions" / f"{ids[1]}_seg.dcm").exists()
    _, rows = _rows(folder / "mean_dice_raw.csv")
    assert sorted(Path(r["filename"]) for r in rows) == [root / "imagesTr" / c for c in ids]
    names = _rows(folder / "mean_dice_raw.csv")[0][1:-1]
    for r in rows:
        cid = Path(r["filename"]).name
        saved, affine = _nifti(folder / "predictions" / f"{cid}.nii.gz")
        label, label_affine = _nifti(root / "labelsTr" / f"{cid}.nii.gz")
        assert saved.shape == label.shape and np.allclose(affine, label_affine, atol=1e-4)
        for c, n in enumerate(names, start=1):
            assert _close(_dice(saved, label, c), float(r[n]), 1e-6), (cid, n)
        if cid != ids[0]:
            continue
        seg = hd.seg.segread(str(folder / "predictions" / f"{cid}_seg.dcm"))
        assert [s.segment_label for s in seg.SegmentSequence] == names
        series = scan_case(root / "imagesTr" / cid, cid).series
        (slices,) = series.values()
        slices, problems = check_series(cid, slices[0].series_uid, slices)
        assert not problems
        frames = seg.get_pixels_by_source_instance(
            source_sop_instance_uids=[s.sop_uid for s in slices], combine_segments=True
        )
        np.testing.assert_array_equal(np.asarray(frames), saved.transpose(2, 1, 0))
