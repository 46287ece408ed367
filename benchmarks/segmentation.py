"""Private 3D segmentation: Dice per epsilon for non-private, DP-SGD and DP-KFC, and the levers.

Run the whole study (MSD Task04 hippocampus, epsilon 8, 3 and 1, seeds 1-3)::

    python benchmarks/segmentation.py                     # study "main"
    python benchmarks/segmentation.py --study levers      # the recipe's levers at epsilon 8
    python benchmarks/segmentation.py --study levers --lever-epsilons 3   # ... at epsilon 3
    python benchmarks/segmentation.py --study best        # each method's best recipe, on seeds
    python benchmarks/segmentation.py --study shipped     # the shipped configs, as shipped
    python benchmarks/segmentation.py --epsilons 8 \
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
import math
import multiprocessing as mp
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from accuracy import ROOT, _environment, _git_commit, _load, _merge, _save  # noqa: E402

METHODS = ("nonprivate", "dp-sgd", "dp-kfc")
# The other probe-only preconditioner families, run through the same protocol as DP-KFC's
# default family (K-FAC): the method and the config fields it changes.
FAMILIES: dict[str, dict[str, Any]] = {
    "dp-kfc-shampoo": {"method": "dp-kfc", "preconditioner": {"family": "shampoo"}},
    "dp-kfc-diagonal": {"method": "dp-kfc", "preconditioner": {"family": "diagonal"}},
}
PRIVATE = (*METHODS[1:], *FAMILIES)
ALL_METHODS = (*METHODS, *FAMILIES)

# Each method's best recipe that the later levers change one thing of: DP-SGD's combined lever
# (run at its tuned clip norm) and DP-KFC's per-layer raw-norm recipe at clip norm x0.25.
_SGD_BEST: dict[str, Any] = {"pretrain": {"steps": 1000}, "data": {"patches_per_unit": 2}}
_KFC_BEST: dict[str, Any] = _merge(
    _SGD_BEST,
    {"preconditioner": {"scaling": "per_layer_raw"}, "privacy": {"max_grad_norm": "x0.25"}},
)
_GROUP4: dict[str, Any] = {"model": {"kwargs": {"norm": ["group", {"num_groups": 4}]}}}

# One lever changed at a time from the shipped config (the lever study).
LEVERS: dict[str, dict[str, Any]] = {
    "shipped": {},
    "no data-free pretraining": {"pretrain": {"steps": 0}},
    "previous recipe (24^3 patches x2, batch 16, 18 epochs, no pretraining)": {
        "data": {"patch_size": [24, 24, 24], "patches_per_unit": 2},
        "training": {"batch_size": 16, "epochs": 18},
        "pretrain": {"steps": 0},
    },
    "24^3 patches x2 instead of nearly whole volumes": {
        "data": {"patch_size": [24, 24, 24], "patches_per_unit": 2}
    },
    "augmentation multiplicity: 2 random crops per patient, summed before clipping": {
        "data": {"patches_per_unit": 2}
    },
    "batch 32 (more, noisier steps)": {"training": {"batch_size": 32}},
    "80 epochs (twice the steps, more noise per step)": {"training": {"epochs": 80}},
    "20 epochs (half the steps, less noise per step)": {"training": {"epochs": 20}},
    "data-free pretraining 1000 steps instead of 200": {"pretrain": {"steps": 1000}},
    "weight average (decay 0.9)": {"training": {"ema_decay": 0.9}},
    "cosine learning rate": {"training": {"lr_schedule": "cosine"}},
    "clip norm x0.25": {"privacy": {"max_grad_norm": "x0.25"}},
    "UNet channels 16-32-64 (4x parameters)": {"model": {"kwargs": {"channels": [16, 32, 64]}}},
    "UNet channels 4-8-16 (1/4 of the parameters)": {"model": {"kwargs": {"channels": [4, 8, 16]}}},
    "K-FAC A only (no G factor)": {"preconditioner": {"factors": "a"}},
    "probe targets: smooth blobs on a background": {"probes": {"target": "shapes"}},
    "preconditioner family: Shampoo (L^-1/4 g R^-1/4 from probe gradients)": {
        "preconditioner": {"family": "shampoo"}
    },
    "preconditioner family: diagonal (probe gradient second moment)": {
        "preconditioner": {"family": "diagonal"}
    },
    # the per-layer evidence: DP-KFC's whitening leaves the first convolution (and the PReLU
    # slopes, fallback s I) a tiny share of the clipped norm; three ways to give it back
    "per-layer scale rule (each layer's median transformed norm equal on probes)": {
        "preconditioner": {"scaling": "per_layer"}
    },
    "weaker input whitening (damping_a 0.1 instead of 0.001)": {
        "preconditioner": {"damping_a": 0.1}
    },
    "per-layer scale rule keeping each layer's unpreconditioned norm on probes": {
        "preconditioner": {"scaling": "per_layer_raw"}
    },
    # that rule leaves most units unclipped at the config's C, as DP-SGD at x1: with x0.25
    "the same per-layer scale rule with clip norm x0.25": {
        "preconditioner": {"scaling": "per_layer_raw"},
        "privacy": {"max_grad_norm": "x0.25"},
    },
    # pretraining 1000 steps combined with each method's clip norm from the main study's grid
    # (DP-SGD's x0.25; DP-KFC clips every unit, so its update under Adam does not depend on C)
    "data-free pretraining 1000 steps at each method's tuned clip norm": {
        "pretrain": {"steps": 1000}
    },
    # longer data-free pretraining (the strongest single lever for DP-SGD below epsilon 8)
    "data-free pretraining 3000 steps at each method's tuned clip norm": {
        "pretrain": {"steps": 3000}
    },
    # after pretraining the network is a confident segmenter: G from labels it would predict
    # (the true Fisher) instead of label maps independent of it
    "data-free pretraining 1000 steps with probe targets sampled from the model (true Fisher)": {
        "pretrain": {"steps": 1000},
        "probes": {"target": "model"},
    },
    # probes closer to real volumes than pink noise: the pretraining's own synthetic shapes
    "probe images: shape volumes (the pretraining's synthetic volumes) with their label maps": {
        "probes": {"kind": "shapes"}
    },
    "data-free pretraining 1000 steps with shape-volume probes": {
        "pretrain": {"steps": 1000},
        "probes": {"kind": "shapes"},
    },
    # the two recipe levers that helped both methods on seed 0, together
    "combined: pretraining 1000 steps + 2 random crops per patient, at each method's tuned "
    "clip norm": {"pretrain": {"steps": 1000}, "data": {"patches_per_unit": 2}},
    # the privatized update multiplied by P once more (post-processing): signal P^2 g, the
    # damped K-FAC natural gradient, instead of the transformed step's P g
    "natural-gradient step (P applied again to the privatized update)": {
        "preconditioner": {"step": "natural"}
    },
    # DP-SGD's best recipe (the combined lever at its clip norm x0.25) with a preconditioner that
    # keeps DP-SGD's split of the clipped norm between layers and only reshapes each layer
    "combined, with the per-layer scale rule keeping each layer's unpreconditioned norm, at "
    "clip norm x0.25": {
        "pretrain": {"steps": 1000},
        "data": {"patches_per_unit": 2},
        "preconditioner": {"scaling": "per_layer_raw"},
        "privacy": {"max_grad_norm": "x0.25"},
    },
    # below epsilon 8 the per-layer SNR of this recipe stays under DP-SGD's in the first
    # convolution and the decoder (epsilon 1); relative damping 1.0 keeps the directions above
    # each factor's mean eigenvalue whitened and leaves the rest nearly as DP-SGD has them
    "combined, with the per-layer raw-norm scale rule and milder preconditioning (damping_a "
    "and damping_g 1.0), at clip norm x0.25": _merge(
        _KFC_BEST, {"preconditioner": {"damping_a": 1.0, "damping_g": 1.0}}
    ),
    "combined, with the per-layer raw-norm scale rule and the Shampoo family, at clip norm x0.25": (
        _merge(_KFC_BEST, {"preconditioner": {"family": "shampoo"}})
    ),
    # the step count and batch size on each method's best recipe (DP-SGD's combined lever at
    # its tuned clip norm; DP-KFC's per-layer raw-norm recipe), the same change for both
    "combined at each method's tuned clip norm, 20 epochs (half the steps, less noise per step)": (
        _merge(_SGD_BEST, {"training": {"epochs": 20}})
    ),
    "combined, with the per-layer raw-norm scale rule, at clip norm x0.25, 20 epochs (half "
    "the steps, less noise per step)": _merge(_KFC_BEST, {"training": {"epochs": 20}}),
    "combined at each method's tuned clip norm, expected batch 128 (half the steps, each "
    "with twice the patients)": _merge(_SGD_BEST, {"training": {"batch_size": 128}}),
    "combined, with the per-layer raw-norm scale rule, at clip norm x0.25, expected batch 128 "
    "(half the steps, each with twice the patients)": _merge(
        _KFC_BEST, {"training": {"batch_size": 128}}
    ),
    # the damping path from DP-KFC to DP-SGD (relative damping 10: every direction nearly as
    # DP-SGD has it, the per-layer raw-norm rule keeping DP-SGD's split between layers)
    "combined, with the per-layer raw-norm scale rule and weak preconditioning (damping_a "
    "and damping_g 10), at clip norm x0.25": _merge(
        _KFC_BEST, {"preconditioner": {"damping_a": 10.0, "damping_g": 10.0}}
    ),
    # normalisation: the UNet's instance norm (no affine) against GroupNorm with 4 groups
    # (affine, channels share statistics), on each method's best recipe
    "combined at each method's tuned clip norm, GroupNorm 4 groups instead of instance norm": (
        _merge(_SGD_BEST, _GROUP4)
    ),
    "combined, with the per-layer raw-norm scale rule, at clip norm x0.25, GroupNorm 4 groups "
    "instead of instance norm": _merge(_KFC_BEST, _GROUP4),
}
# Levers run at each method's (learning rate, clip norm) chosen in the main study; the others
# at its learning rate chosen at the config's clip norm.
TUNED_CLIP_LEVERS = (
    "data-free pretraining 1000 steps at each method's tuned clip norm",
    "data-free pretraining 3000 steps at each method's tuned clip norm",
    "combined: pretraining 1000 steps + 2 random crops per patient, at each method's tuned "
    "clip norm",
    "combined at each method's tuned clip norm, 20 epochs (half the steps, less noise per step)",
    "combined at each method's tuned clip norm, expected batch 128 (half the steps, each "
    "with twice the patients)",
    "combined at each method's tuned clip norm, GroupNorm 4 groups instead of instance norm",
)
LEVER_METHODS = {
    "K-FAC A only (no G factor)": ("dp-kfc",),
    "probe targets: smooth blobs on a background": ("dp-kfc",),
    "preconditioner family: Shampoo (L^-1/4 g R^-1/4 from probe gradients)": ("dp-kfc",),
    "preconditioner family: diagonal (probe gradient second moment)": ("dp-kfc",),
    "per-layer scale rule (each layer's median transformed norm equal on probes)": ("dp-kfc",),
    "weaker input whitening (damping_a 0.1 instead of 0.001)": ("dp-kfc",),
    "per-layer scale rule keeping each layer's unpreconditioned norm on probes": ("dp-kfc",),
    "the same per-layer scale rule with clip norm x0.25": ("dp-kfc",),
    "data-free pretraining 1000 steps at each method's tuned clip norm": ("dp-sgd",),
    "data-free pretraining 1000 steps with probe targets sampled from the model (true Fisher)": (
        "dp-kfc",
    ),
    "probe images: shape volumes (the pretraining's synthetic volumes) with their label maps": (
        "dp-kfc",
    ),
    "data-free pretraining 1000 steps with shape-volume probes": ("dp-kfc",),
    "natural-gradient step (P applied again to the privatized update)": ("dp-kfc",),
    "combined, with the per-layer scale rule keeping each layer's unpreconditioned norm, at "
    "clip norm x0.25": ("dp-kfc",),
    "combined, with the per-layer raw-norm scale rule and milder preconditioning (damping_a "
    "and damping_g 1.0), at clip norm x0.25": ("dp-kfc",),
    "combined, with the per-layer raw-norm scale rule and the Shampoo family, at clip norm x0.25": (
        "dp-kfc",
    ),
    "combined at each method's tuned clip norm, 20 epochs (half the steps, less noise per step)": (
        "dp-sgd",
    ),
    "combined, with the per-layer raw-norm scale rule, at clip norm x0.25, 20 epochs (half "
    "the steps, less noise per step)": ("dp-kfc",),
    "combined at each method's tuned clip norm, expected batch 128 (half the steps, each "
    "with twice the patients)": ("dp-sgd",),
    "combined, with the per-layer raw-norm scale rule, at clip norm x0.25, expected batch 128 "
    "(half the steps, each with twice the patients)": ("dp-kfc",),
    "combined, with the per-layer raw-norm scale rule and weak preconditioning (damping_a "
    "and damping_g 10), at clip norm x0.25": ("dp-kfc",),
    "combined at each method's tuned clip norm, GroupNorm 4 groups instead of instance norm": (
        "dp-sgd",
    ),
    "combined, with the per-layer raw-norm scale rule, at clip norm x0.25, GroupNorm 4 groups "
    "instead of instance norm": ("dp-kfc",),
}


def _job(args: tuple[dict[str, Any], dict[str, Any], str, int]) -> dict[str, Any]:
    """One training run in a worker process (one torch thread each)."""
    import torch

    from dpkfc_med.training.config import config_from_dict
    from dpkfc_med.training.loop import train

    cfg_dict, key, runs_dir, threads = args
    torch.set_num_threads(threads)
    name = _run_name(key)
    cfg = config_from_dict(
        _merge(
            cfg_dict,
            {
                "name": name,
                "training": {"progress": False, "threads": threads},
                "output": {"dir": str(Path(runs_dir) / name)},
                # data-free pretraining is the same for every method and epsilon of a seed:
                # computed once, bitwise the same weights (its minutes are not in "seconds")
                "pretrain": {"cache_dir": str(Path(runs_dir) / "pretrain_cache")},
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


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _shipped_job(config: Path, runs_dir: Path, threads: int = 2) -> dict[str, Any]:
    """Train a shipped config as shipped, then evaluate it on a folder of its test cases."""
    import os

    import torch

    from dpkfc_med.training.config import load_config
    from dpkfc_med.training.evaluate import evaluate_run
    from dpkfc_med.training.loop import train

    torch.set_num_threads(threads)
    run_dir = runs_dir / f"shipped_{config.stem}"
    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = load_config(config, [f"output.dir={run_dir}", "training.progress=false"])
    t0 = time.time()
    res = train(cfg)
    minutes = (time.time() - t0) / 60
    split = json.loads((run_dir / "private_not_for_release" / "split.json").read_text())
    source = Path(res.report["data"]["path"]) if "path" in res.report["data"] else None
    source = source or Path(res.custodian["data"]["path"])
    folder = runs_dir / f"unseen_cases_{config.stem}"
    shutil.rmtree(folder, ignore_errors=True)
    for sub in ("imagesTr", "labelsTr"):
        (folder / sub).mkdir(parents=True)
        for case in split["test"]:
            name = f"{case}.nii.gz"
            os.symlink(source / sub / name, folder / sub / name)
    unseen = evaluate_run(run_dir, data=str(folder))
    return {
        "config": _display_path(config),
        "config_sha256": _sha256(config),
        "epsilon_spent": res.epsilon,
        "minutes": minutes,
        "threads": threads,
        "test": _dice(res.metrics["test"]),
        "unseen_folder": {**_dice(unseen), "n": unseen["n"], "not_dp": unseen.get("not_dp")},
        "git_commit": _git_commit(),
    }


def _clip(key: dict[str, Any]) -> float:
    """The key's clip-norm scale (x the config's ``privacy.max_grad_norm``; 1 when absent)."""
    return float(key.get("clip", 1.0))


def _lever_clip(lever: str | None) -> float:
    """The clip-norm scale a lever itself sets (``"x0.25"``; 1 when it sets none)."""
    clip = LEVERS.get(lever or "shipped", {}).get("privacy", {}).get("max_grad_norm")
    if clip is None:
        return 1.0
    if not (isinstance(clip, str) and clip.startswith("x")):
        raise ValueError(f"lever {lever!r}: max_grad_norm must be a scale like 'x0.25'")
    return float(clip[1:])


def _run_name(key: dict[str, Any]) -> str:
    tag = hashlib.sha256(key["lever"].encode()).hexdigest()[:8]
    lever = "" if key["lever"] == "shipped" else f"_lever{tag}"
    eps = "np" if key["eps"] is None else f"eps{key['eps']:g}"
    clip = "" if _clip(key) == 1.0 else f"_c{_clip(key):g}"
    return f"{key['method']}_{eps}_lr{key['lr']:g}{clip}_s{key['seed']}{lever}"


def _display_path(path: Path) -> str:
    p = path.resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)


def _dice(m: dict[str, Any]) -> dict[str, Any]:
    keys = ("mean_dice", "dice_per_class", "hd95_per_class", "hd95_missed_cases")
    return {k: m[k] for k in keys if k in m}


def _config_for(base: dict[str, Any], key: dict[str, Any]) -> dict[str, Any]:
    lever = json.loads(json.dumps(LEVERS[key["lever"]]))
    if isinstance(lever.get("privacy", {}).get("max_grad_norm"), str):
        scale = _lever_clip(key["lever"])
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
    cfg = _merge(_merge(base, lever), extra)
    if _clip(key) != 1.0:
        cfg["privacy"]["max_grad_norm"] = cfg["privacy"]["max_grad_norm"] * _clip(key)
    return cfg


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return _clip(a) == _clip(b) and all(
        a.get(k) == b.get(k) for k in ("study", "lever", "phase", "method", "eps", "lr", "seed")
    )


def _grid(data: dict[str, Any], eps: float | None) -> list[float]:
    """The learning-rate grid at ``eps``: ``--lrs``, plus the points widening added there."""
    extra = (data.get("widened") or {}).get(_eps_key(eps), [])
    return sorted({*(data.get("lrs") or []), *extra})


def _eps_key(eps: float | None) -> str:
    return "nonprivate" if eps is None else f"{eps:g}"


def _widen(data: dict[str, Any], eps: float | None, methods: list[str]) -> float | None:
    """A learning rate one grid step (x3) beyond an edge where some method's best sits."""
    grid = _grid(data, eps)
    if len(grid) < 2:
        return None
    best = {_best_lr(data, m, eps) for m in methods}
    if grid[-1] in best:
        return _step(grid[-1], up=True) if grid[-1] < 1 else None
    if grid[0] in best:
        return _step(grid[0], up=False)
    return None


