"""Classification with patients as privacy units: mapping, sampling of units, sensitivity C."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from dpkfc_med.data import DataValidationError
from dpkfc_med.privacy.engine import PrivacyEngine
from dpkfc_med.tasks.build import build_task
from dpkfc_med.training.config import ConfigError, config_from_dict
from tests.conftest import SHARED_DATA, GaussianProbes, summed_clipped, tiny_cnn_2d

ADRENAL = Path(SHARED_DATA) / "medmnist3d" / "adrenalmnist3d.npz"
PNEUMONIA = Path(SHARED_DATA) / "medmnist" / "pneumoniamnist.npz"

# 10 training images of 7 patients: p0, p1, p2 have two images each, the others one.
PATIENTS = ["p0", "p0", "p1", "p1", "p2", "p2", "p3", "p4", "p5", "p6"]


def _toy(tmp_path: Path, ids: list[str] = PATIENTS, **extra: np.ndarray) -> Path:
    """An 8x8 binary MedMNIST-format file; a patient's images are near-identical."""
    rng = np.random.default_rng(0)
    arrays: dict[str, np.ndarray] = {"classes": np.array(["negative", "positive"])}
    for split, n in (("train", len(ids)), ("val", 4), ("test", 4)):
        arrays[f"{split}_images"] = rng.integers(0, 256, (n, 8, 8), dtype=np.uint8)
        arrays[f"{split}_labels"] = (np.arange(n) % 2).astype(np.uint8)[:, None]
    first: dict[str, int] = {}
    for i, uid in enumerate(ids):
        j = first.setdefault(uid, i)
        base = arrays["train_images"][j].astype(np.int64)
        arrays["train_images"][i] = np.clip(base + rng.integers(-3, 4, (8, 8)), 0, 255)
        arrays["train_labels"][i] = arrays["train_labels"][j]
    path = tmp_path / "toy.npz"
    np.savez(path, **arrays, **extra)
    return path


def _write_csv(tmp_path: Path, ids: list[str], name: str = "patients.csv") -> Path:
    path = tmp_path / name
    path.write_text(
        "index,unit_id\n" + "".join(f"{i},{u}\n" for i, u in enumerate(ids)), encoding="utf-8"
    )
    return path


def _task(tmp_path: Path, *, method: str = "dp-sgd", **data):
    cfg = config_from_dict({"method": method, "data": {"path": str(_toy(tmp_path)), **data}})
    return build_task(cfg)


def test_mapping_makes_the_patient_the_unit(tmp_path):
    task = _task(tmp_path, unit_ids=str(_write_csv(tmp_path, PATIENTS)))
    assert task.privacy_unit == "patient (unit ids from patients.csv)"
    assert len(task.train_set) == 7 and task.max_samples_per_unit == 2
    assert task.unit_note is None
    units = task.data_record["units"]
    assert units["units_used"] == 7 and units["images_per_unit"] == {
        "min": 1,
        "max": 2,
        "mean": 10 / 7,
    }
    assert len(task.data_record["sha256"]["patients.csv"]) == 64
    # the shareable split count is the number of patients; evaluation stays per image
    assert task.data_record["splits"] == {"train": 7, "val": 4, "test": 4}
    assert units["train_images"] == 10
    assert len(task.extra["splits"]["train"]) == 10


def test_npz_unit_ids_are_used_and_must_agree_with_a_csv(tmp_path):
    ids = np.asarray(PATIENTS)
    cfg = config_from_dict({"data": {"path": str(_toy(tmp_path, train_unit_ids=ids))}})
    task = build_task(cfg)
    assert task.privacy_unit == "patient (train_unit_ids in toy.npz)" and len(task.train_set) == 7
    renamed = [u.upper() for u in PATIENTS]  # same grouping, other names: accepted
    cfg.data.unit_ids = str(_write_csv(tmp_path, renamed))
    assert len(build_task(cfg).train_set) == 7
    other = ["a"] * 5 + ["b"] * 5
    cfg.data.unit_ids = str(_write_csv(tmp_path, other, "other.csv"))
    with pytest.raises(DataValidationError, match=r"(?s)other\.csv.*groups the training images "):
        build_task(cfg)


def test_bad_mapping_names_the_file_and_rows(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("index,unit_id\n0,a\n0,b\n", encoding="utf-8")
    with pytest.raises(DataValidationError) as info:
        _task(tmp_path, unit_ids=str(bad))
    err = str(info.value)
    assert str(bad) in err and "line 3 (index 0, first on line 2)" in err
    assert "9 of the 10 training indices have no row" in err and "toy.npz" in err
    with pytest.raises(ConfigError, match=r"data.unit_ids='nope.csv': could not find data"):
        _task(tmp_path, unit_ids="nope.csv")


def test_max_train_keeps_whole_units(tmp_path):
    task = _task(tmp_path, unit_ids=str(_write_csv(tmp_path, PATIENTS)), max_train=4)
    assert len(task.train_set) == 4
    kept = torch.cat([task.train_set[u]["index"] for u in range(4)]).sort().values
    for u in range(4):
        item = task.train_set[u]
        assert [PATIENTS[i] for i in item["index"]] == [item["unit_id"]] * PATIENTS.count(
            item["unit_id"]
        )
    images = task.extra["splits"]["train"].images
    assert torch.equal(images, task.extra["dataset"].splits["train"][0][kept])


def _private(task, method: str, batch: int = 2, clip: float = 0.05):
    model = tiny_cnn_2d(num_classes=2)
    loader = DataLoader(task.train_set, batch_size=batch, collate_fn=task.extra["collate"])
    engine = PrivacyEngine(seed=1)
    pm, popt, dp_loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=loader,
        noise_multiplier=1.0,
        max_grad_norm=clip,
        delta=1e-5,
        method=method,
        probe_source=GaussianProbes((1, 8, 8), num_classes=2),
        probe_loss=task.probe_loss,
    )
    return engine, pm, popt, dp_loader


