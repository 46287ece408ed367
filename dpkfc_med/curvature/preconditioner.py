r"""The Kronecker preconditioner operator built from probes only.

For a covered layer with factors ``A`` and ``G`` (see :mod:`dpkfc_med.curvature.factors`),

.. math::

    U_A = (A + \pi_A \bar\lambda_A I)^{-1/2}, \qquad
    U_G = (G + \pi_G \bar\lambda_G I)^{-1/2}, \qquad
    \tilde g_i = s \, U_G \, g_i \, U_A,

where ``bar(lambda)`` is the factor's mean eigenvalue (damping is *relative*, so it means the
same for every layer and refresh), and ``s`` a positive scalar. ``P = s (U_A kron U_G)`` is never
materialised. Parameters no adapter covers (norm affines, raw ``nn.Parameter`` s such as
position embeddings) use a documented fallback -- ``s * I`` (default) or ``s * diag(E[g^2] +
damping)^{-1/2}`` from probe gradients -- and always stay inside the clipped norm.

Scale rule (why the clip norm ``C`` keeps its meaning). On ``calibration_samples`` probe
samples we compute raw per-sample gradient norms ``||g_i||`` and transformed norms
``||U g_i||`` (all parameters, fallback included), then

* ``global`` (default): one scalar ``s = median_i ||g_i|| / median_i ||U g_i||`` for the whole
  network, so on probes the transformed per-sample norms have the same median as raw ones and
  ``C`` can be chosen exactly as for DP-SGD; it is recomputed at every refresh, so ``C`` keeps
  that meaning as the factors change.
* ``per_layer``: each layer (fallback parameters grouped by their module) gets ``s_l`` so its
  median transformed norm equals ``median_i ||g_i|| / sqrt(L)``: all ``L`` layers share the
  clipped norm equally on probes (prevents one ill-conditioned layer from taking all of it).
* ``none``: ``s = 1``.

All of it depends only on probes and on the current (already released) parameters.

Every eigendecomposition goes through :func:`~dpkfc_med.curvature.linalg.robust_eigh`: a
factor whose decomposition fails in ``eig_dtype`` is retried in float64, then with a small
diagonal jitter, and as a last resort gets the damped identity scaled by its mean diagonal;
each such fallback is listed in ``summary()["eig_fallbacks"]``.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

import torch
from opacus.grad_sample import GradSampleModule
from torch import Tensor, nn

from dpkfc_med.curvature.adapters import LayerAdapter, adapter_for
from dpkfc_med.curvature.factors import (
    FactorReduction,
    KroneckerFactors,
    LossFn,
    capture_raw,
    covered_layers,
    estimate_factors,
)
from dpkfc_med.curvature.families import Family, estimate_gradient_statistics
from dpkfc_med.curvature.linalg import EighFallback, robust_eigh
from dpkfc_med.utils import check_choice

# Opacus' per-layer per-sample gradient formulas (norm layers, embeddings, and whatever is
# registered with opacus.grad_sample.register_grad_sampler, read at call time), reused for the
# fallback parameters during calibration.
_OPACUS_SAMPLERS = GradSampleModule.GRAD_SAMPLERS

__all__ = [
    "FactorMode",
    "FallbackBlock",
    "FallbackRule",
    "KroneckerBlock",
    "KroneckerPreconditioner",
    "LowRankA",
    "PreconditionerConfig",
    "ScaleRule",
    "coverage_shares",
    "coverage_summary",
    "inverse_sqrt",
    "low_rank_of",
    "transform_path_macs",
]


class FactorMode(str, Enum):
    """Which Kronecker factors are used."""

    AG = "ag"  # U_G g U_A
    A = "a"  # g U_A (activation whitening only; the safe mode on binary tasks)
    IDENTITY = "identity"  # no curvature (DP-SGD, up to the global scale)


class ScaleRule(str, Enum):
    """How the preconditioner's overall scale is normalised (see module docstring)."""

    GLOBAL = "global"
    PER_LAYER = "per_layer"
    NONE = "none"


class FallbackRule(str, Enum):
    """Preconditioner for parameters no adapter covers."""

    IDENTITY = "identity"
    DIAGONAL = "diagonal"


