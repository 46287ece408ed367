"""2D bundles: an exported 2D network runs with MONAI alone and writes what the engine predicts,
for a PNG folder (PNG label maps) and for slices of volumes (volumes, slice by slice)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from dpkfc_med.bundle import export_bundle
from dpkfc_med.cli import main
from tests.bundle.conftest import engine_model, monai_run
from tests.data.test_data_images2d import png_folder
from tests.training.test_segmentation_2d import CONFIG, FOLDER_2D, HIPPO, TINY, _sets


def _train(out: Path, extra: list[str]) -> Path:
    code = main(
        ["train", str(CONFIG), "--out", str(out), "--method", "dp-sgd", *_sets(TINY + extra)]
    )
    assert code == 0
    return out


@pytest.fixture(scope="module")
def png_bundle(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("bundle_png")
    data = png_folder(base / "data", n=12)
    run = _train(base / "run", [f"data.path={data}", *FOLDER_2D])
    return export_bundle(run, base / "bundle")


@pytest.fixture(scope="module")
def slices_bundle(tmp_path_factory) -> Path:
    assert (HIPPO / "imagesTr").is_dir(), f"no msd_hippocampus data at {HIPPO}; set DPKFC_MED_DATA"
    base = tmp_path_factory.mktemp("bundle_slices")
    run = _train(base / "run", ["data.slices.per_unit=2", "data.patch_size=[44,56]"])
    return export_bundle(run, base / "bundle")


def _uncropped(pred: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The engine's prediction on the padded image, with the symmetric padding cut off."""
    starts = [(p - s) // 2 for p, s in zip(pred.shape, shape)]
    return pred[tuple(slice(b, b + s) for b, s in zip(starts, shape))]


def test_png_bundle_writes_png_label_maps_like_the_engine(png_bundle, tmp_path):
    from monai.inferers import sliding_window_inference
    from PIL import Image

    from dpkfc_med.data import segmentation_transforms

    meta = json.loads((png_bundle / "configs" / "metadata.json").read_text(encoding="utf-8"))
    assert meta["task"].startswith("2D segmentation of")
    assert meta["network_data_format"]["inputs"]["image"]["spatial_shape"] == [16, 16]
    rng = np.random.default_rng(5)
    new = tmp_path / "new" / "images"
    new.mkdir(parents=True)
    sizes = {"small": (12, 10), "wide": (30, 14)}  # (W, H): smaller and larger than the patch
    for name, (w, h) in sizes.items():
        Image.fromarray(rng.integers(0, 255, (h, w), dtype=np.uint8)).save(new / f"{name}.png")
    monai_run(png_bundle, tmp_path / "new", tmp_path / "pred")

    net = engine_model(png_bundle)
    load = segmentation_transforms(spatial_size=(16, 16), train=False, reader="PILReader")
    for name, (w, h) in sizes.items():
        written = Image.open(tmp_path / "pred" / f"{name}_seg.png")
        assert written.size == (w, h)
        got = np.asarray(written).T  # [W, H], the engine's axis order
        image = load({"image": str(new / f"{name}.png"), "label": str(new / f"{name}.png")})[
            "image"
        ]
        with torch.no_grad():
            logits = sliding_window_inference(image[None], (16, 16), 16, net, overlap=0.25)
        ref = _uncropped(torch.as_tensor(logits).argmax(1)[0].numpy(), (w, h))
        mismatch = np.argwhere(got != ref)
        assert mismatch.size == 0, f"{name}: {len(mismatch)} pixels differ, e.g. {mismatch[:5]}"


def test_slices_bundle_predicts_volumes_slice_by_slice_like_the_engine(slices_bundle, tmp_path):
    import nibabel as nib
    from monai.inferers import SliceInferer

    from dpkfc_med.data import segmentation_transforms
    from dpkfc_med.data.slices import SliceRule

    infer = yaml.safe_load(
        (slices_bundle / "configs" / "inference.yaml").read_text(encoding="utf-8")
    )
    assert infer["inferer"]["_target_"] == "SliceInferer" and infer["inferer"]["spatial_dim"] == 2
    cases = tmp_path / "cases"
    cases.mkdir()
    names = sorted(p.name for p in (HIPPO / "imagesTr").glob("hippocampus_*.nii.gz"))[:2]
    for name in names:
        os.symlink(HIPPO / "imagesTr" / name, cases / name)
    monai_run(slices_bundle, cases, tmp_path / "pred")

    net = engine_model(slices_bundle)
    load = segmentation_transforms(
        spatial_size=(44, 56), train=False, slices=SliceRule(axis=2, per_unit=2)
    )
    inferer = SliceInferer(spatial_dim=2, roi_size=(44, 56), sw_batch_size=16, overlap=0.25)
    for name in names:
        src = nib.load(str(cases / name))
        out = nib.load(str(tmp_path / "pred" / name.replace(".nii.gz", "_seg.nii.gz")))
        assert out.shape == src.shape
        np.testing.assert_allclose(out.affine, src.affine)
        item = load({"image": str(cases / name), "label": str(HIPPO / "labelsTr" / name)})
        with torch.no_grad():
            logits = inferer(item["image"][None], net)
        ref = _uncropped(torch.as_tensor(logits).argmax(1)[0].numpy(), src.shape)
        got = np.asarray(out.dataobj)
        mismatch = np.argwhere(got != ref)
        assert mismatch.size == 0, f"{name}: {len(mismatch)} voxels differ, e.g. {mismatch[:5]}"


def test_verify_net_in_out_passes_in_2d(png_bundle, slices_bundle):
    from monai.bundle import verify_net_in_out

    for bundle in (png_bundle, slices_bundle):
        verify_net_in_out(
            "network_def",
            meta_file=str(bundle / "configs" / "metadata.json"),
            config_file=str(bundle / "configs" / "inference.yaml"),
            device="cpu",
        )
