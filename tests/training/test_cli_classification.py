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
from dpkfc_med.training.run import train
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
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


def _report(run: Path) -> dict:
    return json.loads((run / "privacy_report.json").read_text(encoding="utf-8"))


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
        "private_not_for_release/metrics.json",
        "private_not_for_release/custodian_report.json",
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
    private = json.loads(
        (out / "private_not_for_release" / "custodian_report.json").read_text(encoding="utf-8")
    )
    assert 0.0 <= private["metrics"]["test"]["auroc"] <= 1.0 and "metrics" not in rep
    md = (out / "privacy_report.md").read_text(encoding="utf-8")
    assert "probe" in md.lower()
    # evaluate on another MedMNIST-format file of the same task; results are custodian-only
    assert main(["evaluate", str(out), "--data", str(BALANCED), "--split", "val"]) == 0
    saved = out / "private_not_for_release" / "evaluations" / "pneumoniamnist_balanced_val.json"
    ev = json.loads(saved.read_text(encoding="utf-8"))
    assert ev["n"] == 270 and 0 <= ev["accuracy"] <= 1
    assert not (out / "evaluations").exists()
    assert ev["overlap_with_training"]["checked"] and ev["overlap_with_training"]["training"] == 96
    assert ev["not_dp"] is (ev["overlap_with_training"]["shared"] > 0)
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
    assert (
        json.loads((tmp_path / "part" / "run.json").read_text(encoding="utf-8"))["status"]
        == "incomplete"
    )
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
        (
            "label_outside_declared",
            r"site\.npz: 1 problem found:\n  - train_labels has 2 label\(s\) >= 2 \(offending "
            r"values \[5\]\), outside the 2 classes 0..1 declared by num_classes",
        ),
        ("labels_skip_a_class", r"(?s)site\.npz.*classes is not declared.*suggest 6 classes"),
        (
            "unit_ids_bad_rows",
            r"units\.csv: 1 problem found:\n  - 19 of the 20 training indices have no row",
        ),
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
    elif case in ("label_outside_declared", "labels_skip_a_class"):
        labels = np.load(PNEUMONIA)["train_labels"][:20].copy()
        labels[[3, 11]] = 5
        path = _bad_npz(tmp_path, train_labels=labels).rename(tmp_path / "site.npz")
        declared = {"num_classes": 2} if case == "label_outside_declared" else {}
        sections["data"] = {"path": str(path), **declared}
    elif case == "unit_ids_bad_rows":
        (tmp_path / "units.csv").write_text("index,unit_id\n0,patient_1\n", encoding="utf-8")
        sections["data"] = {
            "path": str(_bad_npz(tmp_path)),
            "unit_ids": str(tmp_path / "units.csv"),
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
    assert "NO PRIVACY GUARANTEE" in (out / "privacy_report.md").read_text(encoding="utf-8")


def _disjoint_proxy(tmp_path: Path) -> Path:
    """A public proxy of real X-rays that are not in the private training split.

    The balanced file's *training* images are all in pneumoniamnist.npz's training split
    (SOURCES.md), its test images are not; a file name without a MedMNIST flag.
    """
    src = np.load(BALANCED)
    images, labels = src["test_images"], src["test_labels"]
    arrays = {
        f"{s}_{k}": v
        for s in ("train", "val", "test")
        for k, v in (("images", images), ("labels", labels))
    }
    path = tmp_path / "public_xrays.npz"
    np.savez(path, **arrays)
    return path


def test_public_proxy_is_labelled_as_external_data(tmp_path):
    out = tmp_path / "pub"
    cfg = _config(
        tmp_path,
        method="dp-kfc-public",
        probes={"public_data": str(_disjoint_proxy(tmp_path)), "num_probes": 16},
        training={"epochs": 1},
    )
    assert main(["train", str(cfg), "--out", str(out)]) == 0
    pre = _report(out)["preconditioner"]
    assert pre["uses_private_data"] is False
    assert "path" not in pre["external_data"]  # paths stay in the custodian report
    custodian = json.loads(
        (out / "private_not_for_release/custodian_report.json").read_text(encoding="utf-8")
    )
    assert custodian["preconditioner"]["external_data"]["path"].endswith("public_xrays.npz")
    assert len(pre["external_data"]["sha256"]) == 64
    assert pre["probe_source"]["overlap_with_private_train"] == 0
    assert pre["probe_source"]["same_dataset_as_private"] is None


def test_public_proxy_sharing_private_images_is_refused(tmp_path, capsys):
    """pneumoniamnist_balanced's training images are a subset of the private training split."""
    out = tmp_path / "pub"
    probes = {"public_data": str(BALANCED), "num_probes": 16}
    cfg = _config(tmp_path, method="dp-kfc-public", probes=probes, training={"epochs": 1})
    assert main(["train", str(cfg), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"probes.public_data='{BALANCED.resolve()}' overlaps the private training split" in err
    assert f"{PNEUMONIA.resolve()} (4708 images)" in err
    assert "2428 of its training images are identical to private ones" in err
    assert "same MedMNIST dataset ('pneumoniamnist')" in err
    assert "probes.allow_public_overlap: true" in err
    assert not out.exists() or not (out / "run.json").exists()
    # With the explicit override the run goes ahead, and the overlap is on record.
    probes["allow_public_overlap"] = True
    cfg = _config(tmp_path, method="dp-kfc-public", probes=probes, training={"epochs": 1})
    assert main(["train", str(cfg), "--out", str(out)]) == 0
    src = _report(out)["preconditioner"]["probe_source"]
    assert src["overlap_with_private_train"] == 2428 and src["uses_private_data"] is True
    assert src["note"].startswith("shares 2428 images with the private training set")
    assert "NOT covered by the guarantee" in src["note"]


def test_same_medmnist_dataset_at_another_resolution_is_refused(tmp_path):
    """Content hashes cannot match resized copies; the shared MedMNIST flag does."""
    from dpkfc_med.tasks.classification.public_probes import PublicProbeSource

    private = tmp_path / "adrenalmnist3d.npz"
    src = dict(np.load(ADRENAL))
    np.savez(private, **{k: v[:12] for k, v in src.items()})
    public = tmp_path / "adrenalmnist3d_56.npz"  # the same glands, upsampled 2x
    up = {
        k: v[:6].repeat(2, 1).repeat(2, 2).repeat(2, 3) if "images" in k else v[:6]
        for k, v in src.items()
    }
    np.savez(public, **up)
    from dpkfc_med.data import load_medmnist

    kw = {"spatial_shape": (28, 28, 28), "channels": 1, "num_classes": 2, "task": "classification"}
    with pytest.raises(ValueError, match=r"same MedMNIST dataset \('adrenalmnist3d'\)"):
        PublicProbeSource(str(public), private=load_medmnist(private), **kw)
    ok = PublicProbeSource(str(public), private=load_medmnist(private), allow_overlap=True, **kw)
    assert ok.describe()["overlap_with_private_train"] == 0
    assert ok.describe()["same_dataset_as_private"] == "adrenalmnist3d"
    assert "NOT covered by the guarantee" in ok.describe()["note"]


def test_3d_public_proxy_serves_a_2d_task_through_its_central_slices(tmp_path):
    """Each volume gives its three central slices; a 2D proxy for a 3D task is refused."""
    from dpkfc_med.tasks.classification.public_probes import PublicProbeSource

    src = dict(np.load(ADRENAL))
    public = tmp_path / "volumes.npz"
    np.savez(public, **{k: v[:3] for k, v in src.items()})
    kw = {"channels": 1, "num_classes": 2, "task": "classification"}
    proxy = PublicProbeSource(str(public), spatial_shape=(28, 28), **kw)
    vol = torch.as_tensor(src["train_images"][:3], dtype=torch.float64) / 255.0
    expected = torch.cat([vol[:, 14], vol[:, :, 14], vol[:, :, :, 14]]).unsqueeze(1)
    assert proxy.images.shape == (9, 1, 28, 28)
    torch.testing.assert_close(proxy.images.double(), expected, atol=1e-6, rtol=0)
    assert proxy.describe()["images"].startswith("central slice of each volume")
    x, y = proxy.sample(5, seed=0)
    assert x.shape == (5, 1, 28, 28) and y.shape == (5,)
    flat = tmp_path / "flat.npz"
    np.savez(flat, **{k: v[:3] for k, v in dict(np.load(PNEUMONIA)).items()})
    with pytest.raises(ValueError, match=r"holds 2D images but the private task is 3D"):
        PublicProbeSource(str(flat), spatial_shape=(28, 28, 28), **kw)


def test_patient_units_end_to_end(tmp_path):
    """A unit-id CSV makes the patient the unit of the run, its delta and its report."""
    csv = tmp_path / "adrenal_patients.csv"
    rows = [f"{i},patient_{i // 2}" for i in range(1188)]  # two glands per patient
    csv.write_text("index,unit_id\n" + "\n".join(rows) + "\n", encoding="utf-8")
    cfg = _config(
        tmp_path,
        method="dp-sgd",
        data={"path": str(ADRENAL), "max_train": 24, "max_eval": 16, "unit_ids": str(csv)},
        training={"epochs": 1, "batch_size": 8},
    )
    out = tmp_path / "units"
    assert main(["train", str(cfg), "--out", str(out)]) == 0
    rep = _report(out)
    assert rep["data"]["privacy_unit"] == "patient (unit ids from adrenal_patients.csv)"
    assert rep["data"]["num_train_units"] == 24 and rep["data"]["max_samples_per_unit"] is None
    assert "units" not in rep["data"] and rep["data"]["splits"]["train"] == 24  # patients
    private = json.loads(
        (out / "private_not_for_release" / "custodian_report.json").read_text(encoding="utf-8")
    )
    assert private["data"]["units"]["images_per_unit"]["max"] == 2
    assert private["data"]["units"]["train_images"] == 48
    assert rep["privacy"]["sample_rate"] == pytest.approx(1 / 3)  # 8 of 24 patients
    assert "one patient (unit ids from adrenal_patients.csv)" in rep["privacy"]["guarantee"]
    assert rep["privacy"]["delta"] <= 1 / 24


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
    from dpkfc_med.tasks.classification.task import ResizeImage

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


def test_version_matches_the_package_metadata(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"dpkfc-med {version('dpkfc_med')}"
    root = Path(__file__).resolve().parents[2]
    assert "Apache License" in (root / "LICENSE").read_text(encoding="utf-8")[:200]
    assert 'license = { text = "Apache-2.0" }' in (root / "pyproject.toml").read_text(
        encoding="utf-8"
    )


def test_set_override_errors_name_the_override_not_the_file(tmp_path, capsys):
    cfg = Path(__file__).resolve().parents[2] / "configs" / "pneumoniamnist_cnn_2d_eps1.yaml"
    out = tmp_path / "run"
    code = main(["train", str(cfg), "--out", str(out), "--set", "training.lr=abc"])
    err = capsys.readouterr().err
    assert code == 2 and not out.exists()
    assert "config error in the --set overrides" in err
    assert "--set training.lr=abc: must be a number" in err
    assert "pneumoniamnist_cnn_2d_eps1.yaml" not in err
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        cfg.read_text(encoding="utf-8").replace("recipe: auto", "recipie: auto"),
        encoding="utf-8",
    )
    assert main(["train", str(bad), "--out", str(out), "--set", "training.lrr=1"]) == 2
    err = capsys.readouterr().err
    assert f"{bad} and its --set overrides" in err
    assert "--set training.lrr=1: unknown field (did you mean 'lr'?)" in err
    assert "\n  training.recipie: unknown field" in err


@pytest.mark.parametrize("family", ["shampoo", "diagonal"])
def test_train_with_another_preconditioner_family(family, tmp_path):
    cfg = _config(tmp_path, preconditioner={"calibration_samples": 4, "family": family})
    run = tmp_path / "run"
    assert main(["train", str(cfg), "--out", str(run), "--set", "training.epochs=1"]) == 0
    report = _report(run)
    pre = report["preconditioner"]
    assert pre["config"]["family"] == family
    assert {r["family"] for r in pre["coverage"]} == {family}
    assert report["privacy"]["epsilon"]["prv"] <= 4.0
    assert pre["uses_private_data"] is False
    text = (run / "privacy_report.md").read_text(encoding="utf-8")
    assert f"a {family.capitalize()} preconditioner" in text or f"a {family} preconditioner" in text


def test_train_in_bf16_reports_its_precision(tmp_path):
    """A bf16 run trains, spends within the target and says in the report how it computed."""
    cfg = _config(tmp_path, training={"precision": "bf16", "epochs": 1})
    run = tmp_path / "run"
    assert main(["train", str(cfg), "--out", str(run)]) == 0
    report = _report(run)
    assert report["run"]["precision"] == "bf16"
    assert report["privacy"]["epsilon"]["prv"] <= 4.0
    text = (run / "privacy_report.md").read_text(encoding="utf-8")
    assert "bfloat16 forward/backward; per-sample gradients" in text


def test_option_errors_name_the_option_typed(tmp_path, capsys):
    cfg = Path(__file__).resolve().parents[2] / "configs" / "pneumoniamnist_cnn_2d_eps1.yaml"
    assert main(["train", str(cfg), "--out", str(tmp_path / "r"), "--epsilon", "-1"]) == 2
    err = capsys.readouterr().err
    assert "config error in the command-line options" in err
    assert "--epsilon -1.0: must be a positive number" in err and "--set" not in err


def test_batch_above_the_unit_count_is_said_and_accounting_stays_quiet(tmp_path, capsys):
    import warnings

    cfg = _config(tmp_path, method="dp-sgd", data={"max_train": 20}, training={"epochs": 1})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["train", str(cfg), "--out", str(tmp_path / "r")]) == 0
    err = capsys.readouterr().err
    assert "training.batch_size=32 is more than the 20 training units" in err and "q = 1" in err
    assert not [w for w in caught if "divide by zero" in str(w.message)]
