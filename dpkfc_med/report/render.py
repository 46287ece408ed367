"""Human-readable views of a privacy report: Markdown and self-contained HTML.

Both views are rendered from one document model (:func:`build_document`: headings, paragraphs,
bullet lists, banners, tables, images, code), so the Markdown and the HTML always say the same
thing. The text is written for a data-protection officer: the summary states the guarantee in
one sentence, what is not covered follows it, and every figure is traceable to the JSON report
next to it.

Epsilon is always printed rounded *up* to three decimals (:func:`format_epsilon`): a printed
figure must never understate the privacy spent.
"""

from __future__ import annotations

import base64
import html
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from dpkfc_med.methods import Method
from dpkfc_med.report.custodian import not_covered_summary
from dpkfc_med.report.numbers import format_delta, format_epsilon
from dpkfc_med.report.plots import PLOT_FILES
from dpkfc_med.report.schema import ACCOUNTANTS, COVERAGE_COLUMNS
from dpkfc_med.report.wording import NO_GUARANTEE, NOT_VALID, PRIVATE_PRECONDITIONER

__all__ = [
    "DIAGNOSTICS_NOTE",
    "INCOMPLETE_NOTE",
    "NONPRIVATE_NOTE",
    "audit_sentence",
    "build_custodian_document",
    "build_document",
    "render_custodian_markdown",
    "render_html",
    "render_markdown",
]

INCOMPLETE_NOTE = (
    "the figures below cover the steps taken before the interruption; the privacy spent is as "
    "stated"
)
FAILED_NOTE = (
    "the run ended with an error; the figures below cover the steps taken before it; the "
    "privacy spent is as stated"
)
NONPRIVATE_NOTE = (
    "this model was trained without differential privacy (no clipping, no noise); it may "
    "reveal information about individual training {units} and must be handled as the private "
    "data itself"
)
DIAGNOSTICS_NOTE = (
    "computed from un-noised private statistics; not covered by the privacy guarantee; for the "
    "data custodian only"
)

_ACCOUNTANTS = {
    "prv": "PRV (Opacus; Gopi et al. 2021)",
    "rdp": "RDP (Opacus; Mironov 2017)",
    "pld": "PLD (Google dp_accounting; independent implementation)",
}
_MAX_ROWS = 20  # long tables (refreshes, ledger events) show their first and last rows


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _fmt(value: Any) -> str:
    """Display form of a plain JSON value, on one line and never as JSON.

    Lists read ``"28, 28"`` (``"none"`` when empty), mappings ``"mode: clamp; low: 0"``; table
    cells lay nested values out one item a line instead (:func:`_cell`).
    """
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        return "; ".join(f"{k}: {_fmt(v)}" for k, v in value.items()) or "none"
    if isinstance(value, (list, tuple)):
        inner = [_fmt(v) if _is_scalar(v) else f"({_fmt(v)})" for v in value]
        return ", ".join(inner) or "none"
    return str(value)


def _count(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else _fmt(value)


# --------------------------------------------------------------------------- document model
@dataclass(frozen=True)
class Span:
    """Inline text with a style: ``"code"`` (hashes, paths), ``"strong"`` or ``"em"``."""

    text: str
    style: Literal["code", "strong", "em"] = "code"


@dataclass(frozen=True)
class Lines:
    """Inline items laid out one a line: a nested mapping or list inside a table cell.

    HTML shows a small unmarked list; a Markdown table cell, which cannot hold a line break,
    joins the items with ``"; "``.
    """

    items: tuple[Inline, ...]


Inline = str | Span | Lines | tuple["str | Span | Lines", ...]
"""Inline content: plain text, one styled span, lines of items, or a run of them (a tuple)."""


@dataclass(frozen=True)
class Heading:
    """A section heading (level 1 is the title)."""

    level: int
    text: str


@dataclass(frozen=True)
class Paragraph:
    """A paragraph of inline text."""

    content: Inline


@dataclass(frozen=True)
class BulletList:
    """An unordered list: ``<ul><li>`` in HTML, ``- item`` lines in Markdown."""

    items: Sequence[Inline]


@dataclass(frozen=True)
class Banner:
    """A boxed statement that must not be missed (``kind`` sets its colour in HTML)."""

    title: str
    text: str
    kind: Literal["danger", "warning", "note"] = "warning"


@dataclass(frozen=True)
class Box:
    """The plain-language summary: a title and a few paragraphs, boxed (``kind`` sets colour)."""

    title: str
    paragraphs: Sequence[Inline]
    kind: Literal["ok", "warning", "danger"] = "ok"


@dataclass(frozen=True)
class Table:
    """A table; ``header`` may be empty for a plain key-value box."""

    header: Sequence[Inline]
    rows: Sequence[Sequence[Inline]]


@dataclass(frozen=True)
class Image:
    """A report figure, by its key in :data:`~dpkfc_med.report.plots.PLOT_FILES`."""

    key: str
    caption: str


@dataclass(frozen=True)
class Code:
    """A pre-formatted block (the run configuration).

    ``summary``, when given, folds the block in HTML behind that line (``<details>``); Markdown
    always shows it as a fenced block.
    """

    text: str
    language: str = ""
    summary: str = ""


Block = Heading | Paragraph | BulletList | Banner | Box | Table | Image | Code


def _cell(value: Any) -> Inline:
    """Table-cell form of a JSON value: nested mappings one ``key: value`` a line.

    Scalars and lists of scalars stay on one line (:func:`_fmt`: ``"28, 28"``); a mapping, or a
    list holding mappings or lists, becomes :class:`Lines`, nested as deep as the value.
    """
    if isinstance(value, (Span, Lines, tuple)):
        return value
    if isinstance(value, Mapping) and value:
        return Lines(tuple(_labelled(f"{k}: ", _cell(v)) for k, v in value.items()))
    if isinstance(value, list) and not all(_is_scalar(v) for v in value):
        if len(value) == 1:  # one record: its lines, without a level of nesting
            return _cell(value[0])
        return Lines(tuple(_cell(v) for v in value))
    return _fmt(value)


def _labelled(label: str, content: Inline) -> Inline:
    return (label, *content) if isinstance(content, tuple) else (label, content)


def _kv(rows: Sequence[tuple[Inline, Any]]) -> Table:
    return Table(("Item", "Value"), [(k, _cell(v)) for k, v in rows])


def _mapping_table(mapping: Mapping[str, Any], key_name: str = "Item") -> Table:
    return Table((key_name, "Value"), [(str(k), _cell(v)) for k, v in mapping.items()])


def _records_table(records: Sequence[Mapping[str, Any]], columns: Sequence[str] = ()) -> Table:
    """Rows of dicts as a table; the columns are ``columns`` then any other keys, in order."""
    cols = list(columns)
    for record in records:
        cols += [k for k in record if k not in cols]
    rows: list[list[Inline]] = [[_cell(r.get(c)) for c in cols] for r in records]
    if len(rows) > _MAX_ROWS:
        half = _MAX_ROWS // 2
        gap = Span(f"... {len(rows) - 2 * half} more rows in the JSON report", "em")
        rows = [*rows[:half], [gap, *[""] * (len(cols) - 1)], *rows[-half:]]
    return Table(cols, rows)


def _is_records(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, Mapping) for v in value)


