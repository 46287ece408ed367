"""Privacy units of classification data: which training images belong to one patient.

A MedMNIST-format file holds images, not patients; when a patient contributes several images
(AdrenalMNIST3D: left and right gland), the patient must be the privacy unit. Two formats give
the patient (or study) id of every training image:

1. **A CSV file** (``data.unit_ids: PATH``), UTF-8, comma-separated, with a header row that
   names the columns ``index`` and ``unit_id`` (in any order; other columns are ignored)::

       index,unit_id
       0,patient_017
       1,patient_017
       2,patient_204

   ``index`` is the 0-based position of the image in ``train_images`` of the ``.npz`` (the
   whole file, before ``data.max_train``); ``unit_id`` is any non-empty text. Every training
   index must appear exactly once.
2. **An array in the .npz** (``train_unit_ids``; ``val_unit_ids`` / ``test_unit_ids`` are
   read too when present): shape ``(N,)`` or ``(N, 1)``, integer or string dtype (saved
   without pickle, e.g. ``np.asarray(ids, dtype=str)``), one id per image of the split.

Images with the same id form one unit; :class:`UnitImageDataset` has one item per unit, so a
Poisson sampler draws units, and :class:`UnitCollate` hands the trainer one unit index per
image, so the optimizer sums a unit's per-image gradients before clipping.
"""

from __future__ import annotations

import csv
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from dpkfc_med.data.errors import DataValidationError

__all__ = [
    "UnitCollate",
    "UnitImageDataset",
    "as_unit_id_strings",
    "group_by_unit",
    "read_unit_ids_csv",
    "same_grouping",
    "unit_id_array_problems",
]

_SHOW = 10  # rows listed per kind of problem before "... and n more"


def _listed(items: Sequence[Any]) -> str:
    shown = ", ".join(str(v) for v in items[:_SHOW])
    return shown + (f", ... and {len(items) - _SHOW} more" if len(items) > _SHOW else "")


def read_unit_ids_csv(path: str | Path, num_images: int, *, images_file: str = "") -> list[str]:
    """Read and validate a unit-id CSV (format 1 of the module docstring).

    Args:
        path: The CSV file.
        num_images: Images in the training split it describes (``N``).
        images_file: Name of the ``.npz`` whose training split the CSV maps (for messages).

    Returns:
        ``N`` unit ids, the id of training image ``i`` at position ``i``.

    Raises:
        DataValidationError: Unreadable file, missing columns, or rows that are not an index
            in ``0..N-1`` with a non-empty id, or indices missing or listed twice; every bad
            row is named (by line number) in one error.
    """
    path = Path(path)
    target = f"train_images of {images_file}" if images_file else "the training split"
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as err:
        raise DataValidationError(
            path, [f"could not be read as UTF-8 text ({err}); write it as a UTF-8 CSV"]
        ) from err
    rows = list(csv.reader(text.splitlines()))
    header = [h.strip().lower() for h in rows[0]] if rows else []
    missing = [c for c in ("index", "unit_id") if c not in header]
    if missing:
        raise DataValidationError(
            path,
            [
                f"header {rows[0] if rows else '(empty file)'} lacks the column(s) {missing}; the "
                "first row must name the columns index,unit_id (index: 0-based position in "
                f"{target}, unit_id: the patient or study id)"
            ],
        )
    i_col, u_col = header.index("index"), header.index("unit_id")
    ids: list[str | None] = [None] * num_images
    first_line: dict[int, int] = {}
    bad_index: list[str] = []
    out_of_range: list[str] = []
    empty: list[str] = []
    repeated: list[str] = []
    seen_bad: set[int] = set()  # rows with an empty id: reported as such, not as unmapped
    for line, row in enumerate(rows[1:], start=2):
        if not any(cell.strip() for cell in row):
            continue  # blank lines carry no mapping
        cells = row + [""] * (max(i_col, u_col) + 1 - len(row))
        raw_index, unit = cells[i_col].strip(), cells[u_col].strip()
        try:
            index = int(raw_index)
        except ValueError:
            bad_index.append(f"line {line} ({raw_index!r})")
            continue
        if not 0 <= index < num_images:
            out_of_range.append(f"line {line} ({index})")
            continue
        if not unit:
            empty.append(f"line {line}")
            seen_bad.add(index)
            continue
        if index in first_line:
            repeated.append(f"line {line} (index {index}, first on line {first_line[index]})")
            continue
        first_line[index] = line
        ids[index] = unit
    unmapped = [i for i, v in enumerate(ids) if v is None and i not in seen_bad]
    problems = []
    if bad_index:
        problems.append(f"index is not a whole number on {_listed(bad_index)}")
    if out_of_range:
        problems.append(
            f"index outside 0..{num_images - 1} ({target} has {num_images} images) on "
            f"{_listed(out_of_range)}"
        )
    if empty:
        problems.append(f"unit_id is empty on {_listed(empty)}; give every image its patient id")
    if repeated:
        problems.append(
            f"training index listed more than once on {_listed(repeated)}; map each image to "
            "exactly one unit"
        )
    if unmapped:
        problems.append(
            f"{len(unmapped)} of the {num_images} training indices have no row "
            f"({_listed(unmapped)}); every image of {target} must be mapped exactly once"
        )
    if problems:
        raise DataValidationError(path, problems)
    return [v for v in ids if v is not None]


