"""What a run publishes and what stays with the data custodian.

A run directory has two parts:

* the **shareable part** -- ``privacy_report.{json,md,html}``, ``plots/epsilon.png`` and the
  model (``model.pt``): everything in it is either covered by the (epsilon, delta) guarantee
  (the model, everything derived from the ledger) or public by assumption (the config, the
  plan, the number of training units, the environment), so a data-protection officer can hand
  it to a third party;
* the **custodian part** -- everything under :data:`PRIVATE_DIR`: statistics computed from the
  private records *without noise* (per-step training losses, validation and test metrics,
  clipping diagnostics, class counts, the data fingerprint, the case split) and files that show
  private records (segmentation overlays, evaluations). None of it is covered by the guarantee.

:func:`split_report` is the single place that decides which report fields go where
(:data:`CUSTODIAN_ONLY`); the shareable report lists the custodian items by name
(``custodian.items``) and states everything else the guarantee does not cover
(:func:`not_covered`).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

__all__ = [
    "CONFIG_PATHS",
    "CUSTODIAN_FILES",
    "CUSTODIAN_ONLY",
    "CUSTODIAN_SCHEMA",
    "EVALUATIONS_DIR",
    "EVALUATION_NOTE",
    "NOT_COVERED_GROUPS",
    "PRIVATE_DIR",
    "data_dependent_inputs",
    "kept_in_house",
    "not_covered",
    "not_covered_groups",
    "not_covered_summary",
    "shareable_config",
    "split_report",
]

PRIVATE_DIR = "private_not_for_release"
"""Folder of a run directory that holds everything derived from private records without noise."""

CUSTODIAN_SCHEMA = "dpkfc_med.custodian_report/1"

EVALUATIONS_DIR = f"{PRIVATE_DIR}/evaluations"
"""Where ``dpkfc-med evaluate`` writes its results, relative to the run directory."""

EVALUATION_NOTE = (
    "computed from the evaluated data, which the run's privacy guarantee does not protect (it "
    "covers the released model only); for the data custodian: release these figures only if "
    "the evaluated data may be released"
)
"""The privacy note every evaluation result carries."""

CUSTODIAN_FILES: dict[str, str] = {
    "json": f"{PRIVATE_DIR}/custodian_report.json",
    "markdown": f"{PRIVATE_DIR}/custodian_report.md",
    "training_plot": f"{PRIVATE_DIR}/plots/training.png",
}
"""Key -> path (relative to the run directory) of the custodian report's files."""

CONFIG_PATHS = (
    "data.path",
    "data.unit_ids",
    "data.split_file",
    "probes.public_data",
    "pretrain.cache_dir",
    "model.pretrained",
    "output.dir",
    "tracking.uri",
    "tracking.custodian_uri",
)
"""Run-config fields that hold paths: never in the shareable part (names can identify people)."""

CUSTODIAN_ONLY: dict[str, str] = {
    "history.loss": "per-step training losses (un-noised minibatch statistics)",
    "history.val_epoch": "epochs of the validation curve",
    "history.val_metric": "validation metric per epoch (un-noised, on private validation data)",
    "metrics": "validation and test metrics (un-noised, on private held-out data)",
    "diagnostics": "per-step clipping diagnostics (clipped fraction, norms, layer shares)",
    "training.selected_epoch": "the epoch selected on the private validation split",
    "data.class_counts": "class counts of the private splits",
    "data.sha256": "fingerprint of the private data (a membership oracle for the whole dataset)",
    "data.split": "case ids of each split (who is in the training set)",
    "data.units": "images per patient and image counts of the patient-id mapping",
    "data.path": "where the private data lies (folder and file names can name people or wards)",
    "run.run_dir": "the run directory's path",
    **{f"run.config.{field}": f"config field {field} (a path)" for field in CONFIG_PATHS},
    "preconditioner.external_data.path": "the public proxy's path",
    "preconditioner.probe_source.path": "the public proxy's path",
    "model.pretrained.path": "the pretrained weights' path",
}
"""Dotted report field -> what it is; all move from the shareable to the custodian report."""

CUSTODIAN_FOLDER_FILES: dict[str, str] = {
    "custodian_report.json / .md": "this report",
    "metrics.json": "validation and test metrics",
    "split.json": "case ids of each split (segmentation)",
    "overlays/*.png": "slices of private images with ground truth and prediction (segmentation)",
    "evaluations/*.json": "results of `dpkfc-med evaluate` (computed on the evaluated data)",
    "evaluations/*/": "per-case metrics (MetricsSaver CSV layout) of each evaluation, and with "
    "--save-predictions its label maps (NIfTI, DICOM-SEG for DICOM inputs)",
    "bundle_handlers/": "what a bundle's own handlers wrote (TensorBoard, MLflow, MetricsSaver, "
    "...), every output folder moved here",
    "tracking/": "the custodian tracking stream (tracking.backend; losses, validation, clipping)",
}
"""Files that may appear under :data:`PRIVATE_DIR`, and what they hold."""


