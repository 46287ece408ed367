"""The opening sections of the privacy report, what a data-protection officer reads first.

The first screen (:func:`plain_summary`: the verdict, who is protected, epsilon in context, what
is not covered, what to keep in-house), then what the guarantee does not cover in full, what is
kept in-house, the summary table, the guarantee with the other accountants' bounds, and the
empirical audit.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dpkfc_med.report.custodian import (
    NOT_COVERED_GROUPS,
    PRIVATE_DIR,
    kept_in_house,
    not_covered_groups,
)
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
from dpkfc_med.report.statements import (
    ACCOUNTANT_NAMES,
    NONPRIVATE_NOTE,
    audit_sentence,
    epsilon_odds,
    guarantee_sentence,
    method_text,
    other_accountants,
    plural,
    preconditioner_statement,
    randomness_text,
    release_verdict,
    samples_text,
    sampling_text,
    steps_text,
    unit_detail,
    unit_head,
)
from dpkfc_med.report.status import RunStatus
from dpkfc_med.report.wording import NO_GUARANTEE

__all__ = [
    "audit_section",
    "guarantee_section",
    "in_house_section",
    "not_covered_section",
    "plain_summary",
    "summary_section",
]


def _who(report: Mapping[str, Any]) -> str:
    """Who is protected: the unit in words, singular and plural, with the group-privacy note."""
    data = report["data"]
    head, n = unit_head(data["privacy_unit"]), data["num_train_units"]
    detail = unit_detail(data)
    count = f"{n:,} {head if n == 1 else plural(head)}" if isinstance(n, int) else plural(head)
    who = f"each {head} of the training set ({count})."
    if detail:
        who += f" One {head}: {detail}."
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
    return who


def _not_covered_short(report: Mapping[str, Any]) -> BulletList:
    """The not-covered items in a few words, one line per group (the custodian's apart)."""
    custodian = NOT_COVERED_GROUPS["custodian"]
    return BulletList(
        [
            (Span(title, "strong"), ": " + "; ".join(short for short, _ in items) + ".")
            for title, items in not_covered_groups(report)
            if title != custodian
        ]
    )


def _in_house(report: Mapping[str, Any]) -> Inline:
    """What to keep in-house, in one sentence: the custodian items in short, and what to share."""
    custodian = NOT_COVERED_GROUPS["custodian"]
    groups = not_covered_groups(report)
    kept = [short for title, items in groups if title == custodian for short, _ in items]
    kept = kept or [f"everything under {PRIVATE_DIR}/"]
    if not report["privacy"]["private"]:
        return (
            Span("Keep in-house:", "strong"),
            " the model itself, like the private data, and " + "; ".join(kept) + ".",
        )
    return (
        Span("Keep in-house:", "strong"),
        " " + "; ".join(kept) + ". They must not leave the data custodian; only this report, "
        "its epsilon plot and the model may be shared.",
    )


def plain_summary(report: Mapping[str, Any]) -> Box:
    """The first screen, for a data-protection officer: verdict, who, how much, what not.

    In this order: whether the run is a valid DP release (private, not seeded, preconditioner
    free of private data, within its target, no input computed from the private data, complete);
    who is protected (the unit in words and their number, ``data``); how much (the planning
    accountant's epsilon, delta and target, ``privacy``, and what epsilon means); what the
    guarantee does not cover (the groups of ``privacy.not_covered``, in short); what to keep
    in-house. The other accountants' looser bounds are not here: they are in "Privacy guarantee".
    """
    p = report["privacy"]
    head = unit_head(report["data"]["privacy_unit"])
    who = _who(report)
    if not p["private"]:
        return Box(
            "In plain words",
            [
                (
                    Span("Valid DP release: no.", "strong"),
                    " Do not release this model or anything derived from it as private.",
                ),
                (Span("Who would be protected:", "strong"), " " + who),
                (
                    Span("Against what:", "strong"),
                    " nothing. This model was trained without differential privacy (no clipping, "
                    "no noise); it may reveal information about individual training "
                    f"{plural(head)} and must be handled like the private data itself.",
                ),
                _in_house(report),
            ],
            "danger",
        )
    eps, acc = p["epsilon"][p["accountant"]], p["accountant"]
    verdict, kind = release_verdict(report)
    against = (
        " Against anyone who obtains everything this run publishes (the released model, this "
        "report and its epsilon plot), whatever else they know."
    )
    so_far = "" if report["status"] == RunStatus.COMPLETE else " so far"
    target = p["target_epsilon"]
    within = ""
    if target is not None:
        within = (
            f", within the target of {format_epsilon(target)} set before training"
            if eps <= target
            else f", ABOVE the target of {format_epsilon(target)} set before training"
        )
    spent: Inline = (
        Span("How much:", "strong"),
        f" epsilon {format_epsilon(eps)} at delta {format_delta(p['delta'])}{so_far}, after "
        f"{plural('noisy training step', p['steps'])}{within} ({acc.upper()} accountant, which "
        "planned this run). In words: whatever an attacker knew before, everything this run "
        f"publishes changes their odds of guessing whether any one {head} was in the training "
        f"set by at most a factor of e^epsilon = {epsilon_odds(eps)}, except with probability "
        "delta. A smaller epsilon means stronger protection.",
    )
    if (p.get("randomness") or {}).get("source") == "seeded":
        against = (
            " Against what: nothing. The noise and the sampling were seeded from a seed this "
            "report publishes, so anyone can replay them and subtract the noise."
        )
        spent = (
            Span("How much:", "strong"),
            " no guarantee. With secret randomness the same mechanism would have spent epsilon "
            f"{format_epsilon(eps)} at delta {format_delta(p['delta'])}.",
        )
    return Box(
        "In plain words",
        [
            (Span(verdict[0], "strong"), " " + verdict[1]),
            (Span("Who is protected:", "strong"), " " + who + against),
            spent,
            (
                Span("Not covered", "strong"),
                ' (in full under "What the guarantee does not cover"):',
            ),
            _not_covered_short(report),
            _in_house(report),
        ],
        kind,
    )


def summary_section(report: Mapping[str, Any]) -> list[Block]:
    """The summary table: status, guarantee, method, preconditioner, unit, steps, task."""
    p, task, data, model = report["privacy"], report["task"], report["data"], report["model"]
    status = {RunStatus.COMPLETE: "complete", RunStatus.INCOMPLETE: "INCOMPLETE (interrupted)"}
    names = f" ({', '.join(task['label_names'])})" if task["label_names"] else ""
    guarantee: Inline = guarantee_sentence(report)
    if not p["private"]:
        guarantee = (
            Span(NO_GUARANTEE, "strong"),
            ": " + NONPRIVATE_NOTE.format(units=plural(unit_head(data["privacy_unit"]))),
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
    """The guarantee: its text, relation, delta, the stated epsilon, then the other accountants.

    The stated epsilon is the planning accountant's, next to the target it was planned for; the
    other accountants' bounds on the same mechanism follow under their own heading, labelled as
    such (a looser bound is not a second cost, and is never set beside the target).
    """
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
        acc = p["accountant"]
        rows.append(("delta", format_delta(p["delta"])))
        rows.append(
            (
                f"epsilon, stated ({ACCOUNTANT_NAMES[acc]}, which planned this run)",
                format_epsilon(p["epsilon"][acc]),
            )
        )
        rows.append(("Target epsilon (the plan's)", format_epsilon(p["target_epsilon"])))
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
    if p["private"] and (p.get("randomness") or {}).get("source") != "seeded":
        out += [
            Heading(3, "Other accountants: bounds on the same mechanism"),
            Paragraph(
                "Every accountant bounds the epsilon of the one mechanism that ran (the same "
                "steps, noise and sampling); they differ only in how tight the bound is. The "
                f"guarantee is stated by the {p['accountant'].upper()} accountant, which set "
                "the noise for the target; a larger figure below is a looser bound on the same "
                "mechanism, not more privacy spent. They are computed from the same ledger as a "
                "check of the stated figure."
            ),
            Table(
                ("Accountant", "epsilon", "Reading"),
                [(name, value, reading) for name, value, reading in other_accountants(report)],
            ),
        ]
    return out


def not_covered_section(report: Mapping[str, Any]) -> list[Block]:
    """What the guarantee does not cover, grouped (each item once), and the plans."""
    p = report["privacy"]
    out: list[Block] = [Heading(2, "What the guarantee does not cover")]
    for title, items in not_covered_groups(report):
        out += [Paragraph(Span(title, "strong")), BulletList([full for _, full in items])]
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


def in_house_section(report: Mapping[str, Any]) -> list[Block]:
    """What to keep in-house: the custodian folder, and each thing this run keeps there once."""
    cust = report.get("custodian") or {}
    out: list[Block] = [Heading(2, "What to keep in-house")]
    if cust.get("note"):
        out.append(Banner("Custodian only", cust["note"], "note"))
    else:
        out.append(
            Paragraph(
                f"Everything under {PRIVATE_DIR}/ is computed from the private records without "
                "noise and must not leave the data custodian."
            )
        )
    rows = [
        (what, tuple(_joined([Span(f) for f in fields]))) for what, fields in kept_in_house(report)
    ]
    if rows:
        out.append(Table(("Kept in the custodian report", "Report fields"), rows))
    return out


def _joined(spans: list[Span]) -> list[str | Span]:
    out: list[str | Span] = []
    for i, span in enumerate(spans):
        out += [", ", span] if i else [span]
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
            "expected; one above it would show a broken mechanism. The audit's power is the "
            "bound one simulated run of the same plan with 10x too little noise reaches, and "
            "how many wrong guesses its refutation survives: an audit that could not refute "
            "that mechanism says so in its verdict."
        ),
        kv_table(rows),
    ]
