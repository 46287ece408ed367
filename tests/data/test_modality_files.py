"""Images stored one file per modality (nnU-Net's ``<case>_0000.nii.gz``, ``<case>_0001...``)."""

from __future__ import annotations

import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch

from dpkfc_med.data import DataValidationError, VolumeDataset, load_segmentation_folder
from dpkfc_med.data.cases import image_digest

SHAPE = (10, 9, 8)
CASES = ("case_a", "case_b", "case_c")


def _write(path: Path, array: np.ndarray, zoom: tuple[float, ...] = (1.0, 1.0, 2.0)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    image = nib.Nifti1Image(array, np.diag([*zoom, 1.0]))
    image.header.set_zooms(zoom + (1.0,) * (array.ndim - len(zoom)))
    nib.save(image, str(path))


def _volumes(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Two channels of different scale (so per-channel normalisation matters) and a label."""
    rng = np.random.default_rng(seed)
    channels = np.stack([rng.random(SHAPE) * 100, rng.random(SHAPE) * 3 + 10], axis=-1)
    return channels.astype(np.float32), rng.integers(0, 3, SHAPE).astype(np.uint8)


def _per_file(root: Path, *, names: bool = True) -> Path:
    """imagesTr/<case>_0000 + _0001, labelsTr/<case>; ``names``: files named like nnU-Net."""
    for i, cid in enumerate(CASES):
        image, label = _volumes(i)
        for m in range(2):
            _write(root / "imagesTr" / f"{cid}_{m:04d}.nii.gz", image[..., m])
        _write(root / "labelsTr" / f"{cid}.nii.gz", label)
    return root


def _four_d(root: Path) -> Path:
    for i, cid in enumerate(CASES):
        image, label = _volumes(i)
        _write(root / "imagesTr" / f"{cid}.nii.gz", image)
        _write(root / "labelsTr" / f"{cid}.nii.gz", label)
    return root


def test_modality_files_pair_as_channels_in_order(tmp_path):
    cases = load_segmentation_folder(_per_file(tmp_path / "d"), num_classes=3)
    assert cases.case_ids == list(CASES)
    case = cases["case_b"]
    assert case.channels == 2 and case.shape == SHAPE
    assert [p.name for p in case.image_files] == ["case_b_0000.nii.gz", "case_b_0001.nii.gz"]
    image, label = cases.load_case("case_b")
    expected, expected_label = _volumes(1)
    np.testing.assert_array_equal(image, expected)  # stacked last, as a 4-D NIfTI
    np.testing.assert_array_equal(label, expected_label)
    record = cases.data_dicts(["case_b"])[0]
    assert record["image"] == [str(p) for p in case.image_files]


def test_per_file_and_4d_folders_give_the_same_samples(tmp_path):
    """The transformed sample (per-channel z-score, padding) is the same for both layouts."""
    per_file = load_segmentation_folder(_per_file(tmp_path / "a"), num_classes=3)
    four_d = load_segmentation_folder(_four_d(tmp_path / "b"), num_classes=3)
    kwargs = {"spatial_size": (12, 12, 8), "train": False}
    for cid in CASES:
        a = VolumeDataset(per_file, case_ids=[cid], **kwargs)[0]
        b = VolumeDataset(four_d, case_ids=[cid], **kwargs)[0]
        assert a["image"].shape == b["image"].shape == (1, 2, 12, 12, 8)  # [k, C, X, Y, Z]
        torch.testing.assert_close(torch.as_tensor(a["image"]), torch.as_tensor(b["image"]))
        second = torch.as_tensor(a["image"])[0, 1]
        inside = second[second != 0]
        assert abs(float(inside.mean())) < 1e-4 and abs(float(inside.std()) - 1) < 0.05


def test_the_image_digest_covers_every_modality(tmp_path):
    root = _per_file(tmp_path / "d")
    before = image_digest(load_segmentation_folder(root, num_classes=3)["case_a"])
    image, _ = _volumes(7)
    _write(root / "imagesTr" / "case_a_0001.nii.gz", image[..., 1])
    after = image_digest(load_segmentation_folder(root, num_classes=3)["case_a"])
    assert before != after


def test_a_gap_in_the_modality_numbers_names_the_case(tmp_path):
    root = _per_file(tmp_path / "d")
    (root / "imagesTr" / "case_b_0001.nii.gz").rename(root / "imagesTr" / "case_b_0002.nii.gz")
    with pytest.raises(DataValidationError) as err:
        load_segmentation_folder(root, num_classes=3)
    text = str(err.value)
    assert "case case_b" in text and "case_b_0002.nii.gz" in text and "without gaps" in text


def test_modalities_on_different_grids_name_the_file(tmp_path):
    root = _per_file(tmp_path / "d")
    _write(root / "imagesTr" / "case_c_0001.nii.gz", np.zeros((10, 9, 7), np.float32))
    with pytest.raises(DataValidationError) as err:
        load_segmentation_folder(root, num_classes=3)
    assert "case_c_0001.nii.gz" in str(err.value) and "one voxel grid" in str(err.value)


def test_a_4d_file_beside_a_modality_file_is_refused(tmp_path):
    root = _per_file(tmp_path / "d")
    _write(root / "imagesTr" / "case_a_0001.nii.gz", np.zeros((*SHAPE, 2), np.float32))
    with pytest.raises(DataValidationError) as err:
        load_segmentation_folder(root, num_classes=3)
    assert "case_a_0001.nii.gz" in str(err.value) and "one 3-D" in str(err.value)


def _index(root: Path, modalities: dict[str, str]) -> None:
    training = [
        {"image": f"./imagesTr/{c}.nii.gz", "label": f"./labelsTr/{c}.nii.gz"} for c in CASES
    ]
    labels = {"0": "background", "1": "anterior", "2": "posterior"}
    index = {"modality": modalities, "labels": labels, "training": training}
    (root / "dataset.json").write_text(json.dumps(index), encoding="utf-8")


def test_an_nnunet_index_lists_the_case_and_finds_its_modality_files(tmp_path):
    root = _per_file(tmp_path / "d")
    _index(root, {"0": "T1", "1": "T2"})
    cases = load_segmentation_folder(root)
    assert cases.source == "dataset.json" and cases.num_classes == 3
    assert [c.channels for c in cases] == [2, 2, 2]


def test_a_case_missing_a_declared_modality_is_named(tmp_path):
    root = _per_file(tmp_path / "d")
    _index(root, {"0": "T1", "1": "T2"})
    (root / "imagesTr" / "case_c_0001.nii.gz").unlink()
    with pytest.raises(DataValidationError) as err:
        load_segmentation_folder(root)
    text = str(err.value)
    assert "case case_c" in text and "declares 2 modalities" in text
    assert "case case_a" not in text


def test_a_declared_modality_count_checks_4d_images_too(tmp_path):
    root = _four_d(tmp_path / "d")
    _index(root, {"0": "T1", "1": "T2", "2": "FLAIR"})
    with pytest.raises(DataValidationError) as err:
        load_segmentation_folder(root)
    assert "case case_a: 2 channel(s)" in str(err.value)
    assert "declares 3 modalities" in str(err.value)


def test_a_per_file_modality_folder_trains_and_evaluates(tmp_path):
    """The CLI end to end: two input channels, a released model, test Dice on those cases."""
    from dpkfc_med.cli import main
    from tests.training.test_segmentation import CONFIG, TINY, _sets

    root = tmp_path / "d"
    rng = np.random.default_rng(0)
    for cid in ("c1", "c2", "c3", "c4", "c5", "c6"):
        _write(root / "labelsTr" / f"{cid}.nii.gz", rng.integers(0, 3, SHAPE).astype(np.uint8))
        for m in range(2):
            image = rng.random(SHAPE).astype(np.float32) * (m + 1)
            _write(root / "imagesTr" / f"{cid}_{m:04d}.nii.gz", image)
    out = tmp_path / "run"
    sets = [*TINY, "data.num_classes=3", "data.split_fractions=[0.5,0.25,0.25]"]
    sets += ["data.patch_size=[8,8,8]", "pretrain.steps=2"]
    assert main(["train", str(CONFIG), "--out", str(out), "--data", str(root), *_sets(sets)]) == 0
    saved = torch.load(out / "model.pt", weights_only=False)
    assert saved["task"]["in_channels"] == 2
    first = next(v for k, v in saved["model"].items() if v.dim() == 5)
    assert first.shape[1] == 2  # the first convolution reads both modalities
    assert main(["evaluate", str(out), "--split", "test"]) == 0
    # the exported bundle reads a case's modality files as one image, as a 4-D file
    from tests.bundle.conftest import monai_run

    assert main(["bundle", "export", str(out), str(tmp_path / "bundle")]) == 0
    stacked = tmp_path / "stacked"
    for cid in ("c1", "c2"):
        files = [root / "imagesTr" / f"{cid}_{m:04d}.nii.gz" for m in range(2)]
        image = np.stack([np.asarray(nib.load(str(f)).dataobj) for f in files], axis=-1)
        _write(stacked / f"{cid}.nii.gz", image)
        for f in files:
            (tmp_path / "per_file").mkdir(exist_ok=True)
            (tmp_path / "per_file" / f.name).symlink_to(f)
    monai_run(tmp_path / "bundle", tmp_path / "per_file", tmp_path / "pred_a")
    monai_run(tmp_path / "bundle", stacked, tmp_path / "pred_b")
    for cid in ("c1", "c2"):
        a = nib.load(str(tmp_path / "pred_a" / f"{cid}_0000_seg.nii.gz"))
        b = nib.load(str(tmp_path / "pred_b" / f"{cid}_seg.nii.gz"))
        assert a.shape == SHAPE
        np.testing.assert_array_equal(np.asarray(a.dataobj), np.asarray(b.dataobj))
    assert len(list((tmp_path / "pred_a").iterdir())) == 2  # one label map per case


def test_an_nnunet_v2_folder_declares_channels_and_labels_without_a_list(tmp_path):
    """nnU-Net v2: ``channel_names`` and ``labels`` (name -> value), no ``training`` list."""
    root = _per_file(tmp_path / "d")
    labels = {"background": 0, "anterior": 1, "posterior": 2}
    index = {"channel_names": {"0": "T2", "1": "ADC"}, "labels": labels, "numTraining": 3}
    (root / "dataset.json").write_text(json.dumps(index), encoding="utf-8")
    cases = load_segmentation_folder(root)
    assert cases.num_classes == 3 and cases.label_names == {0: "background", 1: "anterior",
                                                             2: "posterior"}  # fmt: skip
    assert [c.channels for c in cases] == [2, 2, 2]
    index["channel_names"] = {"0": "T2"}
    (root / "dataset.json").write_text(json.dumps(index), encoding="utf-8")
    with pytest.raises(DataValidationError, match="declares 1 modality;"):
        load_segmentation_folder(root)
