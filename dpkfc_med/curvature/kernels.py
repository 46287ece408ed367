r"""Per-sample products of the blocks' kernels and their cost in multiply-adds.

Rows are ``[B, G, T, n]`` (samples, groups, positions, features: the adapters' layout),
per-sample gradients ``[B, G, n_g, n_a]``; a per-sample gradient is the sum over positions
of outer products, ``g_b = \sum_t \delta_{b,t} a_{b,t}^\top``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "grads_sq",
    "grads_times",
    "outer_sum",
    "raw_sq_norms",
    "rows_times",
    "transform_path_macs",
]


def grads_times(x: Tensor, u: Tensor) -> Tensor:
    """``x [B, G, r, n] @ U [G, n, m]`` per group (plain matmul when ``G = 1``)."""
    if u.shape[0] == 1:
        return x @ u[0]
    return torch.einsum("bgoi,gij->bgoj", x, u)


def rows_times(x: Tensor, u: Tensor | None) -> Tensor:
    """``x [B, G, r, n]`` times ``U`` per group: ``[G, n, n]``, diagonal ``[G, n]`` or ``None``."""
    if u is None:
        return x
    if u.dim() == 2:
        return x * u.unsqueeze(1)
    return grads_times(x, u)


def grads_sq(raw_w: Tensor, raw_b: Tensor | None) -> Tensor:
    """Squared per-sample norms ``[B]`` of per-sample weight (and bias) gradients."""
    out = raw_w.pow(2).flatten(1).sum(1)
    return out if raw_b is None else out + raw_b.pow(2).flatten(1).sum(1)


def raw_sq_norms(a: Tensor, delta: Tensor, has_bias: bool, raw_w: Tensor | None = None) -> Tensor:
    """Squared per-sample norms ``[B]`` of untransformed gradients from rows and errors."""
    if raw_w is None:
        raw_w = delta.transpose(-1, -2) @ a
    return grads_sq(raw_w[: a.shape[0]], delta.sum(-2) if has_bias else None)


def outer_sum(delta: Tensor, a: Tensor) -> Tensor:
    """Per-sample ``sum_t delta_t a_t^T``: ``[B, T, G, n_g], [B, T, G, n_a] -> [B, G, n_g, n_a]``.

    A batched matmul over ``(B, G)``; for ``G = 1`` it skips the permute copies an einsum makes.
    """
    if a.shape[2] == 1:
        return (delta[:, :, 0].transpose(1, 2) @ a[:, :, 0]).unsqueeze(1)
    return torch.einsum("btgo,btgi->bgoi", delta, a)


def transform_path_macs(
    *, positions: int, groups: int, n_a: int, n_g: int, a_row: int, full_g: bool
) -> tuple[int, int]:
    r"""Per-sample multiply-adds of a layer's transform on each path, beyond the raw gradient.

    With ``T`` positions, ``G`` groups and one row times ``U_A`` costing ``a_row``:

    * factored (transform the rows, then the outer product): ``T G (a_row + [full G] n_g^2)``;
    * materialized (outer product, then transform ``g``): ``G ([full G] n_g^2 n_a + n_g a_row)``.

    The one cost model of the transform: :meth:`KroneckerBlock.choose_path` picks the cheaper
    path with it and :func:`dpkfc_med.curvature.cost.transform_macs` (the refresh schedule and
    the cost benchmark) counts the path the block picks.

    Returns:
        ``(factored, materialized)``.
    """
    g_mat = int(full_g) * n_g * n_g
    factored = positions * groups * (a_row + g_mat)
    materialized = groups * (g_mat * n_a + n_g * a_row)
    return factored, materialized
