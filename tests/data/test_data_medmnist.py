from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from dpkfc_med.data import DataValidationError, Task, TensorImageDataset, load_medmnist


def test_pneumoniamnist_real(pneumonia_path: Path, shared_sha256: dict) -> None:
    ds = load_medmnist(pneumonia_path)
    assert {s: len(y) for s, (_, y) in ds.splits.items()} == {
        "train": 4708,
        "val": 524,
        "test": 624,
    }
    assert ds.task == Task.BINARY and ds.task == "binary"
    assert ds.num_classes == 2
    assert ds.label_names == ["normal", "pneumonia"]  # from medmnist.INFO
    assert ds.flag == "pneumoniamnist"
    assert (ds.spatial_dims, ds.channels, ds.spatial_shape) == (2, 1, (28, 28))
    images, labels = ds.splits["train"]
    assert images.shape == (4708, 1, 28, 28) and images.dtype == torch.float32
    assert labels.shape == (4708,) and labels.dtype == torch.int64
    assert 0.0 <= images.min() and images.max() <= 1.0
    assert ds.class_counts == {"train": [1214, 3494], "val": [135, 389], "test": [234, 390]}
    assert ds.sha256 == shared_sha256["medmnist/pneumoniamnist.npz"]


def test_adrenalmnist3d_real(adrenal_path: Path) -> None:
    ds = load_medmnist(adrenal_path)
    assert (ds.spatial_dims, ds.channels, ds.spatial_shape) == (3, 1, (28, 28, 28))
    images, labels = ds.splits["train"]
    assert images.shape == (1188, 1, 28, 28, 28)
    assert ds.task == "binary" and ds.label_names == ["normal", "hyperplasia"]
    assert ds.class_counts["train"] == [929, 259]
    assert [len(ds.splits[s][1]) for s in ("val", "test")] == [98, 298]
    # Binary masks (0 / 255) become exactly 0 / 1.
    assert set(torch.unique(images[:20]).tolist()) == {0.0, 1.0}


def test_max_per_split_and_subset(pneumonia_path: Path) -> None:
    ds = load_medmnist(pneumonia_path, max_per_split=10)
    assert all(len(y) == 10 for _, y in ds.splits.values())
    full = load_medmnist(pneumonia_path)
    a, b = full.subset("train", 16, seed=3), full.subset("train", 16, seed=3)
    c = full.subset("train", 16, seed=4)
    assert len(a) == 16 and torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.images, c.images)
    assert len(full.subset("val", 10_000)) == 524
    with pytest.raises(KeyError, match="no split 'valid'"):
        full.subset("valid", 3)


def test_rgb_channels_last_and_flat_labels(write_npz, make_arrays) -> None:
    arrays = make_arrays(sample_shape=(5, 6, 3), num_classes=4)
    for s in ("train", "val", "test"):
        arrays[f"{s}_labels"] = arrays[f"{s}_labels"][:, 0]  # (N,) labels
    ds = load_medmnist(write_npz(**arrays))
    images, labels = ds.splits["train"]
    assert images.shape == (6, 3, 5, 6)
    assert (ds.spatial_dims, ds.channels, ds.spatial_shape) == (2, 3, (5, 6))
    raw = arrays["train_images"]
    assert images[2, 1, 4, 5] == pytest.approx(raw[2, 4, 5, 1] / 255.0)
    assert ds.task == "multiclass" and ds.num_classes == 4
    assert ds.label_names == ["class0", "class1", "class2", "class3"]
    assert ds.num_classes_source == "the file's 'classes' array"
    assert labels.tolist() == [0, 1, 2, 3, 0, 1]
    assert ds.class_counts["train"] == [2, 2, 1, 1]


def test_3d_layouts_and_spatial_dims_override(write_npz, make_arrays) -> None:
    ds = load_medmnist(write_npz(**make_arrays(sample_shape=(4, 5, 6, 2))))
    assert ds.spatial_dims == 3 and ds.channels == 2
    assert ds.splits["train"][0].shape == (6, 2, 4, 5, 6)
    # (N, 8, 8, 3) reads as RGB by the rule, as a thin 3D volume when told so.
    path = write_npz("thin.npz", **make_arrays(sample_shape=(8, 8, 3)))
    assert load_medmnist(path).splits["train"][0].shape == (6, 3, 8, 8)
    assert load_medmnist(path, spatial_dims=3).splits["train"][0].shape == (6, 1, 8, 8, 3)
    with pytest.raises(ValueError, match="spatial_dims=4"):
        load_medmnist(path, spatial_dims=4)


def test_multilabel(write_npz, make_arrays) -> None:
    arrays = make_arrays()
    rng = np.random.default_rng(1)
    for s, n in zip(("train", "val", "test"), (6, 3, 3)):
        arrays[f"{s}_labels"] = rng.integers(0, 2, (n, 4)).astype(np.uint8)
    with pytest.raises(DataValidationError, match=r"4 columns but the file's 'classes' array"):
        load_medmnist(write_npz(**arrays))  # 2 class names declared, 4 label columns
    arrays["classes"] = np.array(list("abcd"))
    ds = load_medmnist(write_npz(**arrays))
    assert ds.task == Task.MULTILABEL and ds.num_classes == 4
    assert ds.splits["train"][1].shape == (6, 4)
    assert ds.class_counts["train"] == arrays["train_labels"].sum(0).tolist()


