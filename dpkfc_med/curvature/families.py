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
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
from torch import Tensor, nn

from dpkfc_med.curvature.adapters import adapter_for
from dpkfc_med.curvature.factors import LossFn, capture_raw

__all__ = ["Family", "GradientStatistics", "estimate_gradient_statistics", "raw_layer_grads"]


class Family(str, Enum):
    """Curvature family of the preconditioner (``preconditioner.family``)."""

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
    family: Family,
    *,
    chunk_size: int,
    max_factor_dim: int,
) -> dict[str, GradientStatistics]:
    """Shampoo or diagonal statistics of every layer in ``layers`` from the probe batch.

    Args:
        model: the network (its parameters are read, never its gradients).
        inputs: probe inputs ``[M, ...]``.
        targets: probe targets.
        loss_fn: per-sample losses ``[M]``.
        layers: covered layers by name.
        family: :attr:`Family.SHAMPOO` or :attr:`Family.DIAGONAL`.
        chunk_size: probes per forward/backward pass.
        max_factor_dim: a Shampoo side wider than this keeps only its diagonal.

    Returns:
        ``{layer name: GradientStatistics}``.
    """
    if family is Family.KFAC:
        raise ValueError("K-FAC factors come from estimate_factors, not gradient statistics")
    sums: dict[str, list[Tensor | None]] = {}
    m = inputs.shape[0]
    for s in range(0, m, chunk_size):
        chunk = slice(s, s + chunk_size)
        pairs = capture_raw(model, inputs[chunk], targets[chunk], loss_fn, layers)
        for name, module in layers.items():
            for x, dy in pairs[name]:
                assert dy is not None
                g = raw_layer_grads(module, x, dy).detach().double()  # [B, G, n_g, n_a]
                acc = sums.setdefault(name, [None, None])
                if family is Family.DIAGONAL:
                    part = [g.pow(2).sum(0), None]
                else:
                    n_g, n_a = g.shape[-2:]
                    left = (
                        g.pow(2).sum((0, 3))
                        if n_g > max_factor_dim
                        else torch.einsum("bgoi,bgpi->gop", g, g)
                    )
                    right = (
                        g.pow(2).sum((0, 2))
                        if n_a > max_factor_dim
                        else torch.einsum("bgoi,bgoj->gij", g, g)
                    )
                    part = [left, right]
                sums[name] = [p if a is None else a + p for a, p in zip(acc, part)]  # type: ignore[operator]
    out: dict[str, GradientStatistics] = {}
    for name, (first, second) in sums.items():
        assert first is not None
        if family is Family.DIAGONAL:
            out[name] = GradientStatistics(None, None, first / m, m)
        else:
            assert second is not None
            out[name] = GradientStatistics(first / m, second / m, None, m)
    return out
