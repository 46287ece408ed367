r"""Ghost clipping in preconditioned coordinates: per-unit norms without per-sample gradients.

A covered layer's transformed per-sample gradient is a sum over its ``T`` positions (tokens,
voxels) of outer products of transformed rows,

.. math::

    \tilde g_i = \sum_t \tilde\delta_{it} \tilde a_{it}^T, \qquad
    \tilde\delta = s U_G \delta, \quad \tilde a = U_A [a; 1],

so inner products of two samples' gradients need only the rows (the ghost-norm identity,
Goodfellow 2015; Li et al. 2022):

.. math::

    \langle \tilde g_i, \tilde g_j \rangle
    = \sum_{t, s} (\tilde a_{it} \cdot \tilde a_{js}) (\tilde\delta_{it} \cdot \tilde\delta_{js}).

A unit (a patient with ``k`` samples) has the gradient ``sum_{i in u} g~_i`` and the squared
norm ``sum_{i, j in u} <g~_i, g~_j>`` (:func:`row_norms_sq`). Because the transform is linear
and does not depend on the batch, the clipped sum is formed in raw coordinates and
transformed once, ``sum_i c_i g~_i = s U_G (sum_i c_i g_i) U_A`` with
``sum_i c_i g_i = (c delta)^T [a; 1]`` one product over the batch's rows: no
``[B, n_g, n_a]`` tensor and no second backward pass. :class:`GhostRows` keeps one layer's
input and output error between the backward pass and the optimizer (rows and their
transform exist only while that layer is processed); :func:`ghost_path_wins` is the
per-layer choice between ghost norms and materialised per-sample gradients
(``privacy.clipping: auto``), from the layer's shapes only.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from enum import Enum

import torch
from torch import Tensor, nn

from dpkfc_med.curvature.blocks import KroneckerBlock

__all__ = [
    "Clipping",
    "GhostRows",
    "MAX_GHOST_POSITIONS",
    "ghost_path_wins",
    "pair_index",
    "row_norms_sq",
]


class Clipping(str, Enum):
    """``privacy.clipping``: how each unit's norm is computed.

    Ghost norms where they are cheaper (``auto``), wherever a layer allows them (``ghost``),
    or materialised per-sample gradients everywhere (``per_sample``). The clipped sum is the
    same in every mode (to float rounding).
    """

    AUTO = "auto"
    GHOST = "ghost"
    PER_SAMPLE = "per_sample"


MEMORY_PASS_MACS = 8
"""Multiply-adds one element of a materialised per-sample gradient is worth: it is written
once and read twice (its norm, the clipped sum), streaming memory at about a tenth of the
arithmetic rate of a CPU's matrix products."""

MAX_GHOST_POSITIONS = 4096
"""A layer with more positions per sample keeps materialised per-sample gradients even under
``privacy.clipping: ghost``: its ghost norm costs ``T^2 (n_a + n_g)`` multiply-adds per sample,
which for a 64^3 volume's first convolution (``T = 262144``) would take hours per step."""

PAIR_CHUNK_ELEMENTS = 1 << 22
"""Gram entries (pairs x groups x positions x positions) one chunk of a ghost norm may hold;
layers with more positions than fit are split into blocks of positions."""


def ghost_path_wins(
    *,
    positions: int,
    groups: int,
    n_a: int,
    n_g: int,
    factored: float = 0.0,
    materialized: float = 0.0,
) -> bool:
    r"""Whether ghost norms cost fewer multiply-adds per sample than a per-sample gradient.

    With ``T`` positions and ``G`` groups, the ghost path pays the two Gram matrices,
    ``G T^2 (n_a + n_g)``, and transforms the rows (``factored``); the per-sample path passes
    the gradient through memory, ``3 G n_a n_g`` elements at :data:`MEMORY_PASS_MACS` each,
    and transforms whichever is cheaper, rows or gradient (``min(factored, materialized)``:
    :func:`~dpkfc_med.curvature.kernels.transform_path_macs`; both 0 without a
    preconditioner). The outer product is paid on both paths (per sample, or once for the
    batch in the clipped sum). Only shapes enter: the choice never depends on data.
    """
    ghost = groups * positions * positions * (n_a + n_g) + factored
    per_sample = 3 * groups * n_a * n_g * MEMORY_PASS_MACS + min(factored, materialized)
    return ghost <= per_sample