def _step(lr: float, *, up: bool) -> float:
    """The neighbour of ``lr`` on the 1-3-10 grid (0.03 -> 0.1 up, 0.003 -> 0.001 down)."""
    e = math.floor(math.log10(lr))
    mantissa = lr / 10**e
    if up:
        return float(f"{(3 if mantissa < 2 else 10) * 10**e:.3g}")
    return float(f"{(1 if mantissa > 2 else 0.3) * 10**e:.3g}")


def _clips(data: dict[str, Any], eps: float | None) -> list[float]:
    """The clip-norm scales tuned at ``eps``: ``--clip-scales`` of the study run there."""
    if eps is None:
        return [1.0]
    return sorted((data.get("clip_scales") or {}).get(_eps_key(eps)) or [1.0])


def _best(
    data: dict[str, Any], method: str, eps: float | None, clip: float | None = None
) -> dict[str, Any] | None:
    """The tuning run on the (learning rate, clip scale) grid with the best validation Dice.

    ``clip`` restricts the grid to one clip scale (the lever study runs at the config's).
    """
    lrs = set(_grid(data, eps))
    clips = set(_clips(data, eps)) if clip is None else {clip}
    tune = [
        r
        for r in data["runs"]
        if r.get("study", "main") == "main"
        and r["phase"] == "tune"
        and r["method"] == method
        and r["eps"] == eps
        and (not lrs or r["lr"] in lrs)
        and _clip(r) in clips
    ]
    # Dice to the reported 3 decimals, ties to the config's clip norm: a method that clips every
    # unit under Adam is invariant to C, and its x0.25 runs differ from the x1 runs by float
    # rounding only.
    return (
        max(tune, key=lambda r: (round(r["val"]["mean_dice"], 3), _clip(r) == 1.0))
        if tune
        else None
    )


