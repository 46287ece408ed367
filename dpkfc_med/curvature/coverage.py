"""The preconditioner's coverage table: what each layer and each fallback parameter gets."""

from __future__ import annotations

from typing import Any

from dpkfc_med.curvature.blocks import FallbackBlock, KroneckerBlock
from dpkfc_med.curvature.families import Family, family_spec

__all__ = ["coverage_rows", "coverage_shares"]


def coverage_rows(
    blocks: dict[str, KroneckerBlock],
    fallbacks: dict[str, FallbackBlock],
    family: Family | str,
) -> list[dict[str, Any]]:
    """One row per covered layer and per fallback parameter (the report's coverage columns)."""
    rows: list[dict[str, Any]] = []
    family = family_spec(family).name
    for name, b in blocks.items():
        g, n_a, n_g = b.dims
        rows.append(
            {
                "layer": name,
                "type": type(b.module).__name__,
                "adapter": b.adapter.name,
                "family": family,
                "groups": g,
                "A_dim": n_a,
                "G_dim": n_g,
                "A": "elementwise"
                if b.u_elem is not None
                else "kron"
                if b.a_kron is not None
                else f"rank {b.a_low.rank} + tail"
                if b.a_low is not None
                else "none"
                if b.u_a is None
                else ("diagonal" if b.u_a.dim() == 2 else "full"),
                "G": "elementwise"
                if b.u_elem is not None
                else "none"
                if b.u_g is None
                else ("diagonal" if b.u_g.dim() == 2 else "full"),
                "scale": b.scale,
                "params": sum(p.numel() for p in b.module.parameters(recurse=False)),
            }
        )
    for name, fb in fallbacks.items():
        rows.append(
            {
                "layer": name,
                "type": "parameter",
                "adapter": f"fallback:{'diagonal' if fb.diag is not None else 'identity'}",
                "family": family,
                "groups": 1,
                "A_dim": 0,
                "G_dim": 0,
                "A": "none",
                "G": "none",
                "scale": fb.scale,
                "params": fb.param.numel(),
            }
        )
    return rows


def coverage_shares(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Shares of the trainable parameters by what the coverage table gave them.

    Args:
        rows: :meth:`~dpkfc_med.curvature.preconditioner.KroneckerPreconditioner.coverage`
            rows.

    Returns:
        ``{"trainable": n, "full_block": share in a block of the family whose factors are
        full matrices (dense, low-rank plus tail, Kronecker-structured or elementwise for the
        diagonal family), "diagonal_block": share in a block whose activation-side factor
        was reduced to its diagonal (``max_factor_dim``), "fallback": share under the
        fallback rule}``; shares sum to 1.
    """
    total = sum(int(r["params"]) for r in rows)
    fallback = sum(int(r["params"]) for r in rows if str(r["adapter"]).startswith("fallback"))
    diagonal = sum(
        int(r["params"])
        for r in rows
        if not str(r["adapter"]).startswith("fallback") and r["A"] == "diagonal"
    )
    share = (lambda n: n / total) if total else (lambda n: 0.0)
    return {
        "trainable": total,
        "full_block": share(total - fallback - diagonal),
        "diagonal_block": share(diagonal),
        "fallback": share(fallback),
    }
