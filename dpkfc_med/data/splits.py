"""Train / validation / test splits of case IDs, and their JSON record in a run.

The split (:func:`deterministic_split`) assigns each case by a keyed hash of its own ID, so
adding or removing a case of the folder changes the split of that case only.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from dpkfc_med.data.errors import DataValidationError

__all__ = ["deterministic_split", "load_split", "save_split"]


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
            "its ID); add cases, raise the fraction, or set it to 0 if the split is not needed"
        )
    return out


def save_split(split: Mapping[str, Sequence[str]], path: str | Path) -> Path:
    """Write a split as JSON (``{name: [case IDs]}``) so a run records which cases it used."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({k: list(v) for k, v in split.items()}, indent=1) + "\n")
    return path


def load_split(path: str | Path) -> dict[str, list[str]]:
    """Read a split written by :func:`save_split`."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or not all(isinstance(v, list) for v in data.values()):
        raise DataValidationError(path, ["expected a JSON object {split: [case IDs]}"])
    return {str(k): [str(c) for c in v] for k, v in data.items()}