def _nested_blocks(values: Mapping[str, Any], label_names: Sequence[str] | None) -> list[Block]:
    """Scalars in one table, then one titled table per nested dict / matrix / record list."""
    blocks: list[Block] = []
    scalars = {k: v for k, v in values.items() if not isinstance(v, (Mapping, list))}
    if scalars:
        blocks.append(_mapping_table(scalars, "Name"))
    for key, value in values.items():
        if isinstance(value, Mapping):
            blocks.append(Paragraph(Span(key.replace("_", " "), "strong")))
            if value and all(isinstance(v, Mapping) for v in value.values()):
                # "per_class" -> a "class" column; other nested tables get a "name" column.
                first = key[4:] if key.startswith("per_") else "name"
                records = [{first: k, **v} for k, v in value.items()]
                blocks.append(_records_table(records))
            else:
                blocks.append(_mapping_table(value, "Name"))
        elif key == "confusion_matrix" and isinstance(value, list):
            blocks.append(
                Paragraph(Span("confusion matrix (rows: true class, columns: predicted)", "strong"))
            )
            names = list(label_names or [])
            if len(names) != len(value):
                names = [str(i) for i in range(len(value))]
            rows: list[list[Inline]] = [
                [Span(n, "strong"), *[_fmt(x) for x in row]] for n, row in zip(names, value)
            ]
            blocks.append(Table(["true \\ predicted", *names], rows))
        elif _is_records(value):
            blocks.append(Paragraph(Span(key.replace("_", " "), "strong")))
            blocks.append(_records_table(value))
        elif isinstance(value, list):
            names = list(label_names or [])
            if names and len(names) == len(value):
                blocks.append(Paragraph(Span(key.replace("_", " "), "strong")))
                blocks.append(
                    Table(("Class", "Value"), [(n, _fmt(v)) for n, v in zip(names, value)])
                )
            else:
                blocks.append(Paragraph((Span(key.replace("_", " "), "strong"), ": ", _fmt(value))))
    return blocks


# --------------------------------------------------------------------------- statements
def guarantee_sentence(report: Mapping[str, Any]) -> str:
    """The one-sentence (epsilon, delta) statement of the summary box."""
    p, unit = report["privacy"], report["data"]["privacy_unit"]
    if not p["private"]:
        return f"{NO_GUARANTEE}: " + NONPRIVATE_NOTE.format(units=plural(unit))
    if (p.get("randomness") or {}).get("source") == "seeded":
        return str(p["guarantee"])  # no (epsilon, delta) claim: the noise can be replayed
    eps, primary = p["epsilon"], p["accountant"]
    checks = []
    for name in ACCOUNTANTS:
        if name != primary:
            prefix = "independent " if name == "pld" else ""
            checks.append(f"{prefix}{name.upper()} cross-check: {format_epsilon(eps[name])}")
    return (
        f"(epsilon, delta) = ({format_epsilon(eps[primary])}, {format_delta(p['delta'])}) for the "
        f"add/remove-one-{unit} relation, Poisson sampling at rate {q_text(report)}, "
        f"{primary.upper()} accountant ({', '.join(checks)})"
    )


