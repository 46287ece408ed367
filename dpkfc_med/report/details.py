"""The technical sections of the privacy report and the custodian report's document.

Mechanism parameters and ledger, preconditioner provenance, data, model, training curves and
epsilon history, reproducibility; the custodian's results, diagnostics and private data.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from dpkfc_med.report.custodian import data_dependent_inputs
from dpkfc_med.report.document import (
    Banner,
    Block,
    BulletList,
    Code,
    Heading,
    Image,
    Inline,
    Paragraph,
    Span,
    Table,
    cell_of,
    count_text,
    fmt_value,
    is_records,
    kv_table,
    mapping_table,
    nested_blocks,
    records_table,
)
from dpkfc_med.report.numbers import format_delta, format_epsilon
from dpkfc_med.report.schema.privacy_report import COVERAGE_COLUMNS
from dpkfc_med.report.statements import (
    DIAGNOSTICS_NOTE,
    expected_batch_text,
    plural,
    preconditioner_statement,
    q_text,
    unit_detail,
)

__all__ = [
    "build_custodian_document",
    "curves_section",
    "data_section",
    "mechanism_section",
    "model_section",
    "preconditioner_section",
    "reproducibility_section",
]


def mechanism_section(report: Mapping[str, Any]) -> list[Block]:
    """Mechanism parameters (sampler, q, sigma, C, steps, accountant) and the privacy ledger."""
    p = report["privacy"]
    sigma, clip = p["noise_multiplier"], p["max_grad_norm"]
    noise_std = sigma * clip if sigma is not None and clip is not None else None
    rows: list[tuple[Inline, Any]] = [
        ("Method", p["method"]),
        ("Private", p["private"]),
        ("Sampler", p["sampler"]),
        ("Sample rate q", None if p["sample_rate"] is None else q_text(report)),
        ("Batch size setting B (training.batch_size)", p.get("batch_size")),
        ("Expected batch size", None if p["sampler"] is None else expected_batch_text(report)),
        ("Noise multiplier sigma", None if sigma is None else f"{sigma:.6g}"),
        ("Clipping bound C (max_grad_norm)", None if clip is None else f"{clip:.6g}"),
        (
            "Noise std on the clipped sum (sigma * C)",
            None if noise_std is None else f"{noise_std:.6g}",
        ),
        ("Steps taken", p["steps"]),
        ("Steps planned", p["planned_steps"]),
        ("Epochs", p["epochs"]),
        ("Accountant", p["accountant"]),
        ("delta", format_delta(p["delta"])),
        ("Secure RNG", p["secure_rng"]),
    ]
    procs = p.get("processes") or {}
    if procs.get("world_size", 1) > 1:
        rows.append(
            (
                "Processes",
                f"{procs['world_size']} ({procs.get('backend')}): each unit drawn and clipped "
                "on one rank, one noise draw per step on rank 0, summed by all-reduce",
            )
        )
    out: list[Block] = [Heading(2, "Mechanism parameters"), kv_table(rows)]
    out += [Heading(3, "Privacy ledger"), *_ledger(p["ledger"])]
    return out


def _ledger(ledger: Mapping[str, Any]) -> list[Block]:
    if not ledger:
        return [Paragraph("The ledger is empty.")]
    out: list[Block] = []
    rows = [
        (k, format_delta(v) if k == "delta" else cell_of(v))
        for k, v in ledger.items()
        if not is_records(v)
    ]
    if rows:
        out.append(Table(("Item", "Value"), rows))
    for key, value in ledger.items():
        if is_records(value):
            out += [Paragraph(Span(key, "strong")), records_table(value)]
    return out


def preconditioner_section(report: Mapping[str, Any]) -> list[Block]:
    """Preconditioner provenance: source, refreshes, covered layers, settings, fallbacks."""
    pre = report["preconditioner"]
    out: list[Block] = [Heading(2, "Preconditioner provenance")]
    if pre is None:
        return [
            *out,
            Paragraph(f"No preconditioner was used (method {report['privacy']['method']})."),
        ]
    refresh = pre["refresh_every"]
    schedule = (
        f"built at step 0, then every {plural('step', refresh)}"
        if refresh
        else "built once, at step 0"
    )
    plan = pre.get("refresh_plan") or {}
    if plan.get("rule") == "auto":
        schedule += (
            f" (refresh_every: auto; refreshes estimated at "
            f"{100 * plan['estimated_share']:.1f} % of training time, budget "
            f"{100 * plan['budget']:g} %)"
        )
    rows: list[tuple[Inline, Any]] = [
        ("Uses private data", pre["uses_private_data"]),
        ("Source", preconditioner_statement(report)),
    ]
    ext = pre["external_data"]
    if ext is not None:
        sha = ext["sha256"]
        digest: Inline = Span(sha) if isinstance(sha, str) else fmt_value(sha)
        if ext.get("path"):
            rows.append(("External data", Span(ext["path"])))
        rows += [
            ("External data SHA-256", digest),
            ("External data note", ext["note"]),
        ]
    rows += [
        ("Refresh schedule", schedule),
        ("Refreshes performed", len(pre["refreshes"])),
        ("Covered layers", len(pre["covered_layers"])),
    ]
    out.append(kv_table(rows))
    out += [Heading(3, "Probe source"), mapping_table(pre["probe_source"])]
    out += [Heading(3, "Refreshes")]
    if pre["refreshes"]:
        out.append(records_table(pre["refreshes"], ("step", "probe_seed", "seconds", "scale")))
    else:
        out.append(Paragraph("No refresh was recorded."))
    out.append(Heading(3, "Covered layers"))
    shares = pre.get("coverage_shares")
    if shares and shares.get("trainable"):
        out.append(
            Paragraph(
                f"Of {shares['trainable']:,} trainable parameters, "
                f"{100 * shares['full_block']:.1f} % have a full block of the family, "
                f"{100 * shares['diagonal_block']:.1f} % a block whose activation factor is "
                f"only diagonal (wider than max_factor_dim), and "
                f"{100 * shares['fallback']:.1f} % the fallback rule."
            )
        )
    if pre["coverage"]:
        out.append(records_table(pre["coverage"], COVERAGE_COLUMNS))
    elif pre["covered_layers"]:
        out.append(Table(("Layer",), [(Span(name),) for name in pre["covered_layers"]]))
    else:
        out.append(Paragraph("No layer is covered (the preconditioner is the identity)."))
    out += [Heading(3, "Preconditioner settings"), mapping_table(pre["config"], "Setting")]
    fallbacks = pre.get("eig_fallbacks") or []
    if fallbacks:
        out += [
            Heading(3, "Eigendecomposition fallbacks"),
            Paragraph(
                "These factors' eigendecompositions failed in the configured precision and were "
                "retried as listed (probe-only computations: no effect on the guarantee)."
            ),
            records_table(fallbacks, ("refresh_step", "layer", "factor", "used")),
        ]
    return out


def data_section(report: Mapping[str, Any]) -> list[Block]:
    """The data's privacy unit, unit count and splits (the fingerprint stays with the custodian)."""
    data = report["data"]
    rows: list[tuple[Inline, Any]] = [
        ("Path", Span(data["path"]) if data.get("path") else "in the custodian report"),
        ("Privacy unit", data["privacy_unit"]),
        *([("One unit is", unit_detail(data))] if unit_detail(data) else []),
        ("Units in the training set", data["num_train_units"]),
        ("Maximum samples per unit", data["max_samples_per_unit"]),
    ]
    out: list[Block] = [Heading(2, "Data"), kv_table(rows)]
    out += [
        Heading(3, "Splits"),
        Table(("Split", "Samples"), [(k, fmt_value(v)) for k, v in data["splits"].items()]),
        Paragraph(
            "The data's fingerprint, class counts and case split are in the custodian report: "
            "a fingerprint would let anyone test whether a given dataset is the training set."
        ),
    ]
    bundle = data.get("bundle")
    if bundle:  # a MONAI bundle trained with `dpkfc-med bundle train`
        version = f" {bundle['version']}" if bundle.get("version") else ""
        out += [
            Heading(3, "MONAI bundle"),
            Paragraph(
                f"Trained from the bundle {bundle.get('name')}{version}: its network_def, loss, "
                "optimizer, transforms and data list. Settings of the bundle that would break the "
                "guarantee were replaced by the private engine's equivalents:"
            ),
            BulletList(list(bundle.get("replaced") or ["none"])),
        ]
        inputs = data_dependent_inputs(report)
        if inputs:
            out += [
                Paragraph(
                    "Inputs of the bundle whose values were computed from the private training "
                    "data, outside the private mechanism (not covered: the release is valid for "
                    "the training mechanism only):"
                ),
                BulletList([Span(i) for i in inputs]),
            ]
    return out


