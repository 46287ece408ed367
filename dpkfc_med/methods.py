"""The training methods: one enum, what each method is, and every list derived from it.

The run config, the privacy engine, the report's schema and renderer and the CLI help all read
the methods from here (torch-free, so that the report can import it).

Example:
    >>> Method("dp-kfc-white").mechanism is Method.DP_KFC
    True
    >>> [m.value for m in Method if m.preconditioned]
    ['dp-kfc', 'dp-kfc-white', 'dp-kfc-public']
"""

from __future__ import annotations

from enum import Enum

__all__ = [
    "ENGINE_METHODS",
    "KFAC_CURVATURE",
    "METHODS",
    "PRECONDITIONED_METHODS",
    "Method",
    "method_help",
]

KFAC_CURVATURE = "a KFAC curvature estimate"
"""What preconditions the DP-KFC family's gradients unless the report names another family."""


class Method(str, Enum):
    """A training method (``method`` of a run config, ``privacy.method`` of a report)."""

    NONPRIVATE = "nonprivate"
    DP_SGD = "dp-sgd"
    DP_KFC = "dp-kfc"
    DP_KFC_WHITE = "dp-kfc-white"
    DP_KFC_PUBLIC = "dp-kfc-public"
    DP_STP = "dp-stp"

    @property
    def private(self) -> bool:
        """Whether the method gives a DP guarantee (clipping and noise)."""
        return self is not Method.NONPRIVATE

    @property
    def preconditioned(self) -> bool:
        """Whether per-unit gradients are preconditioned before clipping (the DP-KFC family)."""
        return self in (Method.DP_KFC, Method.DP_KFC_WHITE, Method.DP_KFC_PUBLIC)

    @property
    def scaled(self) -> bool:
        """Whether per-unit gradients are divided by the noisy second moment (dp-stp)."""
        return self is Method.DP_STP

    @property
    def public_data(self) -> bool:
        """Whether the preconditioner is built from external public data instead of probes."""
        return self is Method.DP_KFC_PUBLIC

    @property
    def mechanism(self) -> Method | None:
        """The privacy engine's method that runs it (``None``: trained without the engine).

        Every DP-KFC variant is the ``dp-kfc`` mechanism; they differ in the probe source the
        engine is given. ``dp-stp`` is its own.
        """
        if not self.private:
            return None
        if self.preconditioned:
            return Method.DP_KFC
        return Method.DP_STP if self.scaled else Method.DP_SGD

    @property
    def description(self) -> str:
        """One sentence on what the method does; ``{unit}`` stands for the privacy unit."""
        return self.describe("{unit}")

    def describe(self, unit: str, curvature: str = KFAC_CURVATURE) -> str:
        """One sentence on what the method does, composed from its varying parts.

        Args:
            unit: The privacy unit's noun (``"patient"`` gives ``"per-patient gradients"``).
            curvature: What preconditions the per-unit gradients, for the DP-KFC family (a
                noun phrase; other methods have none: dp-stp's scale is always the same).
        """
        return _DESCRIPTIONS[self].format(unit=unit, curvature=curvature)


_DESCRIPTIONS = {
    Method.NONPRIVATE: "non-private training (no clipping, no noise)",
    Method.DP_SGD: (
        "DP-SGD: per-{unit} gradients clipped to norm C, Gaussian noise added to their sum"
    ),
    Method.DP_KFC: (
        "DP-KFC: per-{unit} gradients preconditioned by {curvature} built from synthetic noise "
        "probes, then clipped to norm C and noised as in DP-SGD"
    ),
    Method.DP_KFC_WHITE: (
        "DP-KFC with white-noise probes: per-{unit} gradients preconditioned by {curvature} "
        "built from white-noise probes, then clipped and noised as in DP-SGD"
    ),
    Method.DP_KFC_PUBLIC: (
        "DP-KFC with public data: per-{unit} gradients preconditioned by {curvature} built "
        "from external public data, then clipped and noised as in DP-SGD"
    ),
    Method.DP_STP: (
        "DP-STP (scale-then-privatize): per-{unit} gradients divided elementwise by the square "
        "root of a moving average of past released (noisy) squared gradients, clipped to norm C "
        "and noised in those coordinates, then multiplied back"
    ),
}

METHODS: tuple[str, ...] = tuple(m.value for m in Method)
"""Every method name, in the enum's order."""

PRECONDITIONED_METHODS: tuple[str, ...] = tuple(m.value for m in Method if m.preconditioned)
"""The names of the methods with a preconditioner."""

ENGINE_METHODS: tuple[Method, ...] = tuple(
    dict.fromkeys(m.mechanism for m in Method if m.mechanism is not None)
)
"""The mechanisms :class:`~dpkfc_med.privacy.engine.PrivacyEngine` runs (dp-sgd, dp-kfc,
dp-stp)."""


def method_help() -> str:
    """``"nonprivate | dp-sgd | ..."``: the methods for a command-line help text."""
    return " | ".join(METHODS)
