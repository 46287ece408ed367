"""Probe-only KFAC curvature: hooks, layer adapters, Kronecker factors, preconditioner."""

from dpkfc_med.curvature.adapters import LayerAdapter, adapter_for, register_adapter
from dpkfc_med.curvature.factors import KroneckerFactors, covered_layers, estimate_factors
from dpkfc_med.curvature.preconditioner import (
    KroneckerBlock,
    KroneckerPreconditioner,
    PreconditionerConfig,
    coverage_shares,
    coverage_summary,
    inverse_sqrt,
)

__all__ = [
    "KroneckerBlock",
    "KroneckerFactors",
    "KroneckerPreconditioner",
    "LayerAdapter",
    "PreconditionerConfig",
    "adapter_for",
    "covered_layers",
    "coverage_shares",
    "coverage_summary",
    "estimate_factors",
    "inverse_sqrt",
    "register_adapter",
]
