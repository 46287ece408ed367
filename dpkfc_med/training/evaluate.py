"""Evaluate a finished run on any dataset of the same task (``dpkfc-med evaluate``).

Evaluation reads only the released model, so it spends no privacy budget, but its figures are
computed from the evaluated data, which the run's guarantee does not protect. Results are
therefore written for the data custodian, under ``RUN_DIR/private_not_for_release/
evaluations/``, and each result says whether the evaluated images (classification: content
hashes) or cases (segmentation: case ids and image-file hashes) overlap the run's training
split. Figures on training data are not differentially private in any sense -- they can reveal
which records were trained on -- so such a result carries ``not_dp: true`` and a ``warning``,
which is also logged and issued as a :class:`TrainingDataEvaluationWarning`.

Segmentation results are also written per case, beside the result's JSON in a folder of the same
name, in the files of MONAI's ``MetricsSaver`` (``metrics.csv``; ``mean_dice_raw.csv`` and
``hd95_raw.csv``: one row per case, one column per class and their ``mean``); with
``save_predictions`` each case's predicted label map is saved there too (``predictions/``:
NIfTI on the input image's grid and affine; DICOM-SEG beside it for a case read from a DICOM
series). The figures are computed on those label maps.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
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
from dpkfc_med.tasks.base import Task
from dpkfc_med.tasks.build import build_task
from dpkfc_med.tasks.segmentation.metrics import (
    dice_scores,
    hausdorff95_scores,
    summarise_cases,
    voxel_spacing,
    write_metric_reports,
)
from dpkfc_med.training.config import ConfigError, RunConfig, config_from_dict
from dpkfc_med.training.predictions import save_prediction
from dpkfc_med.training.setup import build_run_model
from dpkfc_med.utils import write_json

__all__ = ["EVALUATIONS_DIR", "TrainingDataEvaluationWarning", "evaluate_run", "is_bundle_run"]

log = logging.getLogger("dpkfc_med")


class TrainingDataEvaluationWarning(UserWarning):
    """The evaluated data overlaps the run's private training split."""


