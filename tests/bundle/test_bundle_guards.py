"""What a bundle may not do to the guarantee, refused or contained before any budget is spent.

Handlers write only into the custodian folder; values computed from the private data lists,
evaluation lists that repeat training items, labels outside the declared classes, a network
with the wrong output count and a misspelled component are refused by id, before a run folder
exists.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from dpkfc_med.bundle.guards import data_dependent_inputs
from dpkfc_med.bundle.zoo import BundleConfigError, load_bundle, prepare_bundle, train_bundle
from dpkfc_med.cli import main
from dpkfc_med.data import resolve_data_path

BUNDLE = Path(__file__).parent / "zoo_bundle"
DS_MEAN = (
    "ds_mean=$float(sum(monai.transforms.LoadImage(image_only=True)(f).mean() "
    "for f in @images[:@num_train]))"
)
SUBTRAHEND = "train#preprocessing#transforms#1#subtrahend"


@pytest.fixture(scope="module")
def data_dir() -> str:
    return str(resolve_data_path("msd_hippocampus", kind="dir"))


def _base(data_dir: str, n: int = 4) -> list[str]:
    return [f"dataset_dir={data_dir}", f"num_train={n}", "train#trainer#max_epochs=1"]


def test_kept_handlers_write_only_into_the_custodian_folder(data_dir, tmp_path):
    """MetricsSaver's save_dir (per-case Dice with image paths) lands in the custodian folder."""
    outside = tmp_path / "outside"
    out = tmp_path / "run"
    saver = (
        "validate#handlers=[{'_target_': 'MetricsSaver', 'save_dir': '" + str(outside) + "', "
        "'metrics': '*', 'metric_details': '*'}]"
    )
    args = [
        "bundle",
        "train",
        str(BUNDLE),
        "--epsilon",
        "8",
        "--recipe",
        "bundle",
        "--out",
        str(out),
    ]
    for o in [*_base(data_dir, 3), saver, "validate#dataset#data=$[{'image': @images[-1], "
              "'label': @labels[-1]}]"]:  # fmt: skip
        args += ["--override", o]
    assert main([*args, "--set", "training.progress=false"]) == 0
    assert not outside.exists()
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert written and all(p.is_relative_to(out) for p in written)
    saved = out / "private_not_for_release" / "bundle_handlers" / "validate_0_MetricsSaver"
    assert (saved / "metrics.csv").is_file()
    details = (saved / "val_mean_dice_raw.csv").read_text(encoding="utf-8").splitlines()
    assert len(details) == 2  # one row per validation case: custodian only
    report = json.loads((out / "privacy_report.json").read_text(encoding="utf-8"))
    assert any("MetricsSaver (validation)" in item for item in report["privacy"]["not_covered"])
    shareable = [p for p in written if "private_not_for_release" not in p.parts]
    assert shareable and not any(
        "val_mean_dice_raw" in p.read_text(errors="ignore") for p in shareable
    )


@pytest.mark.parametrize(
    ("handlers", "match"),
    [
        ("[{'_target_': 'my_site.LossLogger', 'path': '/tmp/losses.csv'}]",
         r"validate#handlers#0 \(my_site\.LossLogger\): a handler the private engine does not "
         r"know"),
        ("[{'_target_': 'EarlyStopHandler', 'patience': 2}]",
         r"validate#handlers#0 \(EarlyStopHandler\): refused: it stops training"),
        ("[{'_target_': 'MetricsSaver', 'save_dir': '.', }, {'_target_': "
         "'TensorBoardStatsHandler', 'summary_writer': '$object()'}]",
         r"validate#handlers#1 \(TensorBoardStatsHandler\): summary_writer would write"),
        ("$[]", r"validate#handlers: given as '\$\[\]', not a list"),
    ],
)  # fmt: skip
def test_handlers_that_could_write_anywhere_are_refused_by_id(data_dir, handlers, match):
    with pytest.raises(BundleConfigError, match=match):
        prepare_bundle(
            BUNDLE, epsilon=8, overrides=[*_base(data_dir), f"validate#handlers={handlers}"]
        )


