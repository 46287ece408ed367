r"""Structured forms of the input-side root ``U_A``: low rank plus a tail, or channels (x) kernel.

``U_A`` is the inverse square root of the damped input factor ``A`` (``[G, n_a, n_a]``). A
wide ``A`` keeps its top ``r`` eigenpairs exactly (:class:`LowRankA`: a row costs
``2 n_a r`` multiply-adds instead of ``n_a^2``); an ungrouped convolution may instead factor
``A`` over channels and kernel offsets (:class:`KronA`, ``conv_a: kron``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from dpkfc_med.curvature.linalg import EighFallback, robust_eigh
from dpkfc_med.curvature.roots import inverse_sqrt_with_spectrum

__all__ = ["KronA", "LowRankA", "kron_a_from_factor", "kron_eligible", "low_rank_of"]


def kron_eligible(module: nn.Module, a: Tensor) -> bool:
    """Ungrouped (non-transposed) convolution with a full ``A`` factor."""
    return (
        isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d))
        and module.groups == 1
        and a.dim() == 3
    )


@dataclass
class KronA:
    """``U_A = U_C (x) U_K`` (plus a bias scalar) for an ungrouped convolution.

    The patch layout is channel-major (``[C, K]``, then the bias coordinate when present), so
    a row ``x`` maps to ``vec(U_C X U_K)`` with ``X`` its ``C x K`` reshape: the same as the
    row times ``kron(U_C, U_K)`` (both factors are symmetric).
    """

    u_c: Tensor
    u_k: Tensor
    u_bias: float | None = None

    def __post_init__(self) -> None:
        c, k = self.u_c.shape[0], self.u_k.shape[0]
        # With one channel or one kernel offset (C + K >= C K) the explicit product is no
        # larger than its factors and one matmul beats C K tiny ones.
        self.dense = torch.kron(self.u_c, self.u_k) if c + k >= c * k else None

    @property
    def row_macs(self) -> int:
        """Multiply-adds to transform one row."""
        c, k = self.u_c.shape[0], self.u_k.shape[0]
        return c * k * min(c + k, c * k)

    def right_w(self, x: Tensor) -> Tensor:
        """``x [..., C K] -> x (U_C (x) U_K)`` on the last dimension (weight coordinates)."""
        if self.dense is not None:
            return x @ self.dense
        c, k = self.u_c.shape[0], self.u_k.shape[0]
        w = x.reshape(*x.shape[:-1], c, k)
        return (self.u_c @ w @ self.u_k).reshape(*x.shape[:-1], c * k)

    def mix_channels(self, x: Tensor) -> Tensor:
        """``U_C`` on the channels of a layer input ``[B, C, *S]``.

        Channel mixing is per position, so it commutes with padding (zeros, or copies of
        input positions) and with unfolding: the patches of the mixed input are the rows
        ``X -> U_C X``, and only ``U_K`` is left for the per-sample gradient. That costs
        ``S C^2`` per sample on the input instead of ``T C^2 K`` on the patches. (A
        ``groups=C`` convolution applying ``U_K`` as well is slower on CPU than the unfold it
        would replace.)
        """
        b, c = x.shape[:2]
        return torch.matmul(self.u_c, x.reshape(b, c, -1)).view(x.shape)

    def right_k(self, x: Tensor, scale: float = 1.0, out: Tensor | None = None) -> Tensor:
        """``s x (I (x) U_K)`` for ``x [..., C K]`` contiguous: one matmul (into ``out``)."""
        c, k = self.u_c.shape[0], self.u_k.shape[0]
        u_k = self.u_k if scale == 1.0 else self.u_k * scale
        split = (*x.shape[:-1], c, k)
        if out is None:
            return (x.reshape(split) @ u_k).reshape(x.shape)
        torch.matmul(x.reshape(split), u_k, out=out.view(split))
        return out

    def matrix(self) -> Tensor:
        """``[n_a, n_a]`` explicit ``U_A``: ``kron(U_C, U_K)``, then the bias scalar (tests)."""
        m = torch.kron(self.u_c, self.u_k)
        if self.u_bias is None:
            return m
        bias = torch.full((1, 1), self.u_bias, dtype=m.dtype, device=m.device)
        return torch.block_diag(m, bias)

    def right(self, x: Tensor) -> Tensor:
        """``x [..., n_a] -> x U_A`` on the last dimension."""
        ck = self.u_c.shape[0] * self.u_k.shape[0]
        out = self.right_w(x[..., :ck])
        if self.u_bias is None:
            return out
        return torch.cat([out, x[..., ck:] * self.u_bias], dim=-1)


def kron_a_from_factor(
    module: nn.Module,
    a: Tensor,
    damping: float,
    dtype: torch.dtype,
    out_dtype: torch.dtype,
    *,
    layer: str = "",
    record: list[EighFallback] | None = None,
) -> tuple[KronA, Tensor]:
    """Channel and kernel factors from the partial traces of ``A [1, n_a, n_a]``.

    Decomposed in ``dtype``; the returned factors are in ``out_dtype`` (the layer's).
    Decomposition fallbacks are recorded as parts ``"A_C"`` and ``"A_K"`` of ``layer``.
    """
    c = int(getattr(module, "in_channels"))  # noqa: B009 (checked by kron_eligible)
    k = math.prod(int(v) for v in getattr(module, "kernel_size"))  # noqa: B009
    ck = c * k
    w = a[0, :ck, :ck].reshape(c, k, c, k)
    a_c = torch.einsum("ikjk->ij", w) / k
    a_k = torch.einsum("ikil->kl", w) / c
    mean_k = torch.diagonal(a_k).mean()
    if mean_k > 0:  # tr(A_C (x) A_K) = tr(A_C) tr(A_K) = tr(A) with mean eig(A_K) = 1
        a_k = a_k / mean_k
    u_c, ev_c = inverse_sqrt_with_spectrum(
        a_c[None].to(dtype), damping, layer=layer, part="A_C", record=record
    )
    u_k, ev_k = inverse_sqrt_with_spectrum(
        a_k[None].to(dtype), damping, layer=layer, part="A_K", record=record
    )
    bias = (1.0 + damping) ** -0.5 if a.shape[-1] > ck else None
    evals = (ev_c[0][:, None] * ev_k[0][None, :]).reshape(1, -1)
    return KronA(u_c[0].to(out_dtype), u_k[0].to(out_dtype), bias), evals


def low_rank_of(n_a: int, rank_a: int | None) -> int | None:
    """The rank of a full ``n_a``-wide ``A`` under ``rank_a``; ``None``: it stays dense.

    Low-rank only where it saves work: a row costs ``2 n_a r`` multiply-adds instead of
    ``n_a^2``. The cost model (:mod:`.cost`) and :meth:`KroneckerPreconditioner.from_probes`
    share this rule.
    """
    return rank_a if rank_a is not None and n_a > 2 * rank_a else None


@dataclass
class LowRankA:
    r"""``U_A = c I + V diag(d) V^T`` per group: ``A``'s top ``r`` eigenpairs, the tail at its mean.

    With damped eigenvalues ``lambda_i`` (ascending) and eigenvectors ``v_i`` of ``A``, the
    top ``r`` directions keep ``lambda_i^{-1/2}`` and the ``n - r`` others share
    ``c = (mean_{tail} lambda)^{-1/2}``:

    .. math::

        U_A = c I + \sum_{i \in top} (\lambda_i^{-1/2} - c) v_i v_i^\top .

    Attributes:
        v: ``[G, n_a, r]`` top eigenvectors.
        d: ``[G, r]`` ``lambda_i^{-1/2} - c``.
        c: ``[G]`` the tail's inverse square root.
    """

    v: Tensor
    d: Tensor
    c: Tensor

    def __post_init__(self) -> None:
        n = self.v.shape[1]
        # (V diag(d))^T, formed once: the second product of a row needs no scaling pass.
        self.vd_t = (self.v * self.d[:, None]).transpose(-1, -2).contiguous()  # [G, r, n_a]
        # Row n-1 of U_A (the bias coordinate, when the layer has one): formed once.
        last = (self.v[:, n - 1, None] @ self.vd_t)[:, 0]
        last[:, n - 1] += self.c
        self.last_row = last
        # one group: c as a Python number (no device sync per product on GPUs)
        self.c_scalar = float(self.c[0]) if self.c.shape[0] == 1 else None

    @classmethod
    def from_factor(
        cls,
        factor: Tensor,
        damping: float,
        rank: int,
        out_dtype: torch.dtype | None = None,
        *,
        layer: str = "",
        record: list[EighFallback] | None = None,
        power: float = 0.5,
        part: str = "A",
    ) -> tuple[LowRankA, Tensor]:
        """From ``A [G, n, n]`` (``n > rank``); also returns the eigenvalues ``[G, n]``.

        Decomposed in ``factor``'s dtype; the operator is built in ``out_dtype`` (default the
        same), once. ``power``: the operator is ``A^{-power}`` on the kept directions and
        the tail (1/2 for K-FAC; Shampoo's ``R`` takes its exponent ``p``). A decomposition
        failure falls back as :func:`~dpkfc_med.curvature.linalg.robust_eigh` describes (the
        last resort gives ``U_A = c I``), recorded in ``record`` as ``part`` of ``layer``.
        """
        evals, evecs = robust_eigh(factor, layer=layer, part=part, record=record)
        lam = evals.clamp_min(0)
        lam = lam + damping * lam.mean(-1, keepdim=True)
        # an all-zero factor (a layer the probes do not reach) maps to the identity
        lam = torch.where(lam > 0, lam, torch.ones_like(lam))
        n = lam.shape[-1]
        c = lam[:, : n - rank].mean(-1).pow(-power)
        d = lam[:, n - rank :].pow(-power) - c[:, None]
        dt = out_dtype or factor.dtype
        v = evecs[:, :, n - rank :].to(dt).contiguous()
        return cls(v, d.to(dt), c.to(dt)), evals

    @property
    def rank(self) -> int:
        """``r``."""
        return int(self.v.shape[-1])

    @property
    def row_macs(self) -> int:
        """Multiply-adds to transform one row."""
        return 2 * self.v.shape[1] * self.rank

    def dense(self) -> Tensor:
        """``[G, n_a, n_a]`` explicit matrix (tests, small layers)."""
        eye = torch.eye(self.v.shape[1], dtype=self.v.dtype, device=self.v.device)
        return self.c[:, None, None] * eye + self.v @ self.vd_t

    def right_w(self, x: Tensor) -> Tensor:
        """``[x, 0] U_A`` for rows ``x [B, G, m, n_w]``, ``n_w`` = ``n_a`` or ``n_a - 1``.

        With ``n_w = n_a - 1`` the bias coordinate's row (``last_row``) is left out, as
        ``x U_A[:n_w]`` of a dense ``U_A``.
        """
        # one contiguous copy of (possibly strided, unfolded) rows serves both products
        x = x.contiguous()
        n_w, v, vd_t = x.shape[-1], self.v, self.vd_t
        if v.shape[0] == 1:  # 2D factors: one matrix product over all rows, not B of them
            v, vd_t = v[0], vd_t[0]
        y = torch.matmul(x, v[..., :n_w, :] if n_w < v.shape[-2] else v)  # [B, G, m, r]
        out = torch.matmul(y, vd_t)  # [B, G, m, n_a]
        if self.c_scalar is not None:  # one group: added without a temporary
            out[..., :n_w].add_(x, alpha=self.c_scalar)
        else:
            out[..., :n_w].add_(x * self.c[:, None, None])
        return out
