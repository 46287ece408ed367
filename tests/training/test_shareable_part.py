"""What the shareable part of a run holds and says.

No path, no time finer than a day, no epoch chosen on private validation data, no un-noised
private statistic; the report opens with one verdict, the looser accountants on a neutral line.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch

from dpkfc_med.cli import main
from dpkfc_med.report import CUSTODIAN_ONLY, PRIVATE_DIR, REPORT_FILES
from dpkfc_med.report.numbers import format_epsilon
from dpkfc_med.training.config import load_config
from dpkfc_med.training.run import train
from tests.training.test_cli_classification import PNEUMONIA, _config, _report

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


def test_shareable_part_holds_no_unnoised_private_statistic(tmp_path):
    cfg_path = _config(tmp_path, training={"epochs": 1})
    run = tmp_path / "r"
    result = train(load_config(cfg_path, [f"output.dir={run}"]))
    data_sha = hashlib.sha256(PNEUMONIA.read_bytes()).hexdigest()
    losses = [f"{v:.6f}" for v in result.custodian["history"]["loss"] if v == v]
    assert losses
    counts = result.custodian["data"]["class_counts"]
    shareable = [run / REPORT_FILES[k] for k in ("json", "markdown", "html")]
    for path in shareable:
        text = path.read_text(encoding="utf-8")
        assert data_sha not in text, path
        assert "confusion" not in text, path
        assert json.dumps(counts) not in text and json.dumps(counts, indent=2) not in text
    rep = _report(run)
    for dotted in CUSTODIAN_ONLY:
        node = rep
        for part in dotted.split("."):
            node = node.get(part, {}) if isinstance(node, dict) else {}
        assert node == {} or node is None, dotted
    json_text = json.dumps(rep["history"])
    assert not any(v in json_text for v in losses)
    private = json.loads((run / PRIVATE_DIR / "custodian_report.json").read_text(encoding="utf-8"))
    assert [f"{v:.6f}" for v in private["history"]["loss"] if v == v] == losses
    assert private["data"]["sha256"] and private["metrics"]["test"]
    listed = " ".join(rep["privacy"]["not_covered"])
    for words in ("Hyperparameter tuning", "number of training units N", PRIVATE_DIR):
        assert words in listed


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
