"""Write docs/results.md from the committed benchmark results (dpkfc_bench/results/*.md).

    python -m dpkfc_bench results-doc            # rewrite docs/results.md
    python -m dpkfc_bench results-doc --check    # exit 1 when docs/results.md is stale

Every top-level results Markdown (the index README.md aside) goes under a heading of its
group (accuracy, segmentation, audit, cost) with a one-line description and links to its JSON
and figure; its own headings are demoted below that heading, its text is copied unchanged. A new results file is picked
up without changing this script (its description is then its first heading); add a line to
DESCRIPTIONS to describe it better. ``tests/test_docs.py`` checks that the page is fresh.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from dpkfc_bench.harness import RESULTS, ROOT

DOC = ROOT / "docs" / "results.md"
LINK_PREFIX = "../dpkfc_bench/results/"  # results as seen from docs/

GROUPS = (
    ("Classification accuracy", "accuracy_"),
    ("Segmentation", "segmentation_"),
    ("Federated sites", "federated_"),
    ("Empirical privacy audit", "audit_"),
    ("Public weights under shift", "public_init_"),
    ("Several input channels", "multichannel_"),
    ("MONAI bundles", "bundle_"),
    ("Accounted tuning", "tuning_"),
    ("Cost", "cost_"),
)

# Known results, in the order they appear; a stem matches the longest key it starts with.
DESCRIPTIONS = {
    "accuracy_pneumonia_cnn_eps1": "PneumoniaMNIST, small CNN, epsilon 1: every method and variant, 10 epochs.",
    "accuracy_pneumonia_cnn_eps2": "PneumoniaMNIST, small CNN, epsilon 2.",
    "accuracy_pneumonia_cnn_eps8": "PneumoniaMNIST, small CNN, epsilon 8.",
    "accuracy_pneumonia_cnn_long": "PneumoniaMNIST, small CNN, epsilon 1 with 20 epochs instead of 10.",
    "accuracy_pneumonia_densenet": "PneumoniaMNIST, MONAI DenseNet (two dense blocks, GroupNorm), epsilon 1, 2 and 8.",
    "accuracy_pneumonia_vit": "PneumoniaMNIST, MONAI ViT (patch 4, 4 layers), Adam for every method, epsilon 1 and 8; per-layer evidence.",
    "accuracy_adrenal3d_cnn": "AdrenalMNIST3D (28^3 volumes), 3D small CNN, epsilon 8.",
    "segmentation_hippocampus": "MSD hippocampus, MONAI 3D UNet, one patient = one unit, epsilon 8, 3 and 1; per-layer evidence, tuning runs and the lever study.",
    "federated_hippocampus": "MSD hippocampus over 3 Flower sites (every third training case each), DP-KFC at epsilon 8 per site, against the pooled shipped run.",
    "audit_pneumonia_cnn": "One-run empirical lower bound on epsilon (5000 canaries) for the demo config.",
    "public_init_hippocampus": "MSD hippocampus: a keyed-hash public release (75 of 220 cases) with merged labels, inverted contrast or both; public-only, private-only and public init + DP-SGD / DP-KFC fine-tuning (full, 3 seeds; LoRA, last layer, norms and biases at epsilon 1), with per-layer SNR.",
    "multichannel_hippocampus": "MSD hippocampus with a second input channel (the MRI's gradient magnitude, one file per modality) against the one-channel config, DP-KFC at epsilon 8, same seed and cases.",
    "bundle_pipelines": "The Model Zoo bundles of `pipelines/` trained with `dpkfc-med bundle train`, against their run configs.",
    "tuning_adrenal3d": "AdrenalMNIST3D, 3D small CNN, total epsilon 8 and 3: `dpkfc-med tune` against the grid chosen on private validation without noise and against the shipped config untuned, 3 seeds.",
    "tuning_hippocampus": "MSD hippocampus, 3D UNet, total epsilon 8 and 3, 3 seeds: the same three arms.",
    "tuning_pneumonia_cnn": "PneumoniaMNIST, small CNN, total epsilon 8: the first protocol of the tuning study (best-validation epochs, unaccounted arm at the total epsilon).",
    "cost_cpu": "Step time, peak memory and refresh share against Opacus on 2 CPU cores, default settings.",
    "cost_cpu_conv_a_kron": "The same with the structured convolution factor (`preconditioner.conv_a: kron`).",
    "cost_cpu_densenet121_rank_a64": "DenseNet121 alone with the low-rank A factor (`rank_a: 64`).",
    "cost_cpu_transformers": "MONAI ViT (PneumoniaMNIST size) and UNETR (hippocampus crop) against Opacus, one CPU thread.",
    "cost_cpu_unetr": "MONAI UNETR (hippocampus crop, batch 16, one CPU thread) against Opacus after DP-SGD's 3D convolutions moved to the layer's kernel (supersedes the UNETR rows of cost_cpu_transformers).",
    "cost_cpu_clipping": "Clipping modes (`privacy.clipping`: auto, ghost, per_sample) against Opacus' hook and ghost modes, on the three cost models.",
    "cost_cpu_clipping_densenet_vit": "The clipping modes on the DenseNet121 (a second, shorter run) and the MONAI ViT.",
    "cost_cpu_family_shampoo": "DP-KFC with the Shampoo family (`preconditioner.family: shampoo`) against Opacus' two modes, on the three cost models.",
    "cost_cpu_family_diagonal": "DP-KFC with the diagonal family (`preconditioner.family: diagonal`) against Opacus' two modes, on the three cost models.",
    "cost_cpu_brats": "MONAI UNet 3D on BraTS-size inputs (4 channels, 4 classes, 96^3 and 128^3 patches, batch 2, one CPU thread): step time and peak memory against Opacus.",
    "cost_cpu_quick": "The quick mode (small batches and inputs) used as a smoke test.",
    "cost_cpu_bundle": "A Model Zoo bundle trained by MONAI alone against the same bundle through the private engine (non-private, DP-SGD, DP-KFC): time per crop, 2 CPU cores.",
}

INTRO = """\
# Benchmark results

