from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from dpkfc_med.data import (
    DataValidationError,
    VolumeDataset,
    deterministic_split,
    load_segmentation_folder,
    load_split,
    save_split,
    segmentation_transforms,
)

N_REAL = 4  # real hippocampus cases used; keeps the folder fast


@pytest.fixture(scope="module")
def hippo_cases(hippo_root: Path):
    first = sorted(p.name.removesuffix(".nii.gz") for p in (hippo_root / "labelsTr").iterdir())
    return load_segmentation_folder(hippo_root, case_ids=first[:N_REAL])


# --- real MSD hippocampus ------------------------------------------------------------------


def test_real_hippocampus_headers(hippo_root: Path, hippo_cases) -> None:
    assert len(hippo_cases) == N_REAL and hippo_cases.source == "dataset.json"
    assert hippo_cases.num_classes == 3
    assert hippo_cases.label_names == {0: "background", 1: "Anterior", 2: "Posterior"}
    with open(hippo_root / "cases.csv") as fh:
        table = {row["case"]: row for row in csv.DictReader(fh)}
    for case in hippo_cases:
        row = table[case.case_id]
        assert case.shape == (int(row["shape_x"]), int(row["shape_y"]), int(row["shape_z"]))
        assert case.spacing == (1.0, 1.0, 1.0)
        assert case.image_dtype == row["image_dtype"] and case.label_dtype == row["label_dtype"]
        assert case.image_path.parent.name == "imagesTr" and case.channels == 1


def test_real_hippocampus_voxels(hippo_cases) -> None:
    hippo_cases.validate_all()
    for cid in hippo_cases.case_ids:
        image, label = hippo_cases.load_case(cid)
        assert image.shape == label.shape == hippo_cases[cid].shape
        assert set(np.unique(label).tolist()) == {0, 1, 2}
        assert label.dtype == np.int64


def test_volume_dataset_returns_k_patches_of_one_case(hippo_cases) -> None:
    ids = hippo_cases.case_ids[:3]
    ds = VolumeDataset(
        hippo_cases, case_ids=ids, spatial_size=(16, 24, 16), num_patches_per_volume=3, seed=0
    )
    assert len(ds) == 3
    item = ds[1]
    assert item["case_id"] == ids[1]
    assert item["image"].shape == (3, 1, 16, 24, 16) and item["image"].dtype == torch.float32
    assert item["label"].shape == (3, 1, 16, 24, 16) and item["label"].dtype == torch.int64
    assert type(item["image"]) is torch.Tensor  # plain tensors, no MONAI metadata
    assert set(torch.unique(item["label"]).tolist()) <= {0, 1, 2}
    # The patches come from one volume: each patch is a crop of that case's normalised image.
    again = VolumeDataset(
        hippo_cases, case_ids=ids, spatial_size=(16, 24, 16), num_patches_per_volume=3, seed=0
    )[1]
    assert torch.equal(item["image"], again["image"])  # seeded -> reproducible patches
    # A batch of B volumes is [B, k, C, *patch]: the sampler draws volumes, not patches.
    batch = next(iter(DataLoader(ds, batch_size=2)))
    assert batch["image"].shape == (2, 3, 1, 16, 24, 16)
    assert batch["case_id"] == ids[:2]


def test_eval_pipeline_is_deterministic(hippo_cases) -> None:
    cid = hippo_cases.case_ids[0]
    shape = hippo_cases[cid].shape
    ds = VolumeDataset(hippo_cases, case_ids=[cid], spatial_size=64, train=False)
    a, b = ds[0], ds[0]
    assert a["image"].shape == (1, 1, 64, 64, 64)  # padded up to spatial_size, nothing cropped
    assert torch.equal(a["image"], b["image"])
    # Padding only adds background: the label voxel counts are the whole volume's.
    _, label = hippo_cases.load_case(cid)
    assert int((a["label"] > 0).sum()) == int((label > 0).sum())
    whole = VolumeDataset(hippo_cases, case_ids=[cid], spatial_size=8, train=False)[0]
    assert whole["image"].shape[2:] == shape
    z = whole["image"][whole["image"] != 0]
    assert abs(float(z.mean())) < 1e-3  # z-scored over nonzero voxels


def test_transform_options() -> None:
    with pytest.raises(ValueError, match="intensity='minmax' is not one of 'zscore', 'percentile'"):
        segmentation_transforms(spatial_size=8, train=True, intensity="minmax")
    with pytest.raises(ValueError, match="spatial_size"):
        segmentation_transforms(spatial_size=(8, 8), train=True)


# --- deterministic split -------------------------------------------------------------------


def test_deterministic_split(tmp_path: Path) -> None:
    ids = [f"hippocampus_{i:03d}" for i in range(220)]
    split = deterministic_split(ids, seed=0)
    assert [len(v) for v in split.values()] == [154, 33, 33]
    assert sorted(sum(split.values(), [])) == ids  # disjoint and complete
    assert deterministic_split(list(reversed(ids)), seed=0) == split  # input order irrelevant
    assert deterministic_split(ids, seed=1) != split
    assert deterministic_split([f"c{i}" for i in range(5)]) == deterministic_split(
        [f"c{i}" for i in range(5)]
    )
    assert [len(v) for v in deterministic_split([f"c{i}" for i in range(5)]).values()] == [3, 1, 1]
    assert load_split(save_split(split, tmp_path / "run" / "split.json")) == split
    with pytest.raises(ValueError, match=r"duplicate case IDs \['a'\]"):
        deterministic_split(["a", "a", "b"])
    with pytest.raises(ValueError, match="must be >= 0 and sum to 1"):
        deterministic_split(ids, fractions=(0.5, 0.2, 0.2))


