"""Two input channels on real anatomy: the hippocampus MRI plus a second channel, one file each.

No multi-parametric volumes are bundled (BraTS-like data is gigabytes), so the two-channel task
is made from the bundled MSD hippocampus cases, in nnU-Net's per-modality layout:

* ``imagesTr/<case>_0000.nii.gz``: the MRI as bundled (a symbolic link);
* ``imagesTr/<case>_0001.nii.gz``: its Gaussian gradient magnitude (sigma 1 voxel), a derived
  edge map, not a second acquisition: it carries no information the MRI does not;
* ``labelsTr/<case>.nii.gz`` (links) and a ``dataset.json`` listing ``imagesTr/<case>.nii.gz``
  with its two modalities and three labels, as nnU-Net v1 writes it.

The split is the keyed hash of each case id, so both runs see the same train / val / test
cases. The study trains the shipped single-channel ``hippocampus_unet_3d_eps8`` and the
two-channel ``hippocampus_2ch_unet_3d_eps8`` (the same recipe, one more input channel) with the
same seed and reports test Dice side by side: what it shows is that the per-file modality path,
per-channel normalisation, two-channel probes and pretraining train as well as one channel,
not that a second modality helps::

    python -m dpkfc_bench multichannel --prepare    # only write runs/hippocampus_2ch/
    python -m dpkfc_bench multichannel --seeds 1
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from dpkfc_bench.harness import (
    RESULTS,
    ROOT,
    environment,
    git_commit,
    ints,
    load_results,
    mean_std,
    reading_lines,
    record,
    runs_dir,
    save_results,
    table,
)

FOLDER = ROOT / "runs" / "hippocampus_2ch"
"""Where ``--prepare`` writes the two-channel folder ``configs/hippocampus_2ch_unet_3d_eps8.yaml``
reads."""
CONFIGS = {
    1: ROOT / "configs" / "hippocampus_unet_3d_eps8.yaml",
    2: ROOT / "configs" / "hippocampus_2ch_unet_3d_eps8.yaml",
}
OUT = RESULTS / "multichannel_hippocampus.json"
MODALITIES = {"0": "MRI (T1-weighted)", "1": "gradient magnitude of the MRI (derived)"}


def prepare(root: Path = FOLDER) -> Path:
    """Write the two-channel folder once (links to the bundled files, one derived channel)."""
    import nibabel as nib
    from scipy.ndimage import gaussian_gradient_magnitude

    from dpkfc_med.data import load_segmentation_folder, resolve_data_path

    if (root / "dataset.json").is_file():
        return root
    source = resolve_data_path("msd_hippocampus", kind="dir")
    cases = load_segmentation_folder(source)
    shutil.rmtree(root, ignore_errors=True)
    (root / "imagesTr").mkdir(parents=True)
    (root / "labelsTr").mkdir()
    training = []
    for c in cases:
        image = Path(c.image_path)
        os.symlink(image, root / "imagesTr" / f"{c.case_id}_0000.nii.gz")
        os.symlink(Path(c.label_path), root / "labelsTr" / f"{c.case_id}.nii.gz")
        img: Any = nib.load(str(image))
        edges = gaussian_gradient_magnitude(np.asarray(img.dataobj, dtype=np.float32), sigma=1.0)
        derived = nib.Nifti1Image(edges.astype(np.float32), img.affine, img.header)
        derived.set_data_dtype(np.float32)
        nib.save(derived, str(root / "imagesTr" / f"{c.case_id}_0001.nii.gz"))
        training.append({"image": f"./imagesTr/{c.case_id}.nii.gz",
                         "label": f"./labelsTr/{c.case_id}.nii.gz"})  # fmt: skip
    index = {
        "name": "Hippocampus, two channels (MRI + derived gradient magnitude)",
        "modality": MODALITIES,
        "labels": {"0": "background", "1": "Anterior", "2": "Posterior"},
        "training": training,
    }
    (root / "dataset.json").write_text(
        json.dumps(index, indent=1), encoding="utf-8"
    )  # written last: done
    return root


def run_job(channels: int, seed: int, work: Path, threads: int) -> dict[str, Any]:
    """Train one config as shipped (seed changed), and its test Dice."""
    from dpkfc_med.training.config import load_config
    from dpkfc_med.training.run import train

    run = work / f"{channels}ch_s{seed}"
    shutil.rmtree(run, ignore_errors=True)  # an interrupted run starts again
    overrides = [f"training.seed={seed}", f"training.threads={threads}", "training.progress=false",
                 f"output.dir={run}"]  # fmt: skip
    if channels == 2:
        overrides.append(f"data.path={FOLDER}")
    cfg = load_config(CONFIGS[channels], overrides)
    t0 = time.perf_counter()
    result = train(cfg)
    minutes = (time.perf_counter() - t0) / 60
    test = result.metrics["test"]
    return {"channels": channels, "seed": seed, "epsilon": float(result.epsilon or 0),
            "test_mean_dice": float(test["mean_dice"]), "train_minutes": round(minutes, 1),
            "test_dice_per_class": {k: float(v) for k, v in test["dice_per_class"].items()}}  # fmt: skip


def _cell(values: list[float], digits: int) -> str:
    """One value as it is; several as mean +- sd."""
    mean, sd = mean_std(values)
    return f"{mean:.{digits}f}" if len(values) == 1 else f"{mean:.{digits}f} +- {sd:.{digits}f}"


def summarize(data: dict[str, Any]) -> str:
    """The Markdown page."""
    rows = data["runs"]
    lines = [
        "# Two input channels, one file each: MSD hippocampus, MONAI 3D UNet, epsilon 8",
        "",
        f"Generated by `python -m dpkfc_bench multichannel` (git {str(data.get('git_commit'))[:7]})."
        " Protocol in the module docstring of `dpkfc_bench/multichannel.py`: the second channel is"
        " the MRI's gradient magnitude (derived, not a second acquisition); both configs are the"
        " shipped DP-KFC recipe at epsilon 8, same seed, same test cases. Test Dice (mean over"
        " anterior and posterior), mean +- sd over seeds.",
        "",
    ]
    body = []
    for channels in (1, 2):
        own = [r for r in rows if r["channels"] == channels]
        if own:
            dice = [r["test_mean_dice"] for r in own]
            per_class = {k: [r["test_dice_per_class"][k] for r in own]
                         for k in own[0]["test_dice_per_class"]}  # fmt: skip
            body.append([CONFIGS[channels].stem, str(channels), _cell(dice, 3),
                         *[_cell(v, 3) for v in per_class.values()],
                         _cell([r["train_minutes"] for r in own], 1), str(len(own))])  # fmt: skip
    classes = list(rows[0]["test_dice_per_class"]) if rows else []
    lines += table(["config", "channels", "test Dice", *[f"Dice {c}" for c in classes],
                    "minutes (2 cores shared)", "seeds"], body)  # fmt: skip
    lines += reading_lines(data)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="1")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--prepare", action="store_true", help=f"only write {FOLDER}")
    p.add_argument("--summarize", action="store_true", help="only rewrite the Markdown")
    args = p.parse_args(argv)
    if args.prepare:
        print(f"two-channel folder: {prepare()}")
        return 0
    data = load_results(args.out)
    if args.summarize:
        args.out.with_suffix(".md").write_text(summarize(data), encoding="utf-8")
        return 0
    data.setdefault("environment", environment())
    data["git_commit"] = git_commit()
    prepare()
    save_results(args.out, data)
    done = {(r["channels"], r["seed"]) for r in data["runs"]}
    for seed in ints(args.seeds):
        for channels in (1, 2):
            if (channels, seed) in done:
                continue
            row = run_job(channels, seed, runs_dir("multichannel"), args.threads)
            record(args.out, data, row)
            args.out.with_suffix(".md").write_text(summarize(data), encoding="utf-8")
            print(f"{channels} channel(s), seed {seed}: test Dice {row['test_mean_dice']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
