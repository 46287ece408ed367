"""``dpkfc-med train CONFIG --nproc 2``: one run over two gloo processes on loopback."""

from __future__ import annotations

import torch

from dpkfc_med.cli import main
from dpkfc_med.training.config import load_config
from dpkfc_med.training.run import train
from tests.training.test_cli_classification import _config, _report


def test_two_processes_continue_one_run_with_one_ledger(tmp_path, capsys):
    """A run stopped after one epoch in one process is finished by two: same plan, one ledger
    and one report (rank 0's), stating the processes; a user error comes back as one message."""
    cfg = _config(
        tmp_path,
        privacy={"accountant": "rdp"},
        training={"epochs": 2, "threads": 1},
        probes={"num_probes": 16, "refresh_every": 1},
    )
    out = tmp_path / "run"
    first = train(load_config(cfg, [f"output.dir={out}"]), stop_after_epochs=1)
    assert first.status == "incomplete"
    before = _report(out)["privacy"]
    assert before["steps"] == 3 and before["processes"] == {"world_size": 1, "backend": None}
    assert main(["train", str(cfg), "--out", str(out), "--nproc", "2", "--resume"]) == 0
    assert "privacy: epsilon" in capsys.readouterr().out
    rep = _report(out)
    p = rep["privacy"]
    assert rep["status"] == "complete" and p["processes"] == {"world_size": 2, "backend": "gloo"}
    assert p["steps"] == p["planned_steps"] == before["planned_steps"] == 6
    for key in ("sample_rate", "expected_batch_size", "noise_multiplier"):
        assert p[key] == before[key], key
    assert p["epsilon"]["rdp"] <= 4.0 and p["epsilon"]["rdp"] > before["epsilon"]["rdp"]
    assert [x.name for x in out.rglob("ledger*.json")] == ["ledger.json"]
    assert "one noise draw per step on rank 0" in (out / "privacy_report.md").read_text(
        encoding="utf-8"
    )
    assert torch.load(out / "model.pt", map_location="cpu", weights_only=False)["model"]
    # the ranks' user errors come back as one clear message: a complete run is final
    assert main(["train", str(cfg), "--out", str(out), "--nproc", "2", "--resume"]) == 2
    assert "is already complete (6 noisy steps already spent" in capsys.readouterr().err


def test_nproc_is_checked_before_any_process_starts(tmp_path, capsys):
    cfg = _config(tmp_path)
    assert main(["train", str(cfg), "--out", str(tmp_path / "r"), "--nproc", "0"]) == 2
    assert "--nproc 0: use 2 or more processes" in capsys.readouterr().err
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    cfg = _config(tmp_path, training={"device": "cuda"})
    code = main(["train", str(cfg), "--out", str(tmp_path / "r"), "--nproc", str(gpus + 1)])
    assert code == 2
    err = capsys.readouterr().err
    if gpus:
        assert f"{gpus} GPU(s) visible; NCCL needs one GPU per process" in err
    else:  # refused by the config check before the process count is looked at
        assert "training.device=cuda: no CUDA device is available" in err
