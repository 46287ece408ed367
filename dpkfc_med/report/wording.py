"""The loud words of the report, bundle metadata and plots, each defined once."""

from __future__ import annotations

__all__ = ["NOT_VALID", "NO_GUARANTEE", "PRIVATE_PRECONDITIONER"]

NO_GUARANTEE = "NO PRIVACY GUARANTEE"
"""Headline of a non-private run (report banner, plots, bundle task and description)."""

NOT_VALID = "NOT A VALID DP RELEASE"
"""Headline of a run whose noise can be replayed (``privacy.reproducible_noise: true``)."""

PRIVATE_PRECONDITIONER = "PRECONDITIONER USES PRIVATE DATA"
"""Headline of a run whose public proxy overlaps the private training set."""
