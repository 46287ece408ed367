"""Config errors carry their culprits as fields; the CLI renames options from them, not text."""

from __future__ import annotations

from pathlib import Path

import pytest

from dpkfc_med.cli import main
from dpkfc_med.training.config import ConfigError, load_config

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "pneumoniamnist_cnn_2d_eps1.yaml"


def _config_with(tmp_path: Path, old: str, new: str) -> Path:
    bad = tmp_path / "bad.yaml"
    bad.write_text(CONFIG.read_text(encoding="utf-8").replace(old, new), encoding="utf-8")
    return bad


def test_override_problems_name_their_override_and_file_problems_the_file(tmp_path):
    bad = _config_with(tmp_path, "recipe: auto", "recipie: auto")
    with pytest.raises(ConfigError) as caught:
        load_config(bad, ["training.lrr=1"])
    err = caught.value
    assert err.source == f"{bad} and its --set overrides" and err.file == str(bad)
    (in_file, from_set), (no_culprit, culprit) = err.problems, err.set_by
    assert in_file.startswith("training.recipie: unknown field") and no_culprit is None
    assert culprit is not None and culprit[0] == "training.lrr=1"
    assert from_set == f"--set training.lrr=1: {culprit[1]}"
    assert culprit[1].startswith("unknown field (did you mean 'lr'?)")


def test_only_override_problems_name_no_file():
    with pytest.raises(ConfigError) as caught:
        load_config(CONFIG, ["training.lr=abc"])
    err = caught.value
    assert err.source == "the --set overrides" and err.file is None
    assert [c[0] for c in err.set_by if c] == ["training.lr=abc"]
    assert str(err).startswith("config error in the --set overrides:\n  --set training.lr=abc: ")


def test_an_error_built_by_hand_has_no_culprits():
    err = ConfigError(["data.path: missing"], "data")
    assert (err.problems, err.source, err.set_by, err.file) == (
        ["data.path: missing"],
        "data",
        [],
        None,
    )
    assert str(err) == "config error in data:\n  data.path: missing"


def test_the_cli_names_the_option_typed_beside_the_file(tmp_path, capsys):
    bad = _config_with(tmp_path, "accountant: prv", "accountant: prvv")
    assert main(["train", str(bad), "--out", str(tmp_path / "r"), "--epsilon", "-1"]) == 2
    err = capsys.readouterr().err
    assert f"config error in {bad} and its command-line options:\n" in err
    assert "\n  --epsilon -1.0: must be a positive number" in err and "--set" not in err
    assert "\n  privacy.accountant='prvv': not allowed (did you mean 'prv'?)" in err
