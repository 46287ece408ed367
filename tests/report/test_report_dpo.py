"""The report a data-protection officer signs: its first screen, the one stated epsilon, the
grouped not-covered list, the unit in words, and a bundle's inputs computed from private data.
"""

from __future__ import annotations

import re

import pytest

from dpkfc_med.report import render_html, render_markdown, split_report, validate_report
from dpkfc_med.report.custodian import not_covered
from dpkfc_med.report.render import build_document, plain_summary
from dpkfc_med.report.statements import release_verdict
from tests.report.test_report import example_full
from tests.report.test_report_views import per_step_report

INPUTS = ["NormalizeIntensityd subtrahend=@ds_mean", "NormalizeIntensityd divisor=@ds_std"]


def _first_screen(md: str) -> str:
    return md[: md.index("## Contents")]


def _stated(report) -> dict:
    """The report as run.py writes it: its not-covered list computed from the full report."""
    full = report
    full["privacy"]["not_covered"] = not_covered(full)
    return split_report(full)[0]


# ------------------------------------------------------------------ one stated epsilon
def test_the_guarantee_is_stated_once_by_the_planning_accountant():
    """A looser bound (RDP 1.411) is never beside the target nor called "most conservative"."""
    report = per_step_report()
    md = render_markdown(report)
    first = _first_screen(md)
    assert "1.235" in first and "target of 2.000" in first
    assert "1.411" not in first and "RDP" not in first
    assert "most conservative" not in md.lower()
    # the guarantee table: the stated figure, then the target; no other accountant's value
    table = md[md.index("## Privacy guarantee") : md.index("### Other accountants")]
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    stated = next(i for i, r in enumerate(rows) if r.startswith("| epsilon, stated (PRV"))
    assert rows[stated + 1].startswith("| Target epsilon (the plan's) | 2.000 |")
    assert "1.411" not in table
    # the looser bounds: in the technical part, labelled as bounds on the same mechanism
    other = md[md.index("### Other accountants: bounds on the same mechanism") :]
    assert "| RDP (Opacus; Mironov 2017) | 1.411 | a looser bound on the same mechanism" in other
    assert md.index("## Contents") < md.index("### Other accountants")


def test_the_epsilon_plot_labels_rdp_as_a_looser_bound_and_the_target_by_its_accountant():
    from dpkfc_med.report.plots import epsilon_figure

    fig = epsilon_figure(per_step_report())
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "RDP: a looser bound on the same mechanism, not the stated epsilon" in labels
    assert "target epsilon (PRV): 2.000" in labels
    assert not [label for label in labels if label.startswith("RDP upper bound")]
    assert "PRV accountant, which planned the run" in fig.axes[0].get_title()


def test_the_bundle_readme_states_the_planning_accountant_and_no_max():
    from dpkfc_med.bundle.export import _readme

    dp = {
        "private": True,
        "guarantee": "(7.998, 1e-05)-DP",
        "delta": 1e-5,
        "epsilon_spent": {"prv": 7.9976, "rdp": 8.638, "pld": 7.987, "max": 8.638},
        "epsilon_target": 8.0,
        "accountant": "prv",
        "unit_of_privacy": "image",
        "sampler": "poisson",
        "sample_rate": 0.5,
        "noise_multiplier": 1.1,
        "max_grad_norm": 1.0,
        "steps": 3,
        "headline_warnings": [],
        "privacy_report": {"file": "docs/privacy_report.json", "sha256": "0" * 64},
    }
    meta = {"task": "t", "description": "d", "differential_privacy": dp}
    text = _readme(meta, {"kind": "classification"}, "net")
    assert "max 8.638" not in text and "(target 8" not in text
    assert "- epsilon at delta 1e-05: 7.998 (PRV accountant, which planned the run; within" in text
    assert "its target 8)" in text
    other = next(line for line in text.splitlines() if "8.638" in line)
    assert other.startswith("- other accountants, bounds on the same mechanism")
    assert "RDP 8.638 (a looser bound)" in other


