"""The generated files of the training bundles in ``pipelines/`` (metadata and inference config).

Each ``pipelines/NAME/configs/train.json`` is a bundle in the MONAI Model Zoo layout, written by
hand: its own ``network_def``, transforms, loss, optimizer, data lists, trainer and evaluator,
and a ``private_training`` section with the privacy recipe. ``dpkfc-med bundle train
pipelines/NAME`` trains it privately; ``python -m monai.bundle run --config_file
pipelines/NAME/configs/train.json`` trains it with MONAI alone (no privacy).

Its ``configs/metadata.json`` (apart from ``network_data_format``, which the bundle states and
the probes read) and ``configs/inference.yaml`` are generated from the bundle by
:func:`pipeline_files`, with the same code as ``dpkfc-med bundle export``. Regenerate after
changing a bundle::

    python -m dpkfc_med.bundle.pipelines            # rewrite pipelines/*/configs
    python -m dpkfc_med.bundle.pipelines --check    # exit 1 if a file is out of date

A pipeline's ``metadata.json`` states the privacy target of its recipe; the spent values are
``null`` until a run is exported. Its ``inference.yaml`` is the template an export fills: it
reads ``models/model.pt``, which only ``dpkfc-med bundle export`` writes (after checking that
the run finished within its budget).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from dpkfc_med.bundle.inference import HEADER, inference_config
from dpkfc_med.bundle.metadata import bundle_metadata, untrained_dp_block
from dpkfc_med.bundle.network import network_definition

__all__ = ["PIPELINES_DIR", "pipeline_files"]

PIPELINES_DIR = Path(__file__).resolve().parents[2] / "pipelines"
"""``pipelines/`` of the checkout."""


def pipeline_files(bundle: Path) -> dict[str, str]:
    """The generated files of one pipeline bundle.

    Args:
        bundle: ``pipelines/NAME``.

    Returns:
        Relative path -> text, for ``configs/metadata.json`` and ``configs/inference.yaml``.
    """
    from dpkfc_med.bundle.zoo import prepare_bundle
    from dpkfc_med.training.setup import task_record

    prepared = prepare_bundle(bundle)
    cfg = prepared.cfg
    task = task_record(prepared.task)
    net = network_definition(cfg.to_dict()["model"], task)
    meta = bundle_metadata(
        cfg,
        task,
        dp=untrained_dp_block(cfg, unit=prepared.task.privacy_unit),
        bundle_version="0.2.0",
        changelog=(
            "training recipe in the Model Zoo layout; no trained weights (train with "
            "`dpkfc-med bundle train`, then `dpkfc-med bundle export RUN_DIR OUT_DIR`)"
        ),
        needs_dpkfc=True,
        what="Private training recipe (a MONAI bundle: configs/train.json); not a trained model.",
    )
    meta["network_definition"] = net.note
    infer = inference_config(cfg, task, net.config)
    return {
        "configs/metadata.json": json.dumps(meta, indent=2) + "\n",
        "configs/inference.yaml": HEADER + yaml.safe_dump(infer, sort_keys=False),
    }


def main(argv: list[str] | None = None) -> int:
    """Rewrite (or ``--check``) the generated files of every pipeline in ``pipelines/``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="report stale files, write nothing")
    args = p.parse_args(argv)
    stale = []
    for bundle in sorted(
        d for d in PIPELINES_DIR.iterdir() if (d / "configs/train.json").is_file()
    ):
        for rel, text in pipeline_files(bundle).items():
            path = bundle / rel
            if path.is_file() and path.read_text(encoding="utf-8") == text:
                continue
            stale.append(path)
            if not args.check:
                path.write_text(text, encoding="utf-8")
    for path in stale:
        print(f"{'stale' if args.check else 'wrote'}: {path}")
    return 1 if (stale and args.check) else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
