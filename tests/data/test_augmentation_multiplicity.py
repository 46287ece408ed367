"""Augmentation multiplicity for classification (``data.augmentations_per_unit``)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from dpkfc_med.data.augment import AugmentedUnits, RandomShiftFlip
from dpkfc_med.data.medmnist import TensorImageDataset
from dpkfc_med.data.units import UnitCollate
from dpkfc_med.privacy.engine import PrivacyEngine
from tests.conftest import SHARED_DATA, summed_clipped, tiny_cnn_2d

C = 1.0
ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "pneumoniamnist_cnn_2d_eps1.yaml"
PNEUMONIA = Path(SHARED_DATA) / "medmnist" / "pneumoniamnist.npz"
needs_data = pytest.mark.skipif(not PNEUMONIA.is_file(), reason="needs PneumoniaMNIST")


def _images(n, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 8, 8, generator=g) * scale, torch.randint(0, 3, (n,), generator=g)


def _engine(model, n=32, method="dp-sgd"):
    x, y = _images(n)
    pm, popt, _ = PrivacyEngine(seed=3).make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=8),
        noise_multiplier=1.0,
        max_grad_norm=C,
        delta=1e-5,
        method=method,
        backward_reduction="sum",
    )
    return pm, popt


def test_the_transform_shifts_and_flips_within_bounds_from_its_own_state():
    image = torch.arange(2 * 6 * 6, dtype=torch.float32).reshape(2, 6, 6)
    t = RandomShiftFlip(max_shift=2)
    views = [t.set_random_state(seed=s)(image) for s in range(40)]
    assert all(v.shape == image.shape for v in views)
    assert len({tuple(v.flatten().tolist()) for v in views}) > 10  # shifts and flips vary
    again = [t.set_random_state(seed=s)(image) for s in range(40)]
    assert all(torch.equal(a, b) for a, b in zip(views, again))  # the state decides
    # a shift by (1, -2): rows move down 1, columns left 2, the border is zero
    _shifted(image, (1, -2))


def _shifted(image, shifts):
    from dpkfc_med.data.augment import _shift

    out = _shift(image, shifts)
    dy, dx = shifts
    want = torch.zeros_like(image)
    want[:, dy:, : image.shape[2] + dx] = image[:, : image.shape[1] - dy, -dx:]
    assert torch.equal(out, want)
    return out


def test_a_units_views_are_its_own_and_never_read_labels():
    x, y = _images(6)
    alone = AugmentedUnits(TensorImageDataset(x, y), 4, RandomShiftFlip(), seed=0)[3]
    other = AugmentedUnits(TensorImageDataset(x, (y + 1) % 3), 4, RandomShiftFlip(), seed=0)
    for u in (0, 1, 2, 4, 5):  # other units drawn first, and other labels
        other[u]
    first = other[3]
    assert torch.equal(first["image"], alone["image"])
    assert not torch.equal(other[3]["image"], alone["image"])  # the unit's next draw is new
    assert first["image"].shape == (4, 1, 8, 8) and first["unit_id"] == "3"
    assert torch.equal(first["label"], ((y[3] + 1) % 3).repeat(4))
    # the engine's look draws apart and counts nothing
    d = AugmentedUnits(TensorImageDataset(x, y), 4, RandomShiftFlip(), seed=0)
    d.peek(3)
    assert torch.equal(d[3]["image"], alone["image"])


def test_sensitivity_stays_c_per_unit_with_four_views(float64):
    """Brute force: each unit's 4 views summed, then clipped; one unit moves the sum by <= C."""
    torch.manual_seed(1)
    x, y = _images(10, scale=30.0)  # large gradients: every unit is clipped
    aug = AugmentedUnits(TensorImageDataset(x, y), 4, RandomShiftFlip(), seed=0)
    items = [aug[u] for u in range(10)]
    collate = UnitCollate(1, (8, 8))
    model = tiny_cnn_2d()
    reference = copy.deepcopy(model)
    pm, popt = _engine(model)

    def clipped(batch):
        return summed_clipped(
            popt,
            lambda: F.cross_entropy(pm(batch["image"]), batch["label"], reduction="sum").backward(),
            batch["unit"],
        )

    full = collate(items)
    assert full["image"].shape[0] == 40 and torch.equal(
        full["unit"], torch.arange(10).repeat_interleave(4)
    )
    got = clipped(full)
    want = 0
    for it in items:  # one backward pass per view, summed per unit, clipped
        parts = []
        for view, label in zip(it["image"], it["label"]):
            reference.zero_grad()
            F.cross_entropy(reference(view[None]), label[None], reduction="sum").backward()
            parts.append(torch.cat([p.grad.flatten() for p in reference.parameters()]))
        unit = torch.stack(parts).sum(0)
        want = want + unit * min(1.0, C / (float(unit.norm()) + 1e-6))
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    x_new, y_new = _images(1, seed=9, scale=100.0)
    new = AugmentedUnits(TensorImageDataset(x_new, y_new), 4, RandomShiftFlip(), seed=1)[0]
    for kind, batch in {
        "remove": collate(items[:9]),
        "add": collate([*items, new]),
        "replace": collate([*items[:9], new]),
    }.items():
        diff = (clipped(batch) - got).norm()
        bound = 2.0 if kind == "replace" else 1.0
        assert 0.5 * C < diff <= bound * C * (1 + 1e-6), f"{kind}: moved by {diff:.6f}"


