"""The report contracts: the privacy report's and the custodian report's schemas and validators."""

from dpkfc_med.report.schema.custodian_report import validate_custodian_report
from dpkfc_med.report.schema.json_data import to_json_data
from dpkfc_med.report.schema.privacy_report import (
    ACCOUNTANTS,
    COVERAGE_COLUMNS,
    REPORT_SCHEMA,
    STATUSES,
    ReportSchemaError,
    check_report,
    validate_report,
)

__all__ = [
    "ACCOUNTANTS",
    "COVERAGE_COLUMNS",
    "REPORT_SCHEMA",
    "STATUSES",
    "ReportSchemaError",
    "check_report",
    "to_json_data",
    "validate_custodian_report",
    "validate_report",
]
