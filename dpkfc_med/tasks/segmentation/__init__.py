"""Segmentation of NIfTI / DICOM / 2D image folders: the task, its builder, batches, metrics and 2D / 3D layout."""  # noqa: E501
