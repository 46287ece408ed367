"""Predicted label maps of an evaluation, as NIfTI and (for DICOM inputs) DICOM-SEG.

Used by ``dpkfc-med evaluate`` of run configs (:mod:`.evaluate`) and of bundle runs
(:func:`dpkfc_med.bundle.zoo.evaluate_bundle_run`, through :class:`CaseCollector` on the
bundle's own evaluator). Everything written here is computed from private data without noise:
it goes under the run's ``private_not_for_release/evaluations/`` only.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

import dpkfc_med
from dpkfc_med.data import DataValidationError
from dpkfc_med.tasks.segmentation.metrics import save_label_map

__all__ = ["CaseCollector", "save_prediction", "write_dicom_seg"]

log = logging.getLogger("dpkfc_med")


def save_prediction(
    label_map: Any,
    path: Path,
    case: Any | None,
    names: Sequence[str],
    problems: list[str] | None = None,
) -> list[Path]:
    """Save a predicted label map ``[1, *S]`` (a ``MetaTensor`` on the input's grid).

    Always ``path.nii.gz`` (the input's affine); for a case read from a DICOM series
    (:class:`~dpkfc_med.data.dicom.convert.DicomSegmentationCase`) also ``path_seg.dcm``, a
    DICOM-SEG on the series' own slices (:func:`write_dicom_seg`). A DICOM-SEG that cannot be
    written (no ``highdicom``, a series without the tags it must reference) is skipped with a
    sentence appended to ``problems`` (and logged); the NIfTI file is written all the same.

    Returns:
        The written files.
    """
    written = [save_label_map(label_map, path)]
    if case is not None and getattr(case, "series_folder", None) is not None:
        seg = path.with_name(f"{path.name}_seg.dcm")
        try:
            write_dicom_seg(label_map, case, names, seg)
        except (ImportError, DataValidationError) as err:
            text = str(err).strip()
            log.warning("DICOM-SEG not written: %s", text)
            if problems is not None:
                problems.append(text)
        else:
            written.append(seg)
    return written


def write_dicom_seg(label_map: Any, case: Any, names: Sequence[str], path: Path) -> None:
    """A DICOM-SEG (``highdicom``) of ``label_map`` on the slices of the case's series.

    The label map lies on the series' NIfTI conversion (voxel axes: columns, rows, slices
    sorted along the slice normal, as :func:`~dpkfc_med.data.dicom.convert.convert_case` reads
    them); each foreground class is one segment, numbered by its class id and labelled by
    ``names``.

    Raises:
        ImportError: ``highdicom`` is not installed (``pip install 'dpkfc-med[dicom]'``).
        DataValidationError: The series no longer matches the label map (files changed), or
            its slices lack the ``FrameOfReferenceUID`` a DICOM-SEG must reference.
    """
    try:
        import highdicom as hd
    except ImportError as err:
        raise ImportError(
            f"{path.name}: a DICOM-SEG of a DICOM input needs highdicom; pip install "
            "'dpkfc-med[dicom]' (or pip install highdicom), or evaluate without "
            "--save-predictions"
        ) from err
    import pydicom
    from pydicom.sr.codedict import codes

    from dpkfc_med.data.dicom.scan import check_series, scan_case

    scan = scan_case(case.series_folder, case.case_id)
    slices, problems = check_series(
        case.case_id, case.series_uid, scan.series.get(case.series_uid, [])
    )
    frames = np.asarray(label_map[0]).transpose(2, 1, 0)  # [slices, rows, columns]
    if not problems and (len(slices), *slices[0].size) != frames.shape:
        problems = [
            f"case {case.case_id}: series {case.series_uid} has {len(slices)} slices of "
            f"{slices[0].size} (rows, columns), the prediction {frames.shape}; evaluate again "
            "(the series changed since it was read)"
        ]
    sources = [] if problems else [pydicom.dcmread(str(s.path)) for s in slices]
    lacking = [s.path.name for s, ds in zip(slices, sources) if not ds.get("FrameOfReferenceUID")]
    if lacking:
        problems = [
            f"case {case.case_id}: {len(lacking)} of the {len(slices)} slices of series "
            f"{case.series_uid} (e.g. {lacking[0]}) have no FrameOfReferenceUID, which a "
            "DICOM-SEG must reference; re-export the series with its Frame of Reference "
            "module (the NIfTI label map is written)"
        ]
    if problems:
        raise DataValidationError(case.series_folder, problems)
    algorithm = hd.AlgorithmIdentificationSequence(
        name="dpkfc-med", version=dpkfc_med.__version__, family=codes.DCM.ArtificialIntelligence
    )
    segments = [
        hd.seg.SegmentDescription(
            segment_number=number,
            segment_label=str(name),
            segmented_property_category=codes.SCT.Tissue,
            segmented_property_type=codes.SCT.Tissue,
            algorithm_type=hd.seg.SegmentAlgorithmTypeValues.AUTOMATIC,
            algorithm_identification=algorithm,
        )
        for number, name in enumerate(names, start=1)
    ]
    seg = hd.seg.Segmentation(
        source_images=sources,
        pixel_array=frames.astype(np.uint8 if len(names) < 256 else np.uint16),
        segmentation_type=hd.seg.SegmentationTypeValues.BINARY,
        segment_descriptions=segments,
        series_instance_uid=hd.UID(),
        series_number=9901,
        sop_instance_uid=hd.UID(),
        instance_number=1,
        manufacturer="dpkfc-med",
        manufacturer_model_name="dpkfc-med evaluate",
        software_versions=dpkfc_med.__version__,
        device_serial_number="none",
        series_description="dpkfc-med prediction (custodian only, not for release)",
        omit_empty_frames=False,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    seg.save_as(str(path))


class CaseCollector:
    """Ignite handler on a bundle's evaluator: each item's input and, optionally, its label map.

    At every iteration it records each evaluated item's input file (the ``filename`` column
    of MONAI's ``MetricsSaver``) and, with ``pred_dir``, saves the item's prediction as a
    label map (argmax over channels) on the input's grid: taken back through the evaluator
    dataset's transform (MONAI ``Invertd``) and written by :func:`save_prediction`.

    Args:
        pred_dir: Where label maps go (``None``: none saved).
        transform: The evaluator dataset's transform (what ``Invertd`` undoes).
        cases: Case id -> case of the evaluated folder (a DICOM series case also gets a
            DICOM-SEG), or ``None``.
        names: Foreground class names (DICOM-SEG segment labels).
    """

    def __init__(
        self,
        pred_dir: Path | None,
        transform: Any,
        cases: Any = None,
        names: Sequence[str] = (),
    ) -> None:
        self.pred_dir, self.transform, self.cases, self.names = pred_dir, transform, cases, names
        self.filenames: list[str] = []
        self.saved: list[Path] = []
        self.problems: list[str] = []
        """Why a DICOM-SEG was not written (:func:`save_prediction`)."""

    def attach(self, engine: Any) -> None:
        """Collect at each iteration of ``engine`` (from its first epoch on)."""
        from monai.utils import min_version, optional_import

        events, _ = optional_import("ignite.engine", "0.4.11", min_version, "Events")
        engine.add_event_handler(events.EPOCH_STARTED, self._reset)
        engine.add_event_handler(events.ITERATION_COMPLETED, self)

    def _reset(self, _engine: Any) -> None:
        self.filenames, self.saved, self.problems = [], [], []

    def __call__(self, engine: Any) -> None:
        """Record (and save) the items of the evaluator's last iteration."""
        from monai.data import decollate_batch

        batch, output = engine.state.batch, engine.state.output
        batch = decollate_batch(batch) if isinstance(batch, dict) else batch
        output = decollate_batch(output) if isinstance(output, dict) else output
        for item, out in zip(batch, output):
            image = item.get("image")
            meta = getattr(image, "meta", {}) or {}
            name = str(meta.get("filename_or_obj", len(self.filenames)))
            self.filenames.append(name)
            if self.pred_dir is not None:
                self._save(item, out, name)

    def _save(self, item: dict[str, Any], out: dict[str, Any], name: str) -> None:
        from monai.data import MetaTensor
        from monai.transforms import Invertd

        pred = torch.as_tensor(out["pred"]).detach().cpu()
        label_map = pred.argmax(0, keepdim=True) if pred.shape[0] > 1 else pred.round()
        data: dict[Any, Any] = {"image": item["image"], "pred": MetaTensor(label_map.long())}
        if self.transform is not None:
            data = dict(
                Invertd("pred", self.transform, orig_keys="image", nearest_interp=True)(data)
            )
        else:
            data["pred"].meta = dict(getattr(item["image"], "meta", {}))
        cid = str(item.get("case_id") or _stem(name))
        case = self.cases[cid] if self.cases is not None and cid in self.cases.case_ids else None
        assert self.pred_dir is not None  # called only when label maps are saved
        pred_map = data["pred"].long()
        self.saved += save_prediction(
            pred_map, self.pred_dir / cid, case, self.names, self.problems
        )


def _stem(name: str) -> str:
    """A file's name without its image suffixes (``case.nii.gz`` -> ``case``)."""
    base = Path(name).name
    for suffix in (".nii.gz", ".nii", ".png", ".jpg", ".jpeg", ".dcm"):
        if base.lower().endswith(suffix):
            return base[: -len(suffix)]
    return base
