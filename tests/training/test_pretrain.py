"""Data-free pretraining: synthetic shapes from the config only, deterministic, no private data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dpkfc_med.cli import main
from dpkfc_med.training.config import ConfigError, load_config
from dpkfc_med.training.pretrain import synthetic_shapes
from tests.conftest import SHARED_DATA

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "hippocampus_unet_3d_eps8.yaml"
HIPPO = Path(SHARED_DATA) / "msd_hippocampus"
TINY = [
    "data.max_eval=2",
    "data.patch_size=[16,16,16]",
    "training.epochs=1",
    "training.batch_size=3",
    "training.progress=false",
    "model.kwargs.channels=[4,8]",
    "model.kwargs.strides=[2]",
    "probes.num_probes=4",
    "preconditioner.chunk_size=4",
    "preconditioner.calibration_samples=2",
    "pretrain.steps=3",
    "pretrain.batch_size=2",
]


def _draw(seed):
    g = torch.Generator().manual_seed(seed)
    return synthetic_shapes(
        (12, 16, 10), num=6, num_classes=3, spacing=(1.0, 1.0, 2.0), alpha=2.0, generator=g
    )


def test_synthetic_shapes_are_seeded_standardised_and_ordered_by_class():
    x, y = _draw(3)
    x2, y2 = _draw(3)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(_draw(4)[1], y)
    assert x.shape == (6, 1, 12, 16, 10) and x.dtype == torch.float32
    assert y.shape == (6, 12, 16, 10) and y.dtype == torch.int64
    assert set(y.unique().tolist()) <= {0, 1, 2}
    flat = x.flatten(1)
    torch.testing.assert_close(flat.mean(1), torch.zeros(6), atol=1e-5, rtol=0)
    torch.testing.assert_close(flat.std(1), torch.ones(6), atol=1e-4, rtol=0)
    fg = (y > 0).flatten(1).double().mean(1)
    assert torch.all((fg > 0.02) & (fg < 0.27))  # the drawn foreground fraction, 3-25 %
    for i in range(6):  # class means ordered: 0, 1, 2 steps from the background, one sign
        means = [float(x[i, 0][y[i] == c].mean()) for c in range(3) if (y[i] == c).sum() > 20]
        diffs = torch.tensor(means).diff()
        assert torch.all(diffs > 0) or torch.all(diffs < 0)


def test_pretrain_refused_for_classification():
    cfg = ROOT / "configs" / "pneumoniamnist_cnn_2d_eps1.yaml"
    with pytest.raises(ConfigError, match=r"pretrain.steps=5: .*segmentation"):
        load_config(cfg, ["pretrain.steps=5"])
    with pytest.raises(ConfigError, match=r"pretrain.steps=-1"):
        load_config(CONFIG, ["pretrain.steps=-1"])


def test_pretrained_weights_do_not_depend_on_the_private_data():
    """Same config, two different private training sets: bitwise the same pretrained model."""
    assert (HIPPO / "imagesTr").is_dir(), f"no msd_hippocampus data at {HIPPO}"
    from dpkfc_med.tasks.build import build_task
    from dpkfc_med.training.pretrain import pretrain as _pretrain
    from dpkfc_med.training.setup import build_run_model
    from dpkfc_med.training.setup import seed_everything as _seed_everything

    weights = []
    for subset in (
        ["data.max_train=4"],
        ["data.max_train=7", "data.split_fractions=[0.5,0.25,0.25]"],
    ):
        cfg = load_config(CONFIG, TINY + subset)
        task = build_task(cfg)
        _seed_everything(cfg.training.seed)
        model, _ = build_run_model(cfg, task)
        before = [p.detach().clone() for p in model.parameters()]
        record = _pretrain(cfg, task, model, torch.device("cpu"))
        assert record["steps"] == 3 and "no private" in record["data"]
        weights.append([p.detach().clone() for p in model.parameters()])
        assert any(not torch.equal(a, b) for a, b in zip(before, weights[-1]))
    for a, b in zip(*weights):
        assert torch.equal(a, b)


def test_pretraining_is_recorded_in_the_report_and_validation_runs_every_k_epochs(tmp_path):
    assert (HIPPO / "imagesTr").is_dir(), f"no msd_hippocampus data at {HIPPO}"
    run = tmp_path / "pt"
    extra = ["data.max_train=5", "training.epochs=3", "training.eval_every=2"]
    sets = [a for s in TINY + extra for a in ("--set", s)]
    assert main(["train", str(CONFIG), "--out", str(run), "--method", "dp-sgd", *sets]) == 0
    report = json.loads((run / "privacy_report.json").read_text(encoding="utf-8"))
    record = report["training"]["pretraining"]
    assert (
        record["steps"] == 3
        and record["batch_size"] == 2
        and record["spatial_shape"] == [16, 16, 16]
    )
    assert "no privacy cost" in record["data"]
    assert 0 < report["privacy"]["epsilon"]["prv"] <= 8.0
    custodian = json.loads(
        (run / "private_not_for_release" / "custodian_report.json").read_text(encoding="utf-8")
    )
    assert custodian["history"]["val_epoch"] == [2, 3]  # every 2nd epoch and the last


def test_shipped_hippocampus_configs_are_one_workload_at_three_epsilons():
    """eps1 and eps3 are eps8's workload with the recipe left to ``recipe: auto``.

    The epsilon-8 config keeps its hand-tuned recipe; the epsilon-1 and epsilon-3 ones set no
    recipe field. Without their recipe fields, name and target epsilon the three are one
    workload: the same data (patch, spacing, classes), network, probes preset, preconditioner
    limits and evaluation settings.
    """
    import yaml

    from dpkfc_med.recipe import RECIPE_FIELDS
    from dpkfc_med.training.config_checks import flatten

    def drop(node: dict, field: str) -> None:
        *parents, last = field.split(".")
        for part in parents:
            node = node.get(part, {})
        node.pop(last, None)

    workload = {}
    for eps in (1, 3, 8):
        path = ROOT / "configs" / f"hippocampus_unet_3d_eps{eps}.yaml"
        cfg = load_config(path)  # validates
        assert cfg.privacy.target_epsilon == float(eps) and cfg.name == path.stem
        assert cfg.data.patch_size and cfg.data.spacing and cfg.data.num_classes == 3
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
        assert raw["training"].get("recipe", "manual") == ("manual" if eps == 8 else "auto")
        if eps != 8:  # the rule chooses every recipe field
            assert not set(flatten(raw)) & set(RECIPE_FIELDS), path.name
        for field in (*RECIPE_FIELDS, "name", "privacy.target_epsilon", "training.recipe"):
            drop(raw, field)
        workload[eps] = {k: v for k, v in raw.items() if v}  # sections left empty go
    assert workload[1] == workload[3] == workload[8]
    assert set(workload[8]) == {"data", "model", "training", "probes", "preconditioner"}


def _pretrained(cfg, task):
    from dpkfc_med.training.pretrain import pretrain as _pretrain
    from dpkfc_med.training.setup import build_run_model
    from dpkfc_med.training.setup import seed_everything as _seed_everything

    _seed_everything(cfg.training.seed)
    model, _ = build_run_model(cfg, task)
    record = _pretrain(cfg, task, model, torch.device("cpu"))
    return record, {k: v.clone() for k, v in model.state_dict().items()}


def test_pretrain_cache_reuses_bitwise_the_weights_it_would_compute(tmp_path):
    """A cache hit loads exactly the weights of a fresh pretraining; any change of key misses."""
    assert (HIPPO / "imagesTr").is_dir(), f"no msd_hippocampus data at {HIPPO}"
    from dpkfc_med.tasks.build import build_task

    cache = tmp_path / "cache"
    cfg = load_config(CONFIG, TINY + ["data.max_train=4", "pretrain.cache_dir=null"])
    task = build_task(cfg)
    fresh_record, fresh = _pretrained(cfg, task)
    assert "cache" not in fresh_record

    cached = load_config(CONFIG, TINY + ["data.max_train=4", f"pretrain.cache_dir={cache}"])
    first, w1 = _pretrained(cached, task)
    assert first["cache"]["reused"] is False and len(list(cache.glob("*.pt"))) == 1
    # another method and epsilon on the same seed: the same key, loaded from the cache
    other = load_config(
        CONFIG,
        TINY + ["data.max_train=4", f"pretrain.cache_dir={cache}", "privacy.target_epsilon=1.0"],
    )
    other.method = "dp-sgd"
    second, w2 = _pretrained(other, task)
    assert second["cache"] == {"key": first["cache"]["key"], "reused": True}
    assert second["steps"] == 3 and "no private" in second["data"]
    for name in fresh:
        assert torch.equal(fresh[name], w1[name]) and torch.equal(w1[name], w2[name]), name
    # another initial model (training seed) or another pretraining setting: another key
    for change in ("training.seed=1", "pretrain.lr=0.01"):
        cfg3 = load_config(
            CONFIG, TINY + ["data.max_train=4", f"pretrain.cache_dir={cache}", change]
        )
        third, _ = _pretrained(cfg3, task)
        assert third["cache"]["reused"] is False, change
    assert len(list(cache.glob("*.pt"))) == 3


def test_pretraining_is_cached_beside_the_run_by_default(tmp_path):
    """A retried run (another run folder under the same parent) reuses the pretraining."""
    from dpkfc_med.tasks.build import build_task

    cfg = load_config(CONFIG, TINY + ["data.max_train=4", f"output.dir={tmp_path / 'runs' / 'a'}"])
    assert cfg.pretrain.cache_dir == "auto"
    task = build_task(cfg)
    first, w1 = _pretrained(cfg, task)
    assert first["cache"]["reused"] is False
    assert len(list((tmp_path / "runs" / ".pretrain_cache").glob("*.pt"))) == 1
    cfg.output.dir = str(tmp_path / "runs" / "b")
    second, w2 = _pretrained(cfg, task)
    assert second["cache"]["reused"] is True
    assert all(torch.equal(w1[k], w2[k]) for k in w1)


def test_resume_may_move_the_pretraining_cache_but_not_change_pretraining():
    """The cache folder is where identical weights are kept: a resume may change it."""
    from dpkfc_med.training.config_checks import config_changes
    from dpkfc_med.training.opening import resume_replans

    original = load_config(CONFIG, TINY)
    moved = load_config(CONFIG, TINY + ["pretrain.cache_dir=/tmp/elsewhere"])
    assert resume_replans(config_changes(original, moved), "run") is False
    changed = load_config(CONFIG, TINY + ["pretrain.steps=4"])
    with pytest.raises(ConfigError, match=r"pretrain.steps: 3 -> 4"):
        resume_replans(config_changes(original, changed), "run")
