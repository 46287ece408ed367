"""Every shipped config trains as written, at toy size (few units, one epoch, few probes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from dpkfc_med.training.config import load_config
from dpkfc_med.training.run import train

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


def test_the_configs_folder_is_found():
    assert len(CONFIGS) >= 8


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_shipped_config_trains_at_toy_size(path, tmp_path):
    raw = yaml.safe_load(path.read_text())
    seg = raw.get("data", {}).get("task") == "segmentation"
    toy = [
        "training.epochs=1",
        f"training.batch_size={4 if seg else 16}",
        "training.progress=false",
        f"data.max_train={6 if seg else 32}",
        f"data.max_eval={2 if seg else 16}",
        "probes.num_probes=4",
        "preconditioner.chunk_size=2",
        "preconditioner.calibration_samples=2",
        # toy size: no factor wider than 512 is decomposed in full, and the RDP accountant
        # (PRV on a 1-epoch run at q = 1/2 costs seconds per call)
        "preconditioner.max_factor_dim=512",
        "privacy.accountant=rdp",
        f"output.dir={tmp_path / 'run'}",
    ]
    if "pretrain" in raw:
        toy += ["pretrain.steps=1", "pretrain.batch_size=1"]
    cfg = load_config(path, overrides=toy)
    # the model, the mechanism and the privacy target are the config's own
    assert cfg.model.name == raw["model"]["name"]
    assert cfg.method == raw["method"]
    assert cfg.privacy.target_epsilon == raw["privacy"]["target_epsilon"]
    result = train(cfg)
    assert 0 < result.epsilon <= cfg.privacy.target_epsilon
    assert (tmp_path / "run" / "privacy_report.json").is_file()
