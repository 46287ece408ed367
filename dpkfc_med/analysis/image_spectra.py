r"""Radially averaged power spectra of images and volumes, and their fitted exponent.

The exponent follows :data:`dpkfc_med.probes.SPECTRUM_CONVENTION`: power proportional to
f^(-alpha), f the radial frequency in cycles per mm (voxel spacing honoured). The periodogram,
its radial bins and the least-squares slope are those of
:func:`~dpkfc_med.probes.radial_power_spectrum` and :func:`~dpkfc_med.probes.fit_spectral_slope`;
this module adds what real images need before them and records the fit range:

* **Window.** A real image is not periodic; its FFT sees the jump between opposite borders as an
  edge, whose power falls as f^-2 whatever the image holds, and pulls every fitted exponent
  towards 2. Each image is therefore mean-subtracted and multiplied by a separable Hann window
  (``window="hann"``, default) before the FFT. Synthetic probes are periodic, but are windowed
  the same way so that both sides of a comparison are measured alike.
* **Fit range.** The lowest ``skip_bins`` radial bins (default 2, the ones the window's
  main lobe smears) are left out of the fit; the fit runs up to the smallest per-axis Nyquist
  frequency unless ``fmax`` says otherwise. The range used is stored with the result.

A spectrum of private images is computed from the private data without noise: it is a
research and custodian diagnostic, not a differentially private release.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from dpkfc_med.probes import (
    ImageProbeSource,
    ModalityPreset,
    fit_spectral_slope,
    get_preset,
    radial_power_spectrum,
)

__all__ = [
    "ImageSpectrum",
    "band_exponents",
    "hann_window",
    "image_spectrum",
    "probe_spectrum",
    "spectrum_rows",
]


@dataclass(frozen=True)
class ImageSpectrum:
    """Radially averaged power spectrum of a set of images and its fitted exponent.

    Attributes:
        label: What was measured, e.g. ``"PneumoniaMNIST (real)"`` or ``"xray probes"``.
        freqs: Mean radial frequency of each bin, cycles/mm, increasing ``[num_bins]``.
        power: Mean power of each bin ``[num_bins]`` (after the window).
        alpha: Fitted exponent (power proportional to f^(-alpha)) over ``[fmin, fmax]``.
        fmin: Lowest bin frequency in the fit (cycles/mm).
        fmax: Highest bin frequency in the fit (cycles/mm).
        spacing: Voxel spacing in mm per spatial axis.
        num_images: Images (or volumes, times channels) averaged.
        window: ``"hann"`` or ``"none"``.
        uses_private_data: Whether the images are private records (then not a DP release).
        bands: ``(f_lo, f_hi, alpha)`` of the octave bands of :func:`band_exponents`.
    """

    label: str
    freqs: Tensor
    power: Tensor
    alpha: float
    fmin: float
    fmax: float
    spacing: tuple[float, ...]
    num_images: int
    window: str
    uses_private_data: bool
    bands: tuple[tuple[float, float, float], ...] = field(default_factory=tuple)

    def fitted_power(self, freqs: Tensor) -> Tensor:
        """The fitted power law at ``freqs``, anchored at the fit range's geometric mean."""
        keep = (self.freqs >= self.fmin) & (self.freqs <= self.fmax)
        log_f0 = self.freqs[keep].log().mean()
        log_p0 = self.power[keep].log().mean()
        return torch.exp(log_p0 - self.alpha * (freqs.log() - log_f0))

    def row(self) -> dict[str, Any]:
        """One table row: label, alpha, fit range, number of images, private or not."""
        return {
            "label": self.label,
            "alpha": self.alpha,
            "fmin": self.fmin,
            "fmax": self.fmax,
            "num_images": self.num_images,
            "bands": [(lo, hi, round(a, 3)) for lo, hi, a in self.bands],
            "uses_private_data": self.uses_private_data,
        }


def hann_window(shape: Sequence[int], *, dtype: torch.dtype = torch.float64) -> Tensor:
    """Separable (outer product) symmetric Hann window ``[*shape]``; axes of length 1 get 1."""
    out = torch.ones((), dtype=dtype)
    for n in shape:
        w = torch.hann_window(n, periodic=False, dtype=dtype) if n > 2 else torch.ones(n)
        out = out[..., None] * w.to(dtype)
    return out


def _prepare(x: Tensor, spatial_dims: int, window: str) -> Tensor:
    """Mean-subtracted (and windowed) float64 copy of ``x [..., *spatial]`` on the CPU."""
    if window not in ("hann", "none"):
        raise ValueError(f"window={window!r}: use 'hann' (default) or 'none'")
    dims = tuple(range(x.ndim - spatial_dims, x.ndim))
    xd = x.detach().to(device="cpu", dtype=torch.float64)
    xd = xd - xd.mean(dim=dims, keepdim=True)
    if window == "hann":
        xd = xd * hann_window(xd.shape[x.ndim - spatial_dims :])
    return xd


def _spatial_dims(x: Tensor, spacing: float | Sequence[float] | None) -> int:
    if spacing is not None and not isinstance(spacing, int | float):
        nd = len(spacing)
    else:
        nd = x.ndim - 2
    if not 1 <= nd <= 3 or x.ndim < nd + 1:
        raise ValueError(
            f"x of shape {tuple(x.shape)} with spacing={spacing!r}: pass x as "
            "[B, C, *spatial] with 1 to 3 spatial axes and one spacing (mm) per spatial axis"
        )
    return nd


def _spacing_tuple(spacing: float | Sequence[float] | None, nd: int) -> tuple[float, ...]:
    if spacing is None:
        return (1.0,) * nd
    if isinstance(spacing, int | float):
        return (float(spacing),) * nd
    return tuple(float(s) for s in spacing)


