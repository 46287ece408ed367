"""The registry of segmentation folder formats: each says how to recognise a folder and read it.

A format is a name, a ``recognise(root) -> bool`` that looks only at file and folder names
(listings, never image contents) and a ``read(root, options)`` that indexes the folder into
:class:`~dpkfc_med.data.cases.SegmentationCases`. :func:`detect_format` asks every registered
format; a folder recognised by two or more is an
:class:`~dpkfc_med.data.errors.AmbiguousFormatError` naming them, never settled by an order.

Adding a format is one module and one registration, as :mod:`.case_folders` shows::

    @register_format("my-layout", recognise=is_my_layout, layout="<case>/... in words")
    def read_my_layout(root: Path, options: ReadOptions) -> SegmentationCases: ...

plus one import line in :mod:`dpkfc_med.data.formats` so that the module registers on import.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from dpkfc_med.data.cases import SegmentationCases
from dpkfc_med.data.errors import AmbiguousFormatError
from dpkfc_med.utils import did_you_mean

__all__ = [
    "FORMATS",
    "DataFormat",
    "ReadOptions",
    "Reader",
    "data_format",
    "detect_format",
    "register_format",
]


@dataclass(frozen=True)
class ReadOptions:
    """What the caller of :func:`~dpkfc_med.data.load_segmentation_folder` asked for.

    Attributes:
        num_classes: Declared classes (background included); ``None``: undeclared.
        on_unpaired: ``"error"`` or ``"warn"`` (drop, with a warning) for an image without a
            label or vice versa.
        case_ids: Only index these cases; ``None``: every case.
        dicom_series: For DICOM series: regex of the ``SeriesDescription`` to read.
        cache_dir: For DICOM series: where their NIfTI conversions are kept.
        channels: The input channels' names in order (``data.channels``).
    """

    num_classes: int | None = None
    on_unpaired: str = "error"
    case_ids: Sequence[str] | None = None
    dicom_series: str | None = None
    cache_dir: str | Path | None = None
    channels: Sequence[str] | None = None


Reader = Callable[[Path, ReadOptions], SegmentationCases]
"""``read(root, options)``: the folder indexed as segmentation cases (every problem raised once)."""


@dataclass(frozen=True)
class DataFormat:
    """One registered folder format.

    Attributes:
        name: The format's name (``SegmentationCases.source`` may say more).
        recognise: Whether a folder has this layout, from names and listings only.
        read: Indexes a recognised folder.
        layout: The layout in a few words, for errors.
    """

    name: str
    recognise: Callable[[Path], bool]
    read: Reader
    layout: str


FORMATS: dict[str, DataFormat] = {}
"""The registered formats by name, in registration order (which decides nothing)."""


def register_format(
    name: str, *, recognise: Callable[[Path], bool], layout: str
) -> Callable[[Reader], Reader]:
    """Decorator: register the decorated reader as the format ``name``.

    Args:
        name: A new format name.
        recognise: ``recognise(root) -> bool``, cheap: names and listings only.
        layout: The layout in a few words (``"<case>/<case>_<channel>.nii.gz + <case>_seg"``).

    Raises:
        ValueError: ``name`` is already registered.
    """

    def deco(read: Reader) -> Reader:
        if name in FORMATS:
            raise ValueError(f"data format {name!r} is already registered")
        FORMATS[name] = DataFormat(name, recognise, read, layout)
        return read

    return deco


def data_format(name: str) -> DataFormat:
    """The registered format ``name``.

    Raises:
        ValueError: No format has that name (naming the known ones).
    """
    if name not in FORMATS:
        raise ValueError(
            f"data format {name!r} is not registered{did_you_mean(name, FORMATS)}; "
            f"known: {sorted(FORMATS)}"
        )
    return FORMATS[name]


def detect_format(root: Path) -> DataFormat | None:
    """The one registered format that recognises ``root``; ``None`` when none does.

    Raises:
        AmbiguousFormatError: Two or more formats recognise ``root`` (naming each).
    """
    found = [f for f in FORMATS.values() if f.recognise(root)]
    if len(found) > 1:
        raise AmbiguousFormatError(root, {f.name: f.layout for f in found})
    return found[0] if found else None
