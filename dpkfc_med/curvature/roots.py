r"""Inverse roots of damped Kronecker factors, with the factor's spectrum.

For a factor ``F`` (``[G, n, n]``, or its diagonal ``[G, n]``) and a relative damping
``lambda``, the root is

.. math::

    U = \left(F + \lambda\, \bar\mu(F)\, I\right)^{-p}, \qquad
    \bar\mu(F) = \operatorname{tr}(F) / n ,

with ``p = 1/2`` for K-FAC (Shampoo takes ``p = 1/4``); eigenvalues below 0 (round-off) are
clamped before damping, and a factor the probe loss does not reach (all zero) maps to ``I``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dpkfc_med.curvature.linalg import EighFallback, robust_eigh

__all__ = ["inverse_sqrt", "inverse_sqrt_with_spectrum"]


def inverse_sqrt(factor: Tensor, damping: float) -> Tensor:
    """``(F + damping * mean_eig(F) * I)^{-1/2}`` for ``[G, n, n]`` (or diagonal ``[G, n]``).

    Eigenvalues are clamped at 0 before damping (round-off can make them slightly negative).
    An all-zero factor (a layer the probe loss does not reach) maps to the identity. A
    decomposition failure falls back as :func:`~dpkfc_med.curvature.linalg.robust_eigh`
    describes (logged, never raised).
    """
    return inverse_sqrt_with_spectrum(factor, damping)[0]


def inverse_sqrt_with_spectrum(
    factor: Tensor,
    damping: float,
    *,
    layer: str = "",
    part: str = "",
    record: list[EighFallback] | None = None,
    power: float = 0.5,
) -> tuple[Tensor, Tensor]:
    """:func:`inverse_sqrt` and the factor's eigenvalues ``[G, n]`` (one decomposition).

    ``layer``, ``part`` and ``record`` label and collect decomposition fallbacks
    (:func:`~dpkfc_med.curvature.linalg.robust_eigh`). ``power``: the inverse root taken,
    ``(F + damping * mean_eig)^{-power}`` (1/2 by default; Shampoo uses 1/4).
    """
    if factor.dim() == 2:
        mean = factor.mean(dim=-1, keepdim=True)
        lam = factor.clamp_min(0) + damping * mean
        out = lam.rsqrt() if power == 0.5 else lam.pow(-power)
        return torch.where(mean > 0, out, torch.ones_like(out)), factor
    # Decompose the damped matrix: a factor with many exactly-zero rows (e.g. conv taps that
    # only ever see padding) can make LAPACK's eigh fail to converge; the shift fixes that and
    # changes nothing else (same eigenvectors, eigenvalues shifted by the damping).
    n = factor.shape[-1]
    mean = (torch.diagonal(factor, dim1=-2, dim2=-1).sum(-1) / n).clamp_min(0)  # = mean eig
    shift = (damping * mean)[:, None, None] * torch.eye(n, dtype=factor.dtype, device=factor.device)
    lam, evecs = robust_eigh(factor + shift, layer=layer, part=part, record=record)
    evals = lam - damping * mean[:, None]
    # eigenvalues of the undamped factor are clamped at 0, i.e. lam at damping * mean
    lam = torch.maximum(lam, damping * mean[:, None])
    ok = (mean > 0)[:, None]
    lam = lam.clamp_min(torch.finfo(lam.dtype).tiny)
    inv = torch.where(ok, lam.rsqrt() if power == 0.5 else lam.pow(-power), torch.ones_like(lam))
    return (evecs * inv.unsqueeze(-2)) @ evecs.transpose(-1, -2), evals
