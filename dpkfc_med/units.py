"""Privacy units that are not patients: known multi-image datasets and group privacy.

Torch-free on purpose, so the report can import it without loading the training stack.

When a run's privacy unit is one *image* but a patient contributes several images, the
guarantee for a patient follows from group privacy (:func:`group_privacy`). The table
:data:`KNOWN_MULTI_IMAGE_DATASETS` lists the MedMNIST v2 sets whose own description states
that images share a patient (or scan, specimen, animal); :func:`unit_note_for` turns an entry
into the machine-readable ``Task.unit_note`` that the report renders.

Only what the source states is listed: every entry quotes ``medmnist.INFO[flag]
['description']`` (the text of the MedMNIST v2 paper). Sets whose description gives no patient
count (PneumoniaMNIST, DermaMNIST, BreastMNIST, OCTMNIST, RetinaMNIST, PathMNIST, BloodMNIST,
NoduleMNIST3D) are not listed, which means "not known", not "one image per patient".
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = [
    "KNOWN_MULTI_IMAGE_DATASETS",
    "MEDMNIST_V2_CITATION",
    "group_privacy",
    "unit_note_for",
]

MEDMNIST_V2_CITATION = (
    "J. Yang et al., MedMNIST v2 - A large-scale lightweight benchmark for 2D and 3D biomedical "
    "image classification, Scientific Data 10, 41 (2023), doi:10.1038/s41597-022-01721-8"
)
"""The paper whose dataset descriptions (``medmnist.INFO[flag]['description']``) are quoted."""

_LITS_SCANS = (
    "115 and 16 CT scans from the source training set are used as training and validation set, "
    "respectively. The 70 CT scans from the source test set are treated as the test set."
)

KNOWN_MULTI_IMAGE_DATASETS: dict[str, dict[str, Any]] = {
    # flag: group (what one "patient" is), images_per_patient (the stated maximum, or None
    # when only totals are stated), images / patients (the stated totals), quote (verbatim).
    "adrenalmnist3d": {
        "group": "patient",
        "images_per_patient": 2,
        "images": 1584,
        "patients": 792,
        "quote": (
            "consisting of shape masks from 1,584 left and right adrenal glands "
            "(i.e., 792 patients)"
        ),
    },
    "chestmnist": {
        "group": "patient",
        "images_per_patient": None,
        "images": 112120,
        "patients": 30805,
        "quote": "112,120 frontal-view X-Ray images of 30,805 unique patients",
    },
    "organamnist": {
        "group": "CT scan",
        "images_per_patient": None,
        "images": 58830,
        "patients": 201,
        "quote": _LITS_SCANS,
    },
    "organcmnist": {
        "group": "CT scan",
        "images_per_patient": None,
        "images": 23583,
        "patients": 201,
        "quote": _LITS_SCANS,
    },
    "organsmnist": {
        "group": "CT scan",
        "images_per_patient": None,
        "images": 25211,
        "patients": 201,
        "quote": _LITS_SCANS,
    },
    "organmnist3d": {
        "group": "CT scan",
        "images_per_patient": None,
        "images": 1742,
        "patients": 201,
        "quote": (
            "The same 115 and 16 CT scans as the Organ{A,C,S}MNIST from the source training set "
            "are used as training and validation set, respectively, and the same 70 CT scans as "
            "the Organ{A,C,S}MNIST from the source test set are treated as the test set."
        ),
    },
    "fracturemnist3d": {
        "group": "CT scan",
        "images_per_patient": None,
        "images": 5000,
        "patients": 660,
        "quote": "around 5,000 rib fractures from 660 computed tomography 153 (CT) scans",
    },
    "vesselmnist3d": {
        "group": "brain-vessel model (one MRA reconstruction)",
        "images_per_patient": None,
        "images": 1909,
        "patients": 103,
        "quote": (
            "103 3D models (meshes) of entire brain vessels collected by reconstructing MRA "
            "images. 1,694 healthy vessel segments and 215 aneurysm segments are generated "
            "automatically from the complete models"
        ),
    },
    "tissuemnist": {
        "group": "tissue specimen",
        "images_per_patient": None,
        "images": 236386,
        "patients": 3,
        "quote": "236,386 human kidney cortex cells, segmented from 3 reference tissue specimens",
    },
    "synapsemnist3d": {
        "group": "animal",
        "images_per_patient": None,
        "images": 1759,
        "patients": 1,
        "quote": "It uses a 3D image volume of an adult rat",
    },
}
"""MedMNIST flag -> what its description states about images per patient (see module doc).