# ------------------------------------------------------------------ not covered, grouped
def test_not_covered_is_grouped_and_lists_only_what_this_run_has_once():
    from dpkfc_med.report.custodian import NOT_COVERED_GROUPS, kept_in_house, not_covered_groups

    full = example_full()
    # a run that uses no unit-id or split file, no public proxy path, no pretraining cache
    config = full["run"]["config"]
    config["data"]["unit_ids"] = None
    config["data"]["split_file"] = None
    config["probes"]["public_data"] = None
    config["pretrain"]["cache_dir"] = None
    config["tracking"] = {"backend": "none", "uri": None, "custodian_uri": None}
    report = _stated(full)
    md = render_markdown(report)
    section = md[md.index("## What the guarantee does not cover") : md.index("## What to keep")]
    in_house = md[md.index("## What to keep in-house") : md.index("## Summary")]
    for field in ("data.unit_ids", "probes.public_data", "pretrain.cache_dir"):
        assert field not in section and field not in in_house, field
    assert section.count("the public proxy's path") == 1
    assert in_house.count("the public proxy's path") == 1
    bullets = [line for line in section.splitlines() if line.startswith("- ")]
    assert len(bullets) == len(set(bullets)) == len(report["privacy"]["not_covered"])
    assert max(len(b) for b in bullets) < 600  # no run-on bullet of twenty items
    titles = [title for title, _ in not_covered_groups(report)]
    assert titles == [
        NOT_COVERED_GROUPS["private"],
        NOT_COVERED_GROUPS["public"],
        NOT_COVERED_GROUPS["assumed"],
        NOT_COVERED_GROUPS["custodian"],
    ]
    for title in titles:
        assert f"**{title}**" in section
    kept = dict(kept_in_house(report))
    assert kept["paths in the run configuration"] == [
        "run.config.data.path",
        "run.config.output.dir",
    ]
    assert "run.config.data.unit_ids" not in report["custodian"]["items"]


# ------------------------------------------------------------------ the first screen
def test_first_screen_then_contents_then_technical_parts():
    report = per_step_report()
    md = render_markdown(report)
    first = _first_screen(md)
    order = [
        "**Valid DP release: yes.**",
        "**Who is protected:**",
        "**How much:**",
        "**Not covered**",
        "**Keep in-house:**",
    ]
    assert [first.index(x) for x in order] == sorted(first.index(x) for x in order)
    for technical in ("| Item |", "Mechanism", "Preconditioner", "ledger", "1.411"):
        assert technical not in first, technical
    contents = md[md.index("## Contents") :].split("\n\n")[1].splitlines()
    h2 = [line[3:] for line in md.splitlines() if line.startswith("## ")]
    assert h2[0] == "Contents"
    assert contents == [f"{i}. [{t}](#{_slug(t)})" for i, t in enumerate(h2[1:], 1)]
    assert (
        contents[0] == "1. [What the guarantee does not cover](#what-the-guarantee-does-not-cover)"
    )
    page = render_html(report, {})
    for title in h2[1:]:
        assert f'<h2 id="{_slug(title)}">' in page and f'href="#{_slug(title)}"' in page
    assert page.index("In plain words") < page.index('<nav class="contents">')
    assert page.index('<nav class="contents">') < page.index("<table")


def _slug(title: str) -> str:
    return re.sub(r"[^a-z0-9 _-]", "", title.lower()).replace(" ", "-")


# ------------------------------------------------------------------ the unit, in words
@pytest.mark.parametrize(
    ("unit", "n", "who"),
    [
        ("patient", 20, "each patient of the training set (20 patients)"),
        ("patient", 1, "each patient of the training set (1 patient)"),
        ("image", 4708, "each image of the training set (4,708 images)"),
        (
            "item of train#dataset",
            20,
            "each item of train#dataset of the training set (20 items of train#dataset)",
        ),
    ],
)
def test_the_unit_is_named_in_words_in_the_number_that_agrees(unit, n, who):
    report = per_step_report(data__privacy_unit=unit, data__num_train_units=n)
    text = _first_screen(render_markdown(report))
    assert f"**Who is protected:** {who}." in text
    assert "datasets" not in text


