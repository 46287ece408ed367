r"""Per-layer blocks of the preconditioner: inverse roots, the ``U_A`` forms and the kernels.

A :class:`KroneckerBlock` is one covered layer's transform ``g -> s U_G g U_A`` with its
per-sample kernels (from the layer's rows, or on materialised per-sample gradients) and their
cost in multiply-adds (:func:`transform_path_macs`, shared with the refresh schedule and the
cost benchmark); ``U_A`` is dense, low rank (:class:`LowRankA`) or a Kronecker product over
channels and kernel offsets (:class:`KronA`). A :class:`FallbackBlock` scales a parameter no
adapter covers. The network-level operator that holds them is
:class:`~dpkfc_med.curvature.preconditioner.KroneckerPreconditioner`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from dpkfc_med.curvature.adapters import LayerAdapter
from dpkfc_med.curvature.linalg import EighFallback, robust_eigh

__all__ = [
    "FallbackBlock",
    "KronA",
    "KroneckerBlock",
    "LowRankA",
    "inverse_sqrt",
    "kron_a_from_factor",
    "kron_eligible",
    "inverse_sqrt_with_spectrum",
    "low_rank_of",
    "outer_sum",
    "raw_norms_sq",
    "transform_path_macs",
]


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


def kron_eligible(module: nn.Module, a: Tensor) -> bool:
    """Ungrouped (non-transposed) convolution with a full ``A`` factor."""
    return (
        isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d))
        and module.groups == 1
        and a.dim() == 3
    )


def _grads_times(x: Tensor, u: Tensor) -> Tensor:
    """``x [B, G, r, n] @ U [G, n, m]`` per group (plain matmul when ``G = 1``)."""
    if u.shape[0] == 1:
        return x @ u[0]
    return torch.einsum("bgoi,gij->bgoj", x, u)


def _rows_times(x: Tensor, u: Tensor | None) -> Tensor:
    """``x [B, G, r, n]`` times ``U`` per group: ``[G, n, n]``, diagonal ``[G, n]`` or ``None``."""
    if u is None:
        return x
    if u.dim() == 2:
        return x * u.unsqueeze(1)
    return _grads_times(x, u)


def grads_sq(raw_w: Tensor, raw_b: Tensor | None) -> Tensor:
    """Squared per-sample norms ``[B]`` of per-sample weight (and bias) gradients."""
    out = raw_w.pow(2).flatten(1).sum(1)
    return out if raw_b is None else out + raw_b.pow(2).flatten(1).sum(1)


def _raw_sq(a: Tensor, delta: Tensor, has_bias: bool, raw_w: Tensor | None = None) -> Tensor:
    """Squared per-sample norms ``[B]`` of untransformed gradients from rows and errors."""
    if raw_w is None:
        raw_w = delta.transpose(-1, -2) @ a
    return grads_sq(raw_w[: a.shape[0]], delta.sum(-2) if has_bias else None)


def raw_norms_sq(block: KroneckerBlock, a: Tensor, delta: Tensor) -> Tensor:
    """Squared raw per-sample norms ``[B]`` of ``block``'s layer from rows ``[B, G, T, n_w]``."""
    return _raw_sq(a, delta, block.dims[1] > a.shape[-1])


def outer_sum(delta: Tensor, a: Tensor) -> Tensor:
    """Per-sample ``sum_t delta_t a_t^T``: ``[B, T, G, n_g], [B, T, G, n_a] -> [B, G, n_g, n_a]``.

    A batched matmul over ``(B, G)``; for ``G = 1`` it skips the permute copies an einsum makes
    (2x faster on CPU for the small CNN's conv2).
    """
    if a.shape[2] == 1:
        return (delta[:, :, 0].transpose(1, 2) @ a[:, :, 0]).unsqueeze(1)
    return torch.einsum("btgo,btgi->bgoi", delta, a)


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
        ``groups=C`` convolution applying ``U_K`` as well was measured 3x slower than the
        unfold it would replace, on CPU.)
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


