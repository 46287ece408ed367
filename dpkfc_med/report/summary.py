"""The opening sections of the privacy report, what a data-protection officer reads first.

The verdict, the plain-words box, the summary table, the guarantee, what it does not cover
and the empirical audit.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dpkfc_med.report.custodian import not_covered_summary
from dpkfc_med.report.document import (
    Banner,
    Block,
    Box,
    BulletList,
    Heading,
    Inline,
    Paragraph,
    Span,
    Table,
    count_text,
    kv_table,
    records_table,
)
from dpkfc_med.report.numbers import format_delta, format_epsilon
from dpkfc_med.report.schema import ACCOUNTANTS
from dpkfc_med.report.statements import (
    ACCOUNTANT_NAMES,
    NONPRIVATE_NOTE,
    audit_sentence,
    guarantee_sentence,
    method_text,
    plural,
    preconditioner_statement,
    randomness_text,
    release_verdict,
    samples_text,
    sampling_text,
    steps_text,
)
from dpkfc_med.report.wording import NO_GUARANTEE

__all__ = [
    "audit_section",
    "guarantee_section",
    "headline",
    "not_covered_section",
    "plain_summary",
    "summary_section",
]


def headline(report: Mapping[str, Any]) -> list[Block]:
    """The verdict line that opens the report, and the other accountants on a neutral line.

    The verdict states the primary accountant's epsilon and what it is; the looser bounds of
    the cross-check accountants are information, not a warning (a run calibrated to PRV always
    has a larger RDP bound).
    """
    p = report["privacy"]
    if not p["private"]:
        return []  # the no-guarantee banner (NO_GUARANTEE) is the verdict
    verdict, _ = release_verdict(report)
    if (p.get("randomness") or {}).get("source") == "seeded":
        return [Paragraph((Span(verdict[0], "strong"), " " + verdict[1]))]
    eps, acc = p["epsilon"], p["accountant"]
    unit = report["data"]["privacy_unit"]
    line = (
        Span(verdict[0].rstrip(","), "strong"),
        f": epsilon {format_epsilon(eps[acc])} at delta {format_delta(p['delta'])} per {unit}, "
        f"by the {acc.upper()} accountant that planned this run; this is the figure the "
        "guarantee states.",
    )
    others = [f"{name.upper()} {format_epsilon(eps[name])}" for name in ACCOUNTANTS if name != acc]
    return [
        Paragraph(line),
        Paragraph(
            "Other accountants, for reference (upper bounds on the same mechanism by other "
            f"methods; looser bounds are expected): {', '.join(others)}."
        ),
    ]


def plain_summary(report: Mapping[str, Any]) -> Box:
    """A few sentences for a data-protection officer: who, against what, how much, what not.

    Every statement is read off the report: the privacy unit and their number (``data``), the
    epsilon, delta, target and accountant (``privacy``), what is not covered (the items of
    ``privacy.not_covered``, in short), and whether the run is a valid DP release (private,
    not seeded, preconditioner free of private data, complete).
    """
    p, data = report["privacy"], report["data"]
    unit, n = data["privacy_unit"], data["num_train_units"]
    head = unit.partition(" (")[0]
    who = f"Who is protected: each {unit} of the training set ({plural(head, n)})."
    note = data.get("unit_note")
    if isinstance(note, Mapping) and note.get("statement"):
        per = note.get("per_patient")
        if isinstance(per, Mapping):
            who += (
                f" A patient with {per['images_per_patient']} images is protected less, at "
                f'epsilon {format_epsilon(per["epsilon"])} (group privacy; see "Patients with '
                'several images" below).'
            )
        else:
            who += (
                " A patient with several images is protected less (group privacy; see "
                '"Patients with several images" below).'
            )
    if not p["private"]:
        return Box(
            "In plain words",
            [
                who.replace("Who is protected:", "Who would be protected:"),
                "Against what: nothing. This model was trained without differential privacy "
                "(no clipping, no noise); it may reveal information about individual training "
                f"{plural(head)} and must be handled like the private data itself.",
                (
                    Span("Valid DP release: no.", "strong"),
                    " Do not release this model or anything derived from it as private.",
                ),
            ],
            "danger",
        )
    eps, acc = p["epsilon"], p["accountant"]
    against = (
        "Against what: anyone who obtains everything this run publishes (the released model, "
        "this report and its epsilon plot), whatever else they know, can learn only a "
        f"strictly limited amount about whether any one {head} was in the training set."
    )
    spent = (
        f"How much: epsilon {format_epsilon(eps[acc])} at delta {format_delta(p['delta'])} "
        f"after {plural('noisy training step', p['steps'])} ({acc.upper()} accountant), "
        f"against a target of epsilon {format_epsilon(p['target_epsilon'])}. A smaller epsilon "
        "means stronger protection; delta is the small probability allowed for the bound to "
        "fail."
    )
    if format_epsilon(eps["max"]) != format_epsilon(eps[acc]):
        spent += (
            f" The most conservative of the three accountants computed gives "
            f"{format_epsilon(eps['max'])}."
        )
    not_covered = (
        'Not covered (listed in full under "What the guarantee does not cover"): '
        + "; ".join(not_covered_summary(report))
        + "."
    )
    if (p.get("randomness") or {}).get("source") == "seeded":
        against = (
            "Against what: nothing. The noise and the sampling were seeded from a seed this "
            "report publishes, so anyone can replay them and subtract the noise."
        )
        spent = (
            f"How much: no guarantee. With secret randomness the same mechanism would have "
            f"spent epsilon {format_epsilon(eps[acc])} at delta {format_delta(p['delta'])}."
        )
    verdict, kind = release_verdict(report)
    return Box(
        "In plain words",
        [who, against, spent, not_covered, (Span(verdict[0], "strong"), " " + verdict[1])],
        kind,
    )


def summary_section(report: Mapping[str, Any]) -> list[Block]:
    """The summary table: status, guarantee, method, preconditioner, unit, steps, task."""
    p, task, data, model = report["privacy"], report["task"], report["data"], report["model"]
    status = {"complete": "complete", "incomplete": "INCOMPLETE (interrupted)", "failed": "FAILED"}
    names = f" ({', '.join(task['label_names'])})" if task["label_names"] else ""
    guarantee: Inline = guarantee_sentence(report)
    if not p["private"]:
        guarantee = (
            Span(NO_GUARANTEE, "strong"),
            ": " + NONPRIVATE_NOTE.format(units=plural(data["privacy_unit"])),
        )
    rows: list[tuple[Inline, Any]] = [
        ("Status", status[report["status"]]),
        ("Privacy guarantee", guarantee),
        ("Method", method_text(report)),
        ("Private data used for the preconditioner", preconditioner_statement(report)),
        (
            "Privacy unit",
            f"{data['privacy_unit']} ({plural('unit', data['num_train_units'])} in the training "
            f"set, at most {samples_text(data['max_samples_per_unit'])} each)",
        ),
        ("Steps", steps_text(p)),
        ("Task", f"{task['kind']}, {task['spatial_dims']}D, {task['num_classes']} classes{names}"),
        ("Model", f"{model['name']} ({count_text(model['num_params'])} parameters)"),
        (
            "Results",
            "in the custodian report (computed on private data without noise; not covered)",
        ),
        ("Report created", report["created"]),
    ]
    audit = audit_sentence(report)
    if audit is not None:
        rows.insert(2, ("Empirical privacy audit", audit))
    note = data.get("unit_note")
    if isinstance(note, Mapping) and note.get("statement"):
        rows.insert(4, ("Patients with several images", note["statement"]))
    return [Heading(2, "Summary"), kv_table(rows)]


def guarantee_section(report: Mapping[str, Any]) -> list[Block]:
    """The guarantee: its text, the neighbouring relation, delta, every accountant's epsilon."""
    p, data = report["privacy"], report["data"]
    out: list[Block] = [Heading(2, "Privacy guarantee"), Paragraph(p["guarantee"])]
    rows: list[tuple[Inline, Any]] = [
        ("Neighbouring relation", p["neighbouring_relation"]),
        (
            "Privacy unit",
            f"{data['privacy_unit']} "
            f"(at most {samples_text(data['max_samples_per_unit'])} per unit)",
        ),
    ]
    if p["private"]:
        eps = p["epsilon"]
        rows.append(("delta", format_delta(p["delta"])))
        for name in ACCOUNTANTS:
            role = "primary" if name == p["accountant"] else "cross-check"
            rows.append((f"epsilon, {ACCOUNTANT_NAMES[name]} [{role}]", format_epsilon(eps[name])))
        rows.append(("epsilon, most conservative of the three", format_epsilon(eps["max"])))
        rows.append(("Target epsilon", format_epsilon(p["target_epsilon"])))
    rows += [
        ("Sampling", sampling_text(report)),
        ("Noise and sampling randomness", randomness_text(p)),
    ]
    out.append(kv_table(rows))
    if p["private"]:
        out.append(
            Paragraph(
                "Epsilon is printed rounded up to three decimals, never down. It is computed from "
                f"the privacy ledger, which records every noisy step taken ({p['steps']})."
            )
        )
    pre = report["preconditioner"]
    if pre is not None and p["private"]:
        source = "external public data" if pre["external_data"] is not None else "synthetic probes"
        out.append(
            Paragraph(
                f"The preconditioner is computed only from {source} and from model parameters "
                "that were already released by the mechanism; it never reads the private data, "
                "so it is post-processing and consumes no privacy budget."
            )
        )
    return out


