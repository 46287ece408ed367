"""Train / validation / test splits of case IDs, and their JSON record in a run.

The split (:func:`deterministic_split`) assigns each case by a keyed hash of its own ID, so
adding or removing a case of the folder changes the split of that case only. A user's own split
(:func:`read_split_file`: ``{"train": [...], "val": [...], "test": [...]}`` or nnU-Net's
``splits_final.json``) names the cases of each split instead; where the hash leaves a split of a
small folder empty, :func:`fractions_that_fill` finds fractions that fill every split.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from dpkfc_med.data.errors import DataValidationError
from dpkfc_med.utils import did_you_mean

__all__ = [
    "SPLIT_NAMES",
    "deterministic_split",
    "fractions_that_fill",
    "load_split",
    "read_split_file",
    "save_split",
]

SPLIT_NAMES = ("train", "val", "test")
"""The splits of a segmentation run, in order."""


def _split_uniform(case_id: str, seed: int) -> float:
    """A uniform number in ``[0, 1)`` from a BLAKE2b hash of ``case_id`` keyed by ``seed``."""
    key = int(seed).to_bytes(16, "little", signed=True)
    digest = hashlib.blake2b(
        case_id.encode("utf-8"), digest_size=8, key=key, person=b"dpkfc-split"
    ).digest()
    return (int.from_bytes(digest, "little") >> 11) / float(1 << 53)  # 53 bits: exact float


def deterministic_split(
    case_ids: Sequence[str],
    fractions: Sequence[float] = (0.7, 0.15, 0.15),
    seed: int = 0,
    names: Sequence[str] = ("train", "val", "test"),
    *,
    allow_empty: bool = False,
) -> dict[str, list[str]]:
    """Split case IDs reproducibly, each case by a keyed hash of its own ID.

    Case ``c`` gets ``u = blake2b(c, key=seed)`` read as a uniform number in ``[0, 1)`` and
    joins the first split ``i`` with ``u < f_1 + ... + f_i``. Its split is a function of its
    own ID and the seed only: adding a case to the folder or removing one changes the split of
    that case and of no other (a permutation of all IDs cut by fractions would move many), and
    the file-system listing order plays no part. Counts are therefore random, binomial around
    ``f * n`` (for 220 cases and ``f = 0.15``: 33 +- 5.3), not ``floor(f * n)``. Write the
    result into the run directory (:func:`save_split`) so evaluation uses the same cases.

    Privacy guarantee:
        The split is stable in the neighbouring relation of the folder: adding or removing one
        case changes at most that case's membership in the training split, so a guarantee about
        the training split's units is one about the folder's cases.

    Args:
        case_ids: Unique case IDs.
        fractions: One non-negative fraction per split, summing to 1.
        seed: Key of the hash (any integer in ``[-2**127, 2**127)``).
        names: Split names, as many as ``fractions``.
        allow_empty: Return a split with a positive fraction that drew no case instead of
            raising (a caller that reports other problems of the folder first).

    Returns:
        ``{name: sorted case IDs}`` in the order of ``names``.

    Raises:
        ValueError: Duplicate IDs, fractions that are negative or do not sum to 1, a
            ``names`` / ``fractions`` length mismatch, or (unless ``allow_empty``) a split with
            a positive fraction that drew no case (a folder too small for its fractions).

    Examples:
        >>> deterministic_split([f"c{i}" for i in range(10)], seed=1)["val"]
        ['c4', 'c6']
        >>> deterministic_split([f"c{i}" for i in range(11)], seed=1)["val"]  # c10 added
        ['c4', 'c6']
    """
    ids = sorted(case_ids)
    problems = []
    if len(set(ids)) != len(ids):
        dup = sorted({c for c in ids if ids.count(c) > 1})
        problems.append(f"duplicate case IDs {dup}")
    if len(fractions) != len(names):
        problems.append(f"{len(fractions)} fractions for {len(names)} names {list(names)}")
    if any(f < 0 for f in fractions) or not np.isclose(sum(fractions), 1.0):
        problems.append(f"fractions {list(fractions)} must be >= 0 and sum to 1")
    if problems:
        raise ValueError("deterministic_split: " + "; ".join(problems))

    bounds = np.cumsum(np.asarray(fractions, dtype=np.float64))
    bounds /= bounds[-1]  # exactly 1.0 at the end: rounding of the sum leaves no case out
    out: dict[str, list[str]] = {name: [] for name in names}
    for cid in ids:
        u = _split_uniform(cid, seed)
        # first split whose upper bound exceeds u (zero-fraction splits have an empty range)
        out[names[int(np.searchsorted(bounds, u, side="right"))]].append(cid)
    empty = [
        f"split {name!r} (fraction {f:g}) drew none of the {len(ids)} cases"
        for name, f in zip(names, fractions)
        if f > 0 and not out[name]
    ]
    if empty and not allow_empty:
        raise ValueError(
            "deterministic_split: "
            + "; ".join(empty)
            + " (each case joins a split with probability equal to its fraction, by a hash of "
            "its ID); "
            + _fill_hint(ids, fractions, seed)
            + "; or add cases, or set a fraction to 0 if its split is not needed"
        )
    return out


def _counts(us: np.ndarray, fractions: Sequence[float]) -> np.ndarray:
    """Cases per split of the hash values ``us`` under ``fractions``, as the split counts."""
    bounds = np.cumsum(np.asarray(fractions, dtype=np.float64))
    bounds /= bounds[-1]
    idx = np.searchsorted(bounds, us, side="right")
    return np.bincount(idx, minlength=len(fractions))


def fractions_that_fill(
    case_ids: Sequence[str],
    fractions: Sequence[float],
    seed: int = 0,
    *,
    limit: int = 3,
) -> list[list[float]]:
    """Fractions close to ``fractions`` that give every split with a positive fraction a case.

    Searches fractions on a grid of 0.05 (then 0.01), keeping the zero fractions at zero, and
    returns those nearest to ``fractions`` (sum of absolute differences) whose keyed-hash split
    of ``case_ids`` under ``seed`` leaves no such split empty.

    The result depends on the private case IDs: it is for the data's custodian (an error on the
    command line), never for a shareable file.

    Args:
        case_ids: The folder's case IDs.
        fractions: The requested fractions (non-negative, one per split).
        seed: Key of the hash (``training.seed``).
        limit: Most suggestions returned.

    Returns:
        Up to ``limit`` fraction lists (rounded to the grid), nearest first; empty when there
        are fewer cases than positive fractions or no grid point fills every split.

    Examples:
        >>> ids = ["a", "b", "c"]
        >>> all(min(deterministic_split(ids, f, 0).values(), key=len) for f in
        ...     fractions_that_fill(ids, [0.7, 0.15, 0.15]))
        True
    """
    want = [float(f) for f in fractions]
    live = [i for i, f in enumerate(want) if f > 0]
    if not live or len(set(case_ids)) < len(live):
        return []
    us = np.asarray([_split_uniform(c, seed) for c in sorted(set(case_ids))])
    for steps in (20, 100):
        found: list[tuple[float, list[float]]] = []
        for parts in _compositions(steps, len(live)):
            cand = [0.0] * len(want)
            for i, k in zip(live, parts):
                cand[i] = round(k / steps, 2)
            if all(_counts(us, cand)[i] > 0 for i in live):
                found.append((sum(abs(a - b) for a, b in zip(cand, want)), cand))
        if found:
            found.sort(key=lambda t: t[0])
            return [cand for _, cand in found[:limit]]
    return []


def _compositions(total: int, parts: int) -> list[tuple[int, ...]]:
    """Every way to write ``total`` as an ordered sum of ``parts`` positive integers."""
    if parts == 1:
        return [(total,)]
    return [
        (first, *rest)
        for first in range(1, total - parts + 2)
        for rest in _compositions(total - first, parts - 1)
    ]


def _fill_hint(ids: Sequence[str], fractions: Sequence[float], seed: int) -> str:
    live = sum(1 for f in fractions if f > 0)
    if len(ids) < live:
        return f"{len(ids)} case(s) cannot fill {live} splits"
    found = fractions_that_fill(ids, fractions, seed)
    if not found:
        return "no fractions on a 0.01 grid fill every split for these case IDs and this seed"
    shown = " or ".join(str(f) for f in found)
    return f"fractions that fill every split for these {len(ids)} case IDs and seed {seed}: {shown}"


def save_split(split: Mapping[str, Sequence[str]], path: str | Path) -> Path:
    """Write a split as JSON (``{name: [case IDs]}``) so a run records which cases it used."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps({k: list(v) for k, v in split.items()}, indent=1) + "\n", encoding="utf-8"
    )
    return path


