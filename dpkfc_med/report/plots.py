"""Report figures as PNG bytes: epsilon against step, and the training curves.

The epsilon figure draws the stated accountant's exact values at the steps the history lists
(markers: nothing is interpolated between them) against the target it was planned for; the RDP
accountant's epsilon after every step (a faint line: it has a value at each step, see
:mod:`dpkfc_med.report.history`) is labelled as what it is, a looser bound on the same
mechanism, so that it is not read as the budget being exceeded.

Figures are drawn on matplotlib's Agg canvas directly (no ``pyplot``): no global backend is
switched, no window can open on a head-less node, and nothing leaks between calls. PNGs carry
no software-version stamp, so re-rendering the same report gives the same bytes.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from typing import Any

from dpkfc_med.report.numbers import format_delta, format_epsilon
from dpkfc_med.report.status import RunStatus
from dpkfc_med.report.wording import NO_GUARANTEE

__all__ = ["PLOT_FILES", "epsilon_figure", "render_custodian_plots", "render_plots"]

PLOT_FILES: dict[str, str] = {"epsilon": "plots/epsilon.png"}
"""Plot key -> path relative to the run directory (the Markdown links to these)."""


def render_plots(report: Mapping[str, Any]) -> dict[str, bytes]:
    """PNG bytes of every figure of the shareable report, keyed like :data:`PLOT_FILES`.

    Args:
        report: A valid report (see :func:`dpkfc_med.report.validate_report`).

    Returns:
        ``{"epsilon": png}``.
    """
    return {"epsilon": _epsilon_png(report)}


def render_custodian_plots(custodian: Mapping[str, Any]) -> dict[str, bytes]:
    """PNG bytes of the custodian report's figures: ``{"training": png}`` (loss, val curve)."""
    return {"training": _training_png(custodian)}


def _figure(width: float, height: float, **margins: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # Fixed margins rather than a layout engine: half the drawing time, same look here.
    fig = Figure(figsize=(width, height), dpi=100)
    fig.subplots_adjust(**{"left": 0.1, "right": 0.97, "bottom": 0.14, "top": 0.9, **margins})
    FigureCanvasAgg(fig)
    return fig


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    return buf.getvalue()


def _floats(values: Sequence[Any]) -> list[float]:
    # null in a curve marks a non-finite value; NaN leaves a gap in the line.
    return [math.nan if v is None else float(v) for v in values]


def _message(ax: Any, text: str, color: str = "0.3") -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color=color)
    ax.set_xticks([])
    ax.set_yticks([])


def _epsilon_png(report: Mapping[str, Any]) -> bytes:
    return _png(epsilon_figure(report))


def epsilon_figure(report: Mapping[str, Any]) -> Any:
    """The epsilon figure (a matplotlib ``Figure``): the stated accountant against its target."""
    privacy, history = report["privacy"], report["history"]
    fig = _figure(6.4, 3.8)
    ax = fig.add_subplot()
    if not privacy["private"]:
        ax.set_title("Privacy spent")
        _message(ax, f"{NO_GUARANTEE}\n(non-private training: epsilon is unbounded)", "C3")
        return fig

    accountant, eps = privacy["accountant"], privacy["epsilon"]
    steps = history["step"]
    rdp = _floats(history.get("epsilon_rdp") or [])
    if rdp and len(rdp) == len(steps) and accountant != "rdp":
        ax.plot(
            steps,
            rdp,
            color="0.7",
            lw=1,
            ls="--",
            label="RDP: a looser bound on the same mechanism, not the stated epsilon",
        )
    if "epsilon_step" in history:
        # Exact values at the listed steps only: markers, no line (nothing is interpolated).
        listed, exact = history["epsilon_step"], _floats(history["epsilon"])
        if accountant == "rdp" and len(listed) > 60:
            ax.plot(listed, exact, color="C0", lw=1.5, label="epsilon (RDP, stated), every step")
        elif listed:
            ax.plot(
                listed,
                exact,
                "o",
                color="C0",
                ms=4,
                label=f"epsilon ({accountant.upper()}, stated), at the listed steps",
            )
    elif history["epsilon"]:  # a report from before per-step epsilon: one value per step
        ax.plot(steps, _floats(history["epsilon"]), color="C0", label="epsilon spent")
    ax.plot(
        [privacy["steps"]],
        [eps[accountant]],
        "D",
        color="C0",
        ms=7,
        label=f"stated epsilon ({accountant.upper()}): {format_epsilon(eps[accountant])}",
    )
    if privacy.get("target_epsilon") is not None:
        ax.axhline(
            privacy["target_epsilon"],
            color="C3",
            ls="-",
            lw=1,
            label=f"target epsilon ({accountant.upper()}): "
            f"{format_epsilon(privacy['target_epsilon'])}",
        )
    planned = privacy.get("planned_steps")
    if report["status"] != RunStatus.COMPLETE and planned:
        # Show the whole plan so that the interruption is visible.
        ax.axvline(privacy["steps"], color="0.5", ls=":", lw=1, label="run stopped")
        ax.set_xlim(0, max(planned, privacy["steps"]) * 1.02)
    ax.set_xlabel("step")
    ax.set_ylabel(f"epsilon at delta = {format_delta(privacy['delta'])}")
    ax.set_title(f"Privacy spent ({accountant.upper()} accountant, which planned the run)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize="small")
    return fig


def _training_png(report: Mapping[str, Any]) -> bytes:
    history = report["history"]
    from matplotlib.ticker import MaxNLocator

    fig = _figure(9.6, 3.6, left=0.08, right=0.98, wspace=0.25)
    left, right = fig.subplots(1, 2)
    if history["step"]:
        left.plot(history["step"], _floats(history["loss"]), color="C0", lw=1)
        left.set_xlabel("step")
        left.set_ylabel("training loss")
        left.grid(alpha=0.3)
    else:
        _message(left, "no training steps recorded")
    left.set_title("Training loss")

    name = history["val_metric_name"]
    if history["val_epoch"]:
        right.plot(history["val_epoch"], _floats(history["val_metric"]), "o-", color="C1")
        right.set_xlabel("epoch")
        right.xaxis.set_major_locator(MaxNLocator(integer=True))
        right.set_ylabel(name)
        right.grid(alpha=0.3)
    else:
        _message(right, "no validation recorded")
    right.set_title(f"Validation {name}")
    return _png(fig)
