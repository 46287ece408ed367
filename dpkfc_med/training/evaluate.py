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
from collections.abc import Sequence
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
from dpkfc_med.training.config import ConfigError, RunConfig, config_from_dict
from dpkfc_med.training.segmentation_metrics import (
    dice_scores,
    hausdorff95_scores,
    save_label_map,
    summarise_cases,
    voxel_spacing,
    write_metric_reports,
)
from dpkfc_med.training.setup import build_run_model
from dpkfc_med.training.task_build import build_task
from dpkfc_med.training.tasks import Task
from dpkfc_med.utils import write_json

__all__ = ["EVALUATIONS_DIR", "TrainingDataEvaluationWarning", "evaluate_run"]

log = logging.getLogger("dpkfc_med")


class TrainingDataEvaluationWarning(UserWarning):
    """The evaluated data overlaps the run's private training split."""


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
    if str((raw.get("model") or {}).get("name", "")).startswith("bundle:"):
        from dpkfc_med.bundle.zoo import evaluate_bundle_run

        return evaluate_bundle_run(
            run, split=split, device=device, data=data, save_predictions=save_predictions
        )
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
    is predicted as in :meth:`~dpkfc_med.training.segmentation.SegmentationTask.predict`, and
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
        :func:`~dpkfc_med.training.segmentation_metrics.summarise_cases`' figures,
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


def save_prediction(
    label_map: Any,
    path: Path,
    case: Any | None,
    names: Sequence[str],
    problems: list[str] | None = None,
) -> list[Path]:
    """Save a predicted label map ``[1, *S]`` (a ``MetaTensor`` on the input's grid).

    Always ``path.nii.gz`` (the input's affine); for a case read from a DICOM series
    (:class:`~dpkfc_med.data.dicom_convert.DicomSegmentationCase`) also ``path_seg.dcm``, a
    DICOM-SEG on the series' own slices (:func:`write_dicom_seg`). A DICOM-SEG that cannot be
    written (no ``highdicom``, a series without the tags it must reference) is skipped with a
    sentence appended to ``problems`` (and logged); the NIfTI file is written all the same.

    Returns:
        The written files.
    """
    written = [save_label_map(label_map, path)]
    if case is not None and getattr(case, "series_folder", None) is not None:
        seg = path.with_name(f"{path.name}_seg.dcm")
        try:
            write_dicom_seg(label_map, case, names, seg)
        except (ImportError, DataValidationError) as err:
            text = str(err).strip()
            log.warning("DICOM-SEG not written: %s", text)
            if problems is not None:
                problems.append(text)
        else:
            written.append(seg)
    return written


