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

The scale ``s`` (why the clip norm ``C`` keeps its meaning) is set on probes by the scale rule of
:mod:`dpkfc_med.curvature.calibration`; the coverage table is :mod:`dpkfc_med.curvature.coverage`.

All of it depends only on probes and on the current (already released) parameters.

Every eigendecomposition goes through :func:`~dpkfc_med.curvature.linalg.robust_eigh`: a
factor whose decomposition fails in ``eig_dtype`` is retried in float64, then with a small
diagonal jitter, and as a last resort gets the damped identity scaled by its mean diagonal;
each such fallback is listed in ``summary()["eig_fallbacks"]``.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor, nn

from dpkfc_med.curvature.adapters import adapter_for
from dpkfc_med.curvature.blocks import (
    FallbackBlock,
    KronA,
    KroneckerBlock,
    LowRankA,
    inverse_sqrt,
    inverse_sqrt_with_spectrum,
    kron_a_from_factor,
    kron_eligible,
    low_rank_of,
    outer_sum,
    raw_norms_sq,
    transform_path_macs,
)
from dpkfc_med.curvature.calibration import calibrate_scales
from dpkfc_med.curvature.config import FactorMode, FallbackRule, PreconditionerConfig, ScaleRule
from dpkfc_med.curvature.coverage import coverage_rows, coverage_shares
from dpkfc_med.curvature.factors import (
    KroneckerFactors,
    LossFn,
    covered_layers,
    estimate_factors,
)
from dpkfc_med.curvature.families import estimate_gradient_statistics, family_spec
from dpkfc_med.curvature.linalg import EighFallback

__all__ = [
    "FactorMode",
    "FallbackBlock",
    "FallbackRule",
    "KronA",
    "KroneckerBlock",
    "KroneckerPreconditioner",
    "LowRankA",
    "PreconditionerConfig",
    "ScaleRule",
    "coverage_shares",
    "coverage_summary",
    "inverse_sqrt",
    "inverse_sqrt_with_spectrum",
    "low_rank_of",
    "outer_sum",
    "raw_norms_sq",
    "transform_path_macs",
]


def _input_side(
    factor: Tensor,
    damping: float,
    rank: int | None,
    out_dtype: torch.dtype,
    *,
    layer: str,
    part: str,
    record: list[EighFallback],
    power: float = 0.5,
) -> tuple[Tensor | None, LowRankA | None, Tensor]:
    """``factor^{-power}`` of an input side (K-FAC ``A``, Shampoo ``R``).

    Low rank under ``rank`` where that saves work (:func:`low_rank_of`), dense (or diagonal)
    otherwise.

    Returns:
        ``(dense or diagonal root, low-rank root, eigenvalues)``; one of the roots is ``None``.
    """
    if factor.dim() == 3 and (r := low_rank_of(factor.shape[-1], rank)):
        low, ev = LowRankA.from_factor(
            factor, damping, r, out_dtype, layer=layer, record=record, power=power, part=part
        )
        return None, low, ev
    root, ev = inverse_sqrt_with_spectrum(
        factor, damping, layer=layer, part=part, record=record, power=power
    )
    return root.to(out_dtype), None, ev


def _fallback_blocks(model: nn.Module, covered: dict[str, nn.Module]) -> dict[str, FallbackBlock]:
    """An identity :class:`FallbackBlock` for every trainable parameter no block covers."""
    owned = {id(p) for m in covered.values() for p in m.parameters(recurse=False)}
    out = {}
    for mod_name, module in model.named_modules():
        for p_name, p in module.named_parameters(recurse=False):
            if p.requires_grad and id(p) not in owned:
                full = f"{mod_name}.{p_name}" if mod_name else p_name
                out[full] = FallbackBlock(full, p, mod_name, owner=module)
    return out


def _param_dtype(model: nn.Module) -> torch.dtype:
    """The model's floating dtype (float32 when it has no floating parameters)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


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
        fallbacks = _fallback_blocks(model, covered)
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
        if family_spec(cfg.family).statistics is not None:  # Shampoo, diagonal
            stats = estimate_gradient_statistics(
                model,
                inputs,
                targets,
                loss_fn,
                covered,
                cfg.family,
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
                # summed over chunks in the decompositions' dtype: float64 sums of a large
                # network's factors double the refresh's peak memory for no gain, since the
                # decompositions (eig_dtype) only see them in that dtype anyway
                dtype=torch.promote_types(eig_dtype, _param_dtype(model)),
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
                st = stats.pop(name)
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
                    u_a, a_low, ev_a = _input_side(
                        st.right.to(dt),
                        cfg.damping_a,
                        cfg.shampoo_rank,
                        ref_p.dtype,
                        layer=name,
                        part="R",
                        record=eig_fallbacks,
                        power=pw,
                    )
                    u_g = u_g.to(ref_p.dtype)
                    spectra[name] = {"L": _spectrum_stats(ev_g), "R": _spectrum_stats(ev_a)}
            elif name in factors:
                # popped once inverted (unless kept): the factors of a large network
                # would otherwise all stay alive through the decompositions and calibration
                f = factors[name] if keep_factors else factors.pop(name)
                ref: Tensor = module.weight  # type: ignore[assignment]
                # a float64 model gets float64 decompositions whatever eig_dtype says
                dt = torch.promote_types(eig_dtype, ref.dtype)
                if kron_eligible(module, f.a) and cfg.conv_a == "kron":
                    a_kron, ev_a = kron_a_from_factor(
                        module, f.a, cfg.damping_a, dt, ref.dtype, layer=name, record=eig_fallbacks
                    )
                else:
                    u_a, a_low, ev_a = _input_side(
                        f.a.to(dt),
                        cfg.damping_a,
                        cfg.rank_a,
                        ref.dtype,
                        layer=name,
                        part="A",
                        record=eig_fallbacks,
                    )
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
        fallbacks = _fallback_blocks(model, covered)
        pre = cls(blocks, fallbacks, cfg, factors=factors if keep_factors else None)
        calib = calibrate_scales(pre.blocks, pre.fallbacks, cfg, model, inputs, targets, loss_fn)
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

    # ---------------------------------------------------------------------------- use
    def fingerprint(self) -> float:
        """One number that changes with any factor, transform or scale (to compare copies)."""
        total = 0.0
        for block in self.blocks.values():
            parts = [block.u_a, block.u_g, block.u_elem]
            if block.a_low is not None:
                parts += [block.a_low.v, block.a_low.vd_t, block.a_low.c]
            if block.a_kron is not None:
                parts += [block.a_kron.u_c, block.a_kron.u_k]
            total += block.scale + sum(float(t.double().sum()) for t in parts if t is not None)
        for fb in self.fallbacks.values():
            total += fb.scale + (0.0 if fb.diag is None else float(fb.diag.double().sum()))
        return total

    def module_blocks(self) -> dict[nn.Module, KroneckerBlock]:
        """Covered module -> its block, the mapping the per-sample gradient hooks are handed.

        See :meth:`~dpkfc_med.privacy.grad_sample.PreconditionedGradSampleModule.set_blocks`.
        """
        return {block.module: block for block in self.blocks.values()}

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
        return coverage_rows(self.blocks, self.fallbacks, self.config.family)

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


def coverage_summary(model: nn.Module) -> list[dict[str, Any]]:
    """Coverage table of ``model`` before any probe pass (identity factors)."""
    return KroneckerPreconditioner.identity(model).coverage()
