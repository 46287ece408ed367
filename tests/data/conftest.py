"""Fixtures for the data-reader tests: bundled real data (resolved, never copied) and builders
of tiny synthetic files in tmp_path."""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest

from dpkfc_med.data import DataNotFoundError, resolve_data_path


def _resolve_or_skip(spec: str, kind: str = "file") -> Path:
    try:
        return resolve_data_path(spec, kind=kind)  # type: ignore[arg-type]
    except DataNotFoundError as err:
        # Missing data must fail loudly: a skipped data test would hide a broken resolver.
        pytest.fail(f"bundled data not available (set DPKFC_MED_DATA): {err}")


@pytest.fixture(scope="session")
def pneumonia_path() -> Path:
    return _resolve_or_skip("pneumoniamnist")


@pytest.fixture(scope="session")
def adrenal_path() -> Path:
    return _resolve_or_skip("adrenalmnist3d")


@pytest.fixture(scope="session")
def hippo_root() -> Path:
    return _resolve_or_skip("msd_hippocampus", kind="dir")


@pytest.fixture(scope="session")
def dicom_dir() -> Path:
    return _resolve_or_skip("dicom", kind="dir")


@pytest.fixture(scope="session")
def shared_sha256() -> dict[str, str]:
    sums = _resolve_or_skip("SHA256SUMS")
    out = {}
    for line in sums.read_text(encoding="utf-8").splitlines():
        digest, name = line.split(maxsplit=1)
        out[name.removeprefix("./")] = digest
    return out


def good_arrays(
    sizes: Sequence[int] = (6, 3, 3),
    sample_shape: Sequence[int] = (8, 8),
    num_classes: int = 2,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """A valid MedMNIST-layout dict: uint8 images, (N, 1) labels covering every class, and the
    declared class names (``classes``)."""
    rng = np.random.default_rng(seed)
    arrays = {"classes": np.array([f"class{k}" for k in range(num_classes)])}
    for split, n in zip(("train", "val", "test"), sizes):
        arrays[f"{split}_images"] = rng.integers(0, 256, (n, *sample_shape), dtype=np.uint8)
        arrays[f"{split}_labels"] = (np.arange(n) % num_classes).astype(np.uint8)[:, None]
    return arrays


@pytest.fixture
def write_npz(tmp_path: Path) -> Callable[..., Path]:
    def write(name: str = "toy.npz", **arrays: np.ndarray) -> Path:
        path = tmp_path / name
        np.savez(path, **arrays)
        return path

    return write


@pytest.fixture
def write_case() -> Callable[..., None]:
    """Write one synthetic NIfTI image/label pair (1 mm voxels) into imagesTr/ labelsTr/."""
    import nibabel as nib

    def write(
        root: Path,
        case_id: str,
        shape: Sequence[int] = (8, 8, 6),
        label_shape: Sequence[int] | None = None,
        label_values: Sequence[int] = (0, 1, 2),
        image: bool = True,
        label: bool = True,
        image_name: str | None = None,
    ) -> None:
        rng = np.random.default_rng(zlib.crc32(case_id.encode()))
        (root / "imagesTr").mkdir(parents=True, exist_ok=True)
        (root / "labelsTr").mkdir(parents=True, exist_ok=True)
        if image:
            data = rng.uniform(1, 100, shape).astype(np.float32)
            nib.save(
                nib.Nifti1Image(data, np.eye(4)),
                root / "imagesTr" / (image_name or f"{case_id}.nii.gz"),
            )
        if label:
            lshape = tuple(label_shape or shape)
            lab = np.zeros(lshape, dtype=np.uint8)
            flat = lab.reshape(-1)
            for i, v in enumerate(label_values):
                flat[i * 7 : (i + 1) * 7] = v  # a few voxels of every requested value
            nib.save(nib.Nifti1Image(lab, np.eye(4)), root / "labelsTr" / f"{case_id}.nii.gz")

    return write


def _write_dataset_json(root: Path, case_ids: Sequence[str], labels: dict | None = None) -> None:
    meta = {
        "labels": labels if labels is not None else {"0": "bg", "1": "a", "2": "b"},
        "training": [
            {"image": f"./imagesTr/{c}.nii.gz", "label": f"./labelsTr/{c}.nii.gz"} for c in case_ids
        ],
    }
    (root / "dataset.json").write_text(json.dumps(meta), encoding="utf-8")


@pytest.fixture
def write_index() -> Callable[..., None]:
    """Write an MSD-style dataset.json listing the given case IDs."""
    return _write_dataset_json


@pytest.fixture
def make_arrays() -> Callable[..., dict[str, np.ndarray]]:
    return good_arrays
