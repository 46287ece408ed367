"""``dpkfc-med evaluate``: results are custodian-only and evaluations on training data say so."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from dpkfc_med.cli import main
from dpkfc_med.training.evaluate import TrainingDataEvaluationWarning, evaluate_run
from tests.conftest import SHARED_DATA

PNEUMONIA = Path(SHARED_DATA) / "medmnist" / "pneumoniamnist.npz"
HIPPO = Path(SHARED_DATA) / "msd_hippocampus"
SEG_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "hippocampus_unet_3d_eps8.yaml"
EVALS = Path("private_not_for_release") / "evaluations"


def _small_private(root: Path) -> dict[str, np.ndarray]:
    src = np.load(PNEUMONIA)
    arrays = {k: v[:40] if k.startswith("train") else v[:20] for k, v in src.items()}
    root.mkdir(parents=True, exist_ok=True)
    np.savez(root / "pneumoniamnist.npz", **arrays)
    return arrays


@pytest.fixture(scope="module")
def cls_run(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    root = tmp_path_factory.mktemp("cls")
    arrays = _small_private(root / "data")
    out = root / "run"
    sets = [
        f"data.path={root / 'data' / 'pneumoniamnist.npz'}",
        "method=dp-sgd",
        "training.epochs=1",
        "training.batch_size=10",
        "training.progress=false",
    ]
    config = Path(__file__).resolve().parents[2] / "configs" / "pneumoniamnist_cnn_2d_eps1.yaml"
    args = ["train", str(config), "--out", str(out)]
    assert main([*args, *[a for s in sets for a in ("--set", s)]]) == 0
    return out, arrays


def test_split_train_is_flagged_not_dp_and_written_for_the_custodian(cls_run, capsys):
    run, _ = cls_run
    capsys.readouterr()
    with pytest.warns(TrainingDataEvaluationWarning, match="--split train evaluates the run's"):
        assert main(["evaluate", str(run), "--split", "train"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["not_dp"] is True and "NOT differentially private" in printed["warning"]
    saved = json.loads((run / EVALS / "pneumoniamnist_train.json").read_text(encoding="utf-8"))
    assert saved["not_dp"] is True and saved["warning"] == printed["warning"]
    assert saved["overlap_with_training"]["shared"] == 40 == saved["n"]
    assert not (run / "evaluations").exists()


def test_held_out_split_is_not_flagged(cls_run):
    run, _ = cls_run
    out = evaluate_run(run, split="test")
    assert out["not_dp"] is False and "warning" not in out
    assert out["overlap_with_training"] == {
        "checked": True,
        "unit": "images",
        "evaluated": 20,
        "training": 40,
        "shared": 0,
        "method": "SHA-256 of each image after loading, against the run's training split",
    }
    assert "does not protect" in out["privacy_note"]
    assert (run / EVALS / "pneumoniamnist_test.json").is_file()


def test_other_file_holding_training_images_is_flagged(cls_run, tmp_path):
    run, arrays = cls_run
    other = dict(arrays)
    other["val_images"] = np.concatenate([arrays["train_images"][:5], arrays["test_images"][:10]])
    other["val_labels"] = np.concatenate([arrays["train_labels"][:5], arrays["test_labels"][:10]])
    path = tmp_path / "site_b.npz"
    np.savez(path, **other)
    with pytest.warns(TrainingDataEvaluationWarning) as record:
        out = evaluate_run(run, data=str(path), split="val")
    assert out["not_dp"] is True and out["overlap_with_training"]["shared"] == 5
    assert "5 of the 15 evaluated images are in the run's private training split" in str(
        record[0].message
    )
    assert (
        json.loads((run / EVALS / "site_b_val.json").read_text(encoding="utf-8"))["not_dp"] is True
    )


# ------------------------------------------------------------------------- segmentation
TINY = [
    "data.max_train=4",
    "data.max_eval=2",
    "data.patch_size=[16,16,16]",
    "data.spacing=[1.0,1.0,1.0]",
    "training.epochs=1",
    "training.batch_size=2",
    "training.eval_batch_size=16",
    "training.progress=false",
    "model.kwargs.channels=[4,8]",
    "model.kwargs.strides=[2]",
    "method=dp-sgd",
    "pretrain.steps=0",  # the shipped config's data-free pretraining plays no part here
]


def test_segmentation_cases_from_the_training_split_are_flagged(tmp_path, capsys):
    assert (HIPPO / "imagesTr").is_dir(), f"no msd_hippocampus data at {HIPPO}"
    run = tmp_path / "seg"
    sets = [a for s in TINY for a in ("--set", s)]
    assert main(["train", str(SEG_CONFIG), "--out", str(run), *sets]) == 0
    split_file = run / "private_not_for_release" / "split.json"
    split = json.loads(
        (split_file if split_file.is_file() else run / "split.json").read_text(encoding="utf-8")
    )
    other = tmp_path / "site_c"
    for sub in ("imagesTr", "labelsTr"):
        (other / sub).mkdir(parents=True)
    # two training cases (under new names: content, not ids, is compared) and one test case
    chosen = {"a_001": split["train"][0], "a_002": split["train"][1], "a_003": split["test"][0]}
    for new, cid in chosen.items():
        for sub in ("imagesTr", "labelsTr"):
            os.symlink(HIPPO / sub / f"{cid}.nii.gz", other / sub / f"{new}.nii.gz")
    with pytest.warns(TrainingDataEvaluationWarning, match="2 of the 3 evaluated cases"):
        out = evaluate_run(run, data=str(other))
    assert out["split"] == "all" and out["not_dp"] is True
    assert out["overlap_with_training"]["shared"] == 2
    assert out["overlap_with_training"]["training"] == 4
    assert (run / EVALS / "site_c_all.json").is_file()
    # the run's own held-out cases: no overlap by id or content
    held_out = evaluate_run(run, split="val")
    assert held_out["not_dp"] is False
    assert held_out["overlap_with_training"]["shared_case_ids"] == 0
