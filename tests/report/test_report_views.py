"""Report views: the plain-language summary, the designed HTML, the epsilon history, English."""

from __future__ import annotations

import copy
import re
from html.parser import HTMLParser

import pytest

from dpkfc_med.report import (
    format_delta,
    format_epsilon,
    render_html,
    render_markdown,
    render_plots,
    split_report,
    validate_report,
)
from dpkfc_med.report.custodian import not_covered, not_covered_summary
from dpkfc_med.report.render import plain_summary, plural
from tests.report.test_report import PNG_MAGIC, example_full, example_nonprivate, example_report


def per_step_report(**overrides):
    """The example report with a per-step epsilon history (as the training loop writes it)."""
    report = example_report(**overrides)
    eps = report["privacy"]["epsilon"]["prv"]
    report["history"].update(
        step=list(range(1, 101)),
        epsilon_step=[1, 2, 4, 8, 16, 32, 50, 64, 100],
        epsilon=[0.1, 0.15, 0.2, 0.3, 0.45, 0.7, 0.9, 1.0, eps],
        epsilon_rdp=[0.15 + 0.0126 * i for i in range(100)],
        epsilon_accountant="prv",
        epsilon_schedule="steps 1, 2, 4, 8, ... (the powers of two), the last step of every epoch "
        "and the last step taken",
    )
    return report


def _summary_text(report) -> str:
    md = render_markdown(report)
    start = md.index("> ### In plain words")
    return md[start : md.index("## Contents")]


# --------------------------------------------------------------------------- plain summary
def test_plain_summary_states_who_against_what_how_much_and_what_not():
    report = per_step_report()
    text = _summary_text(report)
    p = report["privacy"]
    assert "**Who is protected:** each image of the training set (546 images)." in text
    assert "anyone who obtains everything this run publishes (the released model" in text
    assert (
        f"epsilon {format_epsilon(p['epsilon']['prv'])} at delta {format_delta(p['delta'])}, "
        f"after 100 noisy training steps, within the target of "
        f"{format_epsilon(p['target_epsilon'])} set before training (PRV accountant, which "
        "planned this run)"
    ) in text
    # epsilon in context: how far one image can move an attacker's odds (e^1.235, rounded up)
    assert "by at most a factor of e^epsilon = 3.44, except with probability delta" in text
    # the looser bounds of the other accountants are not on the first screen
    assert "1.411" not in text and "most conservative" not in text
    # the not-covered items, in short and grouped (the custodian's under "Keep in-house")
    shorts = not_covered_summary(report)
    assert len(shorts) == len(not_covered(report))
    assert '**Not covered** (in full under "What the guarantee does not cover"):' in text
    assert (
        "> - **Uses of the private data outside the mechanism**: any hyperparameter tuning on "
        "the private data, and the choice of the released epoch on the private validation split."
    ) in text
    assert "> - **Treated as public**: the number of training units (546)." in text
    for short in shorts:
        assert text.count(short) == 1, short
    assert (
        "**Keep in-house:** everything under private_not_for_release/ (statistics computed from "
        "the private data without noise, and the data's paths)."
    ) in text
    assert "**Valid DP release: yes.** The released model" in text
    assert plain_summary(report).kind == "ok"


def test_plain_summary_comes_first_in_markdown_and_html():
    report = per_step_report()
    md = render_markdown(report)
    assert md.index("> ### In plain words") < md.index("## Summary") < md.index("| Item |")
    page = render_html(report, render_plots(report))
    assert page.index('<section class="summary summary-ok"><h2>In plain words</h2>') < page.index(
        "<table"
    )


@pytest.mark.parametrize(
    ("change", "verdict", "kind"),
    [
        (
            lambda r: r["privacy"].update(
                randomness={"source": "seeded", "valid_dp_release": False}
            ),
            "Valid DP release: no.** The noise was generated from a seed",
            "danger",
        ),
        (
            lambda r: r["preconditioner"].update(uses_private_data=True),
            "Valid DP release: no.** The preconditioner was built partly from private",
            "danger",
        ),
        (lambda r: r.update(status="incomplete"), "Valid DP release: not yet.**", "warning"),
    ],
)
def test_plain_summary_says_when_a_run_is_not_a_valid_release(change, verdict, kind):
    report = per_step_report()
    change(report)
    assert verdict in _summary_text(report)
    assert plain_summary(report).kind == kind


