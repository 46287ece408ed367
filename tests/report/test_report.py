"""Privacy report: schema validation, the shareable/custodian split and the files written."""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
from enum import Enum
from pathlib import Path

import numpy as np
import pytest

from dpkfc_med.report import (
    REPORT_FILES,
    REPORT_SCHEMA,
    ReportSchemaError,
    check_report,
    render_html,
    rerender,
    split_report,
    validate_custodian_report,
    validate_report,
    write_report,
)
from dpkfc_med.report.custodian import CUSTODIAN_FILES, CUSTODIAN_ONLY

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
DELETE = object()


def sha_hex(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def example_report(**overrides):
    """The shareable part of :func:`example_full` (same ``overrides``)."""
    return split_report(example_full(**overrides))[0]


def example_custodian(**overrides):
    """The custodian part of :func:`example_full` (same ``overrides``)."""
    return split_report(example_full(**overrides))[1]


def example_full(**overrides):
    """A complete DP-KFC classification report as the pipeline assembles it (both parts).

    ``overrides`` set nested fields by ``__``-joined paths, e.g. ``privacy__delta=2.0``;
    the value ``DELETE`` removes the field.
    """
    steps = list(range(0, 101, 10))
    report = {
        "schema": REPORT_SCHEMA,
        "status": "complete",
        "created": "2024-05-01T12:00:00+00:00",
        "run": {
            "name": "breastmnist-dpkfc",
            "run_dir": "runs/breastmnist-dpkfc",
            "config_sha256": sha_hex("config"),
            "config": {
                "method": "dp-kfc",
                "privacy": {"target_epsilon": 2.0},
                "data": {
                    "path": "/data/ward7/breastmnist.npz",
                    "unit_ids": "/data/ward7/ids.csv",
                    "split_file": "/data/ward7/splits.json",
                },
                "probes": {"public_data": "/data/public/proxy.npz"},
                "pretrain": {"cache_dir": "/data/ward7/cache"},
                "output": {"dir": "runs/{name}"},
                # path fields, to test their move (a real config sets them with a backend)
                "tracking": {
                    "backend": "none",
                    "uri": "https://tracking.example.org",
                    "custodian_uri": "/data/ward7/tracking",
                },
            },
            "seed": 0,
            "device": "cpu",
        },
        "task": {
            "kind": "classification",
            "spatial_dims": 2,
            "num_classes": 2,
            "label_names": ["malignant", "benign"],
        },
        "data": {
            "path": "medmnist/breastmnist.npz",
            "sha256": {"breastmnist.npz": sha_hex("data")},
            "splits": {"train": 546, "val": 78, "test": 156},
            "class_counts": {"train": [147, 399]},
            "split": {"train": ["case_001"], "val": ["case_002"], "test": ["case_003"]},
            "units": {"images_per_unit": {"min": 1, "max": 2, "mean": 1.5}, "train_images": 819},
            "num_train_units": 546,
            "privacy_unit": "image",
            "max_samples_per_unit": 1,
        },
        "model": {
            "name": "DenseNet121",
            "num_params": 6_953_856,
            "fixes": [
                {
                    "path": "features.norm0",
                    "before": "BatchNorm2d(64)",
                    "after": "GroupNorm(32, 64)",
                    "reason": "BatchNorm mixes samples",
                }
            ],
        },
        "privacy": {
            "method": "dp-kfc",
            "private": True,
            "accountant": "prv",
            "epsilon": {"prv": 1.23401, "rdp": 1.4102, "pld": 1.2338, "max": 1.4102},
            "target_epsilon": 2.0,
            "delta": 1e-5,
            "sampler": "poisson",
            "sample_rate": 0.1172,
            "expected_batch_size": 64,
            "noise_multiplier": 1.1,
            "max_grad_norm": 1.0,
            "steps": 100,
            "planned_steps": 100,
            "epochs": 11.72,
            "secure_rng": False,
            "randomness": {"source": "os-entropy", "valid_dp_release": True},
            "not_covered": ["Hyperparameter tuning on the private data."],
            "neighbouring_relation": "add/remove one image of the training set",
            "guarantee": "Releasing every model parameter update is (epsilon, delta)-DP.",
            "hyperparameter_tuning": "Hyperparameters were fixed in advance on public data.",
            "ledger": {
                "schema": "dpkfc_med.ledger/1",
                "delta": 1e-5,
                "events": [{"sample_rate": 0.1172, "noise_multiplier": 1.1, "steps": 100}],
                "steps": 100,
            },
        },
        "preconditioner": {
            "uses_private_data": False,
            "external_data": None,
            "probe_source": {
                "path": "/data/public/proxy.npz",
                "source": "ImageProbeSource",
                "uses_private_data": False,
                "kind": "pink",
                "alpha": 3.2,
                "preset": "mammography",
            },
            "refresh_every": 50,
            "refreshes": [
                {"step": 0, "probe_seed": 0, "seconds": 0.4, "scale": 1.3},
                {"step": 50, "probe_seed": 1, "seconds": 0.4, "scale": 1.2},
                {"step": 100, "probe_seed": 2, "seconds": 0.4, "scale": 1.1},
            ],
            "covered_layers": ["features.conv0", "classifier"],
            "config": {"damping_g": 0.1, "num_probes": 256},
            "coverage": [
                {
                    "layer": "features.conv0",
                    "type": "Conv2d",
                    "adapter": "conv",
                    "groups": 1,
                    "A_dim": 147,
                    "G_dim": 64,
                    "A": "full",
                    "G": "full",
                    "scale": 1.1,
                    "params": 9408,
                }
            ],
        },
        "training": {
            "optimizer": "sgd",
            "lr": 0.5,
            "epochs": 12,
            "batch_size": 64,
            "selected_epoch": 3,
        },
        "history": {
            "step": steps,
            "epsilon": [0.0, *[0.1 * i + 0.2 for i in range(1, len(steps))]],
            "loss": [0.7 - 0.02 * i for i in range(len(steps))],
            "val_epoch": [1, 2, 3],
            "val_metric": [0.6, 0.7, 0.75],
            "val_metric_name": "auroc",
        },
        "metrics": {
            "val": {"accuracy": 0.8, "auroc": 0.75},
            "test": {
                "n": 156,
                "accuracy": 0.81,
                "auroc": 0.79,
                "per_class": {
                    "malignant": {"sensitivity": 0.5, "specificity": 0.9, "support": 42},
                    "benign": {"sensitivity": 0.9, "specificity": 0.5, "support": 114},
                },
                "confusion_matrix": [[21, 21], [11, 103]],
            },
        },
        "diagnostics": {"mean_clipped_fraction": 0.93, "layer_share": {"classifier": 0.4}},
        "environment": {
            "python": "3.11.7",
            "platform": "Linux-x86_64",
            "machine": {"cpu_count": 2, "torch_threads": 1, "accelerators": []},
            "packages": {"torch": "2.4.0", "opacus": "1.5.2", "medmnist": None},
            "git": {"commit": "a" * 40, "dirty": False},
        },
    }
    for key, value in overrides.items():
        *parents, leaf = key.split("__")
        node = report
        for part in parents:
            node = node[part]
        if value is DELETE:
            del node[leaf]
        else:
            node[leaf] = value
    return report


def example_nonprivate(**overrides):
    report = example_report(**overrides)
    report["privacy"].update(
        method="nonprivate",
        private=False,
        epsilon=None,
        target_epsilon=None,
        delta=None,
        sampler=None,
        sample_rate=None,
        expected_batch_size=None,
        noise_multiplier=None,
        max_grad_norm=None,
        guarantee="None: the model was trained without differential privacy.",
    )
    report["preconditioner"] = None
    report["history"]["epsilon"] = []
    return report


# --------------------------------------------------------------------------- validation
def test_example_report_is_valid():
    assert validate_report(example_report()) == []
    assert validate_report(example_nonprivate()) == []
    check_report(example_report())


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"privacy__epsilon__prv": DELETE}, r"privacy\.epsilon\.prv: missing"),
        ({"privacy__delta": 2.0}, r"privacy\.delta: must be a number in \(0, 1\), got 2\.0"),
        ({"privacy__delta": math.nan}, r"privacy\.delta: must be a number in \(0, 1\)"),
        ({"schema": "other/2"}, r"schema: must be 'dpkfc_med\.privacy_report/2'"),
        ({"status": "complet"}, r"status: must be one of .*\(did you mean 'complete'\?\)"),
        ({"created": "yesterday"}, r"created: must be an ISO-8601 date or date-time"),
        ({"run__config_sha256": "abc"}, r"run\.config_sha256: must be a 64-character hex"),
        ({"task__spatial_dims": 4}, r"task\.spatial_dims: must be one of 2, 3, got 4"),
        ({"task__label_names": ["a"]}, r"task\.label_names: must have num_classes=2 entries"),
        ({"data__max_samples_per_unit": 0}, r"data\.max_samples_per_unit: must be an integer >= 1"),
        ({"privacy__sampler": "uniform"}, r"privacy\.sampler: must be one of 'poisson'"),
        ({"privacy__noise_multiplier": 0.0}, r"privacy\.noise_multiplier: must be a number > 0"),
        ({"privacy__private": False}, r"privacy\.private: must be true for method 'dp-kfc'"),
        ({"privacy__epsilon__max": 1.3}, r"privacy\.epsilon\.max: must be the largest"),
        ({"privacy__steps": True}, r"privacy\.steps: must be an integer >= 0, got True"),
        ({"preconditioner__uses_private_data": True}, r"uses_private_data: must be false"),
        ({"preconditioner": None}, r"preconditioner: must describe the preconditioner"),
        ({"preconditioner__refreshes": [{"step": 0}]}, r"refreshes\[0\]\.probe_seed: missing"),
        ({"history__epsilon": [1.0]}, r"history\.epsilon: must have the length of history\.s"),
        ({"privacy__randomness": DELETE}, r"privacy\.randomness: missing"),
        ({"environment__git": {"commit": "abc"}}, r"environment\.git\.dirty: missing"),
        ({"run__config": {"x": object()}}, r"run\.config\.x: value of type object is not JSON"),
    ],
)
def test_invalid_fields_are_named(overrides, message):
    with pytest.raises(ReportSchemaError, match=message):
        check_report(example_report(**overrides))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"history__loss": [1.0]}, r"history\.loss: must have the length of history\.step"),
        (
            {"metrics__test__confusion_matrix": [[1, 2]]},
            r"metrics\.test\.confusion_matrix: must be a square",
        ),
    ],
)
def test_invalid_custodian_fields_are_named(overrides, message, tmp_path):
    with pytest.raises(ReportSchemaError, match="custodian report: " + message):
        write_report(example_report(), tmp_path, custodian=example_custodian(**overrides))
    assert not list(tmp_path.iterdir())  # nothing is written then


