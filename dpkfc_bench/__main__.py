"""``python -m dpkfc_bench STUDY [options]``: run one study (``--help`` after STUDY for its options).

The package is named ``dpkfc_bench`` because Opacus installs a top-level ``benchmarks`` package
of its own; ``pip install -e .`` makes this one importable from any folder.
"""

from __future__ import annotations

import importlib
import sys

# study -> (module, one line on what it measures)
STUDIES: dict[str, tuple[str, str]] = {
    "accuracy": ("dpkfc_bench.accuracy", "test accuracy and AUROC against epsilon, every method"),
    "segmentation": ("dpkfc_bench.segmentation", "3D segmentation Dice, levers, shipped configs"),
    "federated": ("dpkfc_bench.federated", "hippocampus over Flower sites, each site private"),
    "audit": ("dpkfc_bench.audit", "one-run empirical lower bound on epsilon"),
    "tuning": ("dpkfc_bench.tuning", "accounted tuning against unaccounted and no tuning"),
    "public-init": (
        "dpkfc_bench.public_init",
        "public weights under shift: public-only, private-only, public init + fine-tuning",
    ),
    "multichannel": (
        "dpkfc_bench.multichannel",
        "two input channels, one file each, against one channel (hippocampus, epsilon 8)",
    ),
    "recipe": (
        "dpkfc_bench.recipe",
        "recipe: auto against a workload's own settings and the shipped recipe",
    ),
    "slices-2d": (
        "dpkfc_bench.slices_2d",
        "2D segmentation on slices: one lever at a time on the shipped 2D config",
    ),
    "cost": ("dpkfc_bench.cost", "step time, peak memory and refresh share against Opacus"),
    "bundle-cost": (
        "dpkfc_bench.bundle_cost",
        "a Model Zoo bundle: MONAI alone against the private engine, time per crop",
    ),
    "engine-overhead": (
        "dpkfc_bench.engine_overhead",
        "a private step through PrivateTrainer against the bare loop",
    ),
    "report-screenshot": ("dpkfc_bench.report_screenshot", "the HTML privacy report as a PNG"),
    "results-doc": ("dpkfc_bench.results_doc", "write docs/results.md from the results"),
}


def usage() -> str:
    """The list of studies."""
    width = max(map(len, STUDIES))
    lines = [f"  {name:<{width}}  {what}" for name, (_, what) in STUDIES.items()]
    return "usage: python -m dpkfc_bench STUDY [options]\n\nstudies:\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Dispatch to the study's ``main(argv)``; returns its exit status."""
    from dpkfc_med.utils import did_you_mean

    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0 if args else 2
    study, rest = args[0], args[1:]
    if study not in STUDIES:
        print(
            f"python -m dpkfc_bench: unknown study {study!r}{did_you_mean(study, list(STUDIES))}\n\n"
            + usage(),
            file=sys.stderr,
        )
        return 2
    module = importlib.import_module(STUDIES[study][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