def shareable_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A run config (nested dict) without its path fields (:data:`CONFIG_PATHS`)."""
    out = copy.deepcopy(dict(config))
    for dotted in CONFIG_PATHS:
        _pop(out, dotted)
    return out


def _pop(report: dict[str, Any], dotted: str) -> tuple[bool, Any]:
    node: Any = report
    parts = dotted.split(".")
    for part in parts[:-1]:
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    if not isinstance(node, dict) or parts[-1] not in node:
        return False, None
    return True, node.pop(parts[-1])


def _put(report: dict[str, Any], dotted: str, value: Any) -> None:
    node = report
    parts = dotted.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value


def split_report(full: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a full report into the shareable report and the custodian report.

    Args:
        full: the report as the pipeline assembled it (every field).

    Returns:
        ``(shareable, custodian)``. ``shareable`` lacks every :data:`CUSTODIAN_ONLY` field and
        names the custodian part in ``custodian``; ``custodian`` holds those fields (schema
        :data:`CUSTODIAN_SCHEMA`) with the run's name, status and privacy headline for context.
    """
    shareable = copy.deepcopy(dict(full))
    # times finer than a day would let a reader derive the run's duration, which depends on
    # the secret Poisson batch sizes: the shareable report keeps dates
    if isinstance(shareable.get("created"), str):
        shareable["created"] = shareable["created"][:10]
    for entry in (shareable.get("privacy") or {}).get("plan_history") or []:
        if isinstance(entry, dict) and isinstance(entry.get("time"), str):
            entry["date"] = entry.pop("time")[:10]
    private: dict[str, Any] = {}
    moved: list[str] = []
    for dotted in CUSTODIAN_ONLY:
        found, value = _pop(shareable, dotted)
        if found:
            _put(private, dotted, value)
            if value is not None:  # a field this run does not use is not listed as kept
                moved.append(dotted)
    p = shareable.get("privacy") or {}
    custodian: dict[str, Any] = {
        "schema": CUSTODIAN_SCHEMA,
        "banner": (
            "computed from the private records without noise; not "
            "covered by the privacy guarantee; for the data custodian only"
        ),
        "status": shareable.get("status"),
        "created": shareable.get("created"),
        "run": {k: (shareable.get("run") or {}).get(k) for k in ("name", "run_dir", "seed")},
        "task": shareable.get("task"),
        "privacy": {
            "method": p.get("method"),
            "epsilon": p.get("epsilon"),
            "delta": p.get("delta"),
            "accountant": p.get("accountant"),
        },
        "history": {"step": (shareable.get("history") or {}).get("step", [])},
        "metrics": {"val": None, "test": None},
        "diagnostics": None,
        "training": {},
        "data": {},
        "files": dict(CUSTODIAN_FOLDER_FILES),
    }
    custodian["run"].update(private.get("run", {}))
    custodian["created"] = full.get("created")
    for key in ("history", "training", "data"):
        custodian[key].update(private.get(key, {}))
    for key in ("metrics", "diagnostics", "preconditioner"):
        if key in private:
            custodian[key] = private[key]
    custodian["history"].setdefault("val_metric_name", shareable["history"].get("val_metric_name"))
    shareable["custodian"] = {
        "path": PRIVATE_DIR,
        "report": CUSTODIAN_FILES["json"],
        "items": {k: CUSTODIAN_ONLY[k] for k in moved},
        "note": (
            f"everything under {PRIVATE_DIR}/ is computed from the private records without "
            "noise, is NOT covered by the privacy guarantee and must not leave the data "
            "custodian; this report, its epsilon plot and the model are the shareable part"
        ),
    }
    return shareable, custodian


NOT_COVERED_GROUPS: dict[str, str] = {
    "nothing": "Nothing is covered",
    "private": "Uses of the private data outside the mechanism",
    "public": "Treated as public",
    "weaker": "Protected less",
    "assumed": "Assumed",
    "custodian": "Kept in-house (for the data custodian only)",
    "other": "Also not covered",
}
"""Group key -> title of the groups the not-covered items are shown in, in reading order."""

CONFIG_PATHS_TEXT = "paths in the run configuration"
"""What the config-path fields moved to the custodian report are, as one kept item."""


