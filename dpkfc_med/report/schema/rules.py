"""Field rules of the report schemas: small checks that collect every problem of a document.

A rule is a :data:`Check`, ``check(value, dotted_path, problems)``, that appends one
``"<dotted.field>: <what is wrong>"`` line per problem; the combinators (:func:`fields`,
:func:`nullable`, :func:`list_of`, :func:`mapping_of`) build the privacy report's and the
custodian report's schemas out of the leaf rules.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

from dpkfc_med.utils import did_you_mean

__all__ = [
    "Check",
    "boolean",
    "curve_value",
    "describe",
    "fields",
    "integer",
    "is_int",
    "is_number",
    "join_path",
    "list_of",
    "mapping",
    "mapping_of",
    "nullable",
    "number",
    "one_of",
    "present",
    "sha256",
    "sha256_field",
    "string",
    "timestamp",
]

_HEX64 = re.compile(r"[0-9a-fA-F]{64}")

Check = Callable[[Any, str, list[str]], None]
"""``check(value, dotted_path, problems)`` appends one line per problem to ``problems``."""


def join_path(path: str, key: str) -> str:
    """The dotted path of ``key`` below ``path`` (``key`` alone at the top)."""
    return f"{path}.{key}" if path else key


def describe(value: Any) -> str:
    """``value`` as a problem line quotes it: ``null``, or its repr cut to 60 characters."""
    if value is None:
        return "null"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def is_number(value: Any) -> bool:
    """Whether ``value`` is an int or a float (``True`` and ``False`` are not numbers)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_int(value: Any) -> bool:
    """Whether ``value`` is an int (``True`` and ``False`` are not integers)."""
    return isinstance(value, int) and not isinstance(value, bool)


def fields(spec: dict[str, Check]) -> Check:
    """A mapping that must hold every key of ``spec``, each checked by its own check."""

    def check(value: Any, path: str, problems: list[str]) -> None:
        if not isinstance(value, Mapping):
            problems.append(f"{path or '<report>'}: must be a mapping, got {describe(value)}")
            return
        for key, sub in spec.items():
            if key not in value:
                problems.append(f"{join_path(path, key)}: missing")
            else:
                sub(value[key], join_path(path, key), problems)

    return check


def nullable(inner: Check) -> Check:
    """``None``, or a value that passes ``inner``."""

    def check(value: Any, path: str, problems: list[str]) -> None:
        if value is not None:
            inner(value, path, problems)

    return check


def string(value: Any, path: str, problems: list[str]) -> None:
    """A non-empty string."""
    if not isinstance(value, str) or not value.strip():
        problems.append(f"{path}: must be a non-empty string, got {describe(value)}")


def boolean(value: Any, path: str, problems: list[str]) -> None:
    """``True`` or ``False``."""
    if not isinstance(value, bool):
        problems.append(f"{path}: must be true or false, got {describe(value)}")


def mapping(value: Any, path: str, problems: list[str]) -> None:
    """Any mapping."""
    if not isinstance(value, Mapping):
        problems.append(f"{path}: must be a mapping, got {describe(value)}")


def one_of(*choices: Any) -> Check:
    """One of ``choices`` (never a bool); a misspelt string gets a did-you-mean hint."""

    def check(value: Any, path: str, problems: list[str]) -> None:
        if value not in choices or isinstance(value, bool):
            hint = did_you_mean(value, [str(c) for c in choices]) if isinstance(value, str) else ""
            allowed = ", ".join(repr(c) for c in choices)
            problems.append(f"{path}: must be one of {allowed}, got {describe(value)}{hint}")

    return check


def integer(minimum: int | None = None) -> Check:
    """An integer, at least ``minimum`` when one is given."""

    def check(value: Any, path: str, problems: list[str]) -> None:
        if not is_int(value) or (minimum is not None and value < minimum):
            bound = f" >= {minimum}" if minimum is not None else ""
            problems.append(f"{path}: must be an integer{bound}, got {describe(value)}")

    return check


def number(
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
    context: str = "",
) -> Check:
    """A finite number in an interval; the message states the interval in math notation."""
    if low is not None and high is not None:
        rng = f" in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    elif low is not None:
        rng = f" {'>' if low_open else '>='} {low:g}"
    else:
        rng = ""

    def check(value: Any, path: str, problems: list[str]) -> None:
        ok = is_number(value) and math.isfinite(value)
        if ok and low is not None:
            ok = value > low if low_open else value >= low
        if ok and high is not None:
            ok = value < high if high_open else value <= high
        if not ok:
            problems.append(f"{path}: must be a number{rng}{context}, got {describe(value)}")

    return check


def list_of(item: Check, what: str = "a list") -> Check:
    """A list (or tuple) whose every entry passes ``item``; ``what`` names the expected type."""

    def check(value: Any, path: str, problems: list[str]) -> None:
        if not isinstance(value, (list, tuple)):
            problems.append(f"{path}: must be {what}, got {describe(value)}")
            return
        for i, entry in enumerate(value):
            item(entry, f"{path}[{i}]", problems)

    return check


def mapping_of(item: Check, what: str = "a mapping") -> Check:
    """A mapping whose every value passes ``item``; ``what`` names the expected type."""

    def check(value: Any, path: str, problems: list[str]) -> None:
        if not isinstance(value, Mapping):
            problems.append(f"{path}: must be {what}, got {describe(value)}")
            return
        for key, entry in value.items():
            item(entry, join_path(path, str(key)), problems)

    return check


def curve_value(value: Any, path: str, problems: list[str]) -> None:
    """A number, or ``None`` for a point of a curve."""
    # null stands for a non-finite value (a diverged loss); see to_json_data(finite=True).
    if value is not None and not is_number(value):
        problems.append(f"{path}: must be a number or null, got {describe(value)}")


def sha256(value: Any, path: str, problems: list[str]) -> None:
    """A 64-character hex SHA-256 digest."""
    if not isinstance(value, str) or not _HEX64.fullmatch(value):
        problems.append(f"{path}: must be a 64-character hex SHA-256 digest, got {describe(value)}")


def sha256_field(value: Any, path: str, problems: list[str]) -> None:
    """One digest, or a ``file -> digest`` mapping (a folder of external data)."""
    if isinstance(value, Mapping):
        mapping_of(sha256)(value, path, problems)
    else:
        sha256(value, path, problems)


def timestamp(value: Any, path: str, problems: list[str]) -> None:
    """An ISO-8601 date or date-time (a trailing ``Z`` reads as UTC)."""
    try:
        # Python < 3.11 does not read a trailing "Z"; it means UTC.
        datetime.fromisoformat(value[:-1] + "+00:00" if value.endswith("Z") else value)
    except (TypeError, ValueError, AttributeError):
        problems.append(
            f"{path}: must be an ISO-8601 date or date-time such as '2024-05-01', "
            f"got {describe(value)}"
        )


def present(value: Any, path: str, problems: list[str]) -> None:
    """Any value: the key only has to be there (display-only columns)."""
