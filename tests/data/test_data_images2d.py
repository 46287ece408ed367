"""2D segmentation folders: PNG images/ + masks/ and 2-D NIfTI are indexed from their headers,
read in MONAI's axis order, and every bad pair is refused naming the file and the fix."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from dpkfc_med.data import DataValidationError, load_segmentation_folder, segmentation_transforms
from dpkfc_med.data.slices import RandSlicesd, SliceRule


def png_folder(root: Path, n: int = 4, size: tuple[int, int] = (20, 24), classes: int = 3) -> Path:
    """``n`` greyscale ``W x H = size`` images with a class-``1 + i % (classes - 1)`` box."""
    from PIL import Image

    rng = np.random.default_rng(0)
    (root / "images").mkdir(parents=True)
    (root / "masks").mkdir()
    w, h = size
    for i in range(n):
        mask = np.zeros((h, w), np.uint8)  # PIL arrays are [H, W]
        r, c = rng.integers(2, h // 2), rng.integers(2, w // 2)
        mask[r : r + 6, c : c + 7] = 1 + i % (classes - 1)
        image = (rng.normal(60, 10, mask.shape) + 80 * (mask > 0)).clip(0, 255).astype(np.uint8)
        Image.fromarray(image).save(root / "images" / f"case{i}.png")
        Image.fromarray(mask).save(root / "masks" / f"case{i}.png")
    return root


def test_png_folder_is_indexed_in_monai_axis_order(tmp_path):
    from PIL import Image

    root = png_folder(tmp_path / "d")
    cases = load_segmentation_folder(root, num_classes=3)
    assert cases.reader == "PILReader" and cases.source == "images/masks"
    assert cases.case_ids == ["case0", "case1", "case2", "case3"]
    assert all(c.shape == (20, 24) and c.channels == 1 for c in cases)  # (W, H)
    cases.validate_all()
    image, label = cases.load_case("case0")
    mask = np.asarray(Image.open(root / "masks" / "case0.png"))
    np.testing.assert_array_equal(label, mask.T)  # [W, H], as MONAI's PILReader reads it
    item = segmentation_transforms(
        spatial_size=(24, 24), train=False, reader="PILReader", label_values=(0, 1, 2)
    )(cases.data_dicts(["case0"])[0])
    assert item["image"].shape == (1, 24, 24) and item["label"].shape == (1, 24, 24)
    # padded symmetrically along W (20 -> 24): 2 columns of padding before the mask
    np.testing.assert_array_equal(item["label"][0, 2:22].numpy(), mask.T)


def _break(root: Path, problem: str) -> str:
    """Introduce one problem in case1 of a png_folder; returns the text the error must hold."""
    from PIL import Image

    masks, images = root / "masks", root / "images"
    if problem == "missing mask":
        (masks / "case1.png").unlink()
        return "case case1: image images/case1.png has no mask in masks/"
    if problem == "size mismatch":
        Image.fromarray(np.zeros((10, 10), np.uint8)).save(masks / "case1.png")
        return "mask masks/case1.png is 10x10"
    if problem == "label beyond classes":
        Image.fromarray(np.full((24, 20), 3, np.uint8)).save(masks / "case1.png")
        return "case case1: case1.png holds label value(s) [3] outside the declared classes"
    if problem == "0/255 mask":
        Image.fromarray(np.full((24, 20), 255, np.uint8)).save(masks / "case1.png")
        return "(a 0/255 mask? store class indices 0..K-1)"
    if problem == "rgb mask":
        Image.fromarray(np.zeros((24, 20, 3), np.uint8)).save(masks / "case1.png")
        return "mask masks/case1.png has PIL mode 'RGB'"
    if problem == "jpeg mask":
        (masks / "case1.png").unlink()
        Image.fromarray(np.zeros((24, 20), np.uint8)).save(masks / "case1.jpg")
        return "mask masks/case1.jpg is a JPEG"
    if problem == "alpha image":
        Image.fromarray(np.zeros((24, 20, 4), np.uint8)).save(images / "case1.png")
        return "image images/case1.png has PIL mode 'RGBA'"
    if problem == "unreadable":
        (images / "case1.png").write_bytes(b"\x89PNG not really")
        return "image images/case1.png is unreadable or corrupt"
    raise AssertionError(problem)


@pytest.mark.parametrize(
    "problem",
    [
        "missing mask",
        "size mismatch",
        "label beyond classes",
        "0/255 mask",
        "rgb mask",
        "jpeg mask",
        "alpha image",
        "unreadable",
    ],
)
def test_bad_pairs_are_refused_naming_the_file(tmp_path, problem):
    root = png_folder(tmp_path / "d")
    expected = _break(root, problem)
    with pytest.raises(DataValidationError) as err:
        load_segmentation_folder(root, num_classes=3).validate_all()
    assert expected in str(err.value), str(err.value)
    assert "case0" not in str(err.value)  # only the broken case is named


def test_two_d_nifti_as_x_y_and_x_y_1_read_alike(tmp_path):
    import nibabel as nib

    rng = np.random.default_rng(1)
    image = rng.random((12, 14)).astype(np.float32)
    label = (image > 0.5).astype(np.uint8)
    for cid, shape in (("flat", (12, 14)), ("thin", (12, 14, 1))):
        for sub, arr in (("imagesTr", image), ("labelsTr", label)):
            (tmp_path / sub).mkdir(exist_ok=True)
            affine = np.diag([0.5, 0.7, 2.0, 1.0])
            nib.save(
                nib.Nifti1Image(arr.reshape(shape), affine), str(tmp_path / sub / f"{cid}.nii.gz")
            )
    cases = load_segmentation_folder(tmp_path, num_classes=2)
    assert cases["flat"].shape == (12, 14) and cases["thin"].shape == (12, 14, 1)
    load = segmentation_transforms(spatial_size=(16, 16), train=False, label_values=(0, 1))
    flat, thin = (load(cases.data_dicts([c])[0]) for c in ("flat", "thin"))
    for item in (flat, thin):
        assert item["image"].shape == item["label"].shape == (1, 16, 16)
    assert torch.equal(flat["image"].as_tensor(), thin["image"].as_tensor())
    assert torch.equal(flat["label"].as_tensor(), thin["label"].as_tensor())
    assert [round(float(v), 3) for v in thin["image"].pixdim] == [0.5, 0.7]  # HD95 in mm


def test_slice_rule_positions_are_positional_and_per_draw():
    even = SliceRule(axis=0, per_unit=3, pick="even")
    assert even.positions(9) == [1, 4, 7] and even.positions(2) == [0, 1, 1]
    rand = SliceRule(axis=0, per_unit=3)
    draws = [tuple(rand.positions(10, np.random.RandomState(s))) for s in range(20)]
    assert all(len(set(d)) == 3 for d in draws) and len(set(draws)) > 5
    short = rand.positions(2, np.random.RandomState(0))  # every slice, then repeats
    assert len(short) == 3 and set(short) == {0, 1}
    assert SliceRule(axis=1).positions(4) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="axis=3 must be 0, 1 or 2"):
        SliceRule(axis=3)


def test_rand_slices_cuts_image_and_label_alike():
    volume = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).reshape(2, 3, 4, 5)
    label = (volume[:1] % 3).long()
    t = RandSlicesd(SliceRule(axis=1, per_unit=2, pick="even"))
    out = t({"image": volume, "label": label, "case_id": "a"})
    assert [o["slice_index"] for o in out] == [1, 3]
    for o in out:
        z = o["slice_index"]
        assert torch.equal(o["image"], volume[:, :, z]) and o["image"].shape == (2, 3, 5)
        assert torch.equal(o["label"], label[:, :, z]) and o["case_id"] == "a"
