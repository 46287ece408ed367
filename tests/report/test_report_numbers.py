"""Numbers and provenance of the report: epsilon and delta rounded up, environment, digests."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest

from dpkfc_med.report import (
    collect_environment,
    format_delta,
    format_epsilon,
    sha256_of_files,
    validate_report,
)
from dpkfc_med.report import environment as env_module
from tests.report.test_report import example_report


# --------------------------------------------------------------------------- rounding
@pytest.mark.parametrize(
    ("value", "text"),
    [
        (1.23401, "1.235"),
        (0.99912, "1.000"),
        (1.234, "1.234"),  # exact decimals stay as they are
        (2.0, "2.000"),
        (0.0, "0.000"),
        (0.0000001, "0.001"),
        (12.3456, "12.346"),
        (None, "n/a"),
        (math.inf, "inf"),
    ],
)
def test_epsilon_is_rounded_up(value, text):
    assert format_epsilon(value) == text


def test_epsilon_never_printed_below_its_value():
    rng = np.random.default_rng(0)
    for value in rng.uniform(0, 20, 2000):
        assert float(format_epsilon(float(value))) >= value


@pytest.mark.parametrize(
    ("value", "text"),
    [(1e-5, "1e-5"), (1 / 546, "0.00184"), (1 / 5460, "1.84e-4"), (2.8571428e-6, "2.86e-6")],
)
def test_delta_is_rounded_up(value, text):
    assert format_delta(value) == text
    assert float(text) >= value


# --------------------------------------------------------------------------- environment
def test_collect_environment_has_versions(monkeypatch, tmp_path):
    calls = []

    def fake_git(repo_dir, *args):
        calls.append(args)
        return {"rev-parse": "c0ffee" * 6 + "abcd\n", "status": " M file.py\n"}[args[0]]

    monkeypatch.setattr(env_module, "_run_git", fake_git)
    (tmp_path / ".git").mkdir()
    env = collect_environment(tmp_path)
    for name in ("torch", "opacus", "monai", "numpy", "dpkfc_med", "nibabel", "medmnist"):
        assert name in env["packages"]
    assert env["packages"]["torch"] and env["packages"]["numpy"] == np.__version__
    assert env["git"] == {"commit": "c0ffee" * 6 + "abcd", "dirty": True}
    assert env["machine"]["cpu_count"] >= 1 and env["machine"]["torch_threads"] >= 1
    assert env["python"].count(".") == 2
    report = example_report(environment=env)
    assert validate_report(report) == []


def test_collect_environment_outside_a_checkout(monkeypatch, tmp_path):
    def no_git(*args):
        raise AssertionError("git must not run outside a checkout")

    monkeypatch.setattr(env_module, "_run_git", no_git)
    assert collect_environment(tmp_path)["git"] is None


def test_collect_environment_git_failure(monkeypatch, tmp_path):
    monkeypatch.setattr(env_module, "_run_git", lambda *args: None)
    (tmp_path / ".git").mkdir()
    assert collect_environment(tmp_path)["git"] is None


def test_sha256_of_files(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"abc")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_bytes(b"")
    digests = sha256_of_files(tmp_path)
    assert digests == {
        str(tmp_path / "a.txt"): hashlib.sha256(b"abc").hexdigest(),
        str(tmp_path / "sub" / "b.txt"): hashlib.sha256(b"").hexdigest(),
    }
    assert sha256_of_files([tmp_path / "a.txt"]) == {
        str(tmp_path / "a.txt"): hashlib.sha256(b"abc").hexdigest()
    }
    with pytest.raises(FileNotFoundError, match="missing.npz: no such file"):
        sha256_of_files(tmp_path / "missing.npz")
