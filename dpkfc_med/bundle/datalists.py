"""Data lists for bundle configs: a dataset's train / val / test items, in MONAI's format.

A Model Zoo bundle names its data as lists of dictionaries (``train#dataset#data``). These
helpers give the lists of the layouts ``dpkfc-med`` reads, with the same split as a YAML run
config of the same data, so a bundle and a run config train and evaluate on the same cases::

    "datalists": "$datalists.segmentation_datalists(@dataset_dir, [0.7, 0.15, 0.15], 0)",
    "train": {"dataset": {"data": "$@datalists['train']", ...}},

Only the case ids decide the split (a keyed hash of each id, :func:`deterministic_split`), so
adding or removing a case moves no other case.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["medmnist_datalists", "segmentation_datalists"]


def segmentation_datalists(
    dataset_dir: str | Path,
    fractions: Sequence[float] = (0.7, 0.15, 0.15),
    seed: int = 0,
    channels: Sequence[str] | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """Train / val / test items ``{"image", "label", "case_id"}`` of a segmentation folder.

    Args:
        dataset_dir: A folder ``dpkfc-med`` reads (``imagesTr/`` + ``labelsTr/``, an MSD
            ``dataset.json``, PNG ``images/`` + ``masks/``), or a name under the shared data
            folder (``msd_hippocampus``).
        fractions: Train, val and test fractions (``data.split_fractions`` of a run config).
        seed: The split's key (``training.seed`` of a run config).
        channels: ``data.channels`` of a run config: the modality suffixes of a folder per
            case (BraTS), in channel order. An image of several files is their list.

    Returns:
        ``{"train": [...], "val": [...], "test": [...]}``, the cases of each split;
        the same cases as a run config with the same folder, fractions and seed.

    Raises:
        DataNotFoundError: No such folder.
        DataValidationError: Unpaired or unreadable files (every one named).
        ValueError: Fractions that leave a split empty.
    """
    from dpkfc_med.data import deterministic_split, load_segmentation_folder, resolve_data_path

    root = resolve_data_path(str(dataset_dir), kind="dir")
    cases = load_segmentation_folder(root, channels=channels)
    split = deterministic_split(cases.case_ids, list(fractions), seed)
    return {name: cases.data_dicts(ids) for name, ids in split.items()}


def medmnist_datalists(
    path: str | Path, num_classes: int | None = None
) -> dict[str, list[dict[str, Any]]]:
    """Train / val / test items ``{"image", "label"}`` of a MedMNIST-format ``.npz``.

    Args:
        path: The ``.npz`` or a MedMNIST flag (``pneumoniamnist``), resolved as in a run
            config.
        num_classes: Declared classes (default: the file's MedMNIST flag or ``classes``
            array; never inferred from the labels).

    Returns:
        Per split, one item per image: ``image`` float32 ``[C, *spatial]`` in ``[0, 1]`` (as
        a run config reads it), ``label`` the class id (an ``int``).
    """
    from dpkfc_med.data import load_medmnist, resolve_data_path

    data = load_medmnist(resolve_data_path(str(path)), num_classes=num_classes)
    if str(data.task) == "multilabel":
        raise ValueError(
            f"{data.path}: multi-label files ({data.num_classes} label columns) have no single "
            "class id per image; a bundle data list needs one (train it with a run config)"
        )
    out: dict[str, list[dict[str, Any]]] = {}
    for name, (images, labels) in data.splits.items():
        flat = labels.reshape(len(labels), -1)[:, 0]
        out[name] = [
            {"image": images[i].numpy(), "label": int(flat[i])} for i in range(len(labels))
        ]
    return out