@pytest.mark.parametrize("dotted", list(CUSTODIAN_ONLY))
def test_shareable_report_refuses_every_unnoised_private_statistic(dotted):
    full, report = example_full(), example_report()
    if dotted.startswith("preconditioner.external_data"):  # a public-proxy run has one
        ext = {"path": "/data/public/proxy.npz", "sha256": sha_hex("pub"), "note": "public"}
        kw = {"privacy__method": "dp-kfc-public", "preconditioner__external_data": ext}
        full, report = example_full(**kw), split_report(example_full(**kw))[0]
    if dotted in ("model.pretrained.path", "run.config.model.pretrained"):  # pretrained weights
        weights = {"path": "/data/ward7/w.pt", "sha256": sha_hex("w"), "source": "public"}
        kw = {"run__config__model": {"pretrained": weights["path"]}, "model__pretrained": weights}
        full, report = example_full(**kw), split_report(example_full(**kw))[0]
    node, back = full, report
    *parents, leaf = dotted.split(".")
    for part in parents:
        node, back = node[part], back[part]
    assert leaf not in back  # split_report moved it ...
    back[leaf] = node[leaf]  # ... and putting it back is refused by name
    assert any(
        p.startswith(f"{dotted}: must not be in the shareable report")
        for p in validate_report(report)
    )