def test_plain_summary_of_a_nonprivate_run():
    report = example_nonprivate()
    text = _summary_text(report)
    assert "**Against what:** nothing." in text and "**Valid DP release: no.**" in text
    assert "epsilon" not in text.lower()
    assert plain_summary(report).kind == "danger"


def test_plain_summary_names_patients_with_several_images():
    report = per_step_report()
    report["data"]["unit_note"] = {
        "statement": "The privacy unit is one image, but x holds up to 2 images per patient.",
        "per_patient": {"epsilon": 2.468, "delta": 5e-5, "images_per_patient": 2},
    }
    text = _summary_text(report)
    assert "A patient with 2 images is protected less, at epsilon 2.468 (group privacy" in text
    assert "patients with several images, beyond the weaker group-privacy bound" in text


# --------------------------------------------------------------------------- HTML design
def test_html_is_designed_to_be_read():
    report = per_step_report()
    plots = render_plots(report)
    page = render_html(report, plots)
    assert '<meta name="viewport"' in page and "<main>" in page
    assert re.search(r"main \{ max-width: 5\drem", page)  # a readable line length
    assert "tbody tr:nth-child(even) td { background" in page  # zebra rows
    assert "th, td { border: 1px solid" in page  # ruled tables
    assert ".summary-ok {" in page and ".summary-danger {" in page
    assert page.count('<div class="table-wrap"><table') == page.count("<table") > 10
    assert page.count("<thead><tr><th>") == page.count("<table")
    assert page.count('src="data:image/png;base64,') == len(plots) == 1  # the plot is inline
    assert "<h3>Epsilon history</h3>" in page


# --------------------------------------------------------------------------- epsilon history
def test_epsilon_history_section_lists_the_steps_and_exact_values():
    report = per_step_report()
    md = render_markdown(report)
    assert "### Epsilon history" in md
    assert (
        "The PRV epsilon (the stated accountant) is listed exactly at steps 1, 2, 4, 8, ... (the "
        "powers of two), the last step of every epoch and the last step taken: 9 values"
    ) in md
    assert "nothing is interpolated between them" in md
    assert "| step | epsilon (PRV) | epsilon (RDP, looser bound) |" in md
    rdp = report["history"]["epsilon_rdp"]
    for step, value in zip(report["history"]["epsilon_step"], report["history"]["epsilon"]):
        assert f"| {step} | {format_epsilon(value)} | {format_epsilon(rdp[step - 1])} |" in md
    assert render_plots(report)["epsilon"].startswith(PNG_MAGIC)
    old = example_report()  # a report with one epsilon per step and no epsilon_step
    assert "### Epsilon history" not in render_markdown(old)
    assert render_plots(old)["epsilon"].startswith(PNG_MAGIC)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda h: h.update(epsilon_step=[1, 4, 2, 8, 16, 32, 50, 64, 100]), "strictly increasing"),
        (lambda h: h.update(epsilon=h["epsilon"][:-1]), r"length of history\.epsilon_step \(9\)"),
        (
            lambda h: h.update(epsilon_step=[*h["epsilon_step"][:-1], 99]),
            r"must end at privacy\.steps \(100\)",
        ),
        (
            lambda h: h.update(epsilon=[*h["epsilon"][:-1], 1.2]),
            r"must be privacy\.epsilon\.prv \(1\.23401\)",
        ),
        (lambda h: h.update(epsilon_rdp=[0.1]), r"history\.epsilon_rdp: must have the length"),
        (lambda h: h.update(epsilon_step=[0]), r"history\.epsilon_step\[0\]: must be an integer"),
    ],
)
def test_epsilon_history_is_validated(change, message):
    report = per_step_report()
    assert validate_report(report) == []
    change(report["history"])
    assert any(re.search(message, p) for p in validate_report(report)), validate_report(report)


