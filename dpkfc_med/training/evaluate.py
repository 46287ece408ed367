"""Evaluate a finished run on any dataset of the same task (``dpkfc-med evaluate``).

Evaluation reads only the released model, so it spends no privacy budget, but its figures are
computed from the evaluated data, which the run's guarantee does not protect. Results are
therefore written for the data custodian, under ``RUN_DIR/private_not_for_release/
evaluations/``, and each result says whether the evaluated images (classification: content
hashes) or cases (segmentation: case ids and image-file hashes) overlap the run's training
split. Figures on training data are not differentially private in any sense -- they can reveal
which records were trained on -- so such a result carries ``not_dp: true`` and a ``warning``,
which is also logged and issued as a :class:`TrainingDataEvaluationWarning`.
"""

from __future__ import annotations

import copy
import json
import logging
import warnings
from pathlib import Path
from typing import Any

import torch
import yaml

from dpkfc_med.data import (
    DataNotFoundError,
    DataValidationError,
    deterministic_split,
    load_segmentation_folder,
    load_split,
    resolve_data_path,
)
from dpkfc_med.data.cases import image_digest
from dpkfc_med.data.fingerprint import count_shared, image_digests
from dpkfc_med.report.custodian import EVALUATION_NOTE, EVALUATIONS_DIR, PRIVATE_DIR
from dpkfc_med.training.config import ConfigError, RunConfig, config_from_dict
from dpkfc_med.training.setup import build_run_model
from dpkfc_med.training.task_build import build_task
from dpkfc_med.training.tasks import Task
from dpkfc_med.utils import write_json

__all__ = ["EVALUATIONS_DIR", "TrainingDataEvaluationWarning", "evaluate_run"]

log = logging.getLogger("dpkfc_med")


class TrainingDataEvaluationWarning(UserWarning):
    """The evaluated data overlaps the run's private training split."""


def evaluate_run(
    run_dir: str | Path, *, data: str | None = None, split: str = "test", device: str = "cpu"
) -> dict[str, Any]:
    """Metrics of the run's selected model on ``split`` of ``data`` (default: the run's data).

    Args:
        run_dir: A finished run directory (``config.yaml`` and ``model.pt``).
        data: Another dataset of the same task; default the run's own data.
        split: ``train``, ``val``, ``test`` (or ``all`` for another segmentation folder).
        device: Where to run the model.

    Returns:
        The result, also written to ``RUN_DIR/private_not_for_release/evaluations/
        {data}_{split}.json``: the metrics, ``data``, ``split``, ``overlap_with_training``
        (how many evaluated images / cases are in the run's training split), ``not_dp``
        (true when they overlap, for ``--split train``, or when the overlap could not be
        checked), ``warning`` (when ``not_dp``) and ``privacy_note``.

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
    raw = yaml.safe_load((run / "config.yaml").read_text())
    if str((raw.get("model") or {}).get("name", "")).startswith("bundle:"):
        from dpkfc_med.bundle.zoo import evaluate_bundle_run

        if data is not None:
            raise ConfigError(
                ["--data: a bundle run is evaluated on its bundle's own data lists (--split "
                 "val or test); for other data, export it (dpkfc-med bundle export) and run "
                 "the bundle's inference"], str(run)
            )  # fmt: skip
        return evaluate_bundle_run(run, split=split, device=device)
    trained = config_from_dict(copy.deepcopy(raw), str(run / "config.yaml"))
    cfg = config_from_dict(raw, str(run / "config.yaml"))
    cfg.data.max_train = None
    cfg.data.max_eval = None
    cfg.data.unit_ids = None  # evaluation is per image; the run's mapping describes its own file
    saved = torch.load(run / "model.pt", map_location="cpu", weights_only=False)
    meta = saved["task"]
    if cfg.data.task == "classification" and cfg.data.num_classes is None:
        # the trained model declares the classes of the data it is evaluated on
        cfg.data.num_classes = int(meta["num_classes"])
    task = build_task(cfg, data, public_probes=False)
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
    overlap = training_overlap(run, trained, task, split, own_data=_own_data(task, trained, data))
    warning = _warning(overlap, split)
    if warning:
        log.warning("evaluate %s: %s", run, warning)
        warnings.warn(warning, TrainingDataEvaluationWarning, stacklevel=2)
    dev = torch.device(device)
    model, _ = build_run_model(cfg, task, finetune=False)  # model.pt is a plain network
    model.load_state_dict(saved["model"])
    model.to(dev).eval()
    metrics = task.evaluate(model, split, dev, cfg.training.eval_batch_size, full=True)
    out = {
        "run": str(run),
        "data": task.data_record,
        "split": split,
        "selected_epoch": _selected_epoch(run),
        **({"note": note} if note else {}),
        "not_dp": warning is not None,
        **({"warning": warning} if warning else {}),
        "overlap_with_training": overlap,
        "privacy_note": EVALUATION_NOTE,
        **metrics,
    }
    stem = Path(task.data_record["path"]).stem
    write_json(run / EVALUATIONS_DIR / f"{stem}_{split}.json", out)
    return json.loads(json.dumps(out, default=str))


def _selected_epoch(run: Path) -> int | None:
    """The epoch the run kept, from its custodian-only metrics (not stored in the model)."""
    path = run / PRIVATE_DIR / "metrics.json"
    try:
        return json.loads(path.read_text()).get("selected_epoch")
    except (OSError, ValueError, AttributeError):
        return None


def _own_data(task: Task, trained: RunConfig, data: str | None) -> bool:
    """Whether the evaluation task reads the run's own dataset."""
    if "own_data" in task.extra:
        return bool(task.extra["own_data"])
    if data is None:
        return True
    try:
        return Path(task.data_record["path"]) == resolve_data_path(trained.data.path)
    except (DataNotFoundError, ValueError):
        return False


