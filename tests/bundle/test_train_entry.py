"""The bundles' ``training`` entry trains privately through the engine and writes its report."""

from __future__ import annotations

import json

import pytest

from dpkfc_med.privacy.accounting import PrivacyLedger
from dpkfc_med.training.config import ConfigError
from tests.bundle.conftest import SEG_TINY, bundle_train


def test_segmentation_bundle_trains_privately_and_writes_the_report(seg_run):
    report = json.loads((seg_run / "privacy_report.json").read_text())
    assert report["status"] == "complete"
    p = report["privacy"]
    assert p["private"] and p["method"] == "dp-kfc"
    # the bundle carried its overrides into the engine's config, nothing else
    cfg = report["run"]["config"]
    assert cfg["name"] == "hippocampus_unet_3d_eps8"
    assert cfg["data"]["patch_size"] == [16, 16, 16] and cfg["training"]["epochs"] == 1
    assert cfg["privacy"]["target_epsilon"] == 8.0
    ledger = PrivacyLedger.load(seg_run / "ledger.json")
    assert ledger.steps == p["steps"] > 0
    assert ledger.epsilon() <= p["target_epsilon"]
    for name in ("model.pt", "privacy_report.md", "privacy_report.html", "run.json"):
        assert (seg_run / name).is_file(), name


def _engine_error(info: pytest.ExceptionInfo) -> BaseException:
    # monai.bundle wraps what an expression raises in "RuntimeError: Failed to evaluate"
    assert isinstance(info.value, RuntimeError)
    return info.value.__cause__


def test_bundle_training_refuses_to_overwrite_a_run(seg_run):
    # same guard as `dpkfc-med train --out` (one code path): a second run would spend twice
    with pytest.raises(RuntimeError) as info:
        bundle_train("segmentation_3d", SEG_TINY, seg_run)
    err = _engine_error(info)
    assert isinstance(err, ConfigError) and "already holds a run" in str(err)
    assert "pass --resume" in str(err)


def test_bundle_training_reports_bad_overrides_like_the_cli(tmp_path):
    with pytest.raises(RuntimeError) as info:
        bundle_train("segmentation_3d", [*SEG_TINY, "training.epochs=-1"], tmp_path / "r")
    err = _engine_error(info)
    assert isinstance(err, ConfigError)
    assert "--set training.epochs=-1: must be a positive number" in str(err)
    assert not (tmp_path / "r").exists()