@pytest.mark.parametrize("method", ["dp-sgd", "dp-kfc"])
def test_removing_one_patient_moves_clipped_sum_by_at_most_c(method, tmp_path, float64):
    """Neighbouring datasets differ in one patient (1 or 2 images): the sum moves by <= C."""
    torch.manual_seed(0)
    task = _task(tmp_path, method=method, unit_ids=str(_write_csv(tmp_path, PATIENTS)))
    clip = 0.05
    _, pm, popt, _ = _private(task, method, clip=clip)
    collate = task.extra["collate"]
    items = [task.train_set[u] for u in range(len(task.train_set))]

    def clipped(batch, per_unit=True):
        x, y, units = task.unpack(batch)
        return summed_clipped(
            popt, lambda: task.loss(pm(x.double()), y).backward(), units if per_unit else None
        )

    base = clipped(collate(items))
    for u, item in enumerate(items):
        moved = (base - clipped(collate(items[:u] + items[u + 1 :]))).norm()
        assert 1e-4 < moved <= clip + 1e-12, (item["unit_id"], float(moved))
    # Clipping the two images of patient p0 separately lets it move the sum by up to 2C.
    two = next(u for u, it in enumerate(items) if len(it["label"]) == 2)
    rest = items[:two] + items[two + 1 :]
    per_image = (clipped(collate(items), False) - clipped(collate(rest), False)).norm()
    assert per_image > clip * 1.5


def test_poisson_sampling_draws_whole_units_at_the_unit_rate(tmp_path):
    task = _task(tmp_path, unit_ids=str(_write_csv(tmp_path, PATIENTS)))
    engine, _, _, loader = _private(task, "dp-sgd", batch=2)
    n_units = len(task.train_set)
    assert engine.sample_rate == pytest.approx(1 / 4)  # 1 / ceil(7 units / 2), not images
    counts, empty = [], 0
    for _ in range(500):
        for batch in loader:
            counts.append(len(batch["unit_id"]))
            empty += len(batch["label"]) == 0
            assert batch["unit"].tolist() == sorted(batch["unit"].tolist())
            for b, uid in enumerate(batch["unit_id"]):
                rows = batch["index"][batch["unit"] == b].tolist()
                assert sorted(rows) == [i for i, p in enumerate(PATIENTS) if p == uid]
    # units per batch ~ Binomial(7, 1/4): mean 1.75 (images would give 2.5)
    assert abs(np.mean(counts) - n_units / 4) < 0.1
    assert empty > 0  # empty Poisson batches occur and collate to zero-size tensors


def test_without_mapping_the_unit_is_an_image_with_a_note_for_known_sets():
    cfg = config_from_dict({"data": {"path": str(ADRENAL), "max_train": 8, "max_eval": 4}})
    task = build_task(cfg)
    assert task.privacy_unit == "image" and task.max_samples_per_unit == 1
    note = task.unit_note
    assert note is not None and note["images_per_patient"] == 2
    assert note["dataset"] == "adrenalmnist3d" and "792 patients" in note["quote"]
    cfg = config_from_dict({"data": {"path": str(PNEUMONIA), "max_train": 8, "max_eval": 4}})
    task = build_task(cfg)
    assert task.privacy_unit == "image" and task.unit_note is None


def test_unit_ids_refused_for_segmentation_and_num_classes_checked():
    cfg = config_from_dict({"data": {"path": "x", "task": "segmentation", "unit_ids": "u.csv"}})
    with pytest.raises(ConfigError, match="data.unit_ids: applies to classification only"):
        build_task(cfg)
    cfg = config_from_dict({"data": {"path": "x", "num_classes": 1}})
    with pytest.raises(ConfigError, match=r"data.num_classes=1: must be an integer >= 2"):
        build_task(cfg)


def test_evaluate_a_patient_unit_run_on_another_file(tmp_path):
    """The run's mapping describes its own file: evaluation elsewhere is per image."""
    from dpkfc_med.training.evaluate import TrainingDataEvaluationWarning, evaluate_run
    from dpkfc_med.training.run import train

    csv = _write_csv(tmp_path, PATIENTS)
    cfg = config_from_dict(
        {
            "method": "dp-sgd",
            "data": {"path": str(_toy(tmp_path)), "unit_ids": str(csv), "resize": [28, 28]},
            "model": {"name": "small_cnn"},
            "privacy": {"target_epsilon": 8.0, "delta": 1e-3},
            "training": {"epochs": 1, "batch_size": 3, "progress": False},
            "output": {"dir": str(tmp_path / "run")},
        }
    )
    assert train(cfg).status == "complete"
    other = tmp_path / "other"
    other.mkdir()
    arrays = dict(np.load(tmp_path / "toy.npz"))
    arrays = {k: v[:6] for k, v in arrays.items()}
    np.savez(other / "site_b.npz", **arrays)
    with pytest.warns(TrainingDataEvaluationWarning):
        out = evaluate_run(tmp_path / "run", data=str(other / "site_b.npz"), split="train")
    assert out["n"] == 6 and out["not_dp"] is True
    assert out["overlap_with_training"]["shared"] == 6
