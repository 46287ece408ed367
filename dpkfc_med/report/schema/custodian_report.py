"""The custodian report's contract (schema ``dpkfc_med.custodian_report/1``) and its validator.

The custodian report holds what the shareable report must not (see
:mod:`dpkfc_med.report.custodian`); its validator reads problems in the same
``"<dotted.field>: <what is wrong>"`` form as
:func:`~dpkfc_med.report.schema.privacy_report.validate_report`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dpkfc_med.report.custodian import CUSTODIAN_SCHEMA
from dpkfc_med.report.schema.json_data import to_json_data
from dpkfc_med.report.schema.rules import describe, fields, is_number, mapping, nullable, string

__all__ = ["validate_custodian_report"]

_METRICS = fields({"val": nullable(mapping), "test": nullable(mapping)})


def _check_metrics(metrics: Any, problems: list[str]) -> None:
    _METRICS(metrics, "metrics", problems)
    for split in ("val", "test"):
        values = metrics.get(split) if isinstance(metrics, Mapping) else None
        if not isinstance(values, Mapping) or "confusion_matrix" not in values:
            continue
        cm, path = values["confusion_matrix"], f"metrics.{split}.confusion_matrix"
        square = (
            isinstance(cm, (list, tuple))
            and all(isinstance(r, (list, tuple)) and len(r) == len(cm) for r in cm)
            and all(is_number(x) for r in cm for x in r)
        )
        if not square:
            problems.append(f"{path}: must be a square list of lists of counts (rows: true class)")


def validate_custodian_report(report: Any) -> list[str]:
    """Every problem of a custodian report (schema ``dpkfc_med.custodian_report/1``)."""
    data, problems = to_json_data(report)
    if not isinstance(data, Mapping):
        return [f"<custodian report>: must be a mapping, got {describe(data)}"]
    if data.get("schema") != CUSTODIAN_SCHEMA:
        problems.append(f"schema: must be {CUSTODIAN_SCHEMA!r}, got {describe(data.get('schema'))}")
    string(data.get("banner"), "banner", problems)
    history = data.get("history")
    if not isinstance(history, Mapping):
        problems.append("history: must be a mapping")
    else:
        steps, loss = history.get("step", []), history.get("loss", [])
        if isinstance(steps, list) and isinstance(loss, list) and len(loss) != len(steps):
            problems.append(
                f"history.loss: must have the length of history.step ({len(steps)}), "
                f"has {len(loss)}"
            )
        epochs, values = history.get("val_epoch", []), history.get("val_metric", [])
        if isinstance(epochs, list) and isinstance(values, list) and len(epochs) != len(values):
            problems.append(
                f"history.val_metric: must have the length of history.val_epoch ({len(epochs)}), "
                f"has {len(values)}"
            )
    _check_metrics(data.get("metrics"), problems)
    nullable(mapping)(data.get("diagnostics"), "diagnostics", problems)
    return problems
