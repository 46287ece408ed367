"""The run record's typed sections: frozen, snapshots of live state, and the report's dicts."""

from __future__ import annotations

import dataclasses

import pytest

from dpkfc_med.privacy.accounting import PrivacyLedger
from dpkfc_med.report.record import Mechanism, RunRecord, build_report
from dpkfc_med.report.sections import (
    WEIGHT_AVERAGE_NOTE,
    DataSection,
    HistorySnapshot,
    ModelSection,
    RunSection,
    TaskSection,
    TrainingSection,
    snapshot_ledger,
)

FIX = {"path": "norm1", "before": "BatchNorm2d(8)", "after": "GroupNorm(4, 8)"}


def make_record(
    ledger: PrivacyLedger,
    history: dict,
    *,
    accountant: str = "prv",
    data: dict | None = None,
    **training,
) -> RunRecord:
    """A DP-SGD run's record over 100 images, its ledger a snapshot of ``ledger``."""
    mech = Mechanism(
        ledger=snapshot_ledger(ledger),
        accountant=accountant,
        target_epsilon=8.0,
        planned_steps=10,
        sample_rate=0.1,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        randomness="os-entropy",
        batch_size=10,
        seed=0,
    )
    return RunRecord(
        status="complete",
        method="dp-sgd",
        accountant=accountant,
        privacy_unit="image",
        run=RunSection("r", "/runs/r", "0" * 64, {"name": "r"}, seed=0, device="cpu"),
        task=TaskSection("classification", 2, 2, ("normal", "pneumonia")),
        data=DataSection(data or {"sha256": "ab"}, num_train_units=100, privacy_unit="image"),
        model=ModelSection("cnn", 1234, fixes=[FIX]),
        training=TrainingSection("sgd", 0.1, **training),
        history=HistorySnapshot.of(history),
        metrics={},
        environment={"python": "3.11", "packages": {}, "git": None},
        mechanism=mech,
    )


def test_the_record_is_a_snapshot_of_history_and_ledger():
    """Steps taken and epochs logged after the record is made do not reach its report."""
    live = PrivacyLedger(1e-5)
    live.record(0.1, 1.0, steps=4)
    history = {"step": [1, 2, 3, 4], "epsilon_step": [4], "loss": [1.0, 0.9, 0.8, 0.7]}
    record = make_record(live, history)
    before = build_report(record)
    live.record(0.1, 1.0, steps=6)  # the live run goes on
    history["step"].append(5)
    history["loss"].append(0.6)
    after = build_report(record)
    assert after["privacy"]["steps"] == before["privacy"]["steps"] == 4
    assert after["privacy"]["epsilon"] == before["privacy"]["epsilon"]
    assert after["history"]["step"] == [1, 2, 3, 4]
    assert after["history"]["loss"] == [1.0, 0.9, 0.8, 0.7]
    # and the snapshot's epsilon is the live ledger's at 4 steps, by a fresh ledger
    fresh = PrivacyLedger(1e-5)
    fresh.record(0.1, 1.0, steps=4)
    assert before["privacy"]["epsilon"] == fresh.all_epsilons()


def test_sections_are_frozen():
    record = make_record(PrivacyLedger(1e-5), {"step": []})
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.training.lr = 1.0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.data = DataSection({}, 1, "image")  # type: ignore[misc]


@pytest.mark.parametrize(
    ("select_epoch", "sentence"),
    [("last", "the last epoch (post-processing)"), ("best", "best validation auroc over epochs")],
)
def test_the_training_section_states_how_the_released_epoch_was_chosen(select_epoch, sentence):
    section = TrainingSection("adam", 0.01, select_epoch=select_epoch, selection_metric="auroc")
    assert section.as_dict()["model_selection"] == sentence


def test_the_weight_average_is_described_only_when_one_was_kept():
    assert TrainingSection("adam", 0.01).as_dict()["weight_average"] is None
    kept = TrainingSection("adam", 0.01, average_decay=0.99).as_dict()["weight_average"]
    assert kept == {"decay": 0.99, "note": WEIGHT_AVERAGE_NOTE}


def test_the_report_sections_are_the_record_sections():
    """Every typed section reaches the report unchanged; the data section keeps the record's
    own fields beside the unit count; the not-covered list is there as built."""
    live = PrivacyLedger(1e-5)
    live.record(0.1, 1.0, steps=2)
    record = make_record(live, {"step": [1, 2], "epsilon_step": [2]}, recipe_mode="auto")
    report = build_report(record)
    assert report["run"] == {
        "name": "r",
        "run_dir": "/runs/r",
        "config_sha256": "0" * 64,
        "config": {"name": "r"},
        "seed": 0,
        "device": "cpu",
        "precision": "fp32",
    }
    assert report["task"]["label_names"] == ["normal", "pneumonia"]
    assert report["data"]["sha256"] == "ab" and report["data"]["num_train_units"] == 100
    assert report["model"]["fixes"] == [FIX]
    assert report["training"]["recipe"] == {"mode": "auto", "fields": []}
    assert isinstance(report["privacy"]["not_covered"], list)
    assert report["privacy"]["not_covered"]  # a run config's tuning is never covered
