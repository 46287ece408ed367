"""Regression tests of the second audit's lesser findings: what the shareable part may say.

Nothing shareable comes from a path, carries a time finer than a day or the epoch chosen on
private validation data; the report opens with one verdict, not a warning that fires on every
run; a replayable-noise run claims no guarantee anywhere; a stopped run continues as it was.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from dpkfc_med.cli import main
from dpkfc_med.report import REPORT_FILES
from dpkfc_med.report.numbers import format_epsilon
from dpkfc_med.training.config import load_config
from dpkfc_med.training.run import RunInterrupted, train
from tests.training.test_cli_classification import PNEUMONIA, _config, _report
from tests.training.test_privacy_hardening import _ledger, _stop_at

SECRET = "WARD7_DOE_JANE"  # a folder name that names a ward and a patient


def _shareable_texts(run: Path) -> dict[str, str]:
    texts = {
        k: (run / REPORT_FILES[k]).read_text(encoding="utf-8") for k in ("json", "markdown", "html")
    }
    texts["model.pt"] = repr(torch.load(run / "model.pt", weights_only=False))
    return texts


def test_shareable_files_hold_no_path_no_time_and_no_selected_epoch(tmp_path):
    data = tmp_path / SECRET / "pneumoniamnist.npz"
    data.parent.mkdir()
    shutil.copy(PNEUMONIA, data)
    run = tmp_path / f"{SECRET}_runs" / "r"
    cfg_path = _config(tmp_path, method="dp-sgd", training={"epochs": 1})
    train(load_config(cfg_path, [f"output.dir={run}", f"data.path={data}"]))
    for name, text in _shareable_texts(run).items():
        assert SECRET not in text, name
    assert "selected_epoch" not in _shareable_texts(run)["model.pt"]
    rep = _report(run)
    assert len(rep["created"]) == 10  # a date, no time of day
    assert all("time" not in e and len(e["date"]) == 10 for e in rep["privacy"]["plan_history"])
    saved = torch.load(run / "model.pt", weights_only=False)
    assert "selected_epoch" not in saved and "path" not in saved["config"]["data"]
    # the custodian keeps what was moved, in full
    custodian = json.loads(
        (run / "private_not_for_release/custodian_report.json").read_text(encoding="utf-8")
    )
    assert SECRET in custodian["data"]["path"] and SECRET in custodian["run"]["run_dir"]
    assert "T" in custodian["created"]  # the full timestamp
    metrics = json.loads((run / "private_not_for_release/metrics.json").read_text(encoding="utf-8"))
    assert "selected_epoch" in metrics
    # an exported bundle states the modality and source the config gives, never a folder name
    bundle = tmp_path / "bundle"
    assert main(["bundle", "export", str(run), str(bundle)]) == 0
    meta = json.loads((bundle / "configs/metadata.json").read_text(encoding="utf-8"))
    for path in bundle.rglob("*"):
        if path.suffix in (".json", ".md", ".yaml", ".html"):
            assert SECRET not in path.read_text(encoding="utf-8"), path
    assert meta["data_source"].startswith("not stated")
    assert meta["network_data_format"]["inputs"]["image"]["modality"].startswith("not stated")
    assert "optional_packages_version" in meta


def test_report_opens_with_one_verdict_and_the_looser_accountants_on_a_neutral_line(tmp_path):
    cfg_path = _config(tmp_path, method="dp-sgd", training={"epochs": 1})
    run = tmp_path / "r"
    train(load_config(cfg_path, [f"output.dir={run}"]))
    rep = _report(run)
    eps = rep["privacy"]["epsilon"]
    assert eps["rdp"] > eps["prv"]  # a PRV-calibrated run: RDP is always the looser bound
    assert rep["privacy"]["headline_warnings"] == []
    md = (run / REPORT_FILES["markdown"]).read_text(encoding="utf-8")
    first = md.split("\n\n")[1]
    assert "> **Valid DP release: yes.** The released model" in first
    assert "PRV accountant, which planned this run" in first
    assert format_epsilon(eps["rdp"]) not in first  # the looser bound stays technical
    assert "### Other accountants: bounds on the same mechanism" in md
    assert "disagree" not in md.lower() and "warning" not in md.split("## ")[0].lower()


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


def test_a_stopped_run_continues_as_it_was_with_its_own_config(tmp_path, capsys):
    cfg_path = _config(tmp_path, method="dp-sgd", training={"epochs": 2})
    run = tmp_path / "r"
    first = load_config(cfg_path, [f"output.dir={run}", "training.epochs=4"])
    with pytest.raises(RunInterrupted, match=rf"`dpkfc-med train --resume --out {run}`"):
        train(first, instrument=_stop_at(2, KeyboardInterrupt))
    # the printed command continues the run with its own stored config (4 epochs, not 2)
    assert main(["train", "--resume", "--out", str(run)]) == 0
    assert _ledger(run).steps == 12  # 4 epochs of 3 steps: the first plan
    plans = json.loads((run / "plan.json").read_text(encoding="utf-8"))["plans"]
    assert [p["plan"]["spent_steps"] for p in plans] == [0, 2]
    assert plans[1]["plan"]["steps_remaining"] == 10
    assert "changes" not in capsys.readouterr().err


def test_resuming_with_a_changed_config_says_every_change_and_the_replan(tmp_path, capsys):
    cfg_path = _config(tmp_path, method="dp-sgd", training={"epochs": 4})
    run = tmp_path / "r"
    with pytest.raises(RunInterrupted):
        train(
            load_config(cfg_path, [f"output.dir={run}"]), instrument=_stop_at(4, KeyboardInterrupt)
        )
    capsys.readouterr()
    assert (
        main(["train", str(cfg_path), "--resume", "--out", str(run), "--set", "training.epochs=3"])
        == 0
    )
    err = capsys.readouterr().err
    assert "changes 1 field of the run's stored configuration" in err
    assert "training.epochs: 4 -> 3" in err and "re-planned within the target" in err
    assert _ledger(run).steps == 9


def test_train_without_config_needs_resume_and_a_run(tmp_path, capsys):
    assert main(["train", "--out", str(tmp_path / "nothing")]) == 2
    assert "CONFIG: required" in capsys.readouterr().err
    assert main(["train", "--resume", "--out", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert "dpkfc-med train --resume --out RUN_DIR" in err and "config.yaml not found" in err