def _best_lr(
    data: dict[str, Any], method: str, eps: float | None, clip: float | None = None
) -> float | None:
    """The learning rate of the best tuning run (see ``_best``)."""
    best = _best(data, method, eps, clip)
    return None if best is None else best["lr"]


def _eval_runs(data: dict[str, Any], method: str, eps: float | None) -> list[dict[str, Any]]:
    best = _best(data, method, eps)
    seeds = set(data.get("seeds") or [])
    return [
        r
        for r in data["runs"]
        if best is not None
        and r.get("study", "main") == "main"
        and r["phase"] == "eval"
        and r["method"] == method
        and r["eps"] == eps
        and r["lr"] == best["lr"]
        and _clip(r) == _clip(best)
        and (not seeds or r["seed"] in seeds)
    ]


def _evaluated(data: dict[str, Any]) -> list[str]:
    """The private methods with evaluation runs at some epsilon, in the tables' order."""
    eps_list = data.get("epsilons") or []
    return [m for m in PRIVATE if any(_eval_runs(data, m, e) for e in eps_list)]


def _best_recipe(data: dict[str, Any], method: str, eps: float) -> dict[str, Any] | None:
    """The method's best seed-0 run at ``eps``: its main-study point or any of its lever runs.

    One rule for every method: the highest validation Dice (to the reported 3 decimals) among
    the main study's chosen (learning rate, clip norm) and every lever run of the method at
    that epsilon (each lever at that method's own chosen learning rate); ties go to the main
    study (the fewer changes), then to the earlier lever.
    """
    main = _best(data, method, eps)
    levers = [
        r
        for r in data["runs"]
        if r.get("study") == "levers"
        and r["phase"] == "tune"
        and r["method"] == method
        and r["eps"] == eps
    ]
    cands = ([main] if main is not None else []) + levers
    if not cands:
        return None
    return max(cands, key=lambda r: (round(r["val"]["mean_dice"], 3), r is main))


