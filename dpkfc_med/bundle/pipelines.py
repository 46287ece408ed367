"""The generated files of the training bundles in ``pipelines/`` (metadata and inference config).

Each ``pipelines/NAME/configs/train.yaml`` is written by hand and names its run config
(``run_config``); everything else in ``configs/`` is generated from that run config by
:func:`pipeline_files`, with the same code as ``dpkfc-med bundle export``, so no setting is
written twice. Regenerate after changing a run config::

    python -m dpkfc_med.bundle.pipelines            # rewrite pipelines/*/configs
    python -m dpkfc_med.bundle.pipelines --check    # exit 1 if a file is out of date

A pipeline's ``metadata.json`` states the privacy target of its run config; the spent values
are ``null`` until a run is exported. Its ``inference.yaml`` is the template an export fills:
it reads ``models/model.pt``, which only ``dpkfc-med bundle export`` writes (after checking
that the run finished within its budget).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from dpkfc_med.bundle.inference import HEADER, inference_config
from dpkfc_med.bundle.metadata import bundle_metadata, untrained_dp_block
from dpkfc_med.bundle.network import network_definition

__all__ = ["PIPELINES_DIR", "pipeline_files", "run_config_path"]

PIPELINES_DIR = Path(__file__).resolve().parents[2] / "pipelines"
"""``pipelines/`` of the checkout."""

# Only the shapes are read off the data (tiny subsets: the shapes do not depend on them).
_SHAPE_ONLY = ["data.max_train=2", "data.max_eval=1", "data.unit_ids=null"]


def run_config_path(bundle: Path) -> Path:
    """The run config named by ``bundle/configs/train.yaml`` (its ``run_config``)."""
    from monai.bundle import ConfigParser

    parser = ConfigParser()
    parser.read_config(str(bundle / "configs" / "train.yaml"))
    parser["bundle_root"] = str(bundle)
    return Path(parser.get_parsed_content("run_config")).resolve()


def _task_record(cfg: Any) -> dict[str, Any]:
    from dpkfc_med.training.setup import task_record
    from dpkfc_med.training.task_build import build_task

    return task_record(build_task(cfg, public_probes=False))


def pipeline_files(bundle: Path) -> dict[str, str]:
    """The generated files of one pipeline bundle.

    Args:
        bundle: ``pipelines/NAME``.

    Returns:
        Relative path -> text, for ``configs/metadata.json`` and ``configs/inference.yaml``.
    """
    from dpkfc_med.training.config import load_config

    config = run_config_path(bundle)
    cfg = load_config(config)
    task = _task_record(load_config(config, _SHAPE_ONLY))
    net = network_definition(cfg.to_dict()["model"], task)
    unit = "patient/volume" if task["kind"] == "segmentation" else "image"
    if cfg.data.unit_ids:
        unit = "patient (data.unit_ids)"
    meta = bundle_metadata(
        cfg,
        task,
        dp=untrained_dp_block(cfg, unit=unit),
        bundle_version="0.1.0",
        changelog=(
            "training recipe; no trained weights (train with the bundle's training entry, "
            "then `dpkfc-med bundle export RUN_DIR OUT_DIR`)"
        ),
        needs_dpkfc=True,
        what=f"Private training recipe (run config configs/{config.name}); not a trained model.",
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
        d for d in PIPELINES_DIR.iterdir() if (d / "configs/train.yaml").is_file()
    ):
        for rel, text in pipeline_files(bundle).items():
            path = bundle / rel
            if path.is_file() and path.read_text() == text:
                continue
            stale.append(path)
            if not args.check:
                path.write_text(text)
    for path in stale:
        print(f"{'stale' if args.check else 'wrote'}: {path}")
    return 1 if (stale and args.check) else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
