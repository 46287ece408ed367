"""``dpkfc-med bundle train``: a bundle in the MONAI Model Zoo layout trained privately.

The test bundle (``zoo_bundle/``: 3D UNet with ``norm: batch``, DiceCE, Adam,
``RandCropByPosNegLabeld(num_samples=2)``, ``CacheDataset``, ``SupervisedTrainer`` with
``ValidationHandler`` and ``StatsHandler``, ``SupervisedEvaluator`` with ``MeanDice`` and a
``CheckpointSaver``) runs on the bundled hippocampus cases.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from dpkfc_med.cli import main
from dpkfc_med.data import resolve_data_path
from tests.bundle.conftest import bundle_train

BUNDLE = Path(__file__).parent / "zoo_bundle"
C = 0.5


@pytest.fixture(scope="module")
def data_dir() -> str:
    return str(resolve_data_path("msd_hippocampus", kind="dir"))


@pytest.fixture
def bundle(tmp_path) -> Path:
    """A copy (the non-private MONAI run writes its CheckpointSaver's model into it)."""
    out = tmp_path / "bundle"
    shutil.copytree(BUNDLE, out)
    return out


def _overrides(data_dir: str, num_train: int = 6, epochs: int = 1) -> list[str]:
    return [f"dataset_dir={data_dir}", f"num_train={num_train}",
            f"train#trainer#max_epochs={epochs}"]  # fmt: skip


def test_bundle_trains_privately_to_its_target_with_the_yaml_mechanism(
    bundle, data_dir, tmp_path, capsys
):
    """CLI run: complete, within target, the plan of the equivalent YAML config, export works."""
    from dpkfc_med.training.config import config_from_dict
    from dpkfc_med.training.opening import plan_privacy

    out = tmp_path / "run"
    bundle_train(bundle, out, _overrides(data_dir, epochs=1))
    report = json.loads((out / "privacy_report.json").read_text(encoding="utf-8"))
    p = report["privacy"]
    assert report["status"] == "complete"
    assert 7.0 < p["epsilon"]["prv"] <= 8.0
    # The same mechanism as a YAML config with the bundle's batch size and epochs.
    yaml_cfg = config_from_dict(
        {"method": "dp-kfc", "privacy": {"target_epsilon": 8.0},
         "training": {"epochs": 1, "batch_size": 2},
         "data": {"task": "segmentation", "path": data_dir}}
    )  # fmt: skip
    plan = plan_privacy(yaml_cfg, 6, 3)
    assert p["sample_rate"] == pytest.approx(plan.sample_rate)
    assert p["noise_multiplier"] == pytest.approx(plan.noise_multiplier)
    assert p["planned_steps"] == plan.planned_steps == p["steps"] == 3
    assert p["delta"] == plan.delta
    # BatchNorm fixed and listed; the loader, the validation handler and the checkpoint
    # keyed on a metric replaced, and said so.
    assert any("BatchNorm" in f["before"] for f in report["model"]["fixes"])
    replaced = " ".join(report["data"]["bundle"]["replaced"])
    for word in ("train#dataloader#shuffle", "ValidationHandler", "CheckpointSaver"):
        assert word in replaced
    assert any("StatsHandler" in item for item in p["not_covered"])
    shown = (out / "privacy_report.md").read_text(encoding="utf-8")
    assert "### MONAI bundle" in shown and "(CheckpointSaver): replaced" in shown
    metrics = json.loads(
        (out / "private_not_for_release" / "metrics.json").read_text(encoding="utf-8")
    )
    assert 0.0 <= metrics["val"]["val_mean_dice"] <= 1.0
    # the bundle's own CheckpointSaver (keyed on validation Dice) never ran
    assert not (bundle / "models" / "model.pt").exists()
    assert main(["bundle", "export", str(out), str(tmp_path / "exported")]) == 0
    meta = json.loads(
        (tmp_path / "exported" / "configs" / "metadata.json").read_text(encoding="utf-8")
    )
    spent = meta["differential_privacy"]["epsilon_spent"]
    assert spent["prv"] == pytest.approx(p["epsilon"]["prv"])


def test_each_unit_with_both_crops_moves_the_clipped_sum_by_at_most_c(data_dir):
    """Brute force: removing one item (2 random crops) changes the clipped sum by <= C."""
    from torch.utils.data import DataLoader

    from dpkfc_med.bundle.zoo import prepare_bundle
    from dpkfc_med.privacy.engine import PrivacyEngine
    from tests.conftest import summed_clipped

    b = prepare_bundle(BUNDLE, epsilon=8, overrides=_overrides(data_dir, num_train=4))
    task = b.task
    batch = task.extra["collate"]([task.train_set[i] for i in range(4)])
    x, y, units = task.unpack(batch)
    assert units.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]  # two crops per item, one unit
    x = x * 20  # large gradients: every unit is clipped
    for method in ("dp-sgd", "dp-kfc"):
        torch.manual_seed(0)
        net = b.network
        pm, popt, _ = PrivacyEngine(seed=1).make_private(
            module=net,
            optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
            data_loader=DataLoader(task.train_set, batch_size=2, collate_fn=task.extra["collate"]),
            noise_multiplier=1.0,
            max_grad_norm=C,
            delta=1e-5,
            method=method,
            probe_source=task.probe_source(b.cfg) if method == "dp-kfc" else None,
            probe_loss=task.probe_loss if method == "dp-kfc" else None,
            preconditioner=b.cfg.preconditioner_config() if method == "dp-kfc" else None,
            backward_reduction="sum",
        )

        def backward(xs, ys, pm=pm):
            return lambda: task.per_sample_loss(pm(xs), ys).sum().backward()

        full = summed_clipped(popt, backward(x, y), units)
        for unit in range(4):
            keep = units != unit
            kept = units[keep] - (units[keep] > unit).long()
            neighbour = summed_clipped(popt, backward(x[keep], y[keep]), kept)
            assert float((full - neighbour).norm()) <= C * (1 + 1e-5), (method, unit)
        b = prepare_bundle(BUNDLE, epsilon=8, overrides=_overrides(data_dir, num_train=4))


