"""Stopped, interrupted and killed runs resume with what was spent, and say so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from dpkfc_med.cli import main
from dpkfc_med.privacy.accounting import PrivacyLedger
from dpkfc_med.training.config import ConfigError, load_config
from dpkfc_med.training.run import RunInterrupted, train
from tests.training.test_cli_classification import _config, _report


class _HardKill(BaseException):
    """Stands in for kill -9: no handler of the trainer runs (not Exception, not Ctrl-C)."""


def _stop_at(step: int, exc: type[BaseException]):
    def instrument(engine, popt):
        def hook(opt):
            if opt.steps_taken == step:
                raise exc()

        popt.post_step_hooks.append(hook)

    return instrument


def _ledger(run: Path) -> PrivacyLedger:
    return PrivacyLedger.load(run / "ledger.json")


def test_resume_with_more_epochs_replans_within_the_target(tmp_path):
    cfg_path = _config(tmp_path, method="dp-sgd", training={"epochs": 3})
    run = tmp_path / "r"
    train(load_config(cfg_path, [f"output.dir={run}"]), stop_after_epochs=1)
    original = (run / "config.yaml").read_text(encoding="utf-8")
    more = load_config(cfg_path, [f"output.dir={run}", "training.epochs=8"])
    result = train(more, resume=True)
    assert result.status == "complete"
    ledger = _ledger(run)
    assert ledger.steps == 24  # 8 epochs of 3 steps
    for accountant in ("prv", "pld"):
        assert ledger.epsilon(accountant) <= 4.0  # never past the target, composed
    first, later = ledger.events[0], ledger.events[-1]
    assert first.steps == 3 and later.noise_multiplier > first.noise_multiplier
    # config.yaml is the config the run now follows; every session's config is appended
    assert (run / "config.yaml").read_text(encoding="utf-8") != original
    assert (
        yaml.safe_load((run / "config.yaml").read_text(encoding="utf-8"))["training"]["epochs"] == 8
    )
    sessions = list(yaml.safe_load_all((run / "config_history.yaml").read_text(encoding="utf-8")))
    assert [s["training"]["epochs"] for s in sessions] == [3, 8]
    plans = json.loads((run / "plan.json").read_text(encoding="utf-8"))["plans"]
    assert [p["kind"] for p in plans] == ["start", "checkpoint"]
    assert plans[1]["changed_fields"] == ["training.epochs"]
    assert plans[1]["plan"]["spent_steps"] == 3  # the first session's epoch
    rep = _report(run)
    assert rep["privacy"]["steps"] == 24 and rep["privacy"]["epsilon"]["prv"] <= 4.0
    assert len(rep["privacy"]["plan_history"]) == 2


def test_resume_refuses_changes_to_the_mechanism_naming_them(tmp_path):
    cfg_path = _config(tmp_path, method="dp-sgd", training={"epochs": 3})
    run = tmp_path / "r"
    train(load_config(cfg_path, [f"output.dir={run}"]), stop_after_epochs=1)
    before = _ledger(run).steps
    changed = load_config(
        cfg_path,
        [f"output.dir={run}", "training.batch_size=16", "privacy.max_grad_norm=2.0"],
    )
    with pytest.raises(ConfigError, match=r"privacy\.max_grad_norm: 1\.0 -> 2\.0") as err:
        train(changed, resume=True)
    assert "training.batch_size: 32 -> 16" in str(err.value)
    assert _ledger(run).steps == before  # nothing was spent by the refused attempt


def test_resume_after_a_hard_kill_before_the_first_checkpoint(tmp_path):
    cfg_path = _config(tmp_path, method="dp-sgd", training={"epochs": 3})
    run = tmp_path / "r"
    cfg = load_config(cfg_path, [f"output.dir={run}"])
    with pytest.raises(_HardKill):
        train(cfg, instrument=_stop_at(2, _HardKill))
    assert not (run / "checkpoint.pt").exists()
    spent = _ledger(run)
    assert spent.steps == 2
    # a fresh start in the same folder says what was spent and how to go on
    with pytest.raises(ConfigError, match=r"2 noisy steps already spent, epsilon .*--resume"):
        train(cfg)
    result = train(cfg, resume=True)  # the ledger alone is enough
    assert result.status == "complete"
    ledger = _ledger(run)
    assert ledger.steps == 2 + 9  # the spent steps, then a whole plan from the initial model
    assert ledger.events[0] == spent.events[0]
    assert ledger.epsilon("prv") <= 4.0 and ledger.epsilon("pld") <= 4.0
    assert [
        p["kind"] for p in json.loads((run / "plan.json").read_text(encoding="utf-8"))["plans"]
    ] == [
        "start",
        "ledger",
    ]


def test_interrupt_writes_a_checkpoint_and_says_what_was_spent(tmp_path):
    cfg_path = _config(tmp_path, method="dp-sgd", training={"epochs": 3})
    run = tmp_path / "r"
    cfg = load_config(cfg_path, [f"output.dir={run}"])
    with pytest.raises(RunInterrupted, match=r"2 noisy steps spent, epsilon .* --resume"):
        train(cfg, instrument=_stop_at(2, KeyboardInterrupt))
    ck = torch.load(run / "checkpoint.pt", weights_only=False)
    assert ck["mid_epoch"] is True and ck["engine"]["steps_taken"] == 2
    assert _report(run)["status"] == "incomplete"
    result = train(cfg, resume=True)
    assert result.status == "complete" and _ledger(run).steps == 9  # the plan, exactly


def test_a_stopped_run_continues_as_it_was_with_its_own_config(tmp_path, capsys):
    cfg_path = _config(tmp_path, method="dp-sgd", training={"epochs": 2})
    run = tmp_path / "r"
    first = load_config(cfg_path, [f"output.dir={run}", "training.epochs=4"])
    with pytest.raises(RunInterrupted, match=rf"`dpkfc-med train --resume --out {run}`"):
        train(first, instrument=_stop_at(2, KeyboardInterrupt))
    # the printed command continues the run with its own stored config (4 epochs, not 2)
    assert main(["train", "--resume", "--out", str(run)]) == 0
    assert _ledger(run).steps == 12  # 4 epochs of 3 steps: the first plan
    plans = json.loads((run / "plan.json").read_text(encoding="utf-8"))["plans"]
    assert [p["plan"]["spent_steps"] for p in plans] == [0, 2]
    assert plans[1]["plan"]["steps_remaining"] == 10
    assert "changes" not in capsys.readouterr().err


def test_resuming_with_a_changed_config_says_every_change_and_the_replan(tmp_path, capsys):
    cfg_path = _config(tmp_path, method="dp-sgd", training={"epochs": 4})
    run = tmp_path / "r"
    with pytest.raises(RunInterrupted):
        train(
            load_config(cfg_path, [f"output.dir={run}"]), instrument=_stop_at(4, KeyboardInterrupt)
        )
    capsys.readouterr()
    assert (
        main(["train", str(cfg_path), "--resume", "--out", str(run), "--set", "training.epochs=3"])
        == 0
    )
    err = capsys.readouterr().err
    assert "changes 1 field of the run's stored configuration" in err
    assert "training.epochs: 4 -> 3" in err and "re-planned within the target" in err
    assert _ledger(run).steps == 9


def test_train_without_config_needs_resume_and_a_run(tmp_path, capsys):
    assert main(["train", "--out", str(tmp_path / "nothing")]) == 2
    assert "CONFIG: required" in capsys.readouterr().err
    assert main(["train", "--resume", "--out", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert "dpkfc-med train --resume --out RUN_DIR" in err and "config.yaml not found" in err