def test_a_bundle_unit_source_is_stated_beside_the_unit():
    report = per_step_report(data__privacy_unit="patient", data__num_train_units=20)
    report["data"]["unit_source"] = (
        "all items of train#dataset#data sharing the data-list key 'patient_id'"
    )
    md = render_markdown(report)
    assert (
        "**Who is protected:** each patient of the training set (20 patients). One patient: all "
        "items of train#dataset#data sharing the data-list key 'patient_id'."
    ) in md
    assert "| One unit is | all items of train#dataset#data sharing" in md


@pytest.mark.parametrize(
    ("status", "reason"),
    [
        ("incomplete", "The run stopped before its planned steps"),
    ],
)
def test_a_stopped_run_reads_not_yet_as_one_sentence(status, reason):
    report = per_step_report(status=status)
    md = render_markdown(report)
    assert f"**Valid DP release: not yet.** {reason}" in md
    assert ".**:" not in md and ".:" not in md and ",**" not in md
    assert plain_summary(report).kind == "warning"


# ------------------------------------------------------------------ data-dependent inputs
def _bundle_report(inputs):
    full = example_full(training__select_epoch="last")
    full["data"]["bundle"] = {
        "name": "my_bundle",
        "version": "0.1.0",
        "replaced": [],
        "custodian_handlers": [],
        "data_dependent_inputs": inputs,
    }
    return _stated(full)


def test_inputs_computed_from_private_data_make_the_release_valid_for_the_mechanism_only():
    report = _bundle_report(INPUTS)
    assert validate_report(report) == []
    (headline, reason), kind = release_verdict(report)
    assert headline == "Valid DP release: for the training mechanism only." and kind == "warning"
    assert all(i in reason for i in INPUTS)
    md = render_markdown(report)
    first = _first_screen(md)
    assert "Valid DP release: yes" not in md
    assert "**Valid DP release: for the training mechanism only.**" in first
    assert (
        "the bundle inputs computed from the private training data (NormalizeIntensityd "
        "subtrahend=@ds_mean, NormalizeIntensityd divisor=@ds_std)"
    ) in first
    stated = [s for s in report["privacy"]["not_covered"] if "NormalizeIntensityd" in s]
    assert len(stated) == 1 and all(i in stated[0] for i in INPUTS)
    section = md[md.index("## What the guarantee does not cover") : md.index("## Summary")]
    assert f"- {stated[0]}" in section
    data = md[md.index("### MONAI bundle") :]
    assert "- `NormalizeIntensityd subtrahend=@ds_mean`" in data
    assert plain_summary(report).kind == "warning"
    # without such inputs the same bundle run is a plain yes
    assert release_verdict(_bundle_report([]))[0][0] == "Valid DP release: yes."


def test_data_dependent_inputs_reach_the_report_from_the_run_record():
    """``task.data_record["bundle"]`` is the record's ``data["bundle"]``: it reaches the report."""
    from dpkfc_med.privacy.accounting import PrivacyLedger
    from dpkfc_med.report.record import build_report
    from tests.report.test_report_sections import make_record

    ledger = PrivacyLedger(1e-5)
    ledger.record(0.05, 1.2, steps=4)
    ledger.meta["expected_batch_size"] = 5
    bundle = {"name": "b", "replaced": [], "data_dependent_inputs": INPUTS}
    history = {"step": [1, 2, 3, 4], "epsilon_step": [4], "val_metric_name": "auroc"}
    record = make_record(
        ledger,
        history,
        accountant="rdp",
        data={"splits": {"train": 100}, "bundle": bundle},
        select_epoch="last",
    )
    full = build_report(record)
    assert full["data"]["bundle"]["data_dependent_inputs"] == INPUTS
    assert any("NormalizeIntensityd subtrahend=@ds_mean" in s for s in not_covered(full))
    assert full["privacy"]["not_covered"] == not_covered(full)  # complete as built
    # the guarantee states the accountant that planned the run, with its own epsilon
    eps = full["privacy"]["epsilon"]
    assert eps["rdp"] > eps["prv"]
    assert f"({eps['rdp']:.3f}".rstrip("0")[:5] in full["privacy"]["guarantee"]
    assert "(RDP accountant, which planned the run)" in full["privacy"]["guarantee"]
    assert "PRV accountant" not in full["privacy"]["guarantee"]
    blocks = build_document(_stated(full))
    assert blocks[1].paragraphs[0][0].text == "Valid DP release: for the training mechanism only."
