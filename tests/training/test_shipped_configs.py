"""Every shipped config trains as written, at toy size (few units, one epoch, few probes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from dpkfc_med.training.config import load_config
from dpkfc_med.training.run import train

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


def _brats_like(root: Path) -> list[str]:
    """MSD Task01's layout at toy size: 4-D NIfTI images of 4 channels, labels 0-3."""
    import json

    import nibabel as nib
    import numpy as np

    rng = np.random.default_rng(0)
    training = []
    for i in range(10):
        image = rng.random((12, 12, 10, 4)).astype(np.float32)
        label = rng.integers(0, 4, (12, 12, 10)).astype(np.uint8)
        for sub, array in (("imagesTr", image), ("labelsTr", label)):
            (root / sub).mkdir(parents=True, exist_ok=True)
            nib.save(nib.Nifti1Image(array, np.eye(4)), str(root / sub / f"BRATS_{i:03d}.nii.gz"))
        training.append({"image": f"./imagesTr/BRATS_{i:03d}.nii.gz",
                         "label": f"./labelsTr/BRATS_{i:03d}.nii.gz"})  # fmt: skip
    labels = {"0": "background", "1": "edema", "2": "non-enhancing tumor", "3": "enhancing tumour"}
    modality = {"0": "FLAIR", "1": "T1w", "2": "t1gd", "3": "T2w"}
    (root / "dataset.json").write_text(
        json.dumps({"labels": labels, "modality": modality, "training": training}), encoding="utf-8"
    )
    return [
        f"data.path={root}",
        "data.patch_size=[8,8,8]",
        "training.device=cpu",
        "model.kwargs.channels=[4,8]",
        "model.kwargs.strides=[2]",
        "training.max_physical_batch=1",
    ]  # fmt: skip  (chunks of one patient)


def _public_release_like(root: Path) -> list[str]:
    """A 2-class "public" network of the config's architecture, and the bundled cases."""
    import torch

    from dpkfc_med.bundle import build_network

    path = CONFIGS[0].parent / "hippocampus_unet_3d_public_init_eps1.yaml"
    model = yaml.safe_load(path.read_text(encoding="utf-8"))["model"]
    net = build_network("unet", 3, 1, 2, [32, 48, 32], model["norm"], model["kwargs"])
    root.mkdir(parents=True)
    torch.save({"model": net.state_dict()}, root / "public.pt")
    return ["data.path=msd_hippocampus", f"model.pretrained={root / 'public.pt'}"]


def _two_modality_like(root: Path) -> list[str]:
    """The two-channel folder's layout (one file per modality, nnU-Net's dataset.json)."""
    import json

    import nibabel as nib
    import numpy as np

    rng = np.random.default_rng(0)
    training = []
    for i in range(10):
        files = {f"imagesTr/h_{i:03d}_{m:04d}": rng.random((12, 12, 10)).astype(np.float32)
                 for m in range(2)}  # fmt: skip
        files[f"labelsTr/h_{i:03d}"] = rng.integers(0, 3, (12, 12, 10)).astype(np.uint8)
        for name, array in files.items():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            nib.save(nib.Nifti1Image(array, np.eye(4)), str(root / f"{name}.nii.gz"))
        training.append({"image": f"./imagesTr/h_{i:03d}.nii.gz",
                         "label": f"./labelsTr/h_{i:03d}.nii.gz"})  # fmt: skip
    index = {"modality": {"0": "MRI", "1": "edges"}, "training": training,
             "labels": {"0": "background", "1": "anterior", "2": "posterior"}}  # fmt: skip
    (root / "dataset.json").write_text(json.dumps(index), encoding="utf-8")
    return [f"data.path={root}", "data.patch_size=[8,8,8]"]


# configs whose data is not bundled (or made by a benchmark) train on a stand-in of its layout
STAND_INS = {
    "brats_unet_3d_eps8": _brats_like,
    "hippocampus_2ch_unet_3d_eps8": _two_modality_like,
    "hippocampus_unet_3d_public_init_eps1": _public_release_like,
}


def test_the_configs_folder_is_found():
    assert len(CONFIGS) >= 8


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_shipped_config_trains_at_toy_size(path, tmp_path):
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    seg = raw.get("data", {}).get("task") == "segmentation"
    toy = [
        "training.epochs=1",
        f"training.batch_size={4 if seg else 16}",
        "training.progress=false",
        f"data.max_train={6 if seg else 32}",
        f"data.max_eval={2 if seg else 16}",
        "probes.num_probes=4",
        "preconditioner.chunk_size=2",
        "preconditioner.calibration_samples=2",
        # toy size: no factor wider than 512 is decomposed in full, and the RDP accountant
        # (PRV on a 1-epoch run at q = 1/2 costs seconds per call)
        "preconditioner.max_factor_dim=512",
        "privacy.accountant=rdp",
        f"output.dir={tmp_path / 'run'}",
    ]
    if "pretrain" in raw or raw.get("training", {}).get("recipe") == "auto" and seg:
        toy += ["pretrain.steps=1", "pretrain.batch_size=1"]  # recipe: auto pretrains seg
    if path.stem in STAND_INS:
        toy += STAND_INS[path.stem](tmp_path / "data")
    cfg = load_config(path, overrides=toy)
    # the model, the mechanism and the privacy target are the config's own
    assert cfg.model.name == raw["model"]["name"]
    if "method" in raw:
        assert cfg.method == raw["method"]
    else:  # the rule chooses the method: a config may leave it out only under recipe: auto
        assert raw["training"]["recipe"] == "auto"
    assert cfg.privacy.target_epsilon == raw["privacy"]["target_epsilon"]
    result = train(cfg)
    assert 0 < result.epsilon <= cfg.privacy.target_epsilon
    assert (tmp_path / "run" / "privacy_report.json").is_file()
