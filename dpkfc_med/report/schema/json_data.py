"""The JSON view of a report: plain data, converted from what the pipeline hands over."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from enum import Enum
from pathlib import PurePath
from typing import Any

from dpkfc_med.report.schema.rules import join_path

__all__ = ["to_json_data"]


def to_json_data(value: Any, *, finite: bool = False) -> tuple[Any, list[str]]:
    """Plain JSON data (dicts, lists, str, numbers, bools, ``None``) equivalent to ``value``.

    The pipeline may hand over enums, paths, tuples, dataclasses (e.g. ``Fix``), NumPy scalars
    or arrays and tensors; they are converted rather than rejected so that a report never fails
    on a representation detail at the end of a long run.

    Args:
        value: The report, or any part of it.
        finite: Replace NaN and infinities by ``None`` (JSON has no such numbers; ``null`` in a
            metric or curve marks an undefined value, e.g. the AUROC of a one-class split).

    Returns:
        The converted data and one problem line per value that has no JSON form.
    """
    problems: list[str] = []
    return _convert(value, "", problems, finite), problems


def _convert(value: Any, path: str, problems: list[str], finite: bool) -> Any:
    if isinstance(value, Enum):
        value = value.value
    if value is None or isinstance(value, (bool, str, int)):
        return value
    if isinstance(value, float):
        return None if finite and not math.isfinite(value) else value
    if isinstance(value, PurePath):
        return str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if isinstance(key, Enum):
                key = key.value
            where = join_path(path, str(key))
            if not isinstance(key, (str, int, float, bool)) and key is not None:
                problems.append(f"{where}: key of type {type(key).__name__} has no JSON form")
                continue
            out[str(key)] = _convert(item, where, problems, finite)
        return out
    if isinstance(value, (list, tuple)):
        return [_convert(item, f"{path}[{i}]", problems, finite) for i, item in enumerate(value)]
    tolist = getattr(value, "tolist", None)  # NumPy scalars/arrays, torch tensors
    if callable(tolist):
        return _convert(tolist(), path, problems, finite)
    problems.append(
        f"{path or '<report>'}: value of type {type(value).__name__} is not JSON-serialisable; "
        "store a number, string, list or dict"
    )
    return None
