"""Fisher (Kronecker-factor) spectra of a network on a probe batch, for exploration.

Used by ``notebooks/probes_and_fisher_spectra.ipynb`` to compare pink, white and (by a data
custodian, privately) real-data factor spectra. Computing spectra on private data is *not*
private; the probe spectra are.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from dpkfc_med.curvature.factors import LossFn, estimate_factors

__all__ = ["effective_rank", "factor_spectra", "spectrum_table"]


def effective_rank(eigenvalues: Tensor) -> float:
    """``(sum lambda)^2 / sum lambda^2`` of non-negative eigenvalues (0 for a zero matrix)."""
    ev = eigenvalues.clamp_min(0).double()
    total = float(ev.sum())
    return total**2 / float((ev**2).sum()) if total > 0 else 0.0


def factor_spectra(
    model: nn.Module, inputs: Tensor, targets: Tensor, loss_fn: LossFn, **kwargs: Any
) -> dict[str, dict[str, Tensor]]:
    """Eigenvalues (descending) of every covered layer's ``A`` and ``G`` factors.

    Args:
        model: the network.
        inputs: probe (or data) inputs ``[M, ...]``.
        targets: their targets.
        loss_fn: per-sample loss ``(outputs, targets) -> [M]``.
        **kwargs: passed to :func:`~dpkfc_med.curvature.factors.estimate_factors`.

    Returns:
        ``{layer: {"A": [G * n_a], "G": [G * n_g]}}`` (groups concatenated).
    """
    out: dict[str, dict[str, Tensor]] = {}
    for name, f in estimate_factors(model, inputs, targets, loss_fn, **kwargs).items():
        spectra = {}
        for key, factor in (("A", f.a), ("G", f.g)):
            ev = factor.flatten() if factor.dim() == 2 else torch.linalg.eigvalsh(factor).flatten()
            spectra[key] = ev.sort(descending=True).values
        out[name] = spectra
    return out


def spectrum_table(spectra: dict[str, dict[str, Tensor]]) -> list[dict[str, Any]]:
    """One row per layer: factor sizes, largest eigenvalue and effective rank of A and G."""
    rows = []
    for name, s in spectra.items():
        rows.append(
            {
                "layer": name,
                "A_dim": len(s["A"]),
                "A_eff_rank": effective_rank(s["A"]),
                "G_dim": len(s["G"]),
                "G_eff_rank": effective_rank(s["G"]),
                "G_max": float(s["G"][0]),
            }
        )
    return rows
