"""Number formats that never understate privacy loss: epsilon and delta are rounded *up*."""

from __future__ import annotations

import math
from decimal import ROUND_CEILING, Decimal

__all__ = ["format_delta", "format_epsilon"]


def format_epsilon(value: float | None) -> str:
    """Epsilon rounded *up* to three decimals, e.g. ``1.23401 -> "1.235"``, ``0.99912 -> "1.000"``.

    The ceiling is taken on the shortest decimal form of the float (its ``repr``) rather than
    on ``value * 1000``, whose binary rounding error could push an exact ``1.234`` up to
    ``"1.235"`` or, worse, leave a value a hair above a boundary rounded down.

    Args:
        value: Epsilon; ``None`` for "not applicable".

    Returns:
        The figure as text (``"n/a"`` for ``None``, ``"inf"`` for an unbounded epsilon).
    """
    if value is None:
        return "n/a"
    value = float(value)
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{Decimal(repr(value)).quantize(Decimal('0.001'), rounding=ROUND_CEILING):f}"


def format_delta(value: float | None, digits: int = 3) -> str:
    """Delta rounded *up* to ``digits`` significant digits, e.g. ``1e-05 -> "1e-5"``."""
    if value is None:
        return "n/a"
    d = Decimal(repr(float(value)))
    if not d.is_finite() or d == 0:
        return str(value)
    q = d.quantize(Decimal(1).scaleb(d.adjusted() - digits + 1), rounding=ROUND_CEILING)
    q = q.normalize()
    return f"{q:e}" if q.adjusted() < -3 else f"{q:f}"
