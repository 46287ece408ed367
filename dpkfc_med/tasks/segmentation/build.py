"""Build a segmentation task from a folder: validate every case, split, transforms, probe shape.

:func:`build` is the ``segmentation`` builder of :data:`~dpkfc_med.tasks.build.TASK_BUILDERS`.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from dpkfc_med.data import (
    DataNotFoundError,
    DataValidationError,
    SegmentationCases,
    VolumeDataset,
    deterministic_split,
    load_segmentation_folder,
    read_split_file,
    resolve_data_path,
    segmentation_transforms,
    sha256_file,
)
from dpkfc_med.data.cases import image_digest, read_array
from dpkfc_med.errors import ConfigError
from dpkfc_med.tasks.base import RunConfig
from dpkfc_med.tasks.kinds import TaskKind
from dpkfc_med.tasks.segmentation.batches import CachedPrefix, CachedVolumes, VolumeCollate
from dpkfc_med.tasks.segmentation.layout import (
    SegmentationLayout,
    case_shape_problems,
    resolve_layout,
)
from dpkfc_med.tasks.segmentation.task import SegmentationTask

__all__ = ["build"]


def _patch_size(
    cfg: RunConfig, cases: SegmentationCases, layout: SegmentationLayout, problems: list[str]
) -> tuple[int, ...]:
    """The configured training patch (required), one size per spatial axis of the layout."""
    n = layout.spatial_dims
    if cfg.data.patch_size is None:
        biggest = np.max([layout.plane(c.shape) for c in cases if len(c.shape) >= n], axis=0)
        hint = [int(-(-s // 16) * 16) for s in biggest]
        what = "slices" if layout.slices is not None else ("volumes" if n == 3 else "images")
        problems.append(
            "data.patch_size: required for segmentation (the probes' shape must come from the "
            f"config, not from the private {what}); whole {what} padded to the largest case "
            f"here would be {hint} (for the custodian: derived from the private data, not used)"
        )
        return (16,) * n
    p = list(cfg.data.patch_size)
    if len(p) != n or any(not isinstance(s, int) or s < 1 for s in p):
        if len(p) in (2, 3) and len(p) != n:
            return (16,) * n  # the layout already named the length
        problems.append(f"data.patch_size={p!r}: must be {n} positive integers, e.g. {[32] * n}")
        return (16,) * n
    return tuple(p)


def _spacing(
    cfg: RunConfig, cases: SegmentationCases, layout: SegmentationLayout, problems: list[str]
) -> tuple[tuple[float, ...], str]:
    """The configured voxel spacing of the probes (required), in-plane for slices."""
    n = layout.spatial_dims
    if cfg.data.spacing is not None:
        s = [float(v) for v in cfg.data.spacing]
        if len(s) != n or any(not v > 0 for v in s):
            where = " (in-plane: the slices' two axes)" if layout.slices is not None else ""
            problems.append(f"data.spacing={s!r}: must be {n} positive numbers in mm{where}")
        return tuple(s), "data.spacing"
    rows = [layout.plane(c.spacing) for c in cases if len(c.spacing) >= n]
    med = np.median(np.asarray(rows, dtype=np.float64), axis=0)
    hint = [round(float(v), 3) for v in med]
    problems.append(
        "data.spacing: required for segmentation (the probes' voxel spacing in mm must come "
        "from the config or the protocol, not from the private NIfTI headers); the headers' "
        f"median here is {hint} (for the custodian: derived from the private data, not used)"
    )
    return (1.0,) * n, "unset"


def _label_names(cases: SegmentationCases, num_classes: int) -> list[str]:
    declared = cases.label_names or {}
    return [declared.get(c, "background" if c == 0 else f"class_{c}") for c in range(num_classes)]


def _undeclared_num_classes(cases: SegmentationCases) -> int:
    """Classes of a folder without declared labels: the largest label value + 1."""
    top = 0
    for case in cases:
        top = max(top, int(read_array(case.label_path).max()))
    return max(2, top + 1)


def _fingerprint(cases: SegmentationCases) -> str:
    """SHA-256 of the manifest ``case_id image_sha256 label_sha256`` of ``cases`` (sorted)."""
    lines = [f"{c.case_id} {image_digest(c)} {sha256_file(c.label_path)}\n" for c in cases]
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def _same_folder(a: Path, spec: str) -> bool:
    try:
        return resolve_data_path(spec, kind="dir") == a
    except (DataNotFoundError, ValueError):
        return False


def _split_file(cfg: RunConfig, root: Path) -> Path:
    """``data.split_file``: relative paths in the data folder first, then like ``data.path``."""
    spec = str(cfg.data.split_file)
    if not Path(spec).is_absolute() and (root / spec).is_file():
        return root / spec
    try:
        return resolve_data_path(spec, kind="file")
    except DataNotFoundError as err:
        raise ConfigError([f"data.split_file={spec!r}: {err}"]) from None


def _split(
    cfg: RunConfig, cases: SegmentationCases, root: Path, own_data: bool
) -> tuple[dict[str, list[str]], dict[str, Any]]:
    """The case ids of each split and how they were chosen (for the data record).

    ``data.split_file`` names them for the run's own folder; otherwise (and for other data,
    evaluated whole) each case joins a split by a hash of its id keyed by ``training.seed``.
    An empty split of the hash is left to the caller, which reports the cases' problems first.
    """
    fractions, seed = cfg.data.split_fractions, cfg.training.seed
    if cfg.data.split_file is not None and own_data:
        path = _split_file(cfg, root)
        split_ids, left_out = read_split_file(path, cases.case_ids, fold=cfg.data.split_fold)
        fold = f" (nnU-Net fold {cfg.data.split_fold})" if _is_folds(path) else ""
        rule = (  # no file name: the shareable report keeps no paths
            f"the case ids of each split listed in data.split_file{fold}; the {len(left_out)} "
            "case(s) of the folder it does not list are left out; max_train/max_eval keep the "
            "first n ids of a split"
        )
        return split_ids, {"split_rule": rule, "left_out": len(left_out)}
    try:  # an empty split is reported by the caller, after the cases: a bad case first
        split_ids = deterministic_split(cases.case_ids, fractions, seed, allow_empty=True)
    except ValueError as err:
        raise ConfigError([f"data.split_fractions={fractions!r}: {err}"]) from None
    return split_ids, {
        "split_rule": (
            f"deterministic_split(case ids, fractions={list(fractions)}, seed={seed}): each "
            "case by a hash of its id keyed by the seed; max_train/max_eval keep the first n "
            "ids of a split"
        )
    }


def _is_folds(path: Path) -> bool:
    """Whether a (checked) split file is nnU-Net's list of folds."""
    return isinstance(json.loads(path.read_text(encoding="utf-8")), list)


