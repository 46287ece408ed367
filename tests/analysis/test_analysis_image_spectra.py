"""Image spectra: known exponents of synthetic fields, the window, the fit range, errors."""

import math

import pytest
import torch

from dpkfc_med.analysis import (
    band_exponents,
    hann_window,
    image_spectrum,
    plot_image_spectra,
    probe_spectrum,
    spectrum_rows,
)
from dpkfc_med.probes import pink_noise, white_noise


@pytest.mark.parametrize("alpha", [1.0, 2.0, 3.0])
def test_recovers_alpha_2d(alpha):
    g = torch.Generator().manual_seed(0)
    x = pink_noise((64, 64), batch=8, alpha=alpha, generator=g)
    s = image_spectrum(x)
    assert abs(s.alpha - alpha) < 0.15, s.row()
    # every octave band sees the same power law
    assert s.bands and all(abs(a - alpha) < 0.35 for _, _, a in s.bands), s.bands


def test_recovers_alpha_3d_anisotropic_spacing():
    g = torch.Generator().manual_seed(1)
    spacing = (2.5, 1.0, 1.0)
    x = pink_noise((24, 48, 48), batch=8, alpha=2.0, spacing=spacing, generator=g)
    s = image_spectrum(x, spacing)
    assert abs(s.alpha - 2.0) < 0.2, s.row()
    assert s.spacing == spacing and s.num_images == 8
    # the smallest Nyquist frequency (1 / (2 * 2.5) = 0.2 cycles/mm) bounds the fit
    assert s.fmax <= 0.2 + 1e-9


def test_white_noise_is_flat():
    g = torch.Generator().manual_seed(2)
    s = image_spectrum(white_noise((48, 48), batch=8, generator=g))
    assert abs(s.alpha) < 0.15


def test_window_removes_border_edges():
    # a smooth non-periodic ramp: without a window the border jump reads as a shallow power
    # law; the Hann window leaves the much steeper spectrum of a smooth signal
    yy, xx = torch.meshgrid(torch.arange(32.0), torch.arange(32.0), indexing="ij")
    g = torch.Generator().manual_seed(3)
    x = (xx + 0.5 * yy)[None, None] + 1e-3 * torch.randn(4, 1, 32, 32, generator=g)
    plain = image_spectrum(x, window="none")
    windowed = image_spectrum(x, window="hann", fmax=0.2)
    assert plain.alpha < 2.5
    assert windowed.alpha > plain.alpha + 1.0


def test_hann_window_is_outer_product():
    w = hann_window((5, 7))
    want = torch.outer(
        torch.hann_window(5, periodic=False, dtype=torch.float64),
        torch.hann_window(7, periodic=False, dtype=torch.float64),
    )
    torch.testing.assert_close(w, want, rtol=1e-12, atol=0)


def test_fit_range_is_recorded_and_respected():
    g = torch.Generator().manual_seed(4)
    x = pink_noise((64, 64), batch=4, alpha=2.0, generator=g)
    s = image_spectrum(x, fmin=0.1, fmax=0.3)
    assert 0.1 <= s.fmin < s.fmax <= 0.3
    keep = (s.freqs >= 0.1) & (s.freqs <= 0.3)
    assert s.fmin == pytest.approx(float(s.freqs[keep].min()))
    assert s.fmax == pytest.approx(float(s.freqs[keep].max()))
    # default: the two lowest bins are skipped
    d = image_spectrum(x)
    assert d.fmin == pytest.approx(float(d.freqs[2]))


def test_band_exponents_cover_the_range():
    g = torch.Generator().manual_seed(5)
    x = pink_noise((64, 64), batch=16, alpha=3.0, generator=g)
    # pink noise is periodic: without a window every band is unbiased
    bands = band_exponents(x, fmin=1 / 16, fmax=0.5, window="none")
    assert len(bands) == 3  # log2(0.5 / (1/16)) = 3 octaves
    assert bands[0][0] == pytest.approx(1 / 16) and bands[-1][1] == pytest.approx(0.5)
    assert all(abs(a - 3.0) < 0.3 for _, _, a in bands), bands


@pytest.mark.parametrize(("preset", "shape"), [("xray", (32, 32)), ("mri", (16, 24, 16))])
def test_probe_spectrum_matches_preset(preset, shape):
    s = probe_spectrum(preset, shape, num=8)
    assert abs(s.alpha - 2.0) < 0.25, s.row()
    assert not s.uses_private_data and "alpha=2" in s.label
    assert abs(probe_spectrum(preset, shape, num=8, alpha=3.0).alpha - 3.0) < 0.3


def test_rows_and_plot():
    s = probe_spectrum("ct", (24, 24, 24), num=4)
    row = spectrum_rows([s])[0]
    assert set(row) >= {"label", "alpha", "fmin", "fmax", "bands", "uses_private_data"}
    assert math.isfinite(row["alpha"])
    fig = plot_image_spectra([s])
    assert fig.axes and "alpha=" in fig.axes[0].get_legend().get_texts()[0].get_text()


def test_errors_name_the_field():
    x = torch.zeros(2, 1, 8, 8)
    with pytest.raises(ValueError, match="window='box'.*'hann'"):
        image_spectrum(x + torch.randn_like(x), window="box")
    with pytest.raises(ValueError, match="spacing"):
        image_spectrum(torch.randn(2, 1, 8, 8, 8), spacing=(1.0, 1.0, 1.0, 1.0))
