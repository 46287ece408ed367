"""Private 3D segmentation: CLI end to end on real hippocampus MRI, evaluation on another
folder, the patient/volume privacy unit, and bad inputs refused before a run starts."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from dpkfc_med.cli import main
from tests.conftest import SHARED_DATA, summed_clipped

HIPPO = Path(SHARED_DATA) / "msd_hippocampus"
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "hippocampus_unet_3d_eps8.yaml"

# The real data must be present (set DPKFC_MED_DATA); a missing folder fails, never skips.
needs_hippo = pytest.mark.usefixtures("_hippo_present")


@pytest.fixture
def _hippo_present() -> None:
    assert (HIPPO / "imagesTr").is_dir(), f"no msd_hippocampus data at {HIPPO}; set DPKFC_MED_DATA"


# A tiny slice of the real data and a tiny UNet: seconds per run on one CPU core.
TINY = [
    "data.max_train=6",
    "data.max_eval=2",
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
    # the shipped config's data-free pretraining, a few steps (tests/training/test_pretrain.py
    # checks pretraining itself)
    "pretrain.steps=4",
    "pretrain.batch_size=2",
]


def _sets(items: list[str]) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """One tiny training run per private method (shared by the tests of this module)."""
    assert (HIPPO / "imagesTr").is_dir(), f"no msd_hippocampus data at {HIPPO}; set DPKFC_MED_DATA"
    out = {}
    for method in ("dp-sgd", "dp-kfc"):
        run = tmp_path_factory.mktemp("seg") / method
        code = main(["train", str(CONFIG), "--out", str(run), "--method", method, *_sets(TINY)])
        assert code == 0
        out[method] = run
    return out


@needs_hippo
@pytest.mark.parametrize("method", ["dp-sgd", "dp-kfc"])
def test_cli_train_writes_report_split_overlays_and_dice(runs, method):
    run = runs[method]
    assert json.loads((run / "run.json").read_text(encoding="utf-8"))["status"] == "complete"
    report = json.loads((run / "privacy_report.json").read_text(encoding="utf-8"))
    assert report["data"]["privacy_unit"] == "patient/volume"
    assert report["data"]["max_samples_per_unit"] == 2
    assert report["data"]["num_train_units"] == 6
    assert report["privacy"]["neighbouring_relation"] == "add or remove one patient/volume"
    assert 0 < report["privacy"]["epsilon"]["prv"] <= 8.0
    if method == "dp-kfc":
        src = report["preconditioner"]["probe_source"]
        assert src["task"] == "segmentation" and src["preset"] == "mri"
        assert src["intensity"]["mode"] == "zscore" and src["spatial_shape"] == [16, 16, 16]
    private = run / "private_not_for_release"  # case ids and patients' images stay here
    split = json.loads((private / "split.json").read_text(encoding="utf-8"))
    assert {k: len(v) for k, v in split.items()} == {"train": 6, "val": 2, "test": 2}
    custodian = json.loads((private / "custodian_report.json").read_text(encoding="utf-8"))
    assert split == custodian["data"]["split"] and "split" not in report["data"]
    assert not set(split["train"]) & (set(split["val"]) | set(split["test"]))
    overlays = sorted((private / "overlays").glob("*.png"))
    assert [p.stem for p in overlays] == split["val"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in overlays)
    assert not (run / "overlays").exists() and not (run / "split.json").exists()
    shareable = "".join(
        (run / f"privacy_report.{ext}").read_text(encoding="utf-8")
        for ext in ("json", "md", "html")
    )
    assert not any(case in shareable for ids in split.values() for case in ids)
    metrics = json.loads((private / "metrics.json").read_text(encoding="utf-8"))
    for part in ("val", "test"):
        m = metrics[part]
        assert 0.0 <= m["mean_dice"] <= 1.0 and m["n"] == 2
        assert set(m["dice_per_class"]) == {"Anterior", "Posterior"}
        assert set(m["hd95_per_class"]) == set(m["hd95_missed_cases"]) == {"Anterior", "Posterior"}


@needs_hippo
def test_cli_evaluate_on_another_folder_uses_all_its_cases(runs, tmp_path, capsys):
    other = tmp_path / "other_site"
    for sub in ("imagesTr", "labelsTr"):
        (other / sub).mkdir(parents=True)
    cases = sorted(p.name for p in (HIPPO / "imagesTr").glob("hippocampus_*.nii.gz"))[-3:]
    for name in cases:
        for sub in ("imagesTr", "labelsTr"):
            os.symlink(HIPPO / sub / name, other / sub / name)
    capsys.readouterr()
    assert main(["evaluate", str(runs["dp-sgd"]), "--data", str(other)]) == 0
    printed = capsys.readouterr().out
    assert "all its cases" in printed
    evals = runs["dp-sgd"] / "private_not_for_release" / "evaluations"
    saved = json.loads((evals / "other_site_all.json").read_text(encoding="utf-8"))
    assert saved["split"] == "all" and saved["n"] == 3
    assert 0.0 <= saved["mean_dice"] <= 1.0
    assert set(saved["dice_per_class"]) == {"class_1", "class_2"}  # no dataset.json: unnamed


@needs_hippo
def test_weight_average_is_released_and_lr_follows_the_cosine_plan(tmp_path):
    from dpkfc_med.engines.schedule import lr_factor

    run = tmp_path / "ema"
    extra = ["training.ema_decay=0.9", "training.lr_schedule=cosine", "training.warmup_steps=1"]
    code = main(
        ["train", str(CONFIG), "--out", str(run), "--method", "dp-sgd", *_sets(TINY + extra)]
    )
    assert code == 0
    report = json.loads((run / "privacy_report.json").read_text(encoding="utf-8"))
    assert report["training"]["weight_average"]["decay"] == 0.9
    assert report["training"]["lr_schedule"] == "cosine"
    ck = torch.load(run / "checkpoint.pt", weights_only=False)
    released = torch.load(run / "model.pt", weights_only=False)["model"]
    steps = report["privacy"]["steps"]
    assert ck["ema"]["updates"] == steps  # one average update per noisy step
    lr = float(ck["optimizer"]["param_groups"][0]["lr"])
    cfg_lr = report["training"]["lr"]
    assert lr == pytest.approx(cfg_lr * lr_factor(steps - 1, steps, "cosine", 1), rel=1e-12)
    for name, value in released.items():  # one epoch: the selected model is the final average
        assert torch.equal(value, ck["ema"]["module"][name]), name
    assert any(not torch.equal(released[k], ck["model"][k]) for k in released)


# ------------------------------------------------------------------------- privacy unit
def _summed_clipped(popt, pm, task, batch):
    """Clipped per-unit sum, before noise, for a collated batch of volumes."""
    x, y, units = task.unpack(batch)
    return summed_clipped(popt, lambda: task.loss(pm(x), y).backward(), units)


@pytest.mark.parametrize("method", ["dp-sgd", "dp-kfc"])
def test_removing_one_patient_moves_clipped_sum_by_at_most_c(method, float64):
    """k = 3 patches per patient: per-patient clipping bounds a patient by C, per-patch does not."""
    from torch import nn

    from dpkfc_med.privacy.engine import PrivacyEngine
    from dpkfc_med.tasks.segmentation.task import SegmentationTask, VolumeCollate

    torch.manual_seed(0)
    k, patch, classes = 3, (6, 6, 6), 3
    collate = VolumeCollate(k, 1, patch)
    task = SegmentationTask(
        kind="segmentation",
        spatial_dims=3,
        in_channels=1,
        num_classes=classes,
        spatial_shape=patch,
        label_names=None,
        train_set=[],  # type: ignore[arg-type]
        data_record={},
        spacing=(1.0, 1.5, 2.0),
        intensity="zscore",
    )
    # 8 patients; the k patches of one patient are overlapping crops, so nearly alike.
    items = []
    for i in range(8):
        base = 20 * torch.randn(1, *patch)
        label = torch.randint(0, classes, (1, *patch))
        image = torch.stack([base + 0.1 * torch.randn_like(base) for _ in range(k)])
        items.append(
            {"image": image, "label": label.expand(k, -1, -1, -1, -1).clone(), "case_id": str(i)}
        )
    model = nn.Sequential(
        nn.Conv3d(1, 4, 3, padding=1), nn.Tanh(), nn.GroupNorm(2, 4), nn.Conv3d(4, classes, 1)
    )
    loader = torch.utils.data.DataLoader(items, batch_size=4, collate_fn=collate)
    probes = task.probe_source(_probe_cfg())
    pm, popt, _ = PrivacyEngine(seed=1).make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=loader,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        delta=1e-5,
        method=method,
        probe_source=probes,
        probe_loss=task.probe_loss,
    )
    full, without = collate(items), collate(items[:-1])
    base = _summed_clipped(popt, pm, task, full)
    moved = (base - _summed_clipped(popt, pm, task, without)).norm()
    assert 1e-3 < moved <= 1.0 + 1e-9
    # Clipping each patch separately lets one patient move the sum by up to k * C.
    x, y, _ = task.unpack(full)
    xr, yr, _ = task.unpack(without)

    def per_patch(xb, yb):
        popt.zero_grad()
        task.loss(pm(xb), yb).backward()
        popt.set_unit_ids(None)
        for p in popt.params:
            p.summed_grad = None
        popt.clip_and_accumulate()
        return torch.cat([p.summed_grad.flatten() for p in popt.params])

    assert (per_patch(x, y) - per_patch(xr, yr)).norm() > 1.0 + 1e-6


@needs_hippo
def test_training_patches_of_a_patient_do_not_depend_on_other_patients_drawn():
    """The task's training set: patient A's n-th draw has the same patches whether or not
    other patients were drawn before it (a stream shared by all patients would differ)."""
    from dpkfc_med.tasks.segmentation.build import build as build_segmentation_task
    from dpkfc_med.training.config import load_config

    cfg = load_config(CONFIG, TINY)

    def train_set():
        return build_segmentation_task(cfg).train_set

    alone = train_set()
    first, second = alone[0], alone[0]
    others = train_set()
    others[1]
    others[2]
    again, again_second = others[0], others[0]  # A's first and second draw, after B and C
    assert again["case_id"] == first["case_id"]
    assert torch.equal(again["image"], first["image"])
    assert torch.equal(again["label"], first["label"])
    assert torch.equal(again_second["image"], second["image"])
    assert not torch.equal(first["image"], second["image"])  # a new draw, new patches


def _probe_cfg():
    from dpkfc_med.training.config import config_from_dict

    return config_from_dict(
        {
            "data": {"path": "x", "task": "segmentation"},
            "probes": {"preset": "mri", "num_probes": 8},
        }
    )


def test_collate_handles_empty_poisson_batch_and_unpack_shapes():
    from dpkfc_med.tasks.segmentation.task import SegmentationTask, VolumeCollate

    collate = VolumeCollate(2, 1, (4, 5, 6))
    empty = collate([])
    assert empty["image"].shape == (0, 2, 1, 4, 5, 6) and empty["label"].dtype == torch.int64
    task = SegmentationTask("segmentation", 3, 1, 3, (4, 5, 6), None, [], {})  # type: ignore[arg-type]
    x, y, units = task.unpack(empty)
    assert x.shape == (0, 1, 4, 5, 6) and y.shape == (0, 4, 5, 6) and units.shape == (0,)
    item = {
        "image": torch.randn(2, 1, 4, 5, 6),
        "label": torch.ones(2, 1, 4, 5, 6, dtype=torch.int64),
        "case_id": "a",
    }
    x, y, units = task.unpack(collate([item, item, item]))
    assert x.shape == (6, 1, 4, 5, 6) and y.shape == (6, 4, 5, 6) and y.dtype == torch.int64
    assert units.tolist() == [0, 0, 1, 1, 2, 2]
    out = torch.randn(6, 3, 4, 5, 6, requires_grad=True)
    assert task.probe_loss(out, y).shape == (6,)


# ------------------------------------------------------------------------- bad inputs
def _write(path: Path, array: np.ndarray) -> None:
    import nibabel as nib

    path.parent.mkdir(parents=True, exist_ok=True)
    nib.save(nib.Nifti1Image(array, np.eye(4)), str(path))


def _folder(root: Path, problem: str) -> Path:
    rng = np.random.default_rng(0)
    ids = ["case_a", "case_b", "case_c", "case_d"]
    for cid in ids:
        _write(root / "imagesTr" / f"{cid}.nii.gz", rng.random((8, 8, 8)).astype(np.float32))
        label = rng.integers(0, 3, (8, 8, 8)).astype(np.uint8)
        if cid == "case_c" and problem == "label value":
            label[0, 0, 0] = 5
        shape_bad = cid == "case_c" and problem == "shape mismatch"
        if not (cid == "case_c" and problem == "image without label"):
            _write(root / "labelsTr" / f"{cid}.nii.gz", label[:, :, :6] if shape_bad else label)
    if problem == "unreadable file":
        (root / "imagesTr" / "case_c.nii.gz").write_bytes(b"\x1f\x8b not a nifti")
    (root / "dataset.json").write_text(
        json.dumps(
            {
                "labels": {"0": "background", "1": "a", "2": "b"},
                "training": [
                    {"image": f"./imagesTr/{c}.nii.gz", "label": f"./labelsTr/{c}.nii.gz"}
                    for c in ids
                    if not (c == "case_c" and problem == "image without label")
                ]
                + (
                    [{"image": "./imagesTr/case_c.nii.gz"}]
                    if problem == "image without label"
                    else []
                ),
            }
        ),
        encoding="utf-8",
    )
    return root


@pytest.mark.parametrize(
    ("problem", "message"),
    [
        ("image without label", "has no 'label'"),
        ("shape mismatch", "label shape"),
        ("label value", "outside the declared classes"),
        ("unreadable file", "unreadable"),
    ],
)
def test_bad_inputs_exit_2_naming_the_case_and_write_no_run(problem, message, tmp_path, capsys):
    folder = _folder(tmp_path / "data", problem)
    out = tmp_path / "run"
    code = main(["train", str(CONFIG), "--out", str(out), "--data", str(folder), *_sets(TINY)])
    err = capsys.readouterr().err
    assert code == 2
    assert "case_c" in err and message in err, err
    assert not (out / "run.json").exists()


def test_folder_too_small_for_the_split_fractions_is_refused(tmp_path, capsys):
    """Four clean cases at 0.7/0.15/0.15: an empty split is named with its fraction and count."""
    folder = _folder(tmp_path / "data", "none")
    out = tmp_path / "run"
    code = main(["train", str(CONFIG), "--out", str(out), "--data", str(folder), *_sets(TINY)])
    err = capsys.readouterr().err
    assert code == 2
    assert "data.split_fractions" in err and "(fraction 0.15) drew none of the 4 cases" in err
    assert not (out / "run.json").exists()


def test_bad_inputs_in_plain_folders_name_the_case(tmp_path, capsys):
    """imagesTr/labelsTr without dataset.json: an image without a label names its case."""
    folder = _folder(tmp_path / "data", "image without label")
    (folder / "dataset.json").unlink()
    out = tmp_path / "run"
    code = main(["train", str(CONFIG), "--out", str(out), "--data", str(folder), *_sets(TINY)])
    err = capsys.readouterr().err
    assert code == 2 and "case_c" in err and "has no label" in err
    assert not (out / "run.json").exists()


def test_training_loss_gives_exact_per_patch_gradients(float64):
    """Opacus' mean-reduction rescaling recovers each patch's own DiceCE gradient."""
    from opacus import GradSampleModule
    from torch import nn

    from dpkfc_med.tasks.segmentation.task import SegmentationTask

    torch.manual_seed(3)
    task = SegmentationTask("segmentation", 3, 1, 3, (4, 4, 4), None, [], {})  # type: ignore[arg-type]
    net = nn.Sequential(nn.Conv3d(1, 3, 3, padding=1))
    x, y = torch.randn(5, 1, 4, 4, 4), torch.randint(0, 3, (5, 4, 4, 4))
    y[1] = 0  # a patch without foreground
    gsm = GradSampleModule(net, loss_reduction="mean")
    task.loss(gsm(x), y).backward()
    per_sample = [p.grad_sample.clone() for p in net.parameters()]
    gsm.disable_hooks()
    for i in range(len(x)):
        net.zero_grad()
        single = torch.autograd.grad(
            task.loss(net(x[i : i + 1]), y[i : i + 1]), list(net.parameters())
        )
        for gs, g in zip(per_sample, single):
            torch.testing.assert_close(gs[i], g)


def _hd95_brute_force(pred: np.ndarray, true: np.ndarray, spacing) -> float:
    """Symmetric HD95 from every pair of surface voxels (surface: mask minus its erosion)."""
    from scipy.ndimage import binary_erosion
    from scipy.spatial.distance import cdist

    def surface(mask):
        return np.argwhere(mask & ~binary_erosion(mask)) * np.asarray(spacing)

    sp, st = surface(pred), surface(true)
    d = cdist(sp, st)
    return max(np.percentile(d.min(1), 95), np.percentile(d.min(0), 95))


def test_hausdorff95_matches_brute_force_and_flags_absent_and_missed_classes():
    from dpkfc_med.tasks.segmentation.task import hausdorff95_scores

    rng = np.random.default_rng(0)
    true = np.zeros((12, 14, 10), dtype=np.int64)
    true[2:8, 3:10, 2:7] = 1
    true[8:11, 4:9, 3:8] = 2
    pred = true.copy()
    pred[rng.random(true.shape) < 0.08] = 1  # scattered false positives far from the surface
    pred[3:5, 4:6, 3:5] = 0
    spacing = [1.0, 0.5, 2.0]
    got = hausdorff95_scores(
        torch.from_numpy(pred)[None, None], torch.from_numpy(true)[None, None], 4, spacing
    )
    for c in (1, 2):
        assert float(got[0, c - 1]) == pytest.approx(
            _hd95_brute_force(pred == c, true == c, spacing), rel=1e-5
        )
    assert torch.isnan(got[0, 2])  # class 3 absent from the ground truth
    missed = pred.copy()
    missed[missed == 2] = 0
    got = hausdorff95_scores(
        torch.from_numpy(missed)[None, None], torch.from_numpy(true)[None, None], 3, spacing
    )
    assert torch.isinf(got[0, 1]) and torch.isfinite(got[0, 0])


def test_label_values_outside_the_config_classes_are_refused_before_pretraining(
    tmp_path, capsys, monkeypatch
):
    """No dataset.json labels, data.num_classes=3: a case with label 5 is named at once."""
    import dpkfc_med.training.pretrain as loop

    def never(*args, **kwargs):
        raise AssertionError("pretraining started before the cases were validated")

    monkeypatch.setattr(loop, "pretrain_synthetic", never)
    folder = _folder(tmp_path / "data", "label value")
    (folder / "dataset.json").unlink(missing_ok=True)
    out = tmp_path / "run"
    args = ["train", str(CONFIG), "--out", str(out), "--data", str(folder)]
    sets = [*TINY, "data.num_classes=3", "pretrain.steps=1000"]
    assert main([*args, *_sets(sets)]) == 2
    err = capsys.readouterr().err
    assert "case_c" in err and "5" in err and not out.exists()


def test_mixed_channel_counts_name_the_files(tmp_path, capsys):
    folder = _folder(tmp_path / "data", "none")
    two = np.random.default_rng(1).random((8, 8, 8, 2)).astype(np.float32)
    _write(folder / "imagesTr" / "case_b.nii.gz", two)
    out = tmp_path / "run"
    args = ["train", str(CONFIG), "--out", str(out), "--data", str(folder)]
    assert main([*args, *_sets([*TINY, "data.num_classes=3"])]) == 2
    err = capsys.readouterr().err
    assert "different channel counts" in err and "case_b.nii.gz" in err and not out.exists()


def test_a_multichannel_folder_pretrains_and_trains(tmp_path):
    """4-D NIfTI images (two channels, last axis): data-free pretraining draws two channels."""
    import torch

    folder = tmp_path / "data"
    rng = np.random.default_rng(0)
    for cid in ("case_a", "case_b", "case_c", "case_d", "case_e", "case_f"):
        _write(folder / "imagesTr" / f"{cid}.nii.gz", rng.random((8, 8, 8, 2)).astype(np.float32))
        label = rng.integers(0, 3, (8, 8, 8)).astype(np.uint8)
        _write(folder / "labelsTr" / f"{cid}.nii.gz", label)
    out = tmp_path / "run"
    sets = [*TINY, "data.num_classes=3", "pretrain.steps=2", "pretrain.batch_size=2"]
    sets += ["data.split_fractions=[0.5,0.25,0.25]"]
    args = ["train", str(CONFIG), "--out", str(out), "--data", str(folder), *_sets(sets)]
    assert main(args) == 0
    saved = torch.load(out / "model.pt", weights_only=False)
    assert saved["task"]["in_channels"] == 2
    first = next(v for k, v in saved["model"].items() if v.dim() == 5)
    assert first.shape[1] == 2  # the first convolution reads both channels
