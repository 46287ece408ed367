"""Public weights under shift: public-only, private-only, and public init + private fine-tuning.

The bundled MSD hippocampus cases are split once, by a keyed hash of each case id, into a
"public release" (a third: 75 of the 220 cases) and the private set (the other 145, with its own
train / val / test split). The public release is then shifted the way a real public dataset differs from a
hospital's task:

* ``labels``: anterior and posterior merged into one "hippocampus" class (a coarser public
  annotation; the private task has both);
* ``contrast``: every public image's contrast inverted inside the head (x -> max + min - x on
  nonzero voxels; the background stays 0);
* ``both``: the two together.

For each shift: the public-only model (non-private training on the shifted public cases,
evaluated as a 3-class predictor on the private test cases), and that model fine-tuned privately
on the private training cases with DP-SGD and DP-KFC (every layer; after a label merge, the
output layer's anterior and posterior both start from the public "hippocampus" class:
``model.pretrained_class_map: [0, 1, 1]``). The private-only arm is the shipped recipe on the private
cases (data-free pretraining, no public weights). Every private arm uses the shipped run config
of its epsilon (``configs/hippocampus_unet_3d_eps{1,3,8}.yaml``) with only the method, the
data folder and the initial weights changed, and releases its last epoch; test Dice is on the
private test cases (no one tuned on them). The rows already on the results page were run with
the hand-tuned configs of their time (40 epochs at epsilon 1 and 3); the epsilon-1 and -3
configs are now ``recipe: auto``, which the arms ``--private auto`` and
``--finetune full@training.recipe=auto`` measure::

    python -m dpkfc_bench public-init --eps 1,8 --seeds 1

The shifted folders are written under ``$DPKFC_BENCH_RUNS/public_init/data`` (symbolic links to
the bundled files where nothing changes); rows are appended to
``dpkfc_bench/results/public_init_hippocampus.json`` as each run finishes (resumable).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dpkfc_bench.harness import (
    RESULTS,
    ROOT,
    environment,
    floats,
    fmt_mean_std,
    git_commit,
    ints,
    layer_evidence,
    load_results,
    reading_lines,
    record,
    runs_dir,
    save_results,
    table,
)

SHIFTS = ("labels", "contrast", "both")
METHODS = ("dp-sgd", "dp-kfc")
PUBLIC_FRACTION = 70 / 220
PARTITION_KEY = b"dpkfc-med public-release benchmark"
OUT = RESULTS / "public_init_hippocampus.json"


def is_public(case_id: str) -> bool:
    """Whether a case belongs to the public release (a keyed hash of its id only)."""
    digest = hashlib.blake2b(case_id.encode(), key=PARTITION_KEY, digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64 < PUBLIC_FRACTION


def _link(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if not dst.exists():
        os.symlink(src, dst)


def _write_like(src: Path, dst: Path, array: np.ndarray) -> None:
    import nibabel as nib

    img = nib.load(str(src))
    dst.parent.mkdir(parents=True, exist_ok=True)
    out = nib.Nifti1Image(array.astype(img.get_data_dtype()), img.affine, img.header)
    nib.save(out, str(dst))


def prepare(root: Path) -> dict[str, Path]:
    """The private folder and one public folder per shift (written once, then reused)."""
    import nibabel as nib

    from dpkfc_med.data import load_segmentation_folder, resolve_data_path

    cases = load_segmentation_folder(resolve_data_path("msd_hippocampus", kind="dir"))
    folders = {"private": root / "private", **{s: root / f"public_{s}" for s in SHIFTS}}
    done = root / "prepared"
    if done.is_file():
        return folders
    shutil.rmtree(root, ignore_errors=True)
    for c in cases:
        image, label = Path(c.image_path), Path(c.label_path)
        if not is_public(c.case_id):
            _link(image, folders["private"] / "imagesTr" / image.name)
            _link(label, folders["private"] / "labelsTr" / label.name)
            continue
        for shift in SHIFTS:
            out = folders[shift]
            if shift in ("labels", "both"):
                y = np.asarray(nib.load(str(label)).dataobj)
                _write_like(label, out / "labelsTr" / label.name, np.where(y == 2, 1, y))
            else:
                _link(label, out / "labelsTr" / label.name)
            if shift in ("contrast", "both"):
                x = np.asarray(nib.load(str(image)).dataobj).astype(np.float32)
                inside = x > 0
                lo, hi = float(x[inside].min()), float(x[inside].max())
                _write_like(image, out / "imagesTr" / image.name, np.where(inside, hi + lo - x, 0))
            else:
                _link(image, out / "imagesTr" / image.name)
    done.write_text("ok\n", encoding="utf-8")
    return folders


def _config(eps: float) -> Path:
    return ROOT / "configs" / f"hippocampus_unet_3d_eps{eps:g}.yaml"


def _common(seed: int, threads: int, epochs: int | None) -> list[str]:
    out = [f"training.seed={seed}", "training.select_epoch=last", f"training.threads={threads}",
           "training.progress=false"]  # fmt: skip
    return out + ([f"training.epochs={epochs}"] if epochs else [])


def _train(config: Path, overrides: list[str], work: Path) -> Any:
    from dpkfc_med.training.config import load_config
    from dpkfc_med.training.run import train

    shutil.rmtree(work, ignore_errors=True)  # an interrupted run starts again
    cfg = load_config(config, [*overrides, f"output.dir={work}"])
    train(cfg)
    return cfg


def _test_dice(private_cfg: Any, run_dir: Path) -> dict[str, float]:
    """Test Dice on the private test cases of the network saved in ``run_dir``."""
    import yaml

    from dpkfc_med.tasks.build import build_task
    from dpkfc_med.training.config import config_from_dict
    from dpkfc_med.training.setup import build_run_model

    own = config_from_dict(yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8")))
    model, _ = build_run_model(own, build_task(own, public_probes=False), finetune=False)
    saved = torch.load(run_dir / "model.pt", map_location="cpu", weights_only=False)
    model.load_state_dict(saved["model"])
    task = build_task(private_cfg, public_probes=False)
    m = task.evaluate(model, "test", torch.device("cpu"), private_cfg.training.eval_batch_size)
    return {"test_mean_dice": float(m["mean_dice"]),
            **{f"test_dice_{k}": float(v) for k, v in m["dice_per_class"].items()}}  # fmt: skip


AUTO = "training.recipe=auto"
"""A fine-tuning variant under ``recipe: auto`` (``--finetune full@training.recipe=auto``)."""


def _auto_config(config: Path, path: Path) -> Path:
    """``config`` with every recipe field removed and ``training.recipe: auto``."""
    import yaml

    from dpkfc_bench.recipe import strip_recipe

    raw = strip_recipe(yaml.safe_load(config.read_text(encoding="utf-8")))
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


def job_config(job: dict[str, Any], work: Path) -> tuple[Path, str, list[str]]:
    """A job's config, fine-tuning mode and the mode's overrides.

    ``full@training.lr=0.003`` is a mode and its overrides; ``@training.recipe=auto`` (and the
    private-only arm of method ``auto``) trains under ``recipe: auto``: the config of the
    epsilon with every recipe field removed, the rule seeing the public weights and the method.
    """
    config = _config(job["eps"])
    mode, *variant = job.get("finetune", "full").split("@")
    if (job["arm"] == "private" and job["method"] == "auto") or AUTO in variant:
        variant = [v for v in variant if v != AUTO]
        config = _auto_config(config, work / f"{job['arm']}_auto_eps{job['eps']:g}.yaml")
    return config, mode, variant


def run_job(
    job: dict[str, Any], folders: dict[str, Path], work: Path, threads: int, epochs: int | None
) -> dict[str, Any]:
    """One row: ``public`` (non-private on a shifted public folder), ``private`` or ``finetune``."""
    from dpkfc_med.training.config import load_config

    arm, shift, eps, seed = job["arm"], job.get("shift"), job.get("eps"), job["seed"]
    base = _common(seed, threads, epochs)
    private = [f"data.path={folders['private']}", *base]
    private_cfg = load_config(_config(8.0), private)
    public_dir = work / f"public_{shift}_s{seed}"
    needs_public = arm == "finetune" and not (public_dir / "model.pt").is_file()
    if arm == "public" or needs_public:  # the public model (again, if its folder is gone)
        classes = 2 if shift in ("labels", "both") else 3
        _train(_config(8.0), [f"data.path={folders[shift]}", f"data.num_classes={classes}",
                              "method=nonprivate", *base], public_dir)  # fmt: skip
        if arm == "public":
            return _test_dice(private_cfg, public_dir)
    finetune = job.get("finetune", "full")
    config, mode, variant = job_config(job, work)
    label = finetune.replace("@", "_").replace("=", "")
    run = work / f"{arm}_{shift}_{job['method']}_{label}_eps{eps:g}_s{seed}"
    # the private-only arm keeps its config's own method (the shipped recipe: DP-SGD at 1)
    overrides = [*private, *([f"method={job['method']}"] if arm == "finetune" else [])]
    if arm == "finetune":
        overrides += [f"model.pretrained={public_dir / 'model.pt'}", "pretrain.steps=0",
                      f"training.finetune={mode}", *variant,
                      f"model.pretrained_source=public release, shift {shift}"]  # fmt: skip
        if shift in ("labels", "both"):  # anterior and posterior from the merged class
            overrides.append("model.pretrained_class_map=[0,1,1]")
    cfg = _train(config, overrides, run)
    out = {**_test_dice(cfg, run), **layer_evidence(run)}
    shutil.rmtree(run, ignore_errors=True)
    return out


def jobs(
    eps_list: list[float],
    seeds: list[int],
    finetunes: tuple[str, ...] = ("full",),
    methods: tuple[str, ...] = METHODS,
    private: tuple[str, ...] = ("config",),
) -> list[dict[str, Any]]:
    """Every run, most informative first: epsilon by epsilon, the public models first.

    ``finetunes`` are the ``training.finetune`` modes of the fine-tuning arms (``full``,
    ``lora``, ...), each optionally with a fine-tuning recipe's overrides after ``@``
    (``full@training.lr=0.003``); the public and private-only arms are run once whatever
    they are. ``private``: the private-only arm's recipes, ``config`` (the shipped config of
    the epsilon as it is) and ``auto`` (that config under ``recipe: auto``)."""
    out: list[dict[str, Any]] = []
    for seed in seeds:
        out += [{"arm": "public", "shift": s, "seed": seed} for s in SHIFTS]
    for eps in eps_list:
        for seed in seeds:
            for shift in ("both", "labels", "contrast"):
                out += [{"arm": "finetune", "shift": shift, "method": m, "eps": eps, "seed": seed,
                         "finetune": f} for f in finetunes for m in methods]  # fmt: skip
            out += [{"arm": "private", "shift": None, "method": r, "eps": eps, "seed": seed}
                    for r in private]  # fmt: skip
    return out


def _key(row: dict[str, Any]) -> tuple[Any, ...]:
    finetune = row.get("finetune", "full") if row["arm"] == "finetune" else None
    return (*(row.get(k) for k in ("arm", "shift", "method", "eps", "seed")), finetune)


def _matches(row: dict[str, Any], sel: dict[str, Any]) -> bool:
    """Whether a row has every field of ``sel`` (a fine-tuning row without one is ``full``)."""
    own = {**({"finetune": "full"} if row["arm"] == "finetune" else {}), **row}
    return all(own.get(k) == v for k, v in sel.items())


def _modes(rows: list[dict[str, Any]]) -> list[str]:
    found = {r.get("finetune", "full") for r in rows if r["arm"] == "finetune"}
    return sorted(found, key=lambda m: (m != "full", m))


def summarize(data: dict[str, Any]) -> str:
    """The Markdown page of the results."""
    rows = data["runs"]
    lines = [
        "# Public weights under shift: MSD hippocampus, MONAI 3D UNet",
        "",
        f"Generated by `python -m dpkfc_bench public-init` (git {str(data.get('git_commit'))[:7]})."
        " Protocol in the module docstring of `dpkfc_bench/public_init.py`: 75 of the 220 cases"
        " (a keyed hash of the case id) are the public release, shifted; the other 145 are the"
        " private set. Test Dice (mean over anterior and posterior) on the private test cases,"
        " mean +- sd over seeds; every private run releases its last epoch.",
        "",
    ]

    def cell(sel: dict[str, Any]) -> str:
        vals = [r["test_mean_dice"] for r in rows if _matches(r, sel)]
        return f"{fmt_mean_std(vals)} (n={len(vals)})" if vals else "not run"

    lines += table(["arm", *[f"shift: {s}" for s in SHIFTS]],
                   [["public-only (non-private, public cases)",
                     *[cell({"arm": "public", "shift": s}) for s in SHIFTS]]])  # fmt: skip
    for eps in sorted({r["eps"] for r in rows if r.get("eps") is not None}):
        lines += ["", f"## Epsilon {eps:g}", ""]
        body = [[f"public init + {m} fine-tuning" + ("" if f == "full" else f" ({f.replace('@', ', ')})"),
                 *[cell({"arm": "finetune", "shift": s, "method": m, "eps": eps, "finetune": f})
                   for s in SHIFTS]]
                for f in _modes([r for r in rows if r.get("eps") == eps])
                for m in METHODS]  # fmt: skip
        body = [b for b in body if any(c != "not run" for c in b[1:])]
        private = cell({"arm": "private", "eps": eps, "method": "config"})
        body.append(["private only (shipped recipe, no public weights)", *[private] * 3])
        auto = cell({"arm": "private", "eps": eps, "method": "auto"})
        if auto != "not run":
            body.append(["private only (recipe: auto, no public weights)", *[auto] * 3])
        lines += table(["arm", *[f"shift: {s}" for s in SHIFTS]], body)
    lines += _snr_tables(rows)
    lines += reading_lines(data)
    return "\n".join(lines) + "\n"


def _mean_snr(rows: list[dict[str, Any]], sel: dict[str, Any]) -> dict[str, float]:
    """Mean SNR per layer; DP-KFC's "(fallback)" marks a parameter without a curvature block."""
    own = [{k.removesuffix(" (fallback)"): v for k, v in r["layer_snr"].items()}
           for r in rows if _matches(r, sel)]  # fmt: skip
    return {k: float(np.mean([o[k] for o in own])) for k in own[0]} if own else {}


