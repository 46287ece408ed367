"""One folder per case, one file per modality (the BraTS layout), channels named by the config."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from dpkfc_med.data import DataValidationError, load_segmentation_folder
from tests.data.test_modality_files import _volumes, _write

CHANNELS = ["t1c", "flair"]


def _brats(root: Path, sep: str = "_", cases: tuple[str, ...] = ("BraTS_001", "BraTS_002")) -> Path:
    """``<case>/<case>{sep}flair.nii.gz``, ``...t1c...``, ``...seg...`` (written in name order)."""
    for i, cid in enumerate(cases):
        image, label = _volumes(i)
        _write(root / cid / f"{cid}{sep}flair.nii.gz", image[..., 1])
        _write(root / cid / f"{cid}{sep}t1c.nii.gz", image[..., 0])
        _write(root / cid / f"{cid}{sep}seg.nii.gz", label)
    return root


@pytest.mark.parametrize("sep", ["_", "-"])  # BraTS 2021 and 2023 names
def test_channels_come_in_the_configured_order(tmp_path, sep):
    cases = load_segmentation_folder(_brats(tmp_path / "d", sep), channels=CHANNELS)
    assert cases.case_ids == ["BraTS_001", "BraTS_002"] and cases.source == "case folders"
    case = cases["BraTS_002"]
    assert [p.name for p in case.image_files] == [f"BraTS_002{sep}t1c.nii.gz",
                                                  f"BraTS_002{sep}flair.nii.gz"]  # fmt: skip
    image, label = cases.load_case("BraTS_002")
    expected, expected_label = _volumes(1)
    np.testing.assert_array_equal(image, expected)  # t1c first, as data.channels says
    np.testing.assert_array_equal(label, expected_label)
    flipped = load_segmentation_folder(tmp_path / "d", channels=CHANNELS[::-1])
    np.testing.assert_array_equal(flipped.load_case("BraTS_002")[0], expected[..., ::-1])


def test_without_channels_the_suffixes_found_are_suggested(tmp_path):
    with pytest.raises(DataValidationError) as err:
        load_segmentation_folder(_brats(tmp_path / "d"))
    text = str(err.value)
    assert "data.channels" in text and "['flair', 't1c']" in text and "BraTS_001" in text


def test_a_missing_modality_or_label_names_the_case(tmp_path):
    root = _brats(tmp_path / "d", cases=("a1", "a2", "a3"))
    (root / "a2" / "a2_flair.nii.gz").unlink()
    (root / "a3" / "a3_seg.nii.gz").unlink()
    with pytest.raises(DataValidationError) as err:
        load_segmentation_folder(root, channels=CHANNELS)
    text = str(err.value)
    assert "case a2: no file for channel(s) ['flair']" in text and "['t1c']" in text
    assert "case a3: no label a3_seg.nii.gz" in text and "case a1" not in text
    with pytest.warns(UserWarning, match="case a3: no label"):
        kept = load_segmentation_folder(root, channels=["t1c"], on_unpaired="warn")
    assert kept.case_ids == ["a1", "a2"] and kept.dropped


def test_data_channels_must_agree_with_a_declared_count(tmp_path):
    from tests.data.test_modality_files import _index, _per_file

    root = _per_file(tmp_path / "d")
    _index(root, {"0": "T1", "1": "T2"})
    with pytest.raises(DataValidationError, match="data.channels lists 3 channel"):
        load_segmentation_folder(root, channels=["a", "b", "c"])
    (root / "dataset.json").unlink()
    with pytest.raises(DataValidationError, match="but data.channels declares 3 modalities"):
        load_segmentation_folder(root, channels=["a", "b", "c"])
    assert [c.channels for c in load_segmentation_folder(root, channels=["a", "b"])] == [2] * 3


def test_a_brats_folder_trains_from_the_cli(tmp_path, capsys):
    from dpkfc_med.cli import main
    from tests.training.test_segmentation import CONFIG, TINY, _sets

    root = _brats(tmp_path / "d", cases=tuple(f"BraTS_{i:03d}" for i in range(10)))
    out = tmp_path / "run"
    sets = [*TINY, "data.num_classes=3", "data.split_fractions=[0.5,0.25,0.25]",
            "data.patch_size=[8,8,8]", "pretrain.steps=2", "data.channels=[t1c,flair]"]  # fmt: skip
    assert main(["train", str(CONFIG), "--out", str(out), "--data", str(root), *_sets(sets)]) == 0
    saved = torch.load(out / "model.pt", weights_only=False)
    assert saved["task"]["in_channels"] == 2
    assert main(["evaluate", str(out), "--split", "test"]) == 0
    bad = [*sets[:-1], "data.channels=[t1c,t1c]"]
    capsys.readouterr()
    args = ["train", str(CONFIG), "--out", str(tmp_path / "r2"), "--data", str(root)]
    assert main([*args, *_sets(bad)]) == 2
    assert (
        "--set data.channels=[t1c,t1c]: list each input channel's name once"
        in capsys.readouterr().err
    )


def test_case_ids_pick_case_folders_and_name_the_unknown(tmp_path):
    root = _brats(tmp_path / "d", cases=("a1", "a2", "a3"))
    assert load_segmentation_folder(root, channels=CHANNELS, case_ids=["a3"]).case_ids == ["a3"]
    with pytest.raises(DataValidationError, match="case zz: requested in case_ids"):
        load_segmentation_folder(root, channels=CHANNELS, case_ids=["a1", "zz"])