def unit_id_array_problems(key: str, array: np.ndarray, num_images: int) -> list[str]:
    """Problems of a ``{split}_unit_ids`` array of an ``.npz`` (format 2); empty if valid."""
    problems = []
    if array.ndim == 2 and array.shape[1] == 1:
        array = array[:, 0]
    if array.ndim != 1:
        return [f"{key} has shape {array.shape}; expected (N,) or (N, 1): one id per image"]
    if array.dtype.kind not in "iuUS":
        return [
            f"{key} has dtype {array.dtype}; save unit ids as integers or strings "
            "(np.asarray(ids, dtype=str))"
        ]
    if len(array) != num_images:
        problems.append(
            f"{key} has {len(array)} ids but the split has {num_images} images; give one id "
            "per image"
        )
    if array.dtype.kind in "US":
        blank = np.flatnonzero(np.char.strip(array.astype(str)) == "")
        if len(blank):
            problems.append(
                f"{key} has {len(blank)} empty id(s) at positions {_listed(blank.tolist())}; "
                "give every image its patient id"
            )
    return problems


def as_unit_id_strings(array: np.ndarray) -> list[str]:
    """``{split}_unit_ids`` array -> list of stripped strings (bytes decoded as UTF-8)."""
    flat = array.reshape(len(array), -1)[:, 0] if array.ndim == 2 else array
    if flat.dtype.kind == "S":
        return [v.decode("utf-8").strip() for v in flat.tolist()]
    return [str(v).strip() for v in flat.tolist()]


def group_by_unit(unit_ids: Sequence[str]) -> tuple[list[str], list[np.ndarray]]:
    """Group image positions by unit id, units in order of first appearance.

    Args:
        unit_ids: One id per image.

    Returns:
        ``(names, groups)``: the distinct ids and, for each, the sorted ``int64`` positions
        of its images.
    """
    positions: dict[str, list[int]] = {}
    for i, uid in enumerate(unit_ids):
        positions.setdefault(uid, []).append(i)
    names = list(positions)
    return names, [np.asarray(positions[n], dtype=np.int64) for n in names]


def same_grouping(a: Sequence[str], b: Sequence[str]) -> bool:
    """Whether two id lists put the same images together (the id names may differ)."""
    if len(a) != len(b):
        return False
    return sorted(map(tuple, group_by_unit(a)[1])) == sorted(map(tuple, group_by_unit(b)[1]))


class UnitImageDataset(Dataset):
    """One item per privacy unit (patient), holding all of that unit's images.

    Item ``u`` is ``{"image": [k_u, C, *spatial] float32, "label": [k_u] int64,
    "index": [k_u] int64, "unit_id": str}`` where ``index`` are the images' rows in the
    underlying split; :class:`UnitCollate` batches items of different ``k_u``.

    Privacy guarantee:
        A sampler over this dataset includes or excludes whole units, and with the unit
        indices of :class:`UnitCollate` the optimizer clips the sum of a unit's per-image
        gradients, so the neighbouring relation is add/remove one unit (patient) whatever
        its number of images.

    Args:
        images: ``[N, C, *spatial]`` images of the split.
        labels: ``[N]`` labels.
        groups: Per unit, the positions of its images in ``images``.
        names: Per unit, its id.
        transform: Optional per-image callable (e.g. resizing).
    """

    def __init__(
        self,
        images: Tensor,
        labels: Tensor,
        groups: Sequence[np.ndarray],
        names: Sequence[str],
        transform: Callable[[Tensor], Tensor] | None = None,
    ) -> None:
        if len(groups) != len(names):
            raise ValueError(
                f"UnitImageDataset: {len(groups)} groups but {len(names)} names; pass one id "
                "per group"
            )
        self.images, self.labels = images, labels
        self.groups = [torch.as_tensor(g, dtype=torch.int64) for g in groups]
        self.names = list(names)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.groups)

    @property
    def max_images_per_unit(self) -> int:
        """The largest number of images of one unit (0 for an empty dataset)."""
        return max((len(g) for g in self.groups), default=0)

    def __getitem__(self, unit: int) -> dict[str, Any]:
        index = self.groups[unit]
        image = self.images[index]
        if self.transform is not None:
            image = torch.stack([self.transform(im) for im in image])
        return {
            "image": image,
            "label": self.labels[index],
            "index": index,
            "unit_id": self.names[unit],
        }


class UnitCollate:
    """Concatenate unit items into one batch of images with a unit index per image.

    Returns ``{"image": [M, C, *spatial], "label": [M], "index": [M], "unit": [M],
    "unit_id": [B]}`` for ``B`` units holding ``M`` images in all; ``unit`` is
    ``arange(B).repeat_interleave(k)``. An empty Poisson batch gives zero-size tensors of the
    right trailing shape, so the trainer can still take its noise-only step.

    Args:
        channels: ``C``.
        spatial_shape: Spatial shape of an image after the dataset's transform.
    """

    def __init__(self, channels: int, spatial_shape: Sequence[int]) -> None:
        self.channels = int(channels)
        self.spatial_shape = tuple(int(s) for s in spatial_shape)

    def __call__(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        """Collate ``items`` (each from :class:`UnitImageDataset`)."""
        if not items:
            return {
                "image": torch.zeros(0, self.channels, *self.spatial_shape),
                "label": torch.zeros(0, dtype=torch.int64),
                "index": torch.zeros(0, dtype=torch.int64),
                "unit": torch.zeros(0, dtype=torch.int64),
                "unit_id": [],
            }
        counts = torch.tensor([len(it["label"]) for it in items])
        return {
            "image": torch.cat([it["image"] for it in items]),
            "label": torch.cat([it["label"] for it in items]),
            "index": torch.cat([it["index"] for it in items]),
            "unit": torch.arange(len(items)).repeat_interleave(counts),
            "unit_id": [it["unit_id"] for it in items],
        }
