"""The NIfTI conversion of a case's DICOM series, kept in a cache outside the data folder.

:func:`convert_case` reads a checked series once with SimpleITK's ``ImageSeriesReader`` (and a
DICOM-SEG label with ``highdicom``) into NIfTI files under the cache, keyed by the files' paths,
sizes and modification times, and checks that the label lies on the series' voxel grid;
:func:`header_grid_problem` compares a NIfTI label's shape with the series' before any
conversion.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dpkfc_med.data.cases import SegmentationCase, header_facts, is_nifti_file
from dpkfc_med.data.dicom.scan import DicomSlice

__all__ = ["DicomSegmentationCase", "convert_case", "default_cache", "header_grid_problem"]

_CACHE_VERSION = "1"  # bump when the conversion changes: old cache entries are then ignored
_temp_cache: Path | None = None


@dataclass(frozen=True)
class DicomSegmentationCase(SegmentationCase):
    """A case whose image is a DICOM series, read once into a cached NIfTI file.

    ``image_path`` (and ``label_path`` for a DICOM-SEG label) point at the cached NIfTI
    conversion, so every reader of :class:`SegmentationCase` (MONAI's ``LoadImaged``, the
    fingerprint, :meth:`~dpkfc_med.data.cases.SegmentationCases.validate_all`) works unchanged.

    Attributes:
        series_folder: The case's folder of DICOM files.
        series_uid: ``SeriesInstanceUID`` of the series read.
        series_description: Its ``SeriesDescription`` (``""`` if absent).
        label_source: The label as the user gave it (NIfTI file or DICOM-SEG file).
    """

    series_folder: Path = Path()
    series_uid: str = ""
    series_description: str = ""
    label_source: Path = Path()


def _grid_mismatch(cid: str, label: Path, ishape: Sequence[int], lshape: Sequence[int]) -> str:
    return (
        f"case {cid}: series shape {tuple(ishape)} != label {label.name} shape {tuple(lshape)} "
        "(X, Y, Z); image and label must be on the same voxel grid (resample the label onto "
        "the series)"
    )


def header_grid_problem(cid: str, slices: Sequence[DicomSlice], label: Path) -> str | None:
    """Compare a NIfTI label's shape with the series' from the headers, before any conversion."""
    if not is_nifti_file(label):
        return None  # a DICOM-SEG is read on the series' slices
    rows, cols = slices[0].size
    ishape = (cols, rows, len(slices))  # NIfTI (X, Y, Z): columns, rows, slices
    try:
        lshape = header_facts(label)[0]
    except Exception as err:  # nibabel raises several types for corrupt / foreign files
        return (
            f"case {cid}: label {label.name} is unreadable or corrupt ({type(err).__name__}: "
            f"{err}); re-export or remove the case"
        )
    return None if tuple(lshape) == ishape else _grid_mismatch(cid, label, ishape, lshape)


def _cache_key(root: Path, uid: str, slices: Sequence[DicomSlice], label: Path) -> str:
    h = hashlib.sha256(f"{_CACHE_VERSION}\n{root.resolve()}\n{uid}\n".encode())
    for path in (*(s.path for s in slices), label):
        st = path.stat()
        h.update(f"{path.resolve()} {st.st_size} {st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def default_cache() -> Path:
    """A private temporary folder, removed when the process exits."""
    global _temp_cache
    if _temp_cache is None:
        _temp_cache = Path(tempfile.mkdtemp(prefix="dpkfc-dicom-"))  # mode 0700
        atexit.register(shutil.rmtree, _temp_cache, ignore_errors=True)
    return _temp_cache


def _write_atomic(image: Any, path: Path) -> None:
    import SimpleITK as sitk

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    sitk.WriteImage(image, str(tmp), True)
    os.replace(tmp, path)


def _read_seg(seg_path: Path, slices: Sequence[DicomSlice]) -> np.ndarray:
    """A DICOM-SEG as label values ``[D, H, W]`` on the slices of the series (segment numbers)."""
    try:
        import highdicom as hd
    except ImportError as err:
        raise ImportError(
            f"{seg_path}: DICOM-SEG labels need highdicom; pip install 'dpkfc-med[dicom]' "
            "(or pip install highdicom)"
        ) from err
    seg = hd.seg.segread(str(seg_path))
    return np.asarray(
        seg.get_pixels_by_source_instance(
            source_sop_instance_uids=[s.sop_uid for s in slices],
            combine_segments=True,
            assert_missing_frames_are_empty=True,
        )
    )


def convert_case(
    root: Path,
    cid: str,
    uid: str,
    slices: list[DicomSlice],
    label: Path,
    cache: Path,
) -> SegmentationCase | list[str]:
    """Read the series (and a DICOM-SEG label) into cached NIfTI files and check the label grid."""
    import nibabel as nib
    import SimpleITK as sitk

    key = _cache_key(root, uid, slices, label)
    folder = cache / cid / key
    image_path = folder / f"{cid}.nii.gz"
    label_is_seg = not is_nifti_file(label)
    label_path = folder / f"{cid}_seg.nii.gz" if label_is_seg else label
    if not (image_path.is_file() and label_path.is_file()):
        reader = sitk.ImageSeriesReader()
        reader.SetFileNames([str(s.path) for s in slices])  # sorted along the slice normal
        try:
            image = reader.Execute()
            seg = _read_seg(label, slices) if label_is_seg else None
        except ImportError:
            raise
        except Exception as err:
            kind = "DICOM-SEG label " + label.name if label_is_seg else f"series {uid}"
            return [
                f"case {cid}: {kind} unreadable ({type(err).__name__}: {str(err).strip()[:200]}); "
                "re-export or remove the case"
            ]
        for old in (cache / cid).glob("*"):  # stale conversions of this case
            if old.name != key:
                shutil.rmtree(old, ignore_errors=True)
        _write_atomic(image, image_path)
        if seg is not None:
            lab = sitk.GetImageFromArray(seg.astype(np.uint16 if seg.max() > 255 else np.uint8))
            lab.CopyInformation(image)
            _write_atomic(lab, label_path)
    ishape, izoom, idtype = header_facts(image_path)
    try:
        lshape, lzoom, ldtype = header_facts(label_path)
        laffine = np.asarray(nib.load(str(label_path)).affine)  # type: ignore[attr-defined]
    except Exception as err:
        return [
            f"case {cid}: label {label.name} is unreadable or corrupt ({type(err).__name__}: "
            f"{err}); re-export or remove the case"
        ]
    iaffine = np.asarray(nib.load(str(image_path)).affine)  # type: ignore[attr-defined]
    if tuple(lshape) != tuple(ishape):
        return [_grid_mismatch(cid, label, ishape, lshape)]
    if not np.allclose(izoom, lzoom, rtol=1e-3, atol=1e-4) or not np.allclose(
        iaffine, laffine, atol=1e-2
    ):
        lsp, isp = (tuple(round(float(z), 4) for z in zs) for zs in (lzoom, izoom))
        return [
            f"case {cid}: label {label.name} lies on another grid than the series (spacing "
            f"{lsp} vs {isp} "
            f"mm, origin {laffine[:3, 3].round(3).tolist()} vs {iaffine[:3, 3].round(3).tolist()} "
            "mm RAS, or direction); resample the label onto the series"
        ]
    return DicomSegmentationCase(
        case_id=cid,
        image_path=image_path,
        label_path=label_path,
        shape=(ishape[0], ishape[1], ishape[2]),
        spacing=(izoom[0], izoom[1], izoom[2]),
        image_dtype=idtype,
        label_dtype=ldtype,
        series_folder=slices[0].path.parent,
        series_uid=uid,
        series_description=slices[0].description,
        label_source=label,
    )
