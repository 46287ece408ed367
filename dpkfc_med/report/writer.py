"""Write a run's privacy report: the JSON record first, then figures, Markdown and HTML.

Files in the run directory (paths relative to it)::

    privacy_report.json     the record (schema dpkfc_med.privacy_report/2); the source of truth
    privacy_report.md       human-readable; links plots/*.png
    privacy_report.html     self-contained (figures inlined), for e-mail or an archive
    plots/epsilon.png       epsilon against step

    private_not_for_release/custodian_report.json   un-noised statistics (not covered)
    private_not_for_release/custodian_report.md     their human-readable view
    private_not_for_release/plots/training.png      training loss and validation curves

The first four files are the shareable part (with the model); the custodian files must not
leave the data custodian (:mod:`dpkfc_med.report.custodian`).

The JSON is written first and every file is replaced atomically, so an interrupted write
leaves either the old or the new version, and the views can always be rebuilt from the JSON
with :func:`rerender`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dpkfc_med.report.custodian import CUSTODIAN_FILES
from dpkfc_med.report.plots import PLOT_FILES, render_custodian_plots, render_plots
from dpkfc_med.report.render import render_custodian_markdown, render_html, render_markdown
from dpkfc_med.report.schema.custodian_report import validate_custodian_report
from dpkfc_med.report.schema.json_data import to_json_data
from dpkfc_med.report.schema.privacy_report import ReportSchemaError, check_report
from dpkfc_med.utils import atomic_write_bytes

__all__ = ["REPORT_FILES", "load_report", "rerender", "write_report"]

REPORT_FILES: dict[str, str] = {
    "json": "privacy_report.json",
    "markdown": "privacy_report.md",
    "html": "privacy_report.html",
    **{f"{key}_plot": path for key, path in PLOT_FILES.items()},
}
"""Key of :func:`write_report`'s result -> path relative to the run directory."""


def write_report(
    report: Mapping[str, Any],
    run_dir: str | Path,
    *,
    custodian: Mapping[str, Any] | None = None,
) -> dict[str, Path]:
    """Validate ``report`` and write the JSON record, figures, Markdown and HTML.

    Args:
        report: The report dict (schema :data:`~dpkfc_med.report.REPORT_SCHEMA`). Enums, paths,
            tuples, dataclasses and NumPy/torch numbers are converted to JSON; NaN and
            infinities outside the privacy fields (a diverged loss, the AUROC of a one-class
            split) are stored as ``null``.
        run_dir: The run directory; created if needed.
        custodian: the custodian report (:func:`~dpkfc_med.report.split_report`), written
            under ``private_not_for_release/``.

    Returns:
        The paths written, keyed like :data:`REPORT_FILES` (``"json"``, ``"markdown"``,
        ``"html"``, ``"epsilon_plot"``), plus ``"custodian_json"``, ``"custodian_markdown"``
        and ``"custodian_training_plot"`` with a custodian report.

    Raises:
        ReportSchemaError: listing every problem; nothing is written then.
    """
    check_report(report)
    problems = validate_custodian_report(custodian) if custodian is not None else []
    if problems:
        raise ReportSchemaError([f"custodian report: {p}" for p in problems])
    run_dir = Path(run_dir)
    # Everything is rendered in memory first: a renderer that fails leaves no file behind, so
    # a report on disk always has all of its views. The JSON record is written last.
    files: dict[str, tuple[Path, bytes]] = {}
    if custodian is not None:
        ctext = _json_text(custodian)
        files["custodian_json"] = (run_dir / CUSTODIAN_FILES["json"], ctext.encode("utf-8"))
        files.update(_custodian_views(json.loads(ctext), run_dir))
    text = _json_text(report)
    # Render from the JSON as stored, so rerender() reproduces these files exactly.
    files.update(_views(json.loads(text), run_dir))
    files["json"] = (run_dir / REPORT_FILES["json"], text.encode("utf-8"))
    return _write_all(files)


def _write_all(files: Mapping[str, tuple[Path, bytes]]) -> dict[str, Path]:
    for path, blob in files.values():
        atomic_write_bytes(path, blob)
    return {key: path for key, (path, _) in files.items()}


def _json_text(report: Mapping[str, Any]) -> str:
    data, problems = to_json_data(report, finite=True)
    if problems:  # pragma: no cover - the validators have reported these already
        raise ReportSchemaError(problems)
    return json.dumps(data, indent=2, ensure_ascii=False, allow_nan=False) + "\n"


def _custodian_views(data: Mapping[str, Any], run_dir: Path) -> dict[str, tuple[Path, bytes]]:
    files = {
        f"custodian_{key}_plot": (run_dir / CUSTODIAN_FILES[f"{key}_plot"], png)
        for key, png in render_custodian_plots(data).items()
    }
    files["custodian_markdown"] = (
        run_dir / CUSTODIAN_FILES["markdown"],
        render_custodian_markdown(data).encode("utf-8"),
    )
    return files


def _views(data: Mapping[str, Any], run_dir: Path) -> dict[str, tuple[Path, bytes]]:
    plots = render_plots(data)
    files = {f"{key}_plot": (run_dir / PLOT_FILES[key], png) for key, png in plots.items()}
    for key, text in (("markdown", render_markdown(data)), ("html", render_html(data, plots))):
        files[key] = (run_dir / REPORT_FILES[key], text.encode("utf-8"))
    return files


def load_report(run_dir: str | Path) -> dict[str, Any]:
    """Read and validate ``<run_dir>/privacy_report.json``.

    Raises:
        FileNotFoundError: when the run directory has no report.
        ReportSchemaError: when the file does not follow the schema.
    """
    path = Path(run_dir) / REPORT_FILES["json"]
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no privacy report here; pass the run directory of a training run "
            "(the folder that holds privacy_report.json)"
        )
    data = json.loads(path.read_text(encoding="utf-8"))
    check_report(data)
    return data


def rerender(run_dir: str | Path) -> dict[str, Path]:
    """Rebuild the figures, Markdown and HTML from ``<run_dir>/privacy_report.json``.

    Nothing is recomputed: every figure and number comes from the stored JSON (used by
    ``dpkfc-med report RUN_DIR``, e.g. after a rendering fix or to restore deleted views).

    Args:
        run_dir: A run directory written by :func:`write_report`.

    Returns:
        The paths, keyed like :data:`REPORT_FILES` (the JSON file is read, not rewritten).

    Raises:
        FileNotFoundError: when the run directory has no report.
        ReportSchemaError: when the stored report does not follow the schema.
    """
    run_dir = Path(run_dir)
    data = load_report(run_dir)
    files = _views(data, run_dir)
    cpath = run_dir / CUSTODIAN_FILES["json"]
    if cpath.is_file():
        files.update(_custodian_views(json.loads(cpath.read_text(encoding="utf-8")), run_dir))
    out = {"json": run_dir / REPORT_FILES["json"], **_write_all(files)}
    if cpath.is_file():
        out["custodian_json"] = cpath
    return out