def _seeds(refreshes: Sequence[Mapping[str, Any]]) -> str:
    seeds = [r["probe_seed"] for r in refreshes]
    if not seeds:
        return "no probe seeds recorded"
    if len(seeds) == 1:
        return f"seed {seeds[0]}"
    if seeds == list(range(seeds[0], seeds[0] + len(seeds))):
        return f"seeds {seeds[0]}-{seeds[-1]}"
    shown = ", ".join(map(str, seeds[:6])) + (", ..." if len(seeds) > 6 else "")
    return f"seeds {shown}"


def probe_summary(pre: Mapping[str, Any]) -> str:
    """``"<generator>, <noise>, exponent ..., preset ..., seeds ..."`` from the provenance."""
    src = pre["probe_source"]
    parts = [str(src.get("source", "probe source"))]
    kind = src.get("kind")
    if kind in ("pink", "white"):
        parts.append(f"{kind} noise")
    elif kind is not None:
        parts.append(str(kind))
    if src.get("alpha") is not None:
        parts.append(f"exponent alpha = {_fmt(src['alpha'])}")
    if src.get("zipf_exponent") is not None:
        parts.append(f"Zipf exponent {_fmt(src['zipf_exponent'])}")
    if src.get("preset") is not None:
        parts.append(f"preset {src['preset']}")
    parts.append(_seeds(pre["refreshes"]))
    return ", ".join(parts)


_FAMILY_TEXT = {
    "shampoo": "a Shampoo preconditioner (left and right factors of probe per-sample gradients)",
    "diagonal": "a diagonal preconditioner (the second moment of probe per-sample gradients)",
}


def method_text(report: Mapping[str, Any]) -> str:
    """The method in one sentence, naming the preconditioner family when it is not K-FAC."""
    p, pre = report["privacy"], report.get("preconditioner")
    text = Method(p["method"]).description.format(unit=report["data"]["privacy_unit"])
    family = ((pre or {}).get("config") or {}).get("family", "kfac")
    if family in _FAMILY_TEXT:
        text = text.replace("a KFAC curvature estimate", _FAMILY_TEXT[family])
    return text


def _short_digest(sha: Any) -> str:
    """The first 12 hex digits of a digest (or of each file's digest in a mapping)."""
    if isinstance(sha, Mapping):
        return ", ".join(f"{k}: {str(v)[:12]}" for k, v in sha.items())
    return str(sha)[:12]


def preconditioner_statement(report: Mapping[str, Any]) -> str:
    """Whether private data went into the preconditioner, in one line."""
    pre = report["preconditioner"]
    if pre is None:
        return "Not applicable: no preconditioner"
    ext = pre["external_data"]
    if ext is not None:  # named by its digest: its path stays in the custodian report
        name = ext.get("path") or f"(SHA-256 {_short_digest(ext.get('sha256'))})"
        if pre["uses_private_data"]:
            return (
                f"YES: the public proxy {name} overlaps the private training set (allowed by "
                "probes.allow_public_overlap); NOT covered by the guarantee"
            )
        return f"No private data; external public data {name}"
    return f"No: built from synthetic probes only ({probe_summary(pre)})"


def _headline_metrics(report: Mapping[str, Any]) -> str:
    for split in ("test", "val"):
        values = (report.get("metrics") or {}).get(split)
        if isinstance(values, Mapping):
            scalars = [
                f"{k} {_fmt(v)}"
                for k, v in values.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "n"
            ]
            if scalars:
                return f"{split}: " + ", ".join(scalars[:4])
    return "not evaluated"


# --------------------------------------------------------------------------- sections
def build_document(report: Mapping[str, Any]) -> list[Block]:
    """The report as a list of blocks, in reading order.

    Args:
        report: A valid report, as plain JSON data (see :func:`~dpkfc_med.report.to_json_data`).

    Returns:
        Headings, paragraphs, banners, tables, images and code blocks.
    """
    run, p = report["run"], report["privacy"]
    unit = report["data"]["privacy_unit"]
    doc: list[Block] = [Heading(1, f"Privacy report: {run['name']}")]
    if report["status"] == "incomplete":
        doc.append(Banner("INCOMPLETE RUN", INCOMPLETE_NOTE, "warning"))
    elif report["status"] == "failed":
        doc.append(Banner("FAILED RUN", FAILED_NOTE, "warning"))
    if not p["private"]:
        doc.append(Banner(NO_GUARANTEE, NONPRIVATE_NOTE.format(units=plural(unit)), "danger"))
    for text in p.get("headline_warnings") or []:
        title = next(
            (t for t in (NOT_VALID, PRIVATE_PRECONDITIONER) if text.startswith(t)),
            "Warning",
        )
        doc.append(Banner(title, text, "danger"))
    doc += headline(report)
    doc.append(plain_summary(report))
    doc += _summary(report)
    doc += _guarantee(report)
    # What a data-protection officer needs comes first; the technical detail follows.
    doc += _not_covered(report)
    doc += _audit(report)
    doc += _mechanism(report)
    doc += _preconditioner(report)
    doc += _data(report)
    doc += _model(report)
    doc += _curves(report)
    doc += [Heading(2, "Hyperparameter tuning"), Paragraph(p["hyperparameter_tuning"])]
    doc += _reproducibility(report)
    return doc


