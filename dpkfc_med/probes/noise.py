r"""Power-law ("pink") and white noise fields in 1D, 2D and 3D, and their spectral diagnostics.

Exponent convention, used everywhere in :mod:`dpkfc_med.probes`: **the power spectrum is
proportional to f^(-alpha), i.e. the Fourier amplitude is proportional to f^(-alpha/2), where f
is the radial spatial frequency in cycles per mm.** So ``alpha = 2`` is natural-image "1/f
amplitude" noise, ``alpha = 0`` is white noise and ``alpha = 3`` is the exponent often reported
for mammograms.

.. math::

    P(f) \propto f^{-\alpha}, \qquad
    f = \sqrt{\textstyle\sum_k f_k^2}, \qquad
    f_k \in \mathrm{fftfreq}(n_k, d=\mathrm{spacing}_k)

Frequencies are computed per axis from the voxel spacing (``torch.fft.fftfreq(n_k, d=s_k)``), so
anisotropic volumes (e.g. spacing ``(1, 1, 2.5)`` mm) get a spectrum that is isotropic in
physical space, not in voxel space.

All noise is drawn on the CPU from a :class:`torch.Generator`, computed in float64 and only
then moved to the requested device and dtype, so a seed gives the same probes on every device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import Enum

import torch
from torch import Tensor

from dpkfc_med.probes.checks import (
    check_generator,
    check_positive_int,
    check_spacing,
    check_spatial_shape,
)
from dpkfc_med.utils import check_choice

__all__ = [
    "SPECTRUM_CONVENTION",
    "IntensityMode",
    "fit_spectral_slope",
    "match_intensity",
    "pink_noise",
    "radial_power_spectrum",
    "white_noise",
]

SPECTRUM_CONVENTION = (
    "power spectrum P(f) proportional to f^(-alpha) (Fourier amplitude proportional to "
    "f^(-alpha/2)), f = radial spatial frequency in cycles per mm from "
    "torch.fft.fftfreq(n_k, d=spacing_k) per axis"
)
"""The exponent convention, as a sentence for provenance records (see the module docstring)."""

# Samples are synthesised in float64 chunks of at most this many elements, which bounds the
# temporary memory of the FFT (a 1024 x 64^3 probe batch would otherwise need ~6 GB at once).
_CHUNK_ELEMENTS = 1 << 24


class IntensityMode(str, Enum):
    """How standardised noise is mapped to the intensity range of the preprocessed data.

    Attributes:
        UNIT_RANGE: Clamp to +-``clip_sd`` standard deviations, then map affinely to [0, 1]
            (data preprocessed with e.g. MONAI ``ScaleIntensityRange(..., b_min=0, b_max=1)``).
        RANGE: Same rule, mapped to a custom ``[low, high]``.
        ZSCORE: Leave the noise standardised (zero mean, unit std per sample and channel), for
            data preprocessed with e.g. MONAI ``NormalizeIntensity``.
    """

    UNIT_RANGE = "unit_range"
    RANGE = "range"
    ZSCORE = "zscore"


def _radial_frequency(shape: Sequence[int], spacing: Sequence[float], *, half: bool) -> Tensor:
    """Radial frequency (cycles per mm) of every FFT bin, float64.

    Args:
        shape: Spatial shape ``[*spatial]``.
        spacing: Voxel spacing in mm per axis.
        half: If True, the last axis uses ``rfftfreq`` (the layout of ``torch.fft.rfftn``).

    Returns:
        ``[*spatial]`` (or the rfft half-spectrum shape) tensor of ``sqrt(sum_k f_k^2)``.
    """
    axes = []
    for k, (n, d) in enumerate(zip(shape, spacing)):
        if half and k == len(shape) - 1:
            axes.append(torch.fft.rfftfreq(n, d=d, dtype=torch.float64))
        else:
            axes.append(torch.fft.fftfreq(n, d=d, dtype=torch.float64))
    grids = torch.meshgrid(*axes, indexing="ij")
    return torch.stack(grids).square().sum(dim=0).sqrt()


def _standardise(x: Tensor, dims: tuple[int, ...]) -> Tensor:
    """Zero mean, unit (population) std over ``dims``, independently for every other index."""
    x = x - x.mean(dim=dims, keepdim=True)
    return x / x.std(dim=dims, keepdim=True, correction=0)


def _synthesise(
    spatial_shape: Sequence[int],
    *,
    batch: int,
    channels: int,
    alpha: float | None,
    spacing: float | Sequence[float] | None,
    generator: torch.Generator | None,
    device: torch.device | str | None,
    dtype: torch.dtype,
) -> Tensor:
    """Shared body of :func:`pink_noise` (``alpha`` given) and :func:`white_noise` (None)."""
    shape = check_spatial_shape(spatial_shape)
    spacing_t = check_spacing(spacing, len(shape))
    check_positive_int(batch, "batch")
    check_positive_int(channels, "channels")
    check_generator(generator)
    if alpha is not None and not math.isfinite(alpha):
        raise ValueError(f"alpha={alpha!r} must be a finite number (power spectrum ~ f^-alpha)")

    dims = tuple(range(2, 2 + len(shape)))
    amplitude = None
    if alpha is not None:
        freq = _radial_frequency(shape, spacing_t, half=True)
        amplitude = torch.zeros_like(freq)
        nonzero = freq > 0
        # Amplitude f^(-alpha/2) gives power f^(-alpha); the DC bin is zeroed (undefined for
        # alpha > 0, and the mean is removed by standardisation anyway).
        amplitude[nonzero] = freq[nonzero] ** (-0.5 * float(alpha))

    per_sample = channels * math.prod(shape)
    chunk = max(1, _CHUNK_ELEMENTS // per_sample)
    out = torch.empty((batch, channels, *shape), dtype=dtype)
    for start in range(0, batch, chunk):
        n = min(chunk, batch - start)
        field = torch.randn((n, channels, *shape), generator=generator, dtype=torch.float64)
        if amplitude is not None:
            spectrum = torch.fft.rfftn(field, dim=dims) * amplitude
            field = torch.fft.irfftn(spectrum, s=shape, dim=dims)
        out[start : start + n] = _standardise(field, dims).to(dtype)
    return out.to(device=device)


def pink_noise(
    spatial_shape: Sequence[int],
    *,
    batch: int,
    channels: int = 1,
    alpha: float = 2.0,
    spacing: float | Sequence[float] | None = None,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Standardised power-law noise with power spectrum proportional to f^(-alpha).

    White Gaussian noise is filtered in the Fourier domain by the amplitude f^(-alpha/2)
    (f radial, in cycles per mm, honouring ``spacing``), the DC component is set to zero, and
    every ``[sample, channel]`` field is standardised to zero mean and unit std. Channels are
    independent fields.

    Args:
        spatial_shape: ``(W,)``, ``(H, W)`` or ``(D, H, W)``; any positive sizes.
        batch: Number of samples B.
        channels: Number of channels C.
        alpha: Power-spectrum exponent (``alpha = 2``: natural images; 0: white).
        spacing: Voxel spacing in mm, one per spatial axis or a scalar (default 1.0).
        generator: CPU generator; the same seeded generator state gives bitwise-equal output.
        device: Device of the result (computed on the CPU, then moved).
        dtype: Floating dtype of the result.

    Returns:
        ``[B, C, *spatial]`` tensor, e.g. ``[B, C, D, H, W]`` in 3D.

    Raises:
        ValueError: On an invalid shape, spacing, count, alpha or a non-CPU generator.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> pink_noise((32, 48), batch=2, alpha=2.0, generator=g).shape
        torch.Size([2, 1, 32, 48])
    """
    return _synthesise(
        spatial_shape,
        batch=batch,
        channels=channels,
        alpha=float(alpha),
        spacing=spacing,
        generator=generator,
        device=device,
        dtype=dtype,
    )