def _first_missing(path: Path) -> Path | None:
    """The outermost folder of ``path`` that does not exist yet (``None``: it all exists)."""
    missing = None
    while not path.exists() and path != path.parent:
        missing, path = path, path.parent
    return missing


def build(cfg: RunConfig, data_path: str | None = None) -> SegmentationTask:
    """Read and validate a segmentation folder into a :class:`SegmentationTask`.

    Every case in use is checked before anything is written (pairing, headers, image/label
    shape, readability, label values against the declared classes, and whether its image fits
    the run's 2D / 3D layout); errors name the case and the file. A folder of DICOM series is
    converted into the run's custodian folder first; a refused build removes the folders it
    created, so a refused run leaves no run folder behind.

    Args:
        cfg: the run configuration (``data.*``, ``training.seed``).
        data_path: another folder of the same task (evaluation); default ``cfg.data.path``.

    Returns:
        The task; ``extra["splits"]`` holds evaluation datasets ``train``/``val``/``test`` and
        ``all`` (every case of the folder), ``extra["split_ids"]`` the case IDs per split.

    Raises:
        DataValidationError: a bad case (named) or folder layout.
        DataNotFoundError: the folder does not exist.
        ConfigError: bad ``data.patch_size`` / ``data.spacing`` / ``data.split_fractions`` /
            ``data.spatial_dims`` / ``data.slices``.
    """
    made = _first_missing(_dicom_cache(cfg))
    try:
        return _build_task(cfg, data_path)
    except BaseException:
        if made is not None:  # e.g. the run folder holding a DICOM conversion: nothing ran
            shutil.rmtree(made, ignore_errors=True)
        raise


def _dicom_cache(cfg: RunConfig) -> Path:
    return cfg.run_dir() / "private_not_for_release" / "dicom_cache"


