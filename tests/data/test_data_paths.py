from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dpkfc_med.data import (
    DATA_ENV_VAR,
    DataNotFoundError,
    default_data_root,
    resolve_data_path,
    sha256_file,
)
from dpkfc_med.data.paths import parse_medmnist_flag


@pytest.fixture(autouse=True)
def _no_env_root(monkeypatch: pytest.MonkeyPatch) -> None:
    # A DPKFC_MED_DATA set by the developer must not change which file the tests resolve.
    monkeypatch.delenv(DATA_ENV_VAR, raising=False)


def _tiny_npz(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, train_images=np.zeros((1, 2, 2), np.uint8))
    return path


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("pneumoniamnist", ("pneumoniamnist", 28)),
        ("adrenalmnist3d_64", ("adrenalmnist3d", 64)),
        ("PneumoniaMNIST.npz", ("pneumoniamnist", 28)),
        ("pneumoniamnist_balanced", None),  # not a size suffix: no download flag
        ("pneumoniamnist_65", None),
        ("medmnist/pneumoniamnist.npz", None),
        ("msd_hippocampus", None),
    ],
)
def test_parse_medmnist_flag(spec: str, expected: tuple[str, int] | None) -> None:
    assert parse_medmnist_flag(spec) == expected


def test_bare_flag_resolves_to_bundled_file(pneumonia_path: Path, adrenal_path: Path) -> None:
    assert pneumonia_path.parts[-2:] == ("medmnist", "pneumoniamnist.npz")
    assert adrenal_path.parts[-2:] == ("medmnist3d", "adrenalmnist3d.npz")
    assert resolve_data_path("adrenalmnist3d_64").name == "adrenalmnist3d_64.npz"
    # Derived files in the MedMNIST folders resolve by bare name too.
    assert resolve_data_path("pneumoniamnist_balanced").name == "pneumoniamnist_balanced.npz"
    # A relative path below the data root works as well.
    assert resolve_data_path("medmnist/pneumoniamnist.npz") == pneumonia_path


def test_explicit_path_wins(tmp_path: Path, pneumonia_path: Path, monkeypatch) -> None:
    assert resolve_data_path(pneumonia_path) == pneumonia_path
    # A relative path that exists from the CWD beats the same relative path below the roots.
    local = _tiny_npz(tmp_path / "medmnist" / "pneumoniamnist.npz")
    monkeypatch.chdir(tmp_path)
    assert resolve_data_path("medmnist/pneumoniamnist.npz") == local.resolve()


def test_env_var_beats_bundled(tmp_path: Path, pneumonia_path: Path, monkeypatch) -> None:
    fake = _tiny_npz(tmp_path / "medmnist" / "pneumoniamnist.npz")
    monkeypatch.setenv(DATA_ENV_VAR, str(tmp_path))
    assert resolve_data_path("pneumoniamnist") == fake.resolve()
    assert resolve_data_path("medmnist/pneumoniamnist.npz") == fake.resolve()
    assert default_data_root() == tmp_path
    # Files missing under the env root still fall through to the bundled folder.
    assert resolve_data_path("adrenalmnist3d").name == "adrenalmnist3d.npz"


def test_medmnist_cache(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    cached = _tiny_npz(tmp_path / ".medmnist" / "bloodmnist.npz")
    assert resolve_data_path("bloodmnist") == cached.resolve()


def test_dir_kind(hippo_root: Path) -> None:
    assert (hippo_root / "dataset.json").is_file()
    with pytest.raises(DataNotFoundError, match="exists but is a directory, expected a file"):
        resolve_data_path("msd_hippocampus", kind="file")
    with pytest.raises(ValueError, match="kind='folder' is not one of"):
        resolve_data_path("msd_hippocampus", kind="folder")  # type: ignore[arg-type]


def test_not_found_lists_every_place(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv(DATA_ENV_VAR, str(tmp_path / "nowhere"))
    with pytest.raises(DataNotFoundError) as info:
        resolve_data_path("organmnist3d")
    message = str(info.value)
    for expected in [
        "(explicit path)",
        f"nowhere/organmnist3d (${DATA_ENV_VAR})",
        f"nowhere/medmnist3d/organmnist3d.npz (${DATA_ENV_VAR}, MedMNIST name)",
        ".medmnist/organmnist3d.npz (medmnist cache)",
        "--set data.download=true",
        "shared/data",
        "--data PATH",
        DATA_ENV_VAR + "=",
    ]:
        assert expected in message, f"missing {expected!r} in:\n{message}"
    assert isinstance(info.value, FileNotFoundError)
    assert len(info.value.tried) >= 6


def test_bundled_folder_is_named_when_missing(tmp_path: Path, monkeypatch) -> None:
    import dpkfc_med.data.paths as paths

    monkeypatch.setattr(paths, "_bundled_roots", lambda: [])
    with pytest.raises(DataNotFoundError, match=r"bundled shared/data \(no shared/data folder"):
        resolve_data_path("no_such_folder", kind="dir")


def test_download_without_internet_is_a_clear_error(tmp_path: Path, monkeypatch) -> None:
    import socket

    import medmnist

    def offline(**kwargs):
        raise socket.gaierror(-3, "Temporary failure in name resolution")

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(medmnist, medmnist.INFO["organmnist3d"]["python_class"], offline)
    with pytest.raises(
        DataNotFoundError,
        match=r"(?s)download of MedMNIST 'organmnist3d'.*"
        r"failed.*name resolution.*no internet access.*--data PATH",
    ):
        resolve_data_path("organmnist3d", download=True)


def test_sha256_matches_shipped_sums(pneumonia_path: Path, shared_sha256: dict) -> None:
    assert sha256_file(pneumonia_path) == shared_sha256["medmnist/pneumoniamnist.npz"]
    assert sha256_file(pneumonia_path, chunk_size=4096) == sha256_file(pneumonia_path)


def test_docstring_examples() -> None:
    import doctest

    from dpkfc_med.data import paths, splits

    for module in (paths, splits):
        result = doctest.testmod(module, verbose=False)
        assert result.failed == 0 and result.attempted > 0, module.__name__