``images`` counts the images the quote speaks of (for FractureMNIST3D the source's fractures,
of which MedMNIST keeps 1,370); ``patients`` the groups it names.
"""


def group_privacy(epsilon: float, delta: float, k: int) -> tuple[float, float]:
    r"""The ``(epsilon, delta)`` guarantee for a group of ``k`` units.

    An ``(epsilon, delta)``-DP mechanism is, for datasets that differ in ``k`` units,

    .. math::

        (\varepsilon_k, \delta_k) = (k \varepsilon,\; k e^{(k-1)\varepsilon} \delta),

    the bound of walking a chain of ``k`` neighbouring datasets, which gives
    :math:`\delta \sum_{i<k} e^{i\varepsilon} \le k e^{(k-1)\varepsilon}\delta`
    (Dwork & Roth, *The Algorithmic Foundations of Differential Privacy*, 2014, Thm. 2.2
    for ``delta = 0``). Use it for a patient with ``k`` images when the unit is one image.

    Args:
        epsilon: Per-unit epsilon, ``>= 0``.
        delta: Per-unit delta in ``[0, 1]``.
        k: Units in the group (images per patient), an integer ``>= 1``.

    Returns:
        ``(epsilon_k, delta_k)``; ``delta_k`` is capped at 1 (a vacuous bound).

    Raises:
        ValueError: An argument is out of range (all problems are listed).

    Examples:
        >>> eps_k, delta_k = group_privacy(1.0, 1e-5, 2)
        >>> eps_k, round(delta_k, 9)
        (2.0, 5.4366e-05)
    """
    problems = []
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        problems.append(f"k={k!r}: must be an integer >= 1 (images per patient)")
    if not (isinstance(epsilon, (int, float)) and math.isfinite(epsilon) and epsilon >= 0):
        problems.append(f"epsilon={epsilon!r}: must be a finite number >= 0")
    if not (isinstance(delta, (int, float)) and 0 <= delta <= 1):
        problems.append(f"delta={delta!r}: must be in [0, 1]")
    if problems:
        raise ValueError("group_privacy: " + "; ".join(problems))
    return k * float(epsilon), min(1.0, k * math.exp((k - 1) * epsilon) * float(delta))


def unit_note_for(
    flag: str | None, table: Mapping[str, Mapping[str, Any]] = KNOWN_MULTI_IMAGE_DATASETS
) -> dict[str, Any] | None:
    """The ``Task.unit_note`` of a run whose unit is one image of the MedMNIST set ``flag``.

    Args:
        flag: ``medmnist.INFO`` key of the data (``None``: not a MedMNIST file).
        table: Known datasets (default :data:`KNOWN_MULTI_IMAGE_DATASETS`).

    Returns:
        ``None`` when ``flag`` is not known to hold several images per patient; else a
        JSON-serialisable dict with ``unit`` (``"image"``), ``dataset``, ``group``,
        ``images_per_patient`` (stated maximum ``k`` or ``None``),
        ``mean_images_per_patient``, ``images``, ``patients``, ``source``, ``quote`` and a
        one-paragraph ``statement``.
    """
    entry = table.get(flag) if flag else None
    if entry is None:
        return None
    k = entry["images_per_patient"]
    group = entry["group"]
    mean = round(entry["images"] / entry["patients"], 1)
    fix = (
        "to make the patient the privacy unit, give the training images' patient ids "
        "(data.unit_ids: a CSV with columns index,unit_id, or a train_unit_ids array in the .npz)"
    )
    if k is not None:
        eps_k = f"{k} eps" if k > 1 else "eps"
        statement = (
            f"The privacy unit is one image, but {flag} holds {k} images per {group} "
            f"({entry['images']:,} images of {entry['patients']:,} {_plural(group)}). A {group} is "
            f"protected only by group privacy with k = {k}: ({eps_k}, {k} e^({k - 1} eps) "
            f"delta) where the report states (eps, delta) per image; {fix}."
        )
    else:
        statement = (
            f"The privacy unit is one image, but {flag} holds several images per {group} "
            f"({entry['images']:,} images of {entry['patients']:,} {_plural(group)}, "
            f"{mean} on average; "
            f"the maximum is not stated). A {group} with k images is protected only at "
            f"(k eps, k e^((k-1) eps) delta) where the report states (eps, delta) per image; "
            f"{fix}."
        )
    return {
        "unit": "image",
        "dataset": flag,
        "group": group,
        "images_per_patient": k,
        "mean_images_per_patient": mean,
        "images": entry["images"],
        "patients": entry["patients"],
        "source": f"{MEDMNIST_V2_CITATION}; medmnist.INFO[{flag!r}]['description']",
        "quote": entry["quote"],
        "statement": statement,
    }


def _plural(group: str) -> str:
    """``"patient"`` -> ``"patients"``; ``"model (one scan)"`` -> ``"models (one scan)"``."""
    head, sep, rest = group.partition(" (")
    return f"{head}s{sep}{rest}"
