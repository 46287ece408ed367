"""One home per vocabulary (run status, accountants) and the method sentence from its parts."""

from __future__ import annotations

import pytest

from dpkfc_med.methods import Method
from dpkfc_med.privacy.accounting import Accountant
from dpkfc_med.report import ReportSchemaError, check_report, render_markdown, validate_report
from dpkfc_med.report.schema import ACCOUNTANTS, STATUSES
from dpkfc_med.report.statements import method_text
from dpkfc_med.report.status import RunStatus
from tests.report.test_report import example_report


# --------------------------------------------------------------------------- run status
def test_the_report_accepts_exactly_the_run_status_values():
    assert STATUSES == ("complete", "incomplete")
    assert list(RunStatus) == ["complete", "incomplete"]  # a member equals its string
    assert f"{RunStatus.COMPLETE}: {RunStatus.INCOMPLETE}" == "complete: incomplete"


def test_failed_is_no_status_since_no_run_ever_wrote_it():
    """A run that ends with an error writes ``incomplete`` (its spent privacy, resumable)."""
    with pytest.raises(
        ReportSchemaError,
        match=r"status: must be one of 'complete', 'incomplete', got 'failed'",
    ):
        check_report(example_report(status="failed"))


@pytest.mark.parametrize("status", list(RunStatus))
def test_a_status_member_reads_as_its_value(status):
    member, text = example_report(status=status), example_report(status=status.value)
    assert validate_report(member) == []
    assert render_markdown(member) == render_markdown(text)


# --------------------------------------------------------------------------- accountants
def test_the_schema_lists_the_accountant_enum():
    assert ACCOUNTANTS == tuple(a.value for a in Accountant) == ("prv", "rdp", "pld")


def test_epsilon_max_names_every_accountant():
    report = example_report(privacy__epsilon__max=0.0)
    with pytest.raises(ReportSchemaError, match=r"must be the largest of prv, rdp and pld \("):
        check_report(report)


# --------------------------------------------------------------------------- method sentence
_PROBES = {
    "dp-kfc": "DP-KFC: per-patient gradients preconditioned by {} built from synthetic noise "
    "probes, then clipped to norm C and noised as in DP-SGD",
    "dp-kfc-white": "DP-KFC with white-noise probes: per-patient gradients preconditioned by {} "
    "built from white-noise probes, then clipped and noised as in DP-SGD",
    "dp-kfc-public": "DP-KFC with public data: per-patient gradients preconditioned by {} built "
    "from external public data, then clipped and noised as in DP-SGD",
}
_CURVATURE = {
    None: "a KFAC curvature estimate",  # a report without a family is K-FAC
    "kfac": "a KFAC curvature estimate",
    "shampoo": "a Shampoo preconditioner (left and right factors of probe per-sample gradients)",
    "diagonal": "a diagonal preconditioner (the second moment of probe per-sample gradients)",
    "unregistered": "a KFAC curvature estimate",
}


def _sentence_of(method: str, family: str | None) -> str:
    config = {} if family is None else {"family": family}
    return method_text(
        {
            "privacy": {"method": method},
            "data": {"privacy_unit": "patient (unit ids)"},
            "preconditioner": {"config": config},
        }
    )


@pytest.mark.parametrize("family", list(_CURVATURE))
@pytest.mark.parametrize("method", list(_PROBES))
def test_the_method_sentence_names_the_preconditioner_family(method, family):
    assert _sentence_of(method, family) == _PROBES[method].format(_CURVATURE[family])


def test_methods_without_a_preconditioner_have_no_curvature_part():
    assert _sentence_of("dp-sgd", None) == (
        "DP-SGD: per-patient gradients clipped to norm C, Gaussian noise added to their sum"
    )
    assert _sentence_of("nonprivate", None) == "non-private training (no clipping, no noise)"
    assert Method.DP_KFC.description.format(unit="patient") == _sentence_of("dp-kfc", "kfac")
