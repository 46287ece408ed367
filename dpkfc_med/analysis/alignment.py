r"""Layer-by-layer alignment of two sets of curvature factors (direction versus scale).

For a factor ``F`` (e.g. from pink probes) and a reference ``R`` (e.g. the private-data
oracle) of the same layer and role, with eigenpairs :math:`(\lambda_i, u_i)` and
:math:`(\mu_i, v_i)` in decreasing order:

.. math::

    \text{cos}_i = |u_i^\top v_i|, \qquad
    \text{overlap}_k = \tfrac{1}{k} \lVert U_k^\top V_k \rVert_F^2
    = \tfrac{1}{k} \textstyle\sum_j \cos^2 \theta_j, \qquad
    \text{trace ratio} = \operatorname{tr} F / \operatorname{tr} R,

    e_F = \frac{\lVert F - R \rVert_F}{\lVert R \rVert_F}, \qquad
    e_{\text{shape}} = \frac{\lVert \hat F - \hat R \rVert_F}{\lVert \hat R \rVert_F}, \qquad
    e_{U} = \frac{\lVert U(\hat F) - U(\hat R) \rVert_F}{\lVert U(\hat R) \rVert_F},

with :math:`\theta_j` the principal angles between the top-``k`` eigenspaces,
:math:`\hat F = F / \bar\lambda_F` the factor divided by its mean eigenvalue, and
:math:`U(\hat F) = (\hat F + \pi I)^{-p}` the damped inverse root exactly as the
preconditioner takes it (:func:`~dpkfc_med.curvature.preconditioner.inverse_sqrt_with_spectrum`,
relative damping :math:`\pi` and power :math:`p` of the role,
:func:`~dpkfc_med.analysis.factor_sets.role_damping`). Since the damping is relative,
:math:`U(cF) = c^{-p} U(F)`: ``e_shape`` and ``e_U`` measure the *direction* (shape) of the
factor, the trace ratio its *scale*, and ``e_F`` both together.

``k`` is capped at the numerical rank of both factors (eigenvalues above ``1e-10`` times the
largest), since eigenvectors of a zero eigenvalue are arbitrary. Factors with several groups
``[G, n, n]`` are compared as one block-diagonal matrix. A diagonal factor ``[G, n]`` has the
coordinate axes as eigenvectors: its cosines are 1 where both rank the same coordinate ``i``-th
and 0 otherwise, its overlap the shared fraction of the top-``k`` coordinates. A full factor
compared with a diagonal one is reduced to its diagonal.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

from dpkfc_med.analysis.factor_sets import CurvatureFactors, role_damping
from dpkfc_med.curvature.preconditioner import PreconditionerConfig, inverse_sqrt_with_spectrum

__all__ = [
    "FactorAlignment",
    "align_factor",
    "compare_factors",
    "depth_summary",
    "eigenvalue_decay",
    "relative_frobenius_error",
    "subspace_overlap",
    "top_eigenvector_cosines",
]

_RANK_TOL = 1e-10


@dataclass(frozen=True)
class FactorAlignment:
    """Alignment of one factor with its reference (see the module docstring).

    Attributes:
        layer: Dotted layer name.
        role: Factor role (``"A"``, ``"G"``, ``"L"``, ``"R"``, ``"D"``).
        depth: Position of the layer in the forward order (0 = first).
        num_layers: Number of layers compared.
        dim: Side length ``n`` of the (block-diagonal) factor.
        k: Eigenvectors compared (capped at both numerical ranks).
        top_cosines: ``|u_i^T v_i|`` for ``i < k``.
        subspace_overlap: Mean squared cosine of the principal angles of the top-``k`` spaces.
        rel_frobenius: ``||F - R||_F / ||R||_F``.
        rel_frobenius_shape: The same after dividing each factor by its mean eigenvalue.
        rel_frobenius_inv_root: The same for the damped inverse roots of the normalised factors.
        trace_ratio: ``tr F / tr R``.
    """

    layer: str
    role: str
    depth: int
    num_layers: int
    dim: int
    k: int
    top_cosines: tuple[float, ...]
    subspace_overlap: float
    rel_frobenius: float
    rel_frobenius_shape: float
    rel_frobenius_inv_root: float
    trace_ratio: float

    @property
    def top1_cosine(self) -> float:
        """``|u_1^T v_1|`` (NaN when ``k == 0``)."""
        return self.top_cosines[0] if self.top_cosines else math.nan

    def row(self) -> dict[str, Any]:
        """JSON-serialisable view, with ``top1_cosine``."""
        return {**asdict(self), "top_cosines": list(self.top_cosines), "top1": self.top1_cosine}


def _as_matrix(f: Tensor) -> Tensor:
    """``[G, n, n]`` -> one block-diagonal ``[G n, G n]``; ``[G, n]`` -> a vector ``[G n]``."""
    f = f.detach().to(device="cpu", dtype=torch.float64)
    if f.dim() == 2:
        return f.flatten()
    if f.dim() != 3 or f.shape[-1] != f.shape[-2]:
        raise ValueError(f"a factor must be [G, n, n] or [G, n], got {list(f.shape)}")
    return f[0] if f.shape[0] == 1 else torch.block_diag(*f)


def _pair(f: Tensor, ref: Tensor) -> tuple[Tensor, Tensor]:
    a, b = _as_matrix(f), _as_matrix(ref)
    if a.dim() != b.dim():  # full against diagonal: compare diagonals
        a = a.diagonal() if a.dim() == 2 else a
        b = b.diagonal() if b.dim() == 2 else b
    if a.shape != b.shape:
        raise ValueError(f"factors of different sizes: {list(a.shape)} and {list(b.shape)}")
    return a, b


def _rel_frob(a: Tensor, b: Tensor) -> float:
    num, den = float(torch.linalg.norm(a - b)), float(torch.linalg.norm(b))
    if den == 0:
        return 0.0 if num == 0 else math.inf
    return num / den


def relative_frobenius_error(f: Tensor, ref: Tensor) -> float:
    """``||F - R||_F / ||R||_F`` (``inf`` for a zero reference unless ``F`` is zero too)."""
    return _rel_frob(*_pair(f, ref))


def _top(m: Tensor, k: int) -> Tensor:
    """Top-``k`` eigenvectors ``[n, k]`` (decreasing eigenvalue) of a symmetric matrix."""
    return torch.linalg.eigh(m)[1].flip(1)[:, :k]


def _rank(ev: Tensor) -> int:
    top = float(ev.max()) if ev.numel() else 0.0
    return int((ev > _RANK_TOL * top).sum()) if top > 0 else 0


def _eigen_k(a: Tensor, b: Tensor, k: int) -> int:
    if a.dim() == 1:
        ea, eb = a, b
    else:
        ea, eb = torch.linalg.eigvalsh(a), torch.linalg.eigvalsh(b)
    return min(k, _rank(ea), _rank(eb))


def _cosines(a: Tensor, b: Tensor, k: int) -> tuple[float, ...]:
    if a.dim() == 1:
        ia, ib = a.argsort(descending=True)[:k], b.argsort(descending=True)[:k]
        return tuple(float(x == y) for x, y in zip(ia.tolist(), ib.tolist()))
    return tuple(float(c) for c in (_top(a, k) * _top(b, k)).sum(0).abs())


def _overlap(a: Tensor, b: Tensor, k: int) -> float:
    if k == 0:
        return math.nan
    if a.dim() == 1:
        ia = set(a.argsort(descending=True)[:k].tolist())
        ib = set(b.argsort(descending=True)[:k].tolist())
        return len(ia & ib) / k
    return float((_top(a, k).T @ _top(b, k)).square().sum()) / k


def top_eigenvector_cosines(f: Tensor, ref: Tensor, k: int = 5) -> tuple[float, ...]:
    """``|u_i^T v_i|`` of the top ``k`` eigenvectors, ``k`` capped at both numerical ranks."""
    a, b = _pair(f, ref)
    return _cosines(a, b, _eigen_k(a, b, k))


def subspace_overlap(f: Tensor, ref: Tensor, k: int = 5) -> float:
    """Mean squared cosine of the principal angles between the top-``k`` eigenspaces.

    1 when the spaces coincide, ``k / n`` in expectation for a random ``k``-space of ``R^n``;
    NaN when either factor is zero.
    """
    a, b = _pair(f, ref)
    return _overlap(a, b, _eigen_k(a, b, k))


def _normalised(m: Tensor) -> Tensor:
    mean = (m.sum() if m.dim() == 1 else m.diagonal().sum()) / m.shape[0]
    return m / mean if float(mean) > 0 else m


def _trace(m: Tensor) -> float:
    return float(m.sum() if m.dim() == 1 else m.diagonal().sum())


def _inv_root(m: Tensor, damping: float, power: float) -> Tensor:
    batch = m[None]  # [1, n] diagonal or [1, n, n]
    return inverse_sqrt_with_spectrum(batch, damping, power=power)[0][0]


def align_factor(
    f: Tensor,
    ref: Tensor,
    *,
    k: int = 5,
    damping: float = 1e-3,
    power: float = 0.5,
    layer: str = "",
    role: str = "",
    depth: int = 0,
    num_layers: int = 1,
) -> FactorAlignment:
    """All alignment measures of one factor ``f`` against ``ref`` (module docstring).

    Args:
        f: Factor ``[G, n, n]`` or ``[G, n]``.
        ref: Reference of the same layout.
        k: Eigenvectors compared (capped at both numerical ranks).
        damping: Relative damping of the inverse root.
        power: Power of the inverse root (1/2; Shampoo's exponent for ``L`` and ``R``).
        layer: Layer name, kept on the result.
        role: Factor role, kept on the result.
        depth: The layer's position in the forward order.
        num_layers: Number of layers in the comparison.

    Returns:
        :class:`FactorAlignment`.
    """
    a, b = _pair(f, ref)
    na, nb = _normalised(a), _normalised(b)
    ta, tb = _trace(a), _trace(b)
    kk = _eigen_k(a, b, k)
    return FactorAlignment(
        layer=layer,
        role=role,
        depth=depth,
        num_layers=num_layers,
        dim=int(a.shape[0]),
        k=kk,
        top_cosines=_cosines(a, b, kk),
        subspace_overlap=_overlap(a, b, kk),
        rel_frobenius=_rel_frob(a, b),
        rel_frobenius_shape=_rel_frob(na, nb),
        rel_frobenius_inv_root=_rel_frob(
            _inv_root(na, damping, power), _inv_root(nb, damping, power)
        ),
        trace_ratio=ta / tb if tb > 0 else math.inf,
    )


def compare_factors(
    factors: CurvatureFactors,
    reference: CurvatureFactors,
    *,
    k: int = 5,
    config: PreconditionerConfig | None = None,
) -> list[FactorAlignment]:
    """Align every layer and role of ``factors`` with ``reference`` (e.g. pink vs oracle).

    Args:
        factors: The factors judged (probe factors, or any other set).
        reference: The reference (often :class:`~dpkfc_med.analysis.OracleFactors`).
        k: Eigenvectors compared per factor.
        config: Damping and Shampoo exponent of the inverse roots (default settings).

    Returns:
        One :class:`FactorAlignment` per layer and role, layers in ``reference``'s forward
        order.

    Raises:
        ValueError: If the families differ or a layer is missing on either side.
    """
    if factors.family is not reference.family:
        raise ValueError(
            f"cannot compare {factors.family.value!r} factors with {reference.family.value!r} "
            "ones; estimate both with the same family"
        )
    missing = sorted(set(reference.layers) ^ set(factors.layers))
    if missing:
        raise ValueError(
            f"layers present on one side only: {missing}; compare factors of the same network"
        )
    cfg = config or PreconditionerConfig()
    out = []
    n = len(reference.layers)
    for depth, layer in enumerate(reference.layers):
        for role in reference.roles:
            damping, power = role_damping(reference.family, role, cfg)
            out.append(
                align_factor(
                    factors.factor(layer, role),
                    reference.factor(layer, role),
                    k=k,
                    damping=damping,
                    power=power,
                    layer=layer,
                    role=role,
                    depth=depth,
                    num_layers=n,
                )
            )
    return out


def eigenvalue_decay(factors: CurvatureFactors, layer: str, role: str) -> Tensor:
    """Eigenvalues divided by the largest, decreasing ``[G * n]`` (zeros for a zero factor)."""
    ev = factors.eigenvalues(layer, role)
    top = float(ev[0]) if ev.numel() else 0.0
    return ev / top if top > 0 else ev


_METRICS = (
    "top1",
    "subspace_overlap",
    "rel_frobenius",
    "rel_frobenius_shape",
    "rel_frobenius_inv_root",
    "trace_ratio",
)


def depth_summary(
    rows: Sequence[FactorAlignment], *, split: float = 0.5
) -> dict[str, dict[str, dict[str, float]]]:
    """Mean of each measure over shallow and deep layers, per role.

    A layer is *shallow* when ``depth < split * num_layers`` and *deep* otherwise. The trace
    ratio is averaged geometrically (it is a ratio), the others arithmetically; NaNs are
    skipped.

    Returns:
        ``{role: {"shallow" | "deep" | "all": {measure: mean}}}`` with the measures
        ``top1``, ``subspace_overlap``, ``rel_frobenius``, ``rel_frobenius_shape``,
        ``rel_frobenius_inv_root``, ``trace_ratio`` and the count ``layers``.
    """
    out: dict[str, dict[str, dict[str, float]]] = {}
    for role in dict.fromkeys(r.role for r in rows):
        mine = [r for r in rows if r.role == role]
        groups: Mapping[str, list[FactorAlignment]] = {
            "shallow": [r for r in mine if r.depth < split * r.num_layers],
            "deep": [r for r in mine if r.depth >= split * r.num_layers],
            "all": mine,
        }
        out[role] = {}
        for name, group in groups.items():
            stats: dict[str, float] = {"layers": float(len(group))}
            for m in _METRICS:
                vals = [r.row()[m] for r in group]
                vals = [v for v in vals if math.isfinite(v)]
                if not vals:
                    stats[m] = math.nan
                elif m == "trace_ratio":
                    vals = [v for v in vals if v > 0]
                    stats[m] = math.exp(sum(map(math.log, vals)) / len(vals)) if vals else math.nan
                else:
                    stats[m] = sum(vals) / len(vals)
            out[role][name] = stats
    return out