def test_split_report_moves_private_statistics_to_the_custodian():
    report, custodian = split_report(example_full())
    assert validate_report(report) == [] and validate_custodian_report(custodian) == []
    text = json.dumps(report)
    for needle in (
        '"loss"',
        '"confusion_matrix"',
        '"class_counts"',
        sha_hex("data"),
        '"val_metric"',
    ):
        assert needle not in text, needle
    assert custodian["history"]["loss"] == example_full()["history"]["loss"]
    assert custodian["metrics"] == example_full()["metrics"]
    # a synthetic-probe run has no external data, so no path of it to move
    # nor pretrained weights
    assert set(report["custodian"]["items"]) == set(CUSTODIAN_ONLY) - {
        "preconditioner.external_data.path",
        "model.pretrained.path",
        "run.config.model.pretrained",
    }
    assert "case_001" not in text and custodian["data"]["split"]["train"] == ["case_001"]


def test_all_problems_are_reported_at_once():
    report = example_report(privacy__delta=-1, status="done", model__name=DELETE)
    problems = validate_report(report)
    assert len(problems) == 3, problems
    with pytest.raises(ReportSchemaError) as err:
        write_report(report, "unused")
    assert err.value.problems == tuple(problems)


def test_method_consistency_rules():
    leaky = _with(example_nonprivate(), ("privacy", "epsilon"), {"prv": 1.0})
    assert any(p.startswith("privacy.epsilon: must be null") for p in validate_report(leaky))
    sgd_flag = _with(example_report(), ("privacy", "private"), False)
    assert "privacy.private: must be true for method 'dp-kfc'" in validate_report(sgd_flag)
    sgd = _with(example_report(), ("privacy", "method"), "dp-sgd")
    assert any("must be null for method 'dp-sgd'" in p for p in validate_report(sgd))
    public = _with(example_report(), ("privacy", "method"), "dp-kfc-public")
    assert any("external_data: must name" in p for p in validate_report(public))
    public["preconditioner"]["external_data"] = {
        "sha256": {"a.png": sha_hex("a")},
        "note": "public mammograms, CC-BY",
    }
    assert validate_report(public) == []  # its path is in the custodian report


