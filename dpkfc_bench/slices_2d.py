"""Why 2D segmentation on slices lags 3D: one lever at a time on the 3D recipe reused for 2D.

    python -m dpkfc_bench slices-2d [--levers base,allslices,...] [--report-only]

Every run is ``dpkfc_bench/hippocampus_unet_2d_slices_base.yaml`` (the 3D recipe reused by
hand for 2D; MONAI 2D UNet on axial slices of the
MSD hippocampus volumes, the patient as the privacy unit, epsilon 8) with one change, through
the CLI, one torch thread. Test Dice is on the 40 test patients (whole volumes, slice by slice).
Each run's test predictions are then post-processed the way many MONAI bundles do (largest
connected 3D component of each class, scipy.ndimage): post-processing of released predictions,
no privacy cost; the column shows what it would give, the product does not apply it.

Runs go to ``$DPKFC_BENCH_RUNS/slices_2d/LEVER`` (a finished run is read, not run again);
results to ``dpkfc_bench/results/slices_2d.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from dpkfc_bench.harness import (
    RESULTS,
    ROOT,
    SNR_EXPLAINED,
    environment,
    layer_evidence,
    load_results,
    record,
    runs_dir,
    snr_table,
    table,
)

OUT = RESULTS / "slices_2d"
CONFIG = ROOT / "dpkfc_bench" / "hippocampus_unet_2d_slices_base.yaml"
PRIVATE = "private_not_for_release"
SNR_LEVERS = ("base", "allslices", "all_pre160", "eps30", "dpsgd", "narrow", "wide")
# lever -> (its --set overrides, what it changes)
LEVERS: dict[str, tuple[list[str], str]] = {
    "base": ([], "the 3D recipe reused for 2D (8 random slices per patient, 240 steps at q = 1/3)"),
    "base_s1": (["training.seed=1"], "the same, seed 1"),
    "nonprivate": (["method=nonprivate"], "non-private, same steps and batches"),
    "eps30": (["privacy.target_epsilon=30"], "epsilon 30: noise multiplier 1.26 instead of 3.22"),
    "dpsgd": (["method=dp-sgd"], "DP-SGD instead of DP-KFC"),
    "allslices": (["data.slices.per_unit=null"], "every slice of a drawn patient"),
    "ep40": (["training.epochs=40"], "120 steps"),
    "ep160": (["training.epochs=160", "training.eval_every=8"], "480 steps"),
    "lr03": (["training.lr=0.03"], "lr 0.03"),
    "b128": (["training.batch_size=128"], "batch 128 (q = 1/2, 160 steps)"),
    "ema": (["training.ema_decay=0.95"], "weight average, decay 0.95"),
    "cos": (["training.lr_schedule=cosine"], "cosine lr schedule"),
    "nopre": (["pretrain.steps=0"], "no data-free pretraining"),
    "pre4k": (["pretrain.steps=4000", "pretrain.batch_size=32"], "16x the pretraining"),
    "pre_b160": (["pretrain.batch_size=160"], "pretraining batch 160 (the 3D batch's voxels)"),
    "all_pre160": (
        ["data.slices.per_unit=null", "pretrain.batch_size=160"],
        "every slice and pretraining batch 160",
    ),
    "lr003": (["training.lr=0.003"], "lr 0.003"),
    "clip1": (["privacy.max_grad_norm=1.0"], "clip norm 1 instead of 0.125"),
    "damp10": (
        ["preconditioner.damping_a=10", "preconditioner.damping_g=10"],
        "relative damping 10 (milder whitening)",
    ),  # fmt: skip
    "damp01": (
        ["preconditioner.damping_a=0.1", "preconditioner.damping_g=0.1"],
        "relative damping 0.1 (stronger whitening)",
    ),  # fmt: skip
    "narrow": (
        ["model.kwargs.channels=[4,8,16]"],
        "UNet channels 4, 8, 16 (a quarter of the parameters)",
    ),
    "wide": (["model.kwargs.channels=[16,32,64]"], "UNet channels 16, 32, 64 (4x the parameters)"),
    "b32": (["training.batch_size=32", "training.epochs=40"], "batch 32 (q = 1/5, 200 steps)"),
}


def _dice(pred: np.ndarray, label: np.ndarray) -> float:
    total = pred.sum() + label.sum()
    return 1.0 if total == 0 else float(2 * (pred & label).sum() / total)


def _largest(mask: np.ndarray) -> np.ndarray:
    from scipy import ndimage

    lab, n = ndimage.label(mask)
    if n <= 1:
        return mask
    sizes = ndimage.sum(mask, lab, range(1, n + 1))
    return lab == 1 + int(np.argmax(sizes))


def largest_component_dice(predictions: Path, labels: Path, classes: int = 3) -> float:
    """Mean Dice over cases and foreground classes after keeping each class's largest component."""
    import nibabel as nib

    rows = []
    for f in sorted(predictions.glob("*.nii.gz")):
        p = np.asarray(nib.load(str(f)).dataobj).astype(int)
        g = np.asarray(nib.load(str(labels / f.name)).dataobj).astype(int)
        rows.append([_dice(_largest(p == c), g == c) for c in range(1, classes)])
    return float(np.mean(rows))


