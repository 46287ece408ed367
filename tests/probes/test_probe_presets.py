import dataclasses
import json

import pytest

from dpkfc_med.probes import PRESETS, IntensityMode, ModalityPreset, get_preset

REQUIRED = ["natural", "xray", "ct", "mri", "ultrasound", "mammography", "histopathology", "fundus"]


def test_required_presets_present_and_documented() -> None:
    for name in REQUIRED:
        preset = PRESETS[name]
        assert preset.name == name
        assert preset.citation and preset.rationale
        json.dumps(preset.to_dict())


def test_preset_values() -> None:
    assert PRESETS["natural"].alpha == 2.0 and "Field" in PRESETS["natural"].citation
    assert "van Hateren" in PRESETS["natural"].citation
    mammo = PRESETS["mammography"]
    assert abs(mammo.alpha - 3.0) < 0.35 and "Burgess" in mammo.citation
    assert PRESETS["histopathology"].channels == 3 and PRESETS["fundus"].channels == 3
    assert PRESETS["mri"].intensity is IntensityMode.ZSCORE
    # Modalities without a published exponent use the natural-image default and say so.
    for name in ["xray", "mri", "ultrasound", "histopathology", "fundus", "ct"]:
        assert PRESETS[name].alpha == 2.0
        assert "No measured" in PRESETS[name].rationale


def test_presets_are_immutable() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        PRESETS["ct"].alpha = 3.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        PRESETS["new"] = PRESETS["ct"]  # type: ignore[index]


@pytest.mark.parametrize(
    ("name", "key"), [("MRI", "mri"), ("X-ray", "xray"), (" Mammography ", "mammography")]
)
def test_lookup_case_insensitive(name: str, key: str) -> None:
    assert get_preset(name) is PRESETS[key]


def test_lookup_passes_presets_through() -> None:
    assert get_preset(PRESETS["ct"]) is PRESETS["ct"]


def test_did_you_mean() -> None:
    with pytest.raises(
        ValueError,
        match=r"preset='mamography' is not allowed \(did you mean 'mammography'\?\); "
        r"choose one of \[.*'xray'\]",
    ):
        get_preset("mamography")
    with pytest.raises(ValueError, match="histopathology"):
        get_preset("qqq")


def test_preset_validation() -> None:
    with pytest.raises(ValueError, match="needs low < high"):
        ModalityPreset("bad", 2.0, IntensityMode.RANGE, 1.0, 0.0, 1, "c", "r")
    with pytest.raises(ValueError, match="takes no low/high"):
        ModalityPreset("bad", 2.0, IntensityMode.ZSCORE, 0.0, 1.0, 1, "c", "r")