def test_float_images_kept_unscaled(write_npz, make_arrays) -> None:
    arrays = make_arrays()
    arrays["train_images"] = arrays["train_images"].astype(np.float32) * 10
    arrays["val_images"] = arrays["val_images"].astype(np.float32)
    ds = load_medmnist(write_npz(**arrays))
    assert ds.splits["train"][0].max() > 1.0
    assert ds.splits["test"][0].max() <= 1.0  # uint8 split is still scaled


def test_info_metadata_declares_range(write_npz, make_arrays) -> None:
    # A file named like a MedMNIST flag gets its declared classes from medmnist.INFO.
    path = write_npz("pneumoniamnist_64.npz", **make_arrays(num_classes=3))
    with pytest.raises(DataValidationError, match=r"declared by medmnist.INFO\['pneumoniamnist'\]"):
        load_medmnist(path)
    # An explicit num_classes overrides the metadata.
    assert load_medmnist(path, num_classes=3).num_classes == 3
    with pytest.raises(ValueError, match="did you mean 'pneumoniamnist'"):
        load_medmnist(path, flag="pneumonimnist")


# --- one synthetic archive per failure mode -----------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(
        DataValidationError, match=r"(?s)nope\.npz: 1 problem found:.*file not found"
    ):
        load_medmnist(tmp_path / "nope.npz")


def test_not_an_npz(tmp_path: Path) -> None:
    path = tmp_path / "text.npz"
    path.write_text("hello", encoding="utf-8")
    with pytest.raises(DataValidationError, match=r"not a \.npz \(zip\) archive"):
        load_medmnist(path)


def test_missing_keys_lists_present(write_npz, make_arrays) -> None:
    arrays = make_arrays()
    del arrays["val_labels"], arrays["test_images"]
    with pytest.raises(
        DataValidationError,
        match=r"missing keys \['val_labels', 'test_images'\]; present keys: \['classes', "
        r"'test_labels', 'train_images', 'train_labels', 'val_images'\]",
    ):
        load_medmnist(write_npz(**arrays))


def test_length_mismatch(write_npz, make_arrays) -> None:
    arrays = make_arrays()
    arrays["train_labels"] = arrays["train_labels"][:5]
    with pytest.raises(
        DataValidationError, match="train_images has 6 items but train_labels has 5"
    ):
        load_medmnist(write_npz(**arrays))


def test_empty_split(write_npz, make_arrays) -> None:
    arrays = make_arrays()
    arrays["val_images"] = arrays["val_images"][:0]
    arrays["val_labels"] = arrays["val_labels"][:0]
    with pytest.raises(DataValidationError, match="split 'val' is empty"):
        load_medmnist(write_npz(**arrays))


def test_non_finite_pixels(write_npz, make_arrays) -> None:
    arrays = make_arrays()
    img = arrays["test_images"].astype(np.float32)
    img[0, 0, 0], img[1, 2, 3] = np.nan, np.inf
    arrays["test_images"] = img
    with pytest.raises(DataValidationError, match=r"test_images has 2 non-finite pixel"):
        load_medmnist(write_npz(**arrays))


def test_negative_labels(write_npz, make_arrays) -> None:
    arrays = make_arrays()
    arrays["train_labels"] = arrays["train_labels"].astype(np.int64) - 1
    with pytest.raises(DataValidationError, match=r"train_labels has 3 negative label\(s\)"):
        load_medmnist(write_npz(**arrays))


def test_labels_out_of_declared_range(write_npz, make_arrays) -> None:
    path = write_npz(**make_arrays(num_classes=3))
    with pytest.raises(
        DataValidationError,
        match=r"train_labels has 2 label\(s\) >= 2 \(offending values \[2\]\), outside the 2 "
        r"classes 0..1 declared by num_classes",
    ):
        load_medmnist(path, num_classes=2)


def test_label_outside_binary_file_names_file_split_count_and_values(write_npz, make_arrays):
    """A 5 in a binary MedMNIST file is refused, not read as a 6-class task."""
    arrays = make_arrays()
    arrays["train_labels"][[1, 3]] = 5
    arrays["test_labels"][0] = 7
    path = write_npz("breastmnist.npz", **arrays)  # medmnist.INFO declares 2 classes
    with pytest.raises(DataValidationError) as info:
        load_medmnist(path)
    err = str(info.value)
    assert "breastmnist.npz: 2 problems found" in err
    assert "train_labels has 2 label(s) >= 2 (offending values [5])" in err
    assert "test_labels has 1 label(s) >= 2 (offending values [7])" in err
    assert "medmnist.INFO['breastmnist']" in err