def load_split(path: str | Path) -> dict[str, list[str]]:
    """Read a split written by :func:`save_split`."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, dict) or not all(isinstance(v, list) for v in data.values()):
        raise DataValidationError(path, ["expected a JSON object {split: [case IDs]}"])
    return {str(k): [str(c) for c in v] for k, v in data.items()}


def read_split_file(
    path: str | Path, case_ids: Sequence[str], *, fold: int = 0
) -> tuple[dict[str, list[str]], list[str]]:
    """Read a user's split of the case IDs from JSON and check it against the folder.

    Two formats:

    * ``{"train": [...], "val": [...], "test": [...]}``: the case IDs of each split (``val``
      and ``test`` may be absent or empty); a run's own ``split.json`` has this form.
    * nnU-Net's ``splits_final.json``, a list of folds ``[{"train": [...], "val": [...]},
      ...]``: fold ``fold`` is used; its test split is empty unless the fold also has a
      ``"test"`` list.

    Every case may be listed once, in one split, and must be a case of the folder. Cases of the
    folder that the file does not list are left out of the run (returned, for the record).

    Privacy guarantee:
        The file is a fixed input of the run's config, not derived from the data: the
        guarantee holds with respect to the training split it names (adding or removing one
        case of that split). Unlike :func:`deterministic_split`, it says nothing about cases
        added to the folder later, which the file does not list.

    Args:
        path: The JSON file (``data.split_file``).
        case_ids: The folder's case IDs.
        fold: The nnU-Net fold to use (``data.split_fold``).

    Returns:
        ``({"train": [...], "val": [...], "test": [...]}`` with sorted IDs, the sorted IDs of
        the folder that the file leaves out``)``.

    Raises:
        DataValidationError: naming ``path``: not JSON, another layout, a fold out of range, a
            case listed twice, a case not in the folder, or no training case.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DataValidationError(path, [f"data.split_file: not readable JSON ({err})"]) from None
    layouts = (
        'expected {"train": [case ids], "val": [...], "test": [...]} or nnU-Net\'s '
        'splits_final.json [{"train": [...], "val": [...]}, ...]'
    )
    where = "data.split_file"
    if isinstance(data, list):
        if not data or not all(isinstance(f, dict) for f in data):
            raise DataValidationError(path, [f"{where}: a list, but not of folds; {layouts}"])
        if isinstance(fold, bool) or not 0 <= fold < len(data):
            raise DataValidationError(
                path,
                [
                    f"data.split_fold={fold!r}: the file has {len(data)} fold(s); choose one "
                    f"of 0..{len(data) - 1}"
                ],
            )
        data, where = data[fold], f"data.split_file fold {fold}"
    if not isinstance(data, dict):
        raise DataValidationError(path, [f"{where}: a JSON {type(data).__name__}; {layouts}"])
    problems = [
        f"{where}: unknown split {key!r}{did_you_mean(str(key), SPLIT_NAMES)}; the splits are "
        f"{list(SPLIT_NAMES)}"
        for key in data
        if key not in SPLIT_NAMES
    ]
    split: dict[str, list[str]] = {}
    for name in SPLIT_NAMES:
        ids = data.get(name, [])
        if not isinstance(ids, list) or not all(isinstance(c, str) for c in ids):
            problems.append(f"{where}: {name!r} must be a list of case ids (strings)")
            ids = []
        split[name] = sorted(ids)
    if not split["train"] and not problems:
        problems.append(f"{where}: no case in 'train'; list the training cases")
    seen: dict[str, list[str]] = {}
    for name, ids in split.items():
        for cid in ids:
            seen.setdefault(cid, []).append(name)
    problems += [
        f"{where}: case {cid} is listed {len(names)} times ({', '.join(names)}); list each case "
        "once, in one split"
        for cid, names in sorted(seen.items())
        if len(names) > 1
    ]
    known = set(case_ids)
    unknown = sorted(c for c in seen if c not in known)
    if unknown:
        shown = ", ".join(f"{c}{did_you_mean(c, sorted(known))}" for c in unknown[:10])
        more = f" ... ({len(unknown)} in all)" if len(unknown) > 10 else ""
        problems.append(
            f"{where}: case(s) not in the data folder: {shown}{more}; list only the folder's "
            "case ids (the image file names without .nii.gz, or the case folder names)"
        )
    if problems:
        raise DataValidationError(path, problems)
    return split, sorted(known - set(seen))