@dataclass
class PreconditionerConfig:
    """Settings of the probe-only preconditioner.

    Attributes:
        family: ``"kfac"`` (default: Kronecker factors of activations and output errors),
            ``"shampoo"`` (``L^{-p} g R^{-p}`` with ``L = E[g g^T]``, ``R = E[g^T g]`` of the
            probes' per-sample gradients, ``p = shampoo_exponent``; ``damping_g`` damps ``L``,
            ``damping_a`` damps ``R``) or ``"diagonal"`` (``g / sqrt(E[g^2] + damping_a *
            mean)`` elementwise, every parameter included); :mod:`.families`. ``factors``,
            ``rank_a`` and ``conv_a`` are K-FAC settings.
        shampoo_exponent: ``p`` of the Shampoo transform (1/4: the two sides together give
            the inverse square root of a Kronecker approximation of ``E[vec(g) vec(g)^T]``).
        factors: ``"a"`` (default: activation whitening only), ``"ag"`` or ``"identity"``.
            The default follows the benchmarks (``benchmarks/results``): on PneumoniaMNIST
            the probe ``G`` factors are nearly rank-deficient (two classes) and full A+G with
            ``damping_g=0.1`` collapsed to the majority class, while A-only did not.
        damping_a: relative damping of ``A`` (times its mean eigenvalue).
        damping_g: relative damping of ``G``; the key hyperparameter (1e-3 collapses a
            binary task to its majority class, 0.1 does not).
        reduction: ``"expand"`` or ``"reduce"`` for weight-shared positions.
        scaling: ``"global"``, ``"per_layer"`` or ``"none"``.
        fallback: ``"identity"`` or ``"diagonal"``.
        fallback_damping: relative damping of the diagonal fallback.
        num_probes: probes per refresh.
        chunk_size: probes per forward/backward pass.
        calibration_samples: probe samples used for the scale rule and diagonal fallback.
        max_factor_dim: factors larger than this are diagonal (memory rule).
        eig_dtype: ``"float32"`` (default) or ``"float64"`` for the eigendecompositions
            (factors are always summed over chunks in float64; a float64 model always gets
            float64 decompositions). float32 is 2-3x faster on CPU; on the small CNN's probe
            factors (damping 1e-3) transformed per-sample norms differ from float64's by
            < 0.1 % (``tests/curvature/test_preconditioner.py``).
        max_positions: ``A`` of a convolution with more output positions per probe than this
            averages over this many positions drawn at random (without replacement, seeded by
            the refresh) instead of all of them: the same expectation, and the patch tensor
            and ``A`` estimation of a 64^3 volume shrink 8x at the default. ``null`` = all.
            Expand reduction only.
        conv_a: ``"full"`` (default) or ``"kron"``: for ungrouped convolutions whose ``A``
            is estimated in full (``n_a <= max_factor_dim``; larger ones stay diagonal), replace
            ``U_A`` by ``U_C (x) U_K`` built from the channel and kernel-offset partial traces
            of the same probe ``A`` (``A_C = tr_K A / K``, ``A_K = tr_C A / C``, rescaled so
            ``tr(A_C (x) A_K) = tr A``; the bias coordinate gets ``(1 + damping_a)^{-1/2}``).
            An approximation of the preconditioner that makes the per-sample transform cost
            ``S C^2 + n_g C K^2`` (``U_C`` on the layer input's ``S`` positions before the
            unfold, ``U_K`` on the per-sample gradient) instead of up to ``T (C K)^2``;
            still probe-only, so the privacy argument is unchanged. Opt-in: its
            accuracy is in ``benchmarks/results``.
        rank_a: ``r`` (default 64) or ``null`` (every full ``U_A`` dense): a full ``A``
            with ``n_a > 2 r`` (where it saves work) keeps its top ``r`` eigenpairs exactly
            and replaces the other eigenvalues by their mean (same trace), so
            ``U_A = c I + V diag(d) V^T`` is stored as ``n_a x r`` instead of ``n_a x n_a``
            and a row costs ``2 n_a r`` multiply-adds instead of ``n_a^2``. An approximation
            of the preconditioner (the tail is whitened as a whole), still probe-only. The
            default follows ``benchmarks/results``: test AUROC within seed noise of the dense
            factor's on the small CNN and the DenseNet (Dice equal on the hippocampus UNet),
            accuracy too except the small CNN at epsilon 8 (0.816 against 0.855, about two
            standard errors), and the DenseNet step 0.97-1.10x Opacus' instead of 1.39x
            (memory 1.02-1.06x instead of 1.16x). Applies to layers ``conv_a="kron"`` does not take.
        step: ``"transformed"`` (default) or ``"natural"``. ``transformed`` takes the base
            optimizer's step on the privatized sum of ``s U_G g_i U_A`` as it is (signal
            direction ``P g`` with ``P = s U_A (x) U_G``, isotropic noise). ``natural``
            multiplies the privatized, averaged gradient once more by ``P`` before the base
            optimizer: the DP-SGD step in the reparametrisation ``theta = P phi``, whose
            signal is ``P^2 g`` (the damped KFAC natural gradient) and whose noise has
            covariance ``sigma^2 C^2 P^2 / B^2``. The second product acts on a released
            quantity with a probe-only ``P`` (post-processing: the accounting is unchanged);
            it costs one transform of the parameter-sized average per step. Not combined
            with DP-AdamBC, whose correction assumes isotropic noise.
    """

    factors: FactorMode | str = FactorMode.A
    damping_a: float = 1e-3
    damping_g: float = 0.1
    reduction: FactorReduction | str = FactorReduction.EXPAND
    scaling: ScaleRule | str = ScaleRule.GLOBAL
    fallback: FallbackRule | str = FallbackRule.IDENTITY
    fallback_damping: float = 1e-3
    num_probes: int = 256
    chunk_size: int = 64
    calibration_samples: int = 16
    max_factor_dim: int = 4096
    eig_dtype: str = "float32"
    max_positions: int | None = 32768
    conv_a: str = "full"
    rank_a: int | None = 64
    step: str = "transformed"
    family: Family | str = Family.KFAC
    shampoo_exponent: float = 0.25

    def __post_init__(self) -> None:
        self.family = check_choice("preconditioner.family", self.family, Family)
        self.factors = check_choice("preconditioner.factors", self.factors, FactorMode)
        self.reduction = check_choice("preconditioner.reduction", self.reduction, FactorReduction)
        self.scaling = check_choice("preconditioner.scaling", self.scaling, ScaleRule)
        self.fallback = check_choice("preconditioner.fallback", self.fallback, FallbackRule)
        problems = []
        for key in ("damping_a", "damping_g", "fallback_damping", "shampoo_exponent"):
            v = getattr(self, key)
            if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
                problems.append(f"preconditioner.{key}={v!r}: must be a positive number (e.g. 0.1)")
        for key in ("num_probes", "chunk_size", "calibration_samples", "max_factor_dim"):
            v = getattr(self, key)
            if not (isinstance(v, int) and v >= 1):
                problems.append(f"preconditioner.{key}={v!r}: must be a positive integer")
        v = self.max_positions
        if v is not None and not (isinstance(v, int) and v >= 1):
            problems.append(
                f"preconditioner.max_positions={v!r}: must be a positive integer or null (all)"
            )
        v = self.rank_a
        if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            problems.append(
                f"preconditioner.rank_a={v!r}: must be a positive integer or null (dense U_A)"
            )
        if self.conv_a not in ("full", "kron"):
            problems.append(f"preconditioner.conv_a={self.conv_a!r}: use 'full' or 'kron'")
        if self.step not in ("transformed", "natural"):
            problems.append(f"preconditioner.step={self.step!r}: use 'transformed' or 'natural'")
        if self.eig_dtype not in ("float64", "float32"):
            problems.append(
                f"preconditioner.eig_dtype={self.eig_dtype!r}: use 'float64' or 'float32'"
            )
        if problems:
            raise ValueError("invalid preconditioner settings:\n  " + "\n  ".join(problems))

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable view."""
        d = asdict(self)
        for k, v in d.items():
            if isinstance(v, Enum):
                d[k] = v.value
        return d


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


def _kron_eligible(module: nn.Module, a: Tensor) -> bool:
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


def _raw_sq(a: Tensor, delta: Tensor, has_bias: bool, raw_w: Tensor | None = None) -> Tensor:
    """Squared per-sample norms ``[B]`` of untransformed gradients from rows and errors."""
    if raw_w is None:
        raw_w = delta.transpose(-1, -2) @ a
    out = raw_w[: a.shape[0]].pow(2).flatten(1).sum(1)
    if has_bias:
        out = out + delta.sum(-2).pow(2).flatten(1).sum(1)
    return out


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

    def right(self, x: Tensor) -> Tensor:
        """``x [..., n_a] -> x U_A`` on the last dimension."""
        ck = self.u_c.shape[0] * self.u_k.shape[0]
        out = self.right_w(x[..., :ck])
        if self.u_bias is None:
            return out
        return torch.cat([out, x[..., ck:] * self.u_bias], dim=-1)


def _kron_a(
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
    c = int(getattr(module, "in_channels"))  # noqa: B009 (checked by _kron_eligible)
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
    ) -> tuple[LowRankA, Tensor]:
        """From ``A [G, n, n]`` (``n > rank``); also returns the eigenvalues ``[G, n]``.

        Decomposed in ``factor``'s dtype; the operator is built in ``out_dtype`` (default the
        same), once. A decomposition failure falls back as
        :func:`~dpkfc_med.curvature.linalg.robust_eigh` describes (the last resort gives
        ``U_A = c I``), recorded in ``record`` as part ``"A"`` of ``layer``.
        """
        evals, evecs = robust_eigh(factor, layer=layer, part="A", record=record)
        lam = evals.clamp_min(0)
        lam = lam + damping * lam.mean(-1, keepdim=True)
        # an all-zero factor (a layer the probes do not reach) maps to the identity
        lam = torch.where(lam > 0, lam, torch.ones_like(lam))
        n = lam.shape[-1]
        c = lam[:, : n - rank].mean(-1).rsqrt()
        d = lam[:, n - rank :].rsqrt() - c[:, None]
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

    def _cost(self, b: int, t: int) -> tuple[float, float]:
        """Multiply-adds of ``b`` samples' transformed gradients on each path."""
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

    def choose_path(self, b: int, t: int) -> str:
        """The cheaper way to form transformed per-sample gradients.

        ``"factored"`` transforms ``a`` and ``delta``; ``"materialized"`` transforms the
        per-sample gradient; the one with fewer multiply-adds wins.
        """
        if self.u_elem is not None:  # an elementwise transform needs the per-sample gradient
            return "materialized"
        factored, materialized = self._cost(b, t)
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
            # factored: U_G and the scale act on the errors (rows times symmetric U_G), U_A
            # on the inputs (bias coordinate 1), then one product per sample
            d = _rows_times(delta, self.u_g)
            d = d * self.scale if self.scale != 1.0 else d
            a_t, c = self._times_a(a, has_bias)
            if has_bias and c is None:
                a_t = a_t.add_(self._a_bias_row()[:, None])
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
        if self.u_elem is not None:  # diagonal family: elementwise on the raw gradient
            assert raw_w is not None
            u, sc = self.u_elem, self.scale
            torch.mul(raw_w, u[..., :n_w] * sc, out=w_out)
            if b_out is not None:
                assert raw_b is not None
                torch.mul(raw_b, u[..., n_w] * sc, out=b_out)
            return w_out, b_out, raw_sq
        if mixed and self.u_g is None and self.a_kron is not None:
            # the default A-only kron step: U_K and the scale in one matmul into the output
            self.a_kron.right_k(raw_w, self.scale, out=w_out)
            if b_out is not None:
                assert raw_b is not None
                torch.mul(raw_b, (self.a_kron.u_bias or 1.0) * self.scale, out=b_out)
            return w_out, b_out, raw_sq
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
        return w_out, b_out, raw_sq