def test_values_computed_from_the_data_lists_are_refused_or_listed(data_dir):
    overrides = [*_base(data_dir), DS_MEAN, f"{SUBTRAHEND}=@ds_mean"]
    assert data_dependent_inputs(load_bundle(BUNDLE, overrides)) == [
        f"{SUBTRAHEND}: @ds_mean -> @images"
    ]
    with pytest.raises(BundleConfigError, match=rf"{SUBTRAHEND}: @ds_mean -> @images: computed"):
        prepare_bundle(BUNDLE, epsilon=8, overrides=overrides)
    # statistics of the dataset object itself (a CacheDataset), through a second reference
    via_dataset = [*_base(data_dir), "stats=$len(@train#dataset)", "loss#lambda_ce=$@stats / 10"]
    with pytest.raises(BundleConfigError, match=r"loss#lambda_ce: @stats -> @train#dataset"):
        prepare_bundle(BUNDLE, epsilon=8, overrides=via_dataset)
    b = prepare_bundle(BUNDLE, epsilon=8, overrides=overrides, allow_data_dependent=[SUBTRAHEND])
    assert b.task.data_record["bundle"]["data_dependent_inputs"] == [
        f"{SUBTRAHEND}: @ds_mean -> @images"
    ]
    with pytest.raises(BundleConfigError, match="--allow-data-dependent loss: no value"):
        prepare_bundle(BUNDLE, epsilon=8, overrides=_base(data_dir), allow_data_dependent=["loss"])
    # plain settings the data list reads (the folder, the count) are configuration, not data
    assert data_dependent_inputs(load_bundle(BUNDLE, _base(data_dir))) == []


def test_a_validation_list_of_training_images_is_refused(data_dir):
    same = (
        "validate#dataset#data=$[{'image': i, 'label': l} for i, l in "
        "zip(@images[:2], @labels[:2])]"
    )
    with pytest.raises(BundleConfigError, match=r"validate#dataset#data: 2 of its 2 items are "
                       r"training items"):  # fmt: skip
        prepare_bundle(BUNDLE, epsilon=8, overrides=[*_base(data_dir), same])


def _folder_with_label_7(data_dir: str, tmp_path: Path) -> Path:
    folder = tmp_path / "cases"
    for sub in ("imagesTr", "labelsTr"):
        (folder / sub).mkdir(parents=True)
    for name in ("hippocampus_001.nii.gz", "hippocampus_004.nii.gz", "hippocampus_006.nii.gz"):
        shutil.copy(Path(data_dir) / "imagesTr" / name, folder / "imagesTr" / name)
        label = nib.load(Path(data_dir) / "labelsTr" / name)
        values = np.asarray(label.dataobj).astype(np.uint8)
        if name == "hippocampus_004.nii.gz":
            values[values == 2] = 7
        nib.save(nib.Nifti1Image(values, label.affine), folder / "labelsTr" / name)
    return folder


def test_labels_and_outputs_are_checked_before_a_run_folder_exists(data_dir, tmp_path):
    folder = _folder_with_label_7(data_dir, tmp_path)
    out = tmp_path / "run"
    with pytest.raises(BundleConfigError, match=r"item 1 \(hippocampus_004\.nii\.gz\): label "
                       r"value\(s\) 7 outside the 3 classes 0\.\.2"):  # fmt: skip
        train_bundle(
            BUNDLE,
            epsilon=8,
            out=out,
            overrides=[*_base(str(folder), 3), "validate#dataset#data=$[]"],
        )
    assert not out.exists()
    with pytest.raises(BundleConfigError, match="network_def: the network gives 2 output channels "
                       "but configs/metadata.json declares 3 classes"):  # fmt: skip
        train_bundle(BUNDLE, epsilon=8, out=out,
                     overrides=[*_base(data_dir, 2), "network_def#out_channels=2"])  # fmt: skip
    assert not out.exists()


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("network_def#_target_=UNett", r"network_def: _target_ 'UNett' .*did you mean 'UNet'"),
        ("loss#_target_=DiceCELos", r"loss: _target_ 'DiceCELos' .*did you mean 'DiceCELoss'"),
        ("train#preprocessing#transforms#0#_target_=LoadImaged2",
         r"train#preprocessing: _target_ 'LoadImaged2' .*did you mean 'LoadImaged'"),
    ],
)  # fmt: skip
def test_a_misspelled_component_names_the_id_and_the_closest_name(data_dir, override, match):
    with pytest.raises(BundleConfigError, match=match):
        prepare_bundle(BUNDLE, epsilon=8, overrides=[*_base(data_dir), override])