def run_lever(name: str) -> dict[str, Any]:
    run = runs_dir("slices_2d") / name
    metrics = run / PRIVATE / "metrics.json"
    t0 = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if not metrics.is_file():
        sets = [a for s in [*LEVERS[name][0], "training.progress=false", "training.threads=1"]
                for a in ("--set", s)]  # fmt: skip
        cmd = [sys.executable, "-m", "dpkfc_med.cli", "train", str(CONFIG), "--out", str(run)]
        proc = subprocess.run([*cmd, *sets], cwd=ROOT, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            return {"lever": name, "error": proc.stderr[-2000:]}
    preds = run / PRIVATE / "evaluations" / "msd_hippocampus_test" / "predictions"
    if not preds.is_dir():
        cmd = [sys.executable, "-m", "dpkfc_med.cli", "evaluate", str(run), "--split", "test"]
        subprocess.run([*cmd, "--save-predictions"], cwd=ROOT, capture_output=True, env=env)
    m = json.loads(metrics.read_text(encoding="utf-8"))
    from dpkfc_med.data import resolve_data_path

    labels = resolve_data_path("msd_hippocampus", kind="dir") / "labelsTr"
    return {
        "lever": name,
        "test_dice": m["test"]["mean_dice"],
        "val_dice": m["val"]["mean_dice"],
        "hd95": m["test"].get("hd95_per_class"),
        "largest_component_dice": largest_component_dice(preds, labels),
        "selected_epoch": m.get("selected_epoch"),
        "minutes": round((time.perf_counter() - t0) / 60, 1),
        **layer_evidence(run),
    }


def render(data: dict[str, Any]) -> str:
    rows = []
    for r in data["runs"]:
        if "error" in r:
            continue
        hd = r.get("hd95") or {}
        rows.append([r["lever"], LEVERS.get(r["lever"], ([], ""))[1], f"{r['test_dice']:.3f}",
                     f"{r['largest_component_dice']:.3f}", f"{r['val_dice']:.3f}",
                     ", ".join(f"{v:.1f}" for v in hd.values()), str(r["selected_epoch"])])  # fmt: skip
    lines = [
        "# 2D segmentation on slices: one lever at a time",
        "",
        "Generated by `python -m dpkfc_bench slices-2d` (protocol in the module docstring of",
        "`dpkfc_bench/slices_2d.py`). One seed per lever (seed 0 unless named), epsilon 8, test",
        "Dice on the 40 test patients; `largest component` = the same predictions with each",
        "class's largest connected 3D component kept (post-processing the product does not apply).",
        "",
        *table(
            [
                "lever",
                "change",
                "test Dice",
                "largest component",
                "val Dice",
                "HD95 mm (ant., post.)",
                "selected epoch",
            ],
            rows,
        ),  # fmt: skip
    ]
    kept = {r["lever"]: [r["layer_snr"]] for r in data["runs"] if r.get("layer_snr")}
    shown = {k: kept[k] for k in SNR_LEVERS if k in kept}
    if len(shown) > 1:
        lines += ["", "## Per-layer SNR", "", SNR_EXPLAINED, "", *snr_table(shown)]
    for paragraph in data.get("reading") or []:
        lines += ["", paragraph]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m dpkfc_bench slices-2d", description=__doc__)
    ap.add_argument("--levers", default=",".join(LEVERS))
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args(argv)
    path = OUT.with_suffix(".json")
    data = load_results(path)
    data.setdefault("environment", environment())
    done = {r["lever"] for r in data["runs"] if "error" not in r}
    data["runs"] = [r for r in data["runs"] if "error" not in r]
    for name in [] if args.report_only else args.levers.split(","):
        if name not in done:
            print(f"slices-2d: {name}", flush=True)
            record(path, data, run_lever(name))
    OUT.with_suffix(".md").write_text(render(data), encoding="utf-8")
    print(f"wrote {OUT.with_suffix('.md')}")


if __name__ == "__main__":
    main()
