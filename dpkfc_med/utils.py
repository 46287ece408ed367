"""Small shared helpers: option validation with did-you-mean errors."""

from __future__ import annotations

import difflib
from enum import Enum
from typing import TypeVar

E = TypeVar("E", bound=Enum)

__all__ = ["check_choice", "did_you_mean"]


def did_you_mean(value: str, allowed: list[str]) -> str:
    """`` (did you mean 'x'?)`` when a close match exists, else an empty string."""
    close = difflib.get_close_matches(str(value).lower(), allowed, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_choice(field: str, value: object, enum: type[E]) -> E:
    """Coerce ``value`` (an enum member or its plain string) to ``enum``.

    Raises:
        ValueError: naming ``field``, the allowed values and the closest match.
    """
    if isinstance(value, enum):
        return value
    allowed = [str(m.value) for m in enum]
    if isinstance(value, str):
        normalized = value.strip().lower().replace("-", "_")
        for m in enum:
            if str(m.value).lower().replace("-", "_") == normalized:
                return m
    raise ValueError(
        f"{field}={value!r} is not allowed{did_you_mean(str(value), allowed)}; "
        f"choose one of {allowed}"
    )