def write_dicom_seg(label_map: Any, case: Any, names: Sequence[str], path: Path) -> None:
    """A DICOM-SEG (``highdicom``) of ``label_map`` on the slices of the case's series.

    The label map lies on the series' NIfTI conversion (voxel axes: columns, rows, slices
    sorted along the slice normal, as :func:`~dpkfc_med.data.dicom_convert.convert_case` reads
    them); each foreground class is one segment, numbered by its class id and labelled by
    ``names``.

    Raises:
        ImportError: ``highdicom`` is not installed (``pip install 'dpkfc-med[dicom]'``).
        DataValidationError: The series no longer matches the label map (files changed), or
            its slices lack the ``FrameOfReferenceUID`` a DICOM-SEG must reference.
    """
    try:
        import highdicom as hd
    except ImportError as err:
        raise ImportError(
            f"{path.name}: a DICOM-SEG of a DICOM input needs highdicom; pip install "
            "'dpkfc-med[dicom]' (or pip install highdicom), or evaluate without "
            "--save-predictions"
        ) from err
    import pydicom
    from pydicom.sr.codedict import codes

    import dpkfc_med
    from dpkfc_med.data.dicom_scan import check_series, scan_case

    scan = scan_case(case.series_folder, case.case_id)
    slices, problems = check_series(
        case.case_id, case.series_uid, scan.series.get(case.series_uid, [])
    )
    frames = np.asarray(label_map[0]).transpose(2, 1, 0)  # [slices, rows, columns]
    if not problems and (len(slices), *slices[0].size) != frames.shape:
        problems = [
            f"case {case.case_id}: series {case.series_uid} has {len(slices)} slices of "
            f"{slices[0].size} (rows, columns), the prediction {frames.shape}; evaluate again "
            "(the series changed since it was read)"
        ]
    sources = [] if problems else [pydicom.dcmread(str(s.path)) for s in slices]
    lacking = [s.path.name for s, ds in zip(slices, sources) if not ds.get("FrameOfReferenceUID")]
    if lacking:
        problems = [
            f"case {case.case_id}: {len(lacking)} of the {len(slices)} slices of series "
            f"{case.series_uid} (e.g. {lacking[0]}) have no FrameOfReferenceUID, which a "
            "DICOM-SEG must reference; re-export the series with its Frame of Reference "
            "module (the NIfTI label map is written)"
        ]
    if problems:
        raise DataValidationError(case.series_folder, problems)
    algorithm = hd.AlgorithmIdentificationSequence(
        name="dpkfc-med", version=dpkfc_med.__version__, family=codes.DCM.ArtificialIntelligence
    )
    segments = [
        hd.seg.SegmentDescription(
            segment_number=number,
            segment_label=str(name),
            segmented_property_category=codes.SCT.Tissue,
            segmented_property_type=codes.SCT.Tissue,
            algorithm_type=hd.seg.SegmentAlgorithmTypeValues.AUTOMATIC,
            algorithm_identification=algorithm,
        )
        for number, name in enumerate(names, start=1)
    ]
    seg = hd.seg.Segmentation(
        source_images=sources,
        pixel_array=frames.astype(np.uint8 if len(names) < 256 else np.uint16),
        segmentation_type=hd.seg.SegmentationTypeValues.BINARY,
        segment_descriptions=segments,
        series_instance_uid=hd.UID(),
        series_number=9901,
        sop_instance_uid=hd.UID(),
        instance_number=1,
        manufacturer="dpkfc-med",
        manufacturer_model_name="dpkfc-med evaluate",
        software_versions=dpkfc_med.__version__,
        device_serial_number="none",
        series_description="dpkfc-med prediction (custodian only, not for release)",
        omit_empty_frames=False,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    seg.save_as(str(path))


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


class CaseCollector:
    """Ignite handler on a bundle's evaluator: each item's input and, optionally, its label map.

    At every iteration it records each evaluated item's input file (the ``filename`` column
    of MONAI's ``MetricsSaver``) and, with ``pred_dir``, saves the item's prediction as a
    label map (argmax over channels) on the input's grid: taken back through the evaluator
    dataset's transform (MONAI ``Invertd``) and written by :func:`save_prediction`.

    Args:
        pred_dir: Where label maps go (``None``: none saved).
        transform: The evaluator dataset's transform (what ``Invertd`` undoes).
        cases: Case id -> case of the evaluated folder (a DICOM series case also gets a
            DICOM-SEG), or ``None``.
        names: Foreground class names (DICOM-SEG segment labels).
    """

    def __init__(
        self,
        pred_dir: Path | None,
        transform: Any,
        cases: Any = None,
        names: Sequence[str] = (),
    ) -> None:
        self.pred_dir, self.transform, self.cases, self.names = pred_dir, transform, cases, names
        self.filenames: list[str] = []
        self.saved: list[Path] = []
        self.problems: list[str] = []
        """Why a DICOM-SEG was not written (:func:`save_prediction`)."""

    def attach(self, engine: Any) -> None:
        """Collect at each iteration of ``engine`` (from its first epoch on)."""
        from monai.utils import min_version, optional_import

        events, _ = optional_import("ignite.engine", "0.4.11", min_version, "Events")
        engine.add_event_handler(events.EPOCH_STARTED, self._reset)
        engine.add_event_handler(events.ITERATION_COMPLETED, self)

    def _reset(self, _engine: Any) -> None:
        self.filenames, self.saved, self.problems = [], [], []

    def __call__(self, engine: Any) -> None:
        from monai.data import decollate_batch

        batch, output = engine.state.batch, engine.state.output
        batch = decollate_batch(batch) if isinstance(batch, dict) else batch
        output = decollate_batch(output) if isinstance(output, dict) else output
        for item, out in zip(batch, output):
            image = item.get("image")
            meta = getattr(image, "meta", {}) or {}
            name = str(meta.get("filename_or_obj", len(self.filenames)))
            self.filenames.append(name)
            if self.pred_dir is not None:
                self._save(item, out, name)

    def _save(self, item: dict[str, Any], out: dict[str, Any], name: str) -> None:
        from monai.data import MetaTensor
        from monai.transforms import Invertd

        pred = torch.as_tensor(out["pred"]).detach().cpu()
        label_map = pred.argmax(0, keepdim=True) if pred.shape[0] > 1 else pred.round()
        data: dict[Any, Any] = {"image": item["image"], "pred": MetaTensor(label_map.long())}
        if self.transform is not None:
            data = dict(
                Invertd("pred", self.transform, orig_keys="image", nearest_interp=True)(data)
            )
        else:
            data["pred"].meta = dict(getattr(item["image"], "meta", {}))
        cid = str(item.get("case_id") or _stem(name))
        case = self.cases[cid] if self.cases is not None and cid in self.cases.case_ids else None
        assert self.pred_dir is not None  # called only when label maps are saved
        pred_map = data["pred"].long()
        self.saved += save_prediction(
            pred_map, self.pred_dir / cid, case, self.names, self.problems
        )


def _stem(name: str) -> str:
    """A file's name without its image suffixes (``case.nii.gz`` -> ``case``)."""
    base = Path(name).name
    for suffix in (".nii.gz", ".nii", ".png", ".jpg", ".jpeg", ".dcm"):
        if base.lower().endswith(suffix):
            return base[: -len(suffix)]
    return base


def item_image_digest(item: Any) -> str:
    """SHA-256 of a data-list item's image: of its file(s) by content, else of its array.

    A case copied or linked elsewhere has the digest of its source, so new cases are checked
    against a training list by content, not by path.
    """
    import hashlib

    from dpkfc_med.bundle.zoo_task import data_digest, names_files
    from dpkfc_med.data.paths import sha256_file

    image = item.get("image") if isinstance(item, dict) else item
    if names_files(image):
        files = image if isinstance(image, (list, tuple)) else [image]
        digests = [sha256_file(str(f)) for f in files]
        return (
            digests[0]
            if len(digests) == 1
            else hashlib.sha256(" ".join(digests).encode()).hexdigest()
        )
    return data_digest(image)
