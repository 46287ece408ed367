"""Human-readable views of a privacy report: Markdown and self-contained HTML.

Both views are rendered from one document model (:func:`build_document`: headings, paragraphs,
bullet lists, banners, tables, images, code), so the Markdown and the HTML always say the same
thing. The text is written for a data-protection officer: the summary states the guarantee in
one sentence, what is not covered follows it, and every figure is traceable to the JSON report
next to it.

Epsilon is always printed rounded *up* to three decimals
(:func:`~dpkfc_med.report.numbers.format_epsilon`): a printed figure must never understate the
privacy spent.

The document is put together here from the opening sections (:mod:`.summary`), the technical
ones (:mod:`.details`) and the shared sentences (:mod:`.statements`), in the model of
:mod:`.document`.
"""

from __future__ import annotations

import base64
import html
import re
from collections.abc import Mapping
from typing import Any

from dpkfc_med.report.details import (
    build_custodian_document,
    curves_section,
    data_section,
    mechanism_section,
    model_section,
    preconditioner_section,
    reproducibility_section,
)
from dpkfc_med.report.document import (
    Banner,
    Block,
    Box,
    BulletList,
    Contents,
    Heading,
    Image,
    Inline,
    Lines,
    Paragraph,
    Span,
    Table,
    anchor,
)
from dpkfc_med.report.plots import PLOT_FILES
from dpkfc_med.report.statements import (
    DIAGNOSTICS_NOTE,
    INCOMPLETE_NOTE,
    NONPRIVATE_NOTE,
    audit_sentence,
    guarantee_sentence,
    method_text,
    plural,
    unit_head,
)
from dpkfc_med.report.status import RunStatus
from dpkfc_med.report.summary import (
    audit_section,
    guarantee_section,
    in_house_section,
    not_covered_section,
    plain_summary,
    summary_section,
)
from dpkfc_med.report.wording import NO_GUARANTEE, NOT_VALID, PRIVATE_PRECONDITIONER

__all__ = [
    "DIAGNOSTICS_NOTE",
    "INCOMPLETE_NOTE",
    "NONPRIVATE_NOTE",
    "audit_sentence",
    "build_custodian_document",
    "build_document",
    "guarantee_sentence",
    "html_block",
    "markdown_block",
    "method_text",
    "plain_summary",
    "plural",
    "render_custodian_markdown",
    "render_html",
    "render_markdown",
]


def build_document(report: Mapping[str, Any]) -> list[Block]:
    """The report as a list of blocks, in reading order.

    First the screen a data-protection officer reads (the loud banners, then the plain-words
    box: verdict, who is protected, epsilon in context, what is not covered, what to keep
    in-house), then a contents list, then the sections: what is not covered in full, what is
    kept in-house, the summary table, the guarantee and the technical parts.

    Args:
        report: A valid report, as plain JSON data (see :func:`~dpkfc_med.report.to_json_data`).

    Returns:
        Headings, paragraphs, banners, tables, images and code blocks.
    """
    run, p = report["run"], report["privacy"]
    unit = unit_head(report["data"]["privacy_unit"])
    doc: list[Block] = [Heading(1, f"Privacy report: {run['name']}")]
    if report["status"] == RunStatus.INCOMPLETE:
        doc.append(Banner("INCOMPLETE RUN", INCOMPLETE_NOTE, "warning"))
    if not p["private"]:
        doc.append(Banner(NO_GUARANTEE, NONPRIVATE_NOTE.format(units=plural(unit)), "danger"))
    for text in p.get("headline_warnings") or []:
        title = next(
            (t for t in (NOT_VALID, PRIVATE_PRECONDITIONER) if text.startswith(t)),
            "Warning",
        )
        doc.append(Banner(title, text, "danger"))
    doc.append(plain_summary(report))
    sections: list[Block] = [
        *not_covered_section(report),
        *in_house_section(report),
        *summary_section(report),
        *guarantee_section(report),
        *audit_section(report),
        *mechanism_section(report),
        *preconditioner_section(report),
        *data_section(report),
        *model_section(report),
        *curves_section(report),
        Heading(2, "Hyperparameter tuning"),
        Paragraph(p["hyperparameter_tuning"]),
        *reproducibility_section(report),
    ]
    doc.append(Contents([b.text for b in sections if isinstance(b, Heading) and b.level == 2]))
    return doc + sections


