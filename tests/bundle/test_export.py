"""``dpkfc-med bundle export``: the bundle runs with MONAI and predicts what the engine predicts;
incomplete and over-budget runs are refused; a non-private run is loudly marked."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from dpkfc_med.bundle import BundleExportError, export_bundle
from dpkfc_med.bundle.metadata import NO_GUARANTEE, metadata_problems, sha256_file
from dpkfc_med.cli import main
from dpkfc_med.privacy.accounting import PrivacyLedger
from tests.bundle.conftest import PNEUMONIA, engine_model, monai_run, write_nifti


@pytest.fixture(scope="module")
def seg_bundle(seg_run, tmp_path_factory) -> Path:
    return export_bundle(seg_run, tmp_path_factory.mktemp("seg_bundle") / "bundle")


@pytest.fixture(scope="module")
def cls_bundle(cls_run, tmp_path_factory) -> Path:
    return export_bundle(cls_run, tmp_path_factory.mktemp("cls_bundle") / "bundle")


def test_export_writes_model_configs_metadata_and_only_the_shareable_report(seg_run, seg_bundle):
    files = sorted(str(p.relative_to(seg_bundle)) for p in seg_bundle.rglob("*") if p.is_file())
    assert files == [
        "configs/inference.yaml",
        "configs/metadata.json",
        "docs/README.md",
        "docs/plots/epsilon.png",
        "docs/privacy_report.html",
        "docs/privacy_report.json",
        "docs/privacy_report.md",
        "models/model.pt",
    ]
    saved = torch.load(seg_run / "model.pt", map_location="cpu", weights_only=False)
    state = torch.load(seg_bundle / "models" / "model.pt", weights_only=True)
    assert state.keys() == saved["model"].keys()
    assert all(torch.equal(state[k], saved["model"][k]) for k in state)  # the selected model
    assert (seg_bundle / "docs/privacy_report.json").read_bytes() == (
        seg_run / "privacy_report.json"
    ).read_bytes()
    meta = json.loads((seg_bundle / "configs" / "metadata.json").read_text(encoding="utf-8"))
    assert metadata_problems(meta) == []
    dp = meta["differential_privacy"]
    ledger = PrivacyLedger.load(seg_run / "ledger.json")
    assert dp["epsilon_spent"] == pytest.approx(ledger.all_epsilons(), rel=1e-12)
    assert dp["epsilon_spent"]["prv"] <= dp["epsilon_target"] == 8.0
    assert dp["delta"] == ledger.delta and dp["steps"] == ledger.steps
    assert dp["noise_multiplier"] == ledger.events[0].noise_multiplier
    assert dp["sample_rate"] == ledger.events[0].sample_rate
    assert dp["sampler"] == "poisson" and dp["unit_of_privacy"] == "patient/volume"
    assert dp["privacy_report"]["sha256"] == sha256_file(seg_bundle / "docs/privacy_report.json")
    # the UNet is rebuilt by plain MONAI, checked against the engine's build
    net_def = yaml.safe_load(
        (seg_bundle / "configs" / "inference.yaml").read_text(encoding="utf-8")
    )["network_def"]
    assert net_def["_target_"] == "monai.networks.nets.UNet"
    assert "dpkfc-med" not in meta["required_packages_version"]


def test_exported_segmentation_bundle_writes_label_maps_like_the_engine(seg_bundle, tmp_path):
    from monai.inferers import sliding_window_inference

    from dpkfc_med.data import segmentation_transforms

    rng = np.random.default_rng(0)
    shapes = [(20, 18, 17), (12, 22, 16)]  # the second is smaller than the patch along x
    for i, shape in enumerate(shapes):
        affine = np.diag([1.5, 1.0, 2.0, 1.0])
        affine[:3, 3] = [i, -2.0, 3.5]
        image = (rng.random(shape) * 100).astype(np.float32)
        write_nifti(tmp_path / "cases" / f"case{i}.nii.gz", image, affine)
        write_nifti(tmp_path / "labels" / f"case{i}.nii.gz", np.zeros(shape, np.uint8), affine)
    monai_run(seg_bundle, tmp_path / "cases", tmp_path / "pred")

    import nibabel as nib

    net = engine_model(seg_bundle)
    patch = (16, 16, 16)
    load = segmentation_transforms(spatial_size=patch, train=False)
    for i, shape in enumerate(shapes):
        src = nib.load(str(tmp_path / "cases" / f"case{i}.nii.gz"))
        out = nib.load(str(tmp_path / "pred" / f"case{i}_seg.nii.gz"))
        assert out.shape == shape
        np.testing.assert_allclose(out.affine, src.affine)
        got = np.asarray(out.dataobj)
        # reference: the engine's evaluation pipeline and inferer, padding cropped back
        item = load(
            {
                "image": str(tmp_path / "cases" / f"case{i}.nii.gz"),
                "label": str(tmp_path / "labels" / f"case{i}.nii.gz"),
            }
        )
        with torch.no_grad():
            logits = sliding_window_inference(
                item["image"][None], roi_size=patch, sw_batch_size=16, predictor=net, overlap=0.25
            )
        ref = torch.as_tensor(logits).argmax(1)[0].numpy()
        starts = [(max(p, s) - s) // 2 for p, s in zip(patch, shape)]
        ref = ref[tuple(slice(b, b + s) for b, s in zip(starts, shape))]
        mismatch = np.argwhere(got != ref)
        assert mismatch.size == 0, f"case{i}: {len(mismatch)} voxels differ, e.g. {mismatch[:5]}"


def test_exported_classification_bundle_writes_probabilities_like_the_engine(cls_bundle, tmp_path):
    with np.load(PNEUMONIA) as data:
        arrays = {
            "test_images": data["test_images"][:10],
            "test_labels": data["test_labels"][:10],
            "val_images": data["val_images"][:3],
            "val_labels": data["val_labels"][:3],
        }
    npz = tmp_path / "new_cases.npz"
    np.savez(npz, **arrays)
    monai_run(cls_bundle, npz, tmp_path / "pred")
    monai_run(cls_bundle, npz, tmp_path / "pred", split="val")
    net = engine_model(cls_bundle)
    for split, n in (("test", 10), ("val", 3)):
        rows = np.loadtxt(
            tmp_path / "pred" / f"{split}_probabilities.csv", delimiter=",", skiprows=1
        )
        header = (
            (tmp_path / "pred" / f"{split}_probabilities.csv")
            .read_text(encoding="utf-8")
            .splitlines()[0]
        )
        assert header == "index,prob_normal,prob_pneumonia"
        assert rows.shape == (n, 3)
        np.testing.assert_array_equal(rows[:, 0], np.arange(n))
        # reference: the engine's reading (uint8 / 255, channel first) and its softmax
        x = torch.from_numpy(arrays[f"{split}_images"].astype(np.float32) / 255.0)[:, None]
        with torch.no_grad():
            ref = torch.softmax(net(x), 1).numpy()
        np.testing.assert_allclose(rows[:, 1:], ref, atol=2e-6)


@pytest.mark.parametrize("which", ["seg", "cls"])
def test_verify_net_in_out_passes(which, seg_bundle, cls_bundle):
    from monai.bundle import verify_net_in_out

    bundle = seg_bundle if which == "seg" else cls_bundle
    verify_net_in_out(
        "network_def",
        meta_file=str(bundle / "configs" / "metadata.json"),
        config_file=str(bundle / "configs" / "inference.yaml"),
        device="cpu",
    )


def test_small_cnn_bundle_says_it_needs_dpkfc_med(cls_bundle):
    meta = json.loads((cls_bundle / "configs" / "metadata.json").read_text(encoding="utf-8"))
    net_def = yaml.safe_load(
        (cls_bundle / "configs" / "inference.yaml").read_text(encoding="utf-8")
    )["network_def"]
    assert net_def["_target_"] == "dpkfc_med.bundle.build_network"
    assert "dpkfc-med" in meta["required_packages_version"]
    assert "plain MONAI cannot rebuild" in meta["network_definition"]
    assert "pip install dpkfc-med" in (cls_bundle / "docs" / "README.md").read_text(
        encoding="utf-8"
    )


def test_segmentation_bundle_names_an_empty_folder(seg_bundle, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(RuntimeError) as info:
        monai_run(seg_bundle, tmp_path / "empty", tmp_path / "pred")
    chain, err = [], info.value
    while err is not None:
        chain.append(str(err))
        err = err.__cause__
    assert any("no NIfTI image" in m and "pass --dataset_dir FOLDER" in m for m in chain)


def test_incomplete_run_is_refused(seg_run, copy_run, tmp_path):
    run = copy_run(seg_run)
    (run / "model.pt").unlink()
    status = json.loads((run / "run.json").read_text(encoding="utf-8"))
    (run / "run.json").write_text(json.dumps({**status, "status": "incomplete"}), encoding="utf-8")
    with pytest.raises(BundleExportError, match=r"status 'incomplete', not 'complete'") as info:
        export_bundle(run, tmp_path / "out")
    assert "--resume --out" in str(info.value)
    assert not (tmp_path / "out").exists()


def test_over_budget_ledger_is_refused(seg_run, copy_run, tmp_path):
    run = copy_run(seg_run)
    ledger = json.loads((run / "ledger.json").read_text(encoding="utf-8"))
    for event in ledger["events"]:
        event["steps"] *= 50
    (run / "ledger.json").write_text(json.dumps(ledger), encoding="utf-8")
    with pytest.raises(BundleExportError, match=r"exceeds the run's target 8") as info:
        export_bundle(run, tmp_path / "out")
    assert "ledger.json: epsilon" in str(info.value)
    assert not (tmp_path / "out").exists()


def test_missing_ledger_and_non_empty_out_are_refused(seg_run, copy_run, tmp_path):
    run = copy_run(seg_run)
    (run / "ledger.json").unlink()
    with pytest.raises(BundleExportError, match=r"ledger\.json: missing"):
        export_bundle(run, tmp_path / "out")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x", encoding="utf-8")
    with pytest.raises(BundleExportError, match="exists and is not empty"):
        export_bundle(seg_run, tmp_path / "full")


def test_nonprivate_run_is_exported_loudly_marked(nonprivate_run, tmp_path):
    bundle = export_bundle(nonprivate_run, tmp_path / "np")
    meta = json.loads((bundle / "configs" / "metadata.json").read_text(encoding="utf-8"))
    assert metadata_problems(meta) == []
    dp = meta["differential_privacy"]
    assert dp["private"] is False and dp["epsilon_spent"] is None
    for text in (meta["task"], meta["description"], dp["guarantee"], dp["warning"]):
        assert text.startswith(NO_GUARANTEE), text
    assert (
        (bundle / "docs" / "README.md").read_text(encoding="utf-8").startswith(f"# {NO_GUARANTEE}")
    )


def test_cli_bundle_export(seg_run, copy_run, tmp_path, capsys):
    assert main(["bundle", "export", str(seg_run), str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "bundle:" in out
    # the shipped config's data statements travel with the export: the user is asked to check
    meta = json.loads((tmp_path / "b" / "configs" / "metadata.json").read_text(encoding="utf-8"))
    modality = meta["network_data_format"]["inputs"]["image"]["modality"]
    assert f"check: the metadata states modality {modality!r}" in out
    run = copy_run(seg_run)
    (run / "run.json").write_text(json.dumps({"status": "incomplete"}), encoding="utf-8")
    assert main(["bundle", "export", str(run), str(tmp_path / "c")]) == 2
    assert "status 'incomplete'" in capsys.readouterr().err