def test_the_same_bundle_runs_non_privately_with_monai_alone(bundle, data_dir):
    """Unchanged, the bundle is an ordinary MONAI bundle (the private engine is not needed)."""
    from monai.bundle import run

    run(
        run_id="run",
        config_file=str(bundle / "configs" / "train.json"),
        meta_file=str(bundle / "configs" / "metadata.json"),
        bundle_root=str(bundle),
        dataset_dir=data_dir,
        num_train=2,
        **{"train#trainer#max_epochs": 1},
    )
    assert (bundle / "models" / "model.pt").is_file()  # its CheckpointSaver did run


def test_guarantee_breaking_settings_are_replaced_and_named_by_id(data_dir):
    from dpkfc_med.bundle.zoo import guarantee_problems, load_bundle, prepare_bundle

    b = prepare_bundle(
        BUNDLE, epsilon=8, overrides=[f"dataset_dir={data_dir}", "train#trainer#amp=true"]
    )
    assert any(r.startswith("train#trainer#amp: true: replaced") for r in b.replaced)
    assert b.cfg.training.precision == "float32"
    replaced = guarantee_problems(load_bundle(BUNDLE, [f"dataset_dir={data_dir}"]))
    assert any(r.startswith("validate#handlers#0 (CheckpointSaver)") for r in replaced)
    # the bundle's own StatsHandler stays, attached to the private trainer
    assert [type(h).__name__ for h in b.handlers] == ["StatsHandler"]


def test_items_sharing_the_unit_key_form_one_unit(data_dir):
    """--unit-key: every item of one patient id is one unit (its crops summed before clipping)."""
    from dpkfc_med.bundle.zoo import BundleConfigError, prepare_bundle

    data = (
        "$[{'image': i, 'label': l, 'patient': n // 2}"
        " for n, (i, l) in enumerate(zip(@images[:6], @labels[:6]))]"
    )
    b = prepare_bundle(
        BUNDLE, epsilon=8, unit_key="patient",
        overrides=[f"dataset_dir={data_dir}", f"train#dataset#data={data}"],
    )  # fmt: skip
    assert len(b.task.train_set) == 3
    assert b.task.data_record["splits"]["train"] == 3  # units; the 6 items stay unpublished
    batch = b.task.extra["collate"]([b.task.train_set[0]])
    assert batch["unit"].tolist() == [0, 0, 0, 0]  # 2 items x 2 crops
    with pytest.raises(BundleConfigError, match="item 0 is a str, not a dictionary"):
        prepare_bundle(BUNDLE, epsilon=8, overrides=["train#dataset#data=$['a.nii.gz']"])
    with pytest.raises(BundleConfigError, match="--unit-key 'visit'"):
        prepare_bundle(BUNDLE, epsilon=8, unit_key="visit", overrides=[f"dataset_dir={data_dir}"])


def test_monai_bundle_run_with_the_private_overlay(bundle, data_dir, tmp_path):
    """``python -m monai.bundle run`` with pipelines/private_overlay.json merged on top."""
    from monai.bundle import run

    overlay = Path(__file__).parents[2] / "pipelines" / "private_overlay.json"
    out = tmp_path / "run"
    run(
        run_id="run",
        config_file=[str(bundle / "configs" / "train.json"), str(overlay)],
        bundle_root=str(bundle),
        **{
            "dpkfc_med#out": str(out),
            "dpkfc_med#override": [*_overrides(data_dir, num_train=2), "validate#dataset#data=$[]"],
            # data-free pretraining works on a bundle's network and loss as on the registry's
            "dpkfc_med#set": [
                "training.progress=false",
                "training.eval_every=5",
                "training.epochs=2",  # recipe: auto would plan 200 noisy steps
                "pretrain.steps=2",
                "pretrain.batch_size=2",
                "pretrain.cache_dir=null",
            ],
        },
    )
    report = json.loads((out / "privacy_report.json").read_text(encoding="utf-8"))
    assert report["status"] == "complete"
    assert 7.0 < report["privacy"]["epsilon"]["prv"] <= 8.0
    assert report["training"]["pretraining"]["steps"] == 2
