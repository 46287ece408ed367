"""Private 3D segmentation: Dice per epsilon for non-private, DP-SGD and DP-KFC, and the levers.

Run the whole study (MSD Task04 hippocampus, epsilon 8, 3 and 1, seeds 1-3)::

    python -m dpkfc_bench segmentation                     # study "main"
    python -m dpkfc_bench segmentation --study levers      # the recipe's levers at epsilon 8
    python -m dpkfc_bench segmentation --study levers --lever-epsilons 3   # ... at epsilon 3
    python -m dpkfc_bench segmentation --study best        # each method's best recipe, on seeds
    python -m dpkfc_bench segmentation --study shipped     # the shipped configs, as shipped
    python -m dpkfc_bench segmentation --epsilons 8 \
        --methods dp-sgd,dp-kfc,dp-kfc-shampoo,dp-kfc-diagonal   # the preconditioner families

Every run is the CLI pipeline (`dpkfc_med.training.train`) on ``--config`` with only the method,
target epsilon, learning rate and seed changed (and, in the lever study, the lever's fields).
Privacy unit: one patient/volume; Poisson sampling of volumes; PRV accounting; delta from the
config (<= 1/N).

Tuning protocol (identical for every method and epsilon): the config's optimizer, schedule,
weight average, batch and epochs; a grid of learning rates ``--lrs`` times clip norms
``--clip-scales`` (x1 and x0.25 of the config's ``privacy.max_grad_norm``) run with the
tuning seed 0 and scored by validation mean Dice (foreground classes); where some method's best
sits on the grid's edge, the grid at that epsilon gets one more learning rate beyond it on the
1-3-10 sequence (0.03 -> 0.1), run by every method with every clip norm (``--widen``); the chosen
(learning rate, clip norm) is then run with the evaluation seeds and scored on the test cases. The training seed also draws the case split, so each seed has its own train/val/test cases. Non-private training is
tuned once (it has no epsilon). Model selection inside a run (best epoch by validation Dice) is
the same for every method. The gap fraction of a method at an epsilon is
(Dice - DP-SGD Dice) / (non-private Dice - DP-SGD Dice) on the test means.
Lever study: at epsilon 8 (or ``--lever-epsilons``), seed 0, each method at its learning rate
chosen in the main study at that epsilon and the config's clip norm,
the config as shipped and with one lever changed at a time; scored by validation Dice.
Best-recipe study: per epsilon and private method, the highest seed-0 validation Dice among
the main study's chosen point and every lever run of that method at that epsilon is evaluated
on the evaluation seeds (the same rule for every method).
Shipped study: each ``configs/hippocampus_unet_3d_eps{8,3,1}.yaml`` trained exactly as shipped
with the CLI's settings (noise from OS entropy, two torch threads, seed 0's split), timed, then
evaluated with ``dpkfc-med evaluate RUN --data FOLDER`` on a folder holding only the run's
test cases (cases it has never seen). A config is trained again when its SHA-256 differs from
the one its recorded run carries; the earlier run stays in the results as "earlier version".
Tuning and selection look at private validation data and are NOT covered by the reported
epsilon. Benchmark runs seed the noise (``privacy.reproducible_noise``) so that every method
sees the same batches and noise per seed; shipped runs draw it from OS entropy.

Results are appended run by run to the JSON (an interrupted benchmark resumes), and a Markdown
summary and a figure are regenerated from it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import shutil
import time
from pathlib import Path
from typing import Any

import yaml

from dpkfc_bench.harness import (
    RESULTS,
    ROOT,
    display_path,
    environment,
    floats,
    git_commit,
    ints,
    load_results,
    merge,
    pending,
    runs_dir,
    save_results,
)
from dpkfc_bench.segmentation_levers import (
    ALL_METHODS,
    FAMILIES,
    LEVER_METHODS,
    LEVERS,
    METHODS,
    TUNED_CLIP_LEVERS,
    lever_clip,
)
from dpkfc_bench.segmentation_select import (
    best_recipe,
    best_run,
    clip_grid,
    clip_scale,
    eps_key,
    lr_grid,
    widen,
)
from dpkfc_bench.segmentation_summary import plot, summarize
from dpkfc_med.data.paths import sha256_file

RUN_FIELDS = ("study", "lever", "phase", "method", "eps", "lr", "seed")
"""What identifies a run of the grid, with its clip scale (a run with this key is not rerun)."""


def _job(args: tuple[dict[str, Any], dict[str, Any], str, int]) -> dict[str, Any]:
    """One training run in a worker process (one torch thread each)."""
    import torch

    from dpkfc_med.training.config import config_from_dict
    from dpkfc_med.training.run import train

    cfg_dict, key, work, threads = args
    torch.set_num_threads(threads)
    name = _run_name(key)
    cfg = config_from_dict(
        merge(
            cfg_dict,
            {
                "name": name,
                "training": {"progress": False, "threads": threads},
                "output": {"dir": str(Path(work) / name)},
                # data-free pretraining is the same for every method and epsilon of a seed:
                # computed once, bitwise the same weights (its minutes are not in "seconds")
                "pretrain": {"cache_dir": str(Path(work) / "pretrain_cache")},
            },
        )
    )
    shutil.rmtree(cfg.run_dir(), ignore_errors=True)  # a crashed earlier attempt of this run
    t0 = time.time()
    res = train(cfg)
    diag = res.custodian.get("diagnostics") or {}
    return {
        **key,
        "val": _dice(res.metrics["val"]),
        "test": _dice(res.metrics["test"]),
        "epsilon_spent": res.epsilon,
        "noise_multiplier": res.report["privacy"].get("noise_multiplier"),
        "steps": res.report["privacy"].get("steps"),
        "selected_epoch": res.metrics.get("selected_epoch"),
        "evidence": {
            k: diag.get(k)
            for k in (
                "mean_clipped_fraction",
                "mean_median_transformed_norm",
                "mean_layer_share",
                "mean_layer_snr",
            )
        },
        "seconds": time.time() - t0,
        "threads": threads,
        "device": cfg.training.device,
    }


def _shipped_job(config: Path, work: Path, threads: int = 2) -> dict[str, Any]:
    """Train a shipped config as shipped, then evaluate it on a folder of its test cases."""
    import torch

    from dpkfc_med.training.config import load_config
    from dpkfc_med.training.evaluate import evaluate_run
    from dpkfc_med.training.run import train

    torch.set_num_threads(threads)
    run_dir = work / f"shipped_{config.stem}"
    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = load_config(config, [f"output.dir={run_dir}", "training.progress=false"])
    t0 = time.time()
    res = train(cfg)
    minutes = (time.time() - t0) / 60
    split = json.loads(
        (run_dir / "private_not_for_release" / "split.json").read_text(encoding="utf-8")
    )
    source = Path(res.report["data"]["path"]) if "path" in res.report["data"] else None
    source = source or Path(res.custodian["data"]["path"])
    folder = work / f"unseen_cases_{config.stem}"
    shutil.rmtree(folder, ignore_errors=True)
    for sub in ("imagesTr", "labelsTr"):
        (folder / sub).mkdir(parents=True)
        for case in split["test"]:
            name = f"{case}.nii.gz"
            os.symlink(source / sub / name, folder / sub / name)
    unseen = evaluate_run(run_dir, data=str(folder))
    return {
        "config": display_path(config),
        "config_sha256": sha256_file(config),
        "epsilon_spent": res.epsilon,
        "minutes": minutes,
        "threads": threads,
        "test": _dice(res.metrics["test"]),
        "unseen_folder": {**_dice(unseen), "n": unseen["n"], "not_dp": unseen.get("not_dp")},
        "git_commit": git_commit(),
    }


def _run_name(key: dict[str, Any]) -> str:
    tag = hashlib.sha256(key["lever"].encode()).hexdigest()[:8]  # stable across processes
    lever = "" if key["lever"] == "shipped" else f"_lever{tag}"
    eps = "np" if key["eps"] is None else f"eps{key['eps']:g}"
    clip = "" if clip_scale(key) == 1.0 else f"_c{clip_scale(key):g}"
    return f"{key['method']}_{eps}_lr{key['lr']:g}{clip}_s{key['seed']}{lever}"


def _dice(m: dict[str, Any]) -> dict[str, Any]:
    keys = ("mean_dice", "dice_per_class", "hd95_per_class", "hd95_missed_cases")
    return {k: m[k] for k in keys if k in m}


def _config_for(base: dict[str, Any], key: dict[str, Any]) -> dict[str, Any]:
    """The run's config: the base, the lever's change, the method, lr, seed and epsilon."""
    lever = json.loads(json.dumps(LEVERS[key["lever"]]))
    if isinstance(lever.get("privacy", {}).get("max_grad_norm"), str):
        scale = lever_clip(key["lever"])
        lever["privacy"]["max_grad_norm"] = base["privacy"]["max_grad_norm"] * scale
    family = json.loads(json.dumps(FAMILIES.get(key["method"], {})))
    extra: dict[str, Any] = {
        **family,
        "method": family.get("method", key["method"]),
        "training": {"lr": key["lr"], "seed": key["seed"]},
        # research protocol: the same batches and noise for every method per seed
        "privacy": {"reproducible_noise": True},
    }
    if key["eps"] is not None:
        extra["privacy"]["target_epsilon"] = key["eps"]
    cfg = merge(merge(base, lever), extra)
    if clip_scale(key) != 1.0:
        cfg["privacy"]["max_grad_norm"] = cfg["privacy"]["max_grad_norm"] * clip_scale(key)
    return cfg


def _run_key(run: dict[str, Any]) -> tuple[Any, ...]:
    return (*(run.get(k) for k in RUN_FIELDS), clip_scale(run))


def _run_all(
    jobs: list[dict[str, Any]],
    base: dict[str, Any],
    data: dict[str, Any],
    out: Path,
    work: Path,
    workers: int,
    threads: int | None = None,
) -> None:
    """Train the jobs no recorded run matches, ``workers`` at a time; record each as it ends."""
    todo = pending(jobs, data["runs"], _run_key)
    if not todo:
        return
    threads = threads or (1 if workers > 1 else 2)
    args = [(_config_for(base, k), k, str(work), threads) for k in todo]
    ctx = mp.get_context("spawn")
    with ctx.Pool(processes=min(workers, len(args)), maxtasksperchild=1) as pool:
        for rec in pool.imap_unordered(_job, args):
            data["runs"].append(rec)
            data["class_names"] = list(rec["test"]["dice_per_class"])
            save_results(out, data)
            eps = "-" if rec["eps"] is None else f"{rec['eps']:g}"
            print(
                f"{rec['study']}/{rec['phase']} {rec['method']} eps={eps} lr={rec['lr']:g} "
                f"seed={rec['seed']} [{rec['lever']}]: val {rec['val']['mean_dice']:.3f} "
                f"test {rec['test']['mean_dice']:.3f} ({rec['seconds'] / 60:.1f} min)",
                flush=True,
            )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--config", type=Path, default=ROOT / "dpkfc_bench/hippocampus_unet_3d_recipe_base.yaml"
    )
    p.add_argument("--study", choices=("main", "levers", "best", "shipped"), default="main")
    p.add_argument(
        "--methods",
        default=",".join(METHODS),
        help=f"comma list of {', '.join(ALL_METHODS)} (the last are DP-KFC's other "
        "preconditioner families)",
    )
    p.add_argument("--epsilons", default="8,3,1")
    p.add_argument("--lrs", default="0.003,0.01,0.03")
    p.add_argument(
        "--clip-scales",
        default="1,0.25",
        help="clip norms tuned with every learning rate, as multiples of the config's "
        "privacy.max_grad_norm (every private method gets the same grid)",
    )
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument(
        "--widen",
        type=int,
        default=2,
        help="grid points added (the next of 1-3-10 beyond the edge, for every method at that epsilon) when "
        "a method's best learning rate sits on the grid's edge",
    )
    p.add_argument(
        "--levers",
        help="lever study: comma-separated lever numbers (1 = the first after 'shipped'); "
        "default all",
    )
    p.add_argument(
        "--lever-epsilons",
        default="8",
        help="lever study: the epsilons it runs at (each method at its learning rate chosen "
        "there in the main study)",
    )
    p.add_argument(
        "--lever-seeds",
        help="lever study: evaluate the chosen levers on these seeds (test cases of each seed's "
        "split) instead of tuning them on seed 0; restrict with --levers and --methods",
    )
    p.add_argument("--workers", type=int, default=2, help="runs in parallel (one thread each)")
    p.add_argument(
        "--threads",
        type=int,
        help="torch threads per run (default: 1 with several workers, else 2)",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda", "auto"),
        help="training.device of every run (default: the config's); several --workers share "
        "one GPU",
    )
    p.add_argument("--runs-dir", type=Path, default=runs_dir("segmentation"))
    p.add_argument("--out", type=Path, default=RESULTS / "segmentation_hippocampus.json")
    return p


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    p = _parser()
    args = p.parse_args(argv)
    base = yaml.safe_load(args.config.read_text(encoding="utf-8"))
    if args.device:
        base.setdefault("training", {})["device"] = args.device
    methods = args.methods.split(",")
    for method in methods:
        if method not in ALL_METHODS:
            p.error(f"--methods: unknown method {method!r}; choose from {', '.join(ALL_METHODS)}")
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    data = load_results(out)
    commits = data.setdefault("git_commits", [data["git_commit"]] if data.get("git_commit") else [])
    if git_commit() not in commits:  # every commit whose code made some of the runs
        commits.append(git_commit())
    if args.study == "main":
        _study_main(args, base, data, methods)
    elif args.study == "best":
        _study_best(args, base, data, methods)
    elif args.study == "shipped":
        _study_shipped(args, data)
    else:
        _study_levers(args, base, data, methods, p.error)
    out.with_suffix(".md").write_text(summarize(data), encoding="utf-8")
    plot(data, out.with_suffix(".png"))
    print(out.with_suffix(".md").read_text(encoding="utf-8"))
    return 0


def _study_main(
    args: argparse.Namespace, base: dict[str, Any], data: dict[str, Any], methods: list[str]
) -> None:
    """Tune every method on the (learning rate, clip norm) grid, widen, evaluate the best."""
    epsilons = floats(args.epsilons)
    data.update(
        {
            "config": display_path(args.config),
            "config_contents": base,
            "protocol": __doc__.split("Tuning protocol")[1].split("Results are")[0].strip(),
            "lrs": floats(args.lrs),
            "seeds": ints(args.seeds),
            # a study of some methods at some epsilons keeps the other epsilons' rows
            "epsilons": sorted({*(data.get("epsilons") or []), *epsilons}, reverse=True),
            "tuning_seed": 0,
            "workers": args.workers,
            "environment": environment(),
            "git_commit": git_commit(),
        }
    )
    common = {"study": "main", "lever": "shipped"}

    def run(jobs: list[dict[str, Any]]) -> None:
        _run_all(jobs, base, data, args.out, args.runs_dir, args.workers, args.threads)

    # One epsilon at a time (non-private first), so a partial study holds whole rows.
    for eps in [None, *epsilons]:
        if eps is not None:  # per epsilon: a later study at other epsilons keeps these
            data.setdefault("clip_scales", {})[eps_key(eps)] = floats(args.clip_scales)
        ms = ["nonprivate"] if eps is None else [m for m in methods if m != "nonprivate"]
        if eps is None and "nonprivate" not in methods:
            continue
        tune = {**common, "phase": "tune", "eps": eps, "seed": 0}
        run(
            [
                {**tune, "method": m, "lr": lr, "clip": c}
                for m in ms
                for lr in lr_grid(data, eps)
                for c in clip_grid(data, eps)
            ]
        )
        for _ in range(args.widen):  # a best on the grid's edge: one more point for all
            lr = widen(data, eps, ms)
            if lr is None:
                break
            data.setdefault("widened", {}).setdefault(eps_key(eps), []).append(lr)
            run(
                [
                    {**tune, "method": m, "lr": lr, "clip": c}
                    for m in ms
                    for c in clip_grid(data, eps)
                ]
            )
        evals = [
            {
                **common,
                "phase": "eval",
                "method": m,
                "eps": eps,
                "lr": b["lr"],
                "clip": clip_scale(b),
                "seed": s,
            }
            for m in ms
            if (b := best_run(data, m, eps)) is not None
            for s in data["seeds"]
        ]
        run(evals)
        args.out.with_suffix(".md").write_text(summarize(data), encoding="utf-8")


def _study_best(
    args: argparse.Namespace, base: dict[str, Any], data: dict[str, Any], methods: list[str]
) -> None:
    """Evaluate each method's best recipe per epsilon (when a lever) on the evaluation seeds."""
    jobs = []
    for eps in floats(args.epsilons):
        for m in [x for x in methods if x in METHODS[1:]]:
            b = best_recipe(data, m, eps)
            if b is None or b.get("study", "main") == "main":
                continue  # the main study evaluates its own points
            key = {k: b[k] for k in ("study", "lever", "method", "eps", "lr")}
            if clip_scale(b) != 1.0:
                key["clip"] = clip_scale(b)
            jobs += [{**key, "phase": "eval", "seed": s} for s in data["seeds"]]
    _run_all(jobs, base, data, args.out, args.runs_dir, args.workers, args.threads)


