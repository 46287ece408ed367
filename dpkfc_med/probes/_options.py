"""String-enum option parsing with did-you-mean errors, shared by the probe modules."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from enum import Enum
from typing import TypeVar

E = TypeVar("E", bound=Enum)


def did_you_mean(value: str, allowed: Iterable[str]) -> str:
    """Return ``"; did you mean 'x'?"`` for the closest allowed name, or ``""`` if none is close."""
    matches = difflib.get_close_matches(value, list(allowed), n=1, cutoff=0.5)
    return f"; did you mean {matches[0]!r}?" if matches else ""


def parse_option(enum_cls: type[E], value: E | str, field: str) -> E:
    """Convert ``value`` (an enum member or a plain string, any case) to a member of ``enum_cls``.

    Args:
        enum_cls: A ``str``-valued :class:`~enum.Enum`.
        value: A member of ``enum_cls`` or its string value.
        field: Name of the option, used in the error message.

    Returns:
        The matching enum member.

    Raises:
        ValueError: If ``value`` is not an allowed value; the message names ``field``, lists the
            allowed values and suggests the closest one.
    """
    if isinstance(value, enum_cls):
        return value
    allowed = [str(member.value) for member in enum_cls]
    if isinstance(value, str):
        key = value.strip().lower()
        for member in enum_cls:
            if member.value == key:
                return member
        hint = did_you_mean(key, allowed)
    else:
        hint = ""
    raise ValueError(f"{field}={value!r} is not one of {allowed}{hint}")
