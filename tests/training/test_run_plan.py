"""The run's plan is typed and frozen, and ``plan.json`` keeps the format old runs resume from."""

from __future__ import annotations

import dataclasses
import json

import pytest

from dpkfc_med.training.config import config_from_dict
from dpkfc_med.training.opening import (
    OpeningKind,
    PlanError,
    PrivacyPlan,
    RunPlan,
    plan_privacy,
)
from dpkfc_med.utils import write_json

# one entry of a plan.json as runs have written it since plans were stored (write_json, indent 1)
STORED = """{
 "plans": [
  {
   "session": 0,
   "kind": "start",
   "time": "2026-12-01T10:00:00+00:00",
   "changed_fields": [],
   "plan": {
    "delta": 1e-05,
    "sample_rate": 0.3333333333333333,
    "planned_steps": 9,
    "noise_multiplier": 1.2345678901234567,
    "spent_steps": 0,
    "steps_remaining": 9
   },
   "data_sha256": "ab12"
  }
 ]
}"""


def _cfg(**privacy):
    return config_from_dict(
        {"method": "dp-sgd", "privacy": {"target_epsilon": 4.0, **privacy},
         "training": {"epochs": 3, "batch_size": 8},
         "data": {"task": "classification", "path": "x"}}
    )  # fmt: skip


def test_a_stored_plan_is_read_and_written_back_byte_for_byte(tmp_path):
    entries = json.loads(STORED)["plans"]
    plan = PrivacyPlan.from_dict(entries[0]["plan"])
    assert plan.planned_steps == 9 and plan.noise_multiplier == 1.2345678901234567
    write_json(tmp_path / "plan.json", {"plans": [{**entries[0], "plan": plan.to_dict()}]})
    assert (tmp_path / "plan.json").read_text(encoding="utf-8") == STORED


def test_a_continued_plan_records_the_spent_steps_and_keeps_the_rest():
    plan = PrivacyPlan.from_dict(json.loads(STORED)["plans"][0]["plan"])
    later = plan.continued(4)
    assert later.to_dict() == {**plan.to_dict(), "spent_steps": 4, "steps_remaining": 5}
    assert list(later.to_dict()) == list(plan.to_dict())
    assert plan.continued(12).steps_remaining == 0
    assert "9 noisy steps" in later.describe() and "4 already spent" in later.describe()


def test_a_stored_plan_without_a_field_is_refused_by_name():
    stored = json.loads(STORED)["plans"][0]["plan"]
    del stored["noise_multiplier"]
    with pytest.raises(PlanError, match=r"plan.json: the stored plan lacks \['noise_multiplier'\]"):
        PrivacyPlan.from_dict(stored)


def test_the_plan_is_frozen_and_says_how_the_run_opens():
    privacy = plan_privacy(_cfg(), 64, 8)
    assert (privacy.sample_rate, privacy.planned_steps, privacy.spent_steps) == (1 / 8, 24, 0)
    assert privacy.delta == pytest.approx(1e-5) and privacy.noise_multiplier > 0
    plan = RunPlan(OpeningKind.CHECKPOINT, privacy)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.privacy = None  # type: ignore[misc]
    assert plan.from_checkpoint and f"{plan.kind}" == "checkpoint"
    assert not plan.all_spent(23) and plan.all_spent(24)
    assert not RunPlan(OpeningKind.START, None).all_spent(10**9)  # non-private: epochs only


def test_a_given_noise_multiplier_that_overspends_is_refused():
    with pytest.raises(PlanError, match="spends epsilon .* > privacy.target_epsilon=4.0"):
        plan_privacy(_cfg(noise_multiplier=0.3), 64, 8)
