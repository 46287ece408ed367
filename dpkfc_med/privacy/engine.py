"""The engine: one call wires model, scale-then-privatize optimizer, Poisson loader and ledger.

In the spirit of Opacus' ``PrivacyEngine.make_private``; the engine additionally owns the
probe source and the preconditioner refresh schedule (every ``refresh_every`` steps and at step
0, from fresh probes at the current, already released, parameters:
:mod:`dpkfc_med.privacy.refresh`). The Poisson loader is :mod:`dpkfc_med.privacy.loader`.

Privacy guarantee:
    Each step is a Poisson-subsampled Gaussian mechanism over privacy units (samples, or
    patients when the optimizer is given unit ids) with sensitivity ``C``: units are sampled
    independently with probability ``q`` (Opacus' sampler, or the OS CSPRNG in secure mode),
    per-unit transformed gradients are clipped to ``C`` and ``N(0, sigma^2 C^2)`` noise is
    added. The preconditioner depends only on probes and released parameters, so it is
    post-processing. The ledger is written before each update is applied.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from dpkfc_med.curvature.cost import refresh_settings_problems
from dpkfc_med.curvature.factors import LossFn
from dpkfc_med.curvature.preconditioner import PreconditionerConfig
from dpkfc_med.methods import ENGINE_METHODS, Method
from dpkfc_med.privacy.accounting import Accountant, PrivacyLedger, calibrate_noise_multiplier
from dpkfc_med.privacy.adambc import NATURAL_STEP_REFUSED, DPAdamBC
from dpkfc_med.privacy.distributed import (
    World,
    check_mechanism_on_every_rank,
    module_digests,
    unit_ids_digest,
)
from dpkfc_med.privacy.ghost import Clipping
from dpkfc_med.privacy.grad_sample import PreconditionedGradSampleModule
from dpkfc_med.privacy.loader import check_loader_sampling, poisson_loader
from dpkfc_med.privacy.optimizer import ScaleThenPrivatizeOptimizer
from dpkfc_med.privacy.refresh import PreconditionerRefreshes
from dpkfc_med.privacy.stp import SecondMomentScaleOptimizer, stp_clipping
from dpkfc_med.probes.sources import ProbeSource, probe_source_problems
from dpkfc_med.utils import check_choice

__all__ = ["Method", "PrivacyEngine", "check_loader_sampling", "check_model_compatible"]

log = logging.getLogger(__name__)

STP_NEEDS_ADAPTIVE = (
    "dp-stp with an optimizer that keeps no second moment (%s): the released gradient is "
    "multiplied by s, about the released noise's own scale (sigma C / B at the first step, "
    "shrinking after), so SGD's steps shrink by that factor; use adam, whose second moment "
    "undoes s, or raise the lr"
)


def check_model_compatible(model: nn.Module) -> None:
    """Raise one error listing every module that breaks per-sample privacy, with the fix."""
    from opacus.validators import ModuleValidator

    problems = []
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            problems.append(
                f"{name or '<root>'}: {type(m).__name__} mixes samples and breaks per-sample "
                "privacy; call dpkfc_med.models.make_private_compatible(model) or choose "
                'norm="instance"/"group"'
            )
        elif getattr(m, "inplace", False) is True:
            problems.append(
                f"{name or '<root>'}: {type(m).__name__}(inplace=True) corrupts the activations "
                "captured by the per-sample gradient hooks; call "
                "dpkfc_med.models.make_private_compatible(model) (turns inplace off)"
            )
    if not problems:
        for err in ModuleValidator.validate(model, strict=False):
            problems.append(f"{err}; call dpkfc_med.models.make_private_compatible(model)")
    if problems:
        raise ValueError(
            "model is not compatible with private training:\n  " + "\n  ".join(problems)
        )


def _entropy_generator(device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded from OS entropy; the seed lives only in this call."""
    return torch.Generator(device=device).manual_seed(secrets.randbits(63))


