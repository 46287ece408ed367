"""From the command line: a 3-case folder trains on its own split file, the shipped 2D config
runs on a folder of 2D images with ``--set data.slices=null``, and a folder of 2D images under
a slicing config is refused with one message, not one per case."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dpkfc_med.cli import main
from dpkfc_med.training.config import ConfigError, load_config
from tests.training.test_segmentation import CONFIG, HIPPO, TINY, _sets
from tests.training.test_segmentation_2d import CONFIG as CONFIG_2D
from tests.training.test_segmentation_2d import TINY as TINY_2D
from tests.training.test_segmentation_2d import nifti_2d_folder

# all three in the training split of the keyed hash at seed 0: only the split file fills val/test
THREE = ["hippocampus_001", "hippocampus_004", "hippocampus_006"]


def _small_folder(root: Path, ids: list[str]) -> Path:
    for sub in ("imagesTr", "labelsTr"):
        (root / sub).mkdir(parents=True)
        for cid in ids:
            (root / sub / f"{cid}.nii.gz").symlink_to(HIPPO / sub / f"{cid}.nii.gz")
    return root


def test_three_case_folder_trains_on_its_split_file(tmp_path):
    assert (HIPPO / "imagesTr").is_dir(), f"no msd_hippocampus data at {HIPPO}"
    data = _small_folder(tmp_path / "data", [*THREE, "hippocampus_007"])
    split = {"train": [THREE[0]], "val": [THREE[1]], "test": [THREE[2]]}
    (data / "my_split.json").write_text(json.dumps(split), encoding="utf-8")
    run = tmp_path / "run"
    sets = [*TINY, "data.num_classes=3", "data.split_file=my_split.json"]  # in the data folder
    args = ["train", str(CONFIG), "--data", str(data), "--out", str(run), "--method", "dp-sgd"]
    assert main([*args, *_sets(sets)]) == 0
    private = run / "private_not_for_release"
    assert json.loads((private / "split.json").read_text(encoding="utf-8")) == split
    report = json.loads((run / "privacy_report.json").read_text(encoding="utf-8"))
    assert report["data"]["num_train_units"] == 1
    custodian = json.loads((private / "custodian_report.json").read_text(encoding="utf-8"))
    record = {**report["data"], **custodian["data"]}
    assert record["left_out"] == 1  # hippocampus_007, not listed
    assert "listed in data.split_file" in record["split_rule"]
    assert "my_split" not in json.dumps(report)  # the file's path stays with the custodian
    metrics = json.loads((private / "metrics.json").read_text(encoding="utf-8"))
    assert 0.0 <= metrics["test"]["mean_dice"] <= 1.0


def test_a_split_file_naming_a_missing_case_is_refused_naming_it(tmp_path, capsys):
    data = _small_folder(tmp_path / "data", THREE)
    bad = {"train": [THREE[0], "hippocampus_999"], "val": [THREE[1]]}
    (tmp_path / "split.json").write_text(json.dumps(bad), encoding="utf-8")
    run = tmp_path / "run"
    sets = [*TINY, "data.num_classes=3", f"data.split_file={tmp_path / 'split.json'}"]
    code = main(["train", str(CONFIG), "--data", str(data), "--out", str(run), *_sets(sets)])
    err = capsys.readouterr().err
    assert code == 2 and "case(s) not in the data folder: hippocampus_999" in err, err
    assert not run.exists()


def test_set_null_clears_the_slices_section():
    cfg = load_config(CONFIG_2D, ["data.slices=null"])
    assert cfg.data.slices.axis is None and cfg.data.slices.per_unit == 8
    cfg = load_config(CONFIG_2D, ["data.slices=null", "data.slices.axis=1"])
    assert cfg.data.slices.axis == 1
    with pytest.raises(ConfigError, match="privacy=null: must be a mapping"):
        load_config(CONFIG_2D, ["privacy=null"])  # a required section is not optional


def test_2d_config_on_2d_images_one_message_then_set_null_trains(tmp_path, capsys):
    folder = nifti_2d_folder(tmp_path / "images", n=25)
    run = tmp_path / "run"
    base = ["train", str(CONFIG_2D), "--data", str(folder), "--out", str(run)]
    sets = [*TINY_2D, "data.patch_size=[16,16]", "data.split_fractions=[0.5,0.25,0.25]"]
    assert main([*base, *_sets(sets)]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "data.slices cuts 3-D volumes" in line]
    assert len(lines) == 1, err
    assert "cases do not fit the run" in lines[0] and "--set data.slices=null" in lines[0]
    assert not run.exists()
    assert main([*base, *_sets([*sets, "data.slices=null"])]) == 0
    report = json.loads((run / "privacy_report.json").read_text(encoding="utf-8"))
    assert report["data"]["spatial_dims"] == 2 and "slices" not in report["data"]
