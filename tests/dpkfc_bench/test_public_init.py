"""The public-weights benchmark's data: a disjoint public release, shifted as documented."""

from __future__ import annotations

import nibabel as nib
import numpy as np

from dpkfc_bench.public_init import SHIFTS, is_public, prepare
from dpkfc_med.data import load_segmentation_folder, resolve_data_path


def _array(path) -> np.ndarray:
    return np.asarray(nib.load(str(path)).dataobj).astype(np.float64)


def test_public_release_is_disjoint_and_shifted_as_documented(tmp_path):
    source = load_segmentation_folder(resolve_data_path("msd_hippocampus", kind="dir"))
    folders = prepare(tmp_path)
    private = load_segmentation_folder(folders["private"])
    public = {s: load_segmentation_folder(folders[s]) for s in SHIFTS}
    # every case in exactly one side; the side depends on the case id alone
    assert set(private.case_ids).isdisjoint(public["both"].case_ids)
    assert len(private) + len(public["both"]) == len(source)
    assert all(is_public(c) for c in public["both"].case_ids)
    assert not any(is_public(c) for c in private.case_ids)
    assert 0.25 < len(public["both"]) / len(source) < 0.42
    case = public["both"].case_ids[0]
    original = source[case]
    x, y = _array(original.image_path), _array(original.label_path)
    for shift in SHIFTS:
        c = public[shift][case]
        got_y, got_x = _array(c.label_path), _array(c.image_path)
        merged = shift in ("labels", "both")
        np.testing.assert_array_equal(got_y, np.where(y == 2, 1, y) if merged else y)
        inside = x > 0
        inverted = np.where(inside, x[inside].max() + x[inside].min() - x, 0)
        want = inverted if shift in ("contrast", "both") else x
        np.testing.assert_allclose(got_x, want, rtol=1e-5, atol=1e-3)


def test_summary_keeps_fine_tuning_modes_apart():
    """A row without a mode is full fine-tuning; LoRA rows get their own line and SNR table."""
    from dpkfc_bench.public_init import _key, jobs, summarize

    def row(method, dice, **extra):
        return {"arm": "finetune", "shift": "labels", "method": method, "eps": 1.0, "seed": 1,
                "test_mean_dice": dice, **extra}  # fmt: skip

    rows = [row("dp-sgd", 0.4), row("dp-kfc", 0.5),
            row("dp-sgd", 0.1, finetune="lora", layer_snr={"conv": 2.0}),
            row("dp-kfc", 0.2, finetune="lora", layer_snr={"conv": 1.0})]  # fmt: skip
    text = summarize({"runs": rows})
    lines = {ln.split(" |")[0]: ln for ln in text.splitlines() if ln.startswith("| public init")}
    assert "0.500" in lines["| public init + dp-kfc fine-tuning"]
    assert "0.200" in lines["| public init + dp-kfc fine-tuning (lora)"]
    assert "epsilon 1, lora fine-tuning" in text and "| conv | 2 (x0.50) |" in text
    assert _key(rows[0]) == _key({**rows[0], "finetune": "full"}) != _key(rows[2])
    lora = [j for j in jobs([1.0], [1], ("full", "lora")) if j.get("finetune") == "lora"]
    assert len(lora) == 6  # 3 shifts x 2 methods


def test_a_fine_tuning_recipe_variant_is_its_own_arm_with_its_overrides():
    """``full@training.lr=0.003``: full fine-tuning with that override, a row of its own."""
    from dpkfc_bench.public_init import _key, jobs, summarize

    variant = "full@training.lr=0.003"
    js = jobs([1.0], [1], ("full", variant), methods=("dp-kfc",))
    tuned = [j for j in js if j.get("finetune") == variant]
    assert len(tuned) == 3 and {j["method"] for j in js if j["arm"] == "finetune"} == {"dp-kfc"}
    rows = [{**j, "test_mean_dice": 0.6 if j.get("finetune") == variant else 0.5}
            for j in js if j["arm"] == "finetune"]  # fmt: skip
    assert _key(tuned[0]) != _key({**tuned[0], "finetune": "full"})
    lines = [ln for ln in summarize({"runs": rows}).splitlines() if ln.startswith("| public init")]
    assert lines == [
        "| public init + dp-kfc fine-tuning | 0.500 +- 0.000 (n=1) | 0.500 +- 0.000 (n=1) "
        "| 0.500 +- 0.000 (n=1) |",
        "| public init + dp-kfc fine-tuning (full, training.lr=0.003) | 0.600 +- 0.000 (n=1) "
        "| 0.600 +- 0.000 (n=1) | 0.600 +- 0.000 (n=1) |",
    ]  # no dp-sgd line: nobody ran it


def test_private_only_under_recipe_auto_is_a_row_of_its_own(tmp_path):
    """``--private config,auto``: the shipped recipe and recipe: auto, kept apart."""
    import yaml

    from dpkfc_bench.public_init import _auto_config, _config, _key, jobs, summarize
    from dpkfc_med.recipe import RECIPE_FIELDS
    from dpkfc_med.training.config_checks import flatten

    js = [j for j in jobs([1.0], [1], methods=("dp-kfc",), private=("config", "auto"))
          if j["arm"] == "private"]  # fmt: skip
    assert [j["method"] for j in js] == ["config", "auto"] and _key(js[0]) != _key(js[1])
    rows = [{**j, "test_mean_dice": 0.3 if j["method"] == "config" else 0.5} for j in js]
    lines = [ln for ln in summarize({"runs": rows}).splitlines() if ln.startswith("| private")]
    assert lines[0].startswith("| private only (shipped recipe, no public weights) | 0.300")
    assert lines[1].startswith("| private only (recipe: auto, no public weights) | 0.500")
    raw = yaml.safe_load(_auto_config(_config(1.0), tmp_path / "auto.yaml").read_text("utf-8"))
    assert raw["training"]["recipe"] == "auto"
    assert not set(flatten(raw)) & set(RECIPE_FIELDS)  # every recipe field left to the rule
    assert raw["data"]["patch_size"] == [32, 48, 32] and raw["privacy"]["target_epsilon"] == 1.0


def test_a_public_start_under_recipe_auto_trains_from_the_stripped_config(tmp_path):
    """``full@training.recipe=auto``: the rule's recipe for the public start, overrides kept."""
    import yaml

    from dpkfc_bench.public_init import _config, job_config

    job = {"arm": "finetune", "shift": "labels", "method": "dp-kfc", "eps": 1.0, "seed": 1,
           "finetune": "full@training.recipe=auto@training.head_first_epochs=5"}  # fmt: skip
    config, mode, variant = job_config(job, tmp_path)
    assert mode == "full" and variant == ["training.head_first_epochs=5"]
    raw = yaml.safe_load(config.read_text(encoding="utf-8"))
    assert raw["training"]["recipe"] == "auto" and "lr" not in raw["training"]
    plain = job_config({**job, "finetune": "full@training.lr=0.003"}, tmp_path)
    assert plain == (_config(1.0), "full", ["training.lr=0.003"])
