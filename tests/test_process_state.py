"""Every test owns the process state it changes: the suite passes in one process, any order."""

from __future__ import annotations

import locale
import logging
import os
import sys

import torch

from tests.conftest import _FRESH_LOCALE, restored_process_state


def test_a_test_starts_from_a_fresh_processs_state():
    assert locale.setlocale(locale.LC_ALL) == _FRESH_LOCALE
    log = logging.getLogger("dpkfc_med")
    assert log.propagate and not log.handlers and log.level == logging.NOTSET
    first = torch.rand(3)
    torch.manual_seed(0)
    assert torch.equal(first, torch.rand(3))  # seeded like every test


def test_what_a_run_or_a_dicom_writer_leaves_is_undone(tmp_path, monkeypatch):
    monkeypatch.delenv("DPKFC_PROCESS_STATE_PROBE", raising=False)
    before_threads, before_path = torch.get_num_threads(), list(sys.path)
    log = logging.getLogger("dpkfc_med")
    with restored_process_state():
        locale.setlocale(locale.LC_ALL, "C")  # SimpleITK's DICOM writer (GDCM) does this
        assert locale.setlocale(locale.LC_ALL) != _FRESH_LOCALE
        handler = logging.FileHandler(tmp_path / "train.log")  # what setup_logging leaves
        log.addHandler(handler)
        log.propagate = False
        log.setLevel(logging.INFO)
        torch.set_num_threads(before_threads + 1)
        torch.set_default_dtype(torch.float64)
        sys.path.insert(0, str(tmp_path))
        os.environ["DPKFC_PROCESS_STATE_PROBE"] = "1"
        os.chdir(tmp_path)
    assert locale.setlocale(locale.LC_ALL) == _FRESH_LOCALE
    assert log.propagate and not log.handlers and log.level == logging.NOTSET
    assert handler.stream is None  # closed: no open file in a removed tmp folder
    assert torch.get_num_threads() == before_threads
    assert torch.get_default_dtype() == torch.float32
    assert sys.path == before_path and "DPKFC_PROCESS_STATE_PROBE" not in os.environ
    assert os.getcwd() != str(tmp_path)