def is_bundle_run(run_dir: str | Path) -> bool:
    """Whether ``run_dir`` holds a ``dpkfc-med bundle train`` run (its model is a bundle's)."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        return False
    raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    return str((raw.get("model") or {}).get("name", "")).startswith("bundle:")


def evaluate_run(
    run_dir: str | Path,
    *,
    data: str | None = None,
    split: str = "test",
    device: str = "cpu",
    save_predictions: bool = False,
) -> dict[str, Any]:
    """Metrics of the run's selected model on ``split`` of ``data`` (default: the run's data).

    Args:
        run_dir: A finished run directory (``config.yaml`` and ``model.pt``).
        data: Another dataset of the same task; default the run's own data. For a bundle run,
            a segmentation folder of new cases (all its cases are evaluated).
        split: ``train``, ``val``, ``test`` (or ``all`` for another segmentation folder).
        device: Where to run the model.
        save_predictions: Segmentation: also save each case's predicted label map.

    Returns:
        The result, also written to ``RUN_DIR/private_not_for_release/evaluations/
        {data}_{split}.json``: the metrics, ``data``, ``split``, ``overlap_with_training``
        (how many evaluated images / cases are in the run's training split), ``not_dp``
        (true when they overlap, for ``--split train``, or when the overlap could not be
        checked), ``warning`` (when ``not_dp``) and ``privacy_note``. Segmentation adds
        ``per_case``: the per-case files (``metrics``, ``raw``) and ``predictions`` (a folder,
        or ``None``), relative to the run directory.

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
    raw = yaml.safe_load((run / "config.yaml").read_text(encoding="utf-8"))
    if is_bundle_run(run):  # its data and evaluator are the bundle's, one layer up
        raise ConfigError(
            [f"{run} is a MONAI bundle run: evaluate it with "
             "dpkfc_med.bundle.zoo.evaluate_bundle_run (what `dpkfc-med evaluate` does)"],
            str(run),
        )  # fmt: skip
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
    stem = Path(task.data_record["path"]).stem
    cases_dir = run / EVALUATIONS_DIR / f"{stem}_{split}"
    if task.kind == "segmentation":
        metrics = evaluate_cases(
            task, model, split, dev, cfg.training.eval_batch_size, cases_dir,
            save_predictions=save_predictions, run=run,
        )  # fmt: skip
    else:
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
    write_json(run / EVALUATIONS_DIR / f"{stem}_{split}.json", out)
    return json.loads(json.dumps(out, default=str))


def evaluate_cases(
    task: Task,
    model: torch.nn.Module,
    split: str,
    device: torch.device,
    batch_size: int,
    out_dir: Path,
    *,
    save_predictions: bool = False,
    run: Path | None = None,
) -> dict[str, Any]:
    """Dice and Hausdorff-95 of each case of ``split``, written per case, with the summary.

    Each volume goes through the task's evaluation transform (kept as MONAI ``MetaTensor``),
    is predicted as in :meth:`~dpkfc_med.tasks.segmentation.task.SegmentationTask.predict`, and
    the prediction and label are taken back to the input's grid (MONAI ``Invertd``: the
    evaluation padding removed), where they are scored and saved.

    Args:
        task: A segmentation task whose ``extra["splits"][split]`` holds the cases.
        model: The network, in eval mode.
        split: The evaluated split.
        device: Where the model lives.
        batch_size: Windows per forward pass of the sliding-window inferer.
        out_dir: The folder of the per-case files (replaced).
        save_predictions: Also write ``out_dir/predictions/<case_id>.nii.gz`` (and
            ``<case_id>_seg.dcm`` for a case read from a DICOM series).
        run: The run directory the returned paths are relative to.

    Returns:
        :func:`~dpkfc_med.tasks.segmentation.metrics.summarise_cases`' figures,
        ``hd95_unit``, ``per`` for a 2D network on slices, and ``per_case`` (the files).
    """
    from monai.data import MetaTensor
    from monai.transforms import Invertd

    volumes = task.extra["splits"][split].data  # the VolumeDataset behind the cached items
    cases = task.extra["cases"]
    names = task._foreground_names()  # type: ignore[attr-defined]
    invert = Invertd(
        keys=["pred", "label"],
        transform=volumes.transform,
        orig_keys=["image", "label"],
        nearest_interp=True,
    )
    if out_dir.exists():
        shutil.rmtree(out_dir)  # a previous evaluation's cases must not mix with these
    pred_dir = out_dir / "predictions"
    dice_rows, hd_rows, filenames = [], [], []
    dicom_problems: list[str] = []
    for record in volumes.records:
        cid = record["case_id"]
        try:
            item = volumes.transform(dict(record))
        except Exception as err:
            raise DataValidationError(
                volumes.cases.root,
                [f"case {cid}: transform failed ({type(err).__name__}: {err.__cause__ or err}); "
                 "check the files or run validate_all()"],
            ) from err  # fmt: skip
        image = item["image"]
        pred = task.predict(model, image.as_tensor()[None], device, batch_size)  # type: ignore[attr-defined]
        item["pred"] = MetaTensor(pred[0])
        item = invert(item)
        pred_map = item["pred"].to(torch.int64)
        label = item["label"].to(torch.int64)
        dice_rows.append(dice_scores(pred_map[None], label[None], task.num_classes))
        spacing = voxel_spacing(image[None], task.spacing)
        hd_rows.append(hausdorff95_scores(pred_map[None], label[None], task.num_classes, spacing))
        case = cases[cid]
        folder = getattr(case, "series_folder", None)
        filenames.append(str(folder if folder is not None else case.image_path))
        if save_predictions:
            save_prediction(pred_map, pred_dir / cid, case, names, dicom_problems)
    k = len(names)
    dice = torch.cat(dice_rows).numpy() if dice_rows else np.zeros((0, k))
    hd = torch.cat(hd_rows).numpy() if hd_rows else np.zeros((0, k))
    out = summarise_cases(dice, hd, names)
    out["hd95_unit"] = (
        "pixels (PNG / JPEG carry no pixel size)"
        if task.extra.get("reader") == "PILReader"
        else "mm (voxel spacing of each volume's header)"
    )
    if task.extra.get("slices") is not None:
        out["per"] = "volume (each patient's slices predicted and scored together)"
    figures = {"mean_dice": out["mean_dice"]}
    for key, label_ in (("dice", "dice_per_class"), ("hd95", "hd95_per_class")):
        figures.update({f"{key}_{n}": v for n, v in out[label_].items()})
    written = write_metric_reports(
        out_dir, filenames, figures, {"mean_dice": dice, "hd95": hd}, names
    )
    base = run if run is not None else out_dir.parent
    out["per_case"] = {
        "metrics": str(written[0].relative_to(base)),
        "raw": [str(p.relative_to(base)) for p in written[1:]],
        "predictions": str(pred_dir.relative_to(base)) if save_predictions else None,
        **({"dicom_seg_not_written": dicom_problems} if dicom_problems else {}),
    }
    return out


def _selected_epoch(run: Path) -> int | None:
    """The epoch the run kept, from its custodian-only metrics (not stored in the model)."""
    path = run / PRIVATE_DIR / "metrics.json"
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("selected_epoch")
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
