"""Did-you-mean lookups shared by the model registry and the fixer options."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(value: str, allowed: Iterable[str]) -> str:
    """Return a ``" (did you mean 'x'?)"`` hint for a mistyped option, or ``""``.

    Args:
        value: What the user typed.
        allowed: The accepted spellings.

    Returns:
        The hint, with a leading space, or an empty string when nothing is close.
    """
    close = difflib.get_close_matches(value, list(allowed), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def unknown_option(kind: str, value: object, allowed: Iterable[str]) -> ValueError:
    """Build the error for an option outside ``allowed``: culprit, hint, allowed values.

    Args:
        kind: What the option names, e.g. ``"model"`` or ``"norm"``.
        value: The rejected value.
        allowed: The accepted spellings.

    Returns:
        A ``ValueError`` to raise.
    """
    allowed = sorted(allowed)
    hint = did_you_mean(str(value), allowed)
    listed = ", ".join(repr(a) for a in allowed)
    return ValueError(f"unknown {kind} {value!r}{hint}; allowed: {listed}")