def _finetune_text(model: Mapping[str, Any]) -> str:
    mode = model.get("finetune") or "full"
    staged = model.get("head_first")
    if not staged:
        return mode
    n = staged["epochs"]
    return (
        f"{mode}, after {n} epoch{'' if n == 1 else 's'} in which only "
        f"{', '.join(staged['modules'])} ({count_text(staged['params'])} parameters) learned"
    )


def model_section(report: Mapping[str, Any]) -> list[Block]:
    """The network, its parameter counts and the fixes applied for per-sample privacy."""
    model = report["model"]
    out: list[Block] = [
        Heading(2, "Model"),
        kv_table(
            [
                ("Network", model["name"]),
                ("Parameters", count_text(model["num_params"])),
                *(
                    [
                        ("Trained privately", count_text(model["trainable_params"])),
                        ("Frozen", count_text(model.get("frozen_params") or 0)),
                        ("Fine-tuning", _finetune_text(model)),
                    ]
                    if "trainable_params" in model
                    else []
                ),
            ]
        ),
        Heading(3, "Fixes applied for per-sample privacy"),
    ]
    if model["fixes"]:
        out.append(records_table(model["fixes"], ("path", "before", "after", "reason")))
    else:
        out.append(Paragraph("None were needed."))
    return out


def curves_section(report: Mapping[str, Any]) -> list[Block]:
    """Training settings, the epsilon figure and the epsilon history."""
    out: list[Block] = [Heading(2, "Training settings and privacy spent")]
    training = dict(report["training"] or {})
    recipe = training.pop("recipe", None) or {}
    if training:
        out.append(mapping_table(training, "Setting"))
    if recipe.get("fields"):
        out += [
            Heading(3, f"Recipe (training.recipe: {recipe.get('mode')})"),
            Paragraph(
                "Each setting below was either set by you or chosen by the rule of "
                "training.recipe: auto, from public facts only (the target epsilon, the "
                "number of training units, the task's declared shapes and the network)."
            ),
            records_table(recipe["fields"], ("field", "value", "origin", "why")),
        ]
    out.append(Image("epsilon", "Privacy spent (epsilon) against training step"))
    return out + _epsilon_history(report)


