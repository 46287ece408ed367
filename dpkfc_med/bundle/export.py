"""``dpkfc-med bundle export RUN_DIR OUT_DIR``: a finished private run as a MONAI inference bundle.

The bundle is self-contained::

    OUT_DIR/models/model.pt            state dict of the run's selected (released) model
    OUT_DIR/configs/inference.yaml     MONAI preprocessing, network_def, inferer, postprocessing
    OUT_DIR/configs/metadata.json      MONAI metadata + differential_privacy (from the ledger)
    OUT_DIR/docs/README.md             what the bundle is and how to run it
    OUT_DIR/docs/privacy_report.*      the run's shareable privacy report (json, md, html, plots)

Only the shareable part of the run directory is exported; nothing under
``private_not_for_release/`` (un-noised statistics, case ids, overlays) and neither the
checkpoint nor the ledger's working files leave the run. The run's data fingerprint leaves only
as a tag under this custodian's secret key
(:func:`~dpkfc_med.models.pretrained.training_data_tag`), so that fine-tuning the exported
weights on the same data can be refused here. A run fine-tuned from pretrained weights names
them in the metadata (digest and stated source); its LoRA adapters are already merged into
``model.pt``, so the bundle runs with MONAI alone.

``RUN_DIR`` may also be the folder of an accounted tuning (``dpkfc-med tune --out``): the
bundle then holds the best trial's model, ``docs/tuning_report.*`` instead of the run's privacy
report, and a privacy block whose epsilon and words are the whole tuning's
(:mod:`dpkfc_med.bundle.tuned`).

Refused, with every problem named at once: a run that is not complete (``run.json`` status,
no ``model.pt``), a private run without its ledger, and a run whose ledger epsilon exceeds its
target. A non-private run is exported, but its metadata and README say ``NO PRIVACY
GUARANTEE`` in their first words.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from typing import Any

import torch
import yaml

from dpkfc_med.bundle.errors import BundleExportError
from dpkfc_med.bundle.inference import HEADER, inference_config
from dpkfc_med.bundle.metadata import (
    NO_GUARANTEE,
    bundle_metadata,
    dp_block,
    metadata_problems,
    pretrained_block,
    sha256_file,
)
from dpkfc_med.bundle.network import network_definition
from dpkfc_med.bundle.tuned import TUNING_REPORT_FILES, check_tuning, is_tuning, tuning_dp_block
from dpkfc_med.models.pretrained import TAG_FIELD, training_data_tag
from dpkfc_med.report.custodian import PRIVATE_DIR
from dpkfc_med.report.numbers import format_epsilon
from dpkfc_med.report.status import RunStatus
from dpkfc_med.report.writer import REPORT_FILES
from dpkfc_med.utils import atomic_write_bytes

__all__ = ["BundleExportError", "export_bundle"]

# Written by the engine (training/run.py); read here, never written.
RUN_JSON, LEDGER, MODEL, CONFIG = "run.json", "ledger.json", "model.pt", "config.yaml"
EPS_SLACK = 1e-9  # float noise of recomputing the ledger's epsilon


def _json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def _check_run(run: Path) -> tuple[dict[str, Any], dict[str, float] | None]:
    """The run's report and ledger epsilons; raises with every reason the run is not exportable."""
    from dpkfc_med.privacy.accounting import PrivacyLedger

    resume = f"finish it with `dpkfc-med train {run / CONFIG} --resume --out {run}`, then export"
    if not run.is_dir():
        raise BundleExportError([f"{run}: no such run directory (dpkfc-med train ... --out)"], run)
    problems: list[str] = []
    status = _json(run / RUN_JSON).get("status") if (run / RUN_JSON).is_file() else None
    if status != RunStatus.COMPLETE:
        problems.append(
            f"{run / RUN_JSON}: status {status!r}, not 'complete' (the run stopped before its "
            f"last epoch and has no final model); {resume}"
        )
    for name in (MODEL, CONFIG, REPORT_FILES["json"]):
        if not (run / name).is_file() and not (name == MODEL and status != RunStatus.COMPLETE):
            problems.append(f"{run / name}: missing; export needs a finished run ({resume})")
    report: dict[str, Any] = {}
    if (run / REPORT_FILES["json"]).is_file():
        report = _json(run / REPORT_FILES["json"])
        if report.get("status") != RunStatus.COMPLETE and status == RunStatus.COMPLETE:
            problems.append(
                f"{run / REPORT_FILES['json']}: status {report.get('status')!r}; re-render it "
                f"with `dpkfc-med report {run}` or {resume}"
            )
    epsilons: dict[str, float] | None = None
    privacy = report.get("privacy") or {}
    if privacy.get("private"):
        ledger_path = run / LEDGER
        if not ledger_path.is_file():
            problems.append(
                f"{ledger_path}: missing; a private run's guarantee is its ledger (restore it "
                "from the run's backup; a run without its ledger cannot be released)"
            )
        else:
            ledger = PrivacyLedger.from_dict(_json(ledger_path))
            epsilons = ledger.all_epsilons()
            accountant = privacy.get("accountant", "prv")
            target = float(privacy["target_epsilon"])
            spent = epsilons[accountant]
            if spent > target + EPS_SLACK:
                problems.append(
                    f"{ledger_path}: epsilon {spent:.4f} ({accountant.upper()}, {ledger.steps} "
                    f"steps at delta {ledger.delta:g}) exceeds the run's target "
                    f"{target:g}; the model is not covered by the target and must not be "
                    "released under it (train a new run within its budget)"
                )
            if ledger.steps < int(privacy.get("steps") or 0):
                problems.append(
                    f"{ledger_path}: {ledger.steps} steps, fewer than the report's "
                    f"{privacy.get('steps')}; the ledger is not this run's (restore it)"
                )
    if problems:
        raise BundleExportError(problems, run)
    return report, epsilons


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, text.encode())


