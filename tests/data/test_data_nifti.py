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
        segmentation_transforms(spatial_size=(8, 8, 8, 8), train=True)
    with pytest.raises(ValueError, match="slices need an in-plane"):
        segmentation_transforms(spatial_size=(8, 8, 8), train=True, slices=object())


# --- deterministic split -------------------------------------------------------------------


def _membership(split: dict[str, list[str]]) -> dict[str, str]:
    return {cid: name for name, ids in split.items() for cid in ids}


def test_deterministic_split(tmp_path: Path) -> None:
    ids = [f"hippocampus_{i:03d}" for i in range(220)]
    split = deterministic_split(ids, seed=0)
    assert sorted(sum(split.values(), [])) == ids  # disjoint and complete
    assert all(v == sorted(v) for v in split.values())
    # Binomial counts around f * n (154, 33, 33), not floor(f * n): within 3 standard deviations.
    for (name, ids_in), f in zip(split.items(), (0.7, 0.15, 0.15)):
        assert abs(len(ids_in) - f * 220) <= 3 * (220 * f * (1 - f)) ** 0.5, (name, len(ids_in))
    assert deterministic_split(list(reversed(ids)), seed=0) == split  # input order irrelevant
    assert deterministic_split(ids, seed=1) != split
    assert deterministic_split(ids, seed=0, names=("a", "b", "c")) == dict(
        zip("abc", split.values())
    )
    # A zero fraction gets no case; an all-training split holds every case.
    assert deterministic_split(ids, fractions=(0.8, 0.2, 0.0))["test"] == []
    assert deterministic_split(ids, fractions=(1.0, 0.0, 0.0))["train"] == ids
    assert load_split(save_split(split, tmp_path / "run" / "split.json")) == split
    with pytest.raises(ValueError, match=r"duplicate case IDs \['a'\]"):
        deterministic_split(["a", "a", "b"])
    with pytest.raises(ValueError, match="must be >= 0 and sum to 1"):
        deterministic_split(ids, fractions=(0.5, 0.2, 0.2))


def test_split_of_a_case_does_not_depend_on_the_other_cases() -> None:
    """Adding or removing one case of the folder changes at most that case's split."""
    ids = [f"hippocampus_{i:03d}" for i in range(220)]
    for seed in (0, 1, 7):
        base = _membership(deterministic_split(ids, seed=seed))
        for removed in ids[::11]:
            rest = [c for c in ids if c != removed]
            after = _membership(deterministic_split(rest, seed=seed))
            moved = [c for c in rest if after[c] != base[c]]
            assert not moved, f"seed {seed}: removing {removed} moved {moved}"
        for added in ("hippocampus_999", "aaa_first", "zzz_last", "hippocampus_100b"):
            after = _membership(deterministic_split([*ids, added], seed=seed))
            moved = [c for c in ids if after[c] != base[c]]
            assert not moved, f"seed {seed}: adding {added} moved {moved}"


def test_split_too_small_for_its_fractions_names_fraction_and_count() -> None:
    ids = ["case_a", "case_b", "case_c", "case_d"]
    with pytest.raises(ValueError, match=r"split 'val' \(fraction 0.15\) drew none of the 4 cases"):
        deterministic_split(ids, seed=0)
    split = deterministic_split(ids, seed=0, allow_empty=True)
    assert split["val"] == [] and sorted(sum(split.values(), [])) == ids


# --- per-volume random streams -------------------------------------------------------------


def test_patches_of_a_volume_do_not_depend_on_other_volumes_drawn(hippo_cases) -> None:
    """Same seed and draw count: A's patches are the same whether or not B was drawn first."""
    ids = hippo_cases.case_ids[:3]

    def dataset(seed: int | None = 0) -> VolumeDataset:
        return VolumeDataset(
            hippo_cases,
            case_ids=ids,
            spatial_size=(16, 24, 16),
            num_patches_per_volume=3,
            seed=seed,
        )

    alone = dataset()
    a_first = alone[0]["image"]
    a_second = alone[0]["image"]
    after_b = dataset()
    after_b[1]
    after_b[2]
    assert torch.equal(after_b[0]["image"], a_first)  # B and C drawn before A: no effect
    assert torch.equal(after_b[0]["image"], a_second)  # A's second draw, after B and C
    assert not torch.equal(a_first, a_second)  # a new draw of a volume gets new patches
    assert not torch.equal(dataset(seed=1)[0]["image"], a_first)  # the run seed counts
    # Without a seed every draw comes from OS entropy: independent of the others as well.
    free = dataset(seed=None)
    assert not torch.equal(free[0]["image"], free[0]["image"])


def test_patches_do_not_depend_on_other_volumes_with_loader_workers(hippo_cases) -> None:
    """In a DataLoader worker too: batches {A} and {B, A} give A the same patches."""
    ids = hippo_cases.case_ids[:2]

    def first_image(batches: list[list[int]]) -> torch.Tensor:
        ds = VolumeDataset(
            hippo_cases, case_ids=ids, spatial_size=16, num_patches_per_volume=2, seed=0
        )
        loader = DataLoader(
            ds,
            batch_sampler=batches,
            num_workers=1,
            generator=torch.Generator().manual_seed(0),
            multiprocessing_context="fork",
        )
        batch = next(iter(loader))
        return batch["image"][batch["case_id"].index(ids[0])]

    assert torch.equal(first_image([[0]]), first_image([[1, 0]]))


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
    assert "(pair it, or move it out of the data folder)" in message
    assert "on_unpaired" not in message  # a Python argument no CLI or config option has
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
