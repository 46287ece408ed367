r"""Curvature factors of every preconditioner family, from probes or from a private-data oracle.

One record type holds the factors of one network for one family, layer by layer, under fixed
role names:

=============  ==========================================================  =================
family         roles                                                       damping, power
=============  ==========================================================  =================
``kfac``       ``A`` (layer inputs) ``[G, n_a, n_a]``, ``G`` (output          ``damping_a``,
               errors) ``[G, n_g, n_g]``                                   ``damping_g``; 1/2
``shampoo``    ``L = E[g g^T]`` ``[G, n_g, n_g]``, ``R = E[g^T g]``          ``damping_g``,
               ``[G, n_a, n_a]``                                           ``damping_a``; p
``diagonal``   ``D = E[g^2]`` flattened to ``[G, n_g n_a]`` (a diagonal)     ``damping_a``; 1/2
=============  ==========================================================  =================

A factor too wide for ``max_factor_dim`` is kept as its diagonal ``[G, n]``, as in the
preconditioner. The estimators are the preconditioner's own
(:func:`~dpkfc_med.curvature.factors.estimate_factors`,
:func:`~dpkfc_med.curvature.families.estimate_gradient_statistics`) with the settings of a
:class:`~dpkfc_med.curvature.PreconditionerConfig`.

Two constructors, kept apart on purpose:

* :func:`probe_factors` draws from a :class:`~dpkfc_med.probes.ProbeSource` (pink or white
  noise, a public proxy dataset) -- what DP-KFC itself may use.
* :func:`oracle_factors` computes the same statistics on **private** images and labels. The
  result, :class:`OracleFactors`, uses private data, is not differentially private and is for
  research only. It is neither a probe source nor a preconditioner: it has no ``sample`` or
  ``describe`` (so :meth:`~dpkfc_med.privacy.PrivacyEngine.make_private` refuses it as
  ``probe_source``) and no gradient transform, so it cannot enter a training run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from dpkfc_med.curvature.factors import LossFn, covered_layers, estimate_factors
from dpkfc_med.curvature.families import Family, estimate_gradient_statistics
from dpkfc_med.curvature.preconditioner import PreconditionerConfig
from dpkfc_med.probes import ProbeSource, probe_source_problems
from dpkfc_med.utils import check_choice

__all__ = [
    "ORACLE_LABEL",
    "ROLES",
    "CurvatureFactors",
    "OracleFactors",
    "ProbeFactors",
    "forward_order",
    "oracle_factors",
    "probe_factors",
    "role_damping",
]

ORACLE_LABEL = "ORACLE: uses private data, not DP, research only"
"""Label carried by every :class:`OracleFactors` (and shown in its plots and tables)."""

ROLES: Mapping[Family, tuple[str, ...]] = {
    Family.KFAC: ("A", "G"),
    Family.SHAMPOO: ("L", "R"),
    Family.DIAGONAL: ("D",),
}
"""Factor roles of each family, in the order they are reported."""


def role_damping(
    family: Family | str, role: str, config: PreconditionerConfig
) -> tuple[float, float]:
    """``(relative damping, power)`` the preconditioner applies to a factor of this role.

    The preconditioner takes ``(F + damping * mean_eig(F) I)^(-power)``: power 1/2 for
    K-FAC and the diagonal family, ``config.shampoo_exponent`` for Shampoo; ``G`` and
    Shampoo's ``L`` are damped by ``damping_g``, the others by ``damping_a``.

    Raises:
        ValueError: If ``role`` is not a role of ``family`` (the message lists them).
    """
    fam = check_choice("family", family, Family)
    if role not in ROLES[fam]:
        raise ValueError(f"role={role!r} is not a role of family {fam.value!r}: {ROLES[fam]}")
    damping = config.damping_g if role in ("G", "L") else config.damping_a
    power = float(config.shampoo_exponent) if fam is Family.SHAMPOO else 0.5
    return float(damping), power


@dataclass(frozen=True)
class CurvatureFactors:
    """Factors of one network for one preconditioner family, by layer and role.

    Attributes:
        family: The preconditioner family.
        blocks: ``{layer: {role: factor}}``, each factor ``[G, n, n]`` (full) or ``[G, n]``
            (diagonal), float64.
        layers: Covered layers in the order the forward pass first reaches them (the depth
            order used by the alignment summaries).
        num_samples: Inputs the expectations average over.
        provenance: Where the inputs came from (a probe source's ``describe()``, or the
            oracle's data description).
        uses_private_data: Whether private records entered the factors.
        label: Short name for tables and legends.
    """

    family: Family
    blocks: Mapping[str, Mapping[str, Tensor]]
    layers: tuple[str, ...]
    num_samples: int
    provenance: Mapping[str, Any] = field(default_factory=dict)
    uses_private_data: bool = False
    label: str = ""

    @property
    def roles(self) -> tuple[str, ...]:
        """The family's factor roles (:data:`ROLES`)."""
        return ROLES[self.family]

    def factor(self, layer: str, role: str) -> Tensor:
        """One factor ``[G, n, n]`` or ``[G, n]``.

        Raises:
            KeyError: For an unknown layer or role, listing the known ones.
        """
        if layer not in self.blocks:
            raise KeyError(f"{self.label or 'factors'}: no layer {layer!r}; layers: {self.layers}")
        if role not in self.blocks[layer]:
            raise KeyError(f"layer {layer!r} has no factor {role!r}; roles: {self.roles}")
        return self.blocks[layer][role]

    def eigenvalues(self, layer: str, role: str) -> Tensor:
        """Eigenvalues of a factor, all groups together, in decreasing order ``[G * n]``."""
        f = self.factor(layer, role)
        ev = f.flatten() if f.dim() == 2 else torch.linalg.eigvalsh(f).flatten()
        return ev.clamp_min(0).sort(descending=True).values


@dataclass(frozen=True)
class ProbeFactors(CurvatureFactors):
    """:class:`CurvatureFactors` estimated from a probe source (what DP-KFC may use)."""


@dataclass(frozen=True)
class OracleFactors(CurvatureFactors):
    """Factors computed on PRIVATE data: not differentially private, research only.

    A reference for judging probe factors, never an input to training: it is not a
    :class:`~dpkfc_med.probes.ProbeSource` (it has no ``sample`` or ``describe``) and not a
    preconditioner (it transforms no gradient), and the private images it was computed from
    are not kept.
    """

    uses_private_data: bool = True
    label: str = ORACLE_LABEL

    _REFUSED: ClassVar[tuple[str, ...]] = ("sample", "describe")

    def __getattr__(self, name: str) -> Any:
        # Only reached for missing attributes: say why a probe-source method is absent.
        if name in self._REFUSED:
            raise AttributeError(
                f"OracleFactors has no {name}(): it is built from private data ({ORACLE_LABEL}) "
                "and can never act as a probe source; train with "
                "dpkfc_med.probes.ImageProbeSource instead"
            )
        raise AttributeError(name)


def forward_order(
    model: nn.Module, inputs: Tensor, layers: Mapping[str, nn.Module]
) -> tuple[str, ...]:
    """Names of ``layers`` in the order a forward pass on ``inputs`` first calls them."""
    seen: list[str] = []
    handles = []
    for name, module in layers.items():

        def hook(mod: nn.Module, args: Any, out: Any, name: str = name) -> None:
            if name not in seen:
                seen.append(name)

        handles.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(inputs)
    finally:
        for h in handles:
            h.remove()
    return tuple(seen) + tuple(n for n in layers if n not in seen)


def _estimate(
    model: nn.Module,
    inputs: Tensor,
    targets: Tensor,
    loss_fn: LossFn,
    family: Family,
    cfg: PreconditionerConfig,
    position_seed: int,
) -> tuple[dict[str, dict[str, Tensor]], tuple[str, ...]]:
    layers = covered_layers(model)
    if not layers:
        raise ValueError(
            f"{type(model).__name__} has no layer with a curvature adapter and a trainable "
            "weight; see dpkfc_med.curvature.adapters.supported_layer_types()"
        )
    blocks: dict[str, dict[str, Tensor]] = {}
    if family is Family.KFAC:
        for name, f in estimate_factors(
            model,
            inputs,
            targets,
            loss_fn,
            layers=layers,
            reduction=cfg.reduction,
            chunk_size=cfg.chunk_size,
            max_factor_dim=cfg.max_factor_dim,
            need_g=True,
            max_positions=cfg.max_positions,
            position_seed=position_seed,
        ).items():
            blocks[name] = {"A": f.a, "G": f.g}
    else:
        stats = estimate_gradient_statistics(
            model,
            inputs,
            targets,
            loss_fn,
            layers,
            family,
            chunk_size=cfg.chunk_size,
            max_factor_dim=cfg.max_factor_dim,
        )
        for name, st in stats.items():
            if family is Family.DIAGONAL:
                assert st.second_moment is not None
                blocks[name] = {"D": st.second_moment.flatten(1)}
            else:
                assert st.left is not None and st.right is not None
                blocks[name] = {"L": st.left, "R": st.right}
    order = forward_order(model, inputs[:1], {n: layers[n] for n in blocks})
    return blocks, order


def _probe_source_problem(source: object) -> str | None:
    if isinstance(source, OracleFactors):
        return f"source is OracleFactors ({ORACLE_LABEL}); probe factors need a ProbeSource"
    problems = probe_source_problems(
        source,
        field="source",
        fix="use oracle_factors(model, images, labels, ...) for private data (research only)",
    )
    return problems[0] if problems else None


def probe_factors(
    model: nn.Module,
    source: ProbeSource,
    loss_fn: LossFn,
    *,
    family: Family | str = Family.KFAC,
    num_probes: int = 256,
    seed: int = 0,
    config: PreconditionerConfig | None = None,
    label: str | None = None,
) -> ProbeFactors:
    """Factors of ``family`` estimated from ``num_probes`` probes of ``source``.

    Args:
        model: The network at the parameters of interest (initialisation or trained).
        source: Any :class:`~dpkfc_med.probes.ProbeSource`: pink or white
            :class:`~dpkfc_med.probes.ImageProbeSource`, a public proxy dataset.
        loss_fn: Per-sample loss ``(outputs, targets) -> [M]``.
        family: ``"kfac"``, ``"shampoo"`` or ``"diagonal"``.
        num_probes: Probes drawn.
        seed: Probe seed (also seeds the positions drawn under ``config.max_positions``).
        config: Estimation settings (reduction, chunk size, ``max_factor_dim``,
            ``max_positions``); default :class:`~dpkfc_med.curvature.PreconditionerConfig`.
        label: Name for tables (default: the source's ``kind``).

    Returns:
        :class:`ProbeFactors`; ``uses_private_data`` is what the source's ``describe()``
        says (a public proxy overlapping the private data says True).

    Raises:
        ValueError: If ``source`` is not a probe source (a DataLoader, Dataset, tensor or
            :class:`OracleFactors` is refused).
    """
    problem = _probe_source_problem(source)
    if problem:
        raise ValueError(problem)
    fam = check_choice("family", family, Family)
    cfg = config or PreconditionerConfig()
    ref = next(model.parameters())
    batch = source.sample(num_probes, seed=seed, model=model, device=ref.device, dtype=ref.dtype)
    blocks, order = _estimate(model, batch[0], batch[1], loss_fn, fam, cfg, seed)
    described = dict(source.describe())
    name = label or str(described.get("kind", type(source).__name__))
    return ProbeFactors(
        family=fam,
        blocks=blocks,
        layers=order,
        num_samples=int(batch[0].shape[0]),
        provenance=described,
        uses_private_data=bool(described.get("uses_private_data", False)),
        label=name,
    )


def oracle_factors(
    model: nn.Module,
    inputs: Tensor,
    targets: Tensor,
    loss_fn: LossFn,
    *,
    family: Family | str = Family.KFAC,
    config: PreconditionerConfig | None = None,
    data: str = "private data",
) -> OracleFactors:
    """Factors of ``family`` on PRIVATE inputs and labels: not DP, research only.

    The same estimator as :func:`probe_factors`, on real images with their true labels (the
    "empirical" curvature a data-dependent preconditioner would see). The result is a
    reference for analysis; it cannot be given to a training run.

    Args:
        model: The network.
        inputs: Private images ``[N, C, *spatial]``.
        targets: Their labels ``[N]`` or label maps ``[N, *spatial]``.
        loss_fn: Per-sample loss ``(outputs, targets) -> [M]``.
        family: ``"kfac"``, ``"shampoo"`` or ``"diagonal"``.
        config: Estimation settings (as for :func:`probe_factors`).
        data: What the inputs are, for the provenance record.

    Returns:
        :class:`OracleFactors` labelled :data:`ORACLE_LABEL`.
    """
    fam = check_choice("family", family, Family)
    cfg = config or PreconditionerConfig()
    if inputs.shape[0] == 0:
        raise ValueError("oracle_factors: inputs is empty; pass at least one private image")
    blocks, order = _estimate(model, inputs, targets, loss_fn, fam, cfg, 0)
    return OracleFactors(
        family=fam,
        blocks=blocks,
        layers=order,
        num_samples=int(inputs.shape[0]),
        provenance={"data": data, "note": ORACLE_LABEL, "uses_private_data": True},
    )