def _snr_cell(sgd: dict[str, float], kfc: dict[str, float], layer: str) -> str:
    base = sgd.get(layer, np.nan)
    return f"{base:.2g} (x{kfc.get(layer, np.nan) / base:.2f})"


def _snr_tables(rows: list[dict[str, Any]]) -> list[str]:
    """Per layer: DP-KFC's mean SNR over DP-SGD's, per shift (runs that kept diagnostics)."""
    lines: list[str] = []
    kept = [r for r in rows if r.get("layer_snr")]
    for eps in sorted({r["eps"] for r in kept}):
        for mode in _modes(kept):
            at = {"arm": "finetune", "eps": eps, "finetune": mode}
            pairs = {s: (_mean_snr(kept, {**at, "shift": s, "method": "dp-sgd"}),
                         _mean_snr(kept, {**at, "shift": s, "method": "dp-kfc"}))
                     for s in SHIFTS}  # fmt: skip
            pairs = {s: v for s, v in pairs.items() if v[0] and v[1]}
            if not pairs:
                continue
            layers = list(dict.fromkeys(k for sgd, _ in pairs.values() for k in sgd))
            body = [[layer, *[_snr_cell(sgd, kfc, layer) for sgd, kfc in pairs.values()]]
                    for layer in layers]  # fmt: skip
            lines += ["", f"### Per-layer SNR, epsilon {eps:g}, {mode} fine-tuning",
                      "", "DP-SGD's SNR of each layer (its clipped signal's squared norm over the "
                      "noise's expected squared norm on that layer, mean over steps and seeds) and, "
                      "in brackets, DP-KFC's SNR as a multiple of it (above 1: DP-KFC's transform "
                      "leaves that layer more signal per unit of noise). Custodian diagnostics "
                      "from un-noised private gradients, not DP.", ""]  # fmt: skip
            lines += table(["layer", *[f"shift: {s}" for s in pairs]], body)
    return lines