def test_classes_are_never_read_off_the_private_labels(write_npz, make_arrays):
    """Adding one training image with a new label must not change the class count.

    Without a declaration the count would be ``max(label) + 1`` over all splits, training split
    included: a neighbouring dataset would get another output layer (certain
    distinguishability). The file is refused instead, naming what to set, with the value the
    data suggests shown to the custodian.
    """
    arrays = make_arrays()
    del arrays["classes"]
    path = write_npz("site_a.npz", **arrays)  # no MedMNIST flag, no classes array
    with pytest.raises(
        DataValidationError,
        match=r"(?s)site_a\.npz: 1 problem found.*number of classes is not declared.*"
        r"--set data\.num_classes=N.*classes=np\.array.*custodian only.*suggest 2 classes",
    ):
        load_medmnist(path)
    arrays["train_labels"][4] = 2  # the neighbouring dataset: one image with a new label
    with pytest.raises(DataValidationError, match=r"number of classes is not declared"):
        load_medmnist(write_npz("site_a.npz", **arrays))
    # declared anywhere (argument, file), the count is the declaration whatever the labels
    assert load_medmnist(path, num_classes=3).num_classes == 3
    arrays["classes"] = np.array(["a", "b", "c"])
    ds = load_medmnist(write_npz("site_b.npz", **arrays))
    assert ds.num_classes == 3 and ds.label_names == ["a", "b", "c"]
    arrays["classes"] = np.array(["a", "b"])
    with pytest.raises(DataValidationError, match=r"label\(s\) >= 2 \(offending values \[2\]\)"):
        load_medmnist(write_npz("site_b.npz", **arrays))


def test_inferred_labels_that_skip_a_class_are_refused(write_npz, make_arrays):
    """With ``infer_classes`` (public data), labels {0, 1, 5} would silently make 6 classes."""
    arrays = make_arrays()
    del arrays["classes"]
    arrays["train_labels"][4] = 5
    path = write_npz("site_b.npz", **arrays)  # no MedMNIST flag: classes not declared
    with pytest.raises(
        DataValidationError,
        match=r"(?s)site_b\.npz: 1 problem found.*skip class\(es\) \[2, 3, 4\].*"
        r"train_labels has 1 label\(s\) > 1 \(values \[5\]\).*declare the classes",
    ):
        load_medmnist(path, infer_classes=True)
    # Declaring the classes turns the same file into a clear out-of-range error ...
    with pytest.raises(DataValidationError, match=r"train_labels has 1 label\(s\) >= 2"):
        load_medmnist(path, num_classes=2)
    # ... and a declared 6-class task accepts it.
    ds = load_medmnist(path, num_classes=6)
    assert ds.num_classes == 6 and ds.num_classes_source == "num_classes"
    # Contiguous undeclared labels still infer max + 1 and say so.
    plain = make_arrays(num_classes=3)
    del plain["classes"]
    inferred = load_medmnist(write_npz("site_c.npz", **plain), infer_classes=True)
    assert inferred.num_classes == 3 and "not declared" in inferred.num_classes_source


def test_multilabel_values_not_binary(write_npz, make_arrays) -> None:
    arrays = make_arrays()
    for s, n in zip(("train", "val", "test"), (6, 3, 3)):
        arrays[f"{s}_labels"] = np.full((n, 3), 2, np.uint8)
    with pytest.raises(DataValidationError, match="multi-label targets must be 0/1 indicators"):
        load_medmnist(write_npz(**arrays))


def test_inconsistent_shapes_between_splits(write_npz, make_arrays) -> None:
    arrays = make_arrays()
    arrays["test_images"] = np.zeros((3, 9, 9), np.uint8)
    with pytest.raises(
        DataValidationError,
        match=r"test_images has per-image shape \(9, 9\) but train_images has \(8, 8\)",
    ):
        load_medmnist(write_npz(**arrays))


def test_several_problems_one_error(write_npz, make_arrays) -> None:
    arrays = make_arrays()
    arrays["train_labels"] = arrays["train_labels"][:4]  # length mismatch
    arrays["val_images"] = np.zeros((3, 7, 7), np.uint8)  # shape mismatch
    arrays["test_labels"] = -arrays["test_labels"].astype(np.int8)  # negative label
    with pytest.raises(DataValidationError) as info:
        load_medmnist(write_npz("bad.npz", **arrays))
    err = info.value
    assert len(err.problems) == 3, err.problems
    assert "bad.npz: 3 problems found" in str(err)
    for part in ("train_images has 6 items", "val_images has per-image shape", "test_labels has 1"):
        assert part in str(err)


def test_tensor_image_dataset_batches(write_npz, make_arrays) -> None:
    ds = load_medmnist(write_npz(**make_arrays()))
    train = ds.dataset("train", transform=lambda x: x * 2)
    x, y = train[0]
    assert torch.equal(x, ds.splits["train"][0][0] * 2) and y.dtype == torch.int64
    xb, yb = next(iter(DataLoader(train, batch_size=4)))
    assert xb.shape == (4, 1, 8, 8) and yb.shape == (4,)
    with pytest.raises(ValueError, match="3 images but 2 labels"):
        TensorImageDataset(torch.zeros(3, 1, 2, 2), torch.zeros(2))