def kept_in_house(report: Mapping[str, Any]) -> list[tuple[str, list[str]]]:
    """What this run keeps in the custodian report: ``(what it is, [dotted fields])``, once each.

    Only fields this run has are listed: the shareable report's ``custodian.items`` (what
    :func:`split_report` moved), or, in a full report, the :data:`CUSTODIAN_ONLY` fields that
    hold a value. Fields that are the same thing (the public proxy's path, named twice) share
    one entry; the config fields that hold paths are one entry.
    """
    items = (report.get("custodian") or {}).get("items")
    fields = list(items) if isinstance(items, Mapping) else _present(report)
    out: dict[str, list[str]] = {}
    for dotted in fields:
        if dotted.startswith("run.config."):
            what = CONFIG_PATHS_TEXT
        else:
            what = str(CUSTODIAN_ONLY.get(dotted, (items or {}).get(dotted, dotted)))
        out.setdefault(what, []).append(dotted)
    return list(out.items())


def _present(report: Mapping[str, Any]) -> list[str]:
    """The :data:`CUSTODIAN_ONLY` fields of a full report that hold a value."""
    found = []
    for dotted in CUSTODIAN_ONLY:
        node: Any = report
        for part in dotted.split("."):
            node = node.get(part) if isinstance(node, Mapping) else None
        if node is not None:
            found.append(dotted)
    return found


def data_dependent_inputs(report: Mapping[str, Any]) -> list[str]:
    """The bundle inputs whose values were computed from the private training data.

    Read from ``data.bundle.data_dependent_inputs`` (one string per input, e.g.
    ``"NormalizeIntensityd subtrahend=@ds_mean"``); empty for runs without a bundle.
    """
    bundle = (report.get("data") or {}).get("bundle")
    values = bundle.get("data_dependent_inputs") if isinstance(bundle, Mapping) else None
    return [str(v) for v in values or []]


def not_covered(report: Mapping[str, Any]) -> list[str]:
    """Everything the stated (epsilon, delta) does not cover, one sentence each.

    Args:
        report: the (shareable or full) report.
    """
    return [full for _, _, full in _not_covered_items(report)]


def not_covered_summary(report: Mapping[str, Any]) -> list[str]:
    """The items of :func:`not_covered`, each in a few words (the plain-language summary)."""
    return [short for _, short, _ in _not_covered_items(report)]


def not_covered_groups(report: Mapping[str, Any]) -> list[tuple[str, list[tuple[str, str]]]]:
    """What the guarantee does not cover, grouped, each item once: ``(title, [(short, full)])``.

    The report's own list (``privacy.not_covered``) comes first: each sentence is matched with
    the item :func:`not_covered` gives for this report (by its text, or by its opening words
    when another version worded it), which names its group and its few-word form; a sentence
    that matches none is shown in full under :data:`NOT_COVERED_GROUPS` ``["other"]``. An item
    this report calls for that the list lacks is added to its group.
    """
    known = _not_covered_items(report)
    stated = list((report.get("privacy") or {}).get("not_covered") or [])
    by_full = {full: (group, short) for group, short, full in known}
    by_start = {full[:_OPENING]: (group, short) for group, short, full in known}
    groups: dict[str, list[tuple[str, str]]] = {key: [] for key in NOT_COVERED_GROUPS}
    matched: set[str] = set()
    for sentence in dict.fromkeys(stated):
        found = by_full.get(sentence) or by_start.get(sentence[:_OPENING])
        group, short = found or ("other", sentence)
        if found is not None:
            matched.add(short)
        groups[group].append((short, sentence))
    for group, short, full in known:
        if short not in matched:
            groups[group].append((short, full))
    return [(NOT_COVERED_GROUPS[key], items) for key, items in groups.items() if items]


_OPENING = 40


def _custodian_sentence(report: Mapping[str, Any]) -> str:
    # each in a few words: the full descriptions are the custodian table's
    kept = [what.partition(" (")[0] for what, _ in kept_in_house(report)]
    if (report.get("task") or {}).get("kind") == "segmentation":
        kept.append("slices of private images with their segmentations (overlays)")
    kept.append("the results of dpkfc-med evaluate, when it is run")
    return f"Everything under {PRIVATE_DIR}/ (for the data custodian only): {'; '.join(kept)}."


