"""A bundle's declared modality chooses its probe preset, unless the user chooses one."""

from __future__ import annotations

from pathlib import Path

import pytest

from dpkfc_med.bundle.zoo import prepare_bundle
from dpkfc_med.data import resolve_data_path

BUNDLE = Path(__file__).parent / "zoo_bundle"
MODALITY = "_meta_#network_data_format#inputs#image#modality"


@pytest.mark.parametrize(
    ("modality", "preset"), [("MR", "mri"), ("CT", "ct"), ("X-Ray", "xray"), ("PT", "natural")]
)
def test_the_metadata_modality_chooses_the_probe_preset(modality, preset):
    data = str(resolve_data_path("msd_hippocampus", kind="dir"))
    b = prepare_bundle(
        BUNDLE,
        epsilon=8,
        overrides=[f"dataset_dir={data}", "num_train=2", f"{MODALITY}={modality}"],
    )
    assert b.cfg.probes.preset == preset  # PT (PET) has no preset: the default stays
    assert b.task.data_record["bundle"]["modality"] == modality
    chosen = prepare_bundle(
        BUNDLE,
        epsilon=8,
        overrides=[f"dataset_dir={data}", "num_train=2", f"{MODALITY}={modality}"],
        settings=["probes.preset=ultrasound"],
    )
    assert chosen.cfg.probes.preset == "ultrasound"
