"""Weights whose own run record shows they were trained on this run's private data are refused.

The run record is the custodian report beside a run's ``model.pt``; the check compares its data
fingerprint with this run's, for run configs and for bundles (``--set model.pretrained``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dpkfc_med.bundle.zoo import prepare_bundle
from dpkfc_med.data import resolve_data_path
from dpkfc_med.data.paths import sha256_file
from dpkfc_med.models.pretrained import PretrainedWeightsError, same_data_problems

ROOT = Path(__file__).resolve().parents[2]
BUNDLE = ROOT / "tests" / "bundle" / "zoo_bundle"


def _run_folder(tmp_path: Path, name: str, sha256: dict[str, str], state: dict) -> Path:
    """A finished run's model.pt with its custodian record (data fingerprint)."""
    run = tmp_path / name
    (run / "private_not_for_release").mkdir(parents=True)
    torch.save({"model": state}, run / "model.pt")
    record = {"data": {"sha256": sha256}}
    (run / "private_not_for_release" / "custodian_report.json").write_text(
        json.dumps(record), encoding="utf-8"
    )
    return run / "model.pt"


def test_a_run_config_refuses_weights_trained_on_its_own_data(tmp_path):
    from dpkfc_med.cli import main

    npz = resolve_data_path("pneumoniamnist")
    weights = _run_folder(tmp_path, "earlier", {npz.name: sha256_file(npz)}, {"w": torch.zeros(1)})
    out = tmp_path / "run"
    with pytest.raises(PretrainedWeightsError, match="trained on this run's private data"):
        from dpkfc_med.training.config import load_config
        from dpkfc_med.training.run import train

        cfg = load_config(
            ROOT / "configs" / "pneumoniamnist_cnn_2d_eps1.yaml",
            overrides=[f"model.pretrained={weights}", f"output.dir={out}", "data.max_train=64"],
        )
        train(cfg)
    assert not out.exists()
    # the CLI says it as an error, and leaves nothing behind
    args = ["train", str(ROOT / "configs" / "pneumoniamnist_cnn_2d_eps1.yaml"), "--out", str(out)]
    assert main([*args, "--set", f"model.pretrained={weights}", "--set", "data.max_train=64"]) != 0
    assert not out.exists()


def test_a_bundle_refuses_weights_trained_on_its_own_data_and_loads_others(tmp_path):
    data_dir = str(resolve_data_path("msd_hippocampus", kind="dir"))
    overrides = [f"dataset_dir={data_dir}", "num_train=3"]
    fresh = prepare_bundle(BUNDLE, epsilon=8, overrides=overrides)
    state = {
        k: v + 1.0 if v.is_floating_point() else v for k, v in fresh.network.state_dict().items()
    }
    same = fresh.task.data_record["sha256"]
    assert list(same) == ["train#dataset#data"]
    own = _run_folder(tmp_path, "own", same, state)
    with pytest.raises(PretrainedWeightsError, match=r"own/model\.pt: these weights were trained"):
        prepare_bundle(BUNDLE, epsilon=8, overrides=overrides,
                       settings=[f"model.pretrained={own}"])  # fmt: skip
    public = _run_folder(tmp_path, "public", {"other.npz": "0" * 64}, state)
    b = prepare_bundle(BUNDLE, epsilon=8, overrides=overrides,
                       settings=[f"model.pretrained={public}"])  # fmt: skip
    loaded = b.network.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in state.items())  # started from the weights


def test_weights_without_a_run_record_are_not_checked(tmp_path):
    plain = tmp_path / "weights.pt"
    torch.save({"w": torch.zeros(1)}, plain)
    assert same_data_problems(plain, {"x.npz": "a" * 64}) == []
    assert same_data_problems(None, {"x.npz": "a" * 64}) == []
