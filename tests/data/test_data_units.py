"""Unit-id mappings (CSV and .npz arrays), unit datasets and their collate."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from dpkfc_med.data import DataValidationError, load_medmnist
from dpkfc_med.data.fingerprint import count_shared, image_digests
from dpkfc_med.data.units import (
    UnitCollate,
    UnitImageDataset,
    group_by_unit,
    read_unit_ids_csv,
    same_grouping,
    unit_random_state,
)


def _csv(tmp_path: Path, text: str, name: str = "units.csv") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_csv_mapping_read_in_any_column_order(tmp_path):
    path = _csv(tmp_path, "site,unit_id,index\nA,p1,2\nA,p0,0\n\nB, p0 ,1\n")
    assert read_unit_ids_csv(path, 3) == ["p0", "p0", "p1"]


def test_csv_mapping_every_bad_row_named_in_one_error(tmp_path):
    text = "index,unit_id\n0,a\n1,a\nx,b\n9,c\n3,\n1,d\n"
    path = _csv(tmp_path, text)
    with pytest.raises(DataValidationError) as info:
        read_unit_ids_csv(path, 6, images_file="adrenal.npz")
    err = str(info.value)
    assert err.startswith(f"{path}: 5 problems found")
    assert "index is not a whole number on line 4 ('x')" in err
    assert "index outside 0..5 (train_images of adrenal.npz has 6 images) on line 5 (9)" in err
    assert "unit_id is empty on line 6" in err
    assert "listed more than once on line 7 (index 1, first on line 3)" in err
    # 2, 4 and 5 have no row; 3 had an empty id and is reported as such, not twice
    assert "3 of the 6 training indices have no row (2, 4, 5)" in err


def test_csv_without_the_columns_names_the_header(tmp_path):
    with pytest.raises(DataValidationError, match=r"lacks the column\(s\) \['unit_id'\]"):
        read_unit_ids_csv(_csv(tmp_path, "index,patient\n0,a\n"), 1)
    with pytest.raises(DataValidationError, match=r"\(empty file\)"):
        read_unit_ids_csv(_csv(tmp_path, ""), 1)


def test_npz_unit_id_arrays_read_and_validated(write_npz, make_arrays):
    arrays = make_arrays()
    arrays["train_unit_ids"] = np.asarray(["a", "a", "b", "c", "c", "d"])
    arrays["test_unit_ids"] = np.arange(3)[:, None]
    ds = load_medmnist(write_npz(**arrays))
    assert ds.unit_ids == {"train": ["a", "a", "b", "c", "c", "d"], "test": ["0", "1", "2"]}
    assert load_medmnist(write_npz(**arrays), max_per_split=2).unit_ids["train"] == ["a", "a"]
    arrays["train_unit_ids"] = np.asarray(["a", "", "b", "c", "c"])
    arrays["val_unit_ids"] = np.ones((3, 2))
    with pytest.raises(DataValidationError) as info:
        load_medmnist(write_npz(**arrays))
    err = str(info.value)
    assert "train_unit_ids has 5 ids but the split has 6 images" in err
    assert "train_unit_ids has 1 empty id(s) at positions 1" in err
    assert "val_unit_ids has shape (3, 2)" in err


def test_npz_object_unit_ids_refused_without_pickle(write_npz, make_arrays):
    arrays = make_arrays()
    arrays["train_unit_ids"] = np.asarray(["a", 1, None, "b", "c", "d"], dtype=object)
    with pytest.raises(
        DataValidationError, match=r"train_unit_ids could not be read without pickle"
    ):
        load_medmnist(write_npz(**arrays))


def test_grouping_and_same_grouping():
    names, groups = group_by_unit(["b", "a", "b", "c", "a"])
    assert names == ["b", "a", "c"]
    assert [g.tolist() for g in groups] == [[0, 2], [1, 4], [3]]
    assert same_grouping(["b", "a", "b"], ["x", "y", "x"])
    assert not same_grouping(["b", "a", "b"], ["x", "x", "y"])


def test_unit_dataset_and_collate_variable_counts_and_empty_batch():
    images = torch.arange(5 * 1 * 2 * 2, dtype=torch.float32).reshape(5, 1, 2, 2)
    labels = torch.tensor([0, 1, 1, 0, 1])
    names, groups = group_by_unit(["p", "q", "p", "r", "r"])
    ds = UnitImageDataset(images, labels, groups, names, transform=lambda x: x + 1)
    assert len(ds) == 3 and ds.max_images_per_unit == 2
    collate = UnitCollate(1, (2, 2))
    batch = collate([ds[2], ds[0], ds[1]])
    assert batch["index"].tolist() == [3, 4, 0, 2, 1]
    assert batch["unit"].tolist() == [0, 0, 1, 1, 2]
    assert batch["unit_id"] == ["r", "p", "q"]
    assert torch.equal(batch["image"], images[[3, 4, 0, 2, 1]] + 1)
    assert torch.equal(batch["label"], labels[[3, 4, 0, 2, 1]])
    empty = collate([])
    assert empty["image"].shape == (0, 1, 2, 2) and empty["image"].dtype == torch.float32
    assert empty["label"].dtype == torch.int64 and empty["unit"].shape == (0,)


def test_image_digests_match_exact_content_only():
    a = torch.rand(4, 1, 3, 3)
    b = torch.cat([a[2:3], a[:1] + 1e-7, a[:1].double().float()])
    assert count_shared(image_digests(b), image_digests(a)) == 2
    assert count_shared(image_digests(a.double()), image_digests(a)) == 0  # dtype counts
    assert len(set(image_digests(a))) == 4


def test_random_transform_of_a_unit_does_not_depend_on_other_units_drawn():
    """A unit's random augmentation at its n-th draw is the same whoever was drawn before."""
    from monai.transforms import RandGaussianNoise

    images = torch.zeros(5, 1, 4, 4)
    labels = torch.zeros(5, dtype=torch.int64)
    names, groups = group_by_unit(["p", "q", "p", "r", "r"])

    def dataset(seed: int | None = 0) -> UnitImageDataset:
        noise = RandGaussianNoise(prob=1.0, std=1.0)
        return UnitImageDataset(images, labels, groups, names, transform=noise, seed=seed)

    alone = dataset()
    p_first, p_second = alone[0]["image"], alone[0]["image"]
    after_others = dataset()
    after_others[1]
    after_others[2]
    assert torch.equal(after_others[0]["image"], p_first)
    assert torch.equal(after_others[0]["image"], p_second)
    assert not torch.equal(p_first, p_second)  # each draw of a unit is a new augmentation
    assert not torch.equal(p_first[0], p_first[1])  # the unit's two images differ
    assert not torch.equal(dataset(seed=1)[0]["image"], p_first)


def test_unit_random_state_is_a_function_of_seed_unit_and_draw():
    def draw(seed, unit, n):
        return unit_random_state(seed, unit, n).randint(1 << 30, size=4).tolist()

    assert draw(0, "p", 0) == draw(0, "p", 0)
    assert (
        len({str(draw(*key)) for key in [(0, "p", 0), (1, "p", 0), (0, "q", 0), (0, "p", 1)]}) == 4
    )
    assert draw(None, "p", 0) != draw(None, "p", 0)  # OS entropy
