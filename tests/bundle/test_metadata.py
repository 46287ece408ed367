"""Bundle metadata: MONAI's required fields (offline), the privacy block, generated files fresh."""

from __future__ import annotations

import json

import pytest

from dpkfc_med.bundle.metadata import (
    REQUIRED_KEYS,
    TENSOR_KEYS,
    UNTRAINED,
    metadata_problems,
)
from dpkfc_med.bundle.pipelines import pipeline_files
from tests.bundle.conftest import PIPELINES

NAMES = ["classification_2d", "classification_3d", "segmentation_3d"]
ENVIRONMENT = ("monai_version", "pytorch_version", "numpy_version", "required_packages_version")


def _meta(name: str) -> dict:
    return json.loads((PIPELINES / name / "configs" / "metadata.json").read_text(encoding="utf-8"))


def test_required_keys_cover_monai_default_metadata():
    # MONAI's own template (monai.bundle.utils.DEFAULT_METADATA) has the schema's fields.
    from monai.bundle.utils import DEFAULT_METADATA

    assert set(DEFAULT_METADATA) - {"changelog"} <= set(REQUIRED_KEYS)
    assert set(REQUIRED_KEYS) - set(DEFAULT_METADATA) == {"schema"}


@pytest.mark.parametrize("name", NAMES)
def test_pipeline_metadata_is_complete_and_states_the_target(name):
    meta = _meta(name)
    assert metadata_problems(meta) == []
    for part in ("inputs", "outputs"):
        for spec in meta["network_data_format"][part].values():
            assert set(TENSOR_KEYS) <= set(spec)
    dp = meta["differential_privacy"]
    run_config = json.loads(
        (PIPELINES / name / "configs" / "train.json").read_text(encoding="utf-8")
    )["private_training"]
    assert dp["private"] is True
    assert dp["epsilon_target"] == run_config["privacy"]["target_epsilon"]
    assert dp["max_grad_norm"] == run_config["privacy"]["max_grad_norm"]
    assert dp["method"] == run_config["method"]
    # not trained yet: every spent value is null and says who fills it in
    assert {dp["epsilon_spent"][k] for k in ("prv", "rdp", "pld", "max")} == {None}
    assert dp["epsilon_spent"]["note"] == UNTRAINED
    assert dp["steps"] == dp["sample_rate"] == dp["privacy_report"]["sha256"] == UNTRAINED


@pytest.mark.parametrize("name", NAMES)
def test_generated_pipeline_files_are_up_to_date(name):
    generated = pipeline_files(PIPELINES / name)
    for rel, text in generated.items():
        committed = (PIPELINES / name / rel).read_text(encoding="utf-8")
        if rel.endswith(".json"):  # versions are those of the machine that generated them
            a, b = json.loads(committed), json.loads(text)
            for key in ENVIRONMENT:
                a.pop(key), b.pop(key)
            assert a == b, f"{rel} is stale: run python -m dpkfc_med.bundle.pipelines"
        else:
            assert committed == text, f"{rel} is stale: run python -m dpkfc_med.bundle.pipelines"


def test_metadata_problems_name_each_missing_field():
    meta = _meta("segmentation_3d")
    del meta["copyright"]
    del meta["network_data_format"]["inputs"]["image"]["value_range"]
    del meta["differential_privacy"]["noise_multiplier"]
    assert metadata_problems(meta) == [
        "copyright: required by the MONAI metadata schema",
        "network_data_format.inputs.image.value_range: required by the MONAI metadata schema",
        "differential_privacy.noise_multiplier: required",
    ]
    del meta["differential_privacy"]
    assert metadata_problems(meta)[-1].startswith("differential_privacy: required")