def _study_shipped(args: argparse.Namespace, data: dict[str, Any]) -> None:
    """Train each shipped config whose digest no recorded run carries, as shipped."""
    data.setdefault("shipped", {})
    for eps in floats(args.epsilons):
        config = ROOT / "configs" / f"hippocampus_unet_3d_eps{eps:g}.yaml"
        old, digest = data["shipped"].get(display_path(config)), sha256_file(config)
        if old is not None and old.get("config_sha256") == digest:
            continue  # this config as it is now was trained
        if old is not None:  # changed since (or not recorded): its earlier run goes to history
            data.setdefault("shipped_history", []).append(old)
        rec = _shipped_job(config, args.runs_dir)
        data["shipped"][rec["config"]] = rec
        save_results(args.out, data)
        print(
            f"shipped {rec['config']}: {rec['minutes']:.1f} min, unseen Dice "
            f"{rec['unseen_folder']['mean_dice']:.3f}",
            flush=True,
        )


def _study_levers(
    args: argparse.Namespace,
    base: dict[str, Any],
    data: dict[str, Any],
    methods: list[str],
    error: Any,
) -> None:
    """Each lever at each method's chosen learning rate: seed 0, or ``--lever-seeds``."""
    jobs = []
    chosen = list(LEVERS)[1:]  # "shipped" is the main study's tuning run
    if args.levers:
        chosen = [chosen[i - 1] for i in ints(args.levers)]
    for eps in floats(args.lever_epsilons):
        for lever in chosen:
            for m in LEVER_METHODS.get(lever, tuple(x for x in methods if x != "nonprivate")):
                if m not in methods:
                    continue
                tuned = lever in TUNED_CLIP_LEVERS
                b = best_run(data, m, eps, None if tuned else 1.0)
                if b is None:
                    error(
                        f"--study levers: run the main study first (no tuned lr for {m} at {eps:g})"
                    )
                    return
                key = {
                    "study": "levers",
                    "lever": lever,
                    "method": m,
                    "eps": eps,
                    "lr": b["lr"],
                    **({"clip": clip_scale(b)} if tuned and clip_scale(b) != 1.0 else {}),
                }
                if args.lever_seeds:  # evaluation of the lever on the evaluation seeds
                    jobs += [{**key, "phase": "eval", "seed": s} for s in ints(args.lever_seeds)]
                else:
                    jobs.append({**key, "phase": "tune", "seed": 0})
    _run_all(jobs, base, data, args.out, args.runs_dir, args.workers, args.threads)