def _recipe_evals(data: dict[str, Any], best: dict[str, Any]) -> list[dict[str, Any]]:
    """Evaluation runs (seeds of the study) of the recipe ``best`` stands for."""
    if best.get("study", "main") == "main":
        return _eval_runs(data, best["method"], best["eps"])
    seeds = set(data.get("seeds") or [])
    return [
        r
        for r in data["runs"]
        if r.get("study") == "levers"
        and r["phase"] == "eval"
        and r["lever"] == best["lever"]
        and r["method"] == best["method"]
        and r["eps"] == best["eps"]
        and r["lr"] == best["lr"]
        and _clip(r) == _clip(best)
        and (not seeds or r["seed"] in seeds)
    ]


def best_recipe_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Per epsilon and private method: the best recipe, its test Dice and the gap it closes.

    The gap is measured between the best-recipe DP-SGD row and non-private training.
    """
    nonprivate = _eval_runs(data, "nonprivate", None)
    top = _mean_std([r["test"]["mean_dice"] for r in nonprivate])[0] if nonprivate else None
    rows = []
    for eps in data.get("epsilons") or []:
        per: dict[str, dict[str, Any]] = {}
        for method in METHODS[1:]:
            best = _best_recipe(data, method, eps)
            if best is None:
                continue
            runs = _recipe_evals(data, best)
            dice = _mean_std([r["test"]["mean_dice"] for r in runs]) if runs else None
            per[method] = {"eps": eps, "method": method, "best": best, "runs": runs, "dice": dice}
        floor = (per.get("dp-sgd") or {}).get("dice")
        for row in per.values():
            gap = None
            if row["dice"] and floor and top is not None and top > floor[0]:
                gap = (row["dice"][0] - floor[0]) / (top - floor[0])
            rows.append({**row, "gap": gap})
    return rows


def _best_recipe_lines(data: dict[str, Any]) -> list[str]:
    rows = best_recipe_rows(data)
    if not rows:
        return []
    base_clip = (data.get("config_contents") or {}).get("privacy", {}).get("max_grad_norm")
    lines = [
        "",
        "Best recipe per method and epsilon: the highest seed-0 validation Dice among the main "
        "study's chosen point and every lever run of that method at that epsilon (one rule for "
        "every method; DP-KFC has more candidates, its preconditioner levers), evaluated on "
        "the test cases of seeds "
        f"{data.get('seeds')}; gap closed = (Dice - best-recipe DP-SGD) / (non-private - "
        "best-recipe DP-SGD):",
        "",
        "| epsilon | method | recipe | lr | clip norm | val Dice (seed 0) | test mean Dice "
        "| gap closed | seeds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        best, dice = row["best"], row["dice"]
        recipe = "main study point" if best.get("study", "main") == "main" else best["lever"]
        test = f"{dice[0]:.3f} +- {dice[1]:.3f}" if dice else "not evaluated"
        gap = (
            "-" if row["gap"] is None or row["method"] == "dp-sgd" else f"{100 * row['gap']:.0f} %"
        )
        seeds = ",".join(str(r["seed"]) for r in row["runs"]) or "-"
        lines.append(
            f"| {row['eps']:g} | {row['method']} | {recipe} | {best['lr']:g} | "
            f"{_clip_cell(base_clip, best)} | {best['val']['mean_dice']:.3f} | {test} | {gap} "
            f"| {seeds} |"
        )
    return lines


def _mean_std(values: list[float]) -> tuple[float, float]:
    a = np.asarray(values, dtype=float)
    return float(a.mean()), float(a.std(ddof=1)) if len(a) > 1 else 0.0


def gap_fractions(data: dict[str, Any]) -> dict[float, dict[str, float]]:
    """Per epsilon: each private method's fraction of the (non-private - DP-SGD) test-Dice gap."""
    out: dict[float, dict[str, float]] = {}
    nonprivate = _eval_runs(data, "nonprivate", None)
    if not nonprivate:
        return out
    top = _mean_std([r["test"]["mean_dice"] for r in nonprivate])[0]
    for eps in data.get("epsilons") or []:
        sgd = _eval_runs(data, "dp-sgd", eps)
        if not sgd:
            continue
        floor = _mean_std([r["test"]["mean_dice"] for r in sgd])[0]
        out[eps] = {}
        for method in PRIVATE:
            runs = _eval_runs(data, method, eps)
            if runs and top > floor:
                dice = _mean_std([r["test"]["mean_dice"] for r in runs])[0]
                out[eps][method] = (dice - floor) / (top - floor)
    return out


