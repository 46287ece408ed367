"""2D segmentation data: folders of PNG / JPEG images with integer label masks.

Layout: ``images/<case>.<ext>`` paired with ``masks/<case>.<ext>`` by file stem (the name
without its extension), ``ext`` one of :data:`IMAGE_SUFFIXES`. A mask is a single-channel label
map holding the class index of every pixel (``0..K-1``: background 0), stored losslessly
(PNG, TIFF or BMP; a JPEG mask is refused because lossy compression changes values at edges).
Images are greyscale (one channel) or RGB (three); every image of a folder has the same
channels. The classes are declared in the config (``data.num_classes``), never counted from the
masks.

Each case is one image and one privacy unit; folders of 2D NIfTI (``imagesTr``/``labelsTr`` or
``dataset.json`` with ``(X, Y)`` or ``(X, Y, 1)`` files) are read by :mod:`.nifti` instead.
Arrays follow MONAI's ``PILReader`` (``reverse_indexing=True``): a ``W x H`` picture is an
``[W, H]`` (or ``[W, H, C]``) array, so the readers here and MONAI's transforms agree on axes.
Pixels have no physical size in these formats: distances (HD95) are in pixels. Registered as
the ``images-masks`` format.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dpkfc_med.data.cases import (
    IMAGE_SUFFIXES,
    SegmentationCase,
    collect_cases,
    read_headers,
    read_image_array,
)
from dpkfc_med.data.formats.registry import ReadOptions, register_format

__all__ = [
    "IMAGE_SUFFIXES",
    "is_image_file",
    "is_image_mask_folder",
    "load_image_mask_folder",
    "read_image_array",
    "read_image_mask_folder",
]

_LOSSY = (".jpg", ".jpeg")
# PIL modes: channels of an image, and the single-channel modes a label map may have.
_IMAGE_MODES = {"1": 1, "L": 1, "I": 1, "I;16": 1, "I;16B": 1, "I;16L": 1, "F": 1, "RGB": 3}
_MASK_MODES = ("1", "L", "P", "I", "I;16", "I;16B", "I;16L")


def is_image_file(path: Path) -> bool:
    """Whether ``path`` is a 2D image file by its ending (hidden files such as ``._x`` are not)."""
    return (
        path.is_file() and path.suffix.lower() in IMAGE_SUFFIXES and not path.name.startswith(".")
    )


def is_image_mask_folder(root: Path) -> bool:
    """Whether ``root`` has the ``images/`` + ``masks/`` layout (and no ``imagesTr/``)."""
    return (
        (root / "images").is_dir()
        and (root / "masks").is_dir()
        and not (root / "imagesTr").is_dir()
    )


def _facts(path: Path) -> tuple[tuple[int, int], str]:
    """``((W, H), PIL mode)`` from the file header; no pixel data is decoded."""
    from PIL import Image

    with Image.open(path) as img:
        return (int(img.size[0]), int(img.size[1])), str(img.mode)


def _by_stem(folder: Path, kind: str, problems: list[tuple[str | None, str]]) -> dict[str, Path]:
    files: dict[str, Path] = {}
    for p in sorted(folder.iterdir()):
        if not is_image_file(p):
            continue
        if p.stem in files:
            problems.append(
                (
                    p.stem,
                    f"case {p.stem}: two {kind} files ({files[p.stem].name}, {p.name}); keep one",
                )
            )
        files[p.stem] = p
    return files


def _check_pair(cid: str, image: Path, mask: Path) -> Any:
    """The :class:`~dpkfc_med.data.cases.SegmentationCase` of a pair, or its problems."""
    facts, problems = read_headers(
        cid, {"image": image, "mask": mask}, _facts, lambda p: f"{p.parent.name}/{p.name}"
    )
    if problems:
        return problems
    (isize, imode), (msize, mmode) = facts["image"], facts["mask"]
    if mask.suffix.lower() in _LOSSY:
        problems.append(
            f"case {cid}: mask masks/{mask.name} is a JPEG, whose lossy compression changes "
            "label values at edges; save masks as PNG"
        )
    if mmode not in _MASK_MODES:
        problems.append(
            f"case {cid}: mask masks/{mask.name} has PIL mode {mmode!r}; a mask must be one "
            "channel of class indices (0..K-1), e.g. a greyscale or palette PNG"
        )
    if imode not in _IMAGE_MODES:
        problems.append(
            f"case {cid}: image images/{image.name} has PIL mode {imode!r}; images must be "
            "greyscale or RGB (drop the alpha channel, convert palette images)"
        )
    if isize != msize:
        problems.append(
            f"case {cid}: image images/{image.name} is {isize[0]}x{isize[1]} pixels but mask "
            f"masks/{mask.name} is {msize[0]}x{msize[1]}; the mask must label every pixel of "
            "its image (same size)"
        )
    if problems:
        return problems
    return SegmentationCase(
        case_id=cid,
        image_path=image,
        label_path=mask,
        shape=isize,
        spacing=(1.0, 1.0),
        image_dtype=imode,
        label_dtype=mmode,
        channels=_IMAGE_MODES[imode],
    )


def load_image_mask_folder(
    path: str | Path,
    *,
    num_classes: int | None = None,
    on_unpaired: str = "error",
    case_ids: Sequence[str] | None = None,
) -> Any:
    """Index a folder of ``images/`` and ``masks/`` from the file headers.

    Header checks (pairing, readability, modes, image/mask size) run for every case and are
    reported together; label values are checked when a case is read
    (:meth:`~dpkfc_med.data.cases.SegmentationCases.validate_all`).

    Args:
        path: The folder holding ``images/`` and ``masks/``.
        num_classes: Declared classes (background included); ``None``: masks are only checked
            to hold non-negative integers.
        on_unpaired: ``"error"`` or ``"warn"`` (skip, with a warning) for an image without a
            mask or a mask without an image.
        case_ids: Only index these stems; problems of other cases are not reported.

    Returns:
        :class:`~dpkfc_med.data.cases.SegmentationCases` read with MONAI's ``PILReader``.

    Raises:
        DataValidationError: Every problem, each naming the case and the file.
    """
    root = Path(path).expanduser()
    notes: list[tuple[str | None, str]] = []
    images = _by_stem(root / "images", "image", notes)
    masks = _by_stem(root / "masks", "mask", notes)
    if not images and not masks:
        notes.append((None, f"images/ and masks/ hold no {'/'.join(IMAGE_SUFFIXES)} files"))
    stems = set(images) | set(masks)
    if case_ids is not None:
        wanted = set(case_ids)
        notes = [(c, m) for c, m in notes if c is None or c in wanted]
        notes += [
            (c, f"case {c}: requested in case_ids but not found in {root}")
            for c in sorted(wanted - stems)
        ]
        stems &= wanted
    problems = [m for _, m in notes]
    unpaired = []
    for cid in sorted(stems):
        if cid not in masks:
            unpaired.append(f"case {cid}: image images/{images[cid].name} has no mask in masks/")
        elif cid not in images:
            unpaired.append(f"case {cid}: mask masks/{masks[cid].name} has no image in images/")
    dropped: list[str] = []
    if unpaired and on_unpaired == "error":
        problems += [
            f"{m} (add the mask with the same file stem, or move the file out of the data folder)"
            for m in unpaired
        ]
    elif unpaired:
        dropped = unpaired
        warnings.warn(
            f"{root}: skipped {len(dropped)} unpaired file(s): " + "; ".join(dropped),
            stacklevel=4,
        )
    return collect_cases(
        root,
        (
            _check_pair(cid, images[cid], masks[cid])
            for cid in sorted(stems & set(images) & set(masks))
        ),
        problems,
        empty="no image/mask pairs found; check the folder layout",
        num_classes=num_classes,
        source="images/masks",
        dropped=dropped,
        reader="PILReader",
    )


@register_format(
    "images-masks",
    recognise=is_image_mask_folder,
    layout="images/<case>.png + masks/<case>.png (PNG / JPEG / TIFF / BMP)",
)
def read_image_mask_folder(root: Path, options: ReadOptions) -> Any:
    """Read an ``images/`` + ``masks/`` folder: :func:`load_image_mask_folder` with ``options``."""
    return load_image_mask_folder(
        root,
        num_classes=options.num_classes,
        on_unpaired=options.on_unpaired,
        case_ids=options.case_ids,
    )
