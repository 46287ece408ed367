"""The tracking handlers: what each stream may hold, and a shareable failure that never raises."""

from __future__ import annotations

import logging
import math

import pytest
from ignite.engine import Events

from dpkfc_med.engines.handlers.tracking import (
    CustodianTracking,
    ShareableTracking,
    TrackingBackend,
    TrackingPlan,
    plan_tracking,
    shareable_records,
)


def _report() -> dict:
    return {
        "status": "complete",
        "schema": 7,
        "run": {"config": {"training": {"lr": 0.1, "epochs": 2}}, "config_sha256": "abc"},
        "privacy": {
            "accountant": "prv",
            "noise_multiplier": 1.1,
            "steps": 3,
            "epsilon": {"prv": 0.9},
        },
        "history": {
            "step": [1, 2, 3],
            "epsilon_rdp": [0.5, 0.7, 1.0],
            "epsilon_step": [1, 2, 3],
            "epsilon": [0.4, 0.6, 0.9],
            "epsilon_accountant": "prv",
            "loss": [1.0, 0.9, 0.8],
        },
        "metrics": {"test": {"auc": 0.8}},
    }


def test_shareable_records_are_an_allowlist_of_the_report():
    records = shareable_records(_report())
    assert records["epsilon"] == {
        "epsilon_rdp": [(1, 0.5), (2, 0.7), (3, 1.0)],
        "epsilon_prv": [(1, 0.4), (2, 0.6), (3, 0.9)],
    }
    assert records["params"] == {
        "config.training.lr": 0.1,
        "config.training.epochs": 2,
        "privacy.accountant": "prv",
        "privacy.noise_multiplier": 1.1,
    }
    assert records["tags"] == {
        "dpkfc_med.stream": "shareable",
        "status": "complete",
        "report.schema": 7,
        "config_sha256": "abc",
        "privacy.steps": 3,
        "privacy.epsilon.prv": 0.9,
    }
    text = repr(records)
    assert "loss" not in text and "auc" not in text  # neither the loss nor a metric


def test_custodian_step_values_are_the_steps_loss_and_clipping_diagnostics(trainer):
    engine = trainer()
    seen: list[dict[str, float]] = []
    engine.add_event_handler(
        Events.ITERATION_COMPLETED, lambda e: seen.append(CustodianTracking.step_values(e))
    )
    units: list[int] = []
    engine.add_event_handler(
        Events.ITERATION_COMPLETED, lambda e: units.append(e.optimizer.last_diagnostics.batch_units)
    )
    engine.run()
    for values, n in zip(seen, units):
        if n:
            assert values["clipping/batch_units"] == n and math.isfinite(values["loss"])
        else:  # an empty Poisson batch: no diagnostics to show
            assert set(values) <= {"loss"}


def test_no_backend_plans_no_stream_and_the_default_places(tmp_path):
    assert plan_tracking("none", tmp_path) is None
    plan = plan_tracking("tensorboard", tmp_path)
    assert plan is not None and plan.backend is TrackingBackend.TENSORBOARD
    assert plan.shareable == str(tmp_path / "tracking")
    assert plan.custodian == str(tmp_path / "private_not_for_release" / "tracking")
    assert not plan.custodian_explicit


def test_a_shareable_stream_failure_is_logged_never_raised(tmp_path, caplog):
    plan = TrackingPlan(TrackingBackend.TENSORBOARD, str(tmp_path / "tb"), "", False, "e", "r")
    with caplog.at_level(logging.ERROR, logger="dpkfc_med"):
        ShareableTracking(plan, tmp_path)()  # no privacy_report.json in the run folder
    assert "the shareable tracking stream was not written" in caplog.text
    with pytest.raises(FileNotFoundError):
        ShareableTracking(plan, tmp_path).write()
