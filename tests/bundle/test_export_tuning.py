"""``dpkfc-med bundle export`` of an accounted tuning: the best trial, the tuning's guarantee."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from dpkfc_med.bundle import export_bundle
from dpkfc_med.bundle.export import BundleExportError
from dpkfc_med.bundle.metadata import metadata_problems
from dpkfc_med.cli import main
from dpkfc_med.privacy.selection import TrialCount
from dpkfc_med.training.config import load_config
from dpkfc_med.training.tune import TUNING_LEDGER, run_tuning
from tests.training.test_cli_classification import _config


@pytest.fixture(scope="module")
def tuning(tmp_path_factory) -> tuple[Path, dict]:
    """A finished tuning of three one-epoch DP-SGD trials on PneumoniaMNIST (seconds)."""
    tmp = tmp_path_factory.mktemp("tuning")
    cfg = load_config(_config(tmp, method="dp-sgd", training={"epochs": 1}))
    mp = pytest.MonkeyPatch()
    mp.setattr(TrialCount, "sample", lambda self, rng=None: 3)  # K differs from E[K] = 2
    try:
        record = run_tuning(
            cfg,
            target_epsilon=4.0,
            grid={"training.lr": ["0.05", "0.1"]},
            trials=TrialCount.parse("poisson:2"),
            out=tmp / "tune",
        )
    finally:
        mp.undo()
    return tmp / "tune", record


@pytest.fixture(scope="module")
def bundle(tuning, tmp_path_factory) -> Path:
    return export_bundle(tuning[0], tmp_path_factory.mktemp("b") / "bundle")


def test_metadata_and_readme_state_the_tuning_beside_the_total_epsilon(tuning, bundle):
    folder, record = tuning
    plan = record["plan"]
    meta = json.loads((bundle / "configs" / "metadata.json").read_text(encoding="utf-8"))
    assert metadata_problems(meta) == []
    dp = meta["differential_privacy"]
    assert dp["private"] and dp["epsilon_target"] == 4.0
    assert dp["epsilon_spent"]["rdp"] == pytest.approx(plan["epsilon"], rel=1e-6)
    assert dp["epsilon_spent"]["rdp"] <= 4.0
    assert dp["noise_multiplier"] == pytest.approx(plan["noise_multiplier"])
    t = dp["tuning"]
    assert t["expected_trials"] == 2.0 and t["trials_distribution"].startswith("Poisson")
    assert t["epsilon_one_trial"] == pytest.approx(plan["trial_epsilon"])
    assert t["epsilon_total"] == pytest.approx(plan["epsilon"], rel=1e-6)
    assert "selection of the best trial" in t["covers"] and "released model" in t["covers"]
    chosen = record["trials"][record["selected"]]
    assert t["released"]["params"] == chosen["params"]
    words = "expected 2 trials"
    assert words in meta["description"] and "covering its hyperparameter tuning" in meta["task"]
    readme = (bundle / "docs" / "README.md").read_text(encoding="utf-8")
    assert "- tuning: Accounted hyperparameter tuning" in readme and words in readme
    assert f"epsilon {plan['epsilon']:.3f}".rstrip("0") in readme or "epsilon 4" in readme
    assert "tuning_report.md" in readme and "privacy_report.md" not in readme
    # what the bound does not cover stays with the custodian: K, the other trials' scores
    shipped = [p for p in bundle.rglob("*") if p.is_file() and p.suffix in (".json", ".md")]
    assert {p.name for p in (bundle / "docs").iterdir()} == {
        "README.md",
        "tuning_report.json",
        "tuning_report.md",
    }
    for other in record["trials"]:
        if other["index"] != record["selected"]:
            assert not any(
                repr(other["score"])[:12] in p.read_text(encoding="utf-8") for p in shipped
            )
    assert "count" not in dp["tuning"] and "trials_run" not in json.dumps(dp)


def _shareable_texts(folder: Path, bundle: Path) -> dict[str, str]:
    """Every shareable file of a tuning and its bundle as text (a ``.pt``: what it embeds)."""
    texts = {}
    files = [p for p in folder.rglob("*") if "private_not_for_release" not in p.parts]
    for path in [*files, *bundle.rglob("*")]:
        if not path.is_file():
            continue
        if path.suffix == ".pt":
            saved = torch.load(path, map_location="cpu", weights_only=False)
            plain = {k: v for k, v in saved.items() if not isinstance(v, (dict, torch.Tensor))}
            embedded = {k: v for k, v in saved.items() if k in ("config", "task")}
            weights = [k for k, v in saved.items() if isinstance(v, dict) and k not in embedded]
            keys = [list(saved[k]) for k in weights] + [list(saved)]
            texts[str(path)] = json.dumps([plain, embedded, keys], default=str)
        else:
            texts[str(path)] = path.read_text(encoding="utf-8")
    return texts


def test_nothing_shareable_names_the_selected_trial_or_the_count(tuning, bundle):
    """Audit round 3: the released model.pt embedded ``name: t_trial_<i>``, which shows
    K > i; the bound assumes K stays hidden. Only the custodian folder may name a trial."""
    folder, record = tuning
    texts = _shareable_texts(folder, bundle)
    assert str(folder / "model.pt") in texts and str(bundle / "models" / "model.pt") in texts
    saved = torch.load(folder / "model.pt", map_location="cpu", weights_only=False)
    assert saved["config"]["name"] == record["config"]["name"] == "t"
    k = record["count"]  # 3, while E[K] = 2
    for path, text in texts.items():
        assert not re.search(r"trial[ _-]?\d", text, re.IGNORECASE), path  # the index
        assert not re.search(rf"\b{k} trials?\b|\bK ?= ?{k}\b", text), path  # the count
        if path.endswith(".json"):
            assert not {"count", "selected", "index"} & set(re.findall(r'"(\w+)":', text)), path


def test_bundle_holds_the_selected_trials_weights(tuning, bundle):
    folder, record = tuning
    trial = folder / "private_not_for_release" / "trials" / f"trial_{record['selected']}"
    weights = torch.load(bundle / "models" / "model.pt", weights_only=True)
    released = torch.load(trial / "model.pt", weights_only=False)["model"]
    assert weights.keys() == released.keys()
    assert all(torch.equal(weights[k], released[k]) for k in weights)


def test_tuning_report_states_the_mechanism_beside_the_total(tuning):
    text = (tuning[0] / "tuning_report.md").read_text(encoding="utf-8")
    head = text.split("\n\n")[1]  # the line with the total epsilon
    assert "expected 2 trials" in head and "one trial alone" in head
    assert "selection" in head and "released model" in head


def test_unfinished_or_swapped_tuning_is_refused(tuning, tmp_path):
    folder, record = tuning
    stopped = tmp_path / "stopped"
    shutil.copytree(folder, stopped)
    ledger = json.loads((stopped / TUNING_LEDGER).read_text(encoding="utf-8"))
    ledger["trials"][1]["status"] = "running"
    (stopped / TUNING_LEDGER).write_text(json.dumps(ledger), encoding="utf-8")
    with pytest.raises(BundleExportError, match="stopped before every trial was scored"):
        export_bundle(stopped, tmp_path / "b1")
    swapped = tmp_path / "swapped"
    shutil.copytree(folder, swapped)
    other = next(t["index"] for t in record["trials"] if t["index"] != record["selected"])
    trials = swapped / "private_not_for_release" / "trials"
    shutil.copyfile(trials / f"trial_{other}" / "model.pt", swapped / "model.pt")
    if (trials / f"trial_{other}" / "model.pt").read_bytes() != (
        trials / f"trial_{record['selected']}" / "model.pt"
    ).read_bytes():
        with pytest.raises(BundleExportError, match="not the selected trial's model"):
            export_bundle(swapped, tmp_path / "b2")


def test_cli_exports_a_tuning_folder(tuning, tmp_path, capsys):
    assert main(["bundle", "export", str(tuning[0]), str(tmp_path / "b")]) == 0
    assert (tmp_path / "b" / "configs" / "metadata.json").is_file()
