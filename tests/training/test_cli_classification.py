"""End-to-end CLI tests of the classification pipeline on small slices of real MedMNIST data."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from opacus.accountants import PRVAccountant

from dpkfc_med.cli import main
from dpkfc_med.privacy.accounting import PrivacyLedger
from dpkfc_med.training.config import load_config
from dpkfc_med.training.loop import train
from tests.conftest import SHARED_DATA

PNEUMONIA = Path(SHARED_DATA) / "medmnist" / "pneumoniamnist.npz"
BALANCED = Path(SHARED_DATA) / "medmnist" / "pneumoniamnist_balanced.npz"
ADRENAL = Path(SHARED_DATA) / "medmnist3d" / "adrenalmnist3d.npz"


def _config(tmp_path: Path, **sections) -> Path:
    cfg = {
        "name": "t",
        "method": "dp-kfc",
        "data": {"path": str(PNEUMONIA), "max_train": 96, "max_eval": 48},
        "model": {"name": "small_cnn"},
        "privacy": {"target_epsilon": 4.0, "max_grad_norm": 1.0},
        "training": {
            "epochs": 2,
            "batch_size": 32,
            "lr": 0.05,
            "progress": False,
            "eval_batch_size": 64,
        },
        "probes": {"preset": "xray", "num_probes": 32, "refresh_every": 2},
        "preconditioner": {"calibration_samples": 4},
    }
    for key, value in sections.items():
        if isinstance(value, dict):
            cfg.setdefault(key, {}).update(value)
        else:
            cfg[key] = value
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _report(run: Path) -> dict:
    return json.loads((run / "privacy_report.json").read_text())


def _opacus_epsilon(report: dict) -> float:
    p = report["privacy"]
    acc = PRVAccountant()
    acc.history = [(p["noise_multiplier"], p["sample_rate"], p["steps"])]
    return acc.get_epsilon(p["delta"])


def test_train_2d_dp_kfc_report_and_evaluate(tmp_path, capsys):
    from dpkfc_med.report import check_report

    out = tmp_path / "run"
    assert main(["train", str(_config(tmp_path)), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "epsilon =" in printed and "test auroc" in printed
    for name in (
        "privacy_report.json",
        "privacy_report.md",
        "model.pt",
        "metrics.json",
        "ledger.json",
    ):
        assert (out / name).is_file(), name
    rep = _report(out)
    check_report(rep)
    assert rep["status"] == "complete"
    assert rep["privacy"]["sampler"] == "poisson" and rep["privacy"]["steps"] == 6
    assert rep["privacy"]["epsilon"]["prv"] == pytest.approx(_opacus_epsilon(rep), rel=1e-9)
    assert rep["privacy"]["epsilon"]["prv"] <= 4.0
    assert rep["preconditioner"]["uses_private_data"] is False
    assert [r["step"] for r in rep["preconditioner"]["refreshes"]] == [0, 2, 4]
    assert 0.0 <= rep["metrics"]["test"]["auroc"] <= 1.0
    md = (out / "privacy_report.md").read_text()
    assert "probe" in md.lower()
    # evaluate on another MedMNIST-format file of the same task
    assert main(["evaluate", str(out), "--data", str(BALANCED), "--split", "val"]) == 0
    ev = json.loads((out / "evaluations" / "pneumoniamnist_balanced_val.json").read_text())
    assert ev["n"] == 270 and 0 <= ev["accuracy"] <= 1
    assert main(["report", str(out)]) == 0


def test_train_3d_dp_sgd(tmp_path):
    cfg = _config(
        tmp_path,
        method="dp-sgd",
        data={"path": str(ADRENAL), "max_train": 48, "max_eval": 24},
        training={"epochs": 1, "batch_size": 16},
    )
    out = tmp_path / "run3d"
    assert main(["train", str(cfg), "--out", str(out)]) == 0
    rep = _report(out)
    assert rep["task"]["spatial_dims"] == 3 and rep["preconditioner"] is None
    assert rep["privacy"]["epsilon"]["prv"] == pytest.approx(_opacus_epsilon(rep), rel=1e-9)


def test_resume_continues_the_ledger_exactly(tmp_path):
    cfg_path = _config(tmp_path, method="dp-sgd", training={"epochs": 3})
    full = load_config(cfg_path, [f"output.dir={tmp_path / 'full'}"])
    train(full)
    part = load_config(cfg_path, [f"output.dir={tmp_path / 'part'}"])
    first = train(part, stop_after_epochs=1)
    assert first.status == "incomplete"
    assert json.loads((tmp_path / "part" / "run.json").read_text())["status"] == "incomplete"
    assert _report(tmp_path / "part")["status"] == "incomplete"
    resumed = train(part, resume=True)
    assert resumed.status == "complete"
    a = PrivacyLedger.load(tmp_path / "full" / "ledger.json")
    b = PrivacyLedger.load(tmp_path / "part" / "ledger.json")
    assert a.events == b.events and a.steps == 9
    assert (
        _report(tmp_path / "part")["privacy"]["epsilon"]
        == _report(tmp_path / "full")["privacy"]["epsilon"]
    )


def test_steps_spent_after_a_checkpoint_are_never_forgotten(tmp_path):
    cfg_path = _config(tmp_path, method="dp-sgd", training={"epochs": 3})
    cfg = load_config(cfg_path, [f"output.dir={tmp_path / 'r'}"])
    train(cfg, stop_after_epochs=1)
    ledger = PrivacyLedger.load(tmp_path / "r" / "ledger.json")
    ledger.record(
        ledger.events[0].sample_rate, ledger.events[0].noise_multiplier, 2
    )  # crash mid-epoch
    train(cfg, resume=True)
    final = PrivacyLedger.load(tmp_path / "r" / "ledger.json")
    assert final.steps == 9  # plan respected, the 2 orphan steps counted, none dropped
    assert _report(tmp_path / "r")["privacy"]["steps"] == 9


def _bad_npz(tmp_path: Path, **changes) -> Path:
    data = dict(np.load(PNEUMONIA))
    data = {k: v[:20] for k, v in data.items()}
    for key, value in changes.items():
        if value is None:
            data.pop(key)
        else:
            data[key] = value
    path = tmp_path / "pneumoniamnist.npz"  # the name tells the loader it is a 2-class task
    np.savez(path, **data)
    return path


@pytest.mark.parametrize(
    ("case", "pattern"),
    [
        ("missing_file", r"could not find data"),
        ("missing_key", r"test_labels"),
        ("label_range", r"label"),
        ("non_finite", r"non-finite|NaN"),
        ("empty_split", r"empty"),
        ("impossible_budget", r"target_epsilon"),
        ("plan_exceeds", r"spends epsilon"),
        ("unknown_model", r"did you mean 'densenet121'"),
        ("config_typo", r"training.optimiser: unknown field \(did you mean 'optimizer'\?\)"),
        ("network_too_deep", r"DenseNet121 fails on inputs of size 28x28.*data.resize"),
        ("constant_output", r"features.norm5: GroupNorm normalises a single value per group"),
        ("resize_axes", r"data.resize=\[64\]: must be 2 positive integers"),
        ("adambc_gamma", r"training.adambc_gamma=-1.0: must be a positive number"),
        ("optimizer_choice", r"training.optimizer='adamw': not allowed.*'adambc'"),
        ("refresh_every", r"probes.refresh_every='weekly': must be 'auto' or a whole number"),
        ("refresh_budget", r"probes.refresh_budget=2.0: must be a share of training time"),
    ],
)
def test_bad_input_clear_error_and_nothing_written(case, pattern, tmp_path, capsys):
    sections: dict = {}
    if case == "missing_file":
        sections["data"] = {"path": str(tmp_path / "nope.npz")}
    elif case == "missing_key":
        sections["data"] = {"path": str(_bad_npz(tmp_path, test_labels=None))}
    elif case == "label_range":
        sections["data"] = {
            "path": str(_bad_npz(tmp_path, train_labels=np.full((20, 1), 7, np.uint8)))
        }
    elif case == "non_finite":
        imgs = np.load(PNEUMONIA)["train_images"][:20].astype(np.float32)
        imgs[0, 0, 0] = np.nan
        sections["data"] = {"path": str(_bad_npz(tmp_path, train_images=imgs))}
    elif case == "empty_split":
        sections["data"] = {
            "path": str(
                _bad_npz(
                    tmp_path,
                    val_images=np.zeros((0, 28, 28), np.uint8),
                    val_labels=np.zeros((0, 1), np.uint8),
                )
            )
        }
    elif case == "impossible_budget":
        sections["privacy"] = {"target_epsilon": 1e-6}
    elif case == "plan_exceeds":
        sections["privacy"] = {"noise_multiplier": 0.3, "target_epsilon": 1.0}
    elif case == "unknown_model":
        sections["model"] = {"name": "densnet121"}
    elif case == "config_typo":
        sections["training"] = {"optimiser": "sgd"}
    elif case == "network_too_deep":
        sections["model"] = {"name": "densenet121"}
    elif case == "constant_output":  # 28x28 reaches 1x1 before the last dense block
        kw = {"init_features": 8, "growth_rate": 4, "block_config": [1, 1, 1]}
        sections["model"] = {"name": "densenet121", "kwargs": kw}
    elif case == "resize_axes":
        sections["data"] = {"resize": [64]}
    elif case == "adambc_gamma":
        sections["training"] = {"optimizer": "adambc", "adambc_gamma": -1.0}
    elif case == "optimizer_choice":
        sections["training"] = {"optimizer": "adamw"}
    elif case == "refresh_every":
        sections["probes"] = {"preset": "xray", "refresh_every": "weekly"}
    elif case == "refresh_budget":
        sections["probes"] = {"preset": "xray", "refresh_budget": 2.0}
    out = tmp_path / "run"
    code = main(["train", str(_config(tmp_path, **sections)), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2
    assert __import__("re").search(pattern, err), err
    assert not (out / "run.json").exists() and not (out / "privacy_report.json").exists()


def test_nonprivate_run_reports_no_guarantee(tmp_path):
    out = tmp_path / "np"
    cfg = _config(tmp_path, method="nonprivate", training={"epochs": 1})
    assert main(["train", str(cfg), "--out", str(out)]) == 0
    rep = _report(out)
    assert rep["privacy"]["private"] is False and rep["privacy"]["epsilon"] is None
    assert "NO PRIVACY GUARANTEE" in (out / "privacy_report.md").read_text()


def test_public_proxy_is_labelled_as_external_data(tmp_path):
    out = tmp_path / "pub"
    cfg = _config(
        tmp_path,
        method="dp-kfc-public",
        probes={"public_data": str(BALANCED), "num_probes": 16},
        training={"epochs": 1},
    )
    assert main(["train", str(cfg), "--out", str(out)]) == 0
    pre = _report(out)["preconditioner"]
    assert pre["uses_private_data"] is False
    assert pre["external_data"]["path"].endswith("pneumoniamnist_balanced.npz")
    assert len(pre["external_data"]["sha256"]) == 64


def test_resize_reaches_network_probes_and_report(tmp_path):
    out = tmp_path / "rs"
    cfg = _config(
        tmp_path,
        data={"resize": [32, 32], "max_train": 32, "max_eval": 16},
        training={"epochs": 1, "batch_size": 16},
    )
    assert main(["train", str(cfg), "--out", str(out)]) == 0
    rep = _report(out)
    assert rep["data"]["resize"] == [32, 32]
    assert rep["preconditioner"]["probe_source"]["spatial_shape"] == [32, 32]
    from dpkfc_med.training.tasks import ResizeImage

    img = torch.arange(28 * 28, dtype=torch.float32).reshape(1, 28, 28)
    out_img = ResizeImage((32, 32))(img)
    assert type(out_img) is torch.Tensor and out_img.shape == (1, 32, 32)
    # bilinear resizing keeps a linear ramp's range
    assert out_img.min() >= img.min() - 1e-4 and out_img.max() <= img.max() + 1e-4


def test_adambc_subtracts_the_runs_own_noise_variance(tmp_path):
    """training.optimizer=adambc: Phi = (sigma C / B)^2 of the run, gamma defaults to Phi."""
    out = tmp_path / "run"
    cfg = _config(tmp_path, training={"optimizer": "adambc", "lr": 0.003, "epochs": 1})
    assert main(["train", str(cfg), "--out", str(out)]) == 0
    p = _report(out)["privacy"]
    phi = (p["noise_multiplier"] * 1.0 / 32) ** 2
    groups = torch.load(out / "checkpoint.pt", weights_only=False)["optimizer"]["param_groups"]
    assert groups[0]["noise_variance"] == pytest.approx(phi, rel=1e-12)
    assert groups[0]["gamma"] == pytest.approx(phi, rel=1e-12)
