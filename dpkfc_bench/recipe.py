"""``recipe: auto`` against a workload's own settings and the hand-tuned shipped recipe.

    python -m dpkfc_bench recipe [--workloads zoo_bundle_3d,pneumonia_cnn] [--arms own,auto]
        [--epsilons 8] [--seeds 0] [--report-only]

Arms, one protocol for all (the same data, split, epsilon, evaluation):

- ``own``: the workload as its author wrote it: a bundle's own optimizer, lr, batch and
  epochs (``--recipe bundle``), or a shipped config as shipped (its hand-tuned recipe; for
  the 2D slices, ``dpkfc_bench/hippocampus_unet_2d_slices_base.yaml``, the 3D recipe reused);
- ``auto``: ``recipe: auto`` -- a bundle with nothing but ``--epsilon``, a config with every
  recipe field removed (data, network and privacy target kept);
- the rivals, each the ``auto`` arm with one thing set: ``auto+dp-sgd``, ``auto+dp-kfc`` and
  ``auto+dp-stp`` fix the method (the rule chooses the rest; at epsilon <= 1 the rule itself
  picks DP-SGD, so ``auto+dp-kfc`` is the rival there), ``auto+aug4`` adds augmentation
  multiplicity (4 views of every drawn image summed before clipping; classification only);
  ``auto+dp-stp+c10`` and ``+c100``: dp-stp with clip norm 10 or 100 (it clips in scaled
  coordinates, where the rule's clip norm for unscaled gradients may not fit).

Workloads: the bundles ``zoo_bundle_3d`` (``dpkfc_bench/bundles/hippocampus_zoo_style``, a
bundle written the Model Zoo way: UNet with BatchNorm, Adam 3e-3, batch 8) and
``pipeline_cls2d``, ``pipeline_seg3d``, ``pipeline_cls3d`` (the ``pipelines/`` bundles, whose
own recipe is the hand-tuned one), and the shipped configs ``pneumonia_cnn``,
``pneumonia_densenet``, ``hippocampus_3d``, ``hippocampus_2d``, ``hippocampus_2ch`` (two input
channels) and ``adrenal_resnet`` (AdrenalMNIST3D, ResNet-10). Each run
goes through the CLI; its test metric is read from the custodian's ``metrics.json`` (test
patients no run selected on). Results: ``dpkfc_bench/results/recipe.{json,md,png}``; an
interrupted study resumes with the runs it lacks.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from dpkfc_bench.harness import (
    RESULTS,
    ROOT,
    SNR_EXPLAINED,
    environment,
    floats,
    fmt_mean_std,
    ints,
    layer_evidence,
    load_results,
    pending,
    record,
    runs_dir,
    save_results,
    snr_table,
    table,
)

OUT = RESULTS / "recipe"
# bundle workloads: trained with `dpkfc-med bundle train BUNDLE --epsilon E` (own = --recipe bundle)
BUNDLES = {
    "zoo_bundle_3d": ROOT / "dpkfc_bench" / "bundles" / "hippocampus_zoo_style",
    "pipeline_cls2d": ROOT / "pipelines" / "classification_2d",
    "pipeline_seg3d": ROOT / "pipelines" / "segmentation_3d",
    "pipeline_cls3d": ROOT / "pipelines" / "classification_3d",
}
# config workloads: the config (own = as written) and its test metric; the 2D one
# is the 3D recipe reused by hand (the shipped 2D config is recipe: auto)
CONFIGS = {
    "pneumonia_cnn": ("dpkfc_bench/pneumoniamnist_cnn_2d_eps1_hand.yaml", "auroc"),
    "pneumonia_densenet": ("configs/pneumoniamnist_densenet121_2d_eps1.yaml", "auroc"),
    "hippocampus_3d": ("configs/hippocampus_unet_3d_eps8.yaml", "mean_dice"),
    "hippocampus_2d": ("dpkfc_bench/hippocampus_unet_2d_slices_base.yaml", "mean_dice"),
    "hippocampus_2ch": ("configs/hippocampus_2ch_unet_3d_eps8.yaml", "mean_dice"),
    "adrenal_resnet": ("configs/adrenalmnist3d_resnet_3d_eps8.yaml", "auroc"),
}
WORKLOADS = (*BUNDLES, *CONFIGS)
ARMS = ("own", "auto")
# the rivals: the auto recipe with one setting fixed (``--set`` overrides, in the config's terms)
RIVALS = {
    "auto+dp-sgd": ["method=dp-sgd"],
    "auto+dp-kfc": ["method=dp-kfc"],
    "auto+dp-stp": ["method=dp-stp"],
    "auto+aug4": ["data.augmentations_per_unit=4"],
    # dp-stp clips in its scaled coordinates, where a unit's gradient is far longer than the
    # rule's clip norm (chosen for unscaled gradients): its sensitivity to that norm
    "auto+dp-stp+c10": ["method=dp-stp", "privacy.max_grad_norm=10"],
    "auto+dp-stp+c100": ["method=dp-stp", "privacy.max_grad_norm=100"],
}
ALL_ARMS = (*ARMS, *RIVALS)


def strip_recipe(raw: dict[str, Any]) -> dict[str, Any]:
    """A config with every field the rule may choose removed, and ``recipe: auto``."""
    from dpkfc_med.recipe import RECIPE_FIELDS

    out = yaml.safe_load(yaml.safe_dump(raw))
    for field in RECIPE_FIELDS:
        *parents, last = field.split(".")
        node = out
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(last, None)
    out.setdefault("training", {})["recipe"] = "auto"
    return out


def _command(job: dict[str, Any], run: Path, tmp: Path) -> list[str]:
    w, arm, eps, seed = job["workload"], job["arm"], job["epsilon"], job["seed"]
    sets = [f"training.seed={seed}", "training.progress=false", *RIVALS.get(arm, [])]
    common = [part for s in sets for part in ("--set", s)]
    if w in BUNDLES:
        cmd = ["bundle", "train", str(BUNDLES[w]), "--epsilon", str(eps), "--out", str(run)]
        return [*cmd, "--recipe", "bundle" if arm == "own" else "auto", *common]
    raw = yaml.safe_load((ROOT / CONFIGS[w][0]).read_text(encoding="utf-8"))
    raw.setdefault("privacy", {})["target_epsilon"] = float(eps)
    if arm != "own":
        raw = strip_recipe(raw)
    path = tmp / f"{w}_{arm}.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return ["train", str(path), "--out", str(run), *common]


def _metric(job: dict[str, Any], run: Path) -> tuple[str, float | None, dict[str, Any]]:
    import json

    metrics = json.loads((run / "private_not_for_release" / "metrics.json").read_text("utf-8"))
    test = metrics.get("test") or {}
    if job["workload"] in BUNDLES:  # the bundle's key metric on its test list
        name = next((k for k in test if k.startswith("test_")), "test_metric")
    else:
        name = CONFIGS[job["workload"]][1]
        name = next((k for k in test if k.endswith(name)), name)
    value = test.get(name)
    report = json.loads((run / "privacy_report.json").read_text(encoding="utf-8"))
    recipe = ((report.get("training") or {}).get("recipe") or {}).get("fields") or []
    return (
        name,
        (None if value is None else float(value)),
        {"recipe": recipe, **layer_evidence(run)},
    )


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    """One arm through the CLI; its test metric, minutes and the recipe it trained with."""
    run = (
        runs_dir("recipe") / f"{job['workload']}_{job['arm']}_eps{job['epsilon']:g}_s{job['seed']}"
    )
    if run.exists():
        import shutil

        shutil.rmtree(run)  # an interrupted run of this job: start it again
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "dpkfc_med.cli", *_command(job, run, Path(tmp))]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        minutes = (time.perf_counter() - t0) / 60
    if proc.returncode != 0:
        return {**job, "error": proc.stderr[-2000:], "minutes": minutes}
    name, value, extra = _metric(job, run)
    return {**job, "metric": name, "value": value, "minutes": round(minutes, 1), **extra}


def _key(r: dict[str, Any]) -> tuple[Any, ...]:
    return (r["workload"], r["arm"], float(r["epsilon"]), int(r["seed"]))


def render(data: dict[str, Any]) -> str:
    """The Markdown page: one row per workload and epsilon, one column per arm."""
    runs = [r for r in data["runs"] if r.get("value") is not None]
    groups: dict[tuple[str, float], dict[str, list[float]]] = {}
    for r in runs:
        groups.setdefault((r["workload"], float(r["epsilon"])), {}).setdefault(r["arm"], []).append(
            r["value"]
        )
    present = {r["arm"] for r in runs}
    shown = [a for a in ALL_ARMS if a in ARMS or a in present]
    rows = []
    for (w, eps), arms in sorted(groups.items()):
        cells = []
        for arm in shown:
            vals = arms.get(arm, [])
            cells.append("-" if not vals else f"{fmt_mean_std(vals)} (n={len(vals)})")
        metric = next(r["metric"] for r in runs if r["workload"] == w)
        rows.append([w, f"{eps:g}", metric, *cells])
    lines = [
        "# recipe: auto against the workload's own settings",
        "",
        "Generated by `python -m dpkfc_bench recipe`. Test metric on cases no run selected on;",
        "`own` = the bundle's own hyperparameters (`--recipe bundle`) or the shipped hand-tuned",
        "config; `auto` = `recipe: auto` with every recipe field left to the rule;",
        "`auto+X` = the auto recipe with one setting fixed (a method, or 4 augmentations).",
        "",
        *table(["workload", "epsilon", "metric", *shown], rows),
        "",
        "## Runs",
        "",
        *table(
            ["workload", "arm", "epsilon", "seed", "value", "minutes"],
            [
                [
                    r["workload"],
                    r["arm"],
                    f"{r['epsilon']:g}",
                    str(r["seed"]),
                    "error" if r.get("value") is None else f"{r['value']:.3f}",
                    f"{r.get('minutes', 0):.1f}",
                ]
                for r in data["runs"]
            ],
        ),  # fmt: skip
    ]
    lines += _snr_tables(runs)
    for paragraph in data.get("reading") or []:
        lines += ["", paragraph]
    return "\n".join(lines) + "\n"


def _snr_tables(runs: list[dict[str, Any]]) -> list[str]:
    """Per workload and epsilon with two or more arms: each layer's mean SNR per arm."""
    lines: list[str] = []
    groups: dict[tuple[str, float], dict[str, list[dict[str, float]]]] = {}
    for r in runs:
        if r.get("layer_snr"):
            at = groups.setdefault((r["workload"], float(r["epsilon"])), {})
            at.setdefault(r["arm"], []).append(r["layer_snr"])
    for (w, eps), arms in sorted(groups.items()):
        if len(arms) < 2:
            continue
        names = [a for a in ALL_ARMS if a in arms]
        columns = {f"{a} ({_method(runs, w, eps, a)})": arms[a] for a in names}
        lines += ["", f"### Per-layer SNR: {w}, epsilon {eps:g}", "", SNR_EXPLAINED, ""]
        lines += snr_table(columns)
    return lines