def compact_table(data: dict[str, Any]) -> list[str]:
    """Test mean Dice per method (rows) and epsilon (columns), with the gap closed."""
    eps_list = data.get("epsilons") or []
    gaps = gap_fractions(data)
    head = "| method | " + " | ".join(f"epsilon {e:g}" for e in eps_list) + " |"
    lines = [head, "|---|" + "---|" * len(eps_list)]
    nonprivate = _eval_runs(data, "nonprivate", None)
    if nonprivate:
        m, sd = _mean_std([r["test"]["mean_dice"] for r in nonprivate])
        lines.append(
            "| non-private | " + " | ".join([f"{m:.3f} +- {sd:.3f}"] * len(eps_list)) + " |"
        )
    for method in _evaluated(data):
        cells = []
        for eps in eps_list:
            runs = _eval_runs(data, method, eps)
            if not runs:
                cells.append("-")
                continue
            m, sd = _mean_std([r["test"]["mean_dice"] for r in runs])
            gap = gaps.get(eps, {}).get(method)
            extra = (
                f" ({100 * gap:.0f} % of the gap)" if gap is not None and method != "dp-sgd" else ""
            )
            cells.append(f"{m:.3f} +- {sd:.3f}{extra}")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return lines


def _clip_cell(base_clip: float | None, run: dict[str, Any]) -> str:
    if run["eps"] is None:
        return "-"
    scale = _clip(run) * _lever_clip(run.get("lever"))
    return f"{base_clip * scale:g}" if base_clip is not None else f"x{scale:g}"


