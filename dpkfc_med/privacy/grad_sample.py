"""Per-sample gradients in preconditioned coordinates, computed inside Opacus' hooks.

:class:`PreconditionedGradSampleModule` is an Opacus ``GradSampleModule`` whose grad samplers
for covered layers (Linear, ConvNd, ConvTransposeNd) produce ``s U_G g_i U_A`` directly from
the captured activations and output errors (``(U_G delta)(U_A a)^T`` summed over positions, or
the transform of the per-sample gradient, whichever is cheaper; transposed convolutions always
transform per-sample gradients formed on their input grid). Layers without an attached
preconditioner block use Opacus' own samplers unchanged, so DP-SGD through this module is
bit-for-bit Opacus. Everything downstream (clipping, noise, accounting) sees ordinary
``grad_sample`` tensors.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from opacus.grad_sample import GradSampleModule
from opacus.grad_sample.functorch import ft_compute_per_sample_gradient, prepare_layer
from torch import Tensor, nn

from dpkfc_med.curvature.adapters import adapter_for, supported_layer_types
from dpkfc_med.curvature.preconditioner import KroneckerBlock

__all__ = ["PreconditionedGradSampleModule", "RAW_NORM_SAMPLES"]

RAW_NORM_SAMPLES = 16
"""Samples per step whose raw (untransformed) per-sample norms are kept for diagnostics."""

_OPACUS_SAMPLERS = dict(GradSampleModule.GRAD_SAMPLERS)

# Benign: the first layer's input never requires grad, so torch warns for every Opacus hook.
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients")


def _preconditioned_sampler(
    module: nn.Module, activations: list[Tensor], backprops: Tensor
) -> dict[nn.Parameter, Tensor]:
    block: KroneckerBlock | None = getattr(module, "_dpkfc_block", None)
    adapter = adapter_for(module)
    if block is None:
        if type(module) in _OPACUS_SAMPLERS:
            return _OPACUS_SAMPLERS[type(module)](module, activations, backprops)
        # No Opacus formula (ConvTranspose): Opacus' functorch path (prepared in add_hooks) is
        # cheaper than unfolding the zero-inserted input when no transform is needed.
        return ft_compute_per_sample_gradient(module, activations, backprops)
    assert adapter is not None
    if adapter.param_grads is not None:
        # Direct per-sample gradients (transposed convs: no zero-inserted unfold), then the
        # literal transform s U_G g U_A.
        raw = adapter.from_params(module, adapter.param_grads(module, activations[0], backprops))
        grads = block.transform_grads(raw)
    else:
        a = adapter.activations(module, activations[0])
        d = adapter.errors(module, backprops)
        grads, raw = block.per_sample_grads(a, d)
    if raw is None:
        m = RAW_NORM_SAMPLES
        raw = torch.einsum("btgo,btgi->bgoi", d[:m], a[:m])
    module._dpkfc_raw_sq = raw[:RAW_NORM_SAMPLES].pow(2).flatten(1).sum(1)  # type: ignore[assignment]
    return adapter.to_params(module, grads)


class PreconditionedGradSampleModule(GradSampleModule):
    """Opacus ``GradSampleModule`` with preconditioned grad samplers for covered layers."""

    GRAD_SAMPLERS: dict[Any, Any] = {
        **_OPACUS_SAMPLERS,
        **{t: _preconditioned_sampler for t in supported_layer_types()},
    }

    def add_hooks(self, *args: Any, **kwargs: Any) -> None:
        """Prepare functorch for covered types Opacus has no formula for, then add hooks.

        Preparation copies the layer, so it must happen before hooks are registered (as
        Opacus does for the layers it sends to functorch).
        """
        for m in self._module.modules():
            if type(m) in self.GRAD_SAMPLERS and type(m) not in _OPACUS_SAMPLERS:
                if any(p.requires_grad for p in m.parameters(recurse=False)):
                    prepare_layer(m)
        super().add_hooks(*args, **kwargs)

    def disable_hooks(self) -> None:
        """Stop capturing (used during probe passes, which must not touch ``grad_sample``)."""
        self.hooks_enabled = False

    def enable_hooks(self) -> None:
        """Resume capturing."""
        self.hooks_enabled = True