def _warning(overlap: dict[str, Any], split: str) -> str | None:
    """The not-DP warning of an evaluation, or ``None`` when it reads no training data."""
    tail = (
        "these figures are NOT differentially private (they can reveal which records were "
        "trained on) and are for the data custodian only; do not release them"
    )
    if not overlap["checked"]:
        return (
            f"could not check whether the evaluated data overlaps the run's training split "
            f"({overlap['reason']}); treat the figures as computed on training data: {tail}"
        )
    kind = overlap["unit"]
    shared = max(overlap["shared"], overlap.get("shared_case_ids") or 0)
    if split == "train":
        return f"--split train evaluates the run's private training data: {tail}"
    if shared:
        return (
            f"{shared} of the {overlap['evaluated']} evaluated {kind} are in the run's private "
            f"training split ({overlap['method']}): {tail}"
        )
    return None


def training_overlap(
    run: Path, trained: RunConfig, task: Task, split: str, *, own_data: bool
) -> dict[str, Any]:
    """How many evaluated images (or cases) are in the run's training split.

    Args:
        run: The run directory (for ``split.json`` of segmentation runs).
        trained: The run's configuration as trained (``max_train`` kept).
        task: The evaluation task (built with ``max_train = max_eval = None``).
        split: The evaluated split of ``task``.
        own_data: Whether ``task`` reads the run's own data (no ``--data``).

    Returns:
        ``{"checked": True, "unit", "evaluated", "training", "shared", "method"}`` (segmentation
        adds ``shared_case_ids``), or ``{"checked": False, "reason"}`` when the run's training
        data cannot be read. Digests stay in memory; only counts are returned.
    """
    try:
        if task.kind == "segmentation":
            return _segmentation_overlap(run, trained, task, split, own_data=own_data)
        return _classification_overlap(trained, task, split, own_data=own_data)
    except (DataNotFoundError, DataValidationError, ConfigError, KeyError) as err:
        return {"checked": False, "reason": f"{type(err).__name__}: {err}".splitlines()[0]}


def _classification_overlap(
    trained: RunConfig, task: Task, split: str, *, own_data: bool
) -> dict[str, Any]:
    evaluated = task.extra["splits"][split].images
    if own_data and not trained.data.max_train:
        train_images = task.extra["splits"]["train"].images
    else:  # rebuild exactly the images the run trained on (its data, its subset)
        train_images = build_task(trained, public_probes=False).extra["splits"]["train"].images
    return {
        "checked": True,
        "unit": "images",
        "evaluated": len(evaluated),
        "training": len(train_images),
        "shared": count_shared(image_digests(evaluated), image_digests(train_images)),
        "method": "SHA-256 of each image after loading, against the run's training split",
    }


def _segmentation_overlap(
    run: Path, trained: RunConfig, task: Task, split: str, *, own_data: bool
) -> dict[str, Any]:
    run_cases = (
        task.extra["cases"]
        if own_data
        else load_segmentation_folder(
            resolve_data_path(trained.data.path, kind="dir"),
            dicom_series=trained.data.dicom_series,
            channels=trained.data.channels,
            cache_dir=run / PRIVATE_DIR / "dicom_cache",
        )
    )
    train_ids = _training_case_ids(run, trained, run_cases)
    evaluated = list(task.extra["splits"][split].case_ids)
    cases = task.extra["cases"]
    train_hashes = [image_digest(run_cases[c]) for c in train_ids]
    eval_hashes = [image_digest(cases[c]) for c in evaluated]
    return {
        "checked": True,
        "unit": "cases",
        "evaluated": len(evaluated),
        "training": len(train_ids),
        "shared": count_shared(eval_hashes, train_hashes),
        "shared_case_ids": count_shared(evaluated, train_ids) if own_data else None,
        "method": (
            "SHA-256 of each image file against the run's training cases"
            + (", and case ids" if own_data else "")
        ),
    }


def _training_case_ids(run: Path, trained: RunConfig, cases: Any) -> list[str]:
    """The run's training case ids: its ``split.json``, else the split rule recomputed."""
    for path in (run / PRIVATE_DIR / "split.json", run / "split.json"):
        if path.is_file():
            return list(load_split(path)["train"])
    ids = deterministic_split(cases.case_ids, trained.data.split_fractions, trained.training.seed)
    train = list(ids["train"])
    return train[: trained.data.max_train] if trained.data.max_train else train