def summarize(data: dict[str, Any]) -> str:
    """Markdown: test Dice per epsilon and method, gap fractions, HD95, evidence, tuning, levers."""
    names = data.get("class_names") or []

    def fmt(values: list[float]) -> str:
        m, s = _mean_std(values)
        return f"{m:.3f} +- {s:.3f}"

    def hd(runs: list[dict[str, Any]]) -> str:
        vals = [
            np.nanmean([v for v in r["test"].get("hd95_per_class", {}).values()])
            for r in runs
            if r["test"].get("hd95_per_class")
        ]
        return f"{np.mean(vals):.2f}" if vals else "-"

    gaps = gap_fractions(data)
    base_clip = (data.get("config_contents") or {}).get("privacy", {}).get("max_grad_norm")
    lines = [
        f"## {data.get('config')} (test cases; mean +- std over seeds {data.get('seeds')})",
        "",
        *compact_table(data),
        "",
        "| method | target epsilon | lr (chosen on val) | clip norm (chosen on val) | test mean Dice | "
        + " | ".join(f"Dice {n}" for n in names)
        + " | HD95 mm (mean of classes) | gap closed | eps spent | minutes per run | runs |",
        "|---|---|---|---|---|" + "---|" * len(names) + "---|---|---|---|---|",
    ]
    rows: list[tuple[str, float | None]] = [("nonprivate", None)]
    rows += [(m, e) for e in data.get("epsilons") or [] for m in PRIVATE]
    for method, eps in rows:
        runs = _eval_runs(data, method, eps)
        if not runs:
            continue
        per_class = [fmt([r["test"]["dice_per_class"][n] for r in runs]) for n in names]
        spent = [r["epsilon_spent"] for r in runs if r.get("epsilon_spent") is not None]
        gap = gaps.get(eps, {}).get(method) if eps is not None else None
        lines.append(
            f"| {method} | {'-' if eps is None else f'{eps:g}'} | {runs[0]['lr']:g} | "
            f"{_clip_cell(base_clip, runs[0])} | {fmt([r['test']['mean_dice'] for r in runs])} | "
            + " | ".join(per_class)
            + f" | {hd(runs)} | {'-' if gap is None else f'{100 * gap:.0f} %'} | "
            f"{f'{max(spent):.3f}' if spent else '-'} | "
            f"{np.mean([r['seconds'] for r in runs]) / 60:.1f} | {len(runs)} |"
        )
    lines += _best_recipe_lines(data)
    if data.get("notes"):  # what the study did not run, in words (kept with the results)
        lines += ["", "Notes on this study:", ""] + [f"- {n}" for n in data["notes"]]
    lines += _evidence_lines(data)
    lines += [
        "",
        "Tuning runs (seed 0, validation mean Dice):",
        "",
        "| method | target epsilon | lr | clip norm | val mean Dice |",
        "|---|---|---|---|---|",
    ]
    for r in data["runs"]:
        if r.get("study", "main") == "main" and r["phase"] == "tune":
            eps = "-" if r["eps"] is None else f"{r['eps']:g}"
            lines.append(
                f"| {r['method']} | {eps} | {r['lr']:g} | {_clip_cell(base_clip, r)} | "
                f"{r['val']['mean_dice']:.3f} |"
            )
    all_levers = [r for r in data["runs"] if r.get("study") == "levers"]
    for eps in sorted({r["eps"] for r in all_levers}, reverse=True):
        lever_runs = [r for r in all_levers if r["eps"] == eps and r["phase"] == "tune"]
        lines += [
            "",
            f"Lever study (epsilon {eps:g}, seed 0, validation mean Dice; one change from the "
            "shipped config; each method at its learning rate chosen above at the config's clip "
            "norm):",
            "",
            "| lever | " + " | ".join(METHODS[1:]) + " | clipped fraction (dp-sgd / dp-kfc) |",
            "|---|---|---|---|",
        ]
        shipped = [
            r
            for r in data["runs"]
            if r.get("study", "main") == "main"
            and r["phase"] == "tune"
            and r["eps"] == eps
            and _clip(r) == 1.0
            and r["lr"] == _best_lr(data, r["method"], eps, 1.0)
        ]
        for lever in LEVERS:
            cells, clipped = [], []
            for method in METHODS[1:]:
                pool = shipped if lever == "shipped" else lever_runs
                r = next((x for x in pool if x["lever"] == lever and x["method"] == method), None)
                cells.append("-" if r is None else f"{r['val']['mean_dice']:.3f}")
                frac = (r or {}).get("evidence", {}).get("mean_clipped_fraction")
                clipped.append("-" if frac is None else f"{frac:.2f}")
            if any(c != "-" for c in cells):
                lines.append(f"| {lever} | " + " | ".join(cells) + f" | {' / '.join(clipped)} |")
        lines += _lever_snr_lines(shipped, lever_runs, eps)
    lines += _lever_eval_lines(data)
    if data.get("shipped"):
        lines += [
            "",
            "Shipped configs trained as shipped (noise from OS entropy, 2 torch threads, seed 0's "
            "split), then `dpkfc-med evaluate RUN --data FOLDER` on a folder of the run's test "
            "cases only. Minutes include data-free pretraining and exclude the evaluation; "
            "the load on the 2 cores during each run is in the notes above:",
            "",
            "| config | eps spent | minutes (2 threads) | test Dice | Dice on the unseen-case "
            "folder (cases) | HD95 mm per class |",
            "|---|---|---|---|---|---|",
        ]
        earlier = [(r["config"] + " (earlier version)", r) for r in data.get("shipped_history", [])]
        for name, r in [*data["shipped"].items(), *earlier]:
            u = r["unseen_folder"]
            hd95 = ", ".join(f"{k} {v:.2f}" for k, v in (u.get("hd95_per_class") or {}).items())
            lines.append(
                f"| {name} | {r['epsilon_spent']:.3f} | {r['minutes']:.1f} | "
                f"{r['test']['mean_dice']:.3f} | {u['mean_dice']:.3f} ({u['n']}) | {hd95} |"
            )
    env = data.get("environment", {})
    devices = sorted({r.get("device", "cpu") for r in data["runs"]})
    lines += [
        "",
        f"Machine: {env.get('platform')}, {data.get('workers', 1)} runs in parallel with one "
        f"torch thread each, training on {' and '.join(devices)}; git commits of the runs {', '.join(data.get('git_commits') or [str(data.get('git_commit'))])} "
        "(later commits add studies and options; the code of the runs already made is unchanged).",
    ]
    return "\n".join(lines) + "\n"


def _lever_eval_lines(data: dict[str, Any]) -> list[str]:
    """Levers evaluated on the evaluation seeds: test Dice and the gap closed, per epsilon."""
    runs = [r for r in data["runs"] if r.get("study") == "levers" and r["phase"] == "eval"]
    if not runs:
        return []
    nonprivate = _eval_runs(data, "nonprivate", None)
    top = _mean_std([r["test"]["mean_dice"] for r in nonprivate])[0] if nonprivate else None
    lines = [
        "",
        "Levers evaluated on the evaluation seeds (test cases of each seed's split; the lever "
        "at the learning rate and clip norm of its seed-0 run; gap closed against the main "
        "study's DP-SGD and non-private rows at that epsilon):",
        "",
        "| epsilon | lever | method | lr | clip norm | test mean Dice | gap closed | seeds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    base_clip = (data.get("config_contents") or {}).get("privacy", {}).get("max_grad_norm")
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["eps"], r["lever"], r["method"], r["lr"], _clip(r)), []).append(r)
    for (eps, lever, method, lr, _), rs in sorted(
        groups.items(), key=lambda kv: (-kv[0][0], kv[0][1], kv[0][2])
    ):
        dice = [r["test"]["mean_dice"] for r in rs]
        m, sd = _mean_std(dice)
        sgd = _eval_runs(data, "dp-sgd", eps)
        floor = _mean_std([r["test"]["mean_dice"] for r in sgd])[0] if sgd else None
        gap = (
            f"{100 * (m - floor) / (top - floor):.0f} %"
            if top is not None and floor is not None and top > floor
            else "-"
        )
        lines.append(
            f"| {eps:g} | {lever} | {method} | {lr:g} | {_clip_cell(base_clip, rs[0])} | "
            f"{m:.3f} +- {sd:.3f} | {gap} | {','.join(str(r['seed']) for r in rs)} |"
        )
    return lines


def _lever_snr_lines(
    shipped: list[dict[str, Any]], lever_runs: list[dict[str, Any]], eps: float
) -> list[str]:
    """Per-layer SNR of every lever run (covered layers; not DP: un-noised statistics)."""
    rows = [(r, "shipped") for r in shipped] + [(r, r["lever"]) for r in lever_runs]
    rows = [(r, name) for r, name in rows if (r.get("evidence") or {}).get("mean_layer_snr")]
    if not rows:
        return []
    # the layers every run reports under one name (DP-KFC's fallback parameters are named
    # apart, so the norm affines drop out and the covered layers remain)
    layers = [
        k
        for k in rows[0][0]["evidence"]["mean_layer_snr"]
        if all(k in r["evidence"]["mean_layer_snr"] for r, _ in rows)
    ]
    out = [
        "",
        f"Per-layer SNR of the lever runs at epsilon {eps:g} (squared norm of the clipped batch "
        "sum / expected squared norm of the noise on the layer, mean over steps; un-noised "
        "private statistics, not DP):",
        "",
        "| lever | method | " + " | ".join(layers) + " |",
        "|---|---|" + "---|" * len(layers),
    ]
    order = {name: i for i, name in enumerate(LEVERS)}
    for r, name in sorted(rows, key=lambda x: (order.get(x[1], 99), x[0]["method"])):
        snr = r["evidence"]["mean_layer_snr"]
        cells = [f"{snr[k]:.2g}" if snr.get(k) is not None else "-" for k in layers]
        out.append(f"| {name} | {r['method']} | " + " | ".join(cells) + " |")
    return out


