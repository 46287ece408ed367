"""Evaluate a finished run on any dataset of the same task (``dpkfc-med evaluate``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import yaml

from dpkfc_med.training.config import ConfigError, config_from_dict
from dpkfc_med.training.loop import _build_model, _write_json
from dpkfc_med.training.tasks import build_task

__all__ = ["evaluate_run"]


def evaluate_run(
    run_dir: str | Path, *, data: str | None = None, split: str = "test", device: str = "cpu"
) -> dict[str, Any]:
    """Metrics of the run's selected model on ``split`` of ``data`` (default: the run's data).

    Evaluation reads only the released model, so it costs no privacy budget on the training
    data; the evaluation data itself is not protected by the run's guarantee.

    Raises:
        ConfigError: the run directory is incomplete or the data does not match the task.
    """
    run = Path(run_dir)
    problems = [
        f"{run / n}: missing" for n in ("config.yaml", "model.pt") if not (run / n).is_file()
    ]
    if problems:
        raise ConfigError(
            problems + ["evaluate needs a finished run directory (dpkfc-med train ...)"], str(run)
        )
    cfg = config_from_dict(
        yaml.safe_load((run / "config.yaml").read_text()), str(run / "config.yaml")
    )
    cfg.data.max_train = None
    cfg.data.max_eval = None
    saved = torch.load(run / "model.pt", map_location="cpu", weights_only=False)
    meta = saved["task"]
    task = build_task(cfg, data)
    mismatch = []
    for key, got in (
        ("in_channels", task.in_channels),
        ("num_classes", task.num_classes),
        ("spatial_dims", task.spatial_dims),
    ):
        if meta[key] != got:
            mismatch.append(f"{key}: the run was trained with {meta[key]}, the data has {got}")
    if task.kind == "classification" and list(task.spatial_shape) != list(meta["spatial_shape"]):
        mismatch.append(
            f"spatial_shape: the run was trained on {meta['spatial_shape']}, the data has "
            f"{list(task.spatial_shape)}"
        )
    if mismatch:
        raise ConfigError(
            mismatch + ["pass a dataset of the same task (--data)"], str(data or cfg.data.path)
        )
    note = None
    if task.extra.get("own_data") is False and "all" in task.extra.get("splits", {}):
        # Another folder of the same task has no train/val/test meaning for this run: all cases.
        note = f"--data is not the run's data: evaluated on all its cases (--split {split} unused)"
        split = "all"
    if split not in task.extra.get("splits", {}):
        raise ConfigError(
            [f"--split {split}: the data has splits {list(task.extra.get('splits', {}))}"]
        )
    dev = torch.device(device)
    model, _ = _build_model(cfg, task)
    model.load_state_dict(saved["model"])
    model.to(dev).eval()
    metrics = task.evaluate(model, split, dev, cfg.training.eval_batch_size)
    out = {
        "run": str(run),
        "data": task.data_record,
        "split": split,
        "selected_epoch": saved.get("selected_epoch"),
        **({"note": note} if note else {}),
        **metrics,
    }
    stem = Path(task.data_record["path"]).stem
    _write_json(run / "evaluations" / f"{stem}_{split}.json", out)
    return json.loads(json.dumps(out, default=str))