def plot(data: dict[str, Any], path: Path) -> None:
    """Bars of test Dice per shift: public-only, fine-tuned (DP-SGD, DP-KFC), private-only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["runs"]
    eps_list = sorted({r["eps"] for r in rows if r.get("eps") is not None})
    if not eps_list:
        return

    def mean(sel: dict[str, Any]) -> float:
        vals = [r["test_mean_dice"] for r in rows if _matches(r, sel)]
        return float(np.mean(vals)) if vals else float("nan")

    arms = [("public-only", {"arm": "public"}, "#999999"),
            ("public init + DP-SGD", {"arm": "finetune", "method": "dp-sgd", "finetune": "full"},
             "#4c72b0"),
            ("public init + DP-KFC", {"arm": "finetune", "method": "dp-kfc", "finetune": "full"},
             "#dd8452"),
            ("private only", {"arm": "private", "method": "config"}, "#55a868")]  # fmt: skip
    fig, axes = plt.subplots(1, len(eps_list), figsize=(4.2 * len(eps_list), 3.4), sharey=True)
    axes = np.atleast_1d(axes)
    width = 0.2
    for ax, eps in zip(axes, eps_list):
        for i, (label, sel, color) in enumerate(arms):
            at = {} if sel["arm"] == "public" else {"eps": eps}
            values = [mean({**sel, **at, **({} if sel["arm"] == "private" else {"shift": s})})
                      for s in SHIFTS]  # fmt: skip
            ax.bar(np.arange(len(SHIFTS)) + (i - 1.5) * width, values, width, label=label,
                   color=color)  # fmt: skip
        ax.set_xticks(np.arange(len(SHIFTS)), [f"shift: {s}" for s in SHIFTS])
        ax.set_title(f"epsilon {eps:g}")
        ax.set_ylim(0, 1)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("test Dice (private test cases)")
    axes[-1].legend(loc="upper right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


RELEASE = ROOT / "runs" / "public_release"
"""Where ``--prepare-public`` puts the folders and the public model the shipped
``configs/hippocampus_unet_3d_public_init_eps1.yaml`` reads."""


def prepare_public(shift: str, threads: int) -> Path:
    """The shifted public release's non-private model and the private folder, under
    :data:`RELEASE` (``private/``, ``public_<shift>/``, ``public_<shift>_model/model.pt``)."""
    folders = prepare(RELEASE / "data")
    for name in ("private", shift):
        link = RELEASE / (name if name == "private" else f"public_{name}")
        if not link.exists():
            os.symlink(folders[name], link)
    model_dir = RELEASE / f"public_{shift}_model"
    if not (model_dir / "model.pt").is_file():
        classes = 2 if shift in ("labels", "both") else 3
        _train(_config(8.0), [f"data.path={folders[shift]}", f"data.num_classes={classes}",
                              "method=nonprivate", *_common(0, threads, None)], model_dir)  # fmt: skip
    return model_dir / "model.pt"


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--eps", default="1,8")
    p.add_argument("--seeds", default="1")
    p.add_argument(
        "--finetune",
        default="full",
        help="fine-tuning modes, e.g. full,lora,first_and_last_layers; a mode with its recipe's "
        "overrides after @: full@training.lr=0.003, full@training.head_first_epochs=10; "
        "full@training.recipe=auto: the rule's recipe for the public start",
    )
    p.add_argument("--methods", default=",".join(METHODS), help="of dp-sgd,dp-kfc")
    p.add_argument(
        "--private",
        default="config",
        help="private-only recipes, of config,auto (auto: the config under recipe: auto)",
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--epochs", type=int, default=None, help="every arm alike (default: config)")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--summarize", action="store_true", help="only rewrite the Markdown")
    p.add_argument(
        "--prepare-public",
        choices=SHIFTS,
        help="only write runs/public_release/ (the private folder and the shifted public "
        "release's non-private model) for configs/hippocampus_unet_3d_public_init_eps1.yaml",
    )
    args = p.parse_args(argv)
    if args.prepare_public:
        print(f"public model: {prepare_public(args.prepare_public, args.threads)}")
        return 0
    data = load_results(args.out)
    if args.summarize:
        args.out.with_suffix(".md").write_text(summarize(data), encoding="utf-8")
        plot(data, args.out.with_suffix(".png"))
        return 0
    torch.set_num_threads(args.threads)
    data.setdefault("environment", environment())
    data["git_commit"] = git_commit()
    work = runs_dir("public_init")
    folders = prepare(work / "data")
    done = {_key(r) for r in data["runs"]}
    save_results(args.out, data)
    modes, methods = tuple(args.finetune.split(",")), tuple(args.methods.split(","))
    private = tuple(args.private.split(","))
    for job in jobs(floats(args.eps), ints(args.seeds), modes, methods, private):
        if _key(job) in done:
            continue
        t0 = time.perf_counter()
        row = {**job, **run_job(job, folders, work, args.threads, args.epochs)}
        row["seconds"] = round(time.perf_counter() - t0, 1)
        record(args.out, data, row)
        args.out.with_suffix(".md").write_text(summarize(data), encoding="utf-8")
        plot(data, args.out.with_suffix(".png"))
        print(f"{_key(job)}: test Dice {row['test_mean_dice']:.3f} ({row['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