def _evidence_lines(data: dict[str, Any]) -> list[str]:
    """Per-layer share of the clipped norm and SNR, seed-1 evaluation runs, per epsilon."""
    lines: list[str] = []
    for eps in data.get("epsilons") or []:
        runs = {m: _eval_runs(data, m, eps) for m in PRIVATE}
        first = {
            m: next((r for r in rs if r["seed"] == min(x["seed"] for x in rs)), None)
            for m, rs in runs.items()
            if rs
        }
        if len(first) < 2 or "dp-kfc" not in first:
            continue
        ev = {m: r.get("evidence") or {} for m, r in first.items() if r}
        shown = [m for m in PRIVATE if m in ev]
        layers = list((ev.get("dp-kfc") or {}).get("mean_layer_share") or {})
        if not layers:
            continue
        seed = first["dp-kfc"]["seed"]
        lines += [
            "",
            f"Per-layer evidence at epsilon {eps:g} (seed {seed}, means over steps; computed from "
            "un-noised private statistics, not DP): share of the clipped squared norm, and SNR = "
            "squared norm of the clipped batch sum / expected squared norm of the noise on the "
            "layer. Clipped fraction: "
            + ", ".join(
                f"{m} {e.get('mean_clipped_fraction', float('nan')):.2f}" for m, e in ev.items()
            ),
            "",
            "| layer | "
            + " | ".join(f"{what} {m}" for what in ("share", "SNR") for m in shown)
            + " |",
            "|---|" + "---|" * (2 * len(shown)),
        ]
        for layer in layers:
            cells = []
            for field in ("mean_layer_share", "mean_layer_snr"):
                for m in shown:
                    v = (ev.get(m, {}).get(field) or {}).get(layer)
                    cells.append("-" if v is None else f"{v:.3g}")
            lines.append(f"| {layer} | " + " | ".join(cells) + " |")
    return lines


