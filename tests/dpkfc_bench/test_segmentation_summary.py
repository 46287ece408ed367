"""The segmentation benchmark: per-epsilon learning-rate choice, gap fractions, summary, plot."""

from __future__ import annotations

import pytest

from dpkfc_bench import segmentation as seg
from dpkfc_bench import segmentation_select as sel
from dpkfc_bench import segmentation_summary as summary
from dpkfc_bench.harness import ROOT, display_path


def _run(phase, method, eps, lr, seed, val=0.5, test=0.5, study="main", lever="shipped"):
    dice = {
        "mean_dice": test,
        "dice_per_class": {"A": test, "P": test},
        "hd95_per_class": {"A": 2.0, "P": 4.0},
    }
    return {
        "study": study,
        "lever": lever,
        "phase": phase,
        "method": method,
        "eps": eps,
        "lr": lr,
        "seed": seed,
        "val": {"mean_dice": val},
        "test": dice,
        "epsilon_spent": eps,
        "seconds": 60.0,
        "evidence": {
            "mean_clipped_fraction": 1.0,
            "mean_layer_share": {"l": 1.0},
            "mean_layer_snr": {"l": 0.1},
        },
    }


def _data():
    runs = [
        _run("tune", "nonprivate", None, 0.01, 0, val=0.80),
        _run("tune", "nonprivate", None, 0.03, 0, val=0.85),
        _run("tune", "dp-sgd", 8.0, 0.01, 0, val=0.40),
        _run("tune", "dp-sgd", 8.0, 0.03, 0, val=0.30),
        _run("tune", "dp-kfc", 8.0, 0.01, 0, val=0.60),
        _run("tune", "dp-kfc", 8.0, 0.03, 0, val=0.70),
    ]
    for seed, (a, b, c) in enumerate([(0.84, 0.30, 0.70), (0.86, 0.34, 0.72)], start=1):
        runs += [
            _run("eval", "nonprivate", None, 0.03, seed, test=a),
            _run("eval", "dp-sgd", 8.0, 0.01, seed, test=b),
            _run("eval", "dp-kfc", 8.0, 0.03, seed, test=c),
            _run("eval", "dp-kfc", 8.0, 0.01, seed, test=0.99),  # not the chosen lr: ignored
        ]
    runs.append(
        _run(
            "tune",
            "dp-kfc",
            8.0,
            0.03,
            0,
            val=0.72,
            study="levers",
            lever="weight average (decay 0.9)",
        )
    )
    return {
        "runs": runs,
        "epsilons": [8.0],
        "seeds": [1, 2],
        "lrs": [0.01, 0.03],
        "class_names": ["A", "P"],
    }


def test_learning_rate_is_chosen_per_method_and_epsilon_on_validation():
    data = _data()
    assert sel.best_lr(data, "nonprivate", None) == 0.03
    assert sel.best_lr(data, "dp-sgd", 8.0) == 0.01
    assert sel.best_lr(data, "dp-kfc", 8.0) == 0.03  # the lever run (0.72) is not a tuning run
    assert sel.best_lr(data, "dp-kfc", 3.0) is None


def test_gap_fraction_is_the_share_of_the_nonprivate_minus_dpsgd_gap():
    gaps = sel.gap_fractions(_data())
    top, floor, kfc = 0.85, 0.32, 0.71  # means over the two evaluation seeds
    assert gaps[8.0]["dp-kfc"] == pytest.approx((kfc - floor) / (top - floor))
    assert gaps[8.0]["dp-sgd"] == pytest.approx(0.0)


