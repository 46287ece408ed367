"""Scale-then-privatize optimizer: Opacus' ``DPOptimizer`` with one replaced stage.

Opacus' pre-step is a fixed pipeline ``clip_and_accumulate -> add_noise -> scale_grad``. We
override only ``clip_and_accumulate`` (and ``add_noise`` when the OS CSPRNG replaces
``torchcsprng``):

1. ``precondition_grad_samples``: parameters no adapter covers get their fallback transform
   (covered layers already hold ``s U_G g_i U_A``, computed inside the per-sample hooks);
2. per-unit summation: when unit ids are set (patients), per-sample gradients of one unit are
   summed *before* clipping, so the clipped contribution of a unit is bounded by ``C``;
3. flat L2 clipping of the concatenated transformed gradient of every unit to ``C`` and
   summation; diagnostics are recorded on the way.

Between the clipped sum and the noise, :meth:`~ScaleThenPrivatizeOptimizer.run_pre_noise_hooks`
calls the optimizer's ``pre_noise_hooks`` (none by default): the one place where extra units
may join the clipped sum, used by the empirical audit (:mod:`.audit`) to add its canaries.

Noise ``N(0, sigma^2 C^2 I)`` is then added to the sum and divided by the expected batch size
(expected number of units) by the inherited stages; the base optimizer steps in the
transformed coordinates (``preconditioner.step="transformed"``), or on the average multiplied
once more by the preconditioner (``"natural"``, post-processing of the released average).

Privacy guarantee:
    For any fixed preconditioner (built from probes and released parameters only), the
    transformed, per-unit clipped sum has L2 sensitivity ``C`` under adding/removing one unit;
    with Poisson sampling of units at rate ``q`` and noise multiplier ``sigma`` each step is the
    subsampled Gaussian mechanism that the accountants in :mod:`.accounting` assume.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from opacus.optimizers import DPOptimizer
from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed
from torch import Tensor, nn

from dpkfc_med.curvature.preconditioner import KroneckerPreconditioner
from dpkfc_med.privacy.distributed import World, all_reduce_sum
from dpkfc_med.privacy.ghost import GhostRows
from dpkfc_med.privacy.grad_sample import raw_norm_samples
from dpkfc_med.privacy.rng import secure_normal

__all__ = ["BudgetExhaustedError", "ScaleThenPrivatizeOptimizer", "StepDiagnostics"]


class BudgetExhaustedError(RuntimeError):
    """Raised instead of taking a step the privacy plan does not cover."""


@dataclass
class StepDiagnostics:
    """Cheap per-step diagnostics of the clipping stage.

    These are computed from un-noised private per-sample norms: they are NOT differentially
    private and are meant for monitoring by the data custodian, not for release.

    Attributes:
        batch_units: units (or samples) in the batch.
        clipped_fraction: fraction of units whose transformed norm exceeded ``C``.
        median_transformed_norm: median per-unit norm after preconditioning.
        median_raw_norm: median per-sample norm before preconditioning (first
            ``raw_norm_samples(batch)`` samples; per sample, not per unit).
        layer_share: each layer's share of the transformed squared norm (batch total).
        layer_snr: each layer's signal-to-noise ratio of the privatized sum: the squared norm
            of the clipped per-unit sum over the batch, divided by the noise's expected squared
            norm ``sigma^2 C^2 d`` on that layer's ``d`` coordinates (both in the coordinates
            where the noise is added). Infinite when the noise multiplier is 0.
    """

    batch_units: int = 0
    clipped_fraction: float = float("nan")
    median_transformed_norm: float = float("nan")
    median_raw_norm: float = float("nan")
    layer_share: dict[str, float] = field(default_factory=dict)
    layer_snr: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """Plain dict (for logs)."""
        return {
            "batch_units": self.batch_units,
            "clipped_fraction": self.clipped_fraction,
            "median_transformed_norm": self.median_transformed_norm,
            "median_raw_norm": self.median_raw_norm,
            "layer_share": dict(self.layer_share),
            "layer_snr": dict(self.layer_snr),
        }


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else math.inf


class ScaleThenPrivatizeOptimizer(DPOptimizer):
    """DP optimizer that clips and noises per-unit gradients in preconditioned coordinates.

    Args:
        optimizer: the wrapped (base) optimizer.
        noise_multiplier: ``sigma``.
        max_grad_norm: clip norm ``C`` (in transformed coordinates).
        expected_batch_size: expected number of units per batch (``q * N``).
        loss_reduction: ``"mean"`` or ``"sum"`` (as in Opacus).
        generator: torch generator for the noise (seeded research runs).
        secure_mode: draw noise from the OS CSPRNG (see :mod:`.rng`).
        preconditioner: the current preconditioner (``None`` for DP-SGD).
        max_steps: refuse any step beyond this count (the privacy plan).
        diagnostics: record :class:`StepDiagnostics` every step.
        param_owners: ``id(param) -> (module name, module)`` for the diagnostics' per-layer
            names and raw norms (the engine passes the wrapped model's modules).
        raw_norms_sq: the per-sample hooks' raw squared norms by module
            (:attr:`~dpkfc_med.privacy.grad_sample.PreconditionedGradSampleModule.
            raw_norms_sq`), read by the diagnostics.
        world: the training processes (:mod:`.distributed`): rank 0 alone draws the noise,
            and one all-reduce sums the ranks' clipped sums with it; ``expected_batch_size``
            is then the global ``q N``. Diagnostics describe this rank's units.
        ghost_rows: the per-sample hooks' store of layers under ghost clipping
            (:attr:`~dpkfc_med.privacy.grad_sample.PreconditionedGradSampleModule.ghost_rows`):
            their parameters have no ``grad_sample``; their per-unit norms and clipped sums
            come from the kept rows (:mod:`.ghost`). Emptied after every step.

    Attributes:
        hold: ``id(p)`` of every parameter ``p`` that learns nothing at the next steps (the
            first stage of ``training.head_first_epochs``): their per-unit gradients count as
            zero in the clipped norm and sum, and their noisy gradient is dropped before the
            update (no step, no optimizer state). The others' clipped sum then has norm at
            most ``C`` per unit, so the step is the planned mechanism restricted to them.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        noise_multiplier: float,
        max_grad_norm: float,
        expected_batch_size: int | None,
        loss_reduction: str = "mean",
        generator: torch.Generator | None = None,
        secure_mode: bool = False,
        preconditioner: KroneckerPreconditioner | None = None,
        max_steps: int | None = None,
        diagnostics: bool = True,
        param_owners: Mapping[int, tuple[str, nn.Module]] | None = None,
        raw_norms_sq: Mapping[nn.Module, Tensor] | None = None,
        world: World | None = None,
        ghost_rows: dict[nn.Module, GhostRows] | None = None,
    ) -> None:
        # Opacus' own secure path needs torchcsprng; ours uses os.urandom (see add_noise).
        super().__init__(
            optimizer,
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            expected_batch_size=expected_batch_size,
            loss_reduction=loss_reduction,
            generator=generator,
            secure_mode=False,
        )
        self.os_secure = secure_mode
        self.preconditioner = preconditioner
        self.max_steps = max_steps
        self.steps_taken = 0
        self.unit_ids: Tensor | None = None
        self.record_diagnostics = diagnostics
        self.last_diagnostics = StepDiagnostics()
        self.post_step_hooks: list[Callable[[ScaleThenPrivatizeOptimizer], None]] = []
        self.pre_noise_hooks: list[Callable[[ScaleThenPrivatizeOptimizer], None]] = []
        self.param_owners: Mapping[int, tuple[str, nn.Module]] = param_owners or {}
        self.raw_norms_sq: Mapping[nn.Module, Tensor] = {} if raw_norms_sq is None else raw_norms_sq
        self._fallback_raw_sq: dict[int, Tensor] = {}
        self.world = world or World()
        self.ghost_rows: dict[nn.Module, GhostRows] = {} if ghost_rows is None else ghost_rows
        self.hold: frozenset[int] = frozenset()

    def layer_name(
        self, p: nn.Parameter, index: int, names: Mapping[int, str] | None = None
    ) -> str:
        """The layer ``p`` belongs to in the diagnostics (``index``: its place in ``params``).

        ``names``: the preconditioner's ``param_layer_names()``, when the caller has it.
        """
        if names is None:
            names = self.preconditioner.param_layer_names() if self.preconditioner else {}
        if id(p) in names:
            return names[id(p)]
        return self.param_owners.get(id(p), (f"param{index}", None))[0]

    # ------------------------------------------------------------------------ units
    def set_unit_ids(self, unit_ids: Tensor | None) -> None:
        """Unit (patient) index of every sample of the next batch, ``[N_samples]`` int64.

        Samples with the same id are summed before clipping. ``None``: every sample is a unit.
        """
        self.unit_ids = None if unit_ids is None else unit_ids.long()

    # ---------------------------------------------------------------------- stages
    def precondition_grad_samples(self) -> None:
        """Apply fallback transforms to parameters the hooks did not precondition."""
        self._fallback_raw_sq.clear()
        if self.preconditioner is None:
            return
        fallbacks = {id(fb.param): fb for fb in self.preconditioner.fallbacks.values()}
        for p in self.params:
            fb = fallbacks.get(id(p))
            if fb is not None and p.grad_sample is not None:
                gs = self._get_flat_grad_sample(p)
                m = raw_norm_samples(gs.shape[0])
                self._fallback_raw_sq[id(p)] = gs[:m].pow(2).flatten(1).sum(1)
                p.grad_sample = fb.transform(gs)

    def _per_unit(self, grad: Tensor) -> Tensor:
        if self.unit_ids is None:
            return grad
        ids = self.unit_ids.to(grad.device)
        if len(ids) != len(grad):
            raise ValueError(
                f"unit ids cover {len(ids)} samples but the batch has {len(grad)}; call "
                "optimizer.set_unit_ids(...) with one id per sample of the current batch"
            )
        n_units = int(ids.max()) + 1 if len(ids) else 0
        out = grad.new_zeros((n_units, *grad.shape[1:]))
        return out.index_add_(0, ids, grad)

    def _ghost_params(self) -> dict[int, tuple[GhostRows, str]]:
        """``id(param) -> (rows, "weight" | "bias")`` of the layers under ghost clipping now."""
        out: dict[int, tuple[GhostRows, str]] = {}
        for module, rows in self.ghost_rows.items():
            for kind in ("weight", "bias"):
                p = getattr(module, kind, None)
                if isinstance(p, nn.Parameter) and p.requires_grad:
                    out[id(p)] = (rows, kind)
        return out

    def clip_and_accumulate(self) -> None:
        """Precondition fallbacks, sum per unit, clip the flat norm to ``C``, accumulate.

        Layers under ghost clipping contribute their per-unit norms and clipped sums from
        their kept rows (:class:`~dpkfc_med.privacy.ghost.GhostRows`); every other parameter
        from its materialised per-sample gradient. Both give the same clipped sum.
        """
        self.precondition_grad_samples()
        ghost = self._ghost_params()
        # one norm per layer: its weight and bias share the rows
        unique = {id(r): r for r, _ in ghost.values()}
        layer_sq = {key: r.norms_sq(self.unit_ids) for key, r in unique.items()}
        ghost_sq: dict[int, Tensor] = {}
        for pid, (rows, kind) in ghost.items():
            w_sq, b_sq = layer_sq[id(rows)]
            sq_p = w_sq if kind == "weight" else b_sq
            assert sq_p is not None  # a bias parameter has a bias column
            ghost_sq[pid] = torch.zeros_like(sq_p) if pid in self.hold else sq_p
        grads = [
            None if id(p) in ghost else self._per_unit(self._get_flat_grad_sample(p))
            for p in self.params
        ]
        if self.hold:  # a held parameter's gradient counts as zero (its noisy sum is dropped)
            grads = [
                torch.zeros_like(g) if g is not None and id(p) in self.hold else g
                for p, g in zip(self.params, grads)
            ]
        sizes = [len(g) for g in grads if g is not None] + [len(v) for v in ghost_sq.values()]
        if len(set(sizes)) > 1:
            raise ValueError(
                f"per-unit gradients of {sorted(set(sizes))} units in one step: every layer must "
                "see the same batch once per step (take a step after every backward pass)"
            )
        n = sizes[0] if sizes else 0
        if n == 0:  # an empty batch: nothing to clip, on the parameters' device
            device = self.params[0].device
            sq = torch.zeros(0, len(grads), device=device)
            norms = torch.zeros(0, device=device)
        else:
            # Same arithmetic as Opacus (per-parameter norms, then their norm), so DP-SGD
            # through this optimizer is Opacus' step on the same per-sample gradients.
            device = next(g for g in [*grads, *ghost_sq.values()] if g is not None).device
            per_param = torch.stack(
                [
                    ghost_sq[id(p)].clamp(min=0).sqrt().to(device)
                    if g is None
                    else g.reshape(n, -1).norm(2, dim=-1).to(device)
                    for p, g in zip(self.params, grads)
                ],
                dim=1,
            )
            norms = per_param.norm(2, dim=1)
            sq = per_param.pow(2)
        clip = (self.max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
        coef = clip if self.unit_ids is None or n == 0 else clip[self.unit_ids.to(clip.device)]
        ghost_sums: dict[int, tuple[Tensor, Tensor | None]] = {}
        signal: list[float] = []
        for p, g in zip(self.params, grads):
            if g is None:  # ghost clipping: one product over the batch's kept rows
                rows, kind = ghost[id(p)]
                if id(rows) not in ghost_sums:
                    ghost_sums[id(rows)] = rows.clipped_sum(coef)
                w_sum, b_sum = ghost_sums[id(rows)]
                part = w_sum if kind == "weight" else b_sum
                assert part is not None
                summed = part.to(p.dtype).reshape(p.shape)
                if id(p) in self.hold:
                    summed = torch.zeros_like(summed)
            else:
                _check_processed_flag(p.grad_sample)
                g = g.to(p.dtype)
                summed = torch.einsum("i,i...", clip.to(device=g.device, dtype=p.dtype), g)
                _mark_as_processed(p.grad_sample)
            p.summed_grad = summed if p.summed_grad is None else p.summed_grad + summed
            if self.record_diagnostics:
                signal.append(float(summed.double().pow(2).sum()))
        self.ghost_rows.clear()
        if self.record_diagnostics:
            self.last_diagnostics = self._diagnostics(sq, norms, signal)

    @property
    def accumulated_iterations(self) -> int:
        """Backward passes accumulated since the last step (divides the noisy sum).

        Opacus' count over the parameters that hold ``grad_sample``; parameters under ghost
        clipping hold none (their layer refuses a second backward pass before a step), and
        with none at all it is 1.
        """
        vals = {
            len(p.grad_sample) if isinstance(p.grad_sample, list) else 1
            for p in self.params
            if getattr(p, "grad_sample", None) is not None
        }
        if len(vals) > 1:
            raise ValueError("Number of accumulated steps is inconsistent across parameters")
        return vals.pop() if vals else 1

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Opacus' ``zero_grad``, and drop rows kept for ghost clipping."""
        self.ghost_rows.clear()
        super().zero_grad(set_to_none)

    def _diagnostics(self, sq: Tensor, norms: Tensor, signal: list[float]) -> StepDiagnostics:
        n = len(norms)
        if n == 0:
            return StepDiagnostics(batch_units=0)
        names = self.preconditioner.param_layer_names() if self.preconditioner else {}
        share: dict[str, float] = {}
        sig: dict[str, float] = {}
        dims: dict[str, int] = {}
        col = sq.sum(0)
        total = float(col.sum()) or 1.0
        raw_parts: list[Tensor] = []
        done: set[int] = set()
        for j, p in enumerate(self.params):
            key = self.layer_name(p, j, names)
            share[key] = share.get(key, 0.0) + float(col[j]) / total
            sig[key] = sig.get(key, 0.0) + signal[j]
            dims[key] = dims.get(key, 0) + p.numel()
            owner = self.param_owners.get(id(p), ("", None))[1]
            owner_raw = None if owner is None else self.raw_norms_sq.get(owner)
            if owner_raw is not None:  # covered layer: hooks kept raw norms, once per module
                if id(owner) not in done:
                    done.add(id(owner))
                    raw_parts.append(owner_raw)
            elif id(p) in self._fallback_raw_sq:  # fallback parameter
                raw_parts.append(self._fallback_raw_sq[id(p)])
            elif p.grad_sample is not None:  # not preconditioned: raw == transformed
                gs = self._get_flat_grad_sample(p)
                raw_parts.append(gs[: raw_norm_samples(gs.shape[0])].pow(2).flatten(1).sum(1))
        noise_sq = (self.noise_multiplier * self.max_grad_norm) ** 2
        m = min(len(r) for r in raw_parts) if raw_parts else 0
        raw_sq = sum(r[:m].detach().double().cpu() for r in raw_parts) if m else None
        return StepDiagnostics(
            batch_units=n,
            clipped_fraction=float((norms > self.max_grad_norm).double().mean()),
            median_transformed_norm=float(norms.median()),
            median_raw_norm=float(raw_sq.sqrt().median())
            if isinstance(raw_sq, Tensor)
            else float("nan"),
            layer_share=share,
            layer_snr={k: _ratio(sig[k], noise_sq * dims[k]) for k in sig},
        )

    def run_pre_noise_hooks(self) -> None:
        """Call every ``pre_noise_hooks`` entry with the optimizer, once per noisy step.

        Runs after ``clip_and_accumulate`` and right before the noise is drawn, so a hook sees
        (and may add to) ``p.summed_grad``, the transformed, per-unit clipped sum. With no hook
        registered this does nothing, and the step is bit-for-bit the one without this stage.

        Privacy guarantee:
            A hook that adds vectors independent of the private data, each of norm at most
            ``C`` (extra units, such as the audit's canaries), leaves the guarantee for every
            real unit as stated. A hook that reads private data, or adds more than ``C`` per
            extra unit, is outside it.
        """
        for hook in self.pre_noise_hooks:
            hook(self)

    def add_noise(self) -> None:
        """Gaussian noise ``N(0, sigma^2 C^2)``: Opacus' generator, or the OS CSPRNG.

        The pre-noise hooks (:meth:`run_pre_noise_hooks`) run first. Over several processes
        only rank 0 draws, and the ranks' sums are then added up (:attr:`world`).
        """
        self.run_pre_noise_hooks()
        if not self.world.is_main:  # the one draw is rank 0's; this rank adds its clipped sum
            for p in self.params:
                _check_processed_flag(p.summed_grad)
                p.grad = p.summed_grad.clone().view_as(p)
                _mark_as_processed(p.summed_grad)
        elif not self.os_secure:
            super().add_noise()
        else:
            for p in self.params:
                _check_processed_flag(p.summed_grad)
                noise = secure_normal(self.noise_multiplier * self.max_grad_norm, p.summed_grad)
                p.grad = (p.summed_grad + noise).view_as(p)
                _mark_as_processed(p.summed_grad)
        if self.world.distributed:
            all_reduce_sum([p.grad for p in self.params if p.grad is not None])

    def scale_grad(self) -> None:
        """Divide by the expected batch size; with ``step="natural"`` multiply by ``P`` once more.

        The second product only post-processes the privatized average (see
        :attr:`PreconditionerConfig.step`).
        """
        if self.loss_reduction == "mean":
            # Opacus' division, with the divisor read once (Opacus re-counts the accumulated
            # passes over every parameter for every parameter: quadratic in their number)
            divisor = self.expected_batch_size * self.accumulated_iterations
            for p in self.params:
                p.grad /= divisor
        pre = self.preconditioner
        if pre is not None and pre.config.step == "natural":
            pre.precondition_update(self.params)

    def pre_step(self, closure: Callable[[], float] | None = None) -> bool | None:
        """Refuse a step the privacy plan does not cover, then run Opacus' pipeline.

        The pipeline is Opacus' (clip and accumulate, skip check, noise, scale, step hook),
        written out because Opacus' version reads every parameter's ``grad_sample`` first,
        which parameters under ghost clipping do not have.
        """
        if self.max_steps is not None and self.steps_taken >= self.max_steps:
            raise BudgetExhaustedError(
                f"the privacy plan covers {self.max_steps} noisy steps and all were taken; "
                "raise the target epsilon or plan more steps before training"
            )
        if not self.params:  # no trainable parameters: an ordinary optimizer, as in Opacus
            return True
        self.clip_and_accumulate()
        if self._check_skip_next_step():
            self._is_last_step_skipped = True
            return False
        self.add_noise()
        self.scale_grad()
        if self.hold:  # a held parameter's noise only: dropped, no update
            for p in self.params:
                if id(p) in self.hold:
                    p.grad = None
        if self.step_hook:
            self.step_hook(self)
        self._is_last_step_skipped = False
        return True

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One private step; post-step hooks (refresh) see the released parameters."""
        out = super().step(closure)
        if not self._is_last_step_skipped:
            self.steps_taken += 1
            for hook in self.post_step_hooks:
                hook(self)
        self.unit_ids = None
        return out
