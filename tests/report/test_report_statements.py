"""What the rendered report says: banners, method statements, tables, plurals, coverage."""

from __future__ import annotations

import copy
import json

import pytest

from dpkfc_med.report import (
    render_html,
    render_markdown,
    render_plots,
    validate_report,
    write_report,
)
from dpkfc_med.report.render import render_custodian_markdown
from tests.report.test_report import (
    PNG_MAGIC,
    example_custodian,
    example_nonprivate,
    example_report,
    sha_hex,
)


# --------------------------------------------------------------------------- banners
def test_incomplete_run_banner_comes_first():
    report = example_report(status="incomplete", privacy__steps=40, privacy__planned_steps=100)
    md = render_markdown(report)
    first_block = md.split("\n\n")[1]
    assert first_block == (
        "> **INCOMPLETE RUN:** the figures below cover the steps taken before the "
        "interruption; the privacy spent is as stated"
    )
    assert "| Steps | 40 of 100 planned" in md
    assert render_plots(report)["epsilon"].startswith(PNG_MAGIC)


def test_nonprivate_banner_and_no_epsilon():
    report = example_nonprivate()
    md = render_markdown(report)
    assert md.split("\n\n")[1].startswith("> **NO PRIVACY GUARANTEE:**")
    assert "| Privacy guarantee | **NO PRIVACY GUARANTEE**:" in md
    assert "(epsilon, delta)" not in md
    assert "Not applicable: no preconditioner" in md
    page = render_html(report, render_plots(report))
    assert 'class="banner banner-danger"><strong>NO PRIVACY GUARANTEE:' in page


def test_public_data_statement():
    report = example_report(privacy__method="dp-kfc-public")
    report["preconditioner"]["external_data"] = {
        "sha256": sha_hex("public"),
        "note": "public mammography set",
    }
    md = render_markdown(report)  # the shareable report names the proxy by its digest
    assert f"No private data; external public data (SHA-256 {sha_hex('public')[:12]})" in md
    assert f"`{sha_hex('public')}`" in md
    report["preconditioner"]["external_data"]["path"] = "public/cbis-ddsm.npz"
    md = render_markdown(report)  # the full (custodian-side) record names it by its path
    assert "No private data; external public data public/cbis-ddsm.npz" in md


# --------------------------------------------------------------------------- layouts
def test_long_tables_are_shortened_and_nested_metrics_tabulated():
    report = example_report()
    report["preconditioner"]["refreshes"] = [
        {"step": 10 * i, "probe_seed": i, "seconds": 0.1, "scale": 1.0} for i in range(30)
    ]
    md = render_markdown(report)
    assert "*... 10 more rows in the JSON report*" in md
    assert "| 290 | 29 | 0.1 | 1 |" in md and "| 150 | 15 |" not in md
    assert "seeds 0-29" in md
    assert "| class | sensitivity | specificity | support |" not in md  # custodian only
    assert "| class | sensitivity | specificity | support |" in render_custodian_markdown(
        example_custodian()
    )


def test_segmentation_report_with_undefined_values(tmp_path):
    kw = {
        "task__kind": "segmentation",
        "task__spatial_dims": 3,
        "task__label_names": ["background", "tumour"],
        "data__privacy_unit": "patient/volume",
        "data__max_samples_per_unit": 4,
        "metrics__test": {"mean_dice": 0.7, "dice": [0.9, float("nan")]},
    }
    report, custodian = example_report(**kw), example_custodian(**kw)
    custodian["history"]["loss"][3] = float("inf")  # a diverged step
    assert validate_report(report) == []
    md = render_markdown(report)
    assert "for the add/remove-one-patient/volume relation" in md
    assert "at most 4 samples per unit" in md
    assert "| tumour | nan |" in render_custodian_markdown(custodian)
    paths = write_report(report, tmp_path, custodian=custodian)
    stored = json.loads(paths["custodian_json"].read_text(encoding="utf-8"))
    assert stored["history"]["loss"][3] is None and stored["metrics"]["test"]["dice"][1] is None
    assert "| tumour | n/a |" in paths["custodian_markdown"].read_text(encoding="utf-8")


