"""Segmentation folder formats: a registry where each format says how to recognise and read a folder.

:func:`detect_format` asks every registered format whether it recognises a folder (from file
names only); two that both do are an error naming both. Each built-in format registers itself
when its module is imported below; a new format is one module plus one import line here.
"""  # noqa: E501

from dpkfc_med.data.formats import (  # noqa: F401  (each registers its format)
    case_folders,
    dicom_series,
    images2d,
    nifti,
)
from dpkfc_med.data.formats.registry import (
    FORMATS,
    DataFormat,
    ReadOptions,
    data_format,
    detect_format,
    register_format,
)

__all__ = [
    "FORMATS",
    "DataFormat",
    "ReadOptions",
    "data_format",
    "detect_format",
    "register_format",
]
