"""The pipeline bundles: Model Zoo bundles of the shipped run configs, trained privately.

Each ``pipelines/NAME/configs/train.json`` has its own ``network_def``, transforms, loss,
optimizer, data lists, trainer and evaluator, plus a ``private_training`` section; prepared for
the engine it must be the shipped run config it mirrors (mechanism, recipe, network, split).
"""

from __future__ import annotations

import json

import pytest

from dpkfc_med.bundle.zoo import BundleConfigError, prepare_bundle, train_bundle
from dpkfc_med.cli import main
from dpkfc_med.privacy.accounting import PrivacyLedger
from dpkfc_med.training.config import ConfigError, load_config
from tests.bundle.conftest import CONFIGS, PIPELINES

SEG_IDS = [
    "train#dataset#data=$@datalists['train'][:6]",
    "validate#dataset#data=$@datalists['val'][:1]",
    "test#dataset#data=$@datalists['test'][:2]",
    "patch_size=[16,16,16]",
    "_meta_#network_data_format#inputs#image#spatial_shape=[16,16,16]",
    "network_def#channels=[4,8]",
    "network_def#strides=[2]",
    "train#trainer#max_epochs=1",
    "train#dataloader#batch_size=3",
]
SEG_SETTINGS = [
    "pretrain.steps=0",
    "training.progress=false",
    "training.eval_every=1",
    "probes.num_probes=4",
    "preconditioner.chunk_size=4",
    "preconditioner.calibration_samples=2",
]
SAME = {
    "privacy": ("target_epsilon", "max_grad_norm", "accountant", "delta"),
    "training": ("epochs", "batch_size", "optimizer", "lr", "momentum", "weight_decay",
                 "eval_every", "eval_batch_size", "seed", "select_epoch"),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_pipeline_bundle_is_its_run_config_in_the_model_zoo_layout(name):
    from dpkfc_med.tasks.build import build_task
    from dpkfc_med.training.setup import build_run_model

    bundle = prepare_bundle(PIPELINES / name)
    cfg = load_config(CONFIGS[name])
    got, want = bundle.cfg.to_dict(), cfg.to_dict()
    assert got["method"] == want["method"]
    for section, keys in SAME.items():
        for key in keys:
            assert got[section][key] == want[section][key], f"{section}.{key}"
    for section in ("probes", "preconditioner", "pretrain", "clipping"):
        assert got.get(section) == want.get(section), section
    for key in ("modality", "source"):
        assert got["data"][key] == want["data"][key]
    # the same cases in each split (the keyed hash of each case id), the same network
    task = build_task(cfg, public_probes=False)
    assert bundle.task.data_record["splits"] == {
        k: task.data_record["splits"][k] for k in ("train", "val", "test")
    }
    assert bundle.task.spatial_shape == task.spatial_shape
    if task.kind == "segmentation":
        ids = {k: [d["case_id"] for d in bundle.parser.get_parsed_content("datalists")[k]]
               for k in ("train", "val", "test")}  # fmt: skip
        assert ids == {k: list(v.case_ids) for k, v in task.extra["splits"].items() if k in ids}
    model, _ = build_run_model(cfg, task, finetune=False)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in bundle.network.state_dict().items()} == shapes


@pytest.fixture(scope="module")
def seg_bundle_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline_seg") / "run"
    train_bundle(
        PIPELINES / "segmentation_3d",
        out=out,
        overrides=SEG_IDS,
        settings=SEG_SETTINGS,
        recipe="bundle",
    )
    return out


