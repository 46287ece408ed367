"""Audit-ready privacy report: versioned JSON schema, Markdown/HTML rendering and plots."""

from dpkfc_med.report.custodian import (
    CUSTODIAN_FILES,
    CUSTODIAN_ONLY,
    PRIVATE_DIR,
    not_covered,
    shareable_config,
    split_report,
)
from dpkfc_med.report.environment import collect_environment, sha256_of_files
from dpkfc_med.report.numbers import format_delta, format_epsilon
from dpkfc_med.report.plots import PLOT_FILES, render_plots
from dpkfc_med.report.render import render_html, render_markdown
from dpkfc_med.report.schema import (
    REPORT_SCHEMA,
    ReportSchemaError,
    check_report,
    to_json_data,
    validate_custodian_report,
    validate_report,
)
from dpkfc_med.report.writer import REPORT_FILES, load_report, rerender, write_report

__all__ = [
    "CUSTODIAN_FILES",
    "CUSTODIAN_ONLY",
    "PLOT_FILES",
    "PRIVATE_DIR",
    "REPORT_FILES",
    "REPORT_SCHEMA",
    "ReportSchemaError",
    "check_report",
    "collect_environment",
    "format_delta",
    "format_epsilon",
    "load_report",
    "not_covered",
    "render_html",
    "render_markdown",
    "render_plots",
    "rerender",
    "sha256_of_files",
    "shareable_config",
    "split_report",
    "to_json_data",
    "validate_custodian_report",
    "validate_report",
    "write_report",
]