def test_auto_refresh_schedule_is_stated_with_its_estimate():
    report = example_report()
    assert "refresh_every: auto" not in render_markdown(report)  # a fixed period says nothing
    report["preconditioner"]["refresh_plan"] = {
        "rule": "auto",
        "refresh_every": 50,
        "estimated_share": 0.031,
        "budget": 0.05,
    }
    assert validate_report(report) == []
    md = render_markdown(report)
    assert "then every 50 steps (refresh_every: auto; refreshes estimated at 3.1 %" in md
    assert "budget 5 %" in md


def test_headline_banners_audit_unit_note_and_eig_fallbacks_are_rendered():
    report = example_report()
    report["privacy"]["headline_warnings"] = [
        "NOT A VALID DP RELEASE: seeded noise.",
        "PRECONDITIONER USES PRIVATE DATA: the public proxy shares images.",
    ]
    report["audit"] = {
        "epsilon_lower_bound": 0.41234,
        "epsilon_accounted": 1.23401,
        "delta": 1e-5,
        "canaries": 1000,
        "confidence": 0.95,
        "correct_guesses": 57,
    }
    report["data"]["unit_note"] = {"statement": "Up to 2 images per patient: (2.47, 3.4e-5)."}
    report["preconditioner"]["eig_fallbacks"] = [
        {"refresh_step": 0, "layer": "features.conv0", "factor": "A", "used": "float64"}
    ]
    assert validate_report(report) == []
    md = render_markdown(report)
    blocks = md.split("\n\n")
    assert blocks[1] == "> **NOT A VALID DP RELEASE:** NOT A VALID DP RELEASE: seeded noise."
    assert blocks[2].startswith("> **PRECONDITIONER USES PRIVATE DATA:** PRECONDITIONER")
    # the cross-check accountants are information in the technical part, never a banner
    assert "### Other accountants: bounds on the same mechanism" in md and "disagree" not in md
    assert (
        "| Empirical privacy audit | empirical lower bound 0.413 against the accounted 1.235 "
        "(one-run canary audit, 1000 canaries, confidence 0.95) |"
    ) in md
    assert "## Empirical privacy audit" in md and "| Correct guesses | 57 |" in md
    assert "| Patients with several images | Up to 2 images per patient" in md
    assert "| 0 | features.conv0 | A | float64 |" in md
    bad = copy.deepcopy(report)
    del bad["audit"]["canaries"]
    assert "audit.canaries: missing" in validate_report(bad)


def test_unit_plurals_and_epoch_counts_read_as_english():
    from dpkfc_med.report.statements import plural, steps_text

    assert plural("image") == "images"
    assert plural("patient/volume") == "patients/volumes"
    assert plural("patient (data.unit_ids)") == "patients (data.unit_ids)"
    assert steps_text({"steps": 3, "planned_steps": 3, "epochs": 1.0}) == "3 of 3 planned (1 epoch)"
    assert steps_text({"steps": 6, "planned_steps": None, "epochs": 2.0}) == "6 (2 epochs)"


def test_coverage_shares_are_stated_under_the_covered_layers():
    from dpkfc_med.curvature.preconditioner import coverage_shares

    report = example_report()
    rows = report["preconditioner"]["coverage"]
    report["preconditioner"]["coverage_shares"] = coverage_shares(rows)
    assert validate_report(report) == []
    md = render_markdown(report)
    total = sum(r["params"] for r in rows)
    assert f"Of {total:,} trainable parameters, " in md
    assert "% the fallback rule." in md.split("### Covered layers")[1]


def test_a_renderer_that_fails_leaves_no_half_written_report(tmp_path, monkeypatch):
    """No privacy_report.json without its Markdown and HTML (a crash mid-way wrote the JSON)."""
    import dpkfc_med.report.writer as writer

    def broken(*args, **kwargs):
        raise RuntimeError("renderer bug")

    monkeypatch.setattr(writer, "render_html", broken)
    with pytest.raises(RuntimeError, match="renderer bug"):
        write_report(example_report(), tmp_path, custodian=example_custodian())
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]