def _epsilon_history(report: Mapping[str, Any]) -> list[Block]:
    """Which steps the epsilon history lists, and its exact values (rounded up)."""
    p, history = report["privacy"], report["history"]
    if not p["private"] or "epsilon_step" not in history:
        return []
    acc = p["accountant"]
    listed, values = history["epsilon_step"], history["epsilon"]
    rdp = history.get("epsilon_rdp") or []
    rdp_at = dict(zip(history["step"], rdp)) if len(rdp) == len(history["step"]) else {}
    schedule = history.get("epsilon_schedule") or "the steps in the table"
    text = (
        f"The {acc.upper()} epsilon (the stated accountant) is listed exactly at "
        f"{schedule}: {plural('value', len(listed))}, each computed from the privacy ledger "
        "as it stood after that step; nothing is interpolated between them."
    )
    if acc != "rdp" and rdp_at:
        text += (
            " The RDP accountant's epsilon, a looser bound on the same mechanism that is cheap to "
            "compute, is given after every step (history.epsilon_rdp in the JSON report; the "
            "dashed grey line of the figure) and is what the progress bar shows during training; "
            "it is not the stated epsilon."
        )
    records = []
    for step, value in zip(listed, values):
        row: dict[str, Any] = {"step": step, f"epsilon ({acc.upper()})": format_epsilon(value)}
        if acc != "rdp" and rdp_at:
            row["epsilon (RDP, looser bound)"] = format_epsilon(rdp_at.get(step))
        records.append(row)
    return [Heading(3, "Epsilon history"), Paragraph(text), records_table(records)]


