"""Smoke test of the cost benchmark: structure of the measurement, no timing assertions."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch

from dpkfc_bench import cost_cases, cost_markdown, cost_memory, cost_timing

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture
def fast_build(monkeypatch):
    """Build the small CNN with the benchmark's own builder (skips importing MONAI: faster)."""

    def build(case, seed, shape=None):
        torch.manual_seed(seed)
        return cost_cases.fallback_build(case), "fallback"

    monkeypatch.setattr(cost_cases, "build_network", build)


def test_measure_timing_small_cnn(fast_build):
    case = cost_cases.CASES["small_cnn"]
    out = cost_timing.measure_timing(
        case,
        batch=4,
        shape=(28, 28),
        warmup=1,
        rounds=2,
        steps=1,  # 2 timed steps per method, alternating
        refresh_reps=1,
        kfc={"num_probes": 16, "calibration_samples": 4},
    )
    assert out["errors"] == {}
    assert set(out["methods"]) == set(cost_cases.METHODS)
    for summary in out["methods"].values():
        assert summary["n"] == 2
        assert all(t > 0 for t in summary["all_ms"]) and summary["median_ms"] > 0
    # every round ran every method, in a rotated order
    assert [sorted(o) for o in out["round_orders"]] == [sorted(cost_cases.METHODS)] * 2
    assert out["round_orders"][0] != out["round_orders"][1]
    refresh = out["refresh"]
    assert refresh["median_s"] > 0 and refresh["calls"][0]["factors_s"] >= 0
    assert refresh["num_probes"] == 16 and refresh["extrapolated"]
    assert refresh["median_s_default_probes"] > 0

    out.update(epoch_samples=100, epoch_data="synthetic", kfc_overrides={"num_probes": 16})
    out["memory"] = [
        {"model": "small_cnn", "method": m, "primary_mib": 10.0 + i}
        for i, m in enumerate(cost_cases.METHODS)
    ]
    an = cost_markdown.analyse(out, refresh_every=20)
    assert an["ratios"]["time"]["opacus"] == pytest.approx(1.0)
    assert an["ratios"]["memory"]["dp-kfc"] == pytest.approx(14.0 / 11.0)
    # Opacus' fastest mode is the reference of the fastest-competitor targets
    t = {m: s["median_ms"] for m, s in out["methods"].items()}
    fastest = min(t["opacus"], t["opacus-ghost"])
    assert an["ratios"]["time_vs_fastest_opacus"]["dp-kfc"] == pytest.approx(t["dp-kfc"] / fastest)
    assert an["ratios"]["memory_vs_fastest_opacus"]["dp-kfc"] == pytest.approx(14.0 / 11.0)
    assert 0 < an["refresh_amortised"]["share_at_default_period"] < 1
    assert set(an["targets"]) == {
        "step",
        "memory",
        "refresh",
        "fastest_step",
        "fastest_memory",
        "nonprivate_step",
    }
    # fewer probes change the refresh (extrapolated), not the step
    assert an["targets"]["step"] in ("met", "missed")
    assert "extrapolated" in an["targets"]["refresh"]


def test_memory_job_structure(fast_build):
    job = {
        "model": "small_cnn",
        "method": "dp-sgd",
        "batch": 4,
        "shape": [28, 28],
        "seed": 0,
        "device": "cpu",
        "threads": 1,
        "steps": 1,
    }
    res = cost_memory.measure_memory_job(job)
    assert res["method"] == "dp-sgd" and res["step_peak_mib"] > 0
    assert res["primary_mib"] >= 0 and "how" in res


def test_transform_macs_follow_the_sampler_paths(fast_build):
    """Per-sample multiply-adds of the small CNN's conv2 (16 -> 32 channels, 4x4 kernel,
    13x13 input, 5x5 output), counted by hand for the full and the kron factor."""
    rows = cost_cases.layer_footprint(cost_cases.CASES["small_cnn"], (28, 28))
    conv2 = next(r for r in rows if r["C"] == 16)
    assert (conv2["T"], conv2["S"], conv2["n_a"], conv2["n_g"]) == (25, 169, 257, 32)
    macs = cost_cases.transform_macs
    full = {m["layer"]: m for m in macs(rows, {"rank_a": None})}[conv2["layer"]]
    low = {m["layer"]: m for m in macs(rows, {})}[conv2["layer"]]  # default rank_a 64
    kron = {m["layer"]: m for m in macs(rows, {"conv_a": "kron"})}
    assert full["raw"] == 25 * 257 * 32
    assert full["transform"] == min(25, 32) * 257 * 257  # factored: rows times U_A
    assert low["transform"] == 25 * 2 * 257 * 64  # rows times V, then times (V diag d)^T
    # U_C on the 169 input positions, U_K on the per-sample gradient's 32 x 16 blocks
    assert kron[conv2["layer"]]["transform"] == 169 * 16 * 16 + 32 * 16 * 16 * 16


def test_bf16_step_runs_for_every_method(fast_build):
    """Under bf16 autocast every method takes a step that moves the weights, all finite.

    (Float32 per-sample gradients under bf16 are checked in tests/privacy/test_precision.py.)
    """
    case = cost_cases.CASES["small_cnn"]
    x, y = cost_cases.make_batch(case, 4, (28, 28), 0)
    for method in cost_cases.METHODS:
        model, _ = cost_cases.build_network(case, 0, (28, 28))
        before = [p.detach().clone() for p in model.parameters()]
        kfc = {"num_probes": 16, "calibration_samples": 4}
        runner = cost_timing.setup_method(method, case, model, x, y, (28, 28), 0, kfc, "bf16")
        runner.step()
        after = list(model.parameters())
        assert all(bool(torch.isfinite(p).all()) for p in after), method
        assert any(not torch.equal(a, b) for a, b in zip(after, before)), method
        runner.release()


def test_gpu_check_script_names_files_that_exist():
    root = ROOT
    script = (root / "dpkfc_bench" / "gpu_check.sh").read_text(encoding="utf-8")
    subprocess.run(["bash", "-n", str(root / "dpkfc_bench" / "gpu_check.sh")], check=True)
    named = re.findall(r"(tests/\S+\.py|dpkfc_bench/\S+\.sh)", script)
    assert "tests/privacy/test_precision.py" in named and "dpkfc_bench/gpu_cost.sh" in named
    for path in named:
        assert (root / path).is_file(), path