@dataclass
class FallbackBlock:
    """Transform of a parameter no adapter covers: ``g -> s * diag * g`` (diag may be 1)."""

    name: str
    param: nn.Parameter
    module_name: str
    scale: float = 1.0
    diag: Tensor | None = None

    def transform(self, grad_sample: Tensor) -> Tensor:
        """``[B, *param.shape] -> [B, *param.shape]``."""
        out = grad_sample if self.diag is None else grad_sample * self.diag
        return out * self.scale if self.scale != 1.0 else out


def _fallback_params(
    model: nn.Module, covered: dict[str, nn.Module]
) -> list[tuple[str, str, nn.Parameter]]:
    owned = {id(p) for m in covered.values() for p in m.parameters(recurse=False)}
    out = []
    for mod_name, module in model.named_modules():
        for p_name, p in module.named_parameters(recurse=False):
            if p.requires_grad and id(p) not in owned:
                full = f"{mod_name}.{p_name}" if mod_name else p_name
                p._dpkfc_calib_owner = module  # type: ignore[attr-defined]
                out.append((full, mod_name, p))
    return out


def _spectrum_stats(evals: Tensor) -> dict[str, float]:
    ev = evals.flatten().clamp_min(0)
    total = float(ev.sum())
    eff_rank = total**2 / float((ev**2).sum()) if total > 0 else 0.0
    return {
        "max_eig": float(ev.max()),
        "mean_eig": float(ev.mean()),
        "min_eig": float(ev.min()),
        "effective_rank": eff_rank,
    }


