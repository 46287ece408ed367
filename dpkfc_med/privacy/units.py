"""Group privacy for units that are not patients (re-exported from :mod:`dpkfc_med.units`).

The definitions live in the torch-free :mod:`dpkfc_med.units`, so that the report can import
them without this package's ``__init__`` (which loads the engine and Opacus).
"""

from dpkfc_med.units import (
    KNOWN_MULTI_IMAGE_DATASETS,
    MEDMNIST_V2_CITATION,
    group_privacy,
    unit_note_for,
)

__all__ = [
    "KNOWN_MULTI_IMAGE_DATASETS",
    "MEDMNIST_V2_CITATION",
    "group_privacy",
    "unit_note_for",
]
