"""Classes of a labelled MedMNIST-format file: declared, never read off the private labels.

The class count shapes the released model's output layer and the probes, so it comes from a
declaration (``num_classes``, the ``medmnist.INFO`` entry of the file's flag, or a ``classes``
array of names stored in the file). These helpers read that array, word the refusal of an
undeclared file, and check inferred classes of data that is not private.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = [
    "CLASSES_KEY",
    "class_counts",
    "declared_class_names",
    "label_values",
    "undeclared_gap_problems",
    "undeclared_problem",
]

CLASSES_KEY = "classes"
"""Optional 1-D array of class names: a declaration of the classes shipped with the data."""


def label_values(labels: np.ndarray, limit: int = 10) -> str:
    """Distinct label values, e.g. ``[5, 7]`` (``[5, 7, ...]`` beyond ``limit``)."""
    vals = np.unique(labels).tolist()
    return str(vals[:limit])[:-1] + ", ...]" if len(vals) > limit else str(vals)


def undeclared_gap_problems(labels: Mapping[str, np.ndarray], observed_max: int) -> list[str]:
    """Undeclared classes: refuse labels beyond a class that no split uses.

    Without declared classes the task has ``max(label) + 1`` classes. A class index with no
    example anywhere (labels 0, 1 and 5 in a binary file) means that guess is wrong, so the
    labels above the first unused index are reported instead of silently adding classes.
    """
    if observed_max < 0 or any(a.ndim != 1 for a in labels.values()):
        return []
    used = np.zeros(observed_max + 1, dtype=bool)
    for lab in labels.values():
        used[lab[lab >= 0].astype(np.int64)] = True
    unused = np.flatnonzero(~used).tolist()
    if not unused:
        return []
    gap = unused[0]
    where = [
        f"{s}_labels has {int((lab > gap).sum())} label(s) > {gap - 1} (values "
        f"{label_values(lab[lab > gap])})"
        for s, lab in labels.items()
        if (lab > gap).any()
    ]
    shown = unused[:10] + (["..."] if len(unused) > 10 else [])
    return [
        f"the classes are not declared (no num_classes and no medmnist.INFO entry for this "
        f"file name) and the labels skip class(es) {shown}, which no split uses: "
        f"{'; '.join(where)}. Inferring {observed_max + 1} classes would be a guess; declare "
        "the classes (num_classes, or data.num_classes in a run config) and fix the labels "
        "outside them"
    ]


def undeclared_problem(suggested: int) -> str:
    """The refusal of a file whose classes nobody declared (the count is not read off labels)."""
    return (
        "the number of classes is not declared: no num_classes, no medmnist.INFO entry for this "
        f"file name and no {CLASSES_KEY!r} array of class names in the file. The class count "
        "sets the released model's output layer and the probes, so it must not come from the "
        "private labels (one training image with a new label would change it). Set "
        "data.num_classes in the run config (CLI: --set data.num_classes=N; Python: "
        f"num_classes=N) or store the class names in the file (np.savez(..., {CLASSES_KEY}="
        "np.array(['normal', 'pneumonia']))). For you, the data custodian only, not for "
        f"anything you share: the labels in this file suggest {suggested} classes "
        "(largest label + 1)"
    )


def declared_class_names(archive: Any, problems: list[str]) -> list[str]:
    """Class names from the file's ``classes`` array (a declaration shipped with the data)."""
    if CLASSES_KEY not in archive.files:
        return []
    try:
        names = archive[CLASSES_KEY]
    except ValueError as err:  # object arrays need pickle, which is refused
        problems.append(
            f"{CLASSES_KEY} could not be read without pickle ({err}); save class names as "
            "strings (np.asarray(names, dtype=str))"
        )
        return []
    if names.ndim != 1 or names.size == 0:
        problems.append(
            f"{CLASSES_KEY} has shape {names.shape}; expected a non-empty 1-D array with one "
            "name per class"
        )
        return []
    return [str(v) for v in names.tolist()]


def class_counts(labels: torch.Tensor, num_classes: int, multilabel: bool) -> list[int]:
    """Examples per class: counts of ``[N]`` class ids, or column sums of ``[N, K]`` labels."""
    if multilabel:
        return [int(v) for v in labels.sum(dim=0).tolist()]
    return [int(v) for v in torch.bincount(labels, minlength=num_classes).tolist()]