def _build_task(cfg: RunConfig, data_path: str | None) -> SegmentationTask:
    if cfg.data.resize is not None:
        raise ConfigError(
            [
                "data.resize applies to classification images; segmentation trains on "
                "data.patch_size patches of the volumes at their own voxel grid: drop data.resize"
            ]
        )
    spec = data_path or cfg.data.path
    root = resolve_data_path(spec, kind="dir")
    # A folder of DICOM series is converted once into NIfTI in the run's custodian folder.
    cases = load_segmentation_folder(
        root,
        dicom_series=cfg.data.dicom_series,
        cache_dir=_dicom_cache(cfg),
        channels=cfg.data.channels,
    )
    if cases.num_classes is None and cfg.data.num_classes is not None:
        # classes declared in the config: every case's label values are checked against them
        # now, before any pretraining or training (naming the case), not mid-run
        cases = replace(cases, num_classes=cfg.data.num_classes)
    fractions, seed = cfg.data.split_fractions, cfg.training.seed
    own_data = data_path is None or _same_folder(root, cfg.data.path)
    split_ids, split_record = _split(cfg, cases, root, own_data)
    caps = {"train": cfg.data.max_train, "val": cfg.data.max_eval, "test": cfg.data.max_eval}
    for name, cap in caps.items():
        if cap is not None:
            split_ids[name] = split_ids[name][:cap]
    used = sorted({c for ids in split_ids.values() for c in ids})
    # Foreign data is evaluated on every case; the run's own data only on the cases in use.
    checked = cases if not own_data else cases.select(used)
    problems: list[str] = []  # every config problem is reported at once
    layout = resolve_layout(cfg, cases, problems)
    if not problems and (misfits := case_shape_problems(layout, checked)):
        raise DataValidationError(root, misfits)
    checked.validate_all()
    if own_data and cfg.data.split_file is None:  # other data is evaluated whole ("all")
        try:
            deterministic_split(cases.case_ids, fractions, seed)  # a split too small?
        except ValueError as err:
            problems.append(
                f"data.split_fractions={fractions!r}: {err}; or list the cases of each split "
                'in a JSON file, data.split_file ({"train": [...], "val": [...], "test": [...]})'
            )
    declared = cfg.data.num_classes
    num_classes = cases.num_classes if cases.label_names else None  # dataset.json's
    classes_from = "dataset.json 'labels' (the task's declared classes)"
    if declared is not None:
        if num_classes is not None and num_classes != declared:
            problems.append(
                f"data.num_classes={declared} disagrees with the {num_classes} labels declared "
                f"in {root}/dataset.json; fix one of them"
            )
        num_classes, classes_from = declared, "data.num_classes"
    elif num_classes is None:
        top = _undeclared_num_classes(checked)
        if own_data:
            problems.append(
                "data.num_classes: required (the folder has no dataset.json 'labels'; the class "
                "count must not come from the private label values); the largest label value "
                f"here suggests {top} (for the custodian: derived from the private data, not "
                "used)"
            )
        num_classes = top
        classes_from = "largest label value in the data + 1 (evaluation of other data)"
    by_channels: dict[int, list[str]] = {}
    for case in cases:
        by_channels.setdefault(case.channels, []).append(case.image_path.name)
    if len(by_channels) != 1:
        groups = "; ".join(
            f"{n} channel(s): {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}"
            for n, names in sorted(by_channels.items())
        )
        raise DataValidationError(
            root,
            [
                f"cases have different channel counts ({groups}); every case needs the same "
                "modalities in the same order: fix or remove the odd files"
            ],
        )
    in_channels = next(iter(by_channels))
    patch = _patch_size(cfg, cases, layout, problems)
    spacing, spacing_from = _spacing(cfg, cases, layout, problems)
    if problems:
        raise ConfigError(problems)
    rule = layout.slices
    k = int(cfg.data.patches_per_unit) if rule is None else rule.per_unit
    if k is None and rule is not None:
        # every slice of a volume: the count is each volume's extent, for the custodian only
        max_per_unit = max(cases[c].shape[rule.axis] for c in split_ids["train"] or used)
    else:
        max_per_unit = int(k or 1)
    reading: dict[str, Any] = {
        "label_values": cases.label_values,
        "reader": cases.reader,
        "slices": rule,
    }

    train_transform = segmentation_transforms(
        spatial_size=patch,
        train=True,
        num_patches_per_volume=k or 1,
        intensity="zscore",
        **reading,
    )
    train_set = VolumeDataset(
        cases,
        case_ids=split_ids["train"],
        transform=CachedPrefix(train_transform),
        num_patches_per_volume=k or 1,
        seed=cfg.training.seed,
    )
    # One deterministic evaluation pipeline for every split: the whole volume, padded.
    eval_transform = segmentation_transforms(
        spatial_size=patch, train=False, intensity="zscore", **reading
    )
    splits: dict[str, Any] = {
        name: CachedVolumes(VolumeDataset(cases, case_ids=ids, transform=eval_transform))
        for name, ids in {**split_ids, "all": cases.case_ids if not own_data else used}.items()
    }
    record = {
        "path": str(root),
        "format": (
            f"{'image' if cases.reader == 'PILReader' else 'nifti'}-folder ({cases.source})"
        ),
        "sha256": {
            f"{root.name} (manifest of {len(checked)} image/label pairs)": _fingerprint(checked)
        },
        "num_cases": len(cases),
        "splits": {name: len(ids) for name, ids in split_ids.items()},
        "split": split_ids,
        **split_record,
        "subset": {"max_train": cfg.data.max_train, "max_eval": cfg.data.max_eval},
        "num_classes_source": classes_from,
        "patch_size": list(patch),
        "patches_per_unit": k,
        **layout.describe(),
        "spacing_mm": list(spacing),
        "spacing_source": spacing_from,
        "intensity": "z-score per volume over nonzero voxels (no dataset-wide statistic)",
    }
    return SegmentationTask(
        kind=TaskKind.SEGMENTATION,
        spatial_dims=layout.spatial_dims,
        in_channels=in_channels,
        num_classes=num_classes,
        spatial_shape=patch,
        label_names=_label_names(cases, num_classes),
        train_set=train_set,
        data_record=record,
        selection_metric="mean_dice",
        privacy_unit=layout.privacy_unit,
        max_samples_per_unit=max_per_unit,
        max_samples_public=k is not None,
        spacing=spacing,
        intensity="zscore",
        extra={
            "splits": splits,
            "split_ids": split_ids,
            "cases": cases,
            "own_data": own_data,
            "collate": VolumeCollate(k, in_channels, patch),
            "slices": rule,
            "reader": cases.reader,
        },
    )
