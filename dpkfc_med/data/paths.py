"""Find dataset files and folders without hard-coding machine-specific paths.

Search order of :func:`resolve_data_path` (first hit wins):

1. the spec itself, as an existing path (absolute, ``~``-relative or relative to the CWD);
2. ``<root>/<spec>`` for each root in the environment variable ``DPKFC_MED_DATA``
   (several roots may be joined with ``os.pathsep``);
3. ``<root>/<spec>`` for the bundled data folder: a ``shared/data`` directory next to the
   checkout, found by walking up from this package and from the CWD;
4. for a bare MedMNIST flag (``pneumoniamnist``, ``adrenalmnist3d_64``, optionally with
   ``.npz``): ``<root>/medmnist/<flag>.npz`` and ``<root>/medmnist3d/<flag>.npz`` for every
   root above, then the ``medmnist`` package cache ``~/.medmnist/<flag>.npz``;
5. only with ``download=True``: download through the ``medmnist`` package (needs internet).
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Literal

from dpkfc_med.data.errors import DataNotFoundError

__all__ = [
    "DATA_ENV_VAR",
    "MEDMNIST_SIZES",
    "data_roots",
    "default_data_root",
    "medmnist_cache_dir",
    "parse_medmnist_flag",
    "resolve_data_path",
    "sha256_file",
]

DATA_ENV_VAR = "DPKFC_MED_DATA"
"""Environment variable naming one or more data roots (``os.pathsep``-separated)."""

MEDMNIST_SIZES = (28, 64, 128, 224)
"""Image sizes MedMNIST v2 publishes; 28 has no file-name suffix."""

# A MedMNIST flag is a lower-case word ending in "mnist" or "mnist3d", with an optional size.
_FLAG_RE = re.compile(r"^(?P<flag>[a-z0-9]+mnist(?:3d)?)(?:_(?P<size>\d+))?(?:\.npz)?$")
# Any bare MedMNIST-like file name, including derived files such as "pneumoniamnist_balanced".
_BARE_RE = re.compile(r"^[a-z0-9]+mnist(?:3d)?(?:_[a-z0-9_\-]+)?(?:\.npz)?$")

_HINT = (
    f"Fix: pass an existing path (e.g. --data PATH), set {DATA_ENV_VAR}=/path/to/data so that "
    "the spec resolves below it, or place the file in the bundled shared/data folder."
)


def parse_medmnist_flag(spec: str | Path) -> tuple[str, int] | None:
    """Split a bare MedMNIST name into its flag and image size.

    Args:
        spec: A name such as ``"pneumoniamnist"``, ``"adrenalmnist3d_64"`` or
            ``"pneumoniamnist.npz"``. Anything containing a path separator is not a flag.

    Returns:
        ``(flag, size)`` (size 28 when there is no suffix), or ``None`` when ``spec`` is not a
        bare flag name.

    Examples:
        >>> parse_medmnist_flag("adrenalmnist3d_64")
        ('adrenalmnist3d', 64)
        >>> parse_medmnist_flag("medmnist/pneumoniamnist.npz") is None
        True
    """
    text = str(spec)
    if "/" in text or os.sep in text:
        return None
    match = _FLAG_RE.match(text.lower())
    if match is None:
        return None
    size = int(match.group("size") or 28)
    if size not in MEDMNIST_SIZES:
        return None
    return match.group("flag"), size


def _medmnist_file_name(flag: str, size: int) -> str:
    # Mirrors the medmnist package's naming: no suffix for the 28-pixel files.
    return f"{flag}.npz" if size == 28 else f"{flag}_{size}.npz"


def _bundled_roots() -> list[Path]:
    """``shared/data`` folders next to the checkout, seen from the package and from the CWD."""
    found: list[Path] = []
    starts = [Path(__file__).resolve().parent, Path.cwd().resolve()]
    for start in starts:
        for ancestor in (start, *start.parents):
            candidate = ancestor / "shared" / "data"
            if candidate.is_dir() and candidate not in found:
                found.append(candidate)
                break  # the nearest one is the checkout's sibling; stop walking this start
    return found


def _env_roots() -> list[Path]:
    value = os.environ.get(DATA_ENV_VAR, "")
    return [Path(p).expanduser() for p in value.split(os.pathsep) if p.strip()]


def data_roots() -> list[tuple[str, Path]]:
    """Every data root in search order, each with a label saying where it came from.

    Returns:
        ``[(label, root), ...]``: first the ``DPKFC_MED_DATA`` roots (existing or not, so error
        messages can show a mistyped variable), then the bundled ``shared/data`` folders.
    """
    roots = [(f"${DATA_ENV_VAR}", p) for p in _env_roots()]
    roots += [("bundled shared/data", p) for p in _bundled_roots()]
    return roots


def default_data_root() -> Path | None:
    """The first existing data root: ``$DPKFC_MED_DATA`` if set, else the bundled folder.

    Returns:
        The root directory, or ``None`` when neither exists.
    """
    for _, root in data_roots():
        if root.is_dir():
            return root
    return None


def medmnist_cache_dir() -> Path:
    """Where the ``medmnist`` package keeps downloads (``~/.medmnist``), without importing it."""
    return Path("~/.medmnist").expanduser()


def _matches(path: Path, kind: str) -> bool:
    return path.is_file() if kind == "file" else path.is_dir()


def resolve_data_path(
    spec: str | Path,
    *,
    kind: Literal["file", "dir"] = "file",
    download: bool = False,
) -> Path:
    """Turn a user's data spec into an existing file or folder.

    See the module docstring for the search order. The first existing candidate of the right
    kind wins, so an explicit path always beats the roots.

    Args:
        spec: A path (absolute or relative), a path relative to a data root (e.g.
            ``"msd_hippocampus"``), or a bare MedMNIST flag (e.g. ``"pneumoniamnist"``).
        kind: ``"file"`` or ``"dir"``; a candidate of the other kind is skipped and reported.
        download: Allow downloading a MedMNIST flag through the ``medmnist`` package into its
            cache as a last resort. Needs internet; off by default so runs never fetch data
            silently.

    Returns:
        The resolved path (absolute).

    Raises:
        ValueError: ``kind`` is not ``"file"`` or ``"dir"``.
        DataNotFoundError: Nothing matched; the message lists every place tried and the fix.
    """
    if kind not in ("file", "dir"):
        raise ValueError(f"resolve_data_path: kind={kind!r} is not one of 'file', 'dir'")

    tried: list[str] = []

    def check(path: Path, label: str) -> Path | None:
        if _matches(path, kind):
            return path.resolve()
        if path.exists():
            other = "a directory" if path.is_dir() else "a file"
            tried.append(f"{path.absolute()} ({label}; exists but is {other}, expected a {kind})")
        else:
            tried.append(f"{path.absolute()} ({label})")
        return None

    explicit = Path(spec).expanduser()
    if (hit := check(explicit, "explicit path")) is not None:
        return hit

    roots = data_roots()
    if not any(label.startswith("$") for label, _ in roots):
        tried.append(f"${DATA_ENV_VAR} (not set)")
    if not any(label.startswith("bundled") for label, _ in roots):
        tried.append(
            "bundled shared/data (no shared/data folder beside the checkout or the current "
            "directory, e.g. ../shared/data)"
        )
    if not explicit.is_absolute():
        for label, root in roots:
            if (hit := check(root / explicit, label)) is not None:
                return hit

    text = str(spec)
    bare = kind == "file" and "/" not in text and os.sep not in text
    if bare and _BARE_RE.match(text.lower()):
        name = text if text.lower().endswith(".npz") else f"{text}.npz"
        parsed = parse_medmnist_flag(text)
        if parsed is not None:
            name = _medmnist_file_name(*parsed)  # normalises "x_28" to "x.npz" like medmnist
        for label, root in roots:
            for sub in ("medmnist", "medmnist3d"):
                if (hit := check(root / sub / name, f"{label}, MedMNIST name")) is not None:
                    return hit
        cache = medmnist_cache_dir()
        if (hit := check(cache / name, "medmnist cache")) is not None:
            return hit
        if parsed is not None:
            if download:
                return _download_medmnist(*parsed, cache)
            tried.append(
                f"download of MedMNIST {parsed[0]!r} (size {parsed[1]}) skipped: allow it with "
                "--set data.download=true on the command line (download=True in Python); needs "
                "internet"
            )

    raise DataNotFoundError(spec, tried, _HINT)


def _download_medmnist(flag: str, size: int, root: Path) -> Path:
    """Fetch a MedMNIST file through the ``medmnist`` package; needs internet."""
    try:
        import medmnist  # lazy: heavy import, and only needed for downloads
    except ImportError as err:  # pragma: no cover - medmnist is a declared dependency
        raise DataNotFoundError(
            flag, ["medmnist package (not installed)"], "Fix: pip install medmnist"
        ) from err
    info = medmnist.INFO.get(flag)
    if info is None:
        raise DataNotFoundError(
            flag,
            ["medmnist.INFO"],
            f"Fix: use one of the MedMNIST flags: {', '.join(sorted(medmnist.INFO))}",
        )
    root.mkdir(parents=True, exist_ok=True)
    dataset_cls = getattr(medmnist, info["python_class"])
    # Constructing any split downloads the single .npz that holds all three splits.
    try:
        dataset_cls(split="train", download=True, size=size, root=str(root))
    except (OSError, RuntimeError) as err:  # no network: socket.gaierror, URLError, ...
        raise DataNotFoundError(
            flag,
            [f"download of MedMNIST {flag!r} (size {size}) into {root}: failed ({err})"],
            "Fix: this machine may have no internet access. Download the .npz elsewhere "
            f"(Zenodo record of MedMNIST v2) and pass it with --data PATH, or set "
            f"{DATA_ENV_VAR} to the folder holding it",
        ) from None
    path = root / _medmnist_file_name(flag, size)
    if not path.is_file():  # pragma: no cover - depends on the medmnist package version
        raise DataNotFoundError(flag, [str(path)], "Fix: download the file by hand from Zenodo")
    return path.resolve()


def sha256_file(path: str | Path, *, chunk_size: int = 1 << 20) -> str:
    """SHA-256 hex digest of a file, read in chunks; used as a dataset fingerprint in reports.

    Args:
        path: File to hash.
        chunk_size: Bytes read per step, so large files do not need to fit in memory.

    Returns:
        The 64-character lower-case hex digest.
    """
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(chunk_size):
            digest.update(chunk)
    return digest.hexdigest()
