r"""Gradient-statistic preconditioner families estimated from probe per-sample gradients.

Besides K-FAC (activation and error factors, :mod:`.factors`), two families act on the
per-sample gradient matrix ``g_m [G, n_g, n_a]`` of each covered layer, estimated from the
probes' per-sample gradients only (never from private data):

* **Shampoo** (Gupta et al. 2018): ``L = E_m[g_m g_m^T]`` ``[G, n_g, n_g]`` and
  ``R = E_m[g_m^T g_m]`` ``[G, n_a, n_a]``, applied as ``L^{-p} g R^{-p}`` (``p = 1/4`` by
  default). Both factors are damped relative to their mean eigenvalue; a side wider than
  ``max_factor_dim`` keeps only its diagonal.
* **Diagonal** (AdaDPS-style, Li et al. 2022): ``v = E_m[g_m^2]`` elementwise, applied as
  ``g / sqrt(v + damping * mean(v))``.

The expectation runs over all probes, in chunks, with ``delta`` the gradient of the sum of
per-sample losses (so each ``g_m`` is probe ``m``'s own gradient). Everything here reads the
model's parameters and the probes only.

Each family is one :func:`register_family` entry (a :class:`CurvatureFamily`) saying what
differs: where its statistics come from, which setting makes its input side low rank, and
what the cost model and the calibration need to know. The rest of :mod:`dpkfc_med.curvature`
looks a family up with :func:`family_spec` and never tests its name. Adding a family means
registering one entry (its name becomes a valid ``preconditioner.family``) plus its test.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import torch
from torch import Tensor, nn

from dpkfc_med.curvature.adapters import adapter_for
from dpkfc_med.curvature.factors import LossFn, capture_raw
from dpkfc_med.utils import did_you_mean

__all__ = [
    "CurvatureFamily",
    "Family",
    "GradientStatistics",
    "check_family",
    "estimate_gradient_statistics",
    "family_spec",
    "raw_layer_grads",
    "register_family",
    "registered_families",
]


class Family(str, Enum):
    """The built-in curvature families of the preconditioner (``preconditioner.family``).

    Their behaviour is in the registry (:func:`family_spec`); a family registered elsewhere
    is valid by its plain name.
    """

    KFAC = "kfac"
    SHAMPOO = "shampoo"
    DIAGONAL = "diagonal"


@dataclass
class GradientStatistics:
    """Probe per-sample-gradient statistics of one layer (float64).

    Attributes:
        left: Shampoo ``L``: ``[G, n_g, n_g]``, or its diagonal ``[G, n_g]``; ``None`` for the
            diagonal family.
        right: Shampoo ``R``: ``[G, n_a, n_a]`` or ``[G, n_a]``; ``None`` for the diagonal
            family.
        second_moment: diagonal family ``E[g^2]`` ``[G, n_g, n_a]``; ``None`` for Shampoo.
        num_samples: probes averaged.
    """

    left: Tensor | None
    right: Tensor | None
    second_moment: Tensor | None
    num_samples: int


Statistics = Callable[[Tensor, int], tuple[Tensor | None, Tensor | None, Tensor | None]]
"""``(g [B, G, n_g, n_a], max_factor_dim) -> (left, right, second_moment)``: one chunk's sums."""


@dataclass(frozen=True)
class CurvatureFamily:
    """What one curvature family changes, registered with :func:`register_family`.

    Attributes:
        name: its ``preconditioner.family`` value.
        statistics: one chunk's probe statistics of the per-sample gradients
            ``g [B, G, n_g, n_a]`` (float64), summed over the chunk, as the fields ``left``,
            ``right``, ``second_moment`` of :class:`GradientStatistics` (averaged over the
            probes afterwards; the preconditioner inverts ``left``/``right`` to the power
            ``shampoo_exponent``, and ``second_moment`` elementwise). ``None``: the family is
            estimated from Kronecker factors of activations and output errors
            (:func:`~dpkfc_med.curvature.factors.estimate_factors`), as K-FAC is.
        rank_key: the ``PreconditionerConfig`` field whose rank ``r`` makes a full input-side
            factor low rank (``c I + V diag(d) V^T``); ``None`` when no setting does.
        cost_factors: the factor mode the cost model counts whatever
            ``preconditioner.factors`` says (Shampoo always has both sides, ``"ag"``);
            ``None``: the config's.
        kron_conv: ``conv_a="kron"`` applies (a convolution's input-side factor as a
            channel x kernel-offset Kronecker product; never low rank).
        elementwise: the transform is an elementwise product of the raw gradient (one
            multiply per weight, no row form); the fallback parameters then get their
            diagonal too, whatever ``preconditioner.fallback`` says.
    """

    name: str
    statistics: Statistics | None = None
    rank_key: str | None = None
    cost_factors: str | None = None
    kron_conv: bool = False
    elementwise: bool = False


_FAMILIES: dict[str, CurvatureFamily] = {}


def register_family(family: CurvatureFamily) -> CurvatureFamily:
    """Register a curvature family under its name; a second entry of one name is an error."""
    if family.name in _FAMILIES:
        raise ValueError(
            f"curvature family {family.name!r} is registered twice: {_FAMILIES[family.name]} "
            f"and {family}"
        )
    _FAMILIES[family.name] = family
    return family


def registered_families() -> tuple[str, ...]:
    """Names of the registered families, in registration order."""
    return tuple(_FAMILIES)


def _normalized(name: str) -> str:
    return name.strip().lower().replace("-", "_")


