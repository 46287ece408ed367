"""Segmentation data from a dataset folder, in whichever registered format it has.

:func:`load_segmentation_folder` indexes a dataset folder into
:class:`~dpkfc_med.data.cases.SegmentationCases`, pairing images with labels and checking their
headers: the registered format that recognises the folder (:mod:`.formats`: NIfTI / MSD /
nnU-Net, BraTS case folders, DICOM series, 2D PNG / JPEG images and masks) reads it. Slices of
volumes are 2-D samples of their volume (:mod:`.slices`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from dpkfc_med.data.cases import SegmentationCases
from dpkfc_med.data.errors import DataValidationError
from dpkfc_med.data.formats import ReadOptions, data_format, detect_format

__all__ = ["load_segmentation_folder"]


def load_segmentation_folder(
    path: str | Path,
    *,
    num_classes: int | None = None,
    on_unpaired: str = "error",
    case_ids: Sequence[str] | None = None,
    dicom_series: str | None = None,
    cache_dir: str | Path | None = None,
    channels: Sequence[str] | None = None,
    format: str | None = None,
) -> SegmentationCases:
    """Index a segmentation dataset folder from its file headers, in the format it has.

    The format comes from the registry (:mod:`.formats`): the one registered format that
    recognises the folder reads it. NIfTI (:mod:`.formats.nifti`): an MSD-style
    ``dataset.json`` (its ``training`` list pairs images with labels and its ``labels`` dict
    declares the classes) or ``imagesTr/`` and ``labelsTr/`` folders whose files pair by case
    ID (the file name without ``.nii(.gz)``; an image named ``<case>_0000`` in nnU-Net style
    pairs with label ``<case>``; hidden files such as macOS ``._*`` forks are ignored); it also
    reads a folder no format recognises, naming what is missing. The other built-in formats:
    one folder per case (BraTS, :mod:`.formats.case_folders`), folders of DICOM series
    (:mod:`.formats.dicom_series`) and 2D ``images/`` + ``masks/`` (PNG / JPEG,
    :mod:`.formats.images2d`). A folder that two formats recognise is an error naming both.
    Header checks run for every case; voxel checks run lazily
    (:meth:`SegmentationCases.load_case`, the label check in :func:`segmentation_transforms`)
    or all at once with :meth:`SegmentationCases.validate_all`.

    Unpaired files are an error by default: silently dropping a case changes ``N``, which
    enters the sampling rate of the privacy accounting and the dataset record of the report.
    ``on_unpaired="warn"`` drops them with a warning instead.

    Args:
        path: The dataset folder.
        num_classes: Declared classes (background included); overrides ``dataset.json``.
        on_unpaired: ``"error"`` or ``"warn"`` for an image without a label or vice versa.
        case_ids: Only index these cases; problems of other cases are not reported.
        dicom_series: For a folder of DICOM series (one per case, handed to
            :func:`~dpkfc_med.data.formats.dicom_series.load_dicom_segmentation_folder`): regex of
            the ``SeriesDescription`` to read where a case has several.
        cache_dir: For DICOM series: where their NIfTI conversions are kept.
        channels: The input channels' names in order (``data.channels``): for one folder per
            case (BraTS, :mod:`.formats.case_folders`) the modality file suffixes, required;
            for other NIfTI folders the channel count every case must have.
        format: The name of a registered format (:mod:`.formats`: ``nifti``,
            ``case-folders``, ``dicom-series``, ``images-masks``, ...) to read the folder as,
            for a folder that several formats recognise; ``None``: the one that recognises it.

    Returns:
        :class:`SegmentationCases`, sorted by case ID.

    Raises:
        DataValidationError: Listing every problem: missing folder or files, unpaired
            files, unreadable headers, image/label shape or spacing mismatch.
        AmbiguousFormatError: Two registered formats recognise the folder (naming both).
    """
    root = Path(path).expanduser()
    if on_unpaired not in ("error", "warn"):
        raise ValueError(f"on_unpaired={on_unpaired!r} is not one of 'error', 'warn'")
    if not root.is_dir():
        raise DataValidationError(
            root,
            [
                "folder not found; pass a folder with imagesTr/ + labelsTr/ or a dataset.json "
                "(--data PATH, or resolve_data_path(..., kind='dir'))"
            ],
        )
    options = ReadOptions(num_classes, on_unpaired, case_ids, dicom_series, cache_dir, channels)
    chosen = data_format(format) if format is not None else detect_format(root)
    return (chosen or data_format("nifti")).read(root, options)
