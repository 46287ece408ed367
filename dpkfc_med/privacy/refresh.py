"""The engine's preconditioner refreshes: the schedule, the rebuild from probes, provenance.

The preconditioner is rebuilt at step 0 and every ``refresh_every`` steps from fresh probes at
the current, already released, parameters; ``refresh_every="auto"`` picks the period from
multiply-add estimates of the covered layers' shapes (:mod:`dpkfc_med.curvature.cost`).

Privacy guarantee:
    A refresh reads only probes (never private data) and the released parameters, so the
    preconditioner is post-processing; over several processes every rank's preconditioner is
    compared before it is used.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from dpkfc_med.curvature.cost import auto_refresh_every, layer_footprint
from dpkfc_med.curvature.factors import LossFn, covered_layers
from dpkfc_med.curvature.preconditioner import KroneckerPreconditioner, PreconditionerConfig
from dpkfc_med.methods import Method
from dpkfc_med.privacy.distributed import World, check_same_on_every_rank
from dpkfc_med.privacy.grad_sample import PreconditionedGradSampleModule
from dpkfc_med.privacy.loader import first_item
from dpkfc_med.privacy.optimizer import ScaleThenPrivatizeOptimizer
from dpkfc_med.probes.sources import ProbeSource

__all__ = ["PreconditionerRefreshes"]


class PreconditionerRefreshes:
    """The preconditioner part of :class:`~dpkfc_med.privacy.engine.PrivacyEngine`.

    A mixin: the engine sets these attributes in ``make_private`` and attaches
    :meth:`_maybe_refresh` as the optimizer's post-step hook.
    """

    module: PreconditionedGradSampleModule | None
    optimizer: ScaleThenPrivatizeOptimizer | None
    method: Method
    world: World
    probe_source: ProbeSource | None
    probe_loss: LossFn | None
    preconditioner_config: PreconditionerConfig | None
    refresh_every: int
    refresh_plan: dict[str, Any]
    probe_seed: int
    refreshes: list[dict[str, Any]]

    def _probe_module(self) -> nn.Module:
        assert self.module is not None
        return self.module._module

    def _auto_refresh(self, probe: Tensor, batch: int, budget: float) -> dict[str, Any]:
        """The ``refresh_every="auto"`` period from the covered layers' shapes on one probe."""
        assert self.module is not None and self.preconditioner_config is not None
        self.module.disable_hooks()
        try:
            model = self._probe_module()
            ref = next(model.parameters())
            dtype = ref.dtype if probe.is_floating_point() else probe.dtype
            with torch.random.fork_rng(devices=[]):
                rows = layer_footprint(model, probe.to(device=ref.device, dtype=dtype))
        finally:
            self.module.enable_hooks()
        plan = auto_refresh_every(rows, self.preconditioner_config, batch, budget)
        return {"rule": "auto", **plan}

    def _check_probe_shape(self, data_loader: DataLoader) -> Tensor:
        """Check one probe against the training data's shape; return that probe's input."""
        first = first_item(data_loader.dataset)
        x = first[0] if isinstance(first, (tuple, list)) else first.get("image")  # type: ignore[union-attr]
        assert self.probe_source is not None  # checked in make_private
        probe = self.probe_source.sample(1, seed=0, model=self._probe_module())
        px = probe[0]
        if isinstance(x, Tensor) and tuple(px.shape[1:]) != tuple(x.shape[-(px.dim() - 1) :]):
            raise ValueError(
                f"probe inputs have shape {list(px.shape[1:])} per sample but the training "
                f"data has {list(x.shape)}; set the probe source's spatial_shape/channels to "
                "match the (preprocessed) private inputs"
            )
        return px

    def refresh_preconditioner(self, seed: int | None = None) -> KroneckerPreconditioner:
        """Rebuild the preconditioner from fresh probes at the current parameters.

        Args:
            seed: probe seed (a public number); default ``probe_seed`` plus the number of
                refreshes so far.
        """
        assert self.module is not None and self.optimizer is not None
        assert self.preconditioner_config is not None and self.probe_loss is not None
        model = self._probe_module()
        ref = next(model.parameters())
        seed = self.probe_seed + len(self.refreshes) if seed is None else seed
        assert self.probe_source is not None  # checked in make_private
        t0 = time.perf_counter()
        self.module.disable_hooks()
        try:
            # fork_rng: the probe pass (e.g. dropout) must not consume the training RNG.
            with torch.random.fork_rng(devices=[]):
                inputs, targets = self.probe_source.sample(
                    self.preconditioner_config.num_probes,
                    seed=seed,
                    model=model,
                    device=ref.device,
                    dtype=ref.dtype,
                )
                pre = KroneckerPreconditioner.from_probes(
                    model,
                    inputs,
                    targets,
                    self.probe_loss,
                    self.preconditioner_config,
                    position_seed=seed,
                )
        finally:
            self.module.enable_hooks()
        if self.world.distributed:
            check_same_on_every_rank(pre.fingerprint(), "the preconditioner")
        self.module.set_blocks(pre.module_blocks())
        self.optimizer.preconditioner = pre
        self.refreshes.append(
            {
                "step": self.optimizer.steps_taken,
                "probe_seed": seed,
                "seconds": time.perf_counter() - t0,
                "scale": pre.info.get("scale"),
                "eig_fallbacks": list(pre.info.get("eig_fallbacks", [])),
            }
        )
        return pre

    def _maybe_refresh(self, optimizer: ScaleThenPrivatizeOptimizer) -> None:
        done = optimizer.max_steps is not None and optimizer.steps_taken >= optimizer.max_steps
        if self.refresh_every > 0 and optimizer.steps_taken % self.refresh_every == 0 and not done:
            self.refresh_preconditioner()

    @property
    def preconditioner(self) -> KroneckerPreconditioner | None:
        """The preconditioner in use (``None`` for DP-SGD)."""
        return self.optimizer.preconditioner if self.optimizer is not None else None

    def provenance(self) -> dict[str, Any]:
        """Preconditioner provenance for the privacy report."""
        if self.method is not Method.DP_KFC:
            return {"method": self.method.value, "preconditioner": None}
        describe: Callable[[], dict[str, Any]] | None = getattr(self.probe_source, "describe", None)
        pre = self.preconditioner
        return {
            "method": self.method.value,
            "probe_source": describe() if describe else repr(self.probe_source),
            "refresh_every": self.refresh_every,
            "refresh_plan": self.refresh_plan,
            "refreshes": self.refreshes,
            "preconditioner": pre.summary() if pre else None,
            "covered_layers": list(covered_layers(self._probe_module())),
        }