@dataclass
class KroneckerBlock:
    """Transform ``g -> s U_G g U_A`` of one covered layer (``None`` factors are identities).

    Attributes:
        name: dotted module name.
        module: the layer.
        adapter: its layout adapter.
        u_a: ``[G, n_a, n_a]``, diagonal ``[G, n_a]`` or ``None``.
        u_g: ``[G, n_g, n_g]``, diagonal ``[G, n_g]`` or ``None``.
        scale: the scalar ``s``.
        a_kron: structured ``U_A = U_C (x) U_K`` (``conv_a="kron"``); replaces ``u_a``.
        a_low: low-rank-plus-tail ``U_A`` (``rank_a``); replaces ``u_a``.
        u_elem: elementwise transform ``[G, n_g, n_a]`` (the diagonal family), applied to
            the materialised per-sample gradient before ``U_G`` / ``U_A`` (which are then
            ``None``).
    """

    name: str
    module: nn.Module
    adapter: LayerAdapter
    u_a: Tensor | None = None
    u_g: Tensor | None = None
    scale: float = 1.0
    a_kron: KronA | None = None
    a_low: LowRankA | None = None
    u_elem: Tensor | None = None

    @property
    def dims(self) -> tuple[int, int, int]:
        """``(G, n_a, n_g)``."""
        return self.adapter.dims(self.module)

    def cost(self, b: int, t: int) -> tuple[float, float]:
        """Multiply-adds of ``b`` samples' transformed gradients at ``t`` positions each.

        Returns:
            ``(factored, materialized)``: transforming the rows ``a`` and errors ``delta``,
            or the per-sample gradient. The refresh schedule and the cost benchmark use the
            same model (:func:`transform_path_macs`).
        """
        g, n_a, n_g = self.dims
        full_a = self.u_a is not None and self.u_a.dim() == 3
        a_row = full_a * n_a * n_a  # one row times U_A
        if self.a_kron is not None or self.a_low is not None:
            a_row = (self.a_kron or self.a_low).row_macs  # type: ignore[union-attr]
        factored, materialized = transform_path_macs(
            positions=t,
            groups=g,
            n_a=n_a,
            n_g=n_g,
            a_row=a_row,
            full_g=self.u_g is not None and self.u_g.dim() == 3,
        )
        base = t * g * n_a * n_g  # the raw outer product, on both paths
        return float(b * (base + factored)), float(b * (base + materialized))

    def _square(self, u: Tensor | None, n: int, like: Tensor) -> Tensor:
        """A factor as ``[G, n, n]`` (diagonal embedded, ``None`` the identity)."""
        groups = self.dims[0]
        if u is None:
            return torch.eye(n, dtype=like.dtype, device=like.device).repeat(groups, 1, 1)
        return torch.diag_embed(u) if u.dim() == 2 else u

    def dense(self) -> Tensor:
        """The block's operator on ``vec(g)`` as one explicit matrix (tests, small layers).

        ``g`` is ``[G, n_g, n_a]`` flattened row-major, so ``vec(U_G X U_A) = (U_G (x)
        U_A^T) vec(X)``: one such block per group, right-multiplied by ``diag(vec(u_elem))``
        and times ``s``. Built from the factors, independently of :meth:`transform_grads`.

        Returns:
            ``[G n_g n_a, G n_g n_a]``.
        """
        g, n_a, n_g = self.dims
        like = next(p for p in self.module.parameters(recurse=False))
        if self.a_kron is not None:
            u_a = self.a_kron.matrix().unsqueeze(0)
        elif self.a_low is not None:
            u_a = self.a_low.dense()
        else:
            u_a = self._square(self.u_a, n_a, like)
        u_g = self._square(self.u_g, n_g, like)
        parts = []
        for k in range(g):
            m = torch.kron(u_g[k].contiguous(), u_a[k].transpose(0, 1).contiguous())
            if self.u_elem is not None:
                m = m * self.u_elem[k].reshape(1, -1)
            parts.append(m)
        return self.scale * torch.block_diag(*parts)

    @property
    def is_identity(self) -> bool:
        """No factor at all: the transform is ``s I`` (DP-SGD's blocks)."""
        return (
            self.u_a is None
            and self.u_g is None
            and self.a_kron is None
            and self.a_low is None
            and self.u_elem is None
        )

    def choose_path(self, b: int, t: int) -> str:
        """The cheaper way to form transformed per-sample gradients.

        ``"factored"`` transforms ``a`` and ``delta``; ``"materialized"`` transforms the
        per-sample gradient; the one with fewer multiply-adds wins.
        """
        if self.u_elem is not None:  # an elementwise transform needs the per-sample gradient
            return "materialized"
        factored, materialized = self.cost(b, t)
        return "factored" if factored <= materialized else "materialized"

    def raw_grads(self, x: Tensor, dy: Tensor, chunk: int | None = None) -> Tensor:
        """Untransformed per-sample gradients ``[B, G, n_g, n_a]`` from layer input/output error.

        Layers with an unfold-free formula (transposed convolutions) use it; others unfold
        ``chunk`` samples at a time, so a 64^3 volume never holds the whole batch's patches.
        By default a chunk holds at most ``2^20`` patch elements (at least one sample): the
        small CNN's 16 calibration samples go in one piece, a 64^3 volume one at a time.
        """
        ad, module = self.adapter, self.module
        if ad.param_grads is not None:
            return ad.from_params(module, ad.param_grads(module, x, dy))
        if chunk is None:
            g, n_a, n_g = self.dims
            rows = max(1, math.prod(dy.shape[1:]) // (g * n_g)) * g * n_a  # T G n_a
            chunk = max(1, (1 << 20) // rows)
        parts = [
            outer_sum(
                ad.errors(module, dy[s : s + chunk]), ad.activations(module, x[s : s + chunk])
            )
            for s in range(0, x.shape[0], chunk)
        ]
        if not parts:  # an empty (Poisson) batch
            g, n_a, n_g = self.dims
            return x.new_zeros(0, g, n_g, n_a)
        return torch.cat(parts)

    def transform_grads(self, grads: Tensor) -> Tensor:
        """``[B, G, n_g, n_a] -> s U_G (u_elem * grads) U_A`` (the literal per-sample product)."""
        out = grads if self.u_elem is None else grads * self.u_elem
        if self.a_kron is not None:
            out = self.a_kron.right(out)
        elif self.a_low is not None:
            out = self.a_low.right_w(out)
        elif self.u_a is not None:
            if self.u_a.dim() == 2:
                out = out * self.u_a.unsqueeze(1)
            else:
                out = _grads_times(out, self.u_a)
        if self.u_g is not None:
            if self.u_g.dim() == 2:
                out = out * self.u_g.unsqueeze(-1)
            else:
                # U_G symmetric: U_G X = (X^T U_G)^T, a right product again
                out = _grads_times(out.transpose(-1, -2), self.u_g).transpose(-1, -2)
        return out * self.scale if self.scale != 1.0 else out

    def _times_a(
        self, x: Tensor, has_bias: bool, applied: bool = False
    ) -> tuple[Tensor, Tensor | float | None]:
        """Rows ``x [B, G, r, n_w]`` (any strides) with a bias coordinate ``xb`` times ``U_A``.

        Returns ``(out, c)``. For a full ``U_A`` with a bias, ``out = x U_A[:n_w]`` has all
        ``n_a`` columns and ``c`` is ``None`` (the bias row's share ``xb U_A[n_w]`` is for the
        caller to add). Otherwise ``out = x U_ww`` has ``n_w`` columns and the bias
        coordinate maps to ``c * xb`` (``U_A`` is block-diagonal there; ``c`` is ``None``
        without a bias). ``applied``: ``x`` comes from a channel-mixed input
        (:meth:`KronA.mix_channels`; only ``U_K`` is left).
        """
        n_w = x.shape[-1]
        u = self.u_a
        if u is not None and u.dim() == 3:
            return _grads_times(x, u[:, :n_w] if has_bias else u), None
        if self.a_low is not None:
            return self.a_low.right_w(x), None
        c: Tensor | float
        if self.a_kron is not None:
            kron = self.a_kron
            out, c = (kron.right_k(x) if applied else kron.right_w(x)), kron.u_bias or 1.0
        elif u is not None:  # diagonal [G, n_a]
            out, c = x * u[:, None, :n_w], u[:, n_w:]
        else:
            out, c = x, 1.0
        return out, (c if has_bias else None)

    def _a_bias_row(self) -> Tensor:
        """Row ``n_a - 1`` of a full or low-rank ``U_A`` (the bias coordinate): ``[G, n_a]``."""
        if self.a_low is not None:
            return self.a_low.last_row
        assert self.u_a is not None and self.u_a.dim() == 3
        return self.u_a[:, -1]

    def _times_g_into(self, x: Tensor, out: Tensor) -> Tensor:
        """``out = s U_G x`` for ``x [B, G, n_g, m]`` (``U_G`` symmetric), in one pass."""
        u, s = self.u_g, self.scale
        if u is None:
            return torch.mul(x, s, out=out)
        if u.dim() == 2:
            return torch.mul(x, u.unsqueeze(-1) * s, out=out)
        torch.matmul(u[0] if u.shape[0] == 1 else u, x, out=out)
        return out.mul_(s) if s != 1.0 else out

    def _factored_rows(
        self, a: Tensor, delta: Tensor, has_bias: bool
    ) -> tuple[Tensor, Tensor, Tensor | float | None]:
        """Factored rows ``(s U_G delta, a U_A, c)``.

        ``U_G`` and the scale act on the errors (rows times symmetric ``U_G``), ``U_A`` on
        the inputs with the bias coordinate 1 (see :meth:`_times_a` for ``c``; a full or
        low-rank ``U_A``'s bias row is added here).
        """
        d = _rows_times(delta, self.u_g)
        d = d * self.scale if self.scale != 1.0 else d
        a_t, c = self._times_a(a, has_bias)
        if has_bias and c is None:
            a_t = a_t.add_(self._a_bias_row()[:, None])
        return d, a_t, c

    def transformed_rows(self, a: Tensor, delta: Tensor) -> tuple[Tensor, Tensor]:
        r"""Rows whose outer products sum to the transformed per-sample gradient.

        ``s U_G (\sum_t \delta_t [x_t, 1]^T) U_A = \sum_t \tilde\delta_t \tilde a_t^T`` with
        ``\tilde\delta = s U_G \delta`` and ``\tilde a = U_A [x; 1]`` (ghost clipping,
        :mod:`dpkfc_med.privacy.ghost`).

        Args:
            a: ``[B, G, T, n_w]`` rows (the adapter's ``rows``).
            delta: ``[B, G, T, n_g]`` output errors (``error_rows``).

        Returns:
            ``([B, G, T, n_g], [B, G, T, n_a])``; the bias column (if any) last.

        Raises:
            ValueError: for an elementwise (diagonal-family) transform, which acts on the
                per-sample gradient and has no row form.
        """
        if self.u_elem is not None:
            raise ValueError(
                f"{self.name}: an elementwise transform (family 'diagonal') has no row form; "
                "its layers need per-sample gradients (privacy.clipping: per_sample or auto)"
            )
        has_bias = self.dims[1] > a.shape[-1]
        d, a_t, c = self._factored_rows(a, delta, has_bias)
        if has_bias and c is not None:
            col = torch.as_tensor(c, dtype=a_t.dtype, device=a_t.device).reshape(1, -1, 1, 1)
            a_t = torch.cat([a_t, col.expand(*a_t.shape[:-1], 1)], dim=-1)
        return d, a_t

    def sample_grads(
        self,
        a: Tensor,
        delta: Tensor,
        *,
        path: str | None = None,
        raw_norms: int = 0,
        mixed: bool = False,
        out: tuple[Tensor, Tensor | None] | None = None,
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        r"""Transformed per-sample gradients from layer-input rows and output errors.

        ``s U_G (\sum_t \delta_t [x_t, 1]^T) U_A`` for rows ``x_t`` whose bias coordinate
        1 is never materialised: ``U_A`` acts as its leading ``n_w`` rows plus its bias row.
        The same result as :meth:`transform_grads` of the raw per-sample gradient.

        Args:
            a: ``[B, G, T, n_w]`` rows (the adapter's ``rows``; any strides).
            delta: ``[B, G, T, n_g]`` output errors (``error_rows``).
            path: force ``"factored"`` or ``"materialized"`` (default: cheaper one).
            raw_norms: also return the squared untransformed per-sample norms of the first
                this many samples (diagnostics).
            mixed: ``a`` are rows of the input after :meth:`KronA.mix_channels` (``U_C``
                already applied; ``U_K`` is applied to the per-sample gradient, on the
                materialized path). Raw norms then need unmixed rows: use :func:`raw_norms_sq`.
            out: contiguous ``([B, G, n_g, n_w], [B, G, n_g] or None)`` buffers to write
                the result into (each result is written once; on CPU every fresh large
                temporary costs page faults comparable to its arithmetic).

        Returns:
            ``(weight [B, G, n_g, n_w], bias [B, G, n_g] or None, raw_sq [raw_norms] or
            None)``; the ``out`` buffers when given.
        """
        b, g, t, n_w = a.shape
        n_g = delta.shape[-1]
        has_bias = self.dims[1] > n_w
        if mixed and self.a_kron is None:
            raise ValueError(f"{self.name}: mixed rows need a kron U_A (conv_a='kron')")
        if mixed and raw_norms:
            raise ValueError("raw norms need unmixed rows; use raw_norms_sq()")
        w_out, b_out = out if out is not None else (None, None)
        if w_out is None:
            w_out = a.new_empty(b, g, n_g, n_w)
        if has_bias and b_out is None:
            b_out = a.new_empty(b, g, n_g)
        path = (
            "materialized" if mixed or self.u_elem is not None else (path or self.choose_path(b, t))
        )
        raw_w = delta.transpose(-1, -2) @ a if path == "materialized" else None
        raw_b = delta.sum(-2) if has_bias else None  # [B, G, n_g]
        raw_sq = None
        if raw_norms > 0:
            raw_sq = _raw_sq(a[:raw_norms], delta[:raw_norms], has_bias, raw_w)
        if raw_w is None:
            # factored: transformed rows, then one product per sample
            d, a_t, c = self._factored_rows(a, delta, has_bias)
            d_cols = d.transpose(-1, -2)
            # one position (Linear): the outer product as a broadcast, not a K=1 matmul
            prod = torch.mul if t == 1 else torch.matmul
            prod(d_cols, a_t[..., :n_w], out=w_out)
            if b_out is not None:
                if c is None:
                    prod(d_cols, a_t[..., n_w:], out=b_out.unsqueeze(-1))
                else:
                    torch.mul(d.sum(-2), c, out=b_out)
            return w_out, b_out, raw_sq
        assert raw_w is not None
        self.transform_raw(raw_w, raw_b, (w_out, b_out), mixed=mixed)
        return w_out, b_out, raw_sq

    def transform_raw(
        self,
        raw_w: Tensor,
        raw_b: Tensor | None,
        out: tuple[Tensor, Tensor | None],
        *,
        mixed: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        r"""``s U_G [raw_w, raw_b] U_A`` of raw per-sample gradients, into ``out``.

        The materialized path of :meth:`sample_grads`, for raw gradients from anywhere
        (unfolded rows, or a convolution's own kernel: the adapter's ``per_sample_grads``).

        Args:
            raw_w: ``[B, G, n_g, n_w]`` raw weight gradients.
            raw_b: ``[B, G, n_g]`` raw bias gradients, or ``None`` without a bias.
            out: contiguous ``([B, G, n_g, n_w], [B, G, n_g] or None)`` result buffers.
            mixed: ``raw_w`` comes from channel-mixed rows (only ``U_K`` is left).
        """
        w_out, b_out = out
        n_w = raw_w.shape[-1]
        has_bias = raw_b is not None
        if self.u_elem is not None:  # diagonal family: elementwise on the raw gradient
            u, sc = self.u_elem, self.scale
            torch.mul(raw_w, u[..., :n_w] * sc, out=w_out)
            if b_out is not None:
                assert raw_b is not None
                torch.mul(raw_b, u[..., n_w] * sc, out=b_out)
            return w_out, b_out
        if mixed and self.u_g is None and self.a_kron is not None:
            # the default A-only kron step: U_K and the scale in one matmul into the output
            self.a_kron.right_k(raw_w, self.scale, out=w_out)
            if b_out is not None:
                assert raw_b is not None
                torch.mul(raw_b, (self.a_kron.u_bias or 1.0) * self.scale, out=b_out)
            return w_out, b_out
        full, c = self._times_a(raw_w, has_bias, mixed)
        w, bias = full[..., :n_w], None
        if raw_b is not None:
            if c is None:  # the bias coordinate's row of U_A, times the raw bias gradient
                u_b = self._a_bias_row()[:, None]
                w = w.addcmul_(raw_b.unsqueeze(-1), u_b[..., :n_w])
                bias = full[..., n_w].addcmul_(raw_b, u_b[..., n_w])
            else:
                bias = torch.mul(raw_b, c)
        self._times_g_into(w, w_out)
        if b_out is not None:
            assert bias is not None
            self._times_g_into(bias.unsqueeze(-1), b_out.unsqueeze(-1))
        return w_out, b_out


@dataclass
class FallbackBlock:
    """Transform of a parameter no adapter covers: ``g -> s * diag * g`` (diag may be 1)."""

    name: str
    param: nn.Parameter
    module_name: str
    scale: float = 1.0
    diag: Tensor | None = None
    owner: nn.Module | None = field(default=None, repr=False, compare=False)
    """The module holding ``param`` (its raw gradients are captured there for calibration)."""

    def dense(self) -> Tensor:
        """``[n, n]`` explicit operator on the flattened parameter (``n`` its size; tests)."""
        p = self.param
        diag = torch.ones(p.numel(), dtype=p.dtype, device=p.device)
        if self.diag is not None:
            diag = diag * self.diag.reshape(-1)
        return torch.diag(self.scale * diag)

    def transform(self, grad_sample: Tensor) -> Tensor:
        """``[B, *param.shape] -> [B, *param.shape]``."""
        out = grad_sample if self.diag is None else grad_sample * self.diag
        return out * self.scale if self.scale != 1.0 else out
