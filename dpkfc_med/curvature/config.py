"""Settings of the probe-only preconditioner (:class:`PreconditionerConfig`) and its enums."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

from dpkfc_med.curvature.factors import FactorReduction
from dpkfc_med.curvature.families import Family, check_family
from dpkfc_med.utils import check_choice

__all__ = ["FactorMode", "FallbackRule", "PreconditionerConfig", "ScaleRule"]


class FactorMode(str, Enum):
    """Which Kronecker factors are used."""

    AG = "ag"  # U_G g U_A
    A = "a"  # g U_A (activation whitening only; the safe mode on binary tasks)
    IDENTITY = "identity"  # no curvature (DP-SGD, up to the global scale)


class ScaleRule(str, Enum):
    """How the preconditioner's overall scale is normalised (see module docstring)."""

    GLOBAL = "global"
    PER_LAYER = "per_layer"
    PER_LAYER_RAW = "per_layer_raw"
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
        shampoo_rank: ``null`` (default: every full ``R^{-p}`` dense) or ``r``: a full ``R``
            wider than ``r`` keeps its top ``r`` eigenpairs and the rest at their mean
            eigenvalue (``c I + V diag(d) V^T``, as ``rank_a`` does for K-FAC's ``A``), so a
            wide layer's transform costs ``2 r n_a`` instead of ``n_a^2`` per row.
        factors: ``"a"`` (default: activation whitening only, ``g -> s g U_A``), ``"ag"``
            (``g -> s U_G g U_A``) or ``"identity"`` (``g -> s g``). With few classes the
            probe ``G`` factors are nearly rank-deficient, so whitening them is fragile; the
            results behind the default are in ``docs/results.md``.
        damping_a: relative damping of ``A`` (times its mean eigenvalue).
        damping_g: relative damping of ``G`` (times its mean eigenvalue); the key
            hyperparameter of ``factors="ag"``: the smaller it is, the harder a nearly
            rank-deficient ``G`` is whitened.
        reduction: ``"expand"`` or ``"reduce"`` for weight-shared positions.
        scaling: ``"global"``, ``"per_layer"``, ``"per_layer_raw"`` or ``"none"`` (see
            :mod:`dpkfc_med.curvature.preconditioner`).
        fallback: ``"identity"`` or ``"diagonal"``.
        fallback_damping: relative damping of the diagonal fallback.
        num_probes: probes per refresh.
        chunk_size: probes per forward/backward pass.
        calibration_samples: probe samples used for the scale rule and diagonal fallback.
        max_factor_dim: factors larger than this are diagonal (memory rule).
        eig_dtype: ``"float32"`` (default) or ``"float64"`` for the eigendecompositions
            (factors are summed over probe chunks in this dtype; a float64 model always gets
            float64 sums and decompositions). On the tests' probe factors (damping 1e-3)
            float32 keeps transformed per-sample norms within 0.1 % of float64's
            (``tests/curvature/test_preconditioner.py``).
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
            still probe-only, so the privacy argument is unchanged. Opt-in (its accuracy
            and cost: ``docs/results.md``).
        rank_a: ``r`` (default 64) or ``null`` (every full ``U_A`` dense): a full ``A``
            with ``n_a > 2 r`` (where it saves work) keeps its top ``r`` eigenpairs exactly
            and replaces the other eigenvalues by their mean (same trace), so
            ``U_A = c I + V diag(d) V^T`` is stored as ``n_a x r`` instead of ``n_a x n_a``
            and a row costs ``2 n_a r`` multiply-adds instead of ``n_a^2``. An approximation
            of the preconditioner (the tail is whitened as a whole), still probe-only (its
            accuracy and cost against the dense factor: ``docs/results.md``). Applies to
            layers ``conv_a="kron"`` does not take.
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
    shampoo_rank: int | None = None

    def __post_init__(self) -> None:
        self.family = check_family(self.family)
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
        for key, what in (("rank_a", "dense U_A"), ("shampoo_rank", "dense R^-p")):
            v = getattr(self, key)
            if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
                problems.append(
                    f"preconditioner.{key}={v!r}: must be a positive integer or null ({what})"
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