def not_covered_section(report: Mapping[str, Any]) -> list[Block]:
    """What the guarantee does not cover, the custodian-only items and the plans."""
    p = report["privacy"]
    items = p.get("not_covered") or []
    out: list[Block] = [Heading(2, "What the guarantee does not cover")]
    if items:
        out.append(BulletList(items))
    cust = report.get("custodian") or {}
    if cust:
        out.append(Banner("Custodian only", cust["note"], "note"))
        rows = [(Span(k), v) for k, v in (cust.get("items") or {}).items()]
        if rows:
            out.append(Table(("Kept in the custodian report", "What it is"), rows))
    plans = p.get("plan_history") or []
    if len(plans) > 1:
        out.append(Heading(3, "Sessions and plans"))
        records = [
            {
                "session": e.get("session"),
                "kind": e.get("kind"),
                "changed": ", ".join(e.get("changed_fields") or []) or "-",
                "planned_steps": (e.get("plan") or {}).get("planned_steps"),
                "spent_before": (e.get("plan") or {}).get("spent_steps"),
                "sigma": (e.get("plan") or {}).get("noise_multiplier"),
            }
            for e in plans
        ]
        out.append(records_table(records))
    return out


def audit_section(report: Mapping[str, Any]) -> list[Block]:
    """The empirical audit's lower bound next to the accounted epsilon (when one ran)."""
    audit = report.get("audit")
    if not isinstance(audit, Mapping):
        return []
    rows: list[tuple[Inline, Any]] = [
        ("Epsilon lower bound (empirical)", format_epsilon(audit["epsilon_lower_bound"])),
        ("Epsilon accounted", format_epsilon(audit["epsilon_accounted"])),
        ("delta", format_delta(audit["delta"])),
        ("Canaries", audit["canaries"]),
        ("Confidence", audit["confidence"]),
    ]
    rows += [
        (k.replace("_", " ").capitalize(), v)
        for k, v in audit.items()
        if k not in ("epsilon_lower_bound", "epsilon_accounted", "delta", "canaries", "confidence")
        and not isinstance(v, (Mapping, list))
    ]
    return [
        Heading(2, "Empirical privacy audit"),
        Paragraph(
            "A one-run audit ran this mechanism with white-box gradient canaries, each included "
            "with probability 1/2, and turned the correct membership guesses into a statistical "
            "lower bound on epsilon: a test of the accounted plan's trade-off curve (f-DP, "
            "Mahloujifar, Melis and Chaudhuri 2025), with the bound of Steinke, Nasr and "
            "Jagielski (2023) as a cross-check. A lower bound below the accounted epsilon is "
            "expected; one above it would show a broken mechanism. The ceiling is the largest "
            "bound the audit's settings could show: below the accounted epsilon it cannot "
            "refute anything."
        ),
        kv_table(rows),
    ]
