"""DICOM: files and series read into volumes (:mod:`.series`), the header scan and series checks of a case folder (:mod:`.scan`), their NIfTI conversion and its cache (:mod:`.convert`)."""  # noqa: E501

from dpkfc_med.data.dicom.series import list_dicom_series, read_dicom_series

__all__ = ["list_dicom_series", "read_dicom_series"]