def headline(report: Mapping[str, Any]) -> list[Block]:
    """The verdict line that opens the report, and the other accountants on a neutral line.

    The verdict states the primary accountant's epsilon and what it is; the looser bounds of
    the cross-check accountants are information, not a warning (a run calibrated to PRV always
    has a larger RDP bound).
    """
    p = report["privacy"]
    if not p["private"]:
        return []  # the no-guarantee banner (NO_GUARANTEE) is the verdict
    verdict, _ = _release_verdict(report)
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
    verdict, kind = _release_verdict(report)
    return Box(
        "In plain words",
        [who, against, spent, not_covered, (Span(verdict[0], "strong"), " " + verdict[1])],
        kind,
    )


def _release_verdict(
    report: Mapping[str, Any],
) -> tuple[tuple[str, str], Literal["ok", "warning", "danger"]]:
    """Whether the run is a valid DP release, as ``((headline, reason), box kind)``."""
    p = report["privacy"]
    if (p.get("randomness") or {}).get("source") == "seeded":
        return (
            (
                "Valid DP release: no.",
                "The noise was generated from a seed this report publishes "
                "(privacy.reproducible_noise: true), so it can be replayed: research use only.",
            ),
            "danger",
        )
    if (report.get("preconditioner") or {}).get("uses_private_data"):
        return (
            (
                "Valid DP release: no.",
                "The preconditioner was built partly from private training images "
                "(probes.allow_public_overlap: true), which the guarantee does not cover.",
            ),
            "danger",
        )
    target, eps = p.get("target_epsilon"), p["epsilon"][p["accountant"]]
    if target is not None and eps > target:
        return (
            (
                "Valid DP release: not at the target.",
                f"The run spent epsilon {format_epsilon(eps)}, more than its target "
                f"{format_epsilon(target)}; only the spent figure holds.",
            ),
            "danger",
        )
    if report["status"] != "complete":
        return (
            (
                "Valid DP release: not yet.",
                "The run stopped before its planned steps; the privacy spent so far is as "
                "stated, but the run is incomplete: continue it with --resume before releasing "
                "its model.",
            ),
            "warning",
        )
    return (
        (
            "Valid DP release: yes,",
            "at the (epsilon, delta) above, for the released model and everything this run "
            "publishes, provided the items that are not covered are handled as described.",
        ),
        "ok",
    )


def audit_sentence(report: Mapping[str, Any]) -> str | None:
    """The empirical audit's lower bound next to the accounted epsilon, or ``None``."""
    audit = report.get("audit")
    if not isinstance(audit, Mapping):
        return None
    return (
        f"empirical lower bound {format_epsilon(audit['epsilon_lower_bound'])} against the "
        f"accounted {format_epsilon(audit['epsilon_accounted'])} (one-run canary audit, "
        f"{plural('canary', audit['canaries'])}, confidence {audit['confidence']:g})"
    )


def _audit(report: Mapping[str, Any]) -> list[Block]:
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
        _kv(rows),
    ]


def _not_covered(report: Mapping[str, Any]) -> list[Block]:
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
        out.append(_records_table(records))
    return out


def _plural_word(word: str) -> str:
    if word.endswith("s"):
        return word
    if len(word) > 1 and word.endswith("y") and word[-2] not in "aeiou":
        return word[:-1] + "ies"  # canary -> canaries
    return word + "s"


def _steps_text(p: Mapping[str, Any]) -> str:
    planned = f" of {p['planned_steps']} planned" if p["planned_steps"] is not None else ""
    return f"{p['steps']}{planned} ({plural('epoch', float(p['epochs']))})"


def plural(noun: str, count: float | None = None) -> str:
    """A noun phrase in the plural, or ``"<count> <noun>"`` in the number that agrees with it.

    Only the head of the phrase is inflected: the part before ``" ("``, each ``/``-separated
    word of it. Examples: ``plural("image (MedMNIST)") == "images (MedMNIST)"``,
    ``plural("patient/volume") == "patients/volumes"``, ``plural("epoch", 1) == "1 epoch"``,
    ``plural("step", 2) == "2 steps"``, ``plural("epoch", 0.5) == "0.5 epochs"``,
    ``plural("canary", 3) == "3 canaries"``.

    Args:
        noun: The singular phrase.
        count: When given, the count to print before it (integers in full, other numbers to
            three significant digits); the phrase is singular exactly when the count prints
            as ``1``.
    """
    head, sep, tail = noun.partition(" (")
    many = "/".join(_plural_word(w) for w in head.split("/")) + sep + tail
    if count is None:
        return many
    text = str(count) if isinstance(count, int) else f"{count:.3g}"
    return f"{text} {noun if text == '1' else many}"


def _summary(report: Mapping[str, Any]) -> list[Block]:
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
            f"set, at most {_samples(data['max_samples_per_unit'])} each)",
        ),
        ("Steps", _steps_text(p)),
        ("Task", f"{task['kind']}, {task['spatial_dims']}D, {task['num_classes']} classes{names}"),
        ("Model", f"{model['name']} ({_count(model['num_params'])} parameters)"),
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
    return [Heading(2, "Summary"), _kv(rows)]


