"""``dpkfc-med federated``: two Flower sites on loopback, two FedAvg rounds, private sites."""

from __future__ import annotations

import json

import pytest

from dpkfc_med.cli import main
from dpkfc_med.privacy.accounting import PrivacyLedger, epsilon_for
from tests.training.test_cli_classification import _config


def test_two_sites_two_rounds(tmp_path, capsys):
    """Each site's ledger composes both rounds within its target; the preconditioners agree;
    the sites hold disjoint halves of the training split; the server keeps the FedAvg model."""
    cfg = _config(
        tmp_path,
        privacy={"accountant": "rdp"},
        training={"threads": 1},
        probes={"num_probes": 16, "refresh_every": 2},
    )
    out = tmp_path / "fed"
    code = main(["federated", str(cfg), "--out", str(out), "--sites", "2", "--rounds", "2"])
    assert code == 0, capsys.readouterr().err
    assert "site 0: epsilon" in capsys.readouterr().out
    rec = json.loads((out / "server" / "federated.json").read_text())
    assert [h["round"] for h in rec["history"]] == [1, 2]
    assert (out / "server" / "model.pt").is_file() and "auroc" in rec["test"]
    for h in rec["history"]:
        fps = [m["fingerprint"] for m in h["sites"]]
        assert fps[0] != 0.0 and fps[0] == pytest.approx(fps[1], rel=1e-9)
    units = []
    for k in (0, 1):
        site = out / f"site_{k}"
        rep = json.loads((site / "privacy_report.json").read_text())
        p = rep["privacy"]
        assert rep["status"] == "complete" and rep["data"]["shard"]["site"] == k
        assert p["steps"] == p["planned_steps"] == 2 * p["steps_per_epoch"]  # both rounds
        ledger = PrivacyLedger.load(site / "ledger.json")
        assert ledger.steps == p["steps"]
        assert epsilon_for(ledger.events, ledger.delta, "rdp") == pytest.approx(p["epsilon"]["rdp"])
        assert p["epsilon"]["rdp"] <= 4.0 + 1e-9
        units.append(rep["data"]["num_train_units"])
        assert rec["history"][-1]["sites"][k]["steps"] == p["steps"]
    assert sum(units) == 96  # the two shards partition the 96 training images
    # a second run into the same folder is refused before anything starts
    again = ["federated", str(cfg), "--out", str(out), "--sites", "2", "--rounds", "2"]
    assert main(again) == 2
    assert "server exists: a federated run starts in a new folder" in capsys.readouterr().err


def test_federated_refuses_a_non_private_method(tmp_path, capsys):
    cfg = _config(tmp_path, method="nonprivate")
    code = main(
        ["federated", str(cfg), "--out", str(tmp_path / "f"), "--sites", "2", "--rounds", "1"]
    )
    assert code == 2
    assert "federated sites train privately; use dp-sgd or dp-kfc" in capsys.readouterr().err