class KroneckerPreconditioner:
    """Block-diagonal Kronecker preconditioner over the whole network (never materialised).

    Privacy guarantee:
        Built by :meth:`from_probes` from synthetic probes and the model's current parameters
        only; when those parameters are the output of earlier DP steps, the preconditioner is
        post-processing and costs no privacy budget. It never reads ``.grad``/``grad_sample``.
    """

    def __init__(
        self,
        blocks: dict[str, KroneckerBlock],
        fallbacks: dict[str, FallbackBlock],
        config: PreconditionerConfig,
        info: dict[str, Any] | None = None,
        factors: dict[str, KroneckerFactors] | None = None,
    ) -> None:
        self.blocks = blocks
        self.fallbacks = fallbacks
        self.config = config
        self.info: dict[str, Any] = info or {}
        self.factors = factors or {}

    # ----------------------------------------------------------------------- construction
    @classmethod
    def identity(
        cls, model: nn.Module, config: PreconditionerConfig | None = None
    ) -> KroneckerPreconditioner:
        """Identity on every parameter (scale 1): DP-SGD through the DP-KFC code path."""
        cfg = config or PreconditionerConfig(factors="identity", scaling="none")
        covered = covered_layers(model)
        blocks = {n: KroneckerBlock(n, m, adapter_for(m)) for n, m in covered.items()}  # type: ignore[arg-type]
        fallbacks = {n: FallbackBlock(n, p, mn) for n, mn, p in _fallback_params(model, covered)}
        return cls(blocks, fallbacks, cfg, {"scale": 1.0})

    @classmethod
    def from_probes(
        cls,
        model: nn.Module,
        inputs: Tensor,
        targets: Tensor,
        loss_fn: LossFn,
        config: PreconditionerConfig | None = None,
        *,
        keep_factors: bool = False,
        position_seed: int = 0,
    ) -> KroneckerPreconditioner:
        """Estimate factors on probes, invert them and normalise the scale.

        Args:
            model: the network at its current parameters (plain ``nn.Module``).
            inputs: probe inputs ``[M, ...]``; must be finite.
            targets: probe targets.
            loss_fn: per-sample loss ``(outputs, targets) -> [M]``.
            config: settings.
            keep_factors: keep ``A``/``G`` on the object (for spectra in notebooks).
            position_seed: seed of the positions drawn under ``config.max_positions``.
        """
        cfg = config or PreconditionerConfig()
        if torch.is_floating_point(inputs) and not bool(torch.isfinite(inputs).all()):
            raise ValueError(
                "probe inputs contain NaN or Inf; check the probe source "
                "(alpha, intensity range) -- probes must be finite"
            )
        t0 = time.perf_counter()
        covered = covered_layers(model)
        eig_dtype = torch.float64 if cfg.eig_dtype == "float64" else torch.float32
        blocks: dict[str, KroneckerBlock] = {}
        factors: dict[str, KroneckerFactors] = {}
        spectra: dict[str, dict[str, Any]] = {}
        eig_fallbacks: list[EighFallback] = []
        stats = {}
        if cfg.family is not Family.KFAC:
            stats = estimate_gradient_statistics(
                model,
                inputs,
                targets,
                loss_fn,
                covered,
                cfg.family,  # type: ignore[arg-type]
                chunk_size=cfg.chunk_size,
                max_factor_dim=cfg.max_factor_dim,
            )
        elif cfg.factors is not FactorMode.IDENTITY:
            factors = estimate_factors(
                model,
                inputs,
                targets,
                loss_fn,
                layers=covered,
                reduction=cfg.reduction,
                chunk_size=cfg.chunk_size,
                max_factor_dim=cfg.max_factor_dim,
                dtype=torch.float64,
                need_g=cfg.factors is FactorMode.AG,
                max_positions=cfg.max_positions,
                position_seed=position_seed,
            )
        t_factors = time.perf_counter() - t0
        for name, module in covered.items():
            adapter = adapter_for(module)
            assert adapter is not None
            u_a = u_g = None
            a_kron: KronA | None = None
            a_low: LowRankA | None = None
            u_elem: Tensor | None = None
            if name in stats:
                st = stats[name]
                ref_p: Tensor = module.weight  # type: ignore[assignment]
                dt = torch.promote_types(eig_dtype, ref_p.dtype)
                if st.second_moment is not None:  # diagonal family
                    v = st.second_moment
                    mean = v.flatten(1).mean(1).view(-1, 1, 1)
                    inv = (v.clamp_min(0) + cfg.damping_a * mean).rsqrt()
                    u_elem = torch.where(mean > 0, inv, torch.ones_like(inv)).to(ref_p.dtype)
                else:  # Shampoo: L^{-p} on the left, R^{-p} on the right
                    assert st.left is not None and st.right is not None
                    pw = cfg.shampoo_exponent
                    u_g, ev_g = inverse_sqrt_with_spectrum(
                        st.left.to(dt),
                        cfg.damping_g,
                        layer=name,
                        part="L",
                        record=eig_fallbacks,
                        power=pw,
                    )
                    u_a, ev_a = inverse_sqrt_with_spectrum(
                        st.right.to(dt),
                        cfg.damping_a,
                        layer=name,
                        part="R",
                        record=eig_fallbacks,
                        power=pw,
                    )
                    u_g, u_a = u_g.to(ref_p.dtype), u_a.to(ref_p.dtype)
                    spectra[name] = {"L": _spectrum_stats(ev_g), "R": _spectrum_stats(ev_a)}
            elif name in factors:
                f = factors[name]
                ref: Tensor = module.weight  # type: ignore[assignment]
                # a float64 model gets float64 decompositions whatever eig_dtype says
                dt = torch.promote_types(eig_dtype, ref.dtype)
                if _kron_eligible(module, f.a) and cfg.conv_a == "kron":
                    a_kron, ev_a = _kron_a(
                        module, f.a, cfg.damping_a, dt, ref.dtype, layer=name, record=eig_fallbacks
                    )
                elif f.a.dim() == 3 and (rank := low_rank_of(f.a.shape[-1], cfg.rank_a)):
                    a_low, ev_a = LowRankA.from_factor(
                        f.a.to(dt), cfg.damping_a, rank, ref.dtype, layer=name, record=eig_fallbacks
                    )
                else:
                    u_a, ev_a = inverse_sqrt_with_spectrum(
                        f.a.to(dt), cfg.damping_a, layer=name, part="A", record=eig_fallbacks
                    )
                    u_a = u_a.to(ref.dtype)
                spectra[name] = {"A": _spectrum_stats(ev_a)}
                if cfg.factors is FactorMode.AG:
                    u_g, ev_g = inverse_sqrt_with_spectrum(
                        f.g.to(dt), cfg.damping_g, layer=name, part="G", record=eig_fallbacks
                    )
                    u_g = u_g.to(ref.dtype)
                    spectra[name]["G"] = _spectrum_stats(ev_g)
            blocks[name] = KroneckerBlock(
                name, module, adapter, u_a, u_g, a_kron=a_kron, a_low=a_low, u_elem=u_elem
            )
        t_inv = time.perf_counter() - t0 - t_factors
        fallbacks = {n: FallbackBlock(n, p, mn) for n, mn, p in _fallback_params(model, covered)}
        pre = cls(blocks, fallbacks, cfg, factors=factors if keep_factors else None)
        calib = pre._calibrate(model, inputs, targets, loss_fn)
        pre.info = {
            "num_probes": int(inputs.shape[0]),
            "seconds_factors": t_factors,
            "seconds_inverse": t_inv,
            "seconds_total": time.perf_counter() - t0,
            "spectra": spectra,
            "eig_fallbacks": [r.to_dict() for r in eig_fallbacks],
            **calib,
        }
        return pre

    def _calibrate(
        self, model: nn.Module, inputs: Tensor, targets: Tensor, loss_fn: LossFn
    ) -> dict[str, Any]:
        cfg = self.config
        n = min(cfg.calibration_samples, inputs.shape[0])
        x, y = inputs[:n], targets[:n]
        raw_sq = torch.zeros(n, dtype=torch.float64)
        unit_sq: dict[str, Tensor] = {}  # transformed (scale 1) squared norms per unit
        covered = {b.name: b.module for b in self.blocks.values()}
        owners = {
            fb.module_name: fb.param._dpkfc_calib_owner  # type: ignore[attr-defined]
            for fb in self.fallbacks.values()
            if getattr(fb.param, "_dpkfc_calib_owner", None) is not None
        }
        owners = {
            k: m for k, m in owners.items() if type(m) in _OPACUS_SAMPLERS and k not in covered
        }
        raw_pairs = capture_raw(model, x, y, loss_fn, {**covered, **owners})
        for name in covered:
            block = self.blocks[name]
            for xa, dy in raw_pairs[name]:
                assert dy is not None
                raw = block.raw_grads(xa, dy)
                saved, block.scale = block.scale, 1.0
                trans = block.transform_grads(raw)
                block.scale = saved
                raw_sq += raw.pow(2).flatten(1).sum(1).double().cpu()
                sq = trans.pow(2).flatten(1).sum(1).double().cpu()
                unit_sq[name] = unit_sq.get(name, 0) + sq
        if self.fallbacks:
            # Per-sample gradients of norm affines etc. from the same pass through Opacus'
            # per-layer formulas; anything else (raw parameters) by one backward per sample.
            got: dict[int, Tensor] = {}
            for name, module in owners.items():
                for xa, dy in raw_pairs[name]:
                    for p, g in _OPACUS_SAMPLERS[type(module)](module, [xa], dy).items():
                        got[id(p)] = got[id(p)] + g if id(p) in got else g
            rest = [fb.param for fb in self.fallbacks.values() if id(fb.param) not in got]
            if rest:
                loop = [
                    torch.autograd.grad(
                        loss_fn(model(x[i : i + 1]), y[i : i + 1]).sum(), rest, allow_unused=True
                    )
                    for i in range(n)
                ]
                for j, p in enumerate(rest):
                    got[id(p)] = torch.stack(
                        [g[j] if g[j] is not None else torch.zeros_like(p) for g in loop]
                    )
            for fb in self.fallbacks.values():
                gs = got[id(fb.param)].detach()
                if cfg.fallback is FallbackRule.DIAGONAL or cfg.family is Family.DIAGONAL:
                    second = gs.pow(2).mean(0)
                    fb.diag = inverse_sqrt(
                        second.flatten().unsqueeze(0), cfg.fallback_damping
                    ).reshape(fb.param.shape)
                raw_sq += gs.pow(2).flatten(1).sum(1).double().cpu()
                key = f"{fb.module_name} (fallback)"
                saved, fb.scale = fb.scale, 1.0
                unit_sq[key] = (
                    unit_sq.get(key, 0) + fb.transform(gs).pow(2).flatten(1).sum(1).double().cpu()
                )
                fb.scale = saved
        total_sq = sum(unit_sq.values()) if unit_sq else torch.zeros(n, dtype=torch.float64)
        raw_med = float(raw_sq.sqrt().median())
        trans_med = float(torch.as_tensor(total_sq).sqrt().median())
        global_s = raw_med / trans_med if trans_med > 0 and raw_med > 0 else 1.0
        scales: dict[str, float] = {}
        if cfg.scaling is ScaleRule.NONE:
            scales = {k: 1.0 for k in unit_sq}
        elif cfg.scaling is ScaleRule.GLOBAL:
            scales = {k: global_s for k in unit_sq}
        else:
            target = raw_med / math.sqrt(max(len(unit_sq), 1))
            for k, sq in unit_sq.items():
                med = float(sq.sqrt().median())
                scales[k] = target / med if med > 0 and target > 0 else global_s
        for name, block in self.blocks.items():
            block.scale = scales.get(name, global_s if cfg.scaling is ScaleRule.GLOBAL else 1.0)
        for fb in self.fallbacks.values():
            fb.scale = scales.get(f"{fb.module_name} (fallback)", global_s)
        share = {k: float((v * scales.get(k, 1.0) ** 2).sum()) for k, v in unit_sq.items()}
        tot = sum(share.values()) or 1.0
        return {
            "calibration_samples": n,
            "probe_median_raw_norm": raw_med,
            "probe_median_transformed_norm_unscaled": trans_med,
            "scale": global_s,
            "layer_scales": scales,
            "probe_layer_share": {k: v / tot for k, v in share.items()},
        }

    # ---------------------------------------------------------------------------- use
    def attach(self, model: nn.Module) -> None:
        """Point every covered module at its block (read by the per-sample gradient hooks)."""
        for block in self.blocks.values():
            block.module._dpkfc_block = block  # type: ignore[assignment]

    @staticmethod
    def detach(model: nn.Module) -> None:
        """Remove block pointers: hooks then compute raw (DP-SGD) per-sample gradients."""
        for m in model.modules():
            if hasattr(m, "_dpkfc_block"):
                del m._dpkfc_block

    def transform_param_grads(
        self, grads: dict[nn.Parameter, Tensor]
    ) -> dict[nn.Parameter, Tensor]:
        """Reference (literal) transform of materialised per-sample gradients of all params.

        Args:
            grads: ``{param: [B, *param.shape]}`` for every trainable parameter.
        """
        out: dict[nn.Parameter, Tensor] = {}
        for block in self.blocks.values():
            mats = block.adapter.from_params(block.module, grads)
            out.update(block.adapter.to_params(block.module, block.transform_grads(mats)))
        for fb in self.fallbacks.values():
            out[fb.param] = fb.transform(grads[fb.param])
        return out

    @torch.no_grad()
    def precondition_update(self, params: list[nn.Parameter]) -> None:
        """Multiply the released gradients ``p.grad`` of ``params`` by ``P`` in place.

        The second product of ``step="natural"``: ``grad -> s U_G grad U_A`` per covered
        layer and the fallback transform elsewhere. Parameters without a gradient (frozen,
        or outside ``params``) count as zero in their layer's product.

        Privacy guarantee:
            Applied to already privatized gradients with a preconditioner built from probes
            and released parameters only: post-processing, no privacy cost.
        """
        grads = {p: p.grad.unsqueeze(0) for p in params if p.grad is not None}
        if not grads:
            return
        for block in self.blocks.values():
            own = list(block.module.parameters(recurse=False))
            if not any(p in grads for p in own):
                continue
            full = {p: grads.get(p, torch.zeros_like(p).unsqueeze(0)) for p in own}
            mats = block.adapter.from_params(block.module, full)
            for p, g in block.adapter.to_params(block.module, block.transform_grads(mats)).items():
                if p in grads:  # grads[p] is a view of p.grad
                    grads[p].copy_(g.view_as(grads[p]))
        for fb in self.fallbacks.values():
            if fb.param in grads:
                grads[fb.param].copy_(fb.transform(grads[fb.param]))

    def param_layer_names(self) -> dict[int, str]:
        """``id(param) -> layer name`` used for per-layer diagnostics."""
        out: dict[int, str] = {}
        for name, block in self.blocks.items():
            for p in block.module.parameters(recurse=False):
                out[id(p)] = name
        for fb in self.fallbacks.values():
            out[id(fb.param)] = f"{fb.module_name} (fallback)"
        return out

    def coverage(self) -> list[dict[str, Any]]:
        """One row per covered layer and per fallback parameter."""
        rows: list[dict[str, Any]] = []
        for name, b in self.blocks.items():
            g, n_a, n_g = b.dims
            rows.append(
                {
                    "layer": name,
                    "type": type(b.module).__name__,
                    "adapter": b.adapter.name,
                    "family": Family(self.config.family).value,
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
        for name, fb in self.fallbacks.items():
            rows.append(
                {
                    "layer": name,
                    "type": "parameter",
                    "adapter": f"fallback:{'diagonal' if fb.diag is not None else 'identity'}",
                    "family": Family(self.config.family).value,
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

    def summary(self) -> dict[str, Any]:
        """JSON-serialisable description for the privacy report.

        ``"coverage_shares"`` is :func:`coverage_shares` of the coverage table;
        ``"eig_fallbacks"`` lists every factor whose eigendecomposition fell back (one
        :meth:`~dpkfc_med.curvature.linalg.EighFallback.to_dict` each: layer, factor, what
        failed, what was used); empty when all succeeded in ``eig_dtype``.
        """
        coverage = self.coverage()
        return {
            "config": self.config.to_dict(),
            "coverage": coverage,
            "coverage_shares": coverage_shares(coverage),
            "eig_fallbacks": [],
            **self.info,
        }


def coverage_shares(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Shares of the trainable parameters by what the coverage table gave them.

    Args:
        rows: :meth:`KroneckerPreconditioner.coverage` rows.

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


def coverage_summary(model: nn.Module) -> list[dict[str, Any]]:
    """Coverage table of ``model`` before any probe pass (identity factors)."""
    return KroneckerPreconditioner.identity(model).coverage()
