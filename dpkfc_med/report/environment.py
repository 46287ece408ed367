"""What the report records about the software and machine: versions, git state, file hashes.

Nothing here identifies the machine: no host name, user name or absolute home path is read,
so a report can be handed to a data-protection officer or published as is.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["PACKAGES", "collect_environment", "sha256_of_files"]

PACKAGES: dict[str, str] = {
    "torch": "torch",
    "opacus": "opacus",
    "monai": "monai",
    "numpy": "numpy",
    "dpkfc_med": "dpkfc-med",
    "nibabel": "nibabel",
    "medmnist": "medmnist",
    # The independent PLD cross-check of epsilon is computed with it.
    "dp_accounting": "dp-accounting",
}
"""Report key -> distribution name of the packages whose versions are recorded."""


def collect_environment(repo_dir: str | Path | None = None) -> dict[str, Any]:
    """Python, platform, package versions and git state, for the report's ``environment``.

    Args:
        repo_dir: Checkout whose commit is recorded; by default the checkout that holds the
            imported ``dpkfc_med`` package (the code that ran).

    Returns:
        ``{"python", "python_implementation", "platform", "machine": {"system", "release",
        "arch", "cpu_count", "torch_threads", "accelerators"}, "packages": {name: version or
        None}, "git": {"commit", "dirty"} or None}``. ``git`` is ``None`` when ``repo_dir`` is
        not a git checkout or git cannot be run.
    """
    if repo_dir is None:
        repo_dir = Path(__file__).resolve().parents[2]
    return {
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        # platform.platform() is "<system>-<release>-<arch>-<libc>": no host name in it.
        "platform": platform.platform(),
        "machine": _machine(),
        "packages": {key: _version(dist) for key, dist in PACKAGES.items()},
        "git": _git_state(Path(repo_dir)),
    }


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        if distribution == "dpkfc-med":  # a source tree on sys.path without install metadata
            import dpkfc_med

            return dpkfc_med.__version__
        return None


def _machine() -> dict[str, Any]:
    out: dict[str, Any] = {
        "system": platform.system(),
        "release": platform.release(),
        "arch": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": None,
        "accelerators": [],
    }
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency of the package
        return out
    out["torch_threads"] = torch.get_num_threads()
    if torch.cuda.is_available():
        out["accelerators"] = [
            torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())
        ]
    return out


def _run_git(repo_dir: Path, *args: str) -> str | None:
    """Stdout of ``git -C repo_dir args``, or ``None`` when git fails or is not installed."""
    try:
        done = subprocess.run(
            ["git", "-C", str(repo_dir), *args],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _git_state(repo_dir: Path) -> dict[str, Any] | None:
    # Only ask git inside a checkout: outside one, git would search the parents of an unrelated
    # directory (e.g. a home directory under version control) and record the wrong commit.
    if not any((d / ".git").exists() for d in (repo_dir, *repo_dir.parents)):
        return None
    commit = _run_git(repo_dir, "rev-parse", "HEAD")
    if commit is None or not commit.strip():
        return None
    status = _run_git(repo_dir, "status", "--porcelain")
    return {
        "commit": commit.strip(),
        # Unknown status counts as dirty: the commit alone may then not reproduce the run.
        "dirty": status is None or bool(status.strip()),
    }


def sha256_of_files(paths: str | Path | Iterable[str | Path]) -> dict[str, str]:
    """SHA-256 fingerprints of files, for ``data.sha256`` and external data.

    Args:
        paths: A file or folder, or several; a folder stands for every file below it
            (recursively, in sorted order).

    Returns:
        ``{path: 64-character hex digest}``, keyed by the path as given (or, below a folder,
        the folder path joined with the file's relative path).

    Raises:
        FileNotFoundError: naming the first path that does not exist.
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    out: dict[str, str] = {}
    for path in map(Path, paths):
        if path.is_dir():
            for file in sorted(p for p in path.rglob("*") if p.is_file()):
                out[str(file)] = _sha256(file)
        elif path.is_file():
            out[str(path)] = _sha256(path)
        else:
            raise FileNotFoundError(f"{path}: no such file or folder to fingerprint")
    return out


def _sha256(path: Path, chunk_size: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:  # in chunks: NIfTI volumes need not fit in memory
        while chunk := fh.read(chunk_size):
            digest.update(chunk)
    return digest.hexdigest()