def _with(report, path, value):
    report = copy.deepcopy(report)
    node = report
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    return report


def test_enums_paths_and_numpy_values_are_accepted(tmp_path):
    class Method(str, Enum):
        DP_KFC = "dp-kfc"

    report = example_report(privacy__method=Method.DP_KFC, data__path=Path("a/b.npz"))
    custodian = example_custodian()
    custodian["history"]["loss"] = np.asarray(custodian["history"]["loss"])
    custodian["metrics"]["test"]["auroc"] = np.float64("nan")  # one-class split
    report["privacy"]["steps"] = np.int64(100)
    assert validate_report(report) == []
    paths = write_report(report, tmp_path, custodian=custodian)
    stored = json.loads(paths["json"].read_text(encoding="utf-8"))
    assert stored["privacy"]["method"] == "dp-kfc"
    private = json.loads(paths["custodian_json"].read_text(encoding="utf-8"))
    assert private["metrics"]["test"]["auroc"] is None  # strict JSON has no NaN
    assert isinstance(private["history"]["loss"], list)


# --------------------------------------------------------------------------- files
@pytest.fixture(scope="module")
def written(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    return run_dir, write_report(example_report(), run_dir, custodian=example_custodian())


def test_write_report_produces_all_files(written):
    run_dir, paths = written
    custodian_keys = {f"custodian_{k}" for k in CUSTODIAN_FILES}
    assert set(paths) == set(REPORT_FILES) | custodian_keys
    for key, rel in REPORT_FILES.items():
        assert paths[key] == run_dir / rel and paths[key].is_file()
    for key, rel in CUSTODIAN_FILES.items():
        assert paths[f"custodian_{key}"] == run_dir / rel and (run_dir / rel).is_file()
    assert json.loads(paths["json"].read_text(encoding="utf-8")) == example_report()
    for key in ("epsilon_plot", "custodian_training_plot"):
        assert paths[key].read_bytes().startswith(PNG_MAGIC)
    assert not [p for p in run_dir.rglob("*") if p.name.endswith(".tmp")]
    umask = os.umask(0)
    os.umask(umask)
    assert paths["json"].stat().st_mode & 0o777 == 0o666 & ~umask


def test_markdown_states_the_guarantee(written):
    md = written[1]["markdown"].read_text(encoding="utf-8")
    assert md.startswith("# Privacy report: breastmnist-dpkfc")
    assert (
        "(epsilon, delta) = (1.235, 1e-5) for the add/remove-one-image relation, Poisson "
        "sampling at rate q = 0.1172, by the PRV accountant that planned the run |"
    ) in md
    # the other accountants: in the technical part, as bounds on the same mechanism
    assert "### Other accountants: bounds on the same mechanism" in md
    assert "| RDP (Opacus; Mironov 2017) | 1.411 | a looser bound on the same mechanism" in md
    assert (
        "No: built from synthetic probes only (ImageProbeSource, pink noise, exponent alpha = "
        "3.2, preset mammography, seeds 0-2)"
    ) in md
    for section in (
        "Privacy guarantee",
        "Mechanism parameters",
        "Preconditioner provenance",
        "Data",
        "Model",
        "What the guarantee does not cover",
        "Training settings and privacy spent",
        "Hyperparameter tuning",
        "Reproducibility",
    ):
        assert f"\n## {section}\n" in md
    for section in ("Results", "Training curves", "Diagnostics"):  # custodian report only
        assert f"\n## {section}\n" not in md
    assert md.index("## Summary") < md.index("## Privacy guarantee")
    assert "![Privacy spent (epsilon) against training step](plots/epsilon.png)" in md
    assert "training.png" not in md
    assert "must not leave the data custodian" in md
    assert "| features.conv0 | Conv2d | conv |" in md
    assert "| **malignant** | 21 | 21 |" not in md  # the confusion matrix stays private
    assert "GroupNorm(32, 64)" in md
    assert sha_hex("data") not in md and "a" * 40 in md
    assert "INCOMPLETE" not in md and "NO PRIVACY GUARANTEE" not in md
    private = written[1]["custodian_markdown"].read_text(encoding="utf-8")
    assert private.startswith("# Custodian report (private, not for release)")
    assert "| **malignant** | 21 | 21 |" in private and sha_hex("data") in private
    assert "![Training loss against step and validation metric against epoch]" in private
    assert "(plots/training.png)" in private


def test_html_is_self_contained(written):
    page = written[1]["html"].read_text(encoding="utf-8")
    assert page.count('src="data:image/png;base64,') == 1
    assert "plots/epsilon.png" not in page
    assert "1.235" in page and "INCOMPLETE RUN" not in page


def test_render_html_escapes_and_notes_missing_plots():
    report = example_report(run__name="<script>x</script>")
    page = render_html(report, {})
    assert "<script>x" not in page and "&lt;script&gt;" in page
    assert page.count("Figure not available") == 1


def test_rerender_reproduces_views_from_json(written):
    run_dir, paths = written
    before = {k: p.read_bytes() for k, p in paths.items()}
    for key in ("markdown", "html", "epsilon_plot", "custodian_markdown"):
        paths[key].unlink()
    again = rerender(run_dir)
    assert {k: p.read_bytes() for k, p in again.items()} == before


def test_rerender_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="no privacy report here"):
        rerender(tmp_path)
    bad = example_report()
    del bad["privacy"]["epsilon"]["pld"]
    (tmp_path / REPORT_FILES["json"]).write_text(json.dumps(bad), encoding="utf-8")
    with pytest.raises(ReportSchemaError, match=r"privacy\.epsilon\.pld: missing"):
        rerender(tmp_path)


def test_an_empty_table_renders_in_both_views():
    """A run stopped before its first step has empty record tables (e.g. its epsilon history):
    the failed run's report must still render, never crash half-written."""
    from dpkfc_med.report.document import records_table
    from dpkfc_med.report.render import html_block, markdown_block

    empty = records_table([])
    assert markdown_block(empty) == "_(none)_"
    assert "(none)" in html_block(empty, {})