def plot(data: dict[str, Any], path: Path) -> None:
    """Test Dice against epsilon (left) and the gap fraction per epsilon (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    eps_list = sorted(data.get("epsilons") or [])
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    nonprivate = _eval_runs(data, "nonprivate", None)
    if nonprivate:
        m, s = _mean_std([r["test"]["mean_dice"] for r in nonprivate])
        ax.axhspan(m - s, m + s, color="grey", alpha=0.2)
        ax.axhline(m, color="grey", label="non-private")
    shown = _evaluated(data)
    for method in shown:
        xs, ms, ss = [], [], []
        for eps in eps_list:
            runs = _eval_runs(data, method, eps)
            if runs:
                m, s = _mean_std([r["test"]["mean_dice"] for r in runs])
                xs.append(eps), ms.append(m), ss.append(s)
        if xs:
            ax.errorbar(xs, ms, yerr=ss, marker="o", capsize=3, label=method)
    for method in METHODS[1:]:  # each method's best recipe (lever or main point) per epsilon
        pts = [
            (r["eps"], *r["dice"])
            for r in best_recipe_rows(data)
            if r["method"] == method and r["dice"] is not None
        ]
        if pts:
            xs, ms, ss = zip(*sorted(pts))
            ax.errorbar(
                xs, ms, yerr=ss, marker="s", ls="--", capsize=3, label=f"{method}, best recipe"
            )
    ax.set_xscale("log")
    ax.set_xticks(eps_list, [f"{e:g}" for e in eps_list])
    ax.set_xlabel("epsilon (one patient = one unit)")
    ax.set_ylabel("test mean Dice (mean +- std over seeds)")
    ax.legend()
    gaps = gap_fractions(data)
    width = 0.8 / max(1, len(shown))
    for i, method in enumerate(shown):
        vals = [100 * gaps.get(e, {}).get(method, math.nan) for e in eps_list]
        offset = (i - (len(shown) - 1) / 2) * width
        bx.bar(np.arange(len(eps_list)) + offset, vals, width, label=method)
    bx.axhline(100, color="grey", lw=0.8)
    bx.set_xticks(np.arange(len(eps_list)), [f"{e:g}" for e in eps_list])
    bx.set_xlabel("epsilon")
    bx.set_ylabel("% of the (non-private - DP-SGD) gap closed")
    bx.legend()
    fig.suptitle("MSD hippocampus, MONAI 3D UNet")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _run_all(
    jobs: list[dict[str, Any]],
    base: dict[str, Any],
    data: dict[str, Any],
    out: Path,
    runs_dir: Path,
    workers: int,
    threads: int | None = None,
) -> None:
    todo = [k for k in jobs if not any(_same(k, r) for r in data["runs"])]
    if not todo:
        return
    threads = threads or (1 if workers > 1 else 2)
    args = [(_config_for(base, k), k, str(runs_dir), threads) for k in todo]
    ctx = mp.get_context("spawn")
    with ctx.Pool(processes=min(workers, len(args)), maxtasksperchild=1) as pool:
        for rec in pool.imap_unordered(_job, args):
            data["runs"].append(rec)
            data["class_names"] = list(rec["test"]["dice_per_class"])
            _save(out, data)
            eps = "-" if rec["eps"] is None else f"{rec['eps']:g}"
            print(
                f"{rec['study']}/{rec['phase']} {rec['method']} eps={eps} lr={rec['lr']:g} "
                f"seed={rec['seed']} [{rec['lever']}]: val {rec['val']['mean_dice']:.3f} "
                f"test {rec['test']['mean_dice']:.3f} ({rec['seconds'] / 60:.1f} min)",
                flush=True,
            )


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--config", type=Path, default=ROOT / "benchmarks/hippocampus_unet_3d_recipe_base.yaml"
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
    p.add_argument("--runs-dir", type=Path, default=Path("/tmp/dpkfc_bench_runs/segmentation"))
    p.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks/results/segmentation_hippocampus.json"
    )
    args = p.parse_args(argv)
    base = yaml.safe_load(args.config.read_text())
    if args.device:
        base.setdefault("training", {})["device"] = args.device
    methods = args.methods.split(",")
    for method in methods:
        if method not in ALL_METHODS:
            p.error(f"--methods: unknown method {method!r}; choose from {', '.join(ALL_METHODS)}")
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    data = _load(out)
    epsilons = [float(e) for e in args.epsilons.split(",")]
    commits = data.setdefault("git_commits", [data["git_commit"]] if data.get("git_commit") else [])
    if _git_commit() not in commits:  # every commit whose code made some of the runs
        commits.append(_git_commit())
    if args.study == "main":
        data.update(
            {
                "config": _display_path(args.config),
                "config_contents": base,
                "protocol": __doc__.split("Tuning protocol")[1].split("Results are")[0].strip(),
                "lrs": [float(x) for x in args.lrs.split(",")],
                "seeds": [int(s) for s in args.seeds.split(",")],
                # a study of some methods at some epsilons keeps the other epsilons' rows
                "epsilons": sorted({*(data.get("epsilons") or []), *epsilons}, reverse=True),
                "tuning_seed": 0,
                "workers": args.workers,
                "environment": _environment(),
                "git_commit": _git_commit(),
            }
        )
        common = {"study": "main", "lever": "shipped"}
        # One epsilon at a time (non-private first), so a partial study holds whole rows.
        for eps in [None, *epsilons]:
            if eps is not None:  # per epsilon: a later study at other epsilons keeps these
                scales = [float(x) for x in args.clip_scales.split(",")]
                data.setdefault("clip_scales", {})[_eps_key(eps)] = scales
            ms = ["nonprivate"] if eps is None else [m for m in methods if m != "nonprivate"]
            if eps is None and "nonprivate" not in methods:
                continue
            tune = [
                {**common, "phase": "tune", "method": m, "eps": eps, "lr": lr, "seed": 0, "clip": c}
                for m in ms
                for lr in _grid(data, eps)
                for c in _clips(data, eps)
            ]
            _run_all(tune, base, data, out, args.runs_dir, args.workers, args.threads)
            for _ in range(args.widen):  # a best on the grid's edge: one more point for all
                lr = _widen(data, eps, ms)
                if lr is None:
                    break
                data.setdefault("widened", {}).setdefault(_eps_key(eps), []).append(lr)
                more = [
                    {
                        **common,
                        "phase": "tune",
                        "method": m,
                        "eps": eps,
                        "lr": lr,
                        "seed": 0,
                        "clip": c,
                    }
                    for m in ms
                    for c in _clips(data, eps)
                ]
                _run_all(more, base, data, out, args.runs_dir, args.workers, args.threads)
            evals = [
                {
                    **common,
                    "phase": "eval",
                    "method": m,
                    "eps": eps,
                    "lr": best["lr"],
                    "clip": _clip(best),
                    "seed": s,
                }
                for m in ms
                if (best := _best(data, m, eps)) is not None
                for s in data["seeds"]
            ]
            _run_all(evals, base, data, out, args.runs_dir, args.workers, args.threads)
            out.with_suffix(".md").write_text(summarize(data))
    elif args.study == "best":  # each method's best recipe per epsilon on the eval seeds
        jobs = []
        for eps in epsilons:
            for m in [x for x in methods if x in METHODS[1:]]:
                best = _best_recipe(data, m, eps)
                if best is None or best.get("study", "main") == "main":
                    continue  # the main study evaluates its own points
                key = {k: best[k] for k in ("study", "lever", "method", "eps", "lr")}
                if _clip(best) != 1.0:
                    key["clip"] = _clip(best)
                jobs += [{**key, "phase": "eval", "seed": s} for s in data["seeds"]]
        _run_all(jobs, base, data, out, args.runs_dir, args.workers, args.threads)
    elif args.study == "shipped":
        data.setdefault("shipped", {})
        for eps in epsilons:
            config = ROOT / "configs" / f"hippocampus_unet_3d_eps{eps:g}.yaml"
            old, digest = data["shipped"].get(_display_path(config)), _sha256(config)
            if old is not None and old.get("config_sha256") == digest:
                continue  # this config as it is now was trained
            if old is not None:  # changed since (or not recorded): its earlier run goes to history
                data.setdefault("shipped_history", []).append(old)
            rec = _shipped_job(config, args.runs_dir)
            data["shipped"][rec["config"]] = rec
            _save(out, data)
            print(
                f"shipped {rec['config']}: {rec['minutes']:.1f} min, unseen Dice "
                f"{rec['unseen_folder']['mean_dice']:.3f}",
                flush=True,
            )
    else:
        jobs = []
        chosen = list(LEVERS)[1:]  # "shipped" is the main study's tuning run
        if args.levers:
            chosen = [chosen[int(i) - 1] for i in args.levers.split(",")]
        for eps in [float(e) for e in args.lever_epsilons.split(",")]:
            for lever in chosen:
                for m in LEVER_METHODS.get(lever, tuple(x for x in methods if x != "nonprivate")):
                    if m not in methods:
                        continue
                    tuned = lever in TUNED_CLIP_LEVERS
                    best = _best(data, m, eps, None if tuned else 1.0)
                    if best is None:
                        p.error(
                            f"--study levers: run the main study first (no tuned lr for {m} "
                            f"at {eps:g})"
                        )
                    key = {
                        "study": "levers",
                        "lever": lever,
                        "method": m,
                        "eps": eps,
                        "lr": best["lr"],
                        **({"clip": _clip(best)} if tuned and _clip(best) != 1.0 else {}),
                    }
                    if args.lever_seeds:  # evaluation of the lever on the evaluation seeds
                        jobs += [
                            {**key, "phase": "eval", "seed": int(s)}
                            for s in args.lever_seeds.split(",")
                        ]
                    else:
                        jobs.append({**key, "phase": "tune", "seed": 0})
        _run_all(jobs, base, data, out, args.runs_dir, args.workers, args.threads)
    out.with_suffix(".md").write_text(summarize(data))
    plot(data, out.with_suffix(".png"))
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
