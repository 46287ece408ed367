"""Multiply-add counts of a DP-KFC step and of a preconditioner refresh, and the refresh period.

The counts come from the covered layers' shapes only (one forward pass of one probe), so they
are deterministic: the same model, input size and settings give the same refresh period on
every machine, and a run can be reproduced exactly. They drive ``refresh_every="auto"``:
refresh every ``base * 2^k`` steps, the shortest such period at which the refreshes'
estimated share of training time stays within the budget. The measured shares are in
``docs/results.md`` (the cost tables).

Per covered layer with ``T`` output positions, ``G`` groups and factor sizes ``n_a``/``n_g``
(the adapter's ``dims``), per sample:

- forward ``T G n_a n_g`` (the per-sample weight gradient costs the same; transposed
  convolutions form it on their input grid, ``1 / prod(stride)`` of that);
- DP-KFC transform: the cheaper of ``T G (n_a^2 + n_g^2)`` (factored) and
  ``G (n_g^2 n_a + n_g n_a^2)`` (materialized), dropping the terms of identity or diagonal
  factors; ``S C^2 + n_g C K^2`` for a ``conv_a="kron"`` convolution with ``S`` input
  positions, ``C`` input channels and ``K`` kernel offsets (``KroneckerBlock.sample_grads``);
  a low-rank ``U_A`` (``rank_a = r``, where ``n_a > 2 r``) costs ``2 n_a r`` a row instead of
  ``n_a^2``.

A step of ``B`` samples costs ``B (3 forward + transform)`` (forward, backward, per-sample
gradients). A refresh with ``M`` probes costs the probe forward passes (and backward passes for
``G``), the factor products over the rows actually used (``min(T, max_positions)`` positions
per probe), ``EIGH_MACS_PER_N3 * n^3`` per eigendecomposition and the scale calibration
(``calibration_samples`` raw per-sample gradients, transformed).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn

from dpkfc_med.curvature.adapters import adapter_for
from dpkfc_med.curvature.factors import FactorReduction, covered_layers
from dpkfc_med.curvature.families import family_spec
from dpkfc_med.curvature.preconditioner import low_rank_of, transform_path_macs

__all__ = [
    "AUTO_REFRESH_BASE",
    "EIGH_MACS_PER_N3",
    "STEP_MACS_WEIGHT",
    "LayerFootprint",
    "auto_refresh_every",
    "refresh_settings_problems",
    "layer_footprint",
    "refresh_macs",
    "step_macs",
    "transform_macs",
]

EIGH_MACS_PER_N3 = 6.0
"""An ``n x n`` symmetric eigendecomposition takes as long as this many ``n^3`` multiply-adds
of a matrix product (float32 on CPU: a 1152-wide ``eigh`` about as long as 6 products of that
size)."""

STEP_MACS_WEIGHT = 2.4
"""A training step's multiply-adds (convolutions, per-sample hooks) run this many times slower
than the refresh's dense products. Fitted to the measured refresh / step time ratios of the
cost benchmark's three models on 2 CPU threads (``python -m dpkfc_bench cost``,
``dpkfc_bench/results/cost_cpu.md``)."""

AUTO_REFRESH_BASE = 20
"""Shortest period of ``refresh_every="auto"``; longer ones are this times a power of two."""

_KRON_TYPES = ("Conv1d", "Conv2d", "Conv3d")


@dataclass(frozen=True)
class LayerFootprint:
    """Shapes of one covered layer at the training input size (per sample)."""

    layer: str
    type: str
    T: int  # output positions
    S: int  # input positions
    G: int  # groups
    n_a: int  # input factor size (with the bias coordinate)
    n_g: int  # output factor size
    stride_prod: int
    C: int  # input channels (convolutions; 0 otherwise)
    K: int  # kernel offsets (convolutions; 1 otherwise)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable view."""
        return asdict(self)


