"""A bundle's privacy units: ids of the unit alone, draws untouched by the engine's first look.

Neighbouring data lists (one item removed) must leave every other unit's random crops, and so
its clipped gradient, unchanged: a unit's id is a digest of its own data-list entry, never its
position, and the loader's and the preconditioner's look at the data's structure before the
first step draws from a stream no training draw uses.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from dpkfc_med.bundle.zoo import BundleConfigError, prepare_bundle
from dpkfc_med.data import resolve_data_path

BUNDLE = Path(__file__).parent / "zoo_bundle"


@pytest.fixture(scope="module")
def data_dir() -> str:
    return str(resolve_data_path("msd_hippocampus", kind="dir"))


def _data(first: int, count: int) -> str:
    return (
        f"train#dataset#data=$[{{'image': i, 'label': l}} for i, l in "
        f"zip(@images[{first}:{first + count}], @labels[{first}:{first + count}])]"
    )


def _crops(data_dir: str, first: int, count: int) -> dict[str, list[float]]:
    """Per unit id: the sums of its first draw's crops (seed 3)."""
    b = prepare_bundle(
        BUNDLE, epsilon=8, overrides=[f"dataset_dir={data_dir}", _data(first, count)],
        settings=["training.seed=3"],
    )  # fmt: skip
    ds = b.task.train_set
    return {
        Path(ds.units[uid][0]["image"]).name: [float(s["image"].sum()) for s in ds[i]]
        for i, uid in enumerate(ds.ids)
    }


def test_removing_one_item_leaves_every_other_units_crops_unchanged(data_dir):
    """Items 0-4 against items 1-4: the four shared items crop exactly as before."""
    with_first = _crops(data_dir, 0, 5)
    without_first = _crops(data_dir, 1, 4)
    assert len(with_first) == 5 and len(without_first) == 4
    for name, sums in without_first.items():
        assert sums == with_first[name], name


def test_unit_ids_are_digests_of_the_item_not_its_position(data_dir):
    a = prepare_bundle(BUNDLE, epsilon=8, overrides=[f"dataset_dir={data_dir}", _data(0, 3)])
    b = prepare_bundle(BUNDLE, epsilon=8, overrides=[f"dataset_dir={data_dir}", _data(1, 2)])
    assert set(b.task.train_set.ids) < set(a.task.train_set.ids)
    assert all(uid.startswith("item-") for uid in a.task.train_set.ids)
    assert b.task.privacy_unit == "image"
    keyed = prepare_bundle(
        BUNDLE, epsilon=8, unit_key="patient_id",
        overrides=[f"dataset_dir={data_dir}",
                   "train#dataset#data=$[{'image': i, 'label': l, 'patient_id': n // 2} for n, "
                   "(i, l) in enumerate(zip(@images[:4], @labels[:4]))]"],
    )  # fmt: skip
    assert keyed.task.privacy_unit == "patient"


def test_an_item_listed_twice_is_refused_naming_both(data_dir):
    twice = "train#dataset#data=$[{'image': @images[0], 'label': @labels[0]}] * 2"
    with pytest.raises(
        BundleConfigError, match=r"item 1 \(hippocampus_\d+\.nii\.gz\) repeats item 0"
    ):
        prepare_bundle(BUNDLE, epsilon=8, overrides=[f"dataset_dir={data_dir}", twice])


@pytest.mark.parametrize("method", ["dp-sgd", "dp-kfc"])
def test_the_engines_first_look_uses_up_no_draw(data_dir, method):
    """After make_private (loader and, for DP-KFC, the probe-shape check), draw 0 is intact."""
    from dpkfc_med.privacy.engine import PrivacyEngine

    overrides = [f"dataset_dir={data_dir}", _data(0, 3)]
    fresh = prepare_bundle(BUNDLE, epsilon=8, overrides=overrides, settings=["training.seed=5"])
    expected = [float(s["image"].sum()) for s in fresh.task.train_set[0]]
    b = prepare_bundle(BUNDLE, epsilon=8, overrides=overrides, settings=["training.seed=5"])
    task = b.task
    PrivacyEngine(seed=1).make_private(
        module=b.network,
        optimizer=torch.optim.SGD(b.network.parameters(), lr=0.1),
        data_loader=DataLoader(task.train_set, batch_size=2, collate_fn=task.extra["collate"]),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        delta=1e-5,
        method=method,
        probe_source=task.probe_source(b.cfg) if method == "dp-kfc" else None,
        probe_loss=task.probe_loss if method == "dp-kfc" else None,
        preconditioner=b.cfg.preconditioner_config() if method == "dp-kfc" else None,
    )
    assert task.train_set.draws.counts == {}
    assert [float(s["image"].sum()) for s in task.train_set[0]] == expected


def test_a_look_at_a_volume_dataset_counts_no_draw():
    """The same contract for the YAML path's datasets (volumes and unit image sets)."""
    from dpkfc_med.data.units import UnitImageDataset
    from dpkfc_med.privacy.loader import first_item

    class Noisy:
        def __init__(self) -> None:
            self.state = np.random.RandomState(0)

        def set_random_state(self, seed=None, state=None):
            self.state = state

        def __call__(self, image):
            return image + float(self.state.rand())

    images, labels = torch.zeros(4, 1, 2, 2), torch.zeros(4, dtype=torch.int64)
    groups = [np.array([0, 1]), np.array([2, 3])]
    ds = UnitImageDataset(images, labels, groups, ["a", "b"], transform=Noisy(), seed=0)
    look = first_item(ds)
    assert ds.draws.counts == {}
    first = ds[0]
    assert ds.draws.counts == {"a": 1}
    assert not torch.equal(look["image"], first["image"])  # the look stream is not draw 0
    again = UnitImageDataset(images, labels, groups, ["a", "b"], transform=Noisy(), seed=0)
    assert torch.equal(again[0]["image"], first["image"])


def test_equal_in_memory_items_are_separate_units_and_files_listed_twice_are_not():
    """Equal arrays (a dataset's duplicate images) stay separate units; a file twice is refused."""
    from dpkfc_med.bundle.zoo_task import _units

    a, b = np.zeros((1, 2, 2)), np.ones((1, 2, 2))
    units = _units(
        [{"image": a, "label": 0}, {"image": b, "label": 1}, {"image": a, "label": 0}], None
    )
    assert len(units) == 3
    fewer = _units([{"image": b, "label": 1}, {"image": a, "label": 0}], None)
    assert set(fewer) < set(units)  # removing one item moves no other unit's id
    with pytest.raises(BundleConfigError, match=r"item 2 \(x\.nii\.gz\) repeats item 0"):
        _units([{"image": "x.nii.gz"}, {"image": "y.nii.gz"}, {"image": "x.nii.gz"}], None)


def test_a_caching_bundle_reads_each_item_once_and_draws_the_same_crops(data_dir):
    """CacheDataset (cache_rate > 0): the deterministic part is kept; the samples do not change."""
    overrides = [f"dataset_dir={data_dir}", _data(0, 3)]

    def draws(rate: float):
        b = prepare_bundle(
            BUNDLE, epsilon=8, overrides=[*overrides, f"train#dataset#cache_rate={rate}"],
            settings=["training.seed=4"],
        )  # fmt: skip
        ds = b.task.train_set
        sums = [[float(s["image"].sum()) for s in ds[i]] for i in (0, 1, 0, 2, 0)]
        return ds, sums

    plain, expected = draws(0.0)
    cached, got = draws(1.0)
    assert plain.prefix is None and cached.prefix is not None
    assert len(cached._cache) == 3  # one deterministic result per item, read once
    assert got == expected
