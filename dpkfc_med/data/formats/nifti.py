"""The NIfTI folder format: an MSD / nnU-Net ``dataset.json`` or ``imagesTr/`` + ``labelsTr/``.

Images pair with labels through the ``training`` list of a ``dataset.json`` (MSD; nnU-Net's
per-modality files ``<case>_0000.nii.gz``, ... found beside a listed ``<case>.nii.gz``), or by
case ID between ``imagesTr/`` and ``labelsTr/``; the headers are checked for every case.
Volumes are 3-D; 2-D images come as 2-D NIfTI (``(X, Y)`` or ``(X, Y, 1)``). Registered as the
``nifti`` format, which also reads a folder that no format recognises (its reader names what
is missing).
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from dpkfc_med.data.cases import (
    SegmentationCase,
    SegmentationCases,
    case_id_from_path,
    check_nifti_case,
    collect_cases,
    is_nifti_file,
)
from dpkfc_med.data.errors import DataValidationError
from dpkfc_med.data.formats.registry import ReadOptions, register_format

__all__ = ["is_nifti_folder", "read_nifti_folder"]

# nnU-Net names image files "<case>_0000.nii.gz", "<case>_0001.nii.gz", ... (one per modality,
# in channel order) while the label is "<case>.nii.gz".
_MODALITY_SUFFIX = re.compile(r"_(\d{4})$")


def _parse_label_names(raw: Any) -> dict[int, str] | None:
    """MSD ``{"0": "background"}`` or nnU-Net v2 ``{"background": 0}`` -> ``{0: "background"}``."""
    if not isinstance(raw, Mapping) or not raw:
        return None
    if all(str(k).lstrip("-").isdigit() for k in raw):
        return {int(k): str(v) for k, v in raw.items()}
    if all(isinstance(v, int) for v in raw.values()):
        return {int(v): str(k) for k, v in raw.items()}
    return None


# Pairing results: case ID -> (image, label); (case ID, message) for unpaired files and for
# other problems (case ID None when the problem belongs to no case), so that a case_ids filter
# can drop the problems of cases the caller did not ask for.
_Pairs = dict[str, tuple[tuple[Path, ...], Path]]
_Notes = list[tuple[str | None, str]]


def _modality_files(listed: Path, count: int | None) -> tuple[Path, ...]:
    """nnU-Net's per-modality files of a listed image that does not exist itself.

    nnU-Net's ``dataset.json`` lists ``imagesTr/<case>.nii.gz`` while the folder holds
    ``<case>_0000.nii.gz``, ``<case>_0001.nii.gz``, ...: the ``count`` declared modalities,
    else every consecutive one found. Empty when there is none.
    """
    name = listed.name
    suffix = next((x for x in (".nii.gz", ".nii") if name.endswith(x)), listed.suffix)
    stem = name[: len(name) - len(suffix)]
    found: list[Path] = []
    while count is None or len(found) < count:
        candidate = listed.with_name(f"{stem}_{len(found):04d}{suffix}")
        if not candidate.is_file():
            break
        found.append(candidate)
    return tuple(found)


def _pairs_from_index(
    root: Path, training: list[Any], modalities: int | None
) -> tuple[_Pairs, _Notes, _Notes]:
    """Pair images and labels from the ``training`` list of an MSD / nnU-Net ``dataset.json``."""
    pairs: _Pairs = {}
    unpaired: _Notes = []
    problems: _Notes = []
    for i, entry in enumerate(training):
        image_rel = entry.get("image") if isinstance(entry, Mapping) else None
        if not isinstance(image_rel, str):
            problems.append((None, f"dataset.json training[{i}]: no 'image' path; add one"))
            continue
        image_path = (root / image_rel).resolve()
        cid = case_id_from_path(image_path)
        images = _modality_files(image_path, modalities) if not image_path.is_file() else ()
        images = images or (image_path,)
        label_rel = entry.get("label")
        if not isinstance(label_rel, str):
            msg = f"case {cid}: image {image_rel} has no 'label' in dataset.json training[{i}]"
            unpaired.append((cid, msg))
            continue
        label_path = (root / label_rel).resolve()
        for kind, p in (("image", images[0]), ("label", label_path)):
            if not p.is_file():
                problems.append(
                    (
                        cid,
                        f"case {cid}: {kind} file {p} listed in dataset.json does not exist; "
                        "restore it or remove the entry",
                    )
                )
        if cid in pairs:
            problems.append((cid, f"case {cid}: listed twice in dataset.json training"))
        pairs[cid] = (images, label_path)
    return pairs, unpaired, problems


def _pairs_from_folders(root: Path) -> tuple[_Pairs, _Notes, _Notes]:
    """Pair ``imagesTr/<case>.nii.gz`` with ``labelsTr/<case>.nii.gz`` by case ID."""
    image_dir, label_dir = root / "imagesTr", root / "labelsTr"
    missing = [d.name + "/" for d in (image_dir, label_dir) if not d.is_dir()]
    if missing:
        raise DataValidationError(
            root,
            [
                f"missing folder(s) {missing} and no dataset.json with a 'training' list; "
                "expected imagesTr/<case>.nii.gz paired with labelsTr/<case>.nii.gz (or, for "
                "2D PNG / JPEG, images/<case>.png paired with masks/<case>.png)"
            ],
        )
    problems: _Notes = []
    labels: dict[str, Path] = {}
    for p in sorted(label_dir.iterdir()):
        if is_nifti_file(p):
            cid = case_id_from_path(p)
            if cid in labels:
                problems.append(
                    (cid, f"case {cid}: two label files ({labels[cid].name}, {p.name})")
                )
            labels[cid] = p
    files: dict[str, dict[int, Path]] = {}  # case -> modality index (-1: no suffix) -> file
    for p in sorted(image_dir.iterdir()):
        if not is_nifti_file(p):
            continue
        cid, index = case_id_from_path(p), -1
        suffix = _MODALITY_SUFFIX.search(cid)
        if cid not in labels and suffix is not None and cid[: suffix.start()] in labels:
            cid, index = cid[: suffix.start()], int(suffix.group(1))
        own = files.setdefault(cid, {})
        if index in own or (own and (index == -1 or -1 in own)):
            other = own.get(index) or next(iter(own.values()))
            problems.append((cid, f"case {cid}: two image files ({other.name}, {p.name})"))
            continue
        own[index] = p
    images: dict[str, tuple[Path, ...]] = {}
    for cid, own in files.items():
        order = sorted(own)
        if order != [-1] and order != list(range(len(order))):
            have = ", ".join(own[i].name for i in order)
            gap = f"case {cid}: modality files {have} skip a number; nnU-Net numbers one file "
            problems.append((cid, gap + "per modality _0000, _0001, ... without gaps"))
        images[cid] = tuple(own[i] for i in order)
    if not images and not labels:
        problems.append((None, "imagesTr/ and labelsTr/ hold no .nii / .nii.gz files"))

    pairs: _Pairs = {}
    unpaired: _Notes = []
    for cid in sorted(set(images) | set(labels)):
        if cid in images and cid in labels:
            pairs[cid] = (images[cid], labels[cid])
        elif cid in images:
            msg = f"case {cid}: image imagesTr/{images[cid][0].name} has no label in labelsTr/"
            unpaired.append((cid, msg))
        else:
            msg = f"case {cid}: label labelsTr/{labels[cid].name} has no image in imagesTr/"
            unpaired.append((cid, msg))
    return pairs, unpaired, problems


def is_nifti_folder(root: Path) -> bool:
    """Whether ``root`` has a ``dataset.json`` or NIfTI files directly in ``imagesTr/``."""
    if (root / "dataset.json").is_file():
        return True
    images = root / "imagesTr"
    return images.is_dir() and any(is_nifti_file(p) for p in images.iterdir())


@register_format(
    "nifti",
    recognise=is_nifti_folder,
    layout="imagesTr/<case>.nii.gz + labelsTr/<case>.nii.gz, or a dataset.json (MSD, nnU-Net)",
)
def read_nifti_folder(root: Path, options: ReadOptions) -> SegmentationCases:
    """Index a NIfTI folder from its headers (see :func:`~dpkfc_med.data.load_segmentation_folder`).

    ``options.channels`` gives the channel count every case must have (it must agree with the
    modalities ``dataset.json`` declares); ``options.num_classes`` overrides its ``labels``.

    Raises:
        DataValidationError: Listing every problem: missing folders or files, unpaired files,
            unreadable headers, image/label shape or spacing mismatch.
    """
    channels, case_ids = options.channels, options.case_ids
    num_classes, on_unpaired = options.num_classes, options.on_unpaired
    meta: dict[str, Any] = {}
    index = root / "dataset.json"
    if index.is_file():
        try:
            meta = json.loads(index.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise DataValidationError(
                index, [f"not valid JSON ({err}); fix or remove dataset.json"]
            ) from err
    label_names = _parse_label_names(meta.get("labels"))
    # MSD declares {"0": "FLAIR", ...} as "modality", nnU-Net v2 as "channel_names"
    declared_modalities = meta.get("modality", meta.get("channel_names"))
    modalities = len(declared_modalities) if isinstance(declared_modalities, Mapping) else None
    declared_by = "dataset.json"
    conflict: _Notes = []
    if channels:
        if modalities is not None and modalities != len(channels):
            conflict.append((None, f"data.channels lists {len(channels)} channel(s) "
                             f"{list(channels)} but dataset.json declares {modalities} "
                             "modalities; make them agree"))  # fmt: skip
        modalities, declared_by = len(channels), "data.channels"
    if isinstance(meta.get("training"), list):
        source = "dataset.json"
        pairs, unpaired, notes = _pairs_from_index(root, meta["training"], modalities)
    else:
        source = "imagesTr/labelsTr"
        pairs, unpaired, notes = _pairs_from_folders(root)

    notes = conflict + notes
    if case_ids is not None:
        wanted = set(case_ids)
        known = set(pairs) | {cid for cid, _ in unpaired}
        notes = [(cid, m) for cid, m in notes if cid is None or cid in wanted]
        notes += [
            (cid, f"case {cid}: requested in case_ids but not found in {root}")
            for cid in sorted(wanted - known)
        ]
        pairs = {k: v for k, v in pairs.items() if k in wanted}
        unpaired = [(cid, m) for cid, m in unpaired if cid in wanted]
    problems = [m for _, m in notes]

    dropped: list[str] = []
    if unpaired and on_unpaired == "error":
        problems += [f"{msg} (pair it, or move it out of the data folder)" for _, msg in unpaired]
    elif unpaired:
        dropped = [msg for _, msg in unpaired]
        warnings.warn(
            f"{root}: skipped {len(dropped)} unpaired file(s): " + "; ".join(dropped),
            stacklevel=3,
        )

    def checked() -> Iterator[SegmentationCase | list[str]]:
        for cid in sorted(pairs):
            images, label_path = pairs[cid]
            if all(p.is_file() for p in (*images, label_path)):  # else reported by the pairing
                yield check_nifti_case(cid, images, label_path, modalities, declared_by)

    if num_classes is not None:
        declared: int | None = num_classes
    else:
        declared = max(label_names) + 1 if label_names else None
    return collect_cases(
        root,
        checked(),
        problems,
        empty="no image/label pairs found; check the folder layout",
        label_names=label_names,
        num_classes=declared,
        source=source,
        dropped=dropped,
    )