def layer_footprint(model: nn.Module, sample: Tensor) -> list[LayerFootprint]:
    """Per covered layer: positions and factor sizes, from one no-grad forward of ``sample``.

    Args:
        model: the network (plain module; per-sample hooks must be disabled by the caller).
        sample: one input ``[1, ...]`` at the training size (a probe will do).
    """
    layers = covered_layers(model)
    positions: dict[str, int] = {}
    in_positions: dict[str, int] = {}

    def hook(name: str) -> Any:
        def fn(module: nn.Module, inputs: Any, output: Tensor) -> None:
            # a layer called several times per forward (weight sharing) adds up its calls
            positions[name] = positions.get(name, 0) + int(output[0, 0].numel())
            in_positions[name] = in_positions.get(name, 0) + int(inputs[0][0, 0].numel())

        return fn

    handles = [m.register_forward_hook(hook(n)) for n, m in layers.items()]
    try:
        with torch.no_grad():
            model(sample[:1])
    finally:
        for h in handles:
            h.remove()
    rows = []
    for name, m in layers.items():
        adapter = adapter_for(m)
        assert adapter is not None  # guaranteed by covered_layers
        g, n_a, n_g = adapter.dims(m)
        rows.append(
            LayerFootprint(
                layer=name,
                type=type(m).__name__,
                T=positions.get(name, 0),
                S=in_positions.get(name, 0),
                G=g,
                n_a=n_a,
                n_g=n_g,
                stride_prod=math.prod(getattr(m, "stride", (1,))),
                C=int(getattr(m, "in_channels", 0)),
                K=math.prod(getattr(m, "kernel_size", (1,))),
            )
        )
    return rows


def _settings(config: Any) -> dict[str, Any]:
    return config.to_dict() if hasattr(config, "to_dict") else dict(config)


def _full(n: int, factors: str, max_dim: int) -> bool:
    return factors != "identity" and n <= max_dim


def _kron(r: LayerFootprint, cfg: dict[str, Any], full_a: bool) -> bool:
    return cfg.get("conv_a") == "kron" and full_a and r.G == 1 and r.type in _KRON_TYPES


def _raw(r: LayerFootprint) -> int:
    raw = r.T * r.G * r.n_a * r.n_g
    if r.type.startswith("ConvTranspose"):
        raw //= max(r.stride_prod, 1)
    return raw


def transform_macs(rows: list[LayerFootprint], config: Any) -> list[dict[str, Any]]:
    """Per covered layer and per sample: multiply-adds of the raw gradient and the transform.

    The raw per-sample gradient is what DP-SGD computes too; the DP-KFC transform is counted
    on the path the preconditioner picks, with the same
    :func:`~dpkfc_med.curvature.preconditioner.transform_path_macs` the blocks choose it by;
    transposed convolutions form raw gradients on their input grid and always transform them
    (``n_g^2 n_a + n_g n_a^2``). The family's registry entry
    (:func:`~dpkfc_med.curvature.families.family_spec`) says what changes: Shampoo counts
    both sides as full matrices where they fit ``max_factor_dim`` (``R`` low rank under
    ``shampoo_rank``); the diagonal family one elementwise product of the gradient.

    Args:
        rows: :func:`layer_footprint`.
        config: a ``PreconditionerConfig`` or its ``to_dict()``.
    """
    cfg = _settings(config)
    max_dim, factors = int(cfg["max_factor_dim"]), str(cfg["factors"])
    family = family_spec(cfg.get("family", "kfac"))
    factors = family.cost_factors or factors  # Shampoo: both sides, each full where it fits
    out = []
    for r in rows:
        t, g, n_a, n_g = r.T, r.G, r.n_a, r.n_g
        full_a = _full(n_a, factors, max_dim)
        full_g = factors == "ag" and n_g <= max_dim
        a_row = full_a * n_a * n_a  # one row times U_A
        kron = family.kron_conv and _kron(r, cfg, full_a)
        rank = low_rank_of(n_a, cfg.get(family.rank_key)) if family.rank_key else None
        if full_a and rank and not kron:
            a_row = 2 * n_a * rank  # c I + V diag(d) V^T
        factored, materialized = transform_path_macs(
            positions=t, groups=g, n_a=n_a, n_g=n_g, a_row=a_row, full_g=full_g
        )
        if family.elementwise:
            extra = g * n_g * n_a  # g / sqrt(v): one product per weight
        elif factors == "identity":
            extra = 0
        elif kron:
            c, k = r.C, r.K
            extra = r.S * c * c + n_g * c * k * k + full_g * n_g * n_g * n_a
        elif r.type.startswith("ConvTranspose"):
            extra = materialized
        else:
            extra = min(factored, materialized)
        out.append({"layer": r.layer, "type": r.type, "raw": _raw(r), "transform": extra})
    return out


def step_macs(rows: list[LayerFootprint], config: Any, batch: int) -> float:
    """Estimated multiply-adds of one DP-KFC step of ``batch`` samples."""
    per_sample = sum(3 * m["raw"] + m["transform"] for m in transform_macs(rows, config))
    return float(batch * per_sample)