def _not_covered_items(report: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """``(group, short, full)`` statement of each thing the guarantee does not cover."""
    p = report.get("privacy") or {}
    data = report.get("data") or {}
    last = (report.get("training") or {}).get("select_epoch") == "last"
    items = [
        (
            "private",
            "any hyperparameter tuning on the private data"
            + (
                ""
                if last
                else ", and the choice of the released epoch on the private validation split"
            ),
            "Hyperparameter tuning on the private data"
            + (
                " (the released weights are the last epoch's: no epoch was chosen on private data)."
                if last
                else ", including the choice of the released epoch on the private validation split."
            ),
        ),
        (
            "public",
            "the number of training units"
            + (f" ({n:,})" if isinstance(n := data.get("num_train_units"), int) else ""),
            "The number of training units N (it sets the sample rate q = 1/ceil(N/B), the "
            "number of steps and delta) is treated as public, as in Opacus and the standard "
            "analysis of Poisson-subsampled Gaussian mechanisms.",
        ),
        (
            "custodian",
            f"everything under {PRIVATE_DIR}/ (statistics computed from the private data "
            "without noise, and the data's paths)",
            _custodian_sentence(report),
        ),
    ]
    inputs = data_dependent_inputs(report)
    if inputs:
        items.insert(
            1,
            (
                "private",
                "the bundle inputs computed from the private training data ("
                + ", ".join(inputs)
                + ")",
                "The bundle inputs computed from the private training data outside the private "
                "mechanism: " + "; ".join(inputs) + ". The model depends on them, so the "
                "release is valid only for the training mechanism; compute them from public "
                "data (or set them by hand) to cover the whole model.",
            ),
        )
    if p.get("private"):
        rand = (p.get("randomness") or {}).get("source")
        if rand == "seeded":
            items.insert(
                0,
                (
                    "nothing",
                    "anything at all, because the noise can be replayed from the published seed",
                    "NOTHING: this run's noise and sampling were seeded from a published seed "
                    "(privacy.reproducible_noise: true), so anyone can replay them; it is NOT a "
                    "valid DP release.",
                ),
            )
        else:
            items.append(
                (
                    "assumed",
                    "flaws of the random number generator (ideal randomness is assumed)",
                    "Weaknesses of the random number generator: the guarantee assumes ideal "
                    "randomness; noise comes from "
                    + (
                        "the OS CSPRNG with Opacus' floating-point hardening."
                        if rand == "os-csprng"
                        else "PyTorch's generator seeded from OS entropy (set privacy.secure_rng: "
                        "true for the OS CSPRNG and floating-point hardening)."
                    ),
                )
            )
    note = data.get("unit_note")
    if isinstance(note, Mapping) and note.get("statement"):
        items.append(
            (
                "weaker",
                "patients with several images, beyond the weaker group-privacy bound",
                str(note["statement"]),
            )
        )
    pre = report.get("preconditioner") or {}
    if pre.get("uses_private_data"):
        items.append(
            (
                "private",
                "the preconditioner, which was built partly from private training images",
                "The preconditioner: its public proxy shares images with the private training "
                "set (probes.allow_public_overlap: true), so it depends on private records.",
            )
        )
    weights = (report.get("model") or {}).get("pretrained")
    if isinstance(weights, Mapping):
        items.append(
            (
                "public",
                "the training of the pretrained weights the run started from (their data must "
                "be public)",
                "The pretrained weights the run started from (SHA-256 "
                f"{weights.get('sha256')}; source as stated: {weights.get('source')}): the "
                "guarantee covers the private fine-tuning only. Whatever the weights reveal "
                "about their own training data is not covered, so that data must really be "
                "public, i.e. outside the private records.",
            )
        )
    if pre.get("external_data"):
        items.append(
            (
                "public",
                "the external public data used for the preconditioner",
                "The external public data used for the preconditioner is not protected by this "
                "guarantee (it is assumed public).",
            )
        )
    logged = (data.get("bundle") or {}).get("custodian_handlers") or []
    if logged:
        items.append(
            (
                "custodian",
                f"what the bundle's own handlers ({', '.join(logged)}) logged during training",
                f"What the bundle's own handlers ({', '.join(logged)}) logged during training "
                "(e.g. the un-noised training loss) is computed from the private records without "
                "noise and is not covered; it stays with the data custodian "
                f"({PRIVATE_DIR}/ and the console).",
            )
        )
    tracking = ((report.get("run") or {}).get("config") or {}).get("tracking") or {}
    if tracking.get("backend") not in (None, "none"):
        where = (
            "it was sent where tracking.custodian_uri points (named in the custodian report), "
            f"outside {PRIVATE_DIR}/: whoever can read it there sees these statistics"
            if tracking.get("custodian_uri")
            else f"it stays with the data custodian ({PRIVATE_DIR}/tracking/)"
        )
        items.append(
            (
                "custodian",
                f"the custodian {tracking['backend']} tracking stream (un-noised losses, "
                "validation scores, clipping diagnostics)",
                f"The custodian {tracking['backend']} tracking stream (tracking.backend): the "
                "training loss, validation scores and clipping diagnostics it logged are computed "
                f"from the private records without noise and are not covered; {where}. The "
                "shareable stream holds only what this report holds.",
            )
        )
    return items
