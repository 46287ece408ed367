r"""The scale rule: the preconditioner's scale ``s`` from per-sample gradient norms on probes.

Why the clip norm ``C`` keeps its meaning: on ``calibration_samples`` probe
samples we compute raw per-sample gradient norms ``||g_i||`` and transformed norms
``||U g_i||`` (all parameters, fallback included), then

* ``global`` (default): one scalar ``s = median_i ||g_i|| / median_i ||U g_i||`` for the whole
  network, so on probes the transformed per-sample norms have the same median as raw ones and
  ``C`` can be chosen exactly as for DP-SGD; it is recomputed at every refresh, so ``C`` keeps
  that meaning as the factors change.
* ``per_layer``: each layer (fallback parameters grouped by their module) gets ``s_l`` so its
  median transformed norm equals ``median_i ||g_i|| / sqrt(L)``: all ``L`` layers share the
  clipped norm equally on probes (prevents one ill-conditioned layer from taking all of it).
* ``per_layer_raw``: each layer gets ``s_l = median_i ||g_{i,l}|| / median_i ||U g_{i,l}||``, so
  on probes every layer keeps the share of the clipped norm it has without preconditioning
  (DP-SGD's split between layers) and the preconditioner only reshapes the gradient inside each
  layer. Whitening can move most of the norm into a few deep layers, leaving the others (and
  fallback parameters, whose transform is ``s I``) with almost none of it and so a tiny
  signal-to-noise ratio; this rule keeps the between-layer split.
* ``none``: ``s = 1``.

All of it depends only on probes and on the current (already released) parameters.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from opacus.grad_sample import GradSampleModule
from torch import Tensor, nn

from dpkfc_med.curvature.blocks import FallbackBlock, KroneckerBlock, inverse_sqrt
from dpkfc_med.curvature.config import FallbackRule, PreconditionerConfig, ScaleRule
from dpkfc_med.curvature.factors import LossFn, capture_raw
from dpkfc_med.curvature.families import family_spec

__all__ = ["calibrate_scales"]

# Opacus' per-layer per-sample gradient formulas (norm layers, embeddings, and whatever is
# registered with opacus.grad_sample.register_grad_sampler, read at call time), reused for the
# fallback parameters during calibration.
_OPACUS_SAMPLERS = GradSampleModule.GRAD_SAMPLERS


def calibrate_scales(
    blocks: dict[str, KroneckerBlock],
    fallbacks: dict[str, FallbackBlock],
    cfg: PreconditionerConfig,
    model: nn.Module,
    inputs: Tensor,
    targets: Tensor,
    loss_fn: LossFn,
) -> dict[str, Any]:
    """Set the scale of every block and fallback by ``cfg.scaling`` from probe gradient norms.

    Fallbacks under the diagonal rule (or of the diagonal family) also get their
    ``diag(E[g^2] + damping)^{-1/2}`` here, from the same probe gradients.

    Args:
        blocks: the covered layers' blocks (their ``scale`` is set).
        fallbacks: the fallback parameters' blocks (their ``scale`` and ``diag`` are set).
        cfg: settings (``scaling``, ``calibration_samples``, ``fallback``).
        model: the network at its current parameters.
        inputs: probe inputs ``[M, ...]``; the first ``calibration_samples`` are used.
        targets: probe targets.
        loss_fn: per-sample loss ``(outputs, targets) -> [M]``.

    Returns:
        The calibration's figures for the report: samples used, median raw and unscaled
        transformed norms, the global scale, per-layer scales and per-layer shares of the
        transformed norm on probes.
    """
    n = min(cfg.calibration_samples, inputs.shape[0])
    x, y = inputs[:n], targets[:n]
    raw_sq = torch.zeros(n, dtype=torch.float64)
    unit_sq: dict[str, Tensor] = {}  # transformed (scale 1) squared norms per unit
    unit_raw_sq: dict[str, Tensor] = {}  # raw squared norms per unit
    covered = {b.name: b.module for b in blocks.values()}
    owners = {fb.module_name: fb.owner for fb in fallbacks.values() if fb.owner is not None}
    owners = {k: m for k, m in owners.items() if type(m) in _OPACUS_SAMPLERS and k not in covered}
    raw_pairs = capture_raw(model, x, y, loss_fn, {**covered, **owners})
    for name in covered:
        block = blocks[name]
        for xa, dy in raw_pairs[name]:
            assert dy is not None
            raw = block.raw_grads(xa, dy)
            saved, block.scale = block.scale, 1.0
            trans = block.transform_grads(raw)
            block.scale = saved
            rsq = raw.pow(2).flatten(1).sum(1).double().cpu()
            raw_sq += rsq
            unit_raw_sq[name] = unit_raw_sq.get(name, 0) + rsq
            sq = trans.pow(2).flatten(1).sum(1).double().cpu()
            unit_sq[name] = unit_sq.get(name, 0) + sq
    if fallbacks:
        # Per-sample gradients of norm affines etc. from the same pass through Opacus'
        # per-layer formulas; anything else (raw parameters) by one backward per sample.
        got: dict[int, Tensor] = {}
        for name, module in owners.items():
            for xa, dy in raw_pairs[name]:
                for p, g in _OPACUS_SAMPLERS[type(module)](module, [xa], dy).items():
                    got[id(p)] = got[id(p)] + g if id(p) in got else g
        rest = [fb.param for fb in fallbacks.values() if id(fb.param) not in got]
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
        for fb in fallbacks.values():
            gs = got[id(fb.param)].detach()
            if cfg.fallback is FallbackRule.DIAGONAL or family_spec(cfg.family).elementwise:
                second = gs.pow(2).mean(0)
                fb.diag = inverse_sqrt(second.flatten().unsqueeze(0), cfg.fallback_damping).reshape(
                    fb.param.shape
                )
            rsq = gs.pow(2).flatten(1).sum(1).double().cpu()
            raw_sq += rsq
            key = f"{fb.module_name} (fallback)"
            unit_raw_sq[key] = unit_raw_sq.get(key, 0) + rsq
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
        for k, sq in unit_sq.items():
            if cfg.scaling is ScaleRule.PER_LAYER_RAW:
                target = float(torch.as_tensor(unit_raw_sq[k]).sqrt().median())
            else:
                target = raw_med / math.sqrt(max(len(unit_sq), 1))
            med = float(sq.sqrt().median())
            scales[k] = target / med if med > 0 and target > 0 else global_s
    for name, block in blocks.items():
        block.scale = scales.get(name, global_s if cfg.scaling is ScaleRule.GLOBAL else 1.0)
    for fb in fallbacks.values():
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