class PrivacyEngine(PreconditionerRefreshes):
    """Makes a model, optimizer and loader private with DP-SGD, DP-KFC or DP-STP.

    Args:
        accountant: primary accountant (``"prv"``; ``"rdp"``/``"pld"`` for cross-checks).
        secure_mode: draw every sampling decision and noise value from the OS CSPRNG.
        seed: research only: seeds the sampler and noise generators so that a run can be
            replayed. Whoever knows the seed can replay the noise, so a seeded run is not a
            valid DP release (:attr:`reproducible` is then true and reports say so).

    Privacy guarantee:
        Without a seed the noise and the Poisson sampler use PyTorch generators seeded once
        from OS entropy (``secrets``); those seeds are kept in memory only -- never logged,
        checkpointed or reported -- so nothing a run publishes lets anyone replay its noise.
        A resumed run draws fresh seeds.
    """

    def __init__(
        self,
        *,
        accountant: Accountant | str = Accountant.PRV,
        secure_mode: bool = False,
        seed: int | None = None,
    ) -> None:
        self.accountant = check_choice("privacy.accountant", accountant, Accountant)
        if secure_mode and seed is not None:
            raise ValueError(
                "privacy.secure_rng=true cannot be combined with a seed: secure runs draw "
                "their randomness from the OS CSPRNG; drop the seed or turn secure_rng off"
            )
        self.secure_mode = secure_mode
        self.seed = seed
        self.noise_generator: torch.Generator | None = None
        self.sample_generator: torch.Generator | None = None
        if seed is not None:
            self.noise_generator = torch.Generator().manual_seed(seed)
            self.sample_generator = torch.Generator().manual_seed(seed + 1)
        elif not secure_mode:
            self.noise_generator = _entropy_generator()
            self.sample_generator = _entropy_generator()
        self.ledger: PrivacyLedger | None = None
        self.module: PreconditionedGradSampleModule | None = None
        self.optimizer: ScaleThenPrivatizeOptimizer | None = None
        self.method = Method.DP_SGD
        self.probe_source: ProbeSource | None = None
        self.probe_loss: LossFn | None = None
        self.preconditioner_config: PreconditionerConfig | None = None
        self.refresh_every = 0
        self.refresh_plan: dict[str, Any] = {}
        self.probe_seed = 0
        self.refreshes: list[dict[str, Any]] = []
        self.sample_rate = 0.0
        self.world = World()
        self.noise_multiplier = 0.0
        self.max_grad_norm = 0.0

    # ------------------------------------------------------------------ wiring
    def make_private(
        self,
        *,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        data_loader: DataLoader,
        noise_multiplier: float,
        max_grad_norm: float,
        delta: float,
        method: Method | str = Method.DP_KFC,
        probe_source: ProbeSource | None = None,
        probe_loss: LossFn | None = None,
        preconditioner: PreconditionerConfig | None = None,
        refresh_every: int | str = "auto",
        refresh_budget: float = 0.05,
        probe_seed: int = 0,
        max_steps: int | None = None,
        loss_reduction: str = "mean",
        backward_reduction: str | None = None,
        ledger_path: str | Path | None = None,
        diagnostics: bool = True,
        clipping: Clipping | str = Clipping.PER_SAMPLE,
        stp_eps: float | None = None,
        mechanism_extra: Mapping[str, object] | None = None,
    ) -> tuple[PreconditionedGradSampleModule, ScaleThenPrivatizeOptimizer, DataLoader]:
        """Wrap for private training.

        Args:
            module: the network (already made DP-compatible).
            optimizer: base optimizer over ``module``'s parameters.
            data_loader: loader over the private training set whose ``batch_size`` is the
                expected batch size (expected number of units); replaced by a Poisson loader.
            noise_multiplier: ``sigma``.
            max_grad_norm: clip norm ``C``.
            delta: the delta epsilon is reported at.
            method: ``"dp-kfc"``, ``"dp-sgd"`` or ``"dp-stp"`` (scale-then-privatize by the
                noisy second moment of released gradients, :mod:`dpkfc_med.privacy.stp`).
            probe_source: a :class:`~dpkfc_med.probes.ProbeSource` (``sample(num, seed=...,
                model=..., device=..., dtype=...)`` returning ``(inputs, targets)`` and
                ``describe()``) -- required for dp-kfc. Never private data: a ``DataLoader``,
                ``Dataset`` or tensor is refused.
            probe_loss: per-sample loss on probes ``(outputs, targets) -> [M]``.
            preconditioner: preconditioner settings (dp-kfc).
            refresh_every: rebuild the preconditioner every this many steps (0: never after
                step 0), or ``"auto"`` (default): every ``20 * 2^k`` steps, the shortest such
                period at which the refreshes' estimated share of training time stays within
                ``refresh_budget`` (multiply-add estimates from the layer shapes,
                :mod:`dpkfc_med.curvature.cost`: deterministic, so the same model, input size,
                batch and settings always get the same schedule, which depends on public
                settings only -- the network, the probes' shape, the loader's batch size;
                20 for the small CNN on 28x28 images, longer for large networks and volumes).
            refresh_budget: the share of training time ``"auto"`` allows refreshes.
            probe_seed: seed of the first probe batch; refresh ``k`` uses ``probe_seed + k``.
            max_steps: refuse steps beyond this (the privacy plan).
            loss_reduction: ``"mean"`` (the noisy sum is divided by the expected batch size,
                as in Opacus) or ``"sum"`` (it is not).
            backward_reduction: the reduction of the loss ``backward()`` is called on;
                default ``loss_reduction``. ``"sum"`` with ``loss_reduction="mean"``: backward
                on the sum of per-sample losses, update averaged over the expected batch.
                Then every sample's output error is its own loss gradient whatever the secret
                batch size ``B``; a batch-mean loss passes ``(1/B) g`` through the network,
                which low-precision autocast rounds differently for every ``B``, so the
                per-sample hooks refuse a mean loss under bfloat16 / float16.
            ledger_path: keep the ledger in this JSON file (written before each update).
            diagnostics: record per-step clipping diagnostics.
            clipping: how per-unit norms are computed (:class:`~dpkfc_med.privacy.ghost.
                Clipping`): ``"per_sample"`` (materialised per-sample gradients; DP-SGD's
                then equal Opacus' to float rounding), ``"ghost"`` (ghost norms on the
                transformed rows of every layer that has them) or ``"auto"`` (per layer,
                whichever costs fewer multiply-adds by the layer's shapes). The clipped sum,
                the noise and the guarantee are the same in every mode. ``dp-stp`` clips
                per sample (``"auto"`` picks it; ``"ghost"`` is refused).
            stp_eps: dp-stp: the constant added to ``sqrt(v_hat)`` in its scale (``None``: the
                base optimizer's ``eps``, else 1e-8; :meth:`~dpkfc_med.privacy.stp.
                SecondMomentScale.for_optimizer`).
            mechanism_extra: what else defines the mechanism that only the caller knows
                (e.g. ``{"precision": ..., "unit": ...}``). Over several processes every
                rank's mechanism -- these fields, the method, ``C``, ``sigma``, ``q``, the
                units, delta, accountant, clipping, a digest of the network and its initial
                parameters, ``max_steps`` -- is compared before the first step, and any
                difference stops the run on every rank
                (:func:`~dpkfc_med.privacy.distributed.check_mechanism_on_every_rank`).

        Returns:
            ``(private_module, private_optimizer, poisson_loader)``.
        """
        self.method = check_choice("method", method, Method, ENGINE_METHODS)
        problems = []
        if not (noise_multiplier >= 0):
            problems.append(f"noise_multiplier={noise_multiplier!r}: must be >= 0")
        if not (max_grad_norm > 0):
            problems.append(f"max_grad_norm={max_grad_norm!r}: must be > 0 (e.g. 1.0)")
        if self.method is Method.DP_KFC and (probe_source is None or probe_loss is None):
            problems.append(
                "method=dp-kfc needs probe_source and probe_loss (e.g. "
                "dpkfc_med.probes.ImageProbeSource and a per-sample loss); or use method=dp-sgd"
            )
        if self.method is Method.DP_KFC and probe_source is not None:
            problems += probe_source_problems(probe_source)
        if self.method is Method.DP_KFC:
            problems += refresh_settings_problems(refresh_every, refresh_budget)
            natural = preconditioner is not None and preconditioner.step == "natural"
            if natural and isinstance(optimizer, DPAdamBC):
                problems.append(
                    f"preconditioner step='natural' with DPAdamBC: {NATURAL_STEP_REFUSED}"
                )
        if self.method is Method.DP_STP:
            try:
                clipping = stp_clipping(clipping)
            except ValueError as err:
                problems.append(str(err))
            if stp_eps is not None and not stp_eps > 0:
                problems.append(f"stp_eps={stp_eps!r}: must be > 0 (or None for the default)")
            if isinstance(optimizer, DPAdamBC):
                problems.append(
                    "method=dp-stp with DPAdamBC: the released gradient's noise is s * N(0, "
                    "(sigma C / B)^2) per coordinate, not the constant variance DPAdamBC "
                    "subtracts; use adam or sgd"
                )
        backward_reduction = backward_reduction or loss_reduction
        if loss_reduction not in ("mean", "sum") or backward_reduction not in ("mean", "sum"):
            problems.append(
                f"loss_reduction={loss_reduction!r}, backward_reduction={backward_reduction!r}: "
                "each must be 'mean' or 'sum'"
            )
        elif (loss_reduction, backward_reduction) == ("sum", "mean"):
            problems.append(
                "backward_reduction='mean' with loss_reduction='sum' is not a combination: a "
                "mean loss's update is averaged (loss_reduction='mean')"
            )
        if problems:
            raise ValueError("invalid privacy settings:\n  " + "\n  ".join(problems))
        check_model_compatible(module)
        if isinstance(module, PreconditionedGradSampleModule):
            gsm = module
            gsm.set_clipping(clipping)
            if gsm.loss_reduction != backward_reduction:
                raise ValueError(
                    f"the wrapped module's hooks expect a {gsm.loss_reduction!r}-reduced loss "
                    f"but backward_reduction={backward_reduction!r}; wrap the plain module"
                )
        else:
            gsm = PreconditionedGradSampleModule(
                module, loss_reduction=backward_reduction, clipping=clipping
            )
        self.world = World.current()
        if self.world.distributed and self.seed is not None:
            # research runs: each rank's draws are seeded, and differ between ranks
            self.sample_generator = torch.Generator().manual_seed(
                self.seed + 1 + 7919 * self.world.rank
            )
        if not self.world.is_main:
            ledger_path = None  # one ledger, rank 0's
        loader = poisson_loader(
            data_loader, generator=self.sample_generator, secure=self.secure_mode, world=self.world
        )
        self.sample_rate = float(loader.sample_rate)  # type: ignore[attr-defined]
        n_units = len(data_loader.dataset)  # type: ignore[arg-type]
        expected = max(1, round(self.sample_rate * n_units))
        self.noise_multiplier = noise_multiplier
        self.max_grad_norm = max_grad_norm
        self.ledger = PrivacyLedger(delta, ledger_path) if self.ledger is None else self.ledger
        self.ledger.meta.update(
            {"sample_rate": self.sample_rate, "units": n_units, "expected_batch_size": expected}
        )
        # the processes of this (possibly resumed) part of the run
        self.ledger.meta.update({"world_size": self.world.size, "backend": self.world.backend})
        owners = {
            id(p): (name or p_name, m)
            for name, m in gsm._module.named_modules()
            for p_name, p in m.named_parameters(recurse=False)
        }
        stages: dict[str, Any] = {
            "noise_multiplier": noise_multiplier,
            "max_grad_norm": max_grad_norm,
            "expected_batch_size": expected,
            "loss_reduction": loss_reduction,
            "generator": self.noise_generator,
            "secure_mode": self.secure_mode,
            "max_steps": max_steps,
            "diagnostics": diagnostics,
            "param_owners": owners,
            "raw_norms_sq": gsm.raw_norms_sq,
            "world": self.world,
            "ghost_rows": gsm.ghost_rows,
        }
        opt = (
            SecondMomentScaleOptimizer(optimizer, scale_eps=stp_eps, **stages)
            if self.method is Method.DP_STP
            else ScaleThenPrivatizeOptimizer(optimizer, **stages)
        )
        opt.attach_step_hook(self._record_step)
        if self.method is Method.DP_STP and "betas" not in optimizer.defaults:
            log.warning(STP_NEEDS_ADAPTIVE, type(optimizer).__name__)
        if isinstance(optimizer, DPAdamBC):  # bias correction for this mechanism's noise
            optimizer.set_noise(noise_multiplier, max_grad_norm, expected)
        if self.world.distributed:  # one mechanism on every rank, checked before any step
            check_mechanism_on_every_rank(
                {
                    "method": self.method,
                    "max_grad_norm": max_grad_norm,
                    "noise_multiplier": noise_multiplier,
                    "sample_rate": self.sample_rate,
                    "units": n_units,
                    # the same units in the same order: a unit owned by two ranks counts 2 C
                    "unit_ids": unit_ids_digest(data_loader.dataset)[0],
                    "expected_batch_size": expected,
                    "delta": delta,
                    "loss_reduction": loss_reduction,
                    "accountant": self.accountant,
                    "clipping": clipping,
                    "randomness": self.randomness,
                    "max_steps": max_steps,
                    "refresh_every": refresh_every if self.method is Method.DP_KFC else None,
                    "probe_seed": probe_seed if self.method is Method.DP_KFC else None,
                    "preconditioner": preconditioner,
                    "stp_eps": stp_eps if self.method is Method.DP_STP else None,
                    **{f"model_{k}": v for k, v in module_digests(gsm._module).items()},
                    **dict(mechanism_extra or {}),
                }
            )
        self.module, self.optimizer = gsm, opt
        ref = next(gsm.parameters(), None)
        if self.noise_generator is not None and ref is not None and ref.device.type != "cpu":
            # Opacus draws the noise on the parameters' device with this generator.
            self.noise_generator = (
                torch.Generator(device=ref.device).manual_seed(self.seed)
                if self.seed is not None
                else _entropy_generator(ref.device)
            )
            opt.generator = self.noise_generator
        if self.method is Method.DP_KFC:
            self.probe_source, self.probe_loss = probe_source, probe_loss
            self.preconditioner_config = preconditioner or PreconditionerConfig()
            self.probe_seed = probe_seed
            probe = self._check_probe_shape(data_loader)
            if refresh_every == "auto":
                # the configured batch size, not one derived from the private dataset's size:
                # the schedule then depends on public settings only
                planned = data_loader.batch_size or expected
                self.refresh_plan = self._auto_refresh(probe, planned, refresh_budget)
                self.refresh_every = int(self.refresh_plan["refresh_every"])
            else:
                self.refresh_plan = {"refresh_every": int(refresh_every), "rule": "fixed"}
                self.refresh_every = int(refresh_every)
            self.refresh_preconditioner()
            if self.refresh_every > 0:
                opt.post_step_hooks.append(self._maybe_refresh)
        return gsm, opt, loader

    def make_private_with_epsilon(
        self,
        *,
        target_epsilon: float,
        delta: float,
        data_loader: DataLoader,
        epochs: int | None = None,
        steps: int | None = None,
        **kwargs: Any,
    ) -> tuple[PreconditionedGradSampleModule, ScaleThenPrivatizeOptimizer, DataLoader]:
        """:meth:`make_private` with ``sigma`` calibrated to a target epsilon.

        The planned steps spend at most ``target_epsilon``; steps beyond the plan are refused.
        """
        if (epochs is None) == (steps is None):
            raise ValueError("give exactly one of epochs or steps")
        sample_rate = 1 / len(data_loader)
        planned = steps if steps is not None else int(epochs * len(data_loader))  # type: ignore[operator]
        sigma = calibrate_noise_multiplier(
            target_epsilon=target_epsilon,
            delta=delta,
            sample_rate=sample_rate,
            steps=planned,
            accountant=self.accountant,
        )
        return self.make_private(
            data_loader=data_loader,
            noise_multiplier=sigma,
            delta=delta,
            max_steps=planned,
            **kwargs,
        )

    # ------------------------------------------------------------------ ledger
    def _record_step(self, optimizer: ScaleThenPrivatizeOptimizer) -> None:
        # Called by Opacus inside pre_step, after noise is drawn and BEFORE the parameters
        # change: the ledger on disk is ahead of (never behind) what was released.
        assert self.ledger is not None
        self.ledger.record(self.sample_rate, self.noise_multiplier)

    def get_epsilon(
        self, delta: float | None = None, accountant: Accountant | str | None = None
    ) -> float:
        """Epsilon spent so far (primary accountant unless another is named)."""
        if self.ledger is None:
            return 0.0
        return self.ledger.epsilon(accountant or self.accountant, delta)

    # ------------------------------------------------------------------ checkpoints
    @property
    def reproducible(self) -> bool:
        """Whether the noise can be replayed from a seed (research runs, not a DP release)."""
        return self.seed is not None

    @property
    def randomness(self) -> str:
        """Where the mechanism's randomness comes from, in words (for the report)."""
        if self.secure_mode:
            return "os-csprng"
        return "seeded" if self.seed is not None else "os-entropy"

    def state_dict(self) -> dict[str, Any]:
        """Ledger, schedule and, for seeded research runs only, the RNG states.

        Entropy-seeded generator states are never written: a checkpoint must not let anyone
        replay the noise (a resumed run draws fresh seeds).
        """
        replay = self.reproducible
        return {
            "ledger": self.ledger.to_dict() if self.ledger else None,
            "steps_taken": self.optimizer.steps_taken if self.optimizer else 0,
            "refreshes": list(self.refreshes),
            # dp-stp's scale: computed from released gradients only, so it may be kept
            "stp_scale": opt.scale.state_dict()
            if isinstance(opt := self.optimizer, SecondMomentScaleOptimizer)
            else None,
            "noise_generator": self.noise_generator.get_state()
            if replay and self.noise_generator
            else None,
            "sample_generator": self.sample_generator.get_state()
            if replay and self.sample_generator
            else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (call after :meth:`make_private`)."""
        if state.get("ledger") is not None:
            path = self.ledger.path if self.ledger else None
            self.ledger = PrivacyLedger.from_dict(state["ledger"], path)
            # the processes of this part of the run, not of the checkpoint's
            self.ledger.meta.update({"world_size": self.world.size, "backend": self.world.backend})
            self.ledger.save()
        if self.optimizer is not None:
            self.optimizer.steps_taken = int(state["steps_taken"])
        self.refreshes = list(state.get("refreshes", []))
        if isinstance(self.optimizer, SecondMomentScaleOptimizer) and state.get("stp_scale"):
            self.optimizer.scale.load_state_dict(state["stp_scale"])
        if self.noise_generator is not None and state.get("noise_generator") is not None:
            self.noise_generator.set_state(state["noise_generator"])
        if (
            self.sample_generator is not None
            and state.get("sample_generator") is not None
            and not self.world.distributed  # each rank draws its own units, seeded per rank
        ):
            self.sample_generator.set_state(state["sample_generator"])
        if self.method is Method.DP_KFC and self.optimizer is not None:
            # Rebuild at the restored (released) parameters with the next probe seed.
            self.refresh_preconditioner()