def refresh_macs(rows: list[LayerFootprint], config: Any) -> dict[str, float]:
    """Estimated multiply-adds of one refresh, by part, and their ``"total"``."""
    cfg = _settings(config)
    factors = str(cfg["factors"])
    if factors == "identity":
        return {"forward": 0.0, "factors": 0.0, "eigh": 0.0, "calibration": 0.0, "total": 0.0}
    m = int(cfg["num_probes"])
    max_dim = int(cfg["max_factor_dim"])
    max_pos = cfg.get("max_positions")
    reduce = str(cfg.get("reduction", "expand")) == FactorReduction.REDUCE.value
    ag = factors == "ag"
    fwd = sum(_raw(r) for r in rows)
    forward = m * fwd * (3 if ag else 1)  # backward passes only for the G factors
    products = eigh = 0.0
    for r in rows:
        full_a = _full(r.n_a, factors, max_dim)
        used = 1 if reduce else min(r.T, max_pos) if max_pos else r.T
        products += m * used * r.G * (r.n_a * r.n_a if full_a else r.n_a)
        if _kron(r, cfg, full_a):
            eigh += EIGH_MACS_PER_N3 * (r.C**3 + r.K**3)
        elif full_a:
            eigh += EIGH_MACS_PER_N3 * r.G * r.n_a**3
        if ag:
            full_g = r.n_g <= max_dim
            products += m * (1 if reduce else r.T) * r.G * (r.n_g * r.n_g if full_g else r.n_g)
            eigh += EIGH_MACS_PER_N3 * r.G * r.n_g**3 * full_g
    c = min(int(cfg["calibration_samples"]), m)
    # calibration: forward + backward of c probes, raw per-sample gradients, their transform
    # (always the materialized product there)
    calib = c * sum(
        3 * _raw(r)
        + r.G
        * (
            (r.n_g * r.n_a * r.n_a if _full(r.n_a, factors, max_dim) else 0)
            + (r.n_g**2 * r.n_a if ag and r.n_g <= max_dim else 0)
        )
        for r in rows
    )
    total = forward + products + eigh + calib
    return {
        "forward": float(forward),
        "factors": float(products),
        "eigh": float(eigh),
        "calibration": float(calib),
        "total": float(total),
    }


def auto_refresh_every(
    rows: list[LayerFootprint],
    config: Any,
    batch: int,
    budget: float,
    base: int = AUTO_REFRESH_BASE,
) -> dict[str, Any]:
    """The ``refresh_every="auto"`` period: the shortest ``base * 2^k`` steps within budget.

    ``k >= 0`` is the smallest with ``refresh / (period * step + refresh) <= budget`` in the
    multiply-add estimates (the step's weighted by :data:`STEP_MACS_WEIGHT`).

    Returns ``{"refresh_every", "estimated_share", "refresh_macs", "step_macs_weighted", ...}``.
    """
    if not (0 < budget < 1):
        raise ValueError(f"refresh_budget={budget!r}: must be between 0 and 1 (e.g. 0.05)")
    ref = refresh_macs(rows, config)
    step = STEP_MACS_WEIGHT * step_macs(rows, config, max(batch, 1))
    period = base
    if ref["total"] > 0 and step > 0:
        # share <= budget  <=>  period >= refresh (1 - budget) / (budget * step)
        need = ref["total"] * (1 - budget) / (budget * step)
        period = base * 2 ** max(0, math.ceil(math.log2(max(need / base, 1e-300))))
    share = ref["total"] / (period * step + ref["total"]) if ref["total"] > 0 else 0.0
    return {
        "refresh_every": int(period),
        "estimated_share": share,
        "budget": budget,
        "base": base,
        "refresh_macs": ref,
        "step_macs_weighted": step,
        "batch": batch,
        "eigh_macs_per_n3": EIGH_MACS_PER_N3,
        "step_macs_weight": STEP_MACS_WEIGHT,
    }


def refresh_settings_problems(refresh_every: Any, refresh_budget: Any) -> list[str]:
    """What is wrong with ``refresh_every`` and ``refresh_budget``, if anything."""
    problems = []
    whole = isinstance(refresh_every, int) and not isinstance(refresh_every, bool)
    ok = refresh_every == "auto" or (whole and refresh_every >= 0)
    if not ok:
        problems.append(
            f"refresh_every={refresh_every!r}: must be 'auto' or a whole number of steps >= 0 "
            "(0: only the preconditioner built at step 0)"
        )
    if not (isinstance(refresh_budget, (int, float)) and 0 < refresh_budget < 1):
        problems.append(
            f"refresh_budget={refresh_budget!r}: must be a share of training time between 0 "
            "and 1 (e.g. 0.05)"
        )
    return problems
