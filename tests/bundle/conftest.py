"""Toy runs for the bundle tests, trained from the run configs the pipeline bundles mirror.

Sizes follow tests/training: a few images / volumes, one epoch, tiny nets; seconds per run.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from dpkfc_med.bundle import build_network
from tests.conftest import SHARED_DATA

ROOT = Path(__file__).resolve().parents[2]
PIPELINES = ROOT / "pipelines"
PNEUMONIA = Path(SHARED_DATA) / "medmnist" / "pneumoniamnist.npz"
HIPPO = Path(SHARED_DATA) / "msd_hippocampus"

# tests/training/test_segmentation.py's TINY, without the synthetic pretraining
SEG_TINY = [
    "data.max_train=6",
    "data.max_eval=1",
    "data.patch_size=[16,16,16]",
    "data.patches_per_unit=2",
    "training.epochs=1",
    "training.batch_size=3",
    "training.eval_batch_size=16",
    "training.progress=false",
    "model.kwargs.channels=[4,8]",
    "model.kwargs.strides=[2]",
    "probes.num_probes=4",
    "preconditioner.chunk_size=4",
    "preconditioner.calibration_samples=2",
    "pretrain.steps=0",
]
CLS_TINY = [
    f"data.path={PNEUMONIA}",
    "data.max_train=64",
    "data.max_eval=32",
    "privacy.target_epsilon=4.0",
    "training.epochs=1",
    "training.batch_size=32",
    "training.progress=false",
    "training.eval_batch_size=64",
    "probes.num_probes=16",
    "probes.refresh_every=2",
    "preconditioner.calibration_samples=4",
    "preconditioner.rank_a=null",
]


CONFIGS = {
    "segmentation_3d": ROOT / "configs" / "hippocampus_unet_3d_eps8.yaml",
    "classification_2d": ROOT / "dpkfc_bench" / "pneumoniamnist_cnn_2d_eps1_hand.yaml",
    "classification_3d": ROOT / "configs" / "adrenalmnist3d_resnet_3d_eps8.yaml",
}
"""The run config each pipeline bundle in ``pipelines/`` is the Model Zoo form of."""


def bundle_train(bundle: Path, out: Path, overrides: list[str], *extra: str) -> None:
    """``dpkfc-med bundle train BUNDLE --epsilon 8 --recipe bundle`` with bundle overrides."""
    from dpkfc_med.cli import main

    args = ["bundle", "train", str(bundle), "--epsilon", "8", "--recipe", "bundle"]
    args += ["--out", str(out), *[a for o in overrides for a in ("--override", o)]]
    assert main([*args, *extra, "--set", "training.progress=false"]) == 0


def config_train(config: Path, overrides: list[str], out: Path) -> None:
    """``dpkfc-med train CONFIG --set ... --out OUT`` (a run to export)."""
    from dpkfc_med.cli import main

    sets = [a for item in overrides for a in ("--set", item)]
    assert main(["train", str(config), "--out", str(out), *sets]) == 0


@pytest.fixture(scope="session")
def seg_run(tmp_path_factory) -> Path:
    assert (HIPPO / "imagesTr").is_dir(), f"no msd_hippocampus data at {HIPPO}; set DPKFC_MED_DATA"
    out = tmp_path_factory.mktemp("bundle_seg") / "run"
    config_train(CONFIGS["segmentation_3d"], SEG_TINY, out)
    return out


@pytest.fixture(scope="session")
def cls_run(tmp_path_factory) -> Path:
    assert PNEUMONIA.is_file(), f"no pneumoniamnist at {PNEUMONIA}; set DPKFC_MED_DATA"
    out = tmp_path_factory.mktemp("bundle_cls") / "run"
    config_train(CONFIGS["classification_2d"], CLS_TINY, out)
    return out


@pytest.fixture(scope="session")
def nonprivate_run(tmp_path_factory) -> Path:
    from dpkfc_med.cli import main

    out = tmp_path_factory.mktemp("bundle_np") / "run"
    config = ROOT / "configs" / "pneumoniamnist_cnn_2d_eps1.yaml"
    sets = [a for item in CLS_TINY for a in ("--set", item)]
    assert main(["train", str(config), "--method", "nonprivate", "--out", str(out), *sets]) == 0
    return out


@pytest.fixture
def copy_run(tmp_path):
    """A writable copy of a run directory (the session runs stay untouched)."""

    def make(run: Path) -> Path:
        dst = tmp_path / f"copy_{run.parent.name}"
        shutil.copytree(run, dst)
        return dst

    return make


def write_nifti(path: Path, array: np.ndarray, affine: np.ndarray) -> None:
    import nibabel as nib

    path.parent.mkdir(parents=True, exist_ok=True)
    nib.save(nib.Nifti1Image(array, affine), str(path))


def monai_run(bundle: Path, dataset: Path, out: Path, **extra) -> None:
    """Run an exported bundle's inference.yaml with MONAI alone."""
    from monai.bundle import run

    run(
        config_file=str(bundle / "configs" / "inference.yaml"),
        dataset_dir=str(dataset),
        output_dir=str(out),
        **extra,
    )


def engine_model(bundle: Path) -> torch.nn.Module:
    """The trained network rebuilt by the engine's own builder (the reference)."""
    meta = json.loads((bundle / "configs" / "metadata.json").read_text(encoding="utf-8"))
    cfg = yaml.safe_load((bundle / "docs" / "privacy_report.json").read_text(encoding="utf-8"))[
        "run"
    ]["config"]
    fmt = meta["network_data_format"]
    net = build_network(
        cfg["model"]["name"],
        len(fmt["inputs"]["image"]["spatial_shape"]),
        fmt["inputs"]["image"]["num_channels"],
        fmt["outputs"]["pred"]["num_channels"],
        fmt["inputs"]["image"]["spatial_shape"],
        cfg["model"]["norm"],
        cfg["model"]["kwargs"],
    )
    net.load_state_dict(torch.load(bundle / "models" / "model.pt", weights_only=True))
    return net.eval()