# --- synthetic folders ---------------------------------------------------------------------


def test_folder_without_dataset_json(tmp_path: Path, write_case) -> None:
    for cid in ("b", "a", "c"):
        write_case(tmp_path, cid)
    (tmp_path / "imagesTr" / "._a.nii.gz").write_bytes(b"\0\1")  # macOS resource fork
    write_case(tmp_path, "d", image_name="d_0000.nii.gz")  # nnU-Net single-modality naming
    cases = load_segmentation_folder(tmp_path)
    assert cases.case_ids == ["a", "b", "c", "d"] and cases.source == "imagesTr/labelsTr"
    assert cases.num_classes is None and cases.label_values is None
    assert cases["a"].shape == (8, 8, 6)
    assert load_segmentation_folder(tmp_path, num_classes=3).label_values == (0, 1, 2)


def test_missing_label_and_missing_image(tmp_path: Path, write_case) -> None:
    write_case(tmp_path, "ok")
    write_case(tmp_path, "img_only", label=False)
    write_case(tmp_path, "lab_only", image=False)
    with pytest.raises(DataValidationError) as info:
        load_segmentation_folder(tmp_path)
    message = str(info.value)
    assert "case img_only: image imagesTr/img_only.nii.gz has no label in labelsTr/" in message
    assert "case lab_only: label labelsTr/lab_only.nii.gz has no image in imagesTr/" in message
    assert "on_unpaired='warn'" in message
    with pytest.warns(UserWarning, match="skipped 2 unpaired"):
        cases = load_segmentation_folder(tmp_path, on_unpaired="warn")
    assert cases.case_ids == ["ok"] and len(cases.dropped) == 2
    # Restricting to some cases ignores the problems of the others.
    assert load_segmentation_folder(tmp_path, case_ids=["ok"]).case_ids == ["ok"]
    with pytest.raises(DataValidationError, match="case nope: requested in case_ids but not found"):
        load_segmentation_folder(tmp_path, case_ids=["ok", "nope"])


def test_shape_mismatch(tmp_path: Path, write_case) -> None:
    write_case(tmp_path, "bad", shape=(8, 8, 6), label_shape=(8, 8, 5))
    with pytest.raises(
        DataValidationError, match=r"case bad: image shape \(8, 8, 6\) != label shape \(8, 8, 5\)"
    ):
        load_segmentation_folder(tmp_path)


def test_corrupt_file(tmp_path: Path, write_case) -> None:
    write_case(tmp_path, "good")
    write_case(tmp_path, "broken")
    (tmp_path / "imagesTr" / "broken.nii.gz").write_bytes(b"not a nifti file at all")
    with pytest.raises(DataValidationError, match="case broken: image broken.nii.gz is unreadable"):
        load_segmentation_folder(tmp_path)


def test_label_value_outside_declared_classes(tmp_path: Path, write_case, write_index) -> None:
    write_case(tmp_path, "c1")
    write_case(tmp_path, "c2", label_values=(0, 1, 5))
    write_index(tmp_path, ["c1", "c2"])
    cases = load_segmentation_folder(tmp_path)  # headers are fine: voxels are checked lazily
    assert cases.num_classes == 3 and cases.source == "dataset.json"
    match = r"case c2: c2.nii.gz holds label value\(s\) \[5\] outside the declared classes"
    with pytest.raises(DataValidationError, match=match):
        cases.validate_all()
    with pytest.raises(DataValidationError, match=match):
        cases.load_case("c2")
    cases.load_case("c1")
    ds = VolumeDataset(cases, spatial_size=8, num_patches_per_volume=2, seed=0)
    assert ds[0]["image"].shape == (2, 1, 8, 8, 8)
    with pytest.raises(DataValidationError, match=r"case c2: .*\[5\] outside"):
        ds[1]  # the check runs when the volume is loaded for training


def test_dataset_json_problems_reported_together(tmp_path: Path, write_case, write_index) -> None:
    write_case(tmp_path, "c1")
    write_case(tmp_path, "c2", label_shape=(4, 4, 4))
    write_index(tmp_path, ["c1", "c2", "ghost"])
    with pytest.raises(DataValidationError) as info:
        load_segmentation_folder(tmp_path)
    problems = info.value.problems
    assert len(problems) == 3, problems
    assert any("case ghost: image file" in p and "does not exist" in p for p in problems)
    assert any("case ghost: label file" in p for p in problems)
    assert any("case c2: image shape" in p for p in problems)


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(DataValidationError, match="folder not found"):
        load_segmentation_folder(tmp_path / "absent")
    with pytest.raises(
        DataValidationError, match=r"missing folder\(s\) \['imagesTr/', 'labelsTr/'\]"
    ):
        load_segmentation_folder(tmp_path)
