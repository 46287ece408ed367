"""Small shared helpers: option validation with did-you-mean errors."""

from __future__ import annotations

import difflib
import json
import os
import tempfile
from collections.abc import Iterable
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

E = TypeVar("E", bound=Enum)

__all__ = ["check_choice", "did_you_mean"]

CLOSE_MATCH_CUTOFF = 0.6
"""Similarity (``difflib`` ratio) above which a mistyped option gets a suggestion."""


def did_you_mean(value: str, allowed: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` when an allowed spelling is close to ``value``, else ``""``.

    The one did-you-mean rule of the package: option values, config fields, report fields,
    model names, probe presets and the benchmark studies all suggest through it.
    """
    close = difflib.get_close_matches(
        str(value).lower(), list(allowed), n=1, cutoff=CLOSE_MATCH_CUTOFF
    )
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_choice(field: str, value: object, enum: type[E], members: Iterable[E] | None = None) -> E:
    """Coerce ``value`` (an enum member or its plain string, any case, ``-`` or ``_``) to ``enum``.

    Args:
        field: The option's name, for the error.
        value: A member of ``enum`` or its string value.
        enum: A ``str``-valued enum.
        members: The members allowed here (default: all of ``enum``).

    Raises:
        ValueError: naming ``field``, the allowed values and the closest match.
    """
    choices = list(enum) if members is None else list(members)
    if isinstance(value, enum) and value in choices:
        return value
    allowed = [str(m.value) for m in choices]
    if isinstance(value, str):
        normalized = value.strip().lower().replace("-", "_")
        for m in choices:
            if str(m.value).lower().replace("-", "_") == normalized:
                return m
    shown = value.value if isinstance(value, enum) else value
    raise ValueError(
        f"{field}={shown!r} is not allowed{did_you_mean(str(shown), allowed)}; "
        f"choose one of {allowed}"
    )


def _umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it; put it straight back
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | os.PathLike[str], payload: bytes) -> None:
    """Write ``payload`` to ``path`` through a temporary file, ``fsync`` and ``os.replace``.

    A crash leaves either the old or the new file, never a torn one (the ledger's promise that
    it is never behind rests on this). The file gets the mode an ordinary file would get under
    the current umask (``mkstemp`` alone would make it 0600).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-", suffix=".tmp")
    try:
        os.chmod(tmp, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as fh:
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _json_default(o: Any) -> Any:
    if hasattr(o, "tolist"):  # NumPy arrays and scalars, torch tensors
        return o.tolist()
    return str(o)  # paths, enums and anything else by its text


def write_json(path: str | os.PathLike[str], obj: Any) -> None:
    """Atomically write ``obj`` as indented JSON (NumPy/torch values and paths converted)."""
    atomic_write_bytes(path, json.dumps(obj, indent=1, default=_json_default).encode())
