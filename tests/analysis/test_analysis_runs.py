"""Public proxies and benchmark rows of the analysis API."""

import json
from pathlib import Path

import numpy as np
import pytest

from dpkfc_med.analysis import benchmark_accuracy, probe_factors, public_proxy
from tests.conftest import SHARED_DATA

PNEUMONIA = Path(SHARED_DATA) / "medmnist" / "pneumoniamnist.npz"
ADRENAL = Path(SHARED_DATA) / "medmnist3d" / "adrenalmnist3d.npz"


def test_public_proxy_of_another_modality_is_checked_and_gives_factors():
    import torch.nn.functional as F

    from dpkfc_med.models import build_model

    proxy = public_proxy(ADRENAL, spatial_shape=(28, 28), num_classes=2, private=PNEUMONIA)
    described = proxy.describe()
    assert described["overlap_with_private_train"] == 0
    assert described["uses_private_data"] is False
    assert proxy.images.shape[1:] == (1, 28, 28)
    model, _ = build_model("small_cnn", spatial_dims=2, in_channels=1, out_channels=2)
    ce = lambda out, y: F.cross_entropy(out, y, reduction="none")  # noqa: E731
    factors = probe_factors(model, proxy, ce, num_probes=8, label="proxy")
    assert factors.label == "proxy" and not factors.uses_private_data
    assert factors.num_samples == 8 and factors.layers


def test_public_proxy_equal_to_the_private_data_is_refused():
    with pytest.raises(ValueError, match=r"same MedMNIST dataset \('pneumoniamnist'\)"):
        public_proxy(PNEUMONIA, spatial_shape=(28, 28), num_classes=2, private=PNEUMONIA)


def test_benchmark_accuracy_uses_the_validation_choice(tmp_path):
    def run(phase, method, eps, lr, seed, val, test):
        return {
            "phase": phase,
            "method": method,
            "eps": eps,
            "lr": lr,
            "seed": seed,
            "val": {"auroc": val},
            "test": {"auroc": test},
        }

    runs = [
        run("tune", "a", 1.0, 0.1, 0, 0.8, 0.0),
        run("tune", "a", 1.0, 0.2, 0, 0.9, 0.0),
        run("tune", "a", 1.0, 0.5, 0, 0.95, 0.0),  # best, but never evaluated
        *[run("eval", "a", 1.0, 0.2, s, 0.0, t) for s, t in ((1, 0.7), (2, 0.8), (3, 0.9))],
        run("eval", "a", 1.0, 0.1, 1, 0.0, 0.1),
        run("tune", "b", None, 0.1, 0, 0.5, 0.0),
        run("eval", "b", None, 0.1, 1, 0.0, 0.6),
    ]
    path = tmp_path / "acc.json"
    path.write_text(json.dumps({"runs": runs}), encoding="utf-8")
    rows = benchmark_accuracy(path, ["b", "a", "missing"])
    assert [(r["method"], r["epsilon"], r["lr"], r["seeds"]) for r in rows] == [
        ("b", None, 0.1, 1),
        ("a", 1.0, 0.2, 3),
    ]
    assert rows[1]["mean"] == pytest.approx(0.8)
    assert rows[1]["std"] == pytest.approx(np.std([0.7, 0.8, 0.9], ddof=1))
    assert rows[0]["std"] == 0.0


def test_plot_benchmark_accuracy_draws_one_bar_per_row():
    from dpkfc_med.analysis import plot_benchmark_accuracy

    rows = [
        {"method": m, "epsilon": e, "lr": 0.1, "mean": 0.7 + 0.01 * i, "std": 0.02, "seeds": 3}
        for i, (m, e) in enumerate([("a", 1.0), ("b", 1.0), ("a", 8.0)])
    ]
    fig = plot_benchmark_accuracy(rows)
    bars = [p for p in fig.axes[0].patches]
    assert sorted(round(b.get_height(), 6) for b in bars) == [0.7, 0.71, 0.72]
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["epsilon 1", "epsilon 8"]
