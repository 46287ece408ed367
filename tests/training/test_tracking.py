"""Experiment tracking of YAML runs: the shareable and the custodian stream, read back."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

from dpkfc_med.cli import main
from dpkfc_med.engines.handlers.tracking import plan_tracking, shareable_records
from dpkfc_med.report.custodian import PRIVATE_DIR, not_covered
from dpkfc_med.training.config import ConfigError, load_config
from tests.training.test_cli_classification import _config

# un-noised statistics of the private data: none of these may reach the shareable stream
PRIVATE_WORDS = (
    "loss",
    "val_",
    "auroc",
    "accuracy",
    "clipping",
    "clipped",
    "median",
    "batch_units",
    "layer_share",
    "layer_snr",
)


def _tiny(tmp_path: Path) -> Path:
    return _config(
        tmp_path,
        method="dp-sgd",
        data={"max_train": 64, "max_eval": 32},
        training={"epochs": 2, "threads": 1},
    )


def _report(run: Path) -> dict:
    return json.loads((run / "privacy_report.json").read_text(encoding="utf-8"))


def _private_names(names) -> list[str]:
    return [n for n in names if any(w in n.lower() for w in PRIVATE_WORDS)]


def test_mlflow_streams_read_back(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    decoy = tmp_path / "shared_server" / "mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{decoy}")  # must be ignored
    run = tmp_path / "run"
    argv = ["train", str(_tiny(tmp_path)), "--out", str(run), "--set", "tracking.backend=mlflow"]
    argv += ["--set", "training.epochs=1"]  # two noisy steps: each store takes seconds to make
    assert main(argv) == 0
    report = _report(run)
    assert not decoy.exists() and not decoy.parent.exists()

    # shareable: epsilon per step, the recipe, the released model's version; nothing un-noised
    share = mlflow.MlflowClient(f"sqlite:///{run / 'tracking' / 'mlflow.db'}")
    (exp,) = [e for e in share.search_experiments() if e.name == "dpkfc-med"]
    (r,) = share.search_runs([exp.experiment_id])
    assert r.info.run_name == "t" and r.data.tags["dpkfc_med.stream"] == "shareable"
    assert _private_names(r.data.metrics) == []
    assert _private_names(r.data.tags) == []
    assert _private_names(k for k in r.data.params if not k.startswith("config.")) == []
    rdp = share.get_metric_history(r.info.run_id, "epsilon_rdp")
    history = report["history"]
    assert sorted((m.step, m.value) for m in rdp) == list(
        zip(history["step"], history["epsilon_rdp"])
    )
    prv = share.get_metric_history(r.info.run_id, "epsilon_prv")
    assert sorted(m.step for m in prv) == history["epsilon_step"]
    assert len({m.timestamp for m in rdp + prv}) == 1  # no per-step time
    model_sha = hashlib.sha256((run / "model.pt").read_bytes()).hexdigest()
    assert r.data.tags["model.sha256"] == model_sha
    assert r.data.tags["status"] == "complete"
    assert r.data.params["config.method"] == "dp-sgd"
    assert float(r.data.params["privacy.noise_multiplier"]) == report["privacy"]["noise_multiplier"]
    assert "config.data.path" not in r.data.params  # paths stay with the custodian
    assert {a.path for a in share.list_artifacts(r.info.run_id)} >= {"privacy_report.json"}

    # custodian: under private_not_for_release/, with the loss, validation and clipping
    db = run / PRIVATE_DIR / "tracking" / "mlflow.db"
    assert db.is_file()
    cust = mlflow.MlflowClient(f"sqlite:///{db}")
    (exp,) = [e for e in cust.search_experiments() if e.name == "dpkfc-med"]
    (c,) = cust.search_runs([exp.experiment_id])
    assert c.info.run_name == f"t-{PRIVATE_DIR}"
    loss = cust.get_metric_history(c.info.run_id, "loss")
    assert sorted(m.step for m in loss) == history["step"]
    assert {"val_auroc", "clipping/clipped_fraction", "epsilon_rdp"} <= set(c.data.metrics)
    assert c.info.status == "FINISHED"

    # the report lists the custodian stream as not covered, kept in-house
    (item,) = [s for s in report["privacy"]["not_covered"] if "tracking stream" in s]
    assert f"{PRIVATE_DIR}/tracking/" in item and "outside" not in item


def test_tensorboard_streams_read_back(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    cfg = _tiny(tmp_path)
    assert (
        main(["train", str(cfg), "--out", str(run), "--set", "tracking.backend=tensorboard"]) == 0
    )
    history = _report(run)["history"]

    share = EventAccumulator(str(run / "tracking"))
    share.Reload()
    tags = share.Tags()["scalars"]
    assert set(tags) == {"privacy/epsilon_rdp", "privacy/epsilon_prv"}
    rdp = share.Scalars("privacy/epsilon_rdp")
    assert [e.step for e in rdp] == history["step"]
    assert [e.value for e in rdp] == pytest.approx(history["epsilon_rdp"])
    assert set(share.Tags()["tensors"]) >= {"recipe/text_summary", "release/text_summary"}

    cust = EventAccumulator(str(run / PRIVATE_DIR / "tracking"))
    cust.Reload()
    tags = set(cust.Tags()["scalars"])
    assert {"loss", "val_auroc", "clipping/clipped_fraction", "epsilon_rdp"} <= tags
    assert [e.step for e in cust.Scalars("loss")] == history["step"]


def test_custodian_uri_named_in_report_but_not_its_value(tmp_path):
    pytest.importorskip("tensorboard")
    run, elsewhere = tmp_path / "run", tmp_path / "custodian_elsewhere"
    argv = [
        "train",
        str(_tiny(tmp_path)),
        "--out",
        str(run),
        "--set",
        "tracking.backend=tensorboard",
        "--set",
        f"tracking.custodian_uri={elsewhere}",
        "--set",
        "training.epochs=1",
    ]
    assert main(argv) == 0
    assert list(elsewhere.glob("events.out.tfevents.*"))
    assert not (run / PRIVATE_DIR / "tracking").exists()
    report = _report(run)
    (item,) = [s for s in report["privacy"]["not_covered"] if "tracking stream" in s]
    assert "outside" in item and "tracking.custodian_uri" in item
    assert str(elsewhere) not in json.dumps(report)  # the place is the custodian's to know
    custodian = json.loads((run / PRIVATE_DIR / "custodian_report.json").read_text("utf-8"))
    assert str(elsewhere) in json.dumps(custodian)


def test_shareable_records_read_only_the_allowlist():
    report = {
        "status": "complete",
        "run": {"config": {"method": "dp-sgd", "tracking": {"backend": "mlflow"}}},
        "privacy": {"accountant": "prv", "noise_multiplier": 1.2, "epsilon": {"prv": 0.5}},
        "history": {
            "step": [1, 2],
            "epsilon_rdp": [0.3, 0.6],
            "epsilon_step": [2],
            "epsilon": [0.5],
            "epsilon_accountant": "prv",
            "loss": [0.7, 0.6],  # a full (custodian) report's: never read
            "val_metric": [0.8],
        },
        "diagnostics": [{"clipped_fraction": 0.5}],
        "metrics": {"val": {"auroc": 0.8}},
    }
    rec = shareable_records(report)
    assert rec["epsilon"] == {"epsilon_rdp": [(1, 0.3), (2, 0.6)], "epsilon_prv": [(2, 0.5)]}
    assert rec["params"]["privacy.noise_multiplier"] == 1.2
    assert rec["params"]["config.tracking.backend"] == "mlflow"
    assert _private_names(rec["params"]) == [] and _private_names(rec["tags"]) == []


def test_not_covered_names_the_custodian_stream():
    def items(tracking):
        return [
            s for s in not_covered({"run": {"config": {"tracking": tracking}}}) if "tracking" in s
        ]

    assert items({"backend": "none"}) == []
    (home,) = items({"backend": "mlflow", "custodian_uri": None})
    assert f"{PRIVATE_DIR}/tracking/" in home
    (away,) = items({"backend": "mlflow", "custodian_uri": "http://ward-server"})
    assert "outside" in away and "ward-server" not in away
    assert home[:40] == away[:40]  # the shareable report matches either by its opening


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (
            ["tracking.backend=mlfow"],
            r"--set tracking\.backend=mlfow: not allowed \(did you mean 'mlflow'",
        ),
        (["tracking.uri=/x"], r"--set tracking\.uri=/x: only applies with tracking\.backend"),
        (
            ["tracking.backend=mlflow", "tracking.uri=file:///x"],
            r"tracking\.uri=file:///x: MLflow's file store is refused.*give a folder",
        ),
        (
            ["tracking.backend=tensorboard", "tracking.custodian_uri=http://server"],
            r"tracking\.custodian_uri=http://server: TensorBoard writes event files to a folder",
        ),
        (
            ["tracking.backend=tensorboard", "tracking.uri=/a", "tracking.custodian_uri=/a"],
            r"tracking\.custodian_uri=/a: the same folder as tracking\.uri would mix",
        ),
    ],
)
def test_config_errors(tmp_path, overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(_tiny(tmp_path), overrides)


def test_missing_package_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # import mlflow now fails
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'dpkfc-med\[tracking\]'"):
        plan_tracking("mlflow", tmp_path)
    assert plan_tracking("none", tmp_path) is None