This page collects the committed results of the benchmark scripts (commands:
[dpkfc_bench/README.md](../dpkfc_bench/README.md)); every table below is copied from
`dpkfc_bench/results/*.md`, each generated from the JSON next to it. Regenerate the page with
`python -m dpkfc_bench results-doc`. Earlier runs that a page cites are kept in
`dpkfc_bench/results/history/` and profiles in `dpkfc_bench/results/profiles/` (both indexed in
[dpkfc_bench/results/README.md](../dpkfc_bench/results/README.md)); neither is shown here.

## Protocol

- Every private run: Poisson sampling, delta 1e-5, PRV accountant. `opacus` is Opacus' own
  `PrivacyEngine` with none of this package's privacy code; `dp-sgd` and `dp-kfc` are this
  package's.
- One learning-rate grid for every method, chosen on the validation split with seed 0, then the
  evaluation seeds on the test split (mean +- std). The tuning runs are listed with each table.
  Tuning on validation data is outside the reported epsilon.
- `dp-kfc` is the package default at the time of the run: A-only whitening, pink probes,
  low-rank A factor (`rank_a: 64`). `dp-kfc-dense` is the dense A factor (`rank_a: null`);
  every other variant states its overrides under "Method settings".
- Segmentation: the CLI pipeline on `dpkfc_bench/hippocampus_unet_3d_recipe_base.yaml` with only the
  method, epsilon, learning rate and seed changed; each seed draws its own case split; the gap
  closed is (method - DP-SGD) / (non-private - DP-SGD) on the test mean Dice.
- Cost: methods alternated in one process on the same model, batch and initialisation; memory
  is the peak RSS of set-up and steps in a warmed-up process; the preconditioner refresh is
  amortised at the default `refresh_every: auto` period.

## Defaults and the results behind them

- `preconditioner.factors: a` (activation whitening only): on PneumoniaMNIST the probe `G`
  factors are nearly rank-deficient (two classes), and full A+G with `damping_g: 0.1`
  collapsed to the majority class while A-only did not. `damping_g` is the key
  hyperparameter of A+G: 1e-3 collapses a binary task to its majority class, 0.1 does not.
- `preconditioner.rank_a: 64` (low-rank `U_A`): test AUROC within seed noise of the dense
  factor's on the small CNN and the DenseNet (Dice equal on the hippocampus UNet), accuracy
  too except the small CNN at epsilon 8 (0.816 against 0.855, about two standard errors);
  the DenseNet step 0.97-1.10x Opacus' instead of 1.39x (memory 1.02-1.06x instead of 1.16x).