def _method(runs: list[dict[str, Any]], workload: str, eps: float, arm: str) -> str:
    """The method an arm trained with, as its recipe rows name it (``as shipped`` without)."""
    for r in runs:
        if (r["workload"], float(r["epsilon"]), r["arm"]) == (workload, eps, arm):
            for f in r.get("recipe") or []:
                if f.get("field") == "method":
                    return str(f.get("value"))
    return "as shipped"


def plot(data: dict[str, Any], path: Path) -> None:
    """One panel per epsilon: each workload's test metric per arm, every seed as a dot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in data["runs"] if r.get("value") is not None]
    epsilons = sorted({float(r["epsilon"]) for r in runs})
    if not epsilons:
        return
    fig, axes = plt.subplots(1, len(epsilons), figsize=(5 * len(epsilons), 3.6), squeeze=False)
    for ax, eps in zip(axes[0], epsilons):
        here = [r for r in runs if float(r["epsilon"]) == eps]
        workloads = sorted({r["workload"] for r in here})
        arms = [a for a in ALL_ARMS if any(r["arm"] == a for r in here)]
        width = 0.8 / max(1, len(arms))
        for j, arm in enumerate(arms):
            labelled = False  # one legend entry per arm; an arm keeps its colour in every panel
            for i, w in enumerate(workloads):
                vals = [r["value"] for r in here if r["workload"] == w and r["arm"] == arm]
                x = i + (j - (len(arms) - 1) / 2) * width
                if vals:
                    ax.bar(x, sum(vals) / len(vals), width * 0.95, alpha=0.6,
                           color=f"C{ALL_ARMS.index(arm)}",
                           label=None if labelled else arm)  # fmt: skip
                    ax.plot([x] * len(vals), vals, "k.", ms=4)
                    labelled = True
        ax.set_xticks(range(len(workloads)), workloads, rotation=25, ha="right", fontsize=8)
        ax.set_ylim(0, 1)
        ax.set_title(f"epsilon {eps:g}")
        ax.set_ylabel("test metric (Dice or AUROC)")
        ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m dpkfc_bench recipe", description=__doc__)
    ap.add_argument("--workloads", default="zoo_bundle_3d,pneumonia_cnn")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"of {', '.join(ALL_ARMS)}")
    ap.add_argument("--epsilons", type=floats, default=[8.0])
    ap.add_argument("--seeds", type=ints, default=[0])
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args(argv)
    path = OUT.with_suffix(".json")
    data = load_results(path)
    data.setdefault("environment", environment())
    jobs = [
        {"workload": w, "arm": a, "epsilon": e, "seed": s}
        for w in args.workloads.split(",")
        for e in args.epsilons
        for s in args.seeds
        for a in args.arms.split(",")
    ]
    unknown = sorted({j["arm"] for j in jobs} - set(ALL_ARMS))
    if unknown:
        ap.error(f"--arms: unknown {', '.join(unknown)}; choose from {', '.join(ALL_ARMS)}")
    data["runs"] = [r for r in data["runs"] if "error" not in r]  # failed runs: again
    for job in [] if args.report_only else pending(jobs, data["runs"], _key):
        print(f"recipe: {job}", flush=True)
        result = run_job(job)
        print(f"  -> {result.get('value', result.get('error', '')[-300:])}", flush=True)
        record(path, data, result)
    save_results(path, data)
    plot(data, OUT.with_suffix(".png"))
    OUT.with_suffix(".md").write_text(render(data), encoding="utf-8")
    print(f"wrote {OUT.with_suffix('.md')}")


if __name__ == "__main__":
    main()
