"""Sample layout of a segmentation run: 3D volumes, 2D images or 2D slices, and its privacy unit.

The layout is fixed by the config alone: the number of spatial axes is the length of
``data.patch_size`` (or ``data.spatial_dims``; ``data.slices.axis`` makes it 2), so the
network, the probes and the preconditioner never depend on the private headers. The headers
are only checked against it, and every case that does not fit is named with the fix.

Privacy units:
    * 3D volumes: one volume (case / patient), its ``data.patches_per_unit`` patches summed
      before clipping.
    * 2D images: one image (one case of the folder), likewise with its patches. If a patient
      has several images in the folder, the guarantee is per image, not per patient.
    * Slices of volumes: one volume (patient) with all of its slices of a draw summed before
      clipping; Poisson sampling draws volumes, so adding or removing a patient moves the
      clipped sum by at most ``C`` whatever the number of slices.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dpkfc_med.data.slices import SliceRule

__all__ = ["SegmentationLayout", "resolve_layout"]

UNIT_VOLUME = "patient/volume"
UNIT_IMAGE = "image (one case of the folder)"
UNIT_SLICES = "patient/volume (all of its slices)"


@dataclass(frozen=True)
class SegmentationLayout:
    """The sample layout of a segmentation run.

    Attributes:
        spatial_dims: Spatial axes of the network's input (2 or 3).
        slices: The slice rule when 2D samples are slices of 3-D volumes, else ``None``.
        privacy_unit: The unit in words (the report's neighbouring relation).
    """

    spatial_dims: int
    slices: SliceRule | None
    privacy_unit: str

    def case_dims(self, shape: Sequence[int]) -> int:
        """Spatial axes of a file of ``shape``; a trailing size-1 axis of a 2D run is dropped."""
        n = len(shape)
        if self.spatial_dims == 2 and self.slices is None and n == 3 and shape[-1] == 1:
            return 2
        return n

    def plane(self, shape: Sequence[Any]) -> list[Any]:
        """The axes of ``shape`` that a sample keeps (in-plane axes for slices)."""
        if self.slices is not None and len(shape) == 3:
            return [s for i, s in enumerate(shape) if i != self.slices.axis]
        return list(shape[: self.spatial_dims])

    def describe(self) -> dict[str, Any]:
        """The layout for the run's data record."""
        out: dict[str, Any] = {"spatial_dims": self.spatial_dims}
        if self.slices is not None:
            out["slices"] = {
                "axis": self.slices.axis,
                "per_unit": self.slices.per_unit,
                "pick": self.slices.pick,
                "rule": self.slices.describe(),
            }
        return out


def resolve_layout(cfg: Any, cases: Any, problems: list[str]) -> SegmentationLayout:
    """The layout of ``cfg`` for ``cases``; config problems are appended to ``problems``.

    Args:
        cfg: The run config (``data.patch_size``, ``data.spatial_dims``, ``data.slices``,
            ``data.patches_per_unit``).
        cases: The indexed folder (:class:`~dpkfc_med.data.SegmentationCases`).
        problems: Where config problems go (reported together by the caller).
    """
    d = cfg.data
    rule = d.slices
    patch = d.patch_size
    n_patch = len(patch) if isinstance(patch, list) and len(patch) in (2, 3) else None
    pictures = getattr(cases, "reader", "NibabelReader") == "PILReader"
    if d.spatial_dims not in (None, 2, 3):
        problems.append(f"data.spatial_dims={d.spatial_dims!r}: must be 2 or 3 (or null)")
    if rule.axis is not None:
        dims = 2
        if d.spatial_dims == 3:
            problems.append(
                "data.spatial_dims=3 with data.slices: slices train a 2D network; set "
                "data.spatial_dims to 2 or drop it"
            )
        if rule.axis not in (0, 1, 2):
            problems.append(
                f"data.slices.axis={rule.axis!r}: must be 0, 1 or 2 (a voxel axis of the "
                "volumes), or null for no slicing"
            )
        if d.patches_per_unit != 1:
            problems.append(
                f"data.patches_per_unit={d.patches_per_unit} with data.slices: a volume's "
                "samples are its data.slices.per_unit slices (one crop each); set "
                "patches_per_unit to 1"
            )
        if pictures:
            problems.append(
                f"data.slices: {cases.root} holds 2D PNG / JPEG images, not volumes to slice; "
                "set data.slices to null (--set data.slices=null) and give a 2-value "
                "data.patch_size"
            )
    else:
        dims = d.spatial_dims or n_patch or (2 if pictures else 3)
    if n_patch is not None and n_patch != dims:
        what = "in-plane slice size" if rule.axis is not None else f"{dims}D patch"
        problems.append(
            f"data.patch_size={patch!r}: the run is {dims}D, so it needs {dims} values "
            f"(the {what}), e.g. {[32] * dims}"
        )
    if dims == 3 and pictures:
        problems.append(
            f"data.patch_size={patch!r}: {cases.root} holds 2D PNG / JPEG images; give 2 "
            "values (and 2 for data.spacing)"
        )
    slices = None
    if rule.axis in (0, 1, 2):
        slices = SliceRule(axis=rule.axis, per_unit=rule.per_unit, pick=rule.pick)
    unit = UNIT_SLICES if slices else (UNIT_VOLUME if dims == 3 else UNIT_IMAGE)
    return SegmentationLayout(spatial_dims=int(dims), slices=slices, privacy_unit=unit)


def case_shape_problems(layout: SegmentationLayout, cases: Any) -> list[str]:
    """The cases whose image does not fit the layout, naming the files and the fix.

    Cases that misfit the same way are one line (how many, the first few files, one fix), so a
    folder of 2D images under a slicing config reads as one message, not one per case.
    """
    groups: dict[str, list[str]] = {}  # the problem and its fix -> the cases that have it
    for case in cases:
        n = layout.case_dims(case.shape)
        if layout.slices is not None and n != 3:
            why = (
                "data.slices cuts 3-D volumes: for a folder of 2D images set data.slices to "
                "null (--set data.slices=null) and give a 2-value data.patch_size"
            )
        elif layout.slices is None and n != layout.spatial_dims:
            fix = (
                "train on its slices with data.slices.axis, or on volumes with a 3-value "
                "data.patch_size"
                if n == 3
                else "give a 2-value data.patch_size (and data.spacing) for 2D segmentation"
            )
            why = f"the run is {layout.spatial_dims}D; {fix}"
        else:
            continue
        groups.setdefault(why, []).append(
            f"case {case.case_id}: image {case.image_path.name} is {n}-D {tuple(case.shape)}"
        )
    problems = []
    for why, found in groups.items():
        if len(found) == 1:
            problems.append(f"{found[0]} but {why}")
        else:
            shown = "; ".join(found[:3]) + ("; ..." if len(found) > 3 else "")
            problems.append(f"{len(found)} cases do not fit the run ({shown}): {why}")
    return problems
