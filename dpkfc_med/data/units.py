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

Random transforms of a unit draw from :func:`unit_random_state`, a stream of that unit's own
(run seed, unit id, how often this unit was drawn before), never from a stream shared by all
units: with a shared stream a unit's random crops would depend on how many other units the
secret Poisson sampler drew before it, so its clipped gradient would depend on their
membership. The engine's look at the data's structure before the first step
(:meth:`UnitDraws.looking`, a dataset's ``peek``) draws from a stream no training draw uses and
counts nothing, so it never shifts a unit's draws either.
"""

from __future__ import annotations

import csv
import hashlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset, get_worker_info

from dpkfc_med.data.errors import DataValidationError

__all__ = [
    "LOOK_DRAW",
    "UnitCollate",
    "UnitDraws",
    "UnitImageDataset",
    "as_unit_id_strings",
    "group_by_unit",
    "read_unit_ids_csv",
    "reseed_for_unit",
    "same_grouping",
    "unit_id_array_problems",
    "unit_random_state",
]

_SHOW = 10  # rows listed per kind of problem before "... and n more"


def _listed(items: Sequence[Any]) -> str:
    shown = ", ".join(str(v) for v in items[:_SHOW])
    return shown + (f", ... and {len(items) - _SHOW} more" if len(items) > _SHOW else "")


def unit_random_state(seed: int | None, unit_id: str, draw: int) -> np.random.RandomState:
    """The random state of one draw of one unit, independent of every other unit.

    The state is a function of ``(seed, unit_id, draw)`` only (a BLAKE2b hash of the three,
    expanded by ``numpy.random.SeedSequence`` into an MT19937 state), so what a unit's random
    transforms draw does not depend on which other units were drawn before it. In a
    ``DataLoader`` worker the worker's seed (the loader's per-epoch base seed plus the worker
    id, itself independent of the data) is hashed in as well, because each worker process
    counts draws of its own copy of the dataset; PyTorch hands batch ``t`` to worker
    ``t mod W``, so which worker counts a draw depends on the step, not on other units.
    ``seed=None`` draws the state from OS entropy (independent, not reproducible).

    Args:
        seed: The run seed, or ``None`` for OS entropy.
        unit_id: The unit (case or patient) id.
        draw: How many times this unit was drawn before (in this process).

    Returns:
        A fresh ``numpy.random.RandomState`` (the type MONAI's ``set_random_state`` takes).

    Examples:
        >>> a = unit_random_state(0, "case_7", 2).randint(1 << 30)
        >>> a == unit_random_state(0, "case_7", 2).randint(1 << 30)
        True
        >>> a == unit_random_state(0, "case_7", 3).randint(1 << 30)
        False
    """
    if seed is None:
        return np.random.RandomState(np.random.MT19937(np.random.SeedSequence()))
    worker = get_worker_info()
    key = f"{int(seed)}\x00{unit_id}\x00{int(draw)}\x00{'' if worker is None else worker.seed}"
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=32, person=b"dpkfc-unit-rng").digest()
    entropy = int.from_bytes(digest, "little")
    return np.random.RandomState(np.random.MT19937(np.random.SeedSequence(entropy)))


def reseed_for_unit(transform: Any, seed: int | None, unit_id: str, draw: int) -> None:
    """Give ``transform`` the random state of one draw of one unit (:func:`unit_random_state`).

    Transforms that own a seedable random state (MONAI ``Randomizable`` and ``Compose``: a
    ``set_random_state(seed=None, state=None)`` method) are reseeded; others are left alone and
    must be deterministic (a transform drawing from a global generator would share that
    generator between units).
    """
    if transform is not None and hasattr(transform, "set_random_state"):
        transform.set_random_state(state=unit_random_state(seed, unit_id, draw))


LOOK_DRAW = -1
"""The draw number of a look at the data's structure: no training draw (0, 1, ...) uses it."""


class UnitDraws:
    """How often each unit was drawn in this process; reseeds a transform for a unit's draw.

    Draw ``k`` of unit ``u`` gets :func:`unit_random_state` ``(seed, u, k)``. Inside
    :meth:`looking` a draw gets the look stream (:data:`LOOK_DRAW`) and counts nothing, so the
    engine's first look at an item's structure leaves every unit's crops as they would be
    without it.

    Args:
        seed: The run seed, or ``None`` for OS entropy.
    """

    def __init__(self, seed: int | None) -> None:
        self.seed = seed
        self.counts: dict[str, int] = {}
        self._looks = 0

    def reseed(self, transform: Any, unit_id: str) -> None:
        """Reseed ``transform`` for the next draw of ``unit_id`` (a look draws apart)."""
        if self._looks:
            reseed_for_unit(transform, self.seed, unit_id, LOOK_DRAW)
            return
        draw = self.counts.get(unit_id, 0)
        self.counts[unit_id] = draw + 1
        reseed_for_unit(transform, self.seed, unit_id, draw)

    @contextmanager
    def looking(self) -> Iterator[None]:
        """Within this block, draws are looks: the look stream, no count."""
        self._looks += 1
        try:
            yield
        finally:
            self._looks -= 1


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
        transform: Optional per-image callable (e.g. resizing). A random one must own its
            random state (``set_random_state``, as MONAI transforms do): it is reseeded for
            each draw of a unit from (``seed``, unit id, the unit's draw count), see
            :func:`reseed_for_unit`.
        seed: Run seed of the per-unit random streams; ``None`` uses OS entropy.
    """

    def __init__(
        self,
        images: Tensor,
        labels: Tensor,
        groups: Sequence[np.ndarray],
        names: Sequence[str],
        transform: Callable[[Tensor], Tensor] | None = None,
        seed: int | None = None,
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
        self.seed = seed
        self.draws = UnitDraws(seed)

    def __len__(self) -> int:
        return len(self.groups)

    @property
    def max_images_per_unit(self) -> int:
        """The largest number of images of one unit (0 for an empty dataset)."""
        return max((len(g) for g in self.groups), default=0)

    def peek(self, unit: int) -> dict[str, Any]:
        """Item ``unit`` drawn from the look stream, counting no draw (its structure only)."""
        with self.draws.looking():
            return self[unit]

    def __getitem__(self, unit: int) -> dict[str, Any]:
        index = self.groups[unit]
        image = self.images[index]
        if self.transform is not None:
            self.draws.reseed(self.transform, self.names[unit])
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