def test_segmentation_bundle_trains_privately_and_evaluates_its_test_list(seg_bundle_run, capsys):
    run = seg_bundle_run
    report = json.loads((run / "privacy_report.json").read_text(encoding="utf-8"))
    p = report["privacy"]
    assert report["status"] == "complete" and p["method"] == "dp-kfc"
    assert p["target_epsilon"] == 8.0 and p["max_grad_norm"] == 0.125  # private_training
    ledger = PrivacyLedger.load(run / "ledger.json")
    assert ledger.steps == p["steps"] > 0 and ledger.epsilon() <= 8.0
    metrics = json.loads(
        (run / "private_not_for_release" / "metrics.json").read_text(encoding="utf-8")
    )
    assert 0.0 <= metrics["val"]["val_mean_dice"] <= 1.0
    assert metrics["test"]["n"] == 2 and 0.0 <= metrics["test"]["test_mean_dice"] <= 1.0
    # `dpkfc-med evaluate` reads a bundle run: the bundle's evaluator on its test list
    assert main(["evaluate", str(run), "--split", "test"]) == 0
    out = json.loads(
        (run / "private_not_for_release" / "evaluations" / "bundle_test.json").read_text(
            encoding="utf-8"
        )
    )
    assert out["test_mean_dice"] == pytest.approx(metrics["test"]["test_mean_dice"])
    assert out["overlap_with_training"]["shared"] == 0 and out["not_dp"] is False
    capsys.readouterr()
    assert main(["evaluate", str(run), "--split", "train"]) != 0
    assert "--split train: the bundle has no train" in capsys.readouterr().err


def test_bundle_training_refuses_to_overwrite_a_run(seg_bundle_run):
    # the guard of `dpkfc-med train --out`: a second run would spend the budget twice
    with pytest.raises(ConfigError, match="already holds a run"):
        train_bundle(
            PIPELINES / "segmentation_3d",
            out=seg_bundle_run,
            overrides=SEG_IDS,
            settings=SEG_SETTINGS,
        )


def test_private_training_cannot_set_what_the_components_give(tmp_path):
    import shutil

    bundle = tmp_path / "b"
    shutil.copytree(PIPELINES / "segmentation_3d", bundle)
    train = bundle / "configs" / "train.json"
    config = json.loads(train.read_text(encoding="utf-8"))
    config["private_training"]["model"] = {"name": "unet"}
    config["private_training"]["data"]["path"] = "/elsewhere"
    del config["private_training"]["privacy"]["target_epsilon"]
    train.write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(BundleConfigError) as err:
        prepare_bundle(bundle, epsilon=8)
    assert "private_training#model" in str(err.value)
    assert "private_training#data#path" in str(err.value)
    del config["private_training"]["model"], config["private_training"]["data"]["path"]
    train.write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(BundleConfigError, match="no target epsilon: pass --epsilon"):
        prepare_bundle(bundle)
    assert prepare_bundle(bundle, epsilon=3).cfg.privacy.target_epsilon == 3.0


def test_bad_settings_are_reported_like_the_cli(tmp_path):
    with pytest.raises(ConfigError, match="training.epochs=-1: must be a positive number"):
        train_bundle(
            PIPELINES / "segmentation_3d",
            out=tmp_path / "r",
            overrides=SEG_IDS,
            settings=[*SEG_SETTINGS, "training.epochs=-1"],
        )
    assert not (tmp_path / "r").exists()


def test_medmnist_datalists_keep_images_as_read_and_refuse_multilabel_files(tmp_path):
    import numpy as np

    from dpkfc_med.bundle.datalists import medmnist_datalists

    rng = np.random.default_rng(0)
    arrays = {}
    for split, n in (("train", 6), ("val", 2), ("test", 3)):
        arrays[f"{split}_images"] = rng.integers(0, 256, (n, 5, 5), dtype=np.uint8)
        arrays[f"{split}_labels"] = rng.integers(0, 2, (n, 1))
    np.savez(tmp_path / "two.npz", **arrays)
    lists = medmnist_datalists(tmp_path / "two.npz", num_classes=2)
    assert {k: len(v) for k, v in lists.items()} == {"train": 6, "val": 2, "test": 3}
    first = lists["test"][0]
    np.testing.assert_allclose(first["image"][0], arrays["test_images"][0] / 255.0, rtol=1e-6)
    assert first["label"] == int(arrays["test_labels"][0, 0])
    for split, n in (("train", 6), ("val", 2), ("test", 3)):
        arrays[f"{split}_labels"] = rng.integers(0, 2, (n, 3))
    np.savez(tmp_path / "multi.npz", **arrays)
    with pytest.raises(ValueError, match="multi-label"):
        medmnist_datalists(tmp_path / "multi.npz", num_classes=3)
