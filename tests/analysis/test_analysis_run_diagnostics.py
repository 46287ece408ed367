"""Run diagnostics reader on a toy DP-SGD run: means agree with the per-step records."""

import json
from pathlib import Path

import numpy as np
import pytest

from dpkfc_med.analysis import (
    NOT_DP,
    plot_clipped_fraction,
    plot_layer_snr,
    read_run_diagnostics,
    snr_rows,
)
from tests.conftest import SHARED_DATA

PNEUMONIA = Path(SHARED_DATA) / "medmnist" / "pneumoniamnist.npz"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    assert PNEUMONIA.is_file(), f"no bundled PneumoniaMNIST at {PNEUMONIA} (set DPKFC_MED_DATA)"
    from dpkfc_med.training.config import load_config
    from dpkfc_med.training.run import train

    out = tmp_path_factory.mktemp("diag") / "run"
    cfg = load_config(
        Path(__file__).resolve().parents[2] / "configs" / "pneumoniamnist_cnn_2d_eps1.yaml",
        overrides=[
            "method=dp-sgd",
            f"data.path={PNEUMONIA}",
            "data.max_train=96",
            "data.max_eval=32",
            "training.epochs=1",
            "training.batch_size=32",
            "training.progress=false",
            f"output.dir={out}",
        ],
    )
    return train(cfg).run_dir


def test_means_match_per_step_records(run_dir):
    d = read_run_diagnostics(run_dir)
    assert d.method == "dp-sgd" and d.note == NOT_DP
    assert d.epsilon == pytest.approx(1.0, rel=0.05)
    assert d.steps == len(d.step) == len(d.clipped_fraction) >= 2
    assert d.mean_clipped_fraction == pytest.approx(np.nanmean(d.clipped_fraction), rel=1e-12)
    assert set(d.layer_snr) == set(d.mean_layer_snr) == set(d.layers)
    for layer, values in d.layer_snr.items():
        assert len(values) == d.steps
        assert d.mean_layer_snr[layer] == pytest.approx(np.mean(values), rel=1e-12)
    assert "not_for_release" not in d.label and d.label.startswith("dp-sgd")


def test_rows_and_plots(run_dir):
    d = read_run_diagnostics(run_dir)
    rows = snr_rows([d, d])
    assert [r["layer"] for r in rows] == list(d.layers)
    ratio = f"{d.label} / {d.label}"
    assert all(r[ratio] == pytest.approx(1.0) for r in rows)
    assert plot_layer_snr([d]).axes and plot_clipped_fraction([d]).axes


def test_missing_report_names_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="directory of a finished run"):
        read_run_diagnostics(tmp_path)


def test_run_without_diagnostics_is_refused(tmp_path):
    private = tmp_path / "private_not_for_release"
    private.mkdir()
    (private / "custodian_report.json").write_text(
        json.dumps({"diagnostics": None}), encoding="utf-8"
    )
    with pytest.raises(ValueError, match="'diagnostics' is empty.*dp-sgd or dp-kfc"):
        read_run_diagnostics(tmp_path)
    assert snr_rows([]) == []


def test_released_model_holds_the_released_parameters(run_dir):
    """The rebuilt network carries model.pt's parameters and reproduces the run's logits."""
    import torch

    from dpkfc_med.analysis import medmnist_sample, released_model

    model = released_model(run_dir)
    saved = torch.load(Path(run_dir) / "model.pt", map_location="cpu", weights_only=False)
    state = model.state_dict()
    assert set(state) == set(saved["model"])
    for name, value in saved["model"].items():
        assert torch.equal(state[name], value), name
    x = medmnist_sample(PNEUMONIA, num=4).images
    assert not model.training
    assert model(x).shape == (4, 2)
    with pytest.raises(FileNotFoundError, match=r"lacks config.yaml, model.pt"):
        released_model(Path(run_dir) / "nowhere")
