"""The report's document model (headings, paragraphs, tables, ...) and its table builders.

The views (:mod:`~dpkfc_med.report.render`) turn a list of :data:`Block` into Markdown or
HTML; the sections build that list from a report's plain JSON data. A table cell holds a
:data:`Inline`: text, a styled :class:`Span`, a tuple of them, or :class:`Lines` (a nested
value, one item a line).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "Banner",
    "Block",
    "Box",
    "BulletList",
    "Code",
    "Contents",
    "Heading",
    "Image",
    "Inline",
    "Lines",
    "Paragraph",
    "Span",
    "Table",
    "anchor",
    "cell_of",
    "count_text",
    "fmt_value",
    "is_records",
    "kv_table",
    "labelled",
    "mapping_table",
    "nested_blocks",
    "records_table",
]


_MAX_ROWS = 20  # long tables (refreshes, ledger events) show their first and last rows


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def fmt_value(value: Any) -> str:
    """Display form of a plain JSON value, on one line and never as JSON.

    Lists read ``"28, 28"`` (``"none"`` when empty), mappings ``"mode: clamp; low: 0"``; table
    cells lay nested values out one item a line instead (:func:`cell_of`).
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
        return "; ".join(f"{k}: {fmt_value(v)}" for k, v in value.items()) or "none"
    if isinstance(value, (list, tuple)):
        inner = [fmt_value(v) if _is_scalar(v) else f"({fmt_value(v)})" for v in value]
        return ", ".join(inner) or "none"
    return str(value)


def count_text(value: Any) -> str:
    """An integer with thousands separators (``"1,234"``); anything else as :func:`fmt_value`."""
    return (
        f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else fmt_value(value)
    )


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
    """The plain-language summary: a title and a few paragraphs, boxed (``kind`` sets colour).

    A paragraph may be a :class:`BulletList` (the not-covered groups of the first screen).
    """

    title: str
    paragraphs: Sequence[Inline | BulletList]
    kind: Literal["ok", "warning", "danger"] = "ok"


@dataclass(frozen=True)
class Contents:
    """The list of the sections that follow it (its level-2 headings), each a link."""

    titles: Sequence[str]


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


Block = Heading | Paragraph | BulletList | Banner | Box | Contents | Table | Image | Code


def anchor(title: str) -> str:
    """A heading's link target, as GitHub makes it (``"what-to-keep-in-house"``).

    Lower case, punctuation other than ``-`` and ``_`` dropped, spaces as hyphens.
    """
    kept = "".join(c for c in title.lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


def cell_of(value: Any) -> Inline:
    """Table-cell form of a JSON value: nested mappings one ``key: value`` a line.

    Scalars and lists of scalars stay on one line (:func:`fmt_value`: ``"28, 28"``); a mapping, or a
    list holding mappings or lists, becomes :class:`Lines`, nested as deep as the value.
    """
    if isinstance(value, (Span, Lines, tuple)):
        return value
    if isinstance(value, Mapping) and value:
        return Lines(tuple(labelled(f"{k}: ", cell_of(v)) for k, v in value.items()))
    if isinstance(value, list) and not all(_is_scalar(v) for v in value):
        if len(value) == 1:  # one record: its lines, without a level of nesting
            return cell_of(value[0])
        return Lines(tuple(cell_of(v) for v in value))
    return fmt_value(value)


def labelled(label: str, content: Inline) -> Inline:
    """``content`` with ``label`` in front (a tuple of inline parts)."""
    return (label, *content) if isinstance(content, tuple) else (label, content)


def kv_table(rows: Sequence[tuple[Inline, Any]]) -> Table:
    """A two-column ``Item | Value`` table of ``(label, value)`` rows."""
    return Table(("Item", "Value"), [(k, cell_of(v)) for k, v in rows])


def mapping_table(mapping: Mapping[str, Any], key_name: str = "Item") -> Table:
    """A two-column table of a mapping: ``key_name | Value``."""
    return Table((key_name, "Value"), [(str(k), cell_of(v)) for k, v in mapping.items()])


def records_table(records: Sequence[Mapping[str, Any]], columns: Sequence[str] = ()) -> Table:
    """Rows of dicts as a table; the columns are ``columns`` then any other keys, in order."""
    cols = list(columns)
    for record in records:
        cols += [k for k in record if k not in cols]
    rows: list[list[Inline]] = [[cell_of(r.get(c)) for c in cols] for r in records]
    if len(rows) > _MAX_ROWS:
        half = _MAX_ROWS // 2
        gap = Span(f"... {len(rows) - 2 * half} more rows in the JSON report", "em")
        rows = [*rows[:half], [gap, *[""] * (len(cols) - 1)], *rows[-half:]]
    return Table(cols, rows)


def is_records(value: Any) -> bool:
    """Whether ``value`` is a non-empty list of mappings (a table of records)."""
    return isinstance(value, list) and bool(value) and all(isinstance(v, Mapping) for v in value)


def nested_blocks(values: Mapping[str, Any], label_names: Sequence[str] | None) -> list[Block]:
    """Scalars in one table, then one titled table per nested dict / matrix / record list."""
    blocks: list[Block] = []
    scalars = {k: v for k, v in values.items() if not isinstance(v, (Mapping, list))}
    if scalars:
        blocks.append(mapping_table(scalars, "Name"))
    for key, value in values.items():
        if isinstance(value, Mapping):
            blocks.append(Paragraph(Span(key.replace("_", " "), "strong")))
            if value and all(isinstance(v, Mapping) for v in value.values()):
                # "per_class" -> a "class" column; other nested tables get a "name" column.
                first = key[4:] if key.startswith("per_") else "name"
                records = [{first: k, **v} for k, v in value.items()]
                blocks.append(records_table(records))
            else:
                blocks.append(mapping_table(value, "Name"))
        elif key == "confusion_matrix" and isinstance(value, list):
            blocks.append(
                Paragraph(Span("confusion matrix (rows: true class, columns: predicted)", "strong"))
            )
            names = list(label_names or [])
            if len(names) != len(value):
                names = [str(i) for i in range(len(value))]
            rows: list[list[Inline]] = [
                [Span(n, "strong"), *[fmt_value(x) for x in row]] for n, row in zip(names, value)
            ]
            blocks.append(Table(["true \\ predicted", *names], rows))
        elif is_records(value):
            blocks.append(Paragraph(Span(key.replace("_", " "), "strong")))
            blocks.append(records_table(value))
        elif isinstance(value, list):
            names = list(label_names or [])
            if names and len(names) == len(value):
                blocks.append(Paragraph(Span(key.replace("_", " "), "strong")))
                blocks.append(
                    Table(("Class", "Value"), [(n, fmt_value(v)) for n, v in zip(names, value)])
                )
            else:
                blocks.append(
                    Paragraph((Span(key.replace("_", " "), "strong"), ": ", fmt_value(value)))
                )
    return blocks
