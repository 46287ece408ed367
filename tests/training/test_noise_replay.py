"""Noise is drawn from OS entropy; seeded (replayable) noise is named and claims no guarantee."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from dpkfc_med.cli import main
from dpkfc_med.privacy import PrivacyEngine
from dpkfc_med.report import REPORT_FILES
from dpkfc_med.training.config import ConfigError, load_config
from dpkfc_med.training.run import train
from tests.conftest import tiny_cnn_2d
from tests.training.test_cli_classification import _config, _report


def test_noise_is_not_replayable_from_the_published_seed(tmp_path):
    def noisy_step(engine):
        torch.manual_seed(0)
        model = tiny_cnn_2d(2)
        data = TensorDataset(torch.randn(16, 1, 8, 8), torch.randint(0, 2, (16,)))
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        pm, popt, loader = engine.make_private(
            module=model,
            optimizer=opt,
            data_loader=DataLoader(data, batch_size=16),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            delta=1e-5,
            method="dp-sgd",
        )
        x, y = data.tensors
        torch.nn.functional.cross_entropy(pm(x), y).backward()
        popt.step()
        return torch.cat([p.detach().flatten() for p in model.parameters()]), engine

    a, ea = noisy_step(PrivacyEngine())
    b, _ = noisy_step(PrivacyEngine())
    assert not torch.equal(a, b)  # same seed everywhere else, different noise
    state = ea.state_dict()
    assert state["noise_generator"] is None and state["sample_generator"] is None
    assert ea.randomness == "os-entropy" and not ea.reproducible
    c, ec = noisy_step(PrivacyEngine(seed=3))
    d, _ = noisy_step(PrivacyEngine(seed=3))
    assert torch.equal(c, d) and ec.reproducible  # research mode replays, by name only


def test_reproducible_noise_is_named_in_the_report_headline(tmp_path):
    cfg_path = _config(
        tmp_path, method="dp-sgd", training={"epochs": 1}, privacy={"reproducible_noise": True}
    )
    run = tmp_path / "r"
    train(load_config(cfg_path, [f"output.dir={run}"]))
    rep = _report(run)
    assert rep["privacy"]["randomness"] == {
        "source": "seeded",
        "valid_dp_release": False,
        "note": "seeded from the published training.seed: replayable",
    }
    md = (run / REPORT_FILES["markdown"]).read_text(encoding="utf-8")
    assert md.split("\n\n")[1].startswith("> **NOT A VALID DP RELEASE:**")
    assert rep["privacy"]["guarantee"].startswith("NOT A VALID DP RELEASE")
    with pytest.raises(ConfigError, match="reproducible_noise=true contradicts"):
        load_config(cfg_path, ["privacy.secure_rng=true"])


def test_replayable_noise_claims_no_guarantee_anywhere(tmp_path):
    cfg_path = _config(
        tmp_path, method="dp-sgd", training={"epochs": 1}, privacy={"reproducible_noise": True}
    )
    run = tmp_path / "r"
    train(load_config(cfg_path, [f"output.dir={run}"]))
    guarantee = _report(run)["privacy"]["guarantee"]
    assert guarantee.startswith("NOT A VALID DP RELEASE: no differential-privacy guarantee")
    assert "differentially private" not in guarantee and "epsilon" not in guarantee.lower()
    bundle = tmp_path / "bundle"
    assert main(["bundle", "export", str(run), str(bundle)]) == 0
    meta = json.loads((bundle / "configs/metadata.json").read_text(encoding="utf-8"))
    for key in ("task", "description"):
        assert meta[key].startswith("NOT A VALID DP RELEASE"), key
        assert "trained with (epsilon" not in meta[key], key
    readme = (bundle / "docs/README.md").read_text(encoding="utf-8")
    assert readme.splitlines()[0].startswith("# NOT A VALID DP RELEASE")
