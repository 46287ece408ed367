"""The data-format registry: detection by file names, ambiguity as an error, a new format."""

from __future__ import annotations

from pathlib import Path

import pytest

from dpkfc_med.data import AmbiguousFormatError, DataValidationError, load_segmentation_folder
from dpkfc_med.data.formats import FORMATS, ReadOptions, data_format, detect_format
from dpkfc_med.data.formats.registry import register_format
from tests.data.test_case_folders import CHANNELS, _brats


@pytest.fixture
def scratch_formats(monkeypatch):
    """Formats registered by a test are dropped after it."""
    monkeypatch.setattr("dpkfc_med.data.formats.registry.FORMATS", dict(FORMATS))
    from dpkfc_med.data.formats import registry

    return registry.FORMATS


def test_a_brats_folder_is_recognised_by_one_format(tmp_path):
    root = _brats(tmp_path / "d")
    assert detect_format(root).name == "case-folders"
    assert detect_format(tmp_path) is None  # one folder per case, but no case files in them


LAYOUTS = {  # empty files: recognising a folder reads names, never contents
    "nifti": ["imagesTr/a_0000.nii.gz", "labelsTr/a.nii.gz"],
    "nifti ": ["dataset.json", "imagesTr/a.nii.gz", "labelsTr/a.nii.gz"],
    "case-folders": ["a/a_t1c.nii.gz", "a/a_seg.nii.gz", "b/b-flair.nii", "b/b-seg.nii"],
    "dicom-series": ["a/series/1.dcm", "a/a_seg.nii.gz", "labelsTr/b.nii.gz", "b/2.dcm"],
    "dicom-series  ": ["imagesTr/a/1.dcm", "labelsTr/a.nii.gz"],
    "images-masks": ["images/a.png", "masks/a.png"],
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_each_built_in_layout_is_recognised_by_its_format_alone(tmp_path, name):
    for rel in LAYOUTS[name]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).touch()
    assert [f.name for f in FORMATS.values() if f.recognise(tmp_path)] == [name.strip()]


def test_a_new_format_is_one_registration(tmp_path, scratch_formats):
    root = tmp_path / "d"
    (root / "cases").mkdir(parents=True)
    seen: list[ReadOptions] = []

    @register_format("my-layout", recognise=lambda r: (r / "cases").is_dir(), layout="cases/")
    def read(root: Path, options: ReadOptions):
        seen.append(options)
        raise DataValidationError(root, ["my-layout read"])

    assert "my-layout" in scratch_formats and detect_format(root).name == "my-layout"
    with pytest.raises(DataValidationError, match="my-layout read"):
        load_segmentation_folder(root, case_ids=["a"], num_classes=3)
    assert seen[0].case_ids == ["a"] and seen[0].num_classes == 3
    with pytest.raises(ValueError, match="'my-layout' is already registered"):
        register_format("my-layout", recognise=lambda r: False, layout="")(read)


def test_two_formats_that_recognise_a_folder_are_an_error_naming_both(tmp_path, scratch_formats):
    root = _brats(tmp_path / "d")

    @register_format("everything", recognise=lambda r: True, layout="any folder")
    def read(root: Path, options: ReadOptions):
        raise AssertionError("never read: the folder is ambiguous")

    with pytest.raises(AmbiguousFormatError) as err:
        load_segmentation_folder(root, channels=CHANNELS)
    assert err.value.formats == ["case-folders", "everything"]
    text = str(err.value)
    assert "'case-folders' (<case>/<case>_<modality>.nii.gz" in text and "'everything'" in text
    assert "format=NAME" in text and isinstance(err.value, ValueError)
    cases = load_segmentation_folder(root, channels=CHANNELS, format="case-folders")
    assert cases.source == "case folders"


def test_an_unknown_format_name_lists_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match=r"'case-folder' is not registered \(did you mean"):
        data_format("case-folder")
    with pytest.raises(ValueError, match="known: .*'case-folders'"):
        load_segmentation_folder(_brats(tmp_path / "d"), format="nope")