@needs_data
def test_one_view_is_todays_training_set_and_step_bit_for_bit():
    from dpkfc_med.tasks.classification.task import classification_task
    from dpkfc_med.training.config import load_config

    sets = ["data.max_train=64", "data.max_eval=32", "method=dp-sgd"]
    today = classification_task(load_config(CONFIG, sets))
    one = classification_task(load_config(CONFIG, [*sets, "data.augmentations_per_unit=1"]))
    assert type(one.train_set) is type(today.train_set) and "collate" not in one.extra
    assert one.max_samples_per_unit == today.max_samples_per_unit == 1
    steps = []
    for task in (today, one):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(28 * 28, 2))
        x = torch.stack([task.train_set[i][0] for i in range(16)])
        yy = torch.stack([torch.as_tensor(task.train_set[i][1]) for i in range(16)]).reshape(-1)
        pm, popt, _ = PrivacyEngine(seed=5).make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(task.train_set, batch_size=16),
            noise_multiplier=1.0,
            max_grad_norm=C,
            delta=1e-5,
            method="dp-sgd",
            backward_reduction="sum",
        )
        popt.zero_grad()
        F.cross_entropy(pm(x), yy, reduction="sum").backward()
        popt.step()
        steps.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*steps))


@needs_data
def test_four_views_from_the_cli(tmp_path):
    from dpkfc_med.cli import main
    from dpkfc_med.report import check_report

    overrides = [
        "method=dp-sgd",
        "data.max_train=64",
        "data.max_eval=32",
        "data.augmentations_per_unit=4",
        "training.epochs=1",
        "training.batch_size=32",
        "training.progress=false",
    ]
    out = tmp_path / "run"
    args = ["train", str(CONFIG), "--out", str(out)]
    assert main([*args, *[a for o in overrides for a in ("--set", o)]]) == 0
    report = json.loads((out / "privacy_report.json").read_text(encoding="utf-8"))
    check_report(report)
    assert report["status"] == "complete" and report["data"]["max_samples_per_unit"] == 4
    assert report["data"]["num_train_units"] == 64


def test_views_per_unit_are_refused_for_segmentation():
    from dpkfc_med.training.config import ConfigError, load_config

    cfg = ROOT / "configs" / "hippocampus_unet_3d_eps8.yaml"
    with pytest.raises(ConfigError) as err:
        load_config(cfg, ["data.augmentations_per_unit=2"])
    assert any("segmentation draws data.patches_per_unit" in p for p in err.value.problems)
    with pytest.raises(ConfigError, match="must be"):
        load_config(CONFIG, ["data.augmentations_per_unit=0"])


def test_a_patients_images_each_give_k_views_under_one_unit():
    from dpkfc_med.data.units import UnitImageDataset

    x, y = _images(5)
    groups = [torch.tensor([0, 3]).numpy(), torch.tensor([1]).numpy(), torch.tensor([2, 4]).numpy()]
    patients = UnitImageDataset(x, y, groups, ["p0", "p1", "p2"])
    aug = AugmentedUnits(patients, 3, RandomShiftFlip(), seed=0)
    assert aug.max_images_per_unit == 6
    item = aug[0]
    assert item["unit_id"] == "p0" and item["image"].shape == (6, 1, 8, 8)
    assert item["index"].tolist() == [0, 0, 0, 3, 3, 3]
    assert torch.equal(item["label"], y[[0, 0, 0, 3, 3, 3]])
    batch = UnitCollate(1, (8, 8))([item, aug[1], aug[2]])
    assert batch["unit"].tolist() == [0] * 6 + [1] * 3 + [2] * 6