def export_bundle(run_dir: str | Path, out_dir: str | Path) -> Path:
    """Write a self-contained MONAI inference bundle of a finished run.

    Args:
        run_dir: A complete run directory (``dpkfc-med train``), or the folder of a finished
            accounted tuning (``dpkfc-med tune``), whose best trial's model is exported.
        out_dir: The bundle folder to create (must not exist, or be empty).

    Returns:
        ``out_dir``.

    Raises:
        BundleExportError: The run is incomplete, lacks its ledger, or its ledger epsilon
            exceeds its target; or ``out_dir`` is not empty. Every problem is listed.

    Privacy guarantee:
        The bundle holds the released model and the shareable report only, i.e. what the
        run's (epsilon, delta) guarantee covers; the epsilon in its metadata is recomputed from
        the ledger (for a tuning: the whole tuning's, recomputed from its plan, with the
        mechanism in words; no other trial, score or the number of trials is shipped).
    """
    from dpkfc_med.training.config import config_from_dict

    run, out = Path(run_dir), Path(out_dir)
    tuned = check_tuning(run) if is_tuning(run) else None
    if tuned is None:
        report, epsilons = _check_run(run)
        raw = yaml.safe_load((run / CONFIG).read_text(encoding="utf-8"))
        shipped = list(REPORT_FILES.values())
    else:
        report, epsilons, raw = tuned.report, None, tuned.config
        shipped = list(TUNING_REPORT_FILES)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise BundleExportError(
            [f"{out}: exists and is not empty; choose a new bundle folder or remove it"], run
        )
    cfg = config_from_dict(raw, str((run if tuned is None else tuned.trial_dir) / CONFIG))
    saved = torch.load(run / MODEL, map_location="cpu", weights_only=False)
    task, state = saved["task"], saved["model"]
    net = network_definition(cfg.to_dict()["model"], task, state_dict=state)

    buf = io.BytesIO()
    torch.save({k: v.detach().cpu().clone() for k, v in state.items()}, buf)
    atomic_write_bytes(out / "models" / "model.pt", buf.getvalue())
    docs = out / "docs"
    for rel in shipped:  # the shareable report only; never PRIVATE_DIR
        src = run / rel
        if src.is_file() and PRIVATE_DIR not in src.parts:
            (docs / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, docs / rel)
    report_sha = sha256_file(docs / shipped[0])
    if tuned is None:
        dp = dp_block(report, epsilon_spent=epsilons, report_sha256=report_sha)
        source = f"run {report['run']['name']}"
        what = "Trained model of a finished dpkfc-med run."
    else:
        dp = tuning_dp_block(tuned, report_sha256=report_sha)
        source = f"the accounted tuning of {tuned.record['config'].get('name', 'a run')}"
        words = dp["tuning"]["in_words"]
        what = f"The released model of an {words[0].lower()}{words[1:]}"
    trained = run if tuned is None else tuned.trial_dir
    start = pretrained_block((report if tuned is None else tuned.trial_report).get("model") or {})
    if start is not None:
        dp["pretrained_weights"] = start
    tag = training_data_tag(trained)  # lets this custodian refuse fine-tuning on the same data
    if tag is not None:
        dp[TAG_FIELD] = tag
    meta = bundle_metadata(
        cfg,
        task,
        dp=dp,
        bundle_version="1.0.0",
        changelog=f"exported from {source} by dpkfc-med bundle export",
        needs_dpkfc=not net.monai_only,
        what=what,
    )
    meta["network_definition"] = net.note
    missing = metadata_problems(meta)
    if missing:  # a bug here, not a user error: the generator must fill every field
        raise RuntimeError("generated metadata is incomplete: " + "; ".join(missing))
    _write(out / "configs" / "metadata.json", json.dumps(meta, indent=2) + "\n")
    infer = inference_config(cfg, task, net.config)
    _write(out / "configs" / "inference.yaml", HEADER + yaml.safe_dump(infer, sort_keys=False))
    _write(docs / "README.md", _readme(meta, task, net.note))
    return out


