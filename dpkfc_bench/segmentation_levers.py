"""The segmentation study's methods and levers: what each run changes in the base config.

A lever changes one setting of the base recipe (or, for the later ones, of each method's best
recipe); :data:`LEVER_METHODS` names the methods a lever applies to (default: every private
method) and :data:`TUNED_CLIP_LEVERS` the levers run at each method's tuned clip norm.
"""

from __future__ import annotations

from typing import Any

from dpkfc_bench.harness import merge
from dpkfc_med.curvature.families import Family

METHODS = ("nonprivate", "dp-sgd", "dp-kfc")
# The other probe-only preconditioner families, run through the same protocol as DP-KFC's
# default family (K-FAC): the method and the config fields it changes.
FAMILIES: dict[str, dict[str, Any]] = {
    f"dp-kfc-{f.value}": {"method": "dp-kfc", "preconditioner": {"family": f.value}}
    for f in Family
    if f is not Family.KFAC
}
PRIVATE = (*METHODS[1:], *FAMILIES)
ALL_METHODS = (*METHODS, *FAMILIES)

# Each method's best recipe that the later levers change one thing of: DP-SGD's combined lever
# (run at its tuned clip norm) and DP-KFC's per-layer raw-norm recipe at clip norm x0.25.
_SGD_BEST: dict[str, Any] = {"pretrain": {"steps": 1000}, "data": {"patches_per_unit": 2}}
_KFC_BEST: dict[str, Any] = merge(
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
    "and damping_g 1.0), at clip norm x0.25": merge(
        _KFC_BEST, {"preconditioner": {"damping_a": 1.0, "damping_g": 1.0}}
    ),
    "combined, with the per-layer raw-norm scale rule and the Shampoo family, at clip norm x0.25": (
        merge(_KFC_BEST, {"preconditioner": {"family": "shampoo"}})
    ),
    # the step count and batch size on each method's best recipe (DP-SGD's combined lever at
    # its tuned clip norm; DP-KFC's per-layer raw-norm recipe), the same change for both
    "combined at each method's tuned clip norm, 20 epochs (half the steps, less noise per step)": (
        merge(_SGD_BEST, {"training": {"epochs": 20}})
    ),
    "combined, with the per-layer raw-norm scale rule, at clip norm x0.25, 20 epochs (half "
    "the steps, less noise per step)": merge(_KFC_BEST, {"training": {"epochs": 20}}),
    "combined at each method's tuned clip norm, expected batch 128 (half the steps, each "
    "with twice the patients)": merge(_SGD_BEST, {"training": {"batch_size": 128}}),
    "combined, with the per-layer raw-norm scale rule, at clip norm x0.25, expected batch 128 "
    "(half the steps, each with twice the patients)": merge(
        _KFC_BEST, {"training": {"batch_size": 128}}
    ),
    # the damping path from DP-KFC to DP-SGD (relative damping 10: every direction nearly as
    # DP-SGD has it, the per-layer raw-norm rule keeping DP-SGD's split between layers)
    "combined, with the per-layer raw-norm scale rule and weak preconditioning (damping_a "
    "and damping_g 10), at clip norm x0.25": merge(
        _KFC_BEST, {"preconditioner": {"damping_a": 10.0, "damping_g": 10.0}}
    ),
    # normalisation: the UNet's instance norm (no affine) against GroupNorm with 4 groups
    # (affine, channels share statistics), on each method's best recipe
    "combined at each method's tuned clip norm, GroupNorm 4 groups instead of instance norm": (
        merge(_SGD_BEST, _GROUP4)
    ),
    "combined, with the per-layer raw-norm scale rule, at clip norm x0.25, GroupNorm 4 groups "
    "instead of instance norm": merge(_KFC_BEST, _GROUP4),
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


def lever_clip(lever: str | None) -> float:
    """The clip-norm scale a lever itself sets (``"x0.25"``; 1 when it sets none)."""
    clip = LEVERS.get(lever or "shipped", {}).get("privacy", {}).get("max_grad_norm")
    if clip is None:
        return 1.0
    if not (isinstance(clip, str) and clip.startswith("x")):
        raise ValueError(f"lever {lever!r}: max_grad_norm must be a scale like 'x0.25'")
    return float(clip[1:])
