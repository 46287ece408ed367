"""A run that fails before its first noisy step leaves no folder; one that spent budget keeps it.

A refused or crashed start must not block the same command (``--out`` exists), and a crash
after noisy steps must keep the ledger that records them (never under-report spent budget).
"""

from __future__ import annotations

import json

import pytest

from dpkfc_med.training.config import load_config
from dpkfc_med.training.run import train
from tests.training.test_cli_classification import _config


class Boom(RuntimeError):
    pass


def _fail_before_first_step(engine, optimizer) -> None:
    raise Boom("a crash after the mechanism is wired, before any noisy step")


def _fail_after_two_steps(engine, optimizer) -> None:
    def hook(opt) -> None:
        if opt.steps_taken >= 2:
            raise Boom("a crash after two noisy steps")

    optimizer.post_step_hooks.append(hook)


def test_a_failure_before_the_first_step_removes_the_new_folder(tmp_path):
    out = tmp_path / "run"
    cfg = load_config(
        _config(tmp_path, method="dp-sgd", training={"epochs": 1}), [f"output.dir={out}"]
    )
    with pytest.raises(Boom) as raised:
        train(cfg, instrument=_fail_before_first_step)
    assert not out.exists()
    assert any("nothing was spent" in note for note in raised.value.__notes__)
    result = train(cfg)  # the same command again is not blocked
    assert result.status == "complete" and (out / "model.pt").is_file()


def test_a_failure_after_noisy_steps_keeps_the_folder_and_its_ledger(tmp_path):
    out = tmp_path / "run"
    cfg = load_config(
        _config(tmp_path, method="dp-sgd", training={"epochs": 1}), [f"output.dir={out}"]
    )
    with pytest.raises(Boom):
        train(cfg, instrument=_fail_after_two_steps)
    assert json.loads((out / "ledger.json").read_text(encoding="utf-8"))["steps"] >= 2


def test_a_failure_in_an_existing_folder_leaves_it(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("the user's", encoding="utf-8")
    cfg = load_config(
        _config(tmp_path, method="dp-sgd", training={"epochs": 1}), [f"output.dir={out}"]
    )
    with pytest.raises(Boom):
        train(cfg, instrument=_fail_before_first_step)
    assert (out / "notes.txt").read_text(encoding="utf-8") == "the user's"