def band_exponents(
    x: Tensor,
    spacing: float | Sequence[float] | None = None,
    *,
    fmin: float,
    fmax: float,
    window: str = "hann",
) -> tuple[tuple[float, float, float], ...]:
    """Fitted exponent in each of about-octave-wide bands between ``fmin`` and ``fmax``.

    A single power law has the same exponent in every band; a drift across bands shows where
    the data leave it (e.g. a steeper fall above the resolution limit of a resampled image).

    Args:
        x: ``[B, C, *spatial]`` images.
        spacing: Voxel spacing in mm per spatial axis (default 1.0).
        fmin: Lower edge of the first band (cycles/mm).
        fmax: Upper limit of the last band (cycles/mm).
        window: ``"hann"`` (default) or ``"none"``.

    Returns:
        ``((f_lo, f_hi, alpha), ...)``: ``round(log2(fmax / fmin))`` bands of equal log width
        (at least one), each band holding fewer than two radial bins left out.
    """
    nd = _spatial_dims(x, spacing)
    xd = _prepare(x, nd, window)
    # equal log-width bands of about an octave (a last sliver of a band holds too few bins)
    n_bands = max(1, round(math.log2(fmax / fmin))) if fmax > fmin else 1
    edges = [fmin * (fmax / fmin) ** (k / n_bands) for k in range(n_bands + 1)]
    out = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        try:
            slope = fit_spectral_slope(
                xd, spacing, fmin=lo * (1 - 1e-9), fmax=hi * (1 + 1e-9), spatial_dims=nd
            )
        except ValueError:  # fewer than two bins in this band
            continue
        out.append((lo, hi, -slope))
    return tuple(out)


def image_spectrum(
    x: Tensor,
    spacing: float | Sequence[float] | None = None,
    *,
    label: str = "",
    fmin: float | None = None,
    fmax: float | None = None,
    skip_bins: int = 2,
    window: str = "hann",
    uses_private_data: bool = False,
) -> ImageSpectrum:
    """Radially averaged power spectrum and fitted exponent of images or volumes.

    Args:
        x: ``[B, C, H, W]`` images or ``[B, C, D, H, W]`` volumes (any intensity scale: the
            exponent does not depend on it).
        spacing: Voxel spacing in mm, one per spatial axis (default 1.0 each); also fixes the
            number of spatial axes.
        label: Name of the measured set, kept on the result.
        fmin: Lowest bin frequency of the fit (cycles/mm); default: above the lowest
            ``skip_bins`` bins.
        fmax: Highest bin frequency of the fit; default: the smallest per-axis Nyquist.
        skip_bins: Bins left out at the low end when ``fmin`` is not given.
        window: ``"hann"`` (default, see the module docstring) or ``"none"``.
        uses_private_data: Mark the result as computed from private records.

    Returns:
        :class:`ImageSpectrum` with the octave-band exponents of :func:`band_exponents`.

    Raises:
        ValueError: On a shape/spacing mismatch, an unknown window, or a fit range holding
            fewer than two bins.
    """
    nd = _spatial_dims(x, spacing)
    sp = _spacing_tuple(spacing, nd)
    xd = _prepare(x, nd, window)
    freqs, power = radial_power_spectrum(xd, spacing, spatial_dims=nd)
    if fmin is None:
        fmin = float(freqs[min(skip_bins, len(freqs) - 2)])
    if fmax is None:
        fmax = float(freqs[-1])
    slope = fit_spectral_slope(xd, spacing, fmin=fmin, fmax=fmax, spatial_dims=nd)
    keep = (freqs >= fmin) & (freqs <= fmax)
    used_min, used_max = float(freqs[keep].min()), float(freqs[keep].max())
    bands = band_exponents(x, spacing, fmin=used_min, fmax=used_max, window=window)
    return ImageSpectrum(
        label=label,
        freqs=freqs,
        power=power,
        alpha=-slope,
        fmin=used_min,
        fmax=used_max,
        spacing=sp,
        num_images=math.prod(x.shape[: x.ndim - nd]),
        window=window,
        uses_private_data=uses_private_data,
        bands=bands,
    )


def probe_spectrum(
    preset: str | ModalityPreset,
    spatial_shape: Sequence[int],
    *,
    spacing: float | Sequence[float] | None = None,
    alpha: float | None = None,
    num: int = 16,
    seed: int = 0,
    label: str | None = None,
    **kwargs: Any,
) -> ImageSpectrum:
    """Spectrum of a modality preset's pink-noise probes, measured as real images are.

    Args:
        preset: Modality preset name (``"xray"``, ``"ct"``, ``"mri"``, ...).
        spatial_shape: Probe shape ``(H, W)`` or ``(D, H, W)``.
        spacing: Voxel spacing in mm (default 1.0).
        alpha: Override of the preset's exponent.
        num: Probes drawn.
        seed: Probe seed.
        label: Result label (default ``"<preset> probes (alpha=...)"``).
        **kwargs: Passed to :func:`image_spectrum` (``fmin``, ``fmax``, ``window``, ...).

    Returns:
        :class:`ImageSpectrum` of the probes (``uses_private_data=False``).
    """
    p = get_preset(preset)
    src = ImageProbeSource(
        spatial_shape, channels=1, num_classes=2, preset=p, spacing=spacing, alpha=alpha
    )
    batch = src.sample(num, seed=seed, dtype=torch.float64)
    name = label or f"{p.name} probes (alpha={src.alpha:g})"
    return image_spectrum(batch.inputs, src.spacing, label=name, **kwargs)


def spectrum_rows(spectra: Sequence[ImageSpectrum]) -> list[dict[str, Any]]:
    """:meth:`ImageSpectrum.row` of each spectrum, for printing as a table."""
    return [s.row() for s in spectra]
