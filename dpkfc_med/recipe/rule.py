"""``recipe: auto``: every training setting the user left unset, chosen from public facts.

The rule condenses what the benchmarks found to work under DP. Its inputs are the public
facts of `dpkfc_med/recipe/facts.py` only, so two datasets that differ only in their images,
labels and headers get the same recipe.

- **Steps and batch.** About 200 noisy steps at an expected batch of 42 % of the units
  (multiples of 8, between 8 and 256): the tuned recipes of every task sit there (hippocampus
  64 of 154 patients, PneumoniaMNIST 256 of 4,708 for 190 steps, AdrenalMNIST3D 190 steps).
  On the hippocampus 3D UNet the rule's recipe scores as the hand-tuned one at epsilon 8
  (test Dice 0.77, 3 seeds each) and above it at epsilon 3 (0.72 against 0.68) and 1 (0.55
  against 0.41), on PneumoniaMNIST within 0.01 AUROC at epsilon 8, 3 and 1 (recipe benchmark).
- **Optimizer, lr and clip norm.** Segmentation: Adam with a small clip norm (0.125), lr
  0.01 for a 30k-parameter UNet; classification: SGD with momentum 0.9, clip norm 1, lr 0.2
  for a 26k-parameter CNN. Both lrs shrink as `(parameters / reference) ** -1/4`: the noise
  of one step grows with the square root of the parameter count, and the tuned lrs of the
  larger networks (DenseNet121 0.02, ResNet-10 0.05) sit on either side of that line.
- **Data-free pretraining** (segmentation from scratch): 1000 Adam steps on synthetic shapes
  (no data, no privacy cost), each step on about as many synthetic voxels as 8 volumes of
  32x48x32 (the tuned 3D recipe): 8 samples for 3D patches, about 150 for 2D slices of 44x56;
  off when public weights are given. On 2D slices it is the largest lever measured (without it
  test Dice falls from 0.52 to 0.31; with the larger batch it rises to 0.55). With the slices
  below, the rule's 2D recipe reaches 0.59 where the 3D recipe reused by hand reaches 0.52.
- **Crops per unit**: two crops of each drawn patient for 3D volumes; for 2D slices of volumes,
  as many slices as hold the voxels of those two crops (40 slices of 44x56, about every slice
  of a hippocampus volume: 0.58 against 0.52 with eight; 8 at least, 64 at most, so a large CT
  slice keeps the cost bounded), summed before clipping (the sensitivity stays C).
- **Method and preconditioner.** DP-KFC, except DP-SGD at epsilon <= 1 without public
  weights, where whitening paid less than it cost (hippocampus 0.332 vs 0.409 at epsilon 1
  with the hand recipes, DenseNet121 -15 % of the gap; under this rule's recipe the two tie
  there, 0.538 vs 0.548, and on PneumoniaMNIST). Two-class
  classification whitens the A factor only (A+G collapses on binary tasks); otherwise A and G
  with relative damping 1 (10 at epsilon <= 1), and the per-layer scale rule. Not chosen:
  the probe-free scale-then-privatize (``dp-stp``), far behind at the rule's clip norm, and
  augmentation multiplicity, no gain on PneumoniaMNIST (recipe benchmark).
- **Fine-tuning from public weights**: every layer (`full`): after a contrast shift only
  full fine-tuning (and both ends, `first_and_last_layers`, which ties it) recovered, and it
  stays within reach after a label merge; a label merge with and without a contrast shift look
  alike from the public side, so the mode whose worst case is best. Training the output layer
  alone first (`head_first_epochs`) gained nothing, so it stays off.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from dpkfc_med.recipe.facts import PublicFacts

__all__ = ["Choice", "choose", "RECIPES", "RECIPE_FIELDS", "TARGET_STEPS"]

RECIPES = ("manual", "auto")  # training.recipe
TARGET_STEPS = 200  # noisy steps of a run
BATCH_SHARE = 0.42  # expected batch as a share of the training units
SEG_REFERENCE = (0.01, 30_000)  # Adam lr for a 30k-parameter UNet
CLS_REFERENCE = (0.2, 26_000)  # SGD lr for a 26k-parameter CNN
PRETRAIN_VOXELS = 8 * 32 * 48 * 32  # synthetic voxels per pretraining step (tuned 3D recipe)
UNIT_VOXELS = 2 * 32 * 48 * 32  # voxels one drawn patient contributes (two crops, tuned 3D)

# every field the rule may choose, in the order the report lists them
RECIPE_FIELDS = (
    "method",
    "privacy.max_grad_norm",
    "training.batch_size",
    "training.epochs",
    "training.optimizer",
    "training.lr",
    "training.momentum",
    "training.lr_schedule",
    "training.finetune",
    "data.patches_per_unit",
    "data.slices.per_unit",
    "pretrain.steps",
    "pretrain.batch_size",
    "pretrain.lr",
    "probes.num_probes",
    "probes.refresh_every",
    "preconditioner.factors",
    "preconditioner.damping_a",
    "preconditioner.damping_g",
    "preconditioner.scaling",
)


@dataclass(frozen=True)
class Choice:
    """One field the rule chose and the public facts it was chosen from."""

    field: str
    value: Any
    why: str


def expected_batch(n_units: int) -> int:
    """Expected units per step: 42 % of the units in multiples of 8, within 8..256 and N."""
    return min(n_units, max(8, min(256, 8 * round(BATCH_SHARE * n_units / 8))))


def pretrain_batch(patch_voxels: int) -> int:
    """Synthetic samples per pretraining step: about :data:`PRETRAIN_VOXELS` voxels in all.

    Multiples of 8 between 8 and 256 (rounded down, so a 3D patch of the tuned recipe's size or
    larger keeps 8).
    """
    return min(256, max(8, 8 * (PRETRAIN_VOXELS // max(1, patch_voxels) // 8)))


def slices_per_unit(patch_voxels: int) -> int:
    """Slices per drawn patient: about :data:`UNIT_VOXELS` voxels, between 8 and 64.

    The slice count of the volumes is not used: it would come from the private headers.
    """
    return min(64, max(8, round(UNIT_VOXELS / max(1, patch_voxels))))


def epochs_for(n_units: int, batch: int, steps: int = TARGET_STEPS) -> int:
    """Epochs that give about ``steps`` Poisson steps (``ceil(N / B)`` steps an epoch)."""
    return max(1, math.ceil(steps / max(1, math.ceil(n_units / batch))))


def _scaled_lr(reference: tuple[float, int], n_params: int, low: float, high: float) -> float:
    lr, params = reference
    value = lr * (max(n_params, 1) / params) ** -0.25
    return float(f"{min(high, max(low, value)):.2g}")


def choose(f: PublicFacts) -> list[Choice]:
    """The recipe for ``f``: one :class:`Choice` per field of :data:`RECIPE_FIELDS` that applies."""
    seg = f.kind == "segmentation"
    low_eps = f.epsilon <= 1.0
    out: list[Choice] = []

    def add(field: str, value: Any, why: str) -> None:
        out.append(Choice(field, value, why))

    dp_sgd = low_eps and not f.public_weights
    add("method", "dp-sgd" if dp_sgd else "dp-kfc",
        "epsilon <= 1 without public weights: whitening paid less than it cost" if dp_sgd
        else "DP-KFC: ahead of DP-SGD at this epsilon in the benchmarks")  # fmt: skip
    batch = expected_batch(f.n_units)
    add("training.batch_size", batch, f"42 % of the {f.n_units} training units (8..256)")
    add("training.epochs", epochs_for(f.n_units, batch),
        f"about {TARGET_STEPS} noisy steps of {batch} expected units")  # fmt: skip
    add("training.lr_schedule", "constant", "the tuned recipes all train at a constant lr")
    ref = f"(parameters / {{}}) ** -1/4 for {f.n_params:,} parameters"
    if seg:
        add("privacy.max_grad_norm", 0.125, "small clip norm with Adam (segmentation)")
        add("training.optimizer", "adam", "Adam for segmentation")
        add("training.lr", _scaled_lr(SEG_REFERENCE, f.n_params, 1e-3, 0.01),
            "0.01 x " + ref.format(f"{SEG_REFERENCE[1]:,}"))  # fmt: skip
    else:
        add("privacy.max_grad_norm", 1.0, "clip norm 1 with SGD (classification)")
        add("training.optimizer", "sgd", "SGD with momentum for classification")
        add("training.momentum", 0.9, "momentum 0.9")
        add("training.lr", _scaled_lr(CLS_REFERENCE, f.n_params, 0.02, 0.2),
            "0.2 x " + ref.format(f"{CLS_REFERENCE[1]:,}"))  # fmt: skip
    if f.public_weights:
        add("training.finetune", "full", "public weights: every layer fine-tuned")
    if seg and not f.bundle:
        if f.from_volumes:
            k = slices_per_unit(f.patch_voxels)
            add("data.slices.per_unit", k,
                f"{k} slices per drawn patient (the voxels of two 32x48x32 crops), "
                "summed before clipping")  # fmt: skip
        elif f.spatial_dims == 3:
            add("data.patches_per_unit", 2, "two crops per drawn patient, summed before clipping")
    pretrain = seg and not f.public_weights
    add("pretrain.steps", 1000 if pretrain else 0,
        "data-free pretraining on synthetic shapes (no data, no privacy cost)" if pretrain
        else "public weights given" if f.public_weights
        else "synthetic-shape pretraining exists for segmentation only")  # fmt: skip
    if pretrain:
        add("pretrain.batch_size", pretrain_batch(f.patch_voxels),
            "about as many synthetic voxels per step as 8 volumes of 32x48x32")  # fmt: skip
        add("pretrain.lr", 0.003, "Adam lr of pretraining")
    if dp_sgd:
        return out
    add("probes.num_probes", 16 if seg else 256, "synthetic probes per refresh")
    add("probes.refresh_every", 50 if seg else "auto", "preconditioner refresh interval")
    binary = not seg and f.num_classes <= 2
    add("preconditioner.factors", "a" if binary else "ag",
        "A only: two classes give a rank-1 G" if binary else "A and G whitened")  # fmt: skip
    damping = 10.0 if low_eps else 1.0
    add(
        "preconditioner.damping_a",
        0.001 if binary else damping,
        "relative damping (mild whitening" + (", weaker at epsilon <= 1)" if low_eps else ")"),
    )
    add("preconditioner.damping_g", 0.1 if binary else damping, "relative damping of G")
    add("preconditioner.scaling", "global" if binary else "per_layer_raw",
        "each layer keeps its unpreconditioned share of the clipped norm" if not binary
        else "one scale for the whole network")  # fmt: skip
    return out
