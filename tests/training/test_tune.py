"""``dpkfc-med tune``: accounted tuning end to end, its noisy score and a kill mid-tuning."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dpkfc_med.cli import main
from dpkfc_med.privacy.selection import TrialCount
from dpkfc_med.training.config import ConfigError, load_config
from dpkfc_med.training.tune import TUNING_LEDGER, parse_grid, run_tuning, score_noisily
from tests.training.test_cli_classification import _config


def test_grid_keys_that_change_the_mechanism_are_refused():
    assert parse_grid(["training.lr=0.05,0.1", "privacy.max_grad_norm=0.5,1"]) == {
        "training.lr": ["0.05", "0.1"],
        "privacy.max_grad_norm": ["0.5", "1"],
    }
    for bad in ("training.batch_size=16,32", "privacy.target_epsilon=1,8", "data.max_train=5"):
        with pytest.raises(ConfigError, match="same private mechanism"):
            parse_grid([bad])
    with pytest.raises(ConfigError, match="KEY=V1,V2"):
        parse_grid(["training.lr"])


@pytest.mark.parametrize(
    ("item", "why"),
    [
        ("training.seed=0,1", "draws the split"),  # audit: 20 validation cases trained on
        ("probes.allow_public_overlap=false,true", "preconditioner depend on private"),
        ("privacy.reproducible_noise=false,true", "the tuning's plan"),
        ("data.path=a.npz,b.npz", "the private data"),
        ("training.select_epoch=last,best_val", "last epoch"),
        ("model.pretrained=a.pt,b.pt", "a path"),
        ("training={seed: 1}", "sets training.seed"),  # a whole section smuggles the seed
        ("output.dir=a,b", "the tuning's"),
        ("name=a,b", "names the tuning"),
    ],
)
def test_grid_keys_that_change_the_data_split_or_mechanism_name_key_reason_and_fix(item, why):
    """Audit round 3: ``--grid training.seed`` re-drew the split, so a trial trained on units
    it was then scored on; every refused key is named with why and what to do instead."""
    key = item.partition("=")[0]
    with pytest.raises(ConfigError, match="same private mechanism") as err:
        parse_grid([item, "training.lr=0.05,0.1"])
    text = str(err.value)
    assert f"--grid {key}: " in text and why in text and "set it once in the config" in text
    assert "training.lr" not in text.split("--grid ", 1)[1].split(":")[0]  # the lr is fine
    assert len(err.value.problems) == 1


def test_grid_values_are_checked_before_the_budget_is_spent(tmp_path):
    """A value the config refuses stops the tuning before K is drawn (no ledger, no spend)."""
    cfg = load_config(_config(tmp_path, method="dp-sgd", training={"epochs": 1}))
    out = tmp_path / "tune"
    grid = {"training.lr": ["0.05", "fast"], "training.optimiser": ["adam"]}
    with pytest.raises(ConfigError, match=r"training\.lr=fast") as err:
        run_tuning(
            cfg, target_epsilon=4.0, grid=grid, trials=TrialCount.parse("poisson:2"), out=out
        )
    assert "training.optimiser" in str(err.value)  # every problem at once
    with pytest.raises(ConfigError, match="draws the split"):  # a grid passed as a mapping
        run_tuning(
            cfg,
            target_epsilon=4.0,
            grid={"training.seed": [0, 1]},
            trials=TrialCount.parse("poisson:2"),
            out=out,
        )
    assert not (out / TUNING_LEDGER).exists()


def test_the_validation_score_noise_is_calibrated_to_its_sensitivity():
    """Per-unit scores in [0, 1]: the sum has sensitivity 1, the noise std is sigma / n."""
    n, sigma = 40, 3.0
    scores = np.full(n, 0.5)
    draws = np.array([score_noisily(scores, sigma) for _ in range(4000)])
    assert abs(draws.mean() - 0.5) < 4 * sigma / n / np.sqrt(4000)
    assert draws.std() == pytest.approx(sigma / n, rel=0.06)
    # a unit's score is clipped to [0, 1]: no unit moves the sum by more than 1
    assert score_noisily(np.array([5.0, -3.0]), 1e-9) == pytest.approx(0.5)


def test_tuning_releases_the_best_trial_and_survives_a_kill(tmp_path, monkeypatch):
    import dpkfc_med.training.run as loop

    cfg_path = _config(tmp_path, method="dp-sgd", training={"epochs": 1})
    cfg = load_config(cfg_path)
    out = tmp_path / "tune"
    monkeypatch.setattr(TrialCount, "sample", lambda self, rng=None: 2)
    real_train, calls = loop.train, []

    def killed_on_second(tcfg, **kw):
        calls.append(tcfg.output.dir)
        if len(calls) == 2:
            raise KeyboardInterrupt  # a kill before the second trial's first step
        return real_train(tcfg, **kw)

    monkeypatch.setattr(loop, "train", killed_on_second)
    grid = {"training.lr": ["0.05", "0.1"]}
    count = TrialCount.parse("poisson:2")
    with pytest.raises(KeyboardInterrupt):
        run_tuning(cfg, target_epsilon=4.0, grid=grid, trials=count, out=out)
    ledger = json.loads((out / TUNING_LEDGER).read_text(encoding="utf-8"))
    # the whole procedure counts as spent from the moment K was drawn
    assert ledger["count"] == 2 and 3.9 < ledger["epsilon_spent"] <= 4.0
    first_score = ledger["trials"][0]["score"]
    assert ledger["trials"][0]["status"] == "scored" and ledger["trials"][1]["status"] == "running"
    with pytest.raises(ConfigError, match="already holds a tuning"):
        run_tuning(cfg, target_epsilon=4.0, grid=grid, trials=count, out=out)
    monkeypatch.setattr(loop, "train", real_train)
    record = run_tuning(cfg, target_epsilon=4.0, grid=grid, trials=count, out=out, resume=True)
    assert record["count"] == 2 and record["trials"][0]["score"] == first_score  # not re-run
    best = max(record["trials"], key=lambda t: t["score"])
    assert record["selected"] == best["index"]
    trial_dir = out / "private_not_for_release" / "trials" / f"trial_{best['index']}"
    released = torch.load(out / "model.pt", weights_only=False)["model"]
    trial_model = torch.load(trial_dir / "model.pt", weights_only=False)["model"]
    assert all(torch.equal(released[k], trial_model[k]) for k in released)
    trial_report = json.loads((trial_dir / "privacy_report.json").read_text(encoding="utf-8"))
    assert trial_report["training"]["select_epoch"] == "last"
    assert trial_report["privacy"]["noise_multiplier"] == pytest.approx(
        record["plan"]["noise_multiplier"]
    )
    assert "released epoch" not in " ".join(trial_report["privacy"]["not_covered"])
    report = json.loads((out / "tuning_report.json").read_text(encoding="utf-8"))
    assert report["epsilon"] <= 4.0 and report["released"]["params"] == best["params"]
    shared = (out / "tuning_report.md").read_text(encoding="utf-8")
    assert "training.lr in [0.05, 0.1]" in shared  # the grid as typed, not as strings
    other = [t for t in record["trials"] if t["index"] != best["index"]][0]
    assert f"{other['score']:.3f}" not in shared  # other trials' scores stay with the custodian
    for path in out.iterdir():  # nothing outside the custodian folder holds another's score
        if path.is_file() and path.suffix in (".json", ".md"):
            assert repr(other["score"])[:12] not in path.read_text(encoding="utf-8"), path


def test_tune_cli_needs_the_total_epsilon(tmp_path, capsys):
    cfg_path = _config(tmp_path, method="dp-sgd")
    assert main(["tune", str(cfg_path), "--out", str(tmp_path / "t")]) == 2
    assert "tune needs --epsilon" in capsys.readouterr().err