def _guarantee(report: Mapping[str, Any]) -> list[Block]:
    p, data = report["privacy"], report["data"]
    out: list[Block] = [Heading(2, "Privacy guarantee"), Paragraph(p["guarantee"])]
    rows: list[tuple[Inline, Any]] = [
        ("Neighbouring relation", p["neighbouring_relation"]),
        (
            "Privacy unit",
            f"{data['privacy_unit']} (at most {_samples(data['max_samples_per_unit'])} per unit)",
        ),
    ]
    if p["private"]:
        eps = p["epsilon"]
        rows.append(("delta", format_delta(p["delta"])))
        for name in ACCOUNTANTS:
            role = "primary" if name == p["accountant"] else "cross-check"
            rows.append((f"epsilon, {_ACCOUNTANTS[name]} [{role}]", format_epsilon(eps[name])))
        rows.append(("epsilon, most conservative of the three", format_epsilon(eps["max"])))
        rows.append(("Target epsilon", format_epsilon(p["target_epsilon"])))
    rows += [
        ("Sampling", _sampling(report)),
        ("Noise and sampling randomness", _randomness(p)),
    ]
    out.append(_kv(rows))
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


def _randomness(p: Mapping[str, Any]) -> str:
    source = (p.get("randomness") or {}).get("source")
    if source == "os-csprng":
        return "every draw from the OS CSPRNG (secure_rng = true), floating-point hardened"
    if source == "os-entropy":
        return (
            "PyTorch's generator seeded from OS entropy; the seed is never written anywhere, so "
            "nothing published lets anyone replay the noise (the guarantee assumes ideal "
            "randomness)"
        )
    if source == "seeded":
        return (
            "SEEDED from the published training seed (reproducible_noise = true): the noise can "
            "be replayed; NOT a valid DP release"
        )
    return "n/a"


def _samples(n: int | None) -> str:
    if n is None:  # patient units: the most images one patient has is a private statistic
        return "any number of samples"
    return plural("sample", n)


def q_text(report: Mapping[str, Any]) -> str:
    """The sample rate with its one definition, e.g. ``"q = 1/ceil(N/B) = 1/19 = 0.0526316"``.

    ``q = 1/ceil(N/B)`` (``N`` training units, ``B`` = ``training.batch_size``): the number of
    batches of an epoch is ``ceil(N/B)`` and each unit joins each batch with probability ``q``,
    so the expected batch is ``q N`` (:func:`expected_batch_text`), not ``B``.
    """
    p = report["privacy"]
    if p["sample_rate"] is None:
        return "n/a"
    q = f"{p['sample_rate']:.6g}"
    if p.get("steps_per_epoch") is None:  # a report from before these fields were recorded
        return f"q = {q}"
    return f"q = 1/ceil(N/B) = 1/{p['steps_per_epoch']} = {q}"


def expected_batch_text(report: Mapping[str, Any]) -> str:
    """The expected batch with its definition, e.g. ``"248 (q N = 247.79, rounded)"``."""
    p, n = report["privacy"], report["data"]["num_train_units"]
    if p["expected_batch_size"] is None:
        return "n/a"
    if p["sample_rate"] is None or not isinstance(n, int):
        return str(p["expected_batch_size"])
    mean = p["sample_rate"] * n
    if abs(mean - round(mean)) < 1e-9:
        return f"{p['expected_batch_size']} (q N)"
    return f"{p['expected_batch_size']} (q N = {mean:.5g}, rounded)"


def _sampling(report: Mapping[str, Any]) -> str:
    p = report["privacy"]
    if p["sampler"] is None:
        return "n/a"
    sizes = ""
    if p.get("batch_size") is not None:
        sizes = (
            f", N = {report['data']['num_train_units']} units, B = {p['batch_size']} "
            "(training.batch_size)"
        )
    return (
        f"{p['sampler'].capitalize()} sampling: each unit joins each batch independently "
        f"with probability {q_text(report)}{sizes}; expected batch size "
        f"{expected_batch_text(report)}"
    )


def _mechanism(report: Mapping[str, Any]) -> list[Block]:
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
    out: list[Block] = [Heading(2, "Mechanism parameters"), _kv(rows)]
    out += [Heading(3, "Privacy ledger"), *_ledger(p["ledger"])]
    return out


def _ledger(ledger: Mapping[str, Any]) -> list[Block]:
    if not ledger:
        return [Paragraph("The ledger is empty.")]
    out: list[Block] = []
    rows = [
        (k, format_delta(v) if k == "delta" else _cell(v))
        for k, v in ledger.items()
        if not _is_records(v)
    ]
    if rows:
        out.append(Table(("Item", "Value"), rows))
    for key, value in ledger.items():
        if _is_records(value):
            out += [Paragraph(Span(key, "strong")), _records_table(value)]
    return out