def pair_index(unit_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Every ordered pair ``(i, j)`` of samples with the same unit id (``i == j`` included)."""
    ids = unit_ids.long()
    same = ids[:, None] == ids[None, :]
    i, j = same.nonzero(as_tuple=True)
    return i, j


def row_norms_sq(
    d: Tensor, a: Tensor, n_w: int, unit_ids: Tensor | None = None
) -> tuple[Tensor, Tensor | None]:
    """Squared norms of each unit's gradient ``sum_t d_t a_t^T``: ``(weight, bias or None)``.

    Args:
        d: ``[B, G, T, n_g]`` (transformed) output errors.
        a: ``[B, G, T, n_a]`` (transformed) input rows, the bias column last when
            ``n_a > n_w``.
        n_w: the weight's columns.
        unit_ids: ``[B]`` unit of every sample (``None``: every sample is a unit); units are
            numbered ``0 .. U-1`` with ``U = max(id) + 1``.
    """
    b, groups, t = d.shape[:3]
    a_w = a[..., :n_w]
    a_b = a[..., n_w:] if a.shape[-1] > n_w else None
    if unit_ids is None and t == 1:  # one position (Linear): ||d||^2 ||a||^2 per group
        dd = d.pow(2).sum(-1)[..., 0]
        w = (dd * a_w.pow(2).sum(-1)[..., 0]).sum(1)
        bias = None if a_b is None else (dd * a_b.pow(2).sum(-1)[..., 0]).sum(1)
        return w, bias
    if unit_ids is None:  # every sample its own unit: the pairs (i, i)
        ids = torch.arange(b, device=d.device)
        i = j = ids
    else:
        ids = unit_ids.long().to(d.device)
        i, j = pair_index(ids)
    n_units = int(ids.max()) + 1 if b else 0
    w_out = d.new_zeros(n_units)
    b_out = d.new_zeros(n_units) if a_b is not None else None
    # Gram blocks of at most PAIR_CHUNK_ELEMENTS entries: position blocks of tb x tb, then
    # as many pairs as fit, so that memory stays bounded for any T.
    tb = min(t, max(1, math.isqrt(PAIR_CHUNK_ELEMENTS // groups)))
    step = max(1, PAIR_CHUNK_ELEMENTS // (groups * tb * tb))
    for s in range(0, len(i), step):
        # pairs (i, i): slices, which view the rows instead of copying them
        ii: slice | Tensor = slice(s, s + step)
        jj: slice | Tensor = ii
        if unit_ids is not None:
            ii, jj = i[s : s + step], j[s : s + step]
        owners = ids[ii]  # the unit each pair's sum goes to
        w_acc = d.new_zeros(len(owners))
        b_acc = d.new_zeros(len(owners)) if a_b is not None else None
        for p in range(0, t, tb):
            d_i, aw_i = d[ii, :, p : p + tb], a_w[ii, :, p : p + tb]
            for q in range(0, t, tb):
                gram_d = d_i @ d[jj, :, q : q + tb].transpose(-1, -2)
                gram_w = aw_i @ a_w[jj, :, q : q + tb].transpose(-1, -2)
                w_acc += (gram_d * gram_w).sum((1, 2, 3))
                if b_acc is not None and a_b is not None:
                    gram_b = a_b[ii, :, p : p + tb] @ a_b[jj, :, q : q + tb].transpose(-1, -2)
                    b_acc += (gram_d * gram_b).sum((1, 2, 3))
        w_out.index_add_(0, owners, w_acc)
        if b_out is not None and b_acc is not None:
            b_out.index_add_(0, owners, b_acc)
    return w_out, b_out


def _cat_norms(
    parts: list[tuple[Tensor, Tensor | None]], b: int, has_bias: bool, like: Tensor
) -> tuple[Tensor, Tensor | None]:
    """Per-slice ``(weight, bias)`` norms joined in sample order (an empty batch: zeros)."""
    if not parts:
        return like.new_zeros(b), (like.new_zeros(b) if has_bias else None)
    w = torch.cat([w for w, _ in parts])
    biases = [x for _, x in parts if x is not None]
    return w, (torch.cat(biases) if has_bias and biases else None)


NORM_CHUNK_ELEMENTS = 1 << 18
"""Transformed rows (elements) one slice of a ghost norm forms at once (at least one whole
unit): 1 MiB in float32, a piece the matrix products keep in cache."""

SUM_CHUNK_ELEMENTS = 1 << 24
"""Raw rows (elements) one chunk of a clipped sum may unfold at once (64 MiB in float32)."""


@dataclass
class GhostRows:
    """One covered layer's inputs and output errors of a batch, kept for ghost clipping.

    Only what the backward pass hands the hook is kept (the layer's input and output error,
    per use of the layer): rows (unfolded patches) and their transform exist only while one
    layer's norms or clipped sum is computed, so a step holds one layer's rows at a time.

    Attributes:
        module: the layer.
        block: its transform (one without factors: the identity, for DP-SGD).
        uses: ``(input, output error)`` of every use of the layer in the pass.
    """

    module: nn.Module
    block: KroneckerBlock
    uses: list[tuple[Tensor, Tensor]]
    closed: bool = False
    """Set when the layer's last use in the backward pass has been seen."""

    @property
    def has_bias(self) -> bool:
        """Whether the layer's gradient has a bias column."""
        bias = getattr(self.module, "bias", None)
        return bias is not None and bias.requires_grad

    def extend(self, other: GhostRows) -> None:
        """Add a further use of the layer in the same pass (its positions join the sum)."""
        self.uses += other.uses

    def _raw(self, sl: slice | Tensor = slice(None)) -> tuple[Tensor, Tensor]:
        """Raw rows ``[b, G, T, n_w]`` and errors ``[b, G, T, n_g]`` of samples ``sl``.

        ``sl``: a slice (views) or sample indices (copies).
        """
        adapter, module = self.block.adapter, self.module
        assert adapter.rows is not None and adapter.error_rows is not None
        parts = [
            (adapter.rows(module, x[sl]), adapter.error_rows(module, e[sl])) for x, e in self.uses
        ]
        if len(parts) == 1:
            return parts[0]
        return torch.cat([r for r, _ in parts], dim=2), torch.cat([e for _, e in parts], dim=2)

    def norms_sq(self, unit_ids: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """Squared norms of each unit's transformed gradient: ``(weight [U], bias [U] or None)``.

        ``unit_ids``: as for :func:`row_norms_sq`. Transformed rows exist for one slice of
        whole units at a time (:data:`NORM_CHUNK_ELEMENTS`).
        """
        n_w = self.block.dims[1] - self.has_bias
        b = self.uses[0][0].shape[0]
        _, n_a, n_g = self.block.dims
        # The rows' transform runs on cache-sized slices of whole units (as the per-sample
        # path's chunks do): NORM_CHUNK_ELEMENTS transformed rows, at least one unit.
        per_sample = sum(e[:1].numel() for _, e in self.uses) * n_a // n_g
        step = max(1, NORM_CHUNK_ELEMENTS // max(per_sample, 1))
        if unit_ids is None:  # every sample its own unit: slices view the rows
            parts = []
            for s in range(0, b, step):
                rows, err = self._raw(slice(s, s + step))
                parts.append(row_norms_sq(*self.block.transformed_rows(rows, err), n_w))
            return _cat_norms(parts, b, self.has_bias, self.uses[0][1])
        ids = unit_ids.long().to(self.uses[0][1].device)
        n_units = int(ids.max()) + 1 if b else 0
        order = torch.sort(ids, stable=True).indices
        sorted_ids = ids[order]
        # chunk ends fall between units: after at least `step` samples, at the next new unit
        ends = (torch.nonzero(sorted_ids[1:] != sorted_ids[:-1]).flatten() + 1).tolist() + [b]
        w_out = ids.new_zeros(n_units, dtype=self.uses[0][1].dtype)
        b_out = w_out.clone() if self.has_bias else None
        s = 0
        while s < b:
            e = ends[bisect.bisect_left(ends, min(s + step, b))]
            idx = order[s:e]
            owners, local = torch.unique_consecutive(sorted_ids[s:e], return_inverse=True)
            rows, err = self._raw(idx)
            w, bias = row_norms_sq(*self.block.transformed_rows(rows, err), n_w, local)
            w_out[owners] = w
            if b_out is not None and bias is not None:
                b_out[owners] = bias
            s = e
        return w_out, b_out

    def clipped_sum(self, coef: Tensor) -> tuple[Tensor, Tensor | None]:
        """``sum_i coef_i g~_i`` as ``(weight [G, n_g, n_w], bias [G, n_g] or None)``.

        ``coef``: ``[B]`` per-sample factor (the clip factor of the sample's unit). The
        transform is linear and does not depend on the batch, so the weighted sum is formed
        from raw rows, ``sum_i coef_i g_i``, and transformed once: ``s U_G (.) U_A``.
        """
        g, n_a, n_g = self.block.dims
        b = self.uses[0][0].shape[0]
        summed = self.block.adapter.summed_grad
        if summed is not None:  # the layer's own weight-gradient kernel on weighted errors
            raw = sum(
                summed(self.module, x, e * coef.to(e.dtype).view(-1, *[1] * (e.dim() - 1)))
                for x, e in self.uses
            )
            full = self.block.transform_grads(raw.unsqueeze(0))[0]  # type: ignore[union-attr]
            n_w = n_a - self.has_bias
            return full[..., :n_w], (full[..., n_w] if self.has_bias else None)
        # a sample's rows: G T n_w elements, from its errors' G T n_g
        per_sample = sum(e[:1].numel() for _, e in self.uses) * n_a // n_g
        raw = self.uses[0][1].new_zeros(g, n_g, n_a)
        step = max(1, SUM_CHUNK_ELEMENTS // max(per_sample, 1))
        for s in range(0, b, step):
            rows, err = self._raw(slice(s, s + step))
            err = err * coef[s : s + step].to(err.dtype).view(-1, 1, 1, 1)
            # [G, n_g, b T] @ [G, b T, n_w]: one product for the chunk
            left = err.permute(1, 3, 0, 2).reshape(g, n_g, -1)
            n_w = rows.shape[-1]
            raw[..., :n_w] += left @ rows.permute(1, 0, 2, 3).reshape(g, -1, n_w)
            if self.has_bias:
                raw[..., -1] += left.sum(-1)
        full = self.block.transform_grads(raw.unsqueeze(0))[0]
        n_w = n_a - self.has_bias
        return full[..., :n_w], (full[..., n_w] if self.has_bias else None)
