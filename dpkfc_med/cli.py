"""The ``dpkfc-med`` command: train, evaluate and report.

Examples::

    dpkfc-med train configs/pneumoniamnist_cnn_2d_eps1.yaml
    dpkfc-med train CONFIG --epsilon 8 --method dp-sgd --out runs/x --set training.lr=0.1
    dpkfc-med evaluate runs/x --data other_pneumoniamnist.npz --split test
    dpkfc-med report runs/x
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

__all__ = ["main"]


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dpkfc-med",
        description="Differentially private training of MONAI models with DP-KFC or DP-SGD.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser(
        "train",
        help="train a model privately from a YAML config and write a privacy report",
        description="Train from a YAML config (see configs/). Writes the model, metrics, a "
        "ledger and privacy_report.{json,md,html} into the run directory.",
    )
    t.add_argument("config", help="YAML run configuration")
    t.add_argument(
        "--data", help="private data: MedMNIST .npz / flag, or NIfTI folder (overrides data.path)"
    )
    t.add_argument(
        "--epsilon", type=float, help="target epsilon (overrides privacy.target_epsilon)"
    )
    t.add_argument("--method", help="nonprivate | dp-sgd | dp-kfc | dp-kfc-white | dp-kfc-public")
    t.add_argument("--out", help="run directory (overrides output.dir)")
    t.add_argument("--device", help="cpu | cuda | auto")
    t.add_argument("--seed", type=int, help="training seed (overrides training.seed)")
    t.add_argument("--resume", action="store_true", help="continue the run in the output directory")
    t.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any config field, e.g. --set training.lr=0.1 (repeatable)",
    )
    e = sub.add_parser(
        "evaluate",
        help="metrics of a trained run on a MedMNIST file / NIfTI folder of the same task",
        description="Evaluate the selected model of RUN_DIR on a split of any dataset of the same "
        "task (same input shape and classes). Results go to RUN_DIR/evaluations/.",
    )
    e.add_argument("run_dir")
    e.add_argument("--data", help="dataset to evaluate on (default: the run's own data)")
    e.add_argument(
        "--split",
        default="test",
        choices=["test", "val", "train", "all"],
        help="split to evaluate (a segmentation folder other than the run's own: all its cases)",
    )
    e.add_argument("--device", default="cpu")
    r = sub.add_parser(
        "report",
        help="re-render the human-readable privacy report from privacy_report.json",
        description="Re-render privacy_report.md/.html and plots from the JSON (no recomputation).",
    )
    r.add_argument("run_dir")
    return p


def _train(args: argparse.Namespace) -> int:
    from dpkfc_med.training.config import load_config
    from dpkfc_med.training.loop import train

    overrides = list(args.set)
    if args.data:
        overrides.append(f"data.path={args.data}")
    if args.epsilon is not None:
        overrides.append(f"privacy.target_epsilon={args.epsilon}")
    if args.method:
        overrides.append(f"method={args.method}")
    if args.out:
        overrides.append(f"output.dir={args.out}")
    if args.device:
        overrides.append(f"training.device={args.device}")
    if args.seed is not None:
        overrides.append(f"training.seed={args.seed}")
    cfg = load_config(args.config, overrides)
    result = train(cfg, resume=args.resume)
    eps = result.epsilon
    test = (result.metrics or {}).get("test") or {}
    print(f"run: {result.run_dir} ({result.status})")
    if eps is None:
        print("privacy: none (non-private training)")
    else:
        delta = result.report["privacy"]["delta"]
        print(f"privacy: epsilon = {math.ceil(eps * 1000) / 1000:.3f} at delta = {delta:g} (PRV)")
    for key in ("accuracy", "balanced_accuracy", "auroc", "mean_dice"):
        if key in test:
            print(f"test {key}: {test[key]:.4f}")
    print(f"report: {result.run_dir / 'privacy_report.md'}")
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    from dpkfc_med.training.evaluate import evaluate_run

    out = evaluate_run(args.run_dir, data=args.data, split=args.split, device=args.device)
    print(json.dumps(_short(out), indent=1))
    return 0


def _short(metrics: dict[str, Any]) -> dict[str, Any]:
    # The full record (data provenance, confusion matrix) is in RUN_DIR/evaluations/.
    return {k: v for k, v in metrics.items() if k not in ("data", "confusion_matrix")}


def _report(args: argparse.Namespace) -> int:
    from dpkfc_med.report import rerender

    paths = rerender(args.run_dir)
    for p in paths.values() if isinstance(paths, dict) else paths:
        print(p)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``dpkfc-med`` console script."""
    args = _build_parser().parse_args(argv)
    handlers = {"train": _train, "evaluate": _evaluate, "report": _report}
    try:
        return handlers[args.command](args)
    except KeyboardInterrupt:
        print(
            "interrupted: the run is marked incomplete; continue it with --resume", file=sys.stderr
        )
        return 130
    except (ValueError, FileNotFoundError, KeyError) as err:
        # User errors (config, data, plan) carry their own explanation and fix.
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
