"""Private 2D segmentation: PNG and 2-D NIfTI folders and slices of volumes train end to end;
a patient's slices are one privacy unit; 2D Dice and HD95 against hand-computed values; layout
mistakes are refused before a run starts, naming the field or the file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dpkfc_med.cli import main
from tests.conftest import SHARED_DATA, summed_clipped
from tests.data.test_data_images2d import png_folder

HIPPO = Path(SHARED_DATA) / "msd_hippocampus"
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "hippocampus_unet_2d_eps8.yaml"

# Tiny 2D runs: seconds each on one CPU core.
TINY = [
    "data.max_train=6",
    "data.max_eval=2",
    "data.slices.per_unit=8",
    "training.epochs=1",
    "training.batch_size=3",
    "training.eval_batch_size=16",
    "training.progress=false",
    "model.kwargs.channels=[4,8]",
    "model.kwargs.strides=[2]",
    "probes.num_probes=4",
    "preconditioner.chunk_size=2",
    "preconditioner.calibration_samples=2",
    "pretrain.steps=2",
    "pretrain.batch_size=2",
    "pretrain.cache_dir=null",
    "privacy.accountant=rdp",
]
FOLDER_2D = [  # a folder of 2D images instead of slices of the hippocampus volumes
    "data.slices.axis=null",
    "data.patch_size=[16,16]",
    "data.num_classes=3",
    "data.split_fractions=[0.5,0.25,0.25]",
    "data.patches_per_unit=2",
]


def _sets(items: list[str]) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


def nifti_2d_folder(root: Path, n: int = 12) -> Path:
    """``n`` 2-D NIfTI cases, every other one stored as ``(X, Y, 1)``."""
    import nibabel as nib

    rng = np.random.default_rng(2)
    for sub in ("imagesTr", "labelsTr"):
        (root / sub).mkdir(parents=True)
    for i in range(n):
        label = np.zeros((20, 24), np.uint8)
        r, c = rng.integers(2, 12, 2)
        label[r : r + 6, c : c + 7] = 1 + i % 2
        image = (rng.normal(60, 10, label.shape) + 80 * (label > 0)).astype(np.float32)
        shape = (20, 24, 1) if i % 2 else (20, 24)
        for sub, arr in (("imagesTr", image), ("labelsTr", label)):
            nib.save(
                nib.Nifti1Image(arr.reshape(shape), np.eye(4)), str(root / sub / f"c{i}.nii.gz")
            )
    return root


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """One tiny run per kind of 2D data (shared by the tests of this module)."""
    assert (HIPPO / "imagesTr").is_dir(), f"no msd_hippocampus data at {HIPPO}; set DPKFC_MED_DATA"
    base = tmp_path_factory.mktemp("seg2d")
    data = {
        "png": png_folder(base / "png", n=12),
        "nifti": nifti_2d_folder(base / "nifti"),
    }
    out = {}
    for kind in ("png", "nifti", "slices"):
        run = base / f"run_{kind}"
        extra = [] if kind == "slices" else [f"data.path={data[kind]}", *FOLDER_2D]
        if kind == "slices":
            extra = ["data.slices.per_unit=3", "data.patch_size=[44,56]"]
        code = main(["train", str(CONFIG), "--out", str(run), *_sets(TINY + extra)])
        assert code == 0
        out[kind] = run
    return out


@pytest.mark.parametrize("kind", ["png", "nifti", "slices"])
def test_cli_trains_2d_data_end_to_end(runs, kind):
    run = runs[kind]
    assert json.loads((run / "run.json").read_text(encoding="utf-8"))["status"] == "complete"
    report = json.loads((run / "privacy_report.json").read_text(encoding="utf-8"))
    data = report["data"]
    assert report["task"]["spatial_dims"] == 2 and data["spatial_dims"] == 2
    assert 0 < report["privacy"]["epsilon"]["prv"] <= 8.0
    private = run / "private_not_for_release"
    metrics = json.loads((private / "metrics.json").read_text(encoding="utf-8"))["test"]
    assert 0.0 <= metrics["mean_dice"] <= 1.0 and metrics["n"] == data["splits"]["test"] > 0
    assert set(metrics["hd95_per_class"]) == set(metrics["dice_per_class"])
    overlays = sorted((private / "overlays").glob("*.png"))
    split = json.loads((private / "split.json").read_text(encoding="utf-8"))
    assert [p.stem for p in overlays] == split["val"]
    if kind == "slices":
        assert data["privacy_unit"] == "patient/volume (all of its slices)"
        assert data["max_samples_per_unit"] == 3 and data["slices"]["axis"] == 2
        assert data["num_train_units"] == 6  # patients, not slices
        assert metrics["per"].startswith("volume")  # Dice and HD95 per patient
        assert data["patch_size"] == [44, 56]
        assert metrics["hd95_unit"].startswith("mm")
    else:
        assert data["privacy_unit"] == "image (one case of the folder)"
        assert data["max_samples_per_unit"] == 2
        assert metrics["hd95_unit"].startswith("pixels" if kind == "png" else "mm")


def test_cli_evaluate_reports_slices_per_volume(runs):
    assert main(["evaluate", str(runs["slices"])]) == 0
    evals = runs["slices"] / "private_not_for_release" / "evaluations"
    result = json.loads((evals / "msd_hippocampus_test.json").read_text(encoding="utf-8"))
    assert result["n"] >= 2 and result["per"].startswith("volume") and not result["not_dp"]


# ------------------------------------------------------------------------- privacy unit
def _slice_items(num: int, rule, seed: int = 0) -> list[dict]:
    """``num`` patients whose volumes differ in depth, each cut by ``rule`` into 2D slices."""
    from dpkfc_med.data.slices import RandSlicesd

    gen = torch.Generator().manual_seed(seed)
    cut = RandSlicesd(rule)
    cut.set_random_state(seed)
    items = []
    for i in range(num):
        depth = 2 + i % 4
        image = 10 * torch.randn(1, 6, 6, depth, generator=gen)
        label = torch.randint(0, 3, (1, 6, 6, depth), generator=gen)
        slices = cut({"image": image, "label": label, "case_id": str(i)})
        items.append(
            {
                "image": torch.stack([s["image"] for s in slices]),
                "label": torch.stack([s["label"] for s in slices]),
                "case_id": str(i),
            }
        )
    return items


@pytest.mark.parametrize("per_unit", [4, None], ids=["k4", "all_slices"])
@pytest.mark.parametrize("method", ["dp-sgd", "dp-kfc"])
def test_removing_one_patient_moves_clipped_sum_of_its_slices_by_at_most_c(
    method, per_unit, float64
):
    """Brute force: every neighbour (each patient removed in turn) moves the sum by <= C."""
    from torch import nn

    from dpkfc_med.data.slices import SliceRule
    from dpkfc_med.privacy.engine import PrivacyEngine
    from dpkfc_med.tasks.segmentation.task import SegmentationTask, VolumeCollate
    from dpkfc_med.training.config import config_from_dict

    torch.manual_seed(0)
    classes, plane = 3, (6, 6)
    items = _slice_items(6, SliceRule(axis=2, per_unit=per_unit))
    collate = VolumeCollate(per_unit, 1, plane)
    task = SegmentationTask("segmentation", 2, 1, classes, plane, None, [], {})  # type: ignore[arg-type]
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.Tanh(), nn.GroupNorm(2, 4), nn.Conv2d(4, classes, 1)
    )
    loader = torch.utils.data.DataLoader(items, batch_size=3, collate_fn=collate)
    cfg = config_from_dict(
        {"data": {"path": "x", "task": "segmentation"}, "probes": {"num_probes": 8}}
    )
    task.spacing, task.intensity = (1.0, 1.0), "zscore"
    pm, popt, _ = PrivacyEngine(seed=1).make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=loader,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        delta=1e-5,
        method=method,
        probe_source=task.probe_source(cfg),
        probe_loss=task.probe_loss,
    )

    def clipped_sum(batch_items):
        x, y, units = task.unpack(collate(batch_items))
        assert x.shape[1:] == (1, *plane) and len(units) == len(x)
        return summed_clipped(popt, lambda: task.loss(pm(x), y).backward(), units)

    full = clipped_sum(items)
    moves = [(full - clipped_sum(items[:i] + items[i + 1 :])).norm() for i in range(len(items))]
    assert max(moves) <= 1.0 + 1e-9, moves
    assert min(moves) > 1e-3
    # the same slices clipped one by one: a patient moves the sum by more than C
    x, y, _ = task.unpack(collate(items))
    xr, yr, _ = task.unpack(collate(items[:-1]))

    def per_slice(xb, yb):
        return summed_clipped(popt, lambda: task.loss(pm(xb), yb).backward(), None)

    assert (per_slice(x, y) - per_slice(xr, yr)).norm() > 1.0 + 1e-6


def test_a_patients_slices_do_not_depend_on_other_patients_drawn(tmp_path):
    """Through the task's own training set: patient A's n-th draw takes the same slices
    whether or not other patients were drawn before it."""
    from dpkfc_med.tasks.segmentation.build import build as build_segmentation_task
    from dpkfc_med.training.config import load_config

    cfg = load_config(CONFIG, [*TINY, "data.slices.per_unit=3", f"output.dir={tmp_path}"])
    alone = build_segmentation_task(cfg).train_set
    first, second = alone[0], alone[0]
    others = build_segmentation_task(cfg).train_set
    _ = others[1], others[2]  # other patients drawn before A's draws
    again, again_second = others[0], others[0]
    assert first["image"].shape == (3, 1, 44, 56)
    assert torch.equal(again["image"], first["image"]) and torch.equal(
        again["label"], first["label"]
    )
    assert torch.equal(again_second["image"], second["image"])
    assert not torch.equal(first["image"], second["image"])


# ------------------------------------------------------------------------- 2D metrics
def test_2d_dice_and_hd95_against_a_hand_computed_case():
    """A 4x4 square and the same square moved one pixel along x (spacing 2 mm along x).

    Dice = 2 * 12 / (16 + 16) = 0.75. Surfaces (mask minus erosion) are the 12-pixel rings;
    half of each ring's pixels lie on the other ring (distance 0), the rest one pixel away
    along x, so the 95th percentile of the distances both ways is 1 pixel = 2 mm.
    """
    from dpkfc_med.tasks.segmentation.task import dice_scores, hausdorff95_scores

    label = torch.zeros(1, 1, 10, 9, dtype=torch.int64)
    label[0, 0, 2:6, 2:6] = 1
    pred = torch.roll(label, 1, dims=2)
    assert dice_scores(pred, label, 3)[0, 0].item() == pytest.approx(0.75)
    hd = hausdorff95_scores(pred, label, 3, spacing=(2.0, 1.0))
    assert hd[0, 0].item() == pytest.approx(2.0)
    assert torch.isnan(hd[0, 1])  # class 2 absent from the ground truth
    label[0, 0, 7:9, 6:8] = 2  # present in the truth, missed by the prediction
    assert torch.isinf(hausdorff95_scores(pred, label, 3, spacing=(2.0, 1.0))[0, 1])
    assert dice_scores(pred, label, 3)[0, 1].item() == 0.0


# ------------------------------------------------------------------------- refusals
def _volume_folder(root: Path) -> Path:
    """Four tiny 3-D cases (no dataset.json: the classes come from the config)."""
    import nibabel as nib

    rng = np.random.default_rng(0)
    for sub in ("imagesTr", "labelsTr"):
        (root / sub).mkdir(parents=True)
    for i in range(4):
        nib.save(
            nib.Nifti1Image(rng.random((8, 8, 6)).astype(np.float32), np.eye(4)),
            str(root / "imagesTr" / f"v{i}.nii.gz"),
        )
        nib.save(
            nib.Nifti1Image(rng.integers(0, 3, (8, 8, 6)).astype(np.uint8), np.eye(4)),
            str(root / "labelsTr" / f"v{i}.nii.gz"),
        )
    return root


@pytest.mark.parametrize(
    ("data", "overrides", "message"),
    [
        (
            "volumes",
            ["data.slices.axis=null", "data.patch_size=[8,8]"],
            "cases do not fit the run (case v0: image v0.nii.gz is 3-D (8, 8, 6); case v1: image "
            "v1.nii.gz is 3-D (8, 8, 6); case v2: image v2.nii.gz is 3-D (8, 8, 6); ...): the run "
            "is 2D; train on its slices with data.slices.axis",
        ),
        (
            "volumes",
            ["data.patch_size=[8,8,8]"],
            "data.patch_size=[8, 8, 8]: the run is 2D, so it needs 2 values (the in-plane slice",
        ),
        ("volumes", ["data.patches_per_unit=2"], "data.patches_per_unit=2 with data.slices"),
        (
            "volumes",
            ["data.spatial_dims=3"],
            "data.spatial_dims=3 with data.slices: slices train a 2D network",
        ),
        ("volumes", ["data.slices.axis=3"], "data.slices.axis=3: must be 0, 1 or 2"),
        (
            "volumes",
            ["data.spacing=[1.0,1.0,1.0]"],
            "data.spacing=[1.0, 1.0, 1.0]: must be 2 positive numbers in mm (in-plane",
        ),
        (
            "png",
            ["data.patch_size=[8,8]"],
            "holds 2D PNG / JPEG images, not volumes to slice; set data.slices to null "
            "(--set data.slices=null)",
        ),
        (
            "png",
            ["data.slices.axis=null", "data.patch_size=[8,8,8]"],
            "holds 2D PNG / JPEG images; give 2 values",
        ),
        (
            "png",
            ["data.slices.axis=null", "data.patch_size=[8,8]", "data.num_classes=null"],
            "data.num_classes: required",
        ),
    ],
)
def test_layout_mistakes_exit_2_naming_the_field_or_file(
    data, overrides, message, tmp_path, capsys
):
    folder = _volume_folder(tmp_path / "v") if data == "volumes" else png_folder(tmp_path / "p")
    out = tmp_path / "run"
    sets = _sets([*TINY, "data.split_fractions=[0.5,0.25,0.25]", "data.num_classes=3", *overrides])
    code = main(["train", str(CONFIG), "--out", str(out), "--data", str(folder), *sets])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert not (out / "run.json").exists()


def test_images_with_different_channels_are_refused_naming_the_files(tmp_path, capsys):
    from PIL import Image

    folder = png_folder(tmp_path / "p", n=6)
    Image.fromarray(np.zeros((24, 20, 3), np.uint8)).save(folder / "images" / "case4.png")
    sets = _sets([*TINY, *FOLDER_2D])
    code = main(
        ["train", str(CONFIG), "--out", str(tmp_path / "run"), "--data", str(folder), *sets]
    )
    err = capsys.readouterr().err
    assert code == 2 and "cases have different channel counts" in err, err
    assert "3 channel(s): case4.png" in err


def test_every_slice_makes_the_count_per_patient_a_private_fact(tmp_path):
    """per_unit: null: a volume's samples are all its slices; the bound is not published."""
    from dpkfc_med.tasks.segmentation.build import build as build_segmentation_task
    from dpkfc_med.training.config import load_config

    cfg = load_config(CONFIG, [*TINY, "data.slices.per_unit=null", f"output.dir={tmp_path}"])
    task = build_segmentation_task(cfg)
    depths = [task.extra["cases"][c].shape[2] for c in task.extra["split_ids"]["train"]]
    assert not task.max_samples_public and task.max_samples_per_unit == max(depths)
    item = task.train_set[0]
    assert item["image"].shape == (depths[0], 1, 44, 56)
    batch = task.extra["collate"]([task.train_set[0], task.train_set[1]])
    x, y, units = task.unpack(batch)
    assert units.tolist() == [0] * depths[0] + [1] * depths[1] and y.shape == (len(x), 44, 56)


def test_slices_are_refused_for_classification():
    from dpkfc_med.tasks.build import build_task
    from dpkfc_med.training.config import ConfigError, config_from_dict

    cfg = config_from_dict({"data": {"path": "pneumoniamnist", "slices": {"axis": 2}}})
    with pytest.raises(ConfigError, match="data.slices: applies to segmentation"):
        build_task(cfg)
