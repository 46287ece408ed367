"""A nested mapping (a YAML run config) checked field by field into its typed dataclasses.

Every problem is collected (unknown fields with a close match named, wrong types, nulls where
a value is required) instead of stopping at the first; fields marked ``internal`` in their
metadata are not read from a mapping.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, get_args, get_origin, get_type_hints

from dpkfc_med.utils import did_you_mean

__all__ = ["build_dataclass", "leaf_paths"]


def _coerce(path: str, value: Any, hint: Any, problems: list[str]) -> Any:
    origin = get_origin(hint)
    args = [a for a in get_args(hint) if a is not type(None)]
    if value is None:
        if type(None) in get_args(hint):
            return None
        problems.append(f"{path}: must not be null")
        return value
    if origin is list or hint is list:
        if not isinstance(value, (list, tuple)):
            problems.append(f"{path}={value!r}: must be a list")
            return value
        inner = get_args(hint)[0] if get_args(hint) else Any
        return [_coerce(f"{path}[{i}]", v, inner, problems) for i, v in enumerate(value)]
    if origin is not None and args:  # Optional[X] / X | None
        if len(args) == 1:
            return _coerce(path, value, args[0], problems)
        return value
    if hint is bool:
        if not isinstance(value, bool):
            problems.append(f"{path}={value!r}: must be true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            problems.append(f"{path}={value!r}: must be an integer")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            problems.append(f"{path}={value!r}: must be a number")
            return value
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            problems.append(f"{path}={value!r}: must be a string")
        return value
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            problems.append(f"{path}={value!r}: must be a mapping")
        return value
    return value


def build_dataclass(cls: type, data: Any, prefix: str, problems: list[str]) -> Any:
    """``cls`` built from ``data``; each problem appended to ``problems`` as ``"<path>: ..."``.

    Unknown keys are named with a close match; a section given as null takes its defaults
    when the section allows it (``NULL_IS_DEFAULT``).
    """
    if not isinstance(data, dict):
        problems.append(f"{prefix or '<root>'}: must be a mapping, got {type(data).__name__}")
        return cls()
    hints = get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if not f.metadata.get("internal")]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            problems.append(
                f"{path}: unknown field{did_you_mean(str(key), names)}; allowed: {names}"
            )
            continue
        hint = hints[key]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            if value is None and getattr(hint, "NULL_IS_DEFAULT", False):
                kwargs[key] = hint()  # an optional section cleared: its defaults are "off"
                continue
            kwargs[key] = build_dataclass(hint, value, path, problems)
        else:
            kwargs[key] = _coerce(path, value, hint, problems)
    return cls(**kwargs)


def leaf_paths(data: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Dotted paths of every value a nested mapping sets (``training.lr``, ...).

    An empty section (``pretrain: {}``) sets nothing; a null one (``slices: null``) is a value.
    """
    out: list[str] = []
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.extend(leaf_paths(value, path + "."))
        else:
            out.append(path)
    return out
