"""Epsilon after every step (progress bar, report history), one expected batch, bad --out."""

from __future__ import annotations

import html
import json
import os
import re
from pathlib import Path

import pytest
import tqdm
import yaml
from opacus.accountants import PRVAccountant, RDPAccountant

from dpkfc_med.cli import main
from dpkfc_med.privacy.accounting import RDP_ALPHAS
from dpkfc_med.report import format_epsilon
from dpkfc_med.training.config import load_config
from dpkfc_med.training.run import train
from tests.conftest import SHARED_DATA

PNEUMONIA = Path(SHARED_DATA) / "medmnist" / "pneumoniamnist.npz"
N_UNITS, BATCH = 100, 40  # ceil(100/40) = 3 steps per epoch: q = 1/3, expected batch 33, not 40
EPOCHS = 2


def _config(tmp_path: Path, out: Path, **training) -> Path:
    cfg = {
        "name": "per_step",
        "method": "dp-sgd",
        "data": {"path": str(PNEUMONIA), "max_train": N_UNITS, "max_eval": 32},
        "model": {"name": "small_cnn"},
        "privacy": {"target_epsilon": 3.0, "max_grad_norm": 1.0},
        "training": {
            "epochs": EPOCHS,
            "batch_size": BATCH,
            "lr": 0.05,
            "progress": False,
            "eval_batch_size": 64,
            **training,
        },
        "output": {"dir": str(out)},
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


def _opacus(kind: str, sigma: float, q: float, steps: int, delta: float) -> float:
    """Epsilon of ``steps`` identical steps straight from Opacus (the brute-force reference)."""
    if kind == "rdp":
        acc = RDPAccountant()
        acc.history = [(sigma, q, steps)]
        return float(acc.get_epsilon(delta, alphas=RDP_ALPHAS))
    acc = PRVAccountant()
    acc.history = [(sigma, q, steps)]
    return float(acc.get_epsilon(delta))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One 2-epoch DP-SGD run, recording every progress-bar update."""
    tmp = tmp_path_factory.mktemp("per_step")
    postfixes: list[dict[str, str]] = []
    original = tqdm.tqdm.set_postfix

    def record(self, ordered_dict=None, refresh=True, **kwargs):
        postfixes.append({k: str(v) for k, v in kwargs.items()})
        return original(self, ordered_dict, refresh, **kwargs)

    mp = pytest.MonkeyPatch()
    mp.setattr(tqdm.tqdm, "set_postfix", record)
    try:
        result = train(load_config(_config(tmp, tmp / "run")))
    finally:
        mp.undo()
    return result, postfixes


def test_progress_bar_shows_a_fresh_epsilon_after_every_noisy_step(run):
    result, postfixes = run
    p = result.report["privacy"]
    sigma, q, delta = p["noise_multiplier"], p["sample_rate"], p["delta"]
    assert p["steps"] == EPOCHS * 3 == len(postfixes)
    for step, shown in enumerate(postfixes, start=1):
        # RDP after this very step, never the previous epoch's value (nor 0.00 in epoch 1).
        assert shown["eps_rdp"] == format_epsilon(_opacus("rdp", sigma, q, step, delta)), step
        assert float(shown["eps_rdp"]) > 0
        # The stated accountant (PRV) at the latest listed step at or before this one.
        value, at = shown["eps_prv"].split("@")
        listed = max(s for s in (1, 2, 3, 4, 6) if s <= step)
        assert int(at) == listed, (step, shown)
        assert value == format_epsilon(_opacus("prv", sigma, q, listed, delta))


def test_report_history_lists_exact_epsilon_at_the_stated_steps(run):
    result, _ = run
    rep, p = result.report, result.report["privacy"]
    history = rep["history"]
    sigma, q, delta = p["noise_multiplier"], p["sample_rate"], p["delta"]
    # powers of two (1, 2, 4), the last step of each epoch (3, 6) and the last step taken (6)
    assert history["epsilon_step"] == [1, 2, 3, 4, 6]
    assert history["epsilon_accountant"] == "prv"
    assert history["epsilon"] == [
        _opacus("prv", sigma, q, s, delta) for s in history["epsilon_step"]
    ]
    assert history["epsilon"][-1] == p["epsilon"]["prv"]
    assert history["epsilon"] == sorted(history["epsilon"])  # no staircase: all distinct
    assert len(set(history["epsilon"])) == len(history["epsilon"])
    assert history["step"] == [1, 2, 3, 4, 5, 6]
    assert history["epsilon_rdp"] == [_opacus("rdp", sigma, q, s, delta) for s in range(1, 7)]
    md = (result.run_dir / "privacy_report.md").read_text(encoding="utf-8")
    assert history["epsilon_schedule"] in md
    assert "steps 1, 2, 4, 8, ... (the powers of two), the last step of every epoch" in md
    for s, value, rdp in zip(
        history["epsilon_step"],
        history["epsilon"],
        [history["epsilon_rdp"][i - 1] for i in history["epsilon_step"]],
    ):
        assert f"| {s} | {format_epsilon(value)} | {format_epsilon(rdp)} |" in md


def test_every_table_and_text_give_the_same_q_and_expected_batch(run):
    """q = 1/ceil(N/B) and the expected batch round(q N) = 33 everywhere; B = 40 is a setting."""
    result, _ = run
    p = result.report["privacy"]
    assert p["sample_rate"] == 1 / 3 and p["expected_batch_size"] == round(N_UNITS / 3) == 33
    assert p["ledger"]["meta"]["expected_batch_size"] == 33
    assert p["batch_size"] == BATCH and p["steps_per_epoch"] == 3
    assert "expected_batch_size" not in result.report["training"]
    md = (result.run_dir / "privacy_report.md").read_text(encoding="utf-8")
    page = (result.run_dir / "privacy_report.html").read_text(encoding="utf-8")
    for text in (md, html.unescape(re.sub(r"<[^>]+>", " ", page))):
        expected = re.findall(r"expected[ _]batch[ _]size\W+(\d+)", text, flags=re.IGNORECASE)
        assert len(expected) >= 3 and set(expected) == {"33"}, expected
        # q has one definition wherever it is given, and one value wherever it is evaluated
        assert {m for m in re.findall(r"\bq = (\S+)", text)} <= {"1/ceil(N/B)", "1/ceil(N/B),"}
        values = re.findall(r"q = 1/ceil\(N/B\) = (1/\d+ = [0-9.]+)", text)
        assert len(values) >= 3 and set(values) == {"1/3 = 0.333333"}, values
        assert "B/N" not in text and "batch/N" not in text
        assert "q N = 33.333, rounded" in text


def test_read_only_output_directory_is_a_clear_error(tmp_path, capsys, monkeypatch):
    """A run directory under a folder the user cannot write: ``error: ...``, exit 2, nothing left.

    Tests may run as root, for whom ``chmod`` does not stop writes; then the operating system's
    refusal is simulated by making ``Path.mkdir`` raise the ``PermissionError`` it raises for an
    unprivileged user inside the read-only folder.
    """
    locked = tmp_path / "locked"
    locked.mkdir()
    out = locked / "run"
    cfg = _config(tmp_path, out, epochs=1)
    locked.chmod(0o555)
    if os.geteuid() == 0:
        real_mkdir = Path.mkdir

        def refuse(self, *args, **kwargs):
            if locked in self.parents:
                raise PermissionError(13, "Permission denied", str(self))
            return real_mkdir(self, *args, **kwargs)

        monkeypatch.setattr(Path, "mkdir", refuse)
    try:
        code = main(["train", str(cfg), "--out", str(out)])
        err = capsys.readouterr().err
        assert code == 2
        assert err.startswith("error: ") and "Traceback" not in err
        assert f"output.dir: cannot write the run directory {out}: Permission denied" in err
        assert "choose a writable folder with --out" in err
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(0o755)


def test_output_path_under_a_file_is_a_clear_error_and_leaves_nothing(tmp_path, capsys):
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("a file", encoding="utf-8")
    out = blocker / "runs" / "run"
    cfg = _config(tmp_path, tmp_path / "unused", epochs=1)
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["train", str(cfg), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    assert f"output.dir: cannot write the run directory {out}: Not a directory" in err
    assert blocker.read_text(encoding="utf-8") == "a file"
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_run_refused_for_its_output_directory_spent_nothing(tmp_path, monkeypatch):
    """The check runs before the run directory, the ledger or any step exist."""
    calls: list[str] = []
    import dpkfc_med.training.run as loop

    real = loop.start_run_files
    monkeypatch.setattr(loop, "start_run_files", lambda *a: calls.append("start") or real(*a))
    blocker = tmp_path / "file"
    blocker.write_text("", encoding="utf-8")
    with pytest.raises(ValueError, match="output.dir: cannot write"):
        train(load_config(_config(tmp_path, blocker / "run", epochs=1)))
    assert calls == []


def test_json_history_is_what_the_report_prints(run):
    result, _ = run
    data = json.loads((result.run_dir / "privacy_report.json").read_text(encoding="utf-8"))
    assert data["history"]["epsilon"] == result.report["history"]["epsilon"]
