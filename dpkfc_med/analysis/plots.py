"""Figures of the analysis results (matplotlib, imported lazily); each returns its figure.

Results built from private data (real-image spectra, oracle factors, run diagnostics) say so in
their titles or legends.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from dpkfc_med.analysis.alignment import FactorAlignment, eigenvalue_decay
from dpkfc_med.analysis.factor_sets import CurvatureFactors
from dpkfc_med.analysis.image_spectra import ImageSpectrum
from dpkfc_med.analysis.run_diagnostics import NOT_DP, RunDiagnostics

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "plot_alignment",
    "plot_clipped_fraction",
    "plot_eigenvalue_decay",
    "plot_image_spectra",
    "plot_layer_snr",
]


def _plt() -> Any:
    import matplotlib.pyplot as plt  # lazy: matplotlib is only needed for figures

    return plt


def _log_ticks(axis: Any) -> None:
    """Label a log axis with plain numbers, fewer per decade the more decades it spans.

    Matplotlib labels minor ticks as ``2 x 10^-1`` when the axis spans about one decade, and
    those labels run into each other; the density here keeps the labels apart.
    """
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    low, high = sorted(abs(v) for v in axis.get_view_interval())
    decades = math.log10(high / low) if low > 0 else math.inf
    if decades < 0.5:
        subs: tuple[float, ...] = tuple(range(1, 10))
    elif decades < 1:
        subs = (1.0, 2.0, 3.0, 5.0)
    else:
        subs = (1.0, 2.0, 5.0) if decades <= 2 else (1.0,)
    axis.set_major_locator(LogLocator(base=10, subs=subs))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def plot_image_spectra(
    spectra: Sequence[ImageSpectrum], *, title: str = "", normalise: bool = True
) -> Figure:
    """Radially averaged power spectra on log-log axes, each with its fitted power law.

    Args:
        spectra: Spectra to overlay (real images and probes).
        title: Figure title.
        normalise: Divide each spectrum by its power in the lowest fitted bin, so the slopes
            can be compared.
    """
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 4))
    for s in spectra:
        keep = (s.freqs >= s.fmin) & (s.freqs <= s.fmax)
        ref = float(s.power[keep][0]) if normalise else 1.0
        tag = " [private data]" if s.uses_private_data else ""
        (line,) = ax.loglog(s.freqs, s.power / ref, label=f"{s.label}{tag}: alpha={s.alpha:.2f}")
        f = s.freqs[keep]
        ax.loglog(f, s.fitted_power(f) / ref, "--", color=line.get_color(), lw=1)
    _log_ticks(ax.xaxis)
    ax.set_xlabel("radial frequency (cycles/mm)")
    ax.set_ylabel("power (normalised)" if normalise else "power")
    ax.set_title(title or "radially averaged power spectra (dashed: fit)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_eigenvalue_decay(
    sets: Mapping[str, CurvatureFactors],
    *,
    layers: Sequence[str] | None = None,
    title: str = "",
) -> Figure:
    """Eigenvalues over the largest, per layer (columns) and role (rows), one line per set.

    Args:
        sets: Factor sets by legend name (e.g. ``{"pink": ..., "white": ..., "oracle": ...}``).
        layers: Layers to show (default: all of the first set, in forward order).
        title: Figure title.
    """
    plt = _plt()
    from matplotlib.ticker import MaxNLocator

    first = next(iter(sets.values()))
    names = list(layers or first.layers)
    roles = first.roles
    fig, axes = plt.subplots(
        len(roles), len(names), figsize=(2.6 * len(names), 2.3 * len(roles)), squeeze=False
    )
    for j, layer in enumerate(names):
        for i, role in enumerate(roles):
            ax = axes[i][j]
            for name, fs in sets.items():
                ev = eigenvalue_decay(fs, layer, role).clamp_min(1e-12)
                tag = " (private, not DP)" if fs.uses_private_data else ""
                ax.semilogy(ev.numpy(), label=f"{name}{tag}", lw=1)
            ax.set_title(f"{layer}: {role}", fontsize=8)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            _log_ticks(ax.yaxis)
            ax.tick_params(which="both", labelsize=6)
    axes[0][0].legend(fontsize=6)
    fig.suptitle(title or f"{first.family.value} eigenvalue decay (lambda_i / lambda_1)")
    fig.tight_layout()
    return fig


_METRIC_NAMES = {
    "top1": "top-1 eigenvector |cos|",
    "subspace_overlap": "top-k subspace overlap",
    "rel_frobenius": "relative Frobenius error",
    "rel_frobenius_shape": "rel. Frobenius error (trace-normalised)",
    "rel_frobenius_inv_root": "rel. error of damped inverse root",
    "trace_ratio": "trace ratio (scale)",
}


def plot_alignment(
    rows: Mapping[str, Sequence[FactorAlignment]],
    *,
    metrics: Sequence[str] = ("top1", "subspace_overlap", "rel_frobenius_shape", "trace_ratio"),
    title: str = "",
) -> Figure:
    """Alignment measures against depth, one panel per measure, one line per set and role.

    Args:
        rows: :func:`~dpkfc_med.analysis.compare_factors` results by legend name.
        metrics: Measures to show (keys of :meth:`FactorAlignment.row`).
        title: Figure title (e.g. ``"small CNN vs oracle (private, not DP)"``).
    """
    plt = _plt()
    fig, axes = plt.subplots(1, len(metrics), figsize=(3.3 * len(metrics), 3), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        for name, rs in rows.items():
            for role in dict.fromkeys(r.role for r in rs):
                mine = [r for r in rs if r.role == role]
                ys = [r.row()[metric] for r in mine]
                ax.plot([r.depth for r in mine], ys, "o-", ms=3, lw=1, label=f"{name} {role}")
        ax.set_title(_METRIC_NAMES.get(metric, metric), fontsize=8)
        ax.set_xlabel("layer (forward order)", fontsize=7)
        ax.tick_params(labelsize=6)
        if metric == "trace_ratio":
            ax.set_yscale("log")
    axes[0][0].legend(fontsize=6)
    fig.suptitle(title or "alignment with the reference")
    fig.tight_layout()
    return fig


def plot_layer_snr(runs: Sequence[RunDiagnostics], *, title: str = "") -> Figure:
    """Mean per-layer SNR of the privatized update, runs side by side (log scale)."""
    plt = _plt()
    layers = list(dict.fromkeys(k for r in runs for k in r.layers))
    fig, ax = plt.subplots(figsize=(max(4.0, 1.1 * len(layers) + 2), 3.5))
    width = 0.8 / max(len(runs), 1)
    for i, r in enumerate(runs):
        xs = [j + (i - (len(runs) - 1) / 2) * width for j in range(len(layers))]
        ys = [r.mean_layer_snr.get(k, math.nan) for k in layers]
        ax.bar(xs, ys, width=width, label=r.label)
    ax.set_xticks(range(len(layers)))
    ax.set_xticklabels(layers, rotation=30, ha="right", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("SNR (signal / noise squared norm)")
    ax.set_title(title or f"per-layer SNR ({NOT_DP})", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_clipped_fraction(runs: Sequence[RunDiagnostics], *, title: str = "") -> Figure:
    """Per-step clipped fraction of each run (its mean where no per-step record exists)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(4.5, 3))
    for r in runs:
        if r.step:
            ax.plot(r.step, r.clipped_fraction, "o-", ms=3, label=r.label)
        else:
            ax.axhline(r.mean_clipped_fraction, label=f"{r.label} (mean)")
    ax.set_xlabel("step")
    ax.set_ylabel("fraction of units clipped")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title or f"clipped fraction ({NOT_DP})", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_benchmark_accuracy(
    rows: Sequence[Mapping[str, Any]], *, metric: str = "test AUROC", title: str = ""
) -> Figure:
    """Bars of a test metric per method, grouped by epsilon, with the seeds' std as error bars.

    Args:
        rows: :func:`~dpkfc_med.analysis.benchmark_accuracy` rows.
        metric: Axis label of the metric.
        title: Figure title.
    """
    plt = _plt()
    epsilons = list(dict.fromkeys(r["epsilon"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, ax = plt.subplots(figsize=(1.2 + 1.1 * len(epsilons) * len(methods) / 2, 3.2))
    width = 0.8 / max(len(methods), 1)
    for k, method in enumerate(methods):
        mine = {r["epsilon"]: r for r in rows if r["method"] == method}
        xs = [i + k * width for i, e in enumerate(epsilons) if e in mine]
        ax.bar(
            xs,
            [mine[e]["mean"] for e in epsilons if e in mine],
            width,
            yerr=[mine[e]["std"] for e in epsilons if e in mine],
            label=method,
            capsize=2,
        )
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(epsilons))])
    ax.set_xticklabels(["non-private" if e is None else f"epsilon {e:g}" for e in epsilons])
    ax.set_ylabel(metric)
    low = min(r["mean"] - r["std"] for r in rows)
    ax.set_ylim(max(0.0, low - 0.05), 1.0)
    ax.legend(fontsize=7)
    ax.set_title(title or f"{metric} per method (mean +- std over seeds)")
    fig.tight_layout()
    return fig