def test_summary_and_plot(tmp_path):
    data = _data()
    text = summary.summarize(data)
    assert "| dp-kfc | 8 | 0.03 | x1 | 0.710 +- 0.014 |" in text
    assert f"| {100 * (0.71 - 0.32) / (0.85 - 0.32):.0f} % |" in text
    assert "| weight average (decay 0.9) | - | 0.720 |" in text
    assert "| shipped | 0.400 | 0.700 |" in text
    summary.plot(data, tmp_path / "fig.png")
    assert (tmp_path / "fig.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_clip_norm_is_tuned_with_the_learning_rate_for_every_method():
    data = _data()
    data["clip_scales"] = {"8": [0.25, 1.0]}
    data["config_contents"] = {"privacy": {"max_grad_norm": 0.5}}
    tune = _run("tune", "dp-sgd", 8.0, 0.03, 0, val=0.45)
    data["runs"].append({**tune, "clip": 0.25})  # beats (0.01, x1) at 0.40
    assert (
        sel.best_run(data, "dp-sgd", 8.0)["lr"] == 0.03
        and sel.clip_scale(sel.best_run(data, "dp-sgd", 8.0)) == 0.25
    )
    assert sel.best_lr(data, "dp-sgd", 8.0, clip=1.0) == 0.01  # the lever study's choice
    assert sel.eval_runs(data, "dp-sgd", 8.0) == []  # no evaluation at (0.03, x0.25) yet
    evals = [{**_run("eval", "dp-sgd", 8.0, 0.03, s, test=0.5), "clip": 0.25} for s in (1, 2)]
    data["runs"] += evals
    assert sel.eval_runs(data, "dp-sgd", 8.0) == evals  # not the x1 runs at lr 0.03
    key = {"lever": "shipped", "method": "dp-sgd", "lr": 0.03, "seed": 1, "eps": 8.0, "clip": 0.25}
    cfg = seg._config_for({"privacy": {"max_grad_norm": 0.5}, "training": {}}, key)
    assert cfg["privacy"]["max_grad_norm"] == 0.125
    assert seg._run_name(key) != seg._run_name({**key, "clip": 1.0})
    run_key = seg._run_key  # what the resume matches recorded runs on
    assert run_key(key) == run_key({**key, "clip": 0.25}) != run_key({**key, "clip": 1.0})
    assert run_key({**key, "clip": 1.0}) == run_key({k: v for k, v in key.items() if k != "clip"})
    text = summary.summarize(data)
    assert "| dp-sgd | 8 | 0.03 | 0.125 | 0.500 +- 0.000 |" in text
    assert "| dp-sgd | 8 | 0.03 | 0.125 | 0.450 |" in text  # the tuning table names the clip norm
    data["notes"] = ["dp-kfc ran the x1 clip norm only"]
    assert "- dp-kfc ran the x1 clip norm only" in summary.summarize(data)


def test_lever_configs_change_one_thing():
    base = {"privacy": {"max_grad_norm": 0.5, "target_epsilon": 8.0}, "training": {"lr": 1.0}}
    key = {"lever": "clip norm x0.25", "method": "dp-sgd", "lr": 0.01, "seed": 2, "eps": 3.0}
    cfg = seg._config_for(base, key)
    assert cfg["privacy"]["max_grad_norm"] == 0.125 and cfg["privacy"]["target_epsilon"] == 3.0
    assert cfg["training"] == {"lr": 0.01, "seed": 2} and cfg["method"] == "dp-sgd"
    assert cfg["privacy"]["reproducible_noise"] is True
    assert seg._run_name(key) == seg._run_name(dict(key))  # stable across processes


def test_shipped_study_evaluates_on_a_folder_of_unseen_cases(tmp_path):
    import torch
    import yaml

    config = ROOT / "configs" / "hippocampus_unet_3d_eps8.yaml"
    tiny = yaml.safe_load(config.read_text(encoding="utf-8"))
    tiny["data"].update(max_train=5, max_eval=2, patch_size=[16, 16, 16])
    tiny["training"].update(epochs=1, batch_size=3)
    tiny["model"]["kwargs"].update(channels=[4, 8], strides=[2])
    tiny["pretrain"].update(steps=1, batch_size=2)
    tiny["probes"]["num_probes"] = 4
    tiny["preconditioner"].update(chunk_size=4, calibration_samples=2)
    path = tmp_path / "hippocampus_unet_3d_eps8.yaml"
    path.write_text(yaml.safe_dump(tiny), encoding="utf-8")
    threads = torch.get_num_threads()
    try:
        rec = seg._shipped_job(path, tmp_path / "runs", threads=1)
    finally:
        torch.set_num_threads(threads)
    unseen = rec["unseen_folder"]
    assert unseen["n"] == 2 and unseen["not_dp"] is False  # the 2 test cases, never trained on
    assert 0.0 <= unseen["mean_dice"] <= 1.0
    assert set(unseen["hd95_per_class"]) == {"class_1", "class_2"}  # a plain folder: unnamed
    assert 0 < rec["epsilon_spent"] <= 8.0
    text = summary.summarize({"runs": [], "shipped": {rec["config"]: rec}})
    assert "Dice on the unseen-case folder" in text and f"{unseen['mean_dice']:.3f} (2)" in text


def test_grid_widens_beyond_an_edge_for_every_method():
    data = _data()  # dp-kfc's best at 8 is 0.03, the top of the grid
    assert sel.widen(data, 8.0, ["dp-sgd", "dp-kfc"]) == 0.1
    assert sel.widen(data, None, ["nonprivate"]) == 0.1  # 0.03 best there too
    data["widened"] = {"8": [0.1]}
    assert sel.lr_grid(data, 8.0) == [0.01, 0.03, 0.1] and sel.lr_grid(data, 3.0) == [0.01, 0.03]
    data["runs"].append(_run("tune", "dp-kfc", 8.0, 0.1, 0, val=0.65))
    assert sel.best_lr(data, "dp-kfc", 8.0) == 0.03  # interior now
    assert sel.widen(data, 8.0, ["dp-kfc"]) is None
    assert sel.widen(data, 8.0, ["dp-sgd", "dp-kfc"]) == 0.003  # dp-sgd's best: the lower edge
    data["runs"].append(_run("tune", "dp-sgd", 8.0, 0.1, 0, val=0.1))
    data["runs"][2]["val"]["mean_dice"] = 0.2  # dp-sgd's 0.01 run: its best is now 0.03
    assert sel.best_lr(data, "dp-sgd", 8.0) == 0.03


def test_preconditioner_families_run_the_same_protocol():
    """A family is DP-KFC with its config field set, tuned, scored and tabled like DP-KFC."""
    base = {"method": "dp-kfc", "privacy": {"target_epsilon": 8.0}, "training": {"lr": 1.0}}
    key = {"lever": "shipped", "method": "dp-kfc-shampoo", "lr": 0.03, "seed": 1, "eps": 8.0}
    cfg = seg._config_for(base, key)
    assert cfg["method"] == "dp-kfc" and cfg["preconditioner"] == {"family": "shampoo"}
    assert cfg["training"] == {"lr": 0.03, "seed": 1}
    data = _data()
    data["runs"] += [
        _run("tune", "dp-kfc-shampoo", 8.0, 0.01, 0, val=0.65),
        _run("tune", "dp-kfc-shampoo", 8.0, 0.03, 0, val=0.50),
        _run("eval", "dp-kfc-shampoo", 8.0, 0.01, 1, test=0.64),
        _run("eval", "dp-kfc-shampoo", 8.0, 0.01, 2, test=0.66),
    ]
    # non-private 0.85, DP-SGD 0.32: (0.65 - 0.32) / (0.85 - 0.32)
    assert sel.gap_fractions(data)[8.0]["dp-kfc-shampoo"] == pytest.approx(0.33 / 0.53)
    table = "\n".join(summary.compact_table(data))
    assert "| dp-kfc-shampoo | 0.650" in table
    assert "dp-kfc-diagonal" not in table  # no runs: no row


def test_levers_evaluated_on_seeds_get_their_own_table_with_the_gap():
    data = _data()
    lever = "data-free pretraining 1000 steps instead of 200"
    data["runs"] += [
        _run("eval", "dp-sgd", 8.0, 0.01, s, test=t, study="levers", lever=lever)
        for s, t in ((1, 0.50), (2, 0.60))
    ]
    text = summary.summarize(data)
    top, floor = 0.85, 0.32  # the main study's non-private and DP-SGD test means
    gap = f"{100 * (0.55 - floor) / (top - floor):.0f} %"
    assert f"| 8 | {lever} | dp-sgd | 0.01 | x1 | 0.550 +- 0.071 | {gap} | 1,2 |" in text
    # the evaluation runs stay out of the seed-0 lever table and the main study's rows
    assert f"| {lever} | - | - |" not in text
    assert sel.eval_runs(data, "dp-sgd", 8.0)[0]["study"] == "main"
    assert sel.gap_fractions(data)[8.0]["dp-sgd"] == pytest.approx(0.0)


def test_best_recipe_is_one_rule_for_every_method_and_its_gap_uses_the_best_dpsgd():
    data = _data()
    lever = "weight average (decay 0.9)"
    # dp-kfc: the lever (val 0.72) beats its main point (0.70); dp-sgd: a lever that ties its
    # main point (0.40) loses the tie to the main study
    data["runs"].append(
        _run("tune", "dp-sgd", 8.0, 0.01, 0, val=0.4001, study="levers", lever="cosine")
    )
    best = {m: sel.best_recipe(data, m, 8.0) for m in ("dp-sgd", "dp-kfc")}
    assert best["dp-kfc"]["lever"] == lever and best["dp-sgd"].get("study") == "main"
    rows = {r["method"]: r for r in sel.best_recipe_rows(data)}
    assert rows["dp-kfc"]["dice"] is None  # the lever is not evaluated yet
    for seed, test in ((1, 0.75), (2, 0.77)):
        data["runs"].append(
            _run("eval", "dp-kfc", 8.0, 0.03, seed, test=test, study="levers", lever=lever)
        )
    rows = {r["method"]: r for r in sel.best_recipe_rows(data)}
    assert rows["dp-kfc"]["dice"][0] == pytest.approx(0.76)
    assert rows["dp-kfc"]["gap"] == pytest.approx((0.76 - 0.32) / (0.85 - 0.32))
    text = summary.summarize(data)
    assert f"| 8 | dp-kfc | {lever} | 0.03 | x1 | 0.720 | 0.760 +- 0.014 | 83 % | 1,2 |" in text
    sgd = "| 8 | dp-sgd | main study point | 0.01 | x1 | 0.400 | 0.320 +- 0.028 | - | 1,2 |"
    assert sgd in text


def test_device_option_reaches_every_run_config(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(seg, "_run_all", lambda jobs, base, *rest, **kw: seen.append((jobs, base)))
    config = ROOT / "configs" / "hippocampus_unetr_3d_eps8.yaml"
    out = tmp_path / "out.json"
    argv = ["--config", str(config), "--epsilons", "8", "--methods", "dp-sgd,dp-kfc"]
    seg.main([*argv, "--device", "cuda", "--out", str(out), "--runs-dir", str(tmp_path)])
    jobs = [k for batch, _ in seen for k in batch]
    assert {k["method"] for k in jobs} == {"dp-sgd", "dp-kfc"}
    for batch, base in seen:
        for key in batch:
            cfg = seg._config_for(base, key)
            assert cfg["training"]["device"] == "cuda" and cfg["model"]["name"] == "unetr"
    seen.clear()
    seg.main([*argv, "--out", str(out), "--runs-dir", str(tmp_path)])  # default: the config's
    assert all("device" not in base["training"] for _, base in seen)


def test_clip_norm_cells_include_the_levers_own_clip_scale():
    run = _run("tune", "dp-kfc", 3.0, 0.03, 0, study="levers", lever="clip norm x0.25")
    assert summary.clip_cell(0.5, run) == "0.125"
    assert summary.clip_cell(0.5, {**run, "clip": 0.25}) == "0.03125"  # both scales apply
    assert summary.clip_cell(0.5, {**run, "lever": "shipped"}) == "0.5"
    assert summary.clip_cell(0.5, {**run, "eps": None}) == "-"


def test_shipped_study_reruns_a_config_that_changed_and_keeps_the_earlier_run(
    tmp_path, monkeypatch
):
    import json

    config = ROOT / "configs" / "hippocampus_unet_3d_eps8.yaml"
    name = display_path(config)
    calls = []

    def fake_job(path, runs_dir, threads=2):
        calls.append(path)
        unseen = {"mean_dice": 0.7, "n": 2, "not_dp": False, "hd95_per_class": {}}
        return {
            "config": display_path(path),
            "config_sha256": seg.sha256_file(path),
            "epsilon_spent": 8.0,
            "minutes": 1.0,
            "test": {"mean_dice": 0.7},
            "unseen_folder": unseen,
        }

    monkeypatch.setattr(seg, "_shipped_job", fake_job)
    out = tmp_path / "out.json"
    stale = {**fake_job(config, tmp_path), "config_sha256": "0" * 64}
    calls.clear()
    out.write_text(json.dumps({"runs": [], "shipped": {name: stale}}), encoding="utf-8")
    argv = ["--study", "shipped", "--epsilons", "8", "--out", str(out), "--runs-dir", str(tmp_path)]
    seg.main(argv)
    data = json.loads(out.read_text(encoding="utf-8"))
    assert calls == [config] and data["shipped_history"] == [stale]
    assert data["shipped"][name]["config_sha256"] == seg.sha256_file(config)
    seg.main(argv)  # unchanged since: not trained again
    assert calls == [config]
    assert "(earlier version)" in out.with_suffix(".md").read_text(encoding="utf-8")
