"""A user's own split (``data.split_file``) and small folders whose keyed-hash split is empty:
the file's formats and mistakes, fractions that fill every split, and a refused DICOM run that
leaves no run folder (no ``dicom_cache``) behind."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from dpkfc_med.data import (
    DataValidationError,
    deterministic_split,
    fractions_that_fill,
    read_split_file,
)

IDS = ["a", "b", "c", "d"]


def _write(path: Path, data: object) -> Path:
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def test_simple_split_file_names_the_cases_and_leaves_unlisted_ones_out(tmp_path):
    path = _write(tmp_path / "split.json", {"train": ["c", "a"], "val": ["b"]})
    split, left_out = read_split_file(path, IDS)
    assert split == {"train": ["a", "c"], "val": ["b"], "test": []}
    assert left_out == ["d"]


def test_nnunet_folds_pick_data_split_fold_with_an_empty_or_given_test(tmp_path):
    folds = [
        {"train": ["a", "b"], "val": ["c"]},
        {"train": ["b", "c"], "val": ["a"], "test": ["d"]},
    ]
    path = _write(tmp_path / "splits_final.json", folds)
    assert read_split_file(path, IDS) == ({"train": ["a", "b"], "val": ["c"], "test": []}, ["d"])
    assert read_split_file(path, IDS, fold=1) == (
        {"train": ["b", "c"], "val": ["a"], "test": ["d"]},
        [],
    )
    with pytest.raises(DataValidationError, match=r"data.split_fold=2: the file has 2 fold\(s\)"):
        read_split_file(path, IDS, fold=2)


def test_split_file_mistakes_are_named_all_at_once(tmp_path):
    path = _write(
        tmp_path / "split.json",
        {"train": ["a", "b", "zz"], "val": ["b"], "tset": ["c"]},
    )
    with pytest.raises(DataValidationError) as err:
        read_split_file(path, IDS)
    text = str(err.value)
    assert str(path) in text
    assert "unknown split 'tset' (did you mean 'test'?)" in text
    assert "case b is listed 2 times (train, val)" in text
    assert "case(s) not in the data folder: zz" in text
    with pytest.raises(DataValidationError, match="a JSON str; expected"):
        read_split_file(_write(tmp_path / "bad.json", "train"), IDS)
    with pytest.raises(DataValidationError, match="no case in 'train'"):
        read_split_file(_write(tmp_path / "empty.json", {"val": ["a"]}), IDS)


def test_fractions_that_fill_fill_every_split_of_a_small_folder():
    ids = ["hippocampus_001", "hippocampus_004", "hippocampus_006"]  # all in train at seed 0
    with pytest.raises(ValueError, match="drew none of the 3 cases") as err:
        deterministic_split(ids, (0.7, 0.15, 0.15), seed=0)
    found = fractions_that_fill(ids, (0.7, 0.15, 0.15), seed=0)
    assert found and all(str(f) in str(err.value) for f in found)
    for fractions in found:
        split = deterministic_split(ids, fractions, seed=0)
        assert all(len(v) == 1 for v in split.values()), (fractions, split)
    # a zero fraction stays zero; fewer cases than splits cannot be filled
    assert all(f[2] == 0 for f in fractions_that_fill(ids, (0.8, 0.2, 0.0)))
    assert fractions_that_fill(ids[:2], (0.7, 0.15, 0.15)) == []


def test_refused_dicom_run_names_working_fractions_and_leaves_no_folder(
    hippo_root: Path, tmp_path: Path, capsys
) -> None:
    from dpkfc_med.cli import main
    from tests.data.test_data_dicom import _dicom_dataset
    from tests.training.test_segmentation import CONFIG, TINY, _sets

    ids = ["hippocampus_001", "hippocampus_004", "hippocampus_006"]  # all in train at seed 0
    root = _dicom_dataset(hippo_root, tmp_path / "data", ids, layout="case folders")
    run = tmp_path / "runs" / "small"
    args = ["train", str(CONFIG), "--data", str(root), "--out", str(run), "--method", "dp-sgd"]
    code = main([*args, *_sets([*TINY, "data.num_classes=3"])])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "data.split_fractions=[0.7, 0.15, 0.15]" in err and "drew none of the 3 cases" in err
    assert "data.split_file" in err
    named = re.search(r"fill every split for these 3 case IDs and seed 0: (.*?); or", err)
    assert named, err
    for text in named.group(1).split(" or "):
        split = deterministic_split(ids, ast.literal_eval(text), seed=0)
        assert all(split.values()), (text, split)
    assert not (tmp_path / "runs").exists()  # no run folder, no dicom_cache
