import math
import types

import pytest
import torch

from dpkfc_med.probes import (
    SPECTRUM_CONVENTION,
    fit_spectral_slope,
    match_intensity,
    pink_noise,
    radial_power_spectrum,
    white_noise,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("alpha", [1.0, 2.0, 3.0])
def test_slope_2d_non_square(alpha: float) -> None:
    x = pink_noise((96, 64), batch=6, alpha=alpha, generator=_gen(11))
    slope = fit_spectral_slope(x)
    assert abs(slope + alpha) < 0.25, (alpha, slope)


@pytest.mark.parametrize("alpha", [1.0, 2.0, 3.0])
def test_slope_3d_anisotropic_with_spacing(alpha: float) -> None:
    spacing = (1.0, 1.0, 2.5)
    x = pink_noise((32, 48, 40), batch=3, alpha=alpha, spacing=spacing, generator=_gen(5))
    slope = fit_spectral_slope(x, spacing=spacing)
    assert abs(slope + alpha) < 0.25, (alpha, slope)


def test_slope_1d() -> None:
    x = pink_noise((512,), batch=16, alpha=2.0, generator=_gen(2))
    assert abs(fit_spectral_slope(x) + 2.0) < 0.25


def test_spacing_makes_spectrum_isotropic_in_mm() -> None:
    # Physical frequency 0.1 cycles/mm is bin 4 of axis 0 (40 voxels x 1 mm) and bin 10 of
    # axis 2 (40 voxels x 2.5 mm): with spacing honoured, both carry the same expected power.
    # Had spacing been ignored, axis 2's bin would sit at 0.25 cycles/voxel, (2.5)^2 = 6.25x
    # less power for alpha = 2.
    x = pink_noise(
        (40, 8, 40), batch=16, channels=4, alpha=2.0, spacing=(1, 1, 2.5), generator=_gen(3)
    )
    power = torch.fft.fftn(x.double(), dim=(2, 3, 4)).abs().square().mean(dim=(0, 1))
    ratio = float(power[4, 0, 0] / power[0, 0, 10])
    assert 0.6 < ratio < 1.6, ratio


def test_white_noise_slope_near_zero() -> None:
    x = white_noise((96, 64), batch=4, generator=_gen(0))
    assert abs(fit_spectral_slope(x)) < 0.15
    x3 = white_noise((32, 48, 40), batch=4, generator=_gen(1))
    assert abs(fit_spectral_slope(x3, spacing=(1, 1, 2.5))) < 0.15


@pytest.mark.parametrize("make", ["pink", "white"])
def test_standardised_per_sample_and_channel(make: str) -> None:
    if make == "pink":
        x = pink_noise(
            (20, 30), batch=3, channels=2, alpha=2.5, generator=_gen(0), dtype=torch.float64
        )
    else:
        x = white_noise((20, 30), batch=3, channels=2, generator=_gen(0), dtype=torch.float64)
    flat = x.flatten(2)
    assert float(flat.mean(-1).abs().max()) < 1e-10
    assert float((flat.std(-1, correction=0) - 1).abs().max()) < 1e-10


@pytest.mark.parametrize("fn", [pink_noise, white_noise])
def test_seed_determinism(fn) -> None:
    a = fn((24, 16, 8), batch=2, channels=2, generator=_gen(123))
    b = fn((24, 16, 8), batch=2, channels=2, generator=_gen(123))
    c = fn((24, 16, 8), batch=2, channels=2, generator=_gen(124))
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_device_and_dtype(device: str, dtype: torch.dtype) -> None:
    x = pink_noise((8, 12), batch=2, generator=_gen(0), device=device, dtype=dtype)
    assert x.device.type == device and x.dtype == dtype and x.shape == (2, 1, 8, 12)
    ref = pink_noise((8, 12), batch=2, generator=_gen(0), dtype=torch.float64)
    # Same numbers on every device: generated on the CPU, cast at the end.
    assert torch.equal(x.cpu(), ref.to(dtype))


def test_non_cpu_generator_rejected() -> None:
    # A real CUDA generator needs a GPU; the check only looks at ``generator.device``.
    fake_cuda = types.SimpleNamespace(device=torch.device("cuda"))
    with pytest.raises(ValueError, match="CPU torch.Generator"):
        pink_noise((8, 8), batch=1, generator=fake_cuda)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("shape", "spacing", "match"),
    [
        ((0, 8), None, "positive ints"),
        ((8.0, 8), None, "positive ints"),
        ((2, 2, 2, 2), None, "1 to 3"),
        (8, None, "sequence"),
        ((1, 1), None, "at least 2 voxels"),
        ((8, 8), (1.0, 1.0, 1.0), "3 entries but the data has 2 spatial"),
        ((8, 8), (1.0, -1.0), "positive and finite"),
    ],
)
def test_invalid_shape_or_spacing(shape, spacing, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        pink_noise(shape, batch=1, spacing=spacing)


def test_invalid_alpha_and_batch() -> None:
    with pytest.raises(ValueError, match="alpha"):
        pink_noise((8, 8), batch=1, alpha=float("nan"))
    with pytest.raises(ValueError, match="batch=0 must be a positive int"):
        pink_noise((8, 8), batch=0)


def test_radial_power_spectrum_bins() -> None:
    x = pink_noise((32, 48, 40), batch=2, alpha=2.0, spacing=(1, 1, 2.5), generator=_gen(0))
    freqs, power = radial_power_spectrum(x, spacing=(1, 1, 2.5))
    assert freqs.ndim == power.ndim == 1 and freqs.numel() == power.numel() >= 5
    assert bool((freqs[1:] > freqs[:-1]).all())
    assert float(freqs.min()) > 0 and float(freqs.max()) <= 1 / (2 * 2.5) + 1e-12
    assert bool((power > 0).all()) and bool((power[1:] < power[:-1]).all())


def test_fit_range_validation() -> None:
    x = pink_noise((32, 32), batch=1, generator=_gen(0))
    with pytest.raises(ValueError, match="widen the range"):
        fit_spectral_slope(x, fmin=0.3, fmax=0.31)
    # A restricted range still recovers the slope.
    assert (
        abs(fit_spectral_slope(pink_noise((64, 64), batch=4, generator=_gen(1)), fmin=0.05) + 2)
        < 0.25
    )


def test_match_intensity_range_and_zscore() -> None:
    x = torch.tensor([-5.0, -3.0, 0.0, 1.5, 3.0, 7.0])
    y = match_intensity(x, low=-1000.0, high=1000.0)
    assert torch.allclose(y, torch.tensor([-1000.0, -1000.0, 0.0, 500.0, 1000.0, 1000.0]))
    u = match_intensity(x, mode="unit_range")
    assert torch.allclose(u, torch.tensor([0.0, 0.0, 0.5, 0.75, 1.0, 1.0]))
    assert match_intensity(x, mode="zscore") is x
    assert match_intensity(x, mode="ZScore") is x


def test_match_intensity_errors() -> None:
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="did you mean 'zscore'"):
        match_intensity(x, mode="zscor")
    with pytest.raises(ValueError, match="low < high"):
        match_intensity(x, low=1.0, high=0.0)
    with pytest.raises(ValueError, match="use mode='range'"):
        match_intensity(x, low=-1.0, high=1.0, mode="unit_range")


def test_convention_sentence() -> None:
    assert "f^(-alpha)" in SPECTRUM_CONVENTION and "f^(-alpha/2)" in SPECTRUM_CONVENTION
    assert "cycles per mm" in SPECTRUM_CONVENTION
    assert math.isfinite(fit_spectral_slope(white_noise((16, 16), batch=1, generator=_gen(0))))
