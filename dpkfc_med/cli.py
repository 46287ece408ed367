"""The ``dpkfc-med`` command: train, audit, evaluate and report.

Examples::

    dpkfc-med train configs/pneumoniamnist_cnn_2d_eps1.yaml
    dpkfc-med train CONFIG --epsilon 8 --method dp-sgd --out runs/x --set training.lr=0.1
    dpkfc-med evaluate runs/x --data other_pneumoniamnist.npz --split test
    dpkfc-med report runs/x
    dpkfc-med audit configs/pneumoniamnist_cnn_2d_eps1.yaml --epsilon 8 --canaries 5000
    dpkfc-med bundle export runs/x bundles/x
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from dpkfc_med import __version__
from dpkfc_med.methods import method_help
from dpkfc_med.report.numbers import format_epsilon
from dpkfc_med.report.wording import NO_GUARANTEE

__all__ = ["main"]


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dpkfc-med",
        description="Differentially private training of MONAI models with DP-KFC or DP-SGD.",
    )
    p.add_argument("--version", action="version", version=f"dpkfc-med {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser(
        "train",
        help="train a model privately from a YAML config and write a privacy report",
        description="Train from a YAML config (see configs/). Writes the model, metrics, a "
        "ledger and privacy_report.{json,md,html} into the run directory.",
    )
    _add_run_options(t, out_help="run directory (overrides output.dir)")
    t.add_argument(
        "--nproc",
        type=int,
        help="train over this many local processes (torch.distributed: gloo on CPU, one GPU "
        "each with NCCL): the units are sharded, each step adds one noise draw; under "
        "torchrun leave it out",
    )
    t.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in the output directory within its budget (from its checkpoint, "
        "or from its ledger alone); a changed training.epochs re-plans the remaining steps, "
        "other changes to the mechanism, model or data are refused",
    )
    f = sub.add_parser(
        "federated",
        help="train over N federated sites with Flower (FedAvg), each site privately",
        description="Start a Flower server and N site clients on loopback; site k trains on "
        "every N-th unit of the training split with the config's method, its own Poisson "
        "sampling and ledger, its target epsilon spread over all rounds. Writes OUT/site_k/ "
        "(each site's run directory and privacy report) and OUT/server/ (the federated model, "
        "federated.json and federated.md).",
    )
    _add_run_options(f, out_help="the federated run's folder (overrides output.dir)")
    f.add_argument("--sites", type=int, required=True, help="number of sites (>= 2)")
    f.add_argument("--rounds", type=int, required=True, help="FedAvg rounds")
    f.add_argument("--local-epochs", type=int, default=1, help="epochs per site and round")
    a = sub.add_parser(
        "audit",
        help="empirical lower bound on epsilon from one training run with canaries",
        description="Run the config's exact private mechanism once with M white-box gradient "
        "canaries, each included with probability 1/2 (Steinke, Nasr & Jagielski 2023, "
        "'Privacy auditing with one (1) training run'), guess which were included from the "
        "released noisy updates and turn the correct guesses into a lower bound on epsilon. "
        "Writes audit.json (lower bound next to the accounted epsilon) into a new run "
        "directory, runs/{name}_audit by default. The audit run's model contains the canaries: "
        "it is a test of the implementation, not a release. A lower bound above the accounted "
        "epsilon means the guarantee does not hold.",
    )
    _add_run_options(a, out_help="the audit's run directory (default: the config's + '_audit')")
    # Defaults live in dpkfc_med.training.audit (None: use them); the parser stays free of
    # heavy imports so that --help is instant.
    a.add_argument(
        "--canaries",
        type=int,
        metavar="M",
        help="number of canaries, at least 2 and at most the model's number of trainable "
        "parameters (default 5000)",
    )
    a.add_argument("--confidence", type=float, help="confidence of the lower bound (default 0.95)")
    a.add_argument(
        "--noise-scale",
        type=float,
        default=1.0,
        metavar="S",
        help="RESEARCH ONLY, for testing the audit; the run is not DP: multiplies the noise "
        "drawn (the accountant still counts the configured noise) so that a value below 1 "
        "makes a broken mechanism the audit should refute; recorded in audit.json",
    )
    tu = sub.add_parser(
        "tune",
        help="accounted hyperparameter tuning: random trials, only the best released",
        description="Plan, from the total --epsilon, every trial's noise so that a random "
        "number of trials (Papernot & Steinke 2022), each an ordinary private run with "
        "hyperparameters drawn uniformly from --grid and scored on the validation units with "
        "Gaussian noise, and the release of the best one, spend at most --epsilon. Writes "
        "OUT/model.pt (the best trial's), OUT/tuning_report.{json,md} and, for the custodian, "
        "OUT/private_not_for_release/tuning.json (the "
        "tuning's ledger); every trial stays under OUT/private_not_for_release/.",
    )
    _add_run_options(tu, out_help="the tuning's folder (default runs/{name}_tuning)")
    tu.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="values a trial draws from (repeatable), e.g. --grid training.lr=0.05,0.1",
    )
    tu.add_argument(
        "--trials",
        default="poisson:4",
        help="the number of trials: poisson:MU or tnb:ETA,GAMMA (default poisson:4)",
    )
    tu.add_argument("--resume", action="store_true", help="continue the tuning in --out")
    e = sub.add_parser(
        "evaluate",
        help="metrics of a trained run on a MedMNIST file / NIfTI folder of the same task",
        description="Evaluate the selected model of RUN_DIR on a split of any dataset of the same "
        "task (same input shape and classes); a bundle run on its data lists or on a folder of "
        "new cases (--data). Results go to RUN_DIR/private_not_for_release/evaluations/: the "
        "figures (JSON) and, for segmentation, per-case metrics (MONAI MetricsSaver CSV files) "
        "and, with --save-predictions, the predicted label maps.",
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
    e.add_argument(
        "--save-predictions",
        action="store_true",
        help="segmentation: also save each case's predicted label map (NIfTI on the input's "
        "grid; DICOM-SEG too for a DICOM series) under the evaluation's folder",
    )
    r = sub.add_parser(
        "report",
        help="re-render the human-readable privacy report from privacy_report.json",
        description="Re-render privacy_report.md/.html and plots from the JSON (no recomputation).",
    )
    r.add_argument("run_dir")
    b = sub.add_parser(
        "bundle",
        help="MONAI bundles of finished runs (see docs/bundles.md)",
        description="MONAI bundles: `bundle train BUNDLE_DIR --epsilon E` trains a bundle in the "
        "Model Zoo layout privately; `bundle export RUN_DIR OUT_DIR` writes a self-contained "
        "inference bundle of a finished run.",
    )
    bsub = b.add_subparsers(dest="bundle_command", required=True)
    x = bsub.add_parser(
        "export",
        help="write a MONAI inference bundle (model, inference.yaml, metadata with the DP block)",
        description="Write OUT_DIR/models/model.pt, configs/inference.yaml, configs/metadata.json "
        "(with the privacy block from the run's ledger) and docs/ (the shareable privacy report). "
        "Refuses an incomplete run and a run whose ledger epsilon exceeds its target; a "
        f"non-private run is exported marked {NO_GUARANTEE}.",
    )
    x.add_argument("run_dir", help="a finished run (train --out) or accounted tuning (tune --out)")
    x.add_argument("out_dir", help="the bundle folder to create (new or empty)")
    t = bsub.add_parser(
        "train",
        help="train a bundle in the MONAI Model Zoo layout privately (its network, loss, "
        "optimizer, transforms and data list)",
        description="Train BUNDLE_DIR's configs/train.json privately through the private engine: "
        "network_def made DP-compatible, the loss per sample, Poisson sampling of units (one item "
        "of train#dataset, or all items sharing --unit-key), validate#evaluator as custodian-only "
        "evaluation. Probe shapes come from configs/metadata.json's network_data_format.",
    )
    t.add_argument("bundle_dir")
    t.add_argument(
        "--epsilon",
        type=float,
        default=None,
        help="target epsilon of the run (default: the bundle's private_training section)",
    )
    t.add_argument("--delta", type=float, default=None, help="target delta (default: 1e-5 rule)")
    t.add_argument(
        "--method",
        default=None,
        help="dp-kfc, dp-sgd or nonprivate (default: the bundle's private_training, else dp-kfc)",
    )
    t.add_argument("--unit-key", default=None, help="data-list key of the unit (patient) id")
    t.add_argument(
        "--recipe",
        choices=("auto", "bundle"),
        default=None,
        help="auto: batch, epochs, clip norm, optimizer, lr, data-free pretraining and method "
        "chosen by a rule on public facts (training.recipe: auto); bundle: keep the bundle's "
        "own optimizer, lr, batch and epochs (default: the bundle's "
        "private_training#training#recipe, else auto)",
    )
    t.add_argument(
        "--allow-data-dependent",
        action="append",
        default=[],
        metavar="ID",
        help="train although the value at bundle id ID is computed from the private data lists "
        "(e.g. a dataset-wide mean); the report lists it as not covered (refused otherwise)",
    )
    t.add_argument("--out", default=None, help="run directory (default runs/<bundle name>)")
    t.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="ID=VALUE",
        help="set a bundle config id (MONAI '#' ids, e.g. train#trainer#max_epochs=5)",
    )
    t.add_argument(
        "--set",
        action="append",
        default=[],
        dest="settings",
        metavar="KEY=VALUE",
        help="set a private-run field (e.g. privacy.max_grad_norm=0.5, training.eval_every=2)",
    )
    t.add_argument(
        "--pretrained",
        nargs="?",
        const=True,
        default=None,
        metavar="PATH",
        help="fine-tune privately from the bundle's own models/model.pt (no PATH), or from PATH "
        "(a state dict, a run's model.pt or a bundle folder): model.pretrained with its checks; "
        "the weights must not have been trained on this data",
    )
    t.add_argument(
        "--pretrained-source",
        default=None,
        metavar="TEXT",
        help="where the weights come from, as the shareable report shows it (e.g. 'MONAI Model "
        "Zoo spleen_ct_segmentation 0.5.4'); without it the report says its source is 'not "
        "stated' and the console warns",
    )
    t.add_argument("--resume", action="store_true", help="continue the run in --out")
    return p


def _add_run_options(p: argparse.ArgumentParser, *, out_help: str) -> None:
    """The config argument and the overrides shared by ``train`` and ``audit``."""
    p.add_argument(
        "config",
        nargs="?",
        help="YAML run configuration (train --resume --out DIR: optional, the run's own)",
    )
    p.add_argument(
        "--data", help="private data: MedMNIST .npz / flag, or NIfTI folder (overrides data.path)"
    )
    p.add_argument(
        "--epsilon", type=float, help="target epsilon (overrides privacy.target_epsilon)"
    )
    p.add_argument("--method", help=method_help())
    p.add_argument("--out", help=out_help)
    p.add_argument("--device", help="cpu | cuda | auto")
    p.add_argument(
        "--seed",
        type=int,
        help="training seed: model init, probes, data split (overrides training.seed); the noise "
        "and the sampling never derive from it",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any config field, e.g. --set training.lr=0.1 (repeatable)",
    )


def _load_run_config(args: argparse.Namespace) -> Any:
    """The config of ``args.config`` with the command-line overrides applied and validated."""
    from dpkfc_med.training.config import load_config

    if args.config is None:
        from pathlib import Path

        from dpkfc_med.training.config import ConfigError

        own = Path(args.out or "") / "config.yaml" if args.out else None
        if not (getattr(args, "resume", False) and own is not None and own.is_file()):
            raise ConfigError(
                [
                    "CONFIG: required (a YAML run configuration); to continue a stopped run "
                    "with its own configuration: dpkfc-med train --resume --out RUN_DIR"
                    + (f" ({own} not found)" if own is not None else "")
                ]
            )
        args.config = str(own)  # the run's own stored configuration, overrides on top
    from dpkfc_med.training.config import ConfigError

    overrides = list(args.set)
    flags: dict[str, str] = {}  # override -> the command-line option that asked for it
    for option, field, value in (
        ("--data", "data.path", args.data),
        ("--epsilon", "privacy.target_epsilon", args.epsilon),
        ("--method", "method", args.method),
        ("--out", "output.dir", args.out),
        ("--device", "training.device", args.device),
        ("--seed", "training.seed", args.seed),
    ):
        if value is not None and value != "":
            overrides.append(f"{field}={value}")
            flags[overrides[-1]] = f"{option} {value}"
    try:
        return load_config(args.config, overrides)
    except ConfigError as err:
        # name the option the user typed (--epsilon -1), not the override it became
        problems, source = list(err.problems), err.source
        for i, culprit in enumerate(err.set_by):
            if culprit is not None and culprit[0] in flags:
                problems[i] = f"{flags[culprit[0]]}: {culprit[1]}"
                source = f"{err.file} and its" if err.file else "the"
                source += " command-line options"
        raise ConfigError(problems, source) from None


def _train(args: argparse.Namespace) -> int:
    from dpkfc_med.training import distributed
    from dpkfc_med.training.config import ConfigError
    from dpkfc_med.training.run import train

    cfg = _load_run_config(args)
    if args.nproc is not None and args.nproc > 1 and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError(["--nproc: already running under torchrun; drop --nproc"])
    if args.nproc is not None and args.nproc != 1:
        try:
            result = distributed.train_distributed(cfg, args.nproc, resume=args.resume)
        except RuntimeError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
    elif distributed.init_from_environment(cfg):  # under torchrun
        result = distributed.train_on_this_rank(cfg, resume=args.resume)
        if not distributed.World.current().is_main:
            return 0
    else:
        result = train(cfg, resume=args.resume)
    eps = result.epsilon
    test = (result.metrics or {}).get("test") or {}
    print(f"run: {result.run_dir} ({result.status})")
    if eps is None:
        print("privacy: none (non-private training)")
    else:
        delta = result.report["privacy"]["delta"]

        print(f"privacy: epsilon = {format_epsilon(eps)} at delta = {delta:g} (PRV)")
    for key in ("accuracy", "balanced_accuracy", "auroc", "mean_dice"):
        if key in test:
            print(f"test {key}: {test[key]:.4f}")
    if test.get("hd95_per_class"):
        parts = ", ".join(f"{k} {v:.2f}" for k, v in test["hd95_per_class"].items())
        unit = str(test.get("hd95_unit") or "mm").split()[0]  # mm, or pixels for PNG
        print(f"test Hausdorff-95 ({unit}): {parts}")
    print(f"report: {result.run_dir / 'privacy_report.md'}")
    return 0


def _audit(args: argparse.Namespace) -> int:
    from dpkfc_med.training.audit import AUDIT_FILE, format_audit, run_audit

    cfg = _load_run_config(args)
    run = run_audit(
        cfg,
        out=args.out,
        canaries=args.canaries,
        confidence=args.confidence,
        noise_scale=args.noise_scale,
    )
    print(f"audit run: {run.run_dir} (its model includes the canaries: not a release)")
    print(format_audit(run.audit))
    print(f"audit: {run.run_dir / AUDIT_FILE}")
    return 0


def _tune(args: argparse.Namespace) -> int:
    from dpkfc_med.privacy.selection import TrialCount
    from dpkfc_med.training.tune import TUNING_LEDGER, parse_grid, run_tuning

    if args.epsilon is None:
        print("error: tune needs --epsilon (the total for the whole tuning)", file=sys.stderr)
        return 2
    grid = parse_grid(args.grid)
    count = TrialCount.parse(args.trials)
    out = args.out
    args.out = None  # the trials' folders live under the tuning's folder
    cfg = _load_run_config(args)
    out = out or f"runs/{cfg.name}_tuning"
    record = run_tuning(
        cfg, target_epsilon=args.epsilon, grid=grid, trials=count, out=out, resume=args.resume
    )

    p = record["plan"]
    print(
        f"tuning: epsilon {format_epsilon(p['epsilon'])} at delta {p['delta']:g} for the whole "
        f"tuning ({p['trials_in_words']})"
    )
    # The number of trials and the released trial's index stay with the custodian: the bound
    # assumes both hidden, so no shareable file holds them (this console is the custodian's).
    private = f"{out}/{TUNING_LEDGER}"
    if record["selected"] is None:
        print("released: nothing (no trial)")
    else:
        best = record["trials"][record["selected"]]
        chosen = ", ".join(f"{k}={v}" for k, v in best["params"].items()) or "the base config"
        print(f"released: {out}/model.pt ({chosen})")
        print(
            f"custodian only, never publish: trial {best['index']} of {record['count']} drawn "
            f"({private})"
        )
    print(f"report: {out}/tuning_report.md")
    if record["selected"] is not None:
        print(f"bundle: dpkfc-med bundle export {out} BUNDLE_DIR")
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    from dpkfc_med.bundle.zoo import evaluate_bundle_run
    from dpkfc_med.training.evaluate import evaluate_run, is_bundle_run

    out = (evaluate_bundle_run if is_bundle_run(args.run_dir) else evaluate_run)(
        args.run_dir,
        data=args.data,
        split=args.split,
        device=args.device,
        save_predictions=args.save_predictions,
    )
    print(json.dumps(_short(out), indent=1))
    return 0


def _short(metrics: dict[str, Any]) -> dict[str, Any]:
    # The full record (provenance, confusion matrix): RUN_DIR/private_not_for_release/evaluations/
    return {k: v for k, v in metrics.items() if k not in ("data", "confusion_matrix")}


def _report(args: argparse.Namespace) -> int:
    from dpkfc_med.report import rerender

    paths = rerender(args.run_dir)
    for p in paths.values() if isinstance(paths, dict) else paths:
        print(p)
    return 0


def _federated(args: argparse.Namespace) -> int:
    from dpkfc_med.training.federated import run_federated

    cfg = _load_run_config(args)
    try:
        rec = run_federated(
            cfg, sites=args.sites, rounds=args.rounds, local_epochs=args.local_epochs
        )
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    for m in rec["history"][-1]["sites"]:
        print(
            f"site {m['site']}: epsilon = {format_epsilon(m['epsilon'])} ({m['steps']} noisy steps)"
        )
    print(f"federated model: {cfg.run_dir() / 'server' / 'model.pt'}")
    return 0


def _bundle(args: argparse.Namespace) -> int:
    from dpkfc_med.bundle import export_bundle

    if args.bundle_command == "train":
        from dpkfc_med.bundle.zoo import train_bundle

        result = train_bundle(
            args.bundle_dir,
            epsilon=args.epsilon,
            delta=args.delta,
            method=args.method,
            unit_key=args.unit_key,
            recipe=args.recipe,
            out=args.out,
            overrides=args.override,
            settings=args.settings,
            allow_data_dependent=args.allow_data_dependent,
            pretrained=args.pretrained,
            pretrained_source=args.pretrained_source,
            resume=args.resume,
        )
        eps = (
            "no privacy" if result.epsilon is None else f"epsilon {format_epsilon(result.epsilon)}"
        )
        print(f"run {result.status}: {eps}; report: {result.run_dir / 'privacy_report.md'}")
        return 0
    out = export_bundle(args.run_dir, args.out_dir)
    print(f"bundle: {out}")
    meta = json.loads((out / "configs" / "metadata.json").read_text(encoding="utf-8"))
    stated = meta.get("network_data_format", {}).get("inputs", {}).get("image", {})
    print(
        f"check: the metadata states modality {stated.get('modality')!r} and data source "
        f"{meta.get('data_source')!r}, copied from the run config (data.modality, data.source), "
        f"not read from the data; if they do not describe your data, edit "
        f"{out / 'configs' / 'metadata.json'} or set them in the config and export again"
    )
    print(
        f"run it: python -m monai.bundle run --config_file {out / 'configs' / 'inference.yaml'} "
        "--dataset_dir DATA --output_dir PRED"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``dpkfc-med`` console script."""
    from dpkfc_med.console import quiet_third_party

    args = _build_parser().parse_args(argv)
    quiet_third_party()
    handlers = {
        "train": _train,
        "federated": _federated,
        "audit": _audit,
        "tune": _tune,
        "evaluate": _evaluate,
        "report": _report,
        "bundle": _bundle,
    }
    try:
        return handlers[args.command](args)
    except KeyboardInterrupt as err:
        # RunInterrupted says what was spent and how to continue; a bare Ctrl-C before the run
        # started spent nothing.
        print(
            str(err) or "interrupted before training started: nothing was spent",
            file=sys.stderr,
        )
        return 130
    except (ValueError, FileNotFoundError, KeyError) as err:
        # User errors (config, data, plan) carry their own explanation and fix.
        print(f"error: {err}", file=sys.stderr)
        for note in getattr(err, "__notes__", ()):  # e.g. that a refused run left nothing
            print(note, file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