def reproducibility_section(report: Mapping[str, Any]) -> list[Block]:
    """Schema, run, config digest, seed, device, git commit, versions and the config."""
    run, env = report["run"], report["environment"]
    git = env["git"]
    if git is None:
        commit: Inline = "not recorded (not a git checkout)"
    else:
        commit = (
            Span(git["commit"]),
            " (uncommitted changes present)" if git["dirty"] else " (clean)",
        )
    machine = env.get("machine") or {}
    rows: list[tuple[Inline, Any]] = [
        ("Report schema", Span(report["schema"])),
        ("Run name", run["name"]),
        (
            "Run directory",
            Span(run["run_dir"]) if run.get("run_dir") else "in the custodian report",
        ),
        ("Config SHA-256", Span(run["config_sha256"])),
        ("Seed", run["seed"]),
        ("Device", run["device"]),
        (
            "Training precision",
            "bfloat16 forward/backward; per-sample gradients, clipping and noise in float32"
            if run.get("precision") == "bf16"
            else "float32",
        ),
        ("Git commit", commit),
        ("Python", f"{env['python']} {env.get('python_implementation', '')}".strip()),
        ("Platform", env.get("platform")),
    ]
    for key, label in (
        ("cpu_count", "CPU count"),
        ("torch_threads", "Torch threads"),
        ("accelerators", "Accelerators"),
    ):
        if key in machine:
            value = machine[key]
            if isinstance(value, list):
                value = ", ".join(map(str, value)) or "none"
            rows.append((label, value))
    return [
        Heading(2, "Reproducibility"),
        kv_table(rows),
        Heading(3, "Package versions"),
        Table(("Package", "Version"), [(k, fmt_value(v)) for k, v in env["packages"].items()]),
        Heading(3, "Run configuration"),
        _config_code(run["config"]),
    ]


def _config_code(config: Any) -> Code:
    text = json.dumps(config, indent=2)
    lines = text.count("\n") + 1
    return Code(text, "json", f"Show the run configuration (JSON, {plural('line', lines)})")


def _results(report: Mapping[str, Any]) -> list[Block]:
    out: list[Block] = [Heading(2, "Results")]
    labels = (report.get("task") or {}).get("label_names")
    for split, title in (("val", "Validation"), ("test", "Test")):
        values = (report.get("metrics") or {}).get(split)
        out.append(Heading(3, title))
        if not values:
            out.append(Paragraph("Not evaluated."))
        else:
            out += nested_blocks(values, labels)
    return out


def _diagnostics(report: Mapping[str, Any]) -> list[Block]:
    out: list[Block] = [Heading(2, "Diagnostics"), Banner("Note", DIAGNOSTICS_NOTE, "note")]
    diagnostics = report.get("diagnostics")
    if not diagnostics:
        return [*out, Paragraph("No diagnostics were recorded.")]
    return out + nested_blocks(diagnostics, None)


def build_custodian_document(custodian: Mapping[str, Any]) -> list[Block]:
    """The custodian report (un-noised statistics of the private records) as blocks."""
    run = custodian.get("run") or {}
    doc: list[Block] = [
        Heading(1, f"Custodian report (private, not for release): {run.get('name')}"),
        Banner("PRIVATE - NOT FOR RELEASE", custodian["banner"], "danger"),
    ]
    doc += _results(custodian)
    doc += [
        Heading(2, "Training curves"),
        Image("training", "Training loss against step and validation metric against epoch"),
    ]
    training = custodian.get("training") or {}
    if training:
        doc.append(mapping_table(training, "Setting"))
    doc += _diagnostics(custodian)
    data = custodian.get("data") or {}
    doc.append(Heading(2, "Private data"))
    if data.get("sha256"):
        doc.append(
            Table(("File", "SHA-256"), [(Span(f), Span(h)) for f, h in data["sha256"].items()])
        )
    for key in ("class_counts", "units"):
        if data.get(key):
            doc += nested_blocks({key: data[key]}, None)
    if data.get("split"):
        rows = [(k, ", ".join(map(str, v))) for k, v in data["split"].items()]
        doc.append(Table(("Split", "Case ids"), rows))
    files = custodian.get("files") or {}
    if files:
        doc += [
            Heading(2, "Files in this folder"),
            Table(("File", "What it holds"), [(Span(k), v) for k, v in files.items()]),
        ]
    return doc
