"""One vocabulary: every method list is the Method enum; one did-you-mean rule."""

from __future__ import annotations

import pytest

from dpkfc_med.methods import ENGINE_METHODS, METHODS, PRECONDITIONED_METHODS, Method, method_help
from dpkfc_med.report import render
from dpkfc_med.report.schema import privacy_report as schema
from dpkfc_med.utils import check_choice, did_you_mean


def test_every_list_is_derived_from_the_enum():
    assert METHODS == tuple(m.value for m in Method)
    assert schema.METHODS == METHODS and schema.PRECONDITIONED_METHODS == PRECONDITIONED_METHODS
    assert ENGINE_METHODS == (Method.DP_SGD, Method.DP_KFC, Method.DP_STP)
    assert [m.mechanism for m in Method] == [
        None,
        Method.DP_SGD,
        *[Method.DP_KFC] * 3,
        Method.DP_STP,
    ]
    assert method_help() == "nonprivate | dp-sgd | dp-kfc | dp-kfc-white | dp-kfc-public | dp-stp"
    for m in Method:  # every method has the renderer's sentence
        assert "{unit}" in m.description or not m.private


def test_renderer_shows_the_schemas_coverage_columns():
    assert set(schema.COVERAGE_KEYS) < set(schema.COVERAGE_COLUMNS)
    report = {
        "privacy": {"method": "dp-kfc"},
        "data": {"privacy_unit": "patient"},
        "preconditioner": {"config": {"family": "shampoo"}},
    }
    assert "Shampoo" in render.method_text(report) and "per-patient" in render.method_text(report)


def test_the_engine_runs_three_mechanisms_and_says_which():
    assert check_choice("method", "DP-KFC", Method, ENGINE_METHODS) is Method.DP_KFC
    with pytest.raises(
        ValueError,
        match=r"method='nonprivate' is not allowed; choose one of \['dp-sgd', 'dp-kfc', 'dp-stp'\]",
    ):
        check_choice("method", Method.NONPRIVATE, Method, ENGINE_METHODS)
    with pytest.raises(
        ValueError, match=r"method='dp-kfx' is not allowed \(did you mean 'dp-kfc'\?\)"
    ):
        check_choice("method", "dp-kfx", Method, ENGINE_METHODS)


def test_one_did_you_mean_rule():
    assert did_you_mean("Densnet121", ["densenet121", "unet"]) == " (did you mean 'densenet121'?)"
    assert did_you_mean("qqq", ["densenet121"]) == ""
