"""Private-data readers: MedMNIST .npz (2D/3D), segmentation folders in registered formats (NIfTI / MSD dataset.json, BraTS, DICOM series, 2D images); patient unit ids and image fingerprints; data-root resolution."""  # noqa: E501

from dpkfc_med.data.cases import SegmentationCase, SegmentationCases
from dpkfc_med.data.dicom import list_dicom_series, read_dicom_series
from dpkfc_med.data.errors import AmbiguousFormatError, DataNotFoundError, DataValidationError
from dpkfc_med.data.fingerprint import count_shared, image_digests
from dpkfc_med.data.folders import load_segmentation_folder
from dpkfc_med.data.medmnist import (
    MedMNISTDataset,
    Task,
    TensorImageDataset,
    load_medmnist,
    medmnist_info,
)
from dpkfc_med.data.paths import (
    DATA_ENV_VAR,
    data_roots,
    default_data_root,
    resolve_data_path,
    sha256_file,
)
from dpkfc_med.data.splits import (
    deterministic_split,
    fractions_that_fill,
    load_split,
    read_split_file,
    save_split,
)
from dpkfc_med.data.transforms import CropMode, IntensityNorm, segmentation_transforms
from dpkfc_med.data.units import (
    UnitCollate,
    UnitImageDataset,
    group_by_unit,
    read_unit_ids_csv,
)
from dpkfc_med.data.volumes import VolumeDataset

__all__ = [
    "AmbiguousFormatError",
    "DATA_ENV_VAR",
    "CropMode",
    "DataNotFoundError",
    "DataValidationError",
    "IntensityNorm",
    "MedMNISTDataset",
    "SegmentationCase",
    "SegmentationCases",
    "Task",
    "TensorImageDataset",
    "UnitCollate",
    "UnitImageDataset",
    "VolumeDataset",
    "count_shared",
    "data_roots",
    "default_data_root",
    "deterministic_split",
    "fractions_that_fill",
    "group_by_unit",
    "image_digests",
    "list_dicom_series",
    "load_medmnist",
    "load_segmentation_folder",
    "load_split",
    "medmnist_info",
    "read_dicom_series",
    "read_split_file",
    "read_unit_ids_csv",
    "resolve_data_path",
    "save_split",
    "segmentation_transforms",
    "sha256_file",
]
