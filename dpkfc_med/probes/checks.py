"""Argument checks shared by the probe generators: each returns the value or names it and why.

They guard the public probe functions (:mod:`.noise`, :mod:`.sources`, :mod:`.tokens`) before
any probe is drawn, so a wrong shape, spacing, count or seed fails with the argument's name.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import torch

__all__ = [
    "check_generator",
    "check_num_classes",
    "check_positive_int",
    "check_seed",
    "check_spacing",
    "check_spatial_shape",
]


def check_spatial_shape(spatial_shape: Sequence[int]) -> tuple[int, ...]:
    """Validate a 1D/2D/3D spatial shape of positive ints and return it as a tuple."""
    if isinstance(spatial_shape, int) or not isinstance(spatial_shape, Sequence | torch.Size):
        raise ValueError(
            f"spatial_shape={spatial_shape!r} must be a sequence of 1 to 3 positive ints, "
            "e.g. (64, 64) or (32, 48, 40)"
        )
    try:
        # operator.index accepts Python and NumPy integers but not floats or bools.
        shape = tuple(operator.index(n) for n in spatial_shape if not isinstance(n, bool | float))
    except TypeError:
        shape = ()
    if len(shape) != len(spatial_shape) or not 1 <= len(shape) <= 3 or min(shape) < 1:
        raise ValueError(
            f"spatial_shape={spatial_shape!r} must be a sequence of 1 to 3 positive ints, "
            "e.g. (64, 64) or (32, 48, 40)"
        )
    if math.prod(shape) < 2:
        # A single voxel has only the DC component, which standardisation cannot give unit std.
        raise ValueError(f"spatial_shape={spatial_shape!r} must contain at least 2 voxels")
    return shape


def check_spacing(spacing: float | Sequence[float] | None, ndim: int) -> tuple[float, ...]:
    """Return a positive, finite spacing per axis (default 1.0 mm); a scalar is broadcast."""
    if spacing is None:
        return (1.0,) * ndim
    values = (spacing,) * ndim if isinstance(spacing, int | float) else tuple(spacing)
    if len(values) != ndim:
        raise ValueError(
            f"spacing={spacing!r} has {len(values)} entries but the data has {ndim} spatial "
            f"dimensions; give one spacing (mm) per spatial axis"
        )
    out = tuple(float(s) for s in values)
    if not all(math.isfinite(s) and s > 0 for s in out):
        raise ValueError(f"spacing={spacing!r} must be positive and finite (mm per voxel)")
    return out


def check_positive_int(value: int, name: str) -> int:
    """Return ``value`` if it is a positive int, else raise ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")
    return value


def check_generator(generator: torch.Generator | None) -> None:
    """Reject non-CPU generators: probes are drawn on the CPU to be device-independent."""
    if generator is not None and generator.device.type != "cpu":
        raise ValueError(
            f"generator is on {generator.device}; pass a CPU torch.Generator (probes are drawn "
            "on the CPU so that a seed gives the same probes on every device)"
        )


def check_seed(seed: int) -> int:
    """Return ``seed`` if it is a non-negative int (what ``Generator.manual_seed`` accepts)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise ValueError(f"seed={seed!r} must be an int in [0, 2**64)")
    return seed


def check_num_classes(num_classes: int) -> int:
    """Return ``num_classes`` if it is an int >= 2."""
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
        raise ValueError(f"num_classes={num_classes!r} must be an int >= 2")
    return num_classes
