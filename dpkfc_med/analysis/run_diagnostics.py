"""Per-layer signal-to-noise ratio and clipped fraction of a finished run (custodian only).

A private run keeps its clipping diagnostics under ``private_not_for_release/``: the run means
in ``custodian_report.json`` (``diagnostics``: ``mean_clipped_fraction``, ``mean_layer_snr``,
``mean_layer_share``, ...) and the per-step records in ``checkpoint.pt`` (``diag``: one
dictionary per step with ``clipped_fraction``, ``layer_snr``, ``layer_share`` and the median
norms). A layer's SNR is the squared norm of the clipped per-unit sum on that layer divided by
the noise's expected squared norm ``sigma^2 C^2 d`` on its ``d`` coordinates, both where the
noise is added (:class:`~dpkfc_med.privacy.optimizer.StepDiagnostics`).

These figures are computed from un-noised private per-sample gradients: they are **not
differentially private** and are for the data custodian and research, never for release.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dpkfc_med.report.custodian import CUSTODIAN_FILES, PRIVATE_DIR

__all__ = ["NOT_DP", "RunDiagnostics", "read_run_diagnostics", "snr_rows"]

NOT_DP = "computed from un-noised private gradients: NOT differentially private, custodian only"
"""Label carried by every :class:`RunDiagnostics`."""

CHECKPOINT = "checkpoint.pt"


@dataclass(frozen=True)
class RunDiagnostics:
    """Clipping diagnostics of one run (NOT differentially private).

    Attributes:
        run_dir: The run directory.
        name: Run name.
        method: ``"dp-sgd"``, ``"dp-kfc"``, ...
        epsilon: Epsilon of the stated accountant (None if not reported).
        steps: Noisy steps the means cover.
        mean_clipped_fraction: Mean over steps of the fraction of units clipped.
        mean_layer_snr: Mean over steps of each layer's SNR.
        mean_layer_share: Mean over steps of each layer's share of the squared norm.
        step: Per-step index (1-based), empty when the checkpoint holds no records.
        clipped_fraction: Per-step clipped fraction.
        layer_snr: Per-step SNR of each layer.
        note: :data:`NOT_DP`.
    """

    run_dir: Path
    name: str
    method: str
    epsilon: float | None
    steps: int
    mean_clipped_fraction: float
    mean_layer_snr: Mapping[str, float]
    mean_layer_share: Mapping[str, float]
    step: tuple[int, ...] = ()
    clipped_fraction: tuple[float, ...] = ()
    layer_snr: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    note: str = NOT_DP

    @property
    def layers(self) -> tuple[str, ...]:
        """Layers with an SNR, in the report's order."""
        return tuple(self.mean_layer_snr)

    @property
    def label(self) -> str:
        """``"<method>, eps <epsilon>"`` for legends."""
        eps = "" if self.epsilon is None else f", eps {self.epsilon:.3g}"
        return f"{self.method}{eps}"


def _per_step(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / CHECKPOINT
    if not path.is_file():
        return []
    # The run's own checkpoint (written by dpkfc_med.training): the custodian's trusted file.
    ck = torch.load(path, map_location="cpu", weights_only=False)
    diag = ck.get("diag") if isinstance(ck, dict) else None
    return list(diag) if isinstance(diag, list) else []


def read_run_diagnostics(run_dir: str | Path) -> RunDiagnostics:
    """Read a run's clipping diagnostics from its custodian report and checkpoint.

    Args:
        run_dir: Directory of a finished run (``output.dir``).

    Returns:
        :class:`RunDiagnostics` (per-step fields empty when ``checkpoint.pt`` is absent).

    Raises:
        FileNotFoundError: If the custodian report is missing (not a run directory, or a
            shareable copy without ``private_not_for_release/``).
        ValueError: If the run recorded no clipping diagnostics (a non-private run).
    """
    run_dir = Path(run_dir)
    path = run_dir / CUSTODIAN_FILES["json"]
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: pass the directory of a finished run (its output.dir); a "
            f"shareable copy without {PRIVATE_DIR}/ holds no clipping diagnostics"
        )
    report = json.loads(path.read_text(encoding="utf-8"))
    diag = report.get("diagnostics")
    if not diag:
        raise ValueError(
            f"{path}: 'diagnostics' is empty: the run took no noisy steps with clipping "
            "diagnostics (method=non-private, or no step was taken); train with method=dp-sgd "
            "or dp-kfc"
        )
    privacy = report.get("privacy") or {}
    eps_all = privacy.get("epsilon") or {}
    eps = eps_all.get(privacy.get("accountant", "prv")) if isinstance(eps_all, dict) else None
    records = _per_step(run_dir)
    layer_snr: dict[str, list[float]] = {k: [] for k in diag.get("mean_layer_snr", {})}
    for d in records:
        for k in layer_snr:
            layer_snr[k].append(float(d.get("layer_snr", {}).get(k, math.nan)))
    return RunDiagnostics(
        run_dir=run_dir,
        name=str((report.get("run") or {}).get("name", run_dir.name)),
        method=str(privacy.get("method", "")),
        epsilon=None if eps is None else float(eps),
        steps=int(diag.get("steps", len(records))),
        mean_clipped_fraction=float(diag.get("mean_clipped_fraction", math.nan)),
        mean_layer_snr={k: float(v) for k, v in diag.get("mean_layer_snr", {}).items()},
        mean_layer_share={k: float(v) for k, v in diag.get("mean_layer_share", {}).items()},
        step=tuple(range(1, len(records) + 1)),
        clipped_fraction=tuple(float(d.get("clipped_fraction", math.nan)) for d in records),
        layer_snr={k: tuple(v) for k, v in layer_snr.items()},
    )


def snr_rows(runs: Sequence[RunDiagnostics]) -> list[dict[str, Any]]:
    """One row per layer: each run's mean SNR (keyed by its label) and their ratio to the first.

    The ratio column ``"<label> / <first label>"`` is present for every run after the first.
    """
    if not runs:
        return []
    layers = list(dict.fromkeys(k for r in runs for k in r.layers))
    first = runs[0]
    rows = []
    for layer in layers:
        row: dict[str, Any] = {"layer": layer}
        for r in runs:
            row[r.label] = r.mean_layer_snr.get(layer, math.nan)
        base = first.mean_layer_snr.get(layer, math.nan)
        for r in runs[1:]:
            v = r.mean_layer_snr.get(layer, math.nan)
            row[f"{r.label} / {first.label}"] = (
                v / base if base and math.isfinite(base) else math.nan
            )
        rows.append(row)
    return rows
