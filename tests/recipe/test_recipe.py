"""training.recipe: auto: the rule's choices from public facts, what the user set wins, and the
rule reads no private data (two datasets differing only in images, labels and volume shapes
get the same recipe)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from dpkfc_med.recipe import BY_RULE, SET_BY_YOU, PublicFacts, choose
from dpkfc_med.recipe.rule import epochs_for, expected_batch
from dpkfc_med.training.config import config_from_dict

HIPPO = PublicFacts(
    epsilon=8.0, n_units=154, kind="segmentation", spatial_dims=3, from_volumes=False,
    patch_voxels=32 * 48 * 32, in_channels=1, num_classes=3, n_params=29_231,
    public_weights=False,
)  # fmt: skip
PNEUMONIA = PublicFacts(
    epsilon=1.0, n_units=4708, kind="classification", spatial_dims=2, from_volumes=False,
    patch_voxels=28 * 28, in_channels=1, num_classes=2, n_params=25_746, public_weights=False,
)  # fmt: skip


def _by_field(facts: PublicFacts) -> dict[str, object]:
    return {c.field: c.value for c in choose(facts)}


def test_hippocampus_gets_the_tuned_recipe_with_about_200_steps():
    got = _by_field(HIPPO)
    assert got["training.batch_size"] == 64  # 42 % of 154 in multiples of 8
    steps_per_epoch = math.ceil(154 / 64)
    assert got["training.epochs"] == math.ceil(200 / steps_per_epoch) == 67
    assert (got["method"], got["training.optimizer"], got["training.lr"]) == (
        "dp-kfc",
        "adam",
        0.01,
    )
    assert got["privacy.max_grad_norm"] == 0.125
    assert got["data.patches_per_unit"] == 2 and got["pretrain.steps"] == 1000
    assert (got["preconditioner.factors"], got["preconditioner.damping_a"]) == ("ag", 1.0)
    assert got["preconditioner.scaling"] == "per_layer_raw"


def test_slices_of_volumes_get_the_voxels_of_3d_crops_per_unit_and_in_pretraining():
    slices = PublicFacts(**{**HIPPO.to_dict(), "spatial_dims": 2, "from_volumes": True,
                            "patch_voxels": 44 * 56, "n_params": 9_791})  # fmt: skip
    got = _by_field(slices)
    # two crops of 32x48x32 hold 98,304 voxels: 39.9 slices of 44x56
    assert got["data.slices.per_unit"] == 40 and "data.patches_per_unit" not in got
    ct = PublicFacts(**{**slices.to_dict(), "patch_voxels": 512 * 512})
    assert _by_field(ct)["data.slices.per_unit"] == 8  # never below 8: the cost stays bounded
    tiny = PublicFacts(**{**slices.to_dict(), "patch_voxels": 16 * 16})
    assert _by_field(tiny)["data.slices.per_unit"] == 64
    # 8 volumes of 32x48x32 hold 393,216 voxels: 159.6 slices of 44x56, 152 in multiples of 8
    assert got["pretrain.batch_size"] == 152 and got["pretrain.steps"] == 1000
    assert 152 * 44 * 56 <= 8 * 32 * 48 * 32 < 160 * 44 * 56
    assert _by_field(HIPPO)["pretrain.batch_size"] == 8  # the tuned 3D recipe's own batch
    big = PublicFacts(**{**HIPPO.to_dict(), "patch_voxels": 96**3})
    assert _by_field(big)["pretrain.batch_size"] == 8  # never below 8


def test_binary_classification_at_epsilon_1_gets_dp_sgd_and_no_pretraining():
    got = _by_field(PNEUMONIA)
    assert got["method"] == "dp-sgd"
    assert got["training.batch_size"] == 256 and got["training.epochs"] == 11  # 19 steps/epoch
    assert (got["training.optimizer"], got["training.lr"], got["privacy.max_grad_norm"]) == (
        "sgd", 0.2, 1.0)  # fmt: skip
    assert got["pretrain.steps"] == 0
    assert not any(f.startswith("preconditioner.") for f in got)  # DP-SGD has none
    at_8 = _by_field(PublicFacts(**{**PNEUMONIA.to_dict(), "epsilon": 8.0}))
    assert at_8["method"] == "dp-kfc" and at_8["preconditioner.factors"] == "a"


def test_lr_falls_as_the_fourth_root_of_the_parameter_count():
    for factor in (16, 81):
        got = _by_field(PublicFacts(**{**HIPPO.to_dict(), "n_params": 30_000 * factor}))
        assert got["training.lr"] == pytest.approx(0.01 / factor**0.25, rel=0.05)
    big = _by_field(PublicFacts(**{**HIPPO.to_dict(), "n_params": 10**9}))
    assert big["training.lr"] == 1e-3  # the floor


@pytest.mark.parametrize(
    ("n", "batch"), [(1, 1), (5, 5), (8, 8), (20, 8), (154, 64), (600, 256), (10_000, 256)]
)
def test_batch_and_epochs_give_about_200_steps(n, batch):
    b = expected_batch(n)
    assert b == batch  # 42 % of n in multiples of 8, at least 8 (or all n), at most 256
    steps = epochs_for(n, b) * math.ceil(n / b)
    assert 200 <= steps < 200 + math.ceil(n / b)


def test_public_weights_turn_pretraining_off_and_fine_tune_every_layer():
    got = _by_field(PublicFacts(**{**HIPPO.to_dict(), "epsilon": 1.0, "public_weights": True}))
    assert got["pretrain.steps"] == 0 and got["training.finetune"] == "full"
    assert got["method"] == "dp-kfc" and got["preconditioner.damping_a"] == 10.0


def _volumes(root: Path, seed: int, n: int = 8) -> Path:
    """``n`` NIfTI cases with their own random images, labels and volume shapes."""
    import nibabel as nib

    rng = np.random.default_rng(seed)
    for sub in ("imagesTr", "labelsTr"):
        (root / sub).mkdir(parents=True)
    for i in range(n):
        shape = tuple(int(s) for s in rng.integers(14, 22, size=3))
        image = rng.normal(size=shape).astype(np.float32)
        label = (rng.random(shape) < rng.uniform(0.1, 0.4)).astype(np.uint8) * rng.integers(1, 3)
        nib.save(nib.Nifti1Image(image, np.eye(4)), root / "imagesTr" / f"case_{i:03d}.nii.gz")
        nib.save(nib.Nifti1Image(label.astype(np.uint8), np.eye(4)),
                 root / "labelsTr" / f"case_{i:03d}.nii.gz")  # fmt: skip
    return root


def _resolved(folder: Path, extra: dict | None = None):
    from dpkfc_med.tasks.build import build_task
    from dpkfc_med.training.setup import build_run_model, recipe_before_task, resolve_recipe

    raw = {
        "data": {"task": "segmentation", "path": str(folder), "patch_size": [16, 16, 16],
                 "num_classes": 3, "spacing": [1.0, 1.0, 1.0],
                 "split_fractions": [0.75, 0.25, 0.0]},
        "model": {"name": "unet", "kwargs": {"channels": [4, 8], "strides": [2]}},
        "privacy": {"target_epsilon": 3.0},
        "training": {"recipe": "auto", "progress": False, **(extra or {})},
    }  # fmt: skip
    cfg = recipe_before_task(config_from_dict(raw))
    task = build_task(cfg, public_probes=False)
    model, _ = build_run_model(cfg, task)
    return resolve_recipe(cfg, task, model, len(task.train_set))


def test_the_rule_reads_no_private_data(tmp_path):
    a = _resolved(_volumes(tmp_path / "a", seed=1))
    b = _resolved(_volumes(tmp_path / "b", seed=2))
    assert a.recipe_rows == b.recipe_rows
    settings = ("privacy", "training", "pretrain", "probes", "preconditioner", "method")
    assert {k: a.to_dict()[k] for k in settings} == {k: b.to_dict()[k] for k in settings}
    rows = {r["field"]: r for r in a.recipe_rows}
    assert rows["training.batch_size"]["origin"] == BY_RULE
    assert a.training.batch_size == rows["training.batch_size"]["value"] == 6  # all 6 units


def test_what_you_set_wins_and_manual_changes_nothing(tmp_path):
    folder = _volumes(tmp_path / "a", seed=1)
    cfg = _resolved(folder, {"lr": 0.05, "epochs": 3})
    rows = {r["field"]: r for r in cfg.recipe_rows}
    assert (cfg.training.lr, rows["training.lr"]["origin"]) == (0.05, SET_BY_YOU)
    assert (cfg.training.epochs, rows["training.epochs"]["origin"]) == (3, SET_BY_YOU)
    assert rows["training.optimizer"]["origin"] == BY_RULE and cfg.training.optimizer == "adam"
    manual = config_from_dict({"data": {"task": "segmentation", "path": str(folder)}})
    from dpkfc_med.recipe import recipe_after_task, recipe_before_task

    assert recipe_before_task(manual) is manual
    assert recipe_after_task(manual, HIPPO) is manual


def test_a_resumed_run_reports_the_rule_s_fields_as_chosen(tmp_path):
    """The stored config holds every value; recipe_chosen keeps their origin for a resume."""
    import yaml

    from dpkfc_med.training.config import load_config

    first = _resolved(_volumes(tmp_path / "a", seed=1), {"lr": 0.05})
    stored = tmp_path / "config.yaml"
    stored.write_text(yaml.safe_dump(first.to_dict()), encoding="utf-8")
    again = load_config(stored)
    assert set(again.training.recipe_chosen) == {
        r["field"] for r in first.recipe_rows if r["origin"] == BY_RULE
    }
    from dpkfc_med.recipe import recipe_after_task, recipe_before_task

    facts_rows = recipe_after_task(recipe_before_task(again), HIPPO).recipe_rows
    origins = {r["field"]: r["origin"] for r in facts_rows}
    assert origins["training.lr"] == SET_BY_YOU and origins["training.optimizer"] == BY_RULE
    assert again.training.batch_size == first.training.batch_size  # values as stored


def test_a_bundle_gets_the_rule_unless_it_or_you_ask_for_its_own():
    """bundle train: recipe auto by default (the bundle's optimizer, lr, batch and epochs left to
    the rule), --recipe bundle or private_training#training#recipe: bundle keeps them."""
    from dpkfc_med.bundle.zoo import prepare_bundle
    from dpkfc_med.data.paths import resolve_data_path

    root = Path(__file__).resolve().parents[2]
    bundle = root / "tests" / "bundle" / "zoo_bundle"
    overrides = [f"dataset_dir={resolve_data_path('msd_hippocampus', kind='dir')}", "num_train=4"]
    auto = prepare_bundle(bundle, epsilon=8, overrides=overrides)
    assert auto.cfg.training.recipe == "auto" and "method" not in auto.cfg.set_by_user
    assert not {"training.epochs", "training.lr", "training.batch_size"} & set(auto.cfg.set_by_user)
    own = prepare_bundle(bundle, epsilon=8, overrides=overrides, recipe="bundle")
    assert own.cfg.training.recipe == "manual"
    assert (own.cfg.training.lr, own.cfg.training.batch_size, own.cfg.training.epochs) == (
        0.001, 2, 2)  # fmt: skip
    pipeline = prepare_bundle(root / "pipelines" / "segmentation_3d", epsilon=8)
    assert pipeline.cfg.training.recipe == "manual" and pipeline.cfg.training.epochs == 40
    assert prepare_bundle(root / "pipelines" / "segmentation_3d", epsilon=8,
                          recipe="auto").cfg.training.recipe == "auto"  # fmt: skip


def test_a_2d_slices_config_gets_the_patch_size_rule_and_an_empty_section_sets_nothing():
    """The slices per patient come from the configured in-plane patch before the task is built,
    and ``pretrain: {}`` (a section emptied of its recipe fields) leaves pretraining to the rule."""
    from dpkfc_med.recipe import recipe_before_task
    from dpkfc_med.training.config_build import leaf_paths

    assert leaf_paths({"pretrain": {}, "data": {"slices": None, "x": {"y": 1}}}) == [
        "data.slices", "data.x.y"]  # fmt: skip
    cfg = config_from_dict({
        "name": "s", "method": "dp-kfc", "pretrain": {},
        "data": {"task": "segmentation", "path": "msd_hippocampus", "num_classes": 3,
                 "patch_size": [44, 56], "spacing": [1.0, 1.0], "slices": {"axis": 2}},
        "model": {"name": "unet"}, "training": {"recipe": "auto"},
    })  # fmt: skip
    assert "pretrain.steps" not in cfg.set_by_user and "pretrain" not in cfg.set_by_user
    assert recipe_before_task(cfg).data.slices.per_unit == 40  # 98,304 / (44 x 56)
