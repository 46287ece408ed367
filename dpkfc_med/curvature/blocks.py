r"""Per-layer blocks of the preconditioner: the transform of one covered layer or parameter.

A :class:`KroneckerBlock` is one covered layer's transform ``g -> s U_G g U_A`` of a
per-sample gradient ``g`` (``[B, G, n_g, n_a]``) with its kernels: from the layer's rows and
output errors (factored), or on the materialised per-sample gradient, whichever costs fewer
multiply-adds (:func:`~dpkfc_med.curvature.kernels.transform_path_macs`). ``U_A`` is dense,
diagonal, low rank (:class:`~dpkfc_med.curvature.a_forms.LowRankA`) or a Kronecker product
over channels and kernel offsets (:class:`~dpkfc_med.curvature.a_forms.KronA`). A
:class:`FallbackBlock` scales a parameter no adapter covers. The network-level operator that
holds them is :class:`~dpkfc_med.curvature.preconditioner.KroneckerPreconditioner`; the
inverse roots are in :mod:`~dpkfc_med.curvature.roots`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from dpkfc_med.curvature.a_forms import (
    KronA,
    LowRankA,
    kron_a_from_factor,
    kron_eligible,
    low_rank_of,
)
from dpkfc_med.curvature.adapters import LayerAdapter
from dpkfc_med.curvature.kernels import (
    grads_times,
    outer_sum,
    raw_sq_norms,
    rows_times,
    transform_path_macs,
)
from dpkfc_med.curvature.roots import inverse_sqrt, inverse_sqrt_with_spectrum

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


def raw_norms_sq(block: KroneckerBlock, a: Tensor, delta: Tensor) -> Tensor:
    """Squared raw per-sample norms ``[B]`` of ``block``'s layer from rows ``[B, G, T, n_w]``."""
    return raw_sq_norms(a, delta, block.dims[1] > a.shape[-1])


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
                out = grads_times(out, self.u_a)
        if self.u_g is not None:
            if self.u_g.dim() == 2:
                out = out * self.u_g.unsqueeze(-1)
            else:
                # U_G symmetric: U_G X = (X^T U_G)^T, a right product again
                out = grads_times(out.transpose(-1, -2), self.u_g).transpose(-1, -2)
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
            return grads_times(x, u[:, :n_w] if has_bias else u), None
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
        d = rows_times(delta, self.u_g)
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
            raw_sq = raw_sq_norms(a[:raw_norms], delta[:raw_norms], has_bias, raw_w)
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