def _preconditioner(report: Mapping[str, Any]) -> list[Block]:
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
        digest: Inline = Span(sha) if isinstance(sha, str) else _fmt(sha)
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
    out.append(_kv(rows))
    out += [Heading(3, "Probe source"), _mapping_table(pre["probe_source"])]
    out += [Heading(3, "Refreshes")]
    if pre["refreshes"]:
        out.append(_records_table(pre["refreshes"], ("step", "probe_seed", "seconds", "scale")))
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
        out.append(_records_table(pre["coverage"], COVERAGE_COLUMNS))
    elif pre["covered_layers"]:
        out.append(Table(("Layer",), [(Span(name),) for name in pre["covered_layers"]]))
    else:
        out.append(Paragraph("No layer is covered (the preconditioner is the identity)."))
    out += [Heading(3, "Preconditioner settings"), _mapping_table(pre["config"], "Setting")]
    fallbacks = pre.get("eig_fallbacks") or []
    if fallbacks:
        out += [
            Heading(3, "Eigendecomposition fallbacks"),
            Paragraph(
                "These factors' eigendecompositions failed in the configured precision and were "
                "retried as listed (probe-only computations: no effect on the guarantee)."
            ),
            _records_table(fallbacks, ("refresh_step", "layer", "factor", "used")),
        ]
    return out


def _data(report: Mapping[str, Any]) -> list[Block]:
    data = report["data"]
    rows: list[tuple[Inline, Any]] = [
        ("Path", Span(data["path"]) if data.get("path") else "in the custodian report"),
        ("Privacy unit", data["privacy_unit"]),
        ("Units in the training set", data["num_train_units"]),
        ("Maximum samples per unit", data["max_samples_per_unit"]),
    ]
    out: list[Block] = [Heading(2, "Data"), _kv(rows)]
    out += [
        Heading(3, "Splits"),
        Table(("Split", "Samples"), [(k, _fmt(v)) for k, v in data["splits"].items()]),
        Paragraph(
            "The data's fingerprint, class counts and case split are in the custodian report: "
            "a fingerprint would let anyone test whether a given dataset is the training set."
        ),
    ]
    return out


def _model(report: Mapping[str, Any]) -> list[Block]:
    model = report["model"]
    out: list[Block] = [
        Heading(2, "Model"),
        _kv(
            [
                ("Network", model["name"]),
                ("Parameters", _count(model["num_params"])),
                *(
                    [
                        ("Trained privately", _count(model["trainable_params"])),
                        ("Frozen", _count(model.get("frozen_params") or 0)),
                        ("Fine-tuning", model.get("finetune") or "full"),
                    ]
                    if "trainable_params" in model
                    else []
                ),
            ]
        ),
        Heading(3, "Fixes applied for per-sample privacy"),
    ]
    if model["fixes"]:
        out.append(_records_table(model["fixes"], ("path", "before", "after", "reason")))
    else:
        out.append(Paragraph("None were needed."))
    return out


def _results(report: Mapping[str, Any]) -> list[Block]:
    out: list[Block] = [Heading(2, "Results")]
    labels = (report.get("task") or {}).get("label_names")
    for split, title in (("val", "Validation"), ("test", "Test")):
        values = (report.get("metrics") or {}).get(split)
        out.append(Heading(3, title))
        if not values:
            out.append(Paragraph("Not evaluated."))
        else:
            out += _nested_blocks(values, labels)
    return out


def _curves(report: Mapping[str, Any]) -> list[Block]:
    out: list[Block] = [Heading(2, "Training settings and privacy spent")]
    if report["training"]:
        out.append(_mapping_table(report["training"], "Setting"))
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
            " The RDP accountant's epsilon, an upper bound that is cheap to compute, is given "
            "after every step (history.epsilon_rdp in the JSON report; the grey line of the "
            "figure) and is what the progress bar shows during training."
        )
    records = []
    for step, value in zip(listed, values):
        row: dict[str, Any] = {"step": step, f"epsilon ({acc.upper()})": format_epsilon(value)}
        if acc != "rdp" and rdp_at:
            row["epsilon (RDP upper bound)"] = format_epsilon(rdp_at.get(step))
        records.append(row)
    return [Heading(3, "Epsilon history"), Paragraph(text), _records_table(records)]


def _diagnostics(report: Mapping[str, Any]) -> list[Block]:
    out: list[Block] = [Heading(2, "Diagnostics"), Banner("Note", DIAGNOSTICS_NOTE, "note")]
    diagnostics = report.get("diagnostics")
    if not diagnostics:
        return [*out, Paragraph("No diagnostics were recorded.")]
    return out + _nested_blocks(diagnostics, None)


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
        doc.append(_mapping_table(training, "Setting"))
    doc += _diagnostics(custodian)
    data = custodian.get("data") or {}
    doc.append(Heading(2, "Private data"))
    if data.get("sha256"):
        doc.append(
            Table(("File", "SHA-256"), [(Span(f), Span(h)) for f, h in data["sha256"].items()])
        )
    for key in ("class_counts", "units"):
        if data.get(key):
            doc += _nested_blocks({key: data[key]}, None)
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


def render_custodian_markdown(custodian: Mapping[str, Any]) -> str:
    """The custodian report as Markdown (figures linked as ``plots/<name>.png`` beside it)."""
    return "\n\n".join(_md_block(b) for b in build_custodian_document(custodian)) + "\n"


def _reproducibility(report: Mapping[str, Any]) -> list[Block]:
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
        _kv(rows),
        Heading(3, "Package versions"),
        Table(("Package", "Version"), [(k, _fmt(v)) for k, v in env["packages"].items()]),
        Heading(3, "Run configuration"),
        _config_code(run["config"]),
    ]


