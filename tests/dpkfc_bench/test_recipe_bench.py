"""dpkfc_bench.recipe: the arms' configs, the summary table and the plot (no training runs)."""

from __future__ import annotations

import statistics

import yaml

from dpkfc_bench import recipe as bench
from dpkfc_med.recipe import RECIPE_FIELDS


def _run(workload, arm, seed, value, eps=8.0):
    return {"workload": workload, "arm": arm, "epsilon": eps, "seed": seed, "value": value,
            "metric": "auroc", "minutes": 1.0}  # fmt: skip


def test_the_auto_arm_keeps_the_task_and_drops_every_recipe_field(tmp_path):
    cmd = bench._command(
        {"workload": "adrenal_resnet", "arm": "auto", "epsilon": 3.0, "seed": 2},
        tmp_path / "run",
        tmp_path,
    )
    cfg = yaml.safe_load((tmp_path / "adrenal_resnet_auto.yaml").read_text(encoding="utf-8"))
    assert cfg["training"]["recipe"] == "auto" and cfg["privacy"]["target_epsilon"] == 3.0
    assert cfg["data"]["path"] == "adrenalmnist3d" and cfg["model"]["name"] == "resnet10"
    for field in RECIPE_FIELDS:
        node = cfg
        for part in field.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        assert node is None, field
    assert "training.seed=2" in cmd


def test_the_table_gives_mean_and_sd_over_seeds_per_arm_and_the_plot_is_written(tmp_path):
    runs = [_run("w", "own", s, v) for s, v in enumerate((0.80, 0.84, 0.82))]
    runs += [_run("w", "auto", s, v) for s, v in enumerate((0.90, 0.86))]
    text = bench.render({"runs": runs})
    row = next(line for line in text.splitlines() if line.startswith("| w | 8 |"))
    sd = statistics.stdev([0.80, 0.84, 0.82])
    assert f"0.820 +- {sd:.3f} (n=3)" in row and "0.880 +- 0.028 (n=2)" in row
    bench.plot({"runs": runs}, tmp_path / "recipe.png")
    assert (tmp_path / "recipe.png").read_bytes()[:4] == b"\x89PNG"


def test_two_invocations_writing_one_result_file_keep_each_others_runs(tmp_path):
    from dpkfc_bench.harness import load_results, record

    path = tmp_path / "recipe.json"
    first, second = {"runs": []}, {"runs": []}  # each invocation's own view of the file
    record(path, first, _run("a", "own", 0, 0.5))
    record(path, second, _run("b", "own", 0, 0.6))
    record(path, first, _run("a", "auto", 0, 0.7))
    on_disk = load_results(path)["runs"]
    assert [(r["workload"], r["arm"]) for r in on_disk] == [
        ("a", "own"),
        ("b", "own"),
        ("a", "auto"),
    ]
    assert first["runs"] == on_disk


def test_a_rival_arm_is_the_auto_recipe_with_only_its_one_setting_fixed(tmp_path):
    job = {"workload": "pneumonia_cnn", "arm": "auto+dp-stp", "epsilon": 8.0, "seed": 0}
    cmd = bench._command(job, tmp_path / "run", tmp_path)
    rival = yaml.safe_load((tmp_path / "pneumonia_cnn_auto+dp-stp.yaml").read_text("utf-8"))
    bench._command({**job, "arm": "auto"}, tmp_path / "run", tmp_path)
    auto = yaml.safe_load((tmp_path / "pneumonia_cnn_auto.yaml").read_text(encoding="utf-8"))
    assert rival == auto and rival["training"]["recipe"] == "auto"
    sets = [cmd[i + 1] for i, part in enumerate(cmd) if part == "--set"]
    assert sets == ["training.seed=0", "training.progress=false", "method=dp-stp"]
    runs = [_run("w", "auto", 0, 0.9), _run("w", "auto+dp-stp", 0, 0.7)]
    header = next(line for line in bench.render({"runs": runs}).splitlines() if "| own |" in line)
    assert header.split("|")[4:7] == [" own ", " auto ", " auto+dp-stp "]
    assert "auto+dp-sgd" not in header  # a rival nobody ran gets no empty column


def test_an_unknown_arm_is_refused_with_the_choices(capsys):
    import pytest

    with pytest.raises(SystemExit):
        bench.main(["--arms", "auto+dp-xyz", "--report-only"])
    assert "auto+dp-stp" in capsys.readouterr().err


def test_methods_side_by_side_get_a_per_layer_snr_table_with_each_arms_method():
    def run(arm, method, snr):
        return {**_run("w", arm, 0, 0.9), "layer_snr": snr,
                "recipe": [{"field": "method", "value": method}]}  # fmt: skip

    runs = [run("auto", "dp-kfc", {"conv": 0.5, "fc (fallback)": 2.0}),
            run("auto+dp-sgd", "dp-sgd", {"conv": 0.25, "fc": 1.0}),
            {**run("auto+dp-sgd", "dp-sgd", {"conv": 0.75, "fc": 3.0}), "seed": 1}]  # fmt: skip
    lines = bench.render({"runs": runs}).splitlines()
    at = lines.index("### Per-layer SNR: w, epsilon 8")
    table_rows = [ln for ln in lines[at:] if ln.startswith("| ")]
    assert table_rows[0] == "| layer | auto (dp-kfc) | auto+dp-sgd (dp-sgd) |"
    assert table_rows[1:] == ["| conv | 0.5 | 0.5 |", "| fc | 2 | 2 |"]  # means over seeds
    one = bench.render({"runs": runs[1:]})
    assert "Per-layer SNR" not in one  # one arm alone: nothing to compare


def test_a_run_without_diagnostics_gives_no_layer_evidence(tmp_path):
    from dpkfc_bench.harness import layer_evidence

    assert layer_evidence(tmp_path) == {}
