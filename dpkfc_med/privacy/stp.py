r"""Probe-free scale-then-privatize (``dp-stp``): clipping after a noisy second-moment scale.

The rival of DP-KFC that needs no probes: scale-then-privatize (Ganesh, McMahan and Thakurta
2025, *On design principles for private adaptive optimizers*, arXiv 2507.01129; as in
jax_privacy). Each parameter tensor ``p`` has a public scale

.. math::

    s_p = \sqrt{\hat v_p} + \epsilon, \qquad
    v_p \leftarrow \beta_2 v_p + (1 - \beta_2)\, \tilde g_p^2, \qquad
    \hat v_p = v_p / (1 - \beta_2^t),

an exponential moving average of the squares of the ``t`` *released* (noisy, averaged) gradients
``g~`` of the steps before (``s = 1`` before the first release: the first step is DP-SGD's).
One step, with unit ``i``'s per-sample gradients summed per unit (``g_i``):

.. math::

    \bar g = \frac{s}{B}\Big(\sum_i \mathrm{clip}_C(g_i / s) + \mathcal N(0, \sigma^2 C^2 I)
    \Big),

division and product elementwise, ``B`` the expected batch; the base optimizer then steps on
``g~ = \bar g``, and ``v`` takes in ``g~``. Of the stages of
:class:`~dpkfc_med.privacy.optimizer.ScaleThenPrivatizeOptimizer`, only
``precondition_grad_samples`` (divide by ``s``) and ``scale_grad`` (multiply back, then update
``v``) change.

The scale is elementwise, so it does not keep a layer's per-sample gradient as a product of
rows: ghost clipping cannot compute these norms, and ``dp-stp`` clips materialised per-sample
gradients (:func:`stp_clipping`).

Privacy guarantee:
    ``s`` is a function of the gradients released before the step (post-processing of earlier
    outputs of the mechanism), fixed before the step's batch is drawn. For that fixed ``s`` the
    map ``g_i -> g_i / s`` is a public bijection, so the per-unit clipped sum has L2
    sensitivity ``C`` in the scaled coordinates under adding or removing one unit, the noise
    ``N(0, sigma^2 C^2 I)`` is added there, and each step is the same subsampled Gaussian
    mechanism as DP-SGD's; multiplying back by ``s`` and updating ``v`` are post-processing.
    The guarantee needs ``v`` to read nothing but released gradients: it never reads
    ``grad_sample``, ``summed_grad`` or a private batch.

Note:
    The noise reaches the released gradient as ``s N(0, (sigma C / B)^2)``, so ``v`` carries
    ``(sigma C / B)^2 v`` of its own noise: its fixed point ``g^2 / (1 - (sigma C / B)^2)`` is
    finite only for ``sigma C < B`` (always the case for batches of tens of units and
    ``C`` of order 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from dpkfc_med.privacy.ghost import Clipping
from dpkfc_med.privacy.grad_sample import raw_norm_samples
from dpkfc_med.privacy.optimizer import ScaleThenPrivatizeOptimizer
from dpkfc_med.utils import check_choice

__all__ = [
    "DEFAULT_BETA2",
    "DEFAULT_EPS",
    "GHOST_REFUSED",
    "SecondMomentScale",
    "SecondMomentScaleOptimizer",
    "stp_clipping",
]

DEFAULT_BETA2 = 0.999
"""The moving average's decay when the base optimizer has no ``betas`` (Adam's default)."""

DEFAULT_EPS = 1e-8
"""Added to ``sqrt(v)`` when the base optimizer has no ``eps`` (Adam's default)."""

GHOST_REFUSED = (
    "privacy.clipping='ghost' with method dp-stp: the elementwise scale s breaks the per-sample "
    "gradient's row structure that ghost norms need; use privacy.clipping: per_sample (or auto, "
    "which picks per_sample for dp-stp)"
)


def stp_clipping(mode: Clipping | str) -> Clipping:
    """``privacy.clipping`` for ``dp-stp``: ``auto`` and ``per_sample`` give per-sample clipping.

    Raises:
        ValueError: ``mode`` is ``ghost`` (or not a clipping mode).
    """
    mode = check_choice("privacy.clipping", mode, Clipping)
    if mode is Clipping.GHOST:
        raise ValueError(GHOST_REFUSED)
    return Clipping.PER_SAMPLE


class SecondMomentScale:
    """The public per-parameter scale ``s = sqrt(v_hat) + eps`` from released gradients.

    Args:
        params: the parameters, in the optimizer's order.
        beta2: decay of the moving average of squared released gradients.
        eps: added to ``sqrt(v_hat)``.

    Attributes:
        steps: released gradients taken in (``t``).
        exp_avg_sq: ``v`` per parameter (same shapes as ``params``).
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        *,
        beta2: float = DEFAULT_BETA2,
        eps: float = DEFAULT_EPS,
    ) -> None:
        if not 0.0 <= beta2 < 1.0:
            raise ValueError(f"beta2={beta2!r}: must be in [0, 1), e.g. {DEFAULT_BETA2}")
        if not eps > 0.0:
            raise ValueError(f"eps={eps!r}: must be > 0, e.g. {DEFAULT_EPS}")
        self.beta2, self.eps = float(beta2), float(eps)
        self.steps = 0
        self.exp_avg_sq = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in params]

    @classmethod
    def for_optimizer(
        cls,
        optimizer: torch.optim.Optimizer,
        params: Sequence[nn.Parameter],
        *,
        eps: float | None = None,
    ) -> SecondMomentScale:
        """The scale with the base optimizer's ``betas[1]`` and ``eps`` (Adam's), else defaults.

        ``eps``: the scale's own constant instead (jax_privacy's ``eps``: a large one scales
        every coordinate alike, DP-SGD in the limit; Adam's 1e-8 lets coordinates whose noisy
        second moment is small dominate the clipped norm; tune it between the two).
        """
        group = optimizer.param_groups[0] if optimizer.param_groups else {}
        betas = group.get("betas")
        beta2 = float(betas[1]) if betas is not None else DEFAULT_BETA2
        if eps is None:
            eps = float(group.get("eps", DEFAULT_EPS))
        return cls(params, beta2=beta2, eps=eps)

    def scales(self) -> list[Tensor] | None:
        """``s`` per parameter, or ``None`` before the first release (``s = 1``)."""
        if self.steps == 0:
            return None
        correction = 1.0 - self.beta2**self.steps
        return [(v / correction).sqrt_().add_(self.eps) for v in self.exp_avg_sq]

    @torch.no_grad()
    def update(self, released: Sequence[Tensor | None]) -> None:
        """Take in one step's released gradients (``None``: a parameter without one, as zero)."""
        for v, g in zip(self.exp_avg_sq, released):
            v.mul_(self.beta2)
            if g is not None:
                v.addcmul_(g.to(v.dtype), g.to(v.dtype), value=1.0 - self.beta2)
        self.steps += 1

    def state_dict(self) -> dict[str, Any]:
        """``v``, ``t`` and the settings (public: computed from released gradients only)."""
        return {
            "beta2": self.beta2,
            "eps": self.eps,
            "steps": self.steps,
            "exp_avg_sq": [v.detach().clone() for v in self.exp_avg_sq],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (same parameters, same order)."""
        if len(state["exp_avg_sq"]) != len(self.exp_avg_sq):
            raise ValueError(
                f"the saved scale has {len(state['exp_avg_sq'])} parameters, the model "
                f"{len(self.exp_avg_sq)}: resume with the network the run was started with"
            )
        self.beta2, self.eps = float(state["beta2"]), float(state["eps"])
        self.steps = int(state["steps"])
        for v, saved in zip(self.exp_avg_sq, state["exp_avg_sq"]):
            v.copy_(saved)


class SecondMomentScaleOptimizer(ScaleThenPrivatizeOptimizer):
    """DP optimizer that clips per-unit gradients divided by the public scale ``s`` (``dp-stp``).

    Takes :class:`ScaleThenPrivatizeOptimizer`'s arguments (without ``preconditioner``), and:

    Args:
        optimizer: the base optimizer; its ``betas[1]`` and ``eps`` (Adam's) set the scale's,
            unless ``scale`` is given.
        scale: the scale (default: :meth:`SecondMomentScale.for_optimizer`).
        scale_eps: the default scale's ``eps`` (``None``: the base optimizer's, or 1e-8).
        **kwargs: :class:`ScaleThenPrivatizeOptimizer`'s keyword arguments.

    Privacy guarantee:
        See :mod:`dpkfc_med.privacy.stp`: sensitivity ``C`` per unit in the scaled
        coordinates, where the noise is added; ``s`` comes from released gradients only.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        scale: SecondMomentScale | None = None,
        scale_eps: float | None = None,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("preconditioner") is not None:
            raise ValueError(
                "dp-stp takes no preconditioner: its scale comes from released gradients"
            )
        super().__init__(optimizer, **kwargs)
        self.scale = (
            scale
            if scale is not None
            else SecondMomentScale.for_optimizer(optimizer, self.params, eps=scale_eps)
        )
        self._scales: list[Tensor] | None = None

    def precondition_grad_samples(self) -> None:
        """Divide every per-sample gradient by its parameter's ``s`` (nothing at step 0)."""
        super().precondition_grad_samples()
        if self.ghost_rows:
            raise ValueError(GHOST_REFUSED)
        self._scales = self.scale.scales()
        if self._scales is None:
            return
        for p, s in zip(self.params, self._scales):
            if p.grad_sample is None:
                continue
            gs = self._get_flat_grad_sample(p)
            # raw (unscaled) norms for the diagnostics, as the fallback stage keeps them
            self._fallback_raw_sq[id(p)] = (
                gs[: raw_norm_samples(gs.shape[0])].pow(2).flatten(1).sum(1)
            )
            p.grad_sample = gs / s.to(device=gs.device, dtype=gs.dtype)

    def scale_grad(self) -> None:
        """Divide by the expected batch, multiply back by ``s``, and take the release into ``v``."""
        super().scale_grad()
        scales = self._scales
        if scales is not None:
            for p, s in zip(self.params, scales):
                if p.grad is not None:
                    p.grad.mul_(s.to(device=p.grad.device, dtype=p.grad.dtype))
        self._scales = None
        self.scale.update([p.grad for p in self.params])