def _config_code(config: Any) -> Code:
    text = json.dumps(config, indent=2)
    lines = text.count("\n") + 1
    return Code(text, "json", f"Show the run configuration (JSON, {plural('line', lines)})")


# --------------------------------------------------------------------------- Markdown
def _md_inline(content: Inline, cell: bool = False, nested: bool = False) -> str:
    if isinstance(content, str):
        text = content.replace("|", "\\|").replace("\n", " ") if cell else content
        return text
    if isinstance(content, Span):
        if content.style == "code":
            fence = "``" if "`" in content.text else "`"
            return f"{fence}{content.text}{fence}"
        mark = "**" if content.style == "strong" else "*"
        return f"{mark}{_md_inline(content.text, cell)}{mark}"
    if isinstance(content, Lines):
        # One line of text: "; " between items, a nested level in brackets.
        text = "; ".join(_md_inline(item, cell, nested=True) for item in content.items)
        return f"({text})" if nested else text
    return "".join(_md_inline(part, cell, nested) for part in content)


def _md_block(block: Block) -> str:
    if isinstance(block, Heading):
        return f"{'#' * block.level} {block.text}"
    if isinstance(block, Paragraph):
        return _md_inline(block.content)
    if isinstance(block, BulletList):
        return "\n".join(f"- {_md_inline(item)}" for item in block.items)
    if isinstance(block, Banner):
        return f"> **{block.title}:** {block.text}"
    if isinstance(block, Box):
        paragraphs = [f"> {_md_inline(par)}" for par in block.paragraphs]
        return f"> ### {block.title}\n>\n" + "\n>\n".join(paragraphs)
    if isinstance(block, Table):
        header = [_md_inline(h, True) for h in block.header] or [""] * len(block.rows[0])
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(_md_inline(c, True) for c in row) + " |" for row in block.rows]
        return "\n".join(lines)
    if isinstance(block, Image):
        return f"![{block.caption}]({PLOT_FILES.get(block.key, f'plots/{block.key}.png')})"
    return f"```{block.language}\n{block.text}\n```"


def render_markdown(report: Mapping[str, Any]) -> str:
    """The report as Markdown; figures are linked as ``plots/<name>.png`` next to it.

    Args:
        report: A valid report as plain JSON data.

    Returns:
        The document, ending in a newline.
    """
    return "\n\n".join(_md_block(b) for b in build_document(report)) + "\n"


# --------------------------------------------------------------------------- HTML
_CSS = """
:root { --ink: #1f2328; --muted: #59636e; --rule: #d1d9e0; --head: #f2f5f8; --zebra: #f8fafc;
        --ok: #1a7f37; --ok-bg: #eef8f0; --warn: #9a6700; --warn-bg: #fff8e5;
        --danger: #b3261e; --danger-bg: #fdeceb; --note: #59636e; --note-bg: #f4f5f7; }
* { box-sizing: border-box; }
html { font-size: 16px; -webkit-text-size-adjust: 100%; }
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial,
         sans-serif;
       color: var(--ink); background: #fff; line-height: 1.55; margin: 0; }
main { max-width: 52rem; margin: 0 auto; padding: 2.5rem 1.25rem 4rem; }
h1 { font-size: 1.9rem; line-height: 1.25; margin: 0 0 1.25rem; }
h2 { font-size: 1.35rem; margin: 2.4rem 0 0.8rem; padding-bottom: 0.3rem;
     border-bottom: 1px solid var(--rule); }
h3 { font-size: 1.08rem; margin: 1.6rem 0 0.5rem; }
p { margin: 0.6rem 0; max-width: 46rem; }
code { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size: 0.86em;
       background: var(--head); padding: 0.05rem 0.3rem; border-radius: 4px;
       overflow-wrap: anywhere; }
pre { background: var(--zebra); border: 1px solid var(--rule); border-radius: 6px;
      padding: 0.9rem 1rem; overflow-x: auto; font-size: 0.85rem; line-height: 1.45; }
pre code { background: none; padding: 0; }
ul { margin: 0.6rem 0; padding-left: 1.5rem; max-width: 46rem; }
li { margin: 0.35rem 0; }
.table-wrap { overflow-x: auto; max-width: 100%; margin: 0.7rem 0 1.2rem; }
table { border-collapse: collapse; width: 100%; font-size: 0.92rem; }
th, td { border: 1px solid var(--rule); padding: 0.4rem 0.65rem; text-align: left;
         vertical-align: top; overflow-wrap: break-word; }
thead th { background: var(--head); font-weight: 600; white-space: nowrap; }
table.wide { font-size: 0.8rem; }
table.wide th, table.wide td { padding: 0.3rem 0.45rem; }
td ul.cell-list { list-style: none; margin: 0; padding: 0; max-width: none; }
td ul.cell-list li { margin: 0; }
td ul.cell-list ul.cell-list { padding-left: 1rem; }
details.code { margin: 0.7rem 0 1.2rem; }
details.code > summary { cursor: pointer; color: var(--muted); font-size: 0.92rem; }
details.code[open] > summary { margin-bottom: 0.4rem; }
tbody tr:nth-child(even) td { background: var(--zebra); }
table.kv td:first-child { width: 34%; font-weight: 600; color: #32383f; }
.summary { border: 1px solid; border-left-width: 6px; border-radius: 8px; padding: 0.4rem 1.3rem;
           margin: 1.2rem 0 2rem; font-size: 1.02rem; }
.summary h2 { border: none; margin: 0.7rem 0 0.4rem; padding: 0; font-size: 1.2rem; }
.summary p { margin: 0.55rem 0; }
.summary-ok { border-color: var(--ok); background: var(--ok-bg); }
.summary-warning { border-color: var(--warn); background: var(--warn-bg); }
.summary-danger { border-color: var(--danger); background: var(--danger-bg); }
.banner { border: 1px solid; border-left-width: 6px; border-radius: 6px; padding: 0.7rem 1rem;
          margin: 1rem 0; }
.banner-danger { border-color: var(--danger); background: var(--danger-bg); }
.banner-warning { border-color: var(--warn); background: var(--warn-bg); }
.banner-note { border-color: var(--note); background: var(--note-bg); }
figure { margin: 1.2rem 0; text-align: center; }
figure img { max-width: 100%; height: auto; border: 1px solid var(--rule); border-radius: 6px; }
figcaption { font-size: 0.88rem; color: var(--muted); margin-top: 0.4rem; }
@media print {
  main { max-width: none; padding: 0; }
  h2 { break-after: avoid; }
  table, figure, .summary, .banner { break-inside: avoid; }
}
"""