def check_family(value: object, field: str = "preconditioner.family") -> Family | str:
    """``value`` (a :class:`Family`, or a registered name in any case) as a family name.

    Returns the :class:`Family` member for a built-in family, the registered name otherwise.

    Raises:
        ValueError: naming ``field``, the registered families and the closest match.
    """
    name = value.value if isinstance(value, Family) else value
    if isinstance(name, str):
        for known in _FAMILIES:
            if _normalized(known) == _normalized(name):
                return Family(known) if known in {f.value for f in Family} else known
    allowed = list(_FAMILIES)
    raise ValueError(
        f"{field}={name!r} is not allowed{did_you_mean(str(name), allowed)}; "
        f"choose one of {allowed}"
    )


def family_spec(family: Family | str) -> CurvatureFamily:
    """The registered :class:`CurvatureFamily` of ``family`` (a member or a plain name)."""
    name = check_family(family)
    return _FAMILIES[name.value if isinstance(name, Family) else name]


_CHUNK_ELEMENTS = 1 << 22  # unfolded patch elements per sub-chunk (16 MiB in float32)


def raw_layer_grads(module: nn.Module, x: Tensor, dy: Tensor) -> Tensor:
    """Untransformed per-sample gradients ``[B, G, n_g, n_a]`` of one covered layer.

    Unfolds a few samples at a time, so a 3D volume's patches never exist for the whole batch.
    """
    ad = adapter_for(module)
    assert ad is not None, f"{type(module).__name__} has no layer adapter"
    if ad.param_grads is not None:
        return ad.from_params(module, ad.param_grads(module, x, dy))
    first = ad.activations(module, x[:1])  # [1, T, G, n_a]
    step = max(1, _CHUNK_ELEMENTS // max(first.numel(), 1))
    parts = []
    for s in range(0, x.shape[0], step):
        a = ad.activations(module, x[s : s + step])  # [b, T, G, n_a]
        d = ad.errors(module, dy[s : s + step])  # [b, T, G, n_g]
        parts.append(torch.einsum("btgo,btgi->bgoi", d, a))
    return torch.cat(parts)


def estimate_gradient_statistics(
    model: nn.Module,
    inputs: Tensor,
    targets: Tensor,
    loss_fn: LossFn,
    layers: dict[str, nn.Module],
    family: Family | str,
    *,
    chunk_size: int,
    max_factor_dim: int,
) -> dict[str, GradientStatistics]:
    """Gradient statistics of ``family`` (Shampoo, diagonal) for every layer in ``layers``.

    Args:
        model: the network (its parameters are read, never its gradients).
        inputs: probe inputs ``[M, ...]``.
        targets: probe targets.
        loss_fn: per-sample losses ``[M]``.
        layers: covered layers by name.
        family: a registered family with :attr:`CurvatureFamily.statistics`, such as
            :attr:`Family.SHAMPOO` or :attr:`Family.DIAGONAL`.
        chunk_size: probes per forward/backward pass.
        max_factor_dim: a Shampoo side wider than this keeps only its diagonal.

    Returns:
        ``{layer name: GradientStatistics}``.
    """
    spec = family_spec(family)
    if spec.statistics is None:
        raise ValueError(
            f"family {spec.name!r}: its factors come from estimate_factors, not gradient statistics"
        )
    sums: dict[str, list[Tensor | None]] = {}
    m = inputs.shape[0]
    for s in range(0, m, chunk_size):
        chunk = slice(s, s + chunk_size)
        pairs = capture_raw(model, inputs[chunk], targets[chunk], loss_fn, layers)
        for name, module in layers.items():
            for x, dy in pairs[name]:
                assert dy is not None
                g = raw_layer_grads(module, x, dy).detach().double()  # [B, G, n_g, n_a]
                acc = sums.setdefault(name, [None, None, None])
                part = spec.statistics(g, max_factor_dim)
                sums[name] = [p if a is None else a + p for a, p in zip(acc, part)]  # type: ignore[operator]
    out: dict[str, GradientStatistics] = {}
    for name, (left, right, second) in sums.items():
        mean = [None if t is None else t / m for t in (left, right, second)]
        out[name] = GradientStatistics(mean[0], mean[1], mean[2], m)
    return out


def _shampoo_statistics(
    g: Tensor, max_factor_dim: int
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``L = sum_b g_b g_b^T`` ``[G, n_g, n_g]`` and ``R = sum_b g_b^T g_b`` ``[G, n_a, n_a]``.

    A side wider than ``max_factor_dim`` keeps only its diagonal (``[G, n_g]``, ``[G, n_a]``).
    """
    n_g, n_a = g.shape[-2:]
    left = g.pow(2).sum((0, 3)) if n_g > max_factor_dim else torch.einsum("bgoi,bgpi->gop", g, g)
    right = g.pow(2).sum((0, 2)) if n_a > max_factor_dim else torch.einsum("bgoi,bgoj->gij", g, g)
    return left, right, None


def _diagonal_statistics(
    g: Tensor, max_factor_dim: int
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``v = sum_b g_b^2`` elementwise ``[G, n_g, n_a]``."""
    return None, None, g.pow(2).sum(0)


register_family(CurvatureFamily(Family.KFAC.value, rank_key="rank_a", kron_conv=True))
register_family(
    CurvatureFamily(
        Family.SHAMPOO.value,
        statistics=_shampoo_statistics,
        rank_key="shampoo_rank",
        cost_factors="ag",
    )
)
register_family(
    CurvatureFamily(Family.DIAGONAL.value, statistics=_diagonal_statistics, elementwise=True)
)