def test_nonprivate_history_holds_no_epsilon():
    report = example_nonprivate()
    report["history"].update(epsilon_step=[], epsilon_rdp=[])
    assert validate_report(report) == []
    report["history"]["epsilon_rdp"] = [0.0] * len(report["history"]["step"])
    assert "history.epsilon_rdp: must be empty for a non-private run" in validate_report(report)


# --------------------------------------------------------------------------- English
def test_plural_agrees_with_its_count():
    assert plural("image (MedMNIST)") == "images (MedMNIST)"
    assert plural("patient (train_unit_ids in x.npz)", 1) == "1 patient (train_unit_ids in x.npz)"
    assert plural("patient (train_unit_ids in x.npz)", 3) == "3 patients (train_unit_ids in x.npz)"
    assert plural("epoch", 1) == "1 epoch" and plural("epoch", 1.0) == "1 epoch"
    assert plural("epoch", 2.0) == "2 epochs" and plural("epoch", 0.5) == "0.5 epochs"
    assert plural("step", 0) == "0 steps" and plural("canary", 1) == "1 canary"
    assert plural("canary", 1000) == "1000 canaries" and plural("day", 2) == "2 days"


def _one_of_everything(unit: str):
    report = per_step_report(
        privacy__steps=1,
        privacy__planned_steps=1,
        privacy__epochs=1.0,
        data__num_train_units=1,
        data__privacy_unit=unit,
        preconditioner__refresh_every=1,
    )
    report["privacy"]["epsilon"]["prv"] = report["history"]["epsilon"][0] = 0.1
    report["history"].update(step=[1], epsilon_step=[1], epsilon=[0.1], epsilon_rdp=[0.15])
    report["audit"] = {
        "epsilon_lower_bound": 0.01,
        "epsilon_accounted": 0.1,
        "delta": 1e-5,
        "canaries": 1,
        "confidence": 0.95,
    }
    return report


@pytest.mark.parametrize("unit", ["image", "patient (train_unit_ids in pneumoniamnist.npz)"])
def test_rendered_counts_read_as_english(unit):
    report = _one_of_everything(unit)
    assert validate_report(report) == []
    for text in (render_markdown(report), render_html(report, {})):
        bad = re.findall(
            r"\b1 (?:epochs|steps|units|images|patients|samples|canaries|values)\b", text
        )
        assert bad == [], bad
        assert re.findall(r"[a-zA-Z]\)s\b", text) == []  # "...npz)s": a plural after a bracket
    md = render_markdown(report)
    assert "1 of 1 planned (1 epoch)" in md and "every 1 step" in md and "1 canary" in md


def test_split_report_keeps_the_epsilon_history_shareable():
    full = example_full()
    full["history"].update(copy.deepcopy(per_step_report()["history"]))
    full["history"]["loss"] = [0.5] * 100
    shareable, custodian = split_report(full)
    for key in ("epsilon", "epsilon_step", "epsilon_rdp", "epsilon_schedule"):
        assert key in shareable["history"]
    assert "loss" not in shareable["history"] and custodian["history"]["loss"] == [0.5] * 100


