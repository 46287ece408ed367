"""DP-AdamBC: Adam whose second moment has the known DP-noise variance subtracted.

Tang, Shpilevskiy and Lecuyer, "DP-AdamBC: Your DP-Adam Is Actually DP-SGD (Unless You Apply
Bias Correction)", AAAI 2024 (arXiv 2312.14334). A privatized gradient
``g~ = (sum_i clip(g_i) + N(0, sigma^2 C^2 I)) / B`` has, per coordinate, the variance of the
clipped mean plus ``Phi = (sigma C / B)^2``; Adam's ``v`` tracks ``E[g~^2]`` and so is
dominated by ``Phi``, which turns DP-Adam into DP-SGD with a rescaled learning rate. The update
here is

    theta <- theta - lr * m_hat / sqrt(max(v_hat - Phi, gamma))

with Adam's bias-corrected ``m_hat`` and ``v_hat``. It only post-processes released (noised)
gradients, so the privacy guarantee is unchanged. With DP-KFC the noise is isotropic in the
transformed coordinates the step is taken in, so the same ``Phi`` applies.

Written by hand: neither PyTorch nor Opacus ships it (Opacus' optimizers wrap any
``torch.optim`` optimizer but subtract nothing).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

__all__ = ["NATURAL_STEP_REFUSED", "DPAdamBC"]

NATURAL_STEP_REFUSED = (
    "DP-AdamBC subtracts an isotropic noise variance, but the natural step shapes the noise "
    "by the preconditioner; use step 'transformed' with DP-AdamBC, or SGD/Adam"
)
"""Why DP-AdamBC and ``step="natural"`` are refused together (config and engine)."""


class DPAdamBC(torch.optim.Optimizer):
    """Adam with the DP-noise variance ``noise_variance`` subtracted from ``v_hat``.

    Args:
        params: parameters or parameter groups.
        lr: learning rate.
        betas: Adam's ``(beta1, beta2)``.
        gamma: floor of the corrected second moment (the paper's ``gamma'``); it bounds the
            per-coordinate step at ``lr * |m_hat| / sqrt(gamma)`` where noise dominates.
            ``None``: ``Phi``, set with the noise variance (:meth:`set_noise`); a coordinate with
            no signal then moves about ``0.2 lr`` per step (``m_hat`` of pure noise over
            ``sqrt(Phi)``), one whose signal dominates the noise about ``lr``; a tiny
            absolute floor (1e-8) would move noise-only coordinates ~10x more than signal.
        weight_decay: L2 penalty added to the gradient (as in ``torch.optim.Adam``).
        noise_variance: ``Phi = (sigma * C / B)^2`` of the gradients this optimizer will see
            (``B`` the expected batch size Opacus divides by); 0 gives Adam with ``gamma`` as
            a floor instead of an additive epsilon. The privacy engine sets it
            (:meth:`set_noise`) when it wraps this optimizer.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        gamma: float | None = 1e-8,
        weight_decay: float = 0.0,
        noise_variance: float = 0.0,
    ) -> None:
        # gamma None: the floor is Phi itself, set with the noise variance by set_noise()
        self._gamma_from_noise = gamma is None
        self._noise: float | None = None
        gamma = 1e-8 if gamma is None else gamma
        for name, value in (("lr", lr), ("gamma", gamma), ("noise_variance", noise_variance)):
            if not value >= 0:
                raise ValueError(f"DPAdamBC: {name}={value} must be >= 0")
        if gamma == 0:
            raise ValueError("DPAdamBC: gamma must be > 0 (it is the denominator's floor)")
        if not all(0 <= b < 1 for b in betas):
            raise ValueError(f"DPAdamBC: betas={betas} must lie in [0, 1)")
        defaults = {
            "lr": lr,
            "betas": betas,
            "gamma": gamma,
            "weight_decay": weight_decay,
            "noise_variance": noise_variance,
        }
        super().__init__(params, defaults)
        # a restored state dict carries the hyperparameters of its own run; the mechanism of
        # this one (a resumed run may be re-planned with another sigma) is put back after it
        self.register_load_state_dict_post_hook(_restore_noise)

    def set_noise(
        self, noise_multiplier: float, max_grad_norm: float, expected_batch: float
    ) -> float:
        """Subtract the noise of this mechanism: ``Phi = (sigma C / B)^2`` in every group.

        Called by :meth:`~dpkfc_med.privacy.PrivacyEngine.make_private` (the privacy side
        knows ``sigma``, ``C`` and the expected batch ``B``); with ``gamma=None`` the floor is
        ``Phi`` too. Kept across :meth:`load_state_dict`.

        Returns:
            ``Phi``.
        """
        self._noise = noise_variance_of(noise_multiplier, max_grad_norm, expected_batch)
        self._apply_noise()
        return self._noise

    def _apply_noise(self) -> None:
        if self._noise is None:
            return
        for group in self.param_groups:
            group["noise_variance"] = self._noise
            if self._gamma_from_noise:
                group["gamma"] = self._noise if self._noise > 0 else 1e-8

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One update from the (privatized) gradients in ``p.grad``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if group["weight_decay"]:
                    grad = grad.add(p, alpha=group["weight_decay"])
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                t = state["step"]
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                m_hat = m / (1 - beta1**t)
                v_hat = v / (1 - beta2**t)
                denom = (v_hat - group["noise_variance"]).clamp_min_(group["gamma"]).sqrt_()
                p.addcdiv_(m_hat, denom, value=-group["lr"])
        return loss


def _restore_noise(optimizer: torch.optim.Optimizer) -> None:
    """``load_state_dict`` post-hook: put this mechanism's noise variance back."""
    if isinstance(optimizer, DPAdamBC):
        optimizer._apply_noise()


def noise_variance_of(
    noise_multiplier: float, max_grad_norm: float, expected_batch: float
) -> float:
    """``Phi = (sigma * C / B)^2``: per-coordinate variance of the noise in a DP gradient."""
    if expected_batch <= 0:
        raise ValueError(f"expected batch size {expected_batch} must be > 0")
    return float((noise_multiplier * max_grad_norm / expected_batch) ** 2)