_LONG_WORD = re.compile(r"\S{24,}")
_WIDE_TABLE = 7  # columns from which a table is set smaller (the covered layers: 11)


def _breakable(text: str) -> str:
    """Escaped text; long words (layer paths, config keys) may wrap after ``.``, ``_``, ``/``.

    A 3D U-Net's layer names run to 60 characters without a space; without these break points
    they set the width of their table column and push the table past the page.
    """
    return _LONG_WORD.sub(lambda m: re.sub(r"([./_])", r"\1<wbr>", m.group()), html.escape(text))


def _html_inline(content: Inline) -> str:
    if isinstance(content, str):
        return _breakable(content)
    if isinstance(content, Span):
        tag = {"code": "code", "strong": "strong", "em": "em"}[content.style]
        return f"<{tag}>{_breakable(content.text)}</{tag}>"
    if isinstance(content, Lines):
        items = "".join(f"<li>{_html_inline(item)}</li>" for item in content.items)
        return f'<ul class="cell-list">{items}</ul>'
    return "".join(_html_inline(part) for part in content)


def _html_block(block: Block, plots: Mapping[str, bytes]) -> str:
    if isinstance(block, Heading):
        return f"<h{block.level}>{html.escape(block.text)}</h{block.level}>"
    if isinstance(block, Paragraph):
        return f"<p>{_html_inline(block.content)}</p>"
    if isinstance(block, BulletList):
        return "<ul>" + "".join(f"<li>{_html_inline(i)}</li>" for i in block.items) + "</ul>"
    if isinstance(block, Banner):
        return (
            f'<div class="banner banner-{block.kind}"><strong>{html.escape(block.title)}:</strong> '
            f"{html.escape(block.text)}</div>"
        )
    if isinstance(block, Box):
        paragraphs = "".join(f"<p>{_html_inline(par)}</p>" for par in block.paragraphs)
        return (
            f'<section class="summary summary-{block.kind}">'
            f"<h2>{html.escape(block.title)}</h2>{paragraphs}</section>"
        )
    if isinstance(block, Table):
        head = "".join(f"<th>{_html_inline(h)}</th>" for h in block.header)
        body = "".join(
            "<tr>" + "".join(f"<td>{_html_inline(c)}</td>" for c in row) + "</tr>"
            for row in block.rows
        )
        kind = ""
        if len(block.header) == 2:
            kind = ' class="kv"'
        elif len(block.header) >= _WIDE_TABLE:
            kind = ' class="wide"'
        return (
            f'<div class="table-wrap"><table{kind}><thead><tr>{head}</tr></thead>'
            f"<tbody>{body}</tbody></table></div>"
        )
    if isinstance(block, Image):
        caption = html.escape(block.caption)
        png = plots.get(block.key)
        if png is None:
            return f"<p><em>Figure not available: {caption}</em></p>"
        uri = "data:image/png;base64," + base64.b64encode(png).decode("ascii")
        return (
            f'<figure><img src="{uri}" alt="{caption}"><figcaption>{caption}</figcaption></figure>'
        )
    pre = f"<pre><code>{html.escape(block.text)}</code></pre>"
    if block.summary:
        return (
            f'<details class="code"><summary>{html.escape(block.summary)}</summary>{pre}</details>'
        )
    return pre


def render_html(report: Mapping[str, Any], plots: Mapping[str, bytes]) -> str:
    """The report as one self-contained HTML page (figures inlined as base64 data URIs).

    Args:
        report: A valid report as plain JSON data.
        plots: PNG bytes by figure key (``"epsilon"``, ``"training"``), as returned by
            :func:`~dpkfc_med.report.plots.render_plots`; a missing key is noted in the page.

    Returns:
        The HTML document.
    """
    title = html.escape(f"Privacy report: {report['run']['name']}")
    body = "\n".join(_html_block(b, plots) for b in build_document(report))
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{title}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n<main>\n{body}\n"
        "</main>\n</body>\n</html>\n"
    )