# --------------------------------------------------------------------------- HTML structure
class _Structure(HTMLParser):
    """What a browser would build from the page: headings, list items, tables, cell text."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[tuple[str, dict[str, str | None]]] = []
        self.h2: list[str] = []
        self.items: list[tuple[str, str]] = []  # (text, enclosing list tag) of each <li>
        self.paragraphs: list[str] = []
        self.unwrapped_tables = 0
        self.tables = 0
        self.cells: list[str] = []
        self._text: dict[str, list[str]] = {}

    def handle_starttag(self, tag, attrs):
        if tag in ("wbr", "br", "img", "meta"):
            return  # void elements
        if tag == "table":
            self.tables += 1
            parent = self.stack[-1] if self.stack else ("", {})
            wrapped = parent[0] == "div" and "table-wrap" in (parent[1].get("class") or "")
            self.unwrapped_tables += not wrapped
        self.stack.append((tag, dict(attrs)))
        if tag in ("h2", "li", "p", "td"):
            self._text[f"{tag}{len(self.stack)}"] = []

    def handle_endtag(self, tag):
        depth = len(self.stack)
        key = f"{tag}{depth}"
        text = "".join(self._text.pop(key, [])).strip()
        self.stack.pop()
        if tag == "h2":
            self.h2.append(text)
        elif tag == "li":
            self.items.append((text, self.stack[-1][0] if self.stack else ""))
        elif tag == "p":
            self.paragraphs.append(text)
        elif tag == "td":
            self.cells.append(text)

    def handle_data(self, data):
        for key in self._text:
            self._text[key].append(data)


def _structured_report():
    """The example report with an audit and the nested values that real runs record."""
    report = per_step_report()
    report["audit"] = {
        "epsilon_lower_bound": 0.2,
        "epsilon_accounted": 1.234,
        "delta": 1e-5,
        "canaries": 1000,
        "confidence": 0.95,
    }
    report["privacy"]["ledger"]["meta"] = {"sample_rate": 0.1172, "units": 546, "backend": None}
    pre = report["preconditioner"]
    pre["probe_source"]["intensity"] = {"mode": "unit_range", "low": 0.0, "high": 1.0}
    pre["probe_source"]["spatial_shape"] = [28, 28]
    long_name = "model.1.submodule.1.submodule.1.submodule.0.conv.unit0.conv"
    pre["coverage"].append({**pre["coverage"][0], "layer": long_name})
    pre["refreshes"][0]["eig_fallbacks"] = [{"layer": long_name, "factor": "A", "used": "float64"}]
    return report


def test_html_structure_lists_wrapped_tables_readable_cells_and_section_order():
    report = _structured_report()
    page = render_html(report, render_plots(report))
    doc = _Structure()
    doc.feed(page)
    # the not-covered items are a list, not paragraphs that start with "- "
    texts = [" ".join(t.split()) for t in report["privacy"]["not_covered"]]
    bullets = {" ".join(text.split()): parent for text, parent in doc.items}
    for text in texts:
        assert bullets.get(text) == "ul", (text, sorted(bullets))
    assert [p for p in doc.paragraphs if p.startswith("- ")] == []
    assert "<p>- " not in page
    # every table scrolls inside its wrapper instead of pushing past the page
    assert doc.tables > 10 and doc.unwrapped_tables == 0
    assert re.search(r"\.table-wrap \{[^}]*overflow-x: auto", page)
    assert "<wbr>" in page  # long layer names may wrap after their dots
    # nested values read as "key: value" lines, never as JSON
    json_cells = [c for c in doc.cells if '{"' in c or "[{" in c or re.search(r"^\[.*\]$", c)]
    assert json_cells == [], json_cells
    for line in ("sample_rate: 0.1172", "units: 546", "mode: unit_range", "factor: A"):
        assert (line, "ul") in doc.items, line  # one item a line, in the cell
    assert "28, 28" in doc.cells
    # the run configuration is a folded code block, not JSON in a table
    assert re.search(r"<details[^>]*><summary>[^<]*run configuration[^<]*</summary><pre>", page)
    # what a data-protection officer needs comes before the technical detail
    h2 = doc.h2
    assert h2[:6] == [
        "In plain words",
        "Contents",
        "What the guarantee does not cover",
        "What to keep in-house",
        "Summary",
        "Privacy guarantee",
    ], h2
    for technical in (
        "Empirical privacy audit",
        "Mechanism parameters",
        "Preconditioner provenance",
        "Data",
        "Model",
    ):
        assert h2.index("What the guarantee does not cover") < h2.index(technical), h2
    # Markdown says the same, in the same order
    md = render_markdown(report)
    md_h2 = [line[3:] for line in md.splitlines() if line.startswith("## ")]
    assert ["In plain words", *md_h2] == h2
    for text in report["privacy"]["not_covered"]:
        assert f"\n- {text}\n" in md
    assert "| meta | sample_rate: 0.1172; units: 546; backend: n/a |" in md
    assert '{"' not in md.split("### Run configuration")[0]