def white_noise(
    spatial_shape: Sequence[int],
    *,
    batch: int,
    channels: int = 1,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Standardised white Gaussian noise (flat power spectrum, alpha = 0).

    Args:
        spatial_shape: ``(W,)``, ``(H, W)`` or ``(D, H, W)``; any positive sizes.
        batch: Number of samples B.
        channels: Number of channels C.
        generator: CPU generator; the same seeded generator state gives bitwise-equal output.
        device: Device of the result (computed on the CPU, then moved).
        dtype: Floating dtype of the result.

    Returns:
        ``[B, C, *spatial]`` tensor, zero mean and unit std per sample and channel.
    """
    return _synthesise(
        spatial_shape,
        batch=batch,
        channels=channels,
        alpha=None,
        spacing=None,
        generator=generator,
        device=device,
        dtype=dtype,
    )


def _infer_spatial_dims(x: Tensor, spacing: object, spatial_dims: int | None) -> int:
    """Number of trailing spatial axes of ``x``: given, else ``len(spacing)``, else ndim - 2."""
    if spatial_dims is None:
        if spacing is not None and not isinstance(spacing, int | float):
            spatial_dims = len(spacing)  # type: ignore[arg-type]
        else:
            spatial_dims = x.ndim - 2
    if not 1 <= spatial_dims <= 3 or spatial_dims > x.ndim:
        raise ValueError(
            f"cannot use {spatial_dims} spatial dims for a tensor of shape {tuple(x.shape)}; "
            "pass x as [B, C, *spatial] or give spatial_dims (1 to 3)"
        )
    return spatial_dims


def _radial_bins(
    x: Tensor, spacing: float | Sequence[float] | None, spatial_dims: int | None
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Radially binned periodogram of ``x``: mean f, mean power, mean log f, mean log power, count.

    The periodogram is averaged over all leading (sample, channel) axes first. Bins have the
    width of the coarsest frequency resolution ``max_k 1 / (n_k spacing_k)``; the DC bin
    (f = 0) and the corner beyond the smallest Nyquist frequency ``min_k 1 / (2 spacing_k)``
    (where not every direction is sampled) are excluded. Empty bins are dropped.
    """
    nd = _infer_spatial_dims(x, spacing, spatial_dims)
    shape = tuple(x.shape[x.ndim - nd :])
    spacing_t = check_spacing(spacing, nd)
    live = [(n, d) for n, d in zip(shape, spacing_t) if n > 1]
    if not live:
        raise ValueError(f"x of shape {tuple(x.shape)} has no spatial axis longer than 1")
    dims = tuple(range(x.ndim - nd, x.ndim))
    xd = x.detach().to(device="cpu", dtype=torch.float64)
    power = torch.fft.fftn(xd, dim=dims).abs().square() / math.prod(shape)
    power = power.reshape(-1, *shape).mean(dim=0).flatten()
    freq = _radial_frequency(shape, spacing_t, half=False).flatten()

    f_nyquist = min(1.0 / (2.0 * d) for _, d in live)
    width = max(1.0 / (n * d) for n, d in live)
    keep = (freq > 0) & (freq <= f_nyquist * (1 + 1e-12)) & (power > 0)
    freq, power = freq[keep], power[keep]
    index = torch.floor(freq / width).long()
    counts = torch.bincount(index).to(torch.float64)
    nonempty = counts > 0

    def bin_mean(values: Tensor) -> Tensor:
        return (torch.bincount(index, weights=values) / counts.clamp(min=1))[nonempty]

    return (
        bin_mean(freq),
        bin_mean(power),
        bin_mean(freq.log()),
        bin_mean(power.log()),
        counts[nonempty],
    )


def radial_power_spectrum(
    x: Tensor,
    spacing: float | Sequence[float] | None = None,
    *,
    spatial_dims: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Radially averaged power spectrum of images or volumes.

    The periodogram ``|FFT(x)|^2 / N`` is averaged over all leading axes (samples, channels),
    then over radial frequency bins of width ``max_k 1 / (n_k spacing_k)`` cycles/mm. The DC
    bin and frequencies above the smallest per-axis Nyquist frequency are excluded.

    Args:
        x: ``[B, C, *spatial]`` tensor (any leading axes when ``spatial_dims`` is given).
        spacing: Voxel spacing in mm per spatial axis (default 1.0); also fixes the number of
            spatial axes when ``spatial_dims`` is None.
        spatial_dims: Number of trailing spatial axes (default ``len(spacing)`` or
            ``x.ndim - 2``).

    Returns:
        ``(freqs, power)``: 1D float64 tensors ``[num_bins]``, the mean frequency (cycles/mm)
        and mean power of each non-empty bin, in increasing frequency.
    """
    freqs, power, _, _, _ = _radial_bins(x, spacing, spatial_dims)
    return freqs, power


def fit_spectral_slope(
    x: Tensor,
    spacing: float | Sequence[float] | None = None,
    fmin: float | None = None,
    fmax: float | None = None,
    *,
    spatial_dims: int | None = None,
    weighted: bool = True,
) -> float:
    """Least-squares slope of log power against log radial frequency (``-alpha`` for pink noise).

    Uses the bins of :func:`radial_power_spectrum`, but averages ``log f`` and ``log power``
    within each bin (geometric means): for a pure power law the per-frequency log-periodogram
    is ``-alpha log f`` plus noise whose mean does not depend on f, so the fit is unbiased even
    in wide low-frequency bins. Bins are weighted by their number of frequencies (the inverse
    variance of a bin's mean log power), so the few-point lowest bins do not dominate.

    Args:
        x: ``[B, C, *spatial]`` tensor (see :func:`radial_power_spectrum`).
        spacing: Voxel spacing in mm per spatial axis (default 1.0). Use the data's spacing:
            with anisotropic voxels the slope is only meaningful in physical frequency.
        fmin: Lowest bin frequency (cycles/mm) used in the fit; default: all.
        fmax: Highest bin frequency used in the fit; default: the smallest Nyquist frequency.
        spatial_dims: Number of trailing spatial axes (see :func:`radial_power_spectrum`).
        weighted: Weight bins by their frequency count (default); False weights them equally.

    Returns:
        The fitted slope (about ``-alpha`` for power-law noise, 0 for white noise).

    Raises:
        ValueError: If fewer than two bins fall in ``[fmin, fmax]``.
    """
    freqs, _, log_f, log_p, counts = _radial_bins(x, spacing, spatial_dims)
    keep = torch.ones_like(freqs, dtype=torch.bool)
    if fmin is not None:
        keep &= freqs >= fmin
    if fmax is not None:
        keep &= freqs <= fmax
    if int(keep.sum()) < 2:
        raise ValueError(
            f"only {int(keep.sum())} radial bins in [fmin={fmin}, fmax={fmax}] cycles/mm "
            f"(bins span {float(freqs.min()):.4g} to {float(freqs.max()):.4g}); widen the range"
        )
    u, v, w = log_f[keep], log_p[keep], counts[keep]
    if not weighted:
        w = torch.ones_like(w)
    u = u - (w * u).sum() / w.sum()
    return float((w * u * v).sum() / (w * u * u).sum())


def match_intensity(
    x: Tensor,
    *,
    low: float | None = 0.0,
    high: float | None = 1.0,
    mode: IntensityMode | str = IntensityMode.RANGE,
    clip_sd: float = 3.0,
) -> Tensor:
    """Map standardised noise to the data's intensity range by a fixed affine rule.

    Rule for ``"range"`` (and ``"unit_range"``, which is ``"range"`` with ``[0, 1]``): clamp to
    ``[-clip_sd, clip_sd]`` (default +-3 sd, which touches about 0.27 % of Gaussian voxels),
    then map ``[-clip_sd, clip_sd]`` affinely onto ``[low, high]``, i.e.
    ``low + (clamp(x) + clip_sd) / (2 clip_sd) * (high - low)``. ``"zscore"`` returns ``x``
    unchanged. The rule is fixed in advance and is never fitted to private data.

    Args:
        x: Standardised noise ``[B, C, *spatial]``.
        low: Lower end of the target range (``"range"`` mode).
        high: Upper end of the target range (``"range"`` mode).
        mode: ``"range"``, ``"unit_range"`` or ``"zscore"``.
        clip_sd: Clamp half-width in standard deviations.

    Returns:
        Tensor of the same shape, dtype and device as ``x``.

    Raises:
        ValueError: On an unknown mode, ``low >= high``, non-finite bounds, or
            ``"unit_range"`` with bounds other than ``(0, 1)``.
    """
    mode = check_choice("intensity mode", mode, IntensityMode)
    if mode is IntensityMode.ZSCORE:
        return x
    if mode is IntensityMode.UNIT_RANGE:
        if (low, high) not in ((0.0, 1.0), (None, None)):
            raise ValueError(
                f"intensity mode 'unit_range' maps to [0, 1] but low={low!r}, high={high!r} "
                "were given; use mode='range' for a custom range"
            )
        low, high = 0.0, 1.0
    if low is None or high is None or not (math.isfinite(low) and math.isfinite(high)):
        raise ValueError(f"intensity range low={low!r}, high={high!r} must be finite numbers")
    if not low < high:
        raise ValueError(f"intensity range needs low < high, got low={low!r}, high={high!r}")
    if not (math.isfinite(clip_sd) and clip_sd > 0):
        raise ValueError(f"clip_sd={clip_sd!r} must be positive and finite")
    scaled = (x.clamp(-clip_sd, clip_sd) + clip_sd) / (2.0 * clip_sd)
    return low + scaled * (high - low)