def render_markdown(report: Mapping[str, Any]) -> str:
    """The report as Markdown; figures are linked as ``plots/<name>.png`` next to it.

    Args:
        report: A valid report as plain JSON data.

    Returns:
        The document, ending in a newline.
    """
    return "\n\n".join(markdown_block(b) for b in build_document(report)) + "\n"


def render_custodian_markdown(custodian: Mapping[str, Any]) -> str:
    """The custodian report as Markdown (figures linked as ``plots/<name>.png`` beside it)."""
    return "\n\n".join(markdown_block(b) for b in build_custodian_document(custodian)) + "\n"


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


def markdown_block(block: Block) -> str:
    """One block of the document model as Markdown (tables as pipe tables, banners as quotes)."""
    if isinstance(block, Heading):
        return f"{'#' * block.level} {block.text}"
    if isinstance(block, Paragraph):
        return _md_inline(block.content)
    if isinstance(block, BulletList):
        return "\n".join(f"- {_md_inline(item)}" for item in block.items)
    if isinstance(block, Banner):
        return f"> **{block.title}:** {block.text}"
    if isinstance(block, Box):
        paragraphs = [
            markdown_block(par).replace("\n", "\n> ")
            if isinstance(par, BulletList)
            else _md_inline(par)
            for par in block.paragraphs
        ]
        return f"> ### {block.title}\n>\n" + "\n>\n".join(f"> {par}" for par in paragraphs)
    if isinstance(block, Contents):
        links = [f"{i}. [{t}](#{anchor(t)})" for i, t in enumerate(block.titles, 1)]
        return "## Contents\n\n" + "\n".join(links)
    if isinstance(block, Table):
        if not block.rows and not block.header:  # e.g. the epsilon history of a run of 0 steps
            return "_(none)_"
        header = [_md_inline(h, True) for h in block.header] or [""] * len(block.rows[0])
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(_md_inline(c, True) for c in row) + " |" for row in block.rows]
        return "\n".join(lines)
    if isinstance(block, Image):
        return f"![{block.caption}]({PLOT_FILES.get(block.key, f'plots/{block.key}.png')})"
    return f"```{block.language}\n{block.text}\n```"


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
.summary ul { margin: 0.2rem 0 0.55rem; }
.summary li { margin: 0.15rem 0; }
nav.contents { margin: 0 0 2rem; }
nav.contents h2 { margin-top: 0; }
nav.contents ol { margin: 0.4rem 0; padding-left: 1.6rem; columns: 2; column-gap: 2rem; }
nav.contents li { margin: 0.15rem 0; break-inside: avoid; }
a { color: #0b5cad; }
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


def html_block(block: Block, plots: Mapping[str, bytes]) -> str:
    """One block of the document model as HTML; images are inlined from ``plots`` (PNG bytes)."""
    if isinstance(block, Heading):
        ident = f' id="{anchor(block.text)}"' if block.level == 2 else ""
        return f"<h{block.level}{ident}>{html.escape(block.text)}</h{block.level}>"
    if isinstance(block, Contents):
        links = "".join(
            f'<li><a href="#{anchor(t)}">{html.escape(t)}</a></li>' for t in block.titles
        )
        return f'<nav class="contents"><h2>Contents</h2><ol>{links}</ol></nav>'
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
        paragraphs = "".join(
            html_block(par, plots) if isinstance(par, BulletList) else f"<p>{_html_inline(par)}</p>"
            for par in block.paragraphs
        )
        return (
            f'<section class="summary summary-{block.kind}">'
            f"<h2>{html.escape(block.title)}</h2>{paragraphs}</section>"
        )
    if isinstance(block, Table):
        if not block.rows and not block.header:
            return "<p><em>(none)</em></p>"
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
    body = "\n".join(html_block(b, plots) for b in build_document(report))
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{title}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n<main>\n{body}\n"
        "</main>\n</body>\n</html>\n"
    )