def _readme(meta: dict[str, Any], task: dict[str, Any], note: str) -> str:
    dp = meta["differential_privacy"]
    seg = task["kind"] == "segmentation"
    lines = []
    if not dp["private"]:
        lines += [f"# {NO_GUARANTEE}", "", dp["warning"], ""]
    lines += [
        f"# {meta['task']}",
        "",
        meta["description"],
        "",
        "## Privacy",
        "",
    ]
    if dp["private"]:
        spent, acc = dp["epsilon_spent"], dp["accountant"]
        stated = spent[acc]
        within = "within" if stated <= dp["epsilon_target"] else "ABOVE"
        # the guarantee is the planning accountant's figure; the others bound the same
        # mechanism, so a larger one is a looser bound, never a second figure beside the target
        others = ", ".join(
            f"{k.upper()} {format_epsilon(v)} ("
            + ("a looser bound" if v > stated else "a cross-check")
            + ")"
            for k, v in spent.items()
            if k not in (acc, "max")
        )
        lines += [
            f"- guarantee: {dp['guarantee']}",
            f"- epsilon at delta {dp['delta']:g}: {format_epsilon(stated)} ({acc.upper()} "
            f"accountant, which planned the run; {within} its target {dp['epsilon_target']:g})",
            f"- unit of privacy: {dp['unit_of_privacy']}; sampler {dp['sampler']} at rate "
            f"{dp['sample_rate']:.4g}; noise multiplier {dp['noise_multiplier']:.4g}; clip norm "
            f"{dp['max_grad_norm']:g}; {dp['steps']} steps",
            *[f"- WARNING: {w}" for w in dp["headline_warnings"]],
        ]
        if others:
            lines.append(
                f"- other accountants, bounds on the same mechanism (not the stated epsilon): "
                f"{others}"
            )
    start = dp.get("pretrained_weights")
    if start:
        lines.append(
            f"- fine-tuned ({start['fine_tuning']}) from pretrained weights: SHA-256 "
            f"`{start['sha256']}`, source: {start['source']}. {start['covered']}"
        )
    tuning = dp.get("tuning")
    if tuning:
        released = tuning["released"] or {}
        values = ", ".join(f"{k}={v}" for k, v in (released.get("params") or {}).items())
        lines += [
            f"- tuning: {tuning['in_words']} The steps, rate and noise above are every trial's.",
            f"- released hyperparameters: {values or 'the base config'} (noisy validation "
            f"score {released.get('noisy_validation_score', float('nan')):.3f}); grid: "
            + "; ".join(f"{k} in {v}" for k, v in tuning["grid"].items()),
        ]
    shipped = Path(dp["privacy_report"]["file"])
    lines += [
        f"- full report: [{shipped.stem}.md]({shipped.stem}.md) "
        f"(SHA-256 of {shipped.name}: `{dp['privacy_report']['sha256']}`)",
        "",
        "## Run it with MONAI",
        "",
        "```bash",
        "python -m monai.bundle run --config_file BUNDLE/configs/inference.yaml \\",
        "    --dataset_dir "
        + ("FOLDER_OF_NIFTI" if seg else "FILE.npz --split test")
        + " --output_dir PRED",
        "python -m monai.bundle verify_net_in_out network_def \\",
        "    --meta_file BUNDLE/configs/metadata.json --config_file BUNDLE/configs/inference.yaml",
        "python -m monai.bundle verify_metadata --meta_file BUNDLE/configs/metadata.json "
        "--filepath schema.json  # needs internet",
        "```",
        "",
        (
            "Writes one label map `PRED/{name}_seg.nii.gz` per input volume, with the input's "
            "affine (a 2D network: per 2-D image, `PRED/{name}_seg.png` for PNG / JPEG input)."
            if seg
            else "Writes `PRED/{split}_probabilities.csv`: one row per image of the split, "
            "`index` then one probability column per class."
        ),
        "",
        f"Network: {note}.",
        "",
    ]
    return "\n".join(lines)
