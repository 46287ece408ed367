"""The unknown-option error shared by the model registry and the fixer options."""

from __future__ import annotations

from collections.abc import Iterable

from dpkfc_med.utils import did_you_mean


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
