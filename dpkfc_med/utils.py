"""Small shared helpers: option validation with did-you-mean errors."""

from __future__ import annotations

import difflib
import json
import os
import tempfile
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

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