- `preconditioner.eig_dtype: float32`: the factor decompositions run 2-3x faster than in
  float64 on CPU.

## Reading the classification tables

- On PneumoniaMNIST, accuracy is dominated by where a run's decision threshold lands on the
  shifted test split (62.5 % pneumonia against 74 % in training and validation): the default
  DP-KFC at epsilon 2 reaches 0.755 test accuracy at AUROC 0.947 with one seed and 0.885 at
  0.951 with another (per-seed runs in the JSON). Test AUROC ranks the methods more steadily.
- The small CNN's non-private reference picks lr 0.1 on validation (AUROC 0.995), where two of
  its three test seeds end at the majority class; it is therefore below the private runs on
  the test split.
- A method at 0.625 accuracy and 0.500 balanced accuracy (DenseNet) or 0.768 and 0.500
  (AdrenalMNIST3D) predicts the majority class.
- The per-layer diagnostics in the segmentation file are computed from un-noised private
  statistics: they are evidence for the method, not releases.
"""


def describe(stem: str, text: str) -> str:
    """The one-line description of a results file."""
    keys = [k for k in DESCRIPTIONS if stem == k or stem.startswith(k + "_")]
    if keys:
        return DESCRIPTIONS[max(keys, key=len)]
    for line in text.splitlines():
        if line.startswith("#"):
            return line.lstrip("#").strip() + "."
    return f"Results of `{stem}`."


def demote(text: str, top: int) -> str:
    """Shift the Markdown headings of ``text`` so the highest becomes level ``top``."""
    lines = text.splitlines()
    fence = False
    levels = []
    for line in lines:
        if line.startswith("```"):
            fence = not fence
        elif not fence and re.match(r"#{1,6} ", line):
            levels.append(len(line) - len(line.lstrip("#")))
    if not levels:
        return text.rstrip("\n") + "\n"
    shift = top - min(levels)
    out, fence = [], False
    for line in lines:
        if line.startswith("```"):
            fence = not fence
        elif not fence and re.match(r"#{1,6} ", line):
            level = len(line) - len(line.lstrip("#"))
            line = "#" * min(6, level + shift) + line[level:]
        out.append(line)
    return "\n".join(out).rstrip("\n") + "\n"


def _order(stem: str) -> tuple[int, str]:
    known = list(DESCRIPTIONS)
    matches = [i for i, k in enumerate(known) if stem == k or stem.startswith(k + "_")]
    return (min(matches) if matches else len(known), stem)


def render(results: Path = RESULTS) -> str:
    """The whole page (Markdown) from the results folder."""
    files = sorted(f for f in results.glob("*.md") if f.name != "README.md")  # the index
    out = [INTRO]
    placed: set[Path] = set()
    groups = [*GROUPS, ("Other results", "")]
    for title, prefix in groups:
        members = [f for f in files if f not in placed and f.stem.startswith(prefix)]
        if not members:
            continue
        out.append(f"\n## {title}\n")
        for f in sorted(members, key=lambda p: _order(p.stem)):
            placed.add(f)
            text = f.read_text(encoding="utf-8")
            links = [f"[{f.name}]({LINK_PREFIX}{f.name})"]
            for ext in (".json", ".png"):
                other = f.with_suffix(ext)
                if other.exists():
                    links.append(f"[{other.name}]({LINK_PREFIX}{other.name})")
            out.append(f"\n### {f.stem}\n\n{describe(f.stem, text)} Source: {', '.join(links)}.\n")
            png = f.with_suffix(".png")
            if png.exists():
                out.append(f"\n![{f.stem}]({LINK_PREFIX}{png.name})\n")
            out.append("\n" + demote(text, 4))
    return "".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the page is stale")
    parser.add_argument("--out", type=Path, default=DOC, help="where to write the page")
    args = parser.parse_args(argv)
    page = render()
    if args.check:
        current = args.out.read_text(encoding="utf-8") if args.out.exists() else ""
        if current != page:
            print(f"{args.out} is stale: run python -m dpkfc_bench results-doc", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(page, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
