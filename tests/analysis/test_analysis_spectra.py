import torch

from dpkfc_med.analysis import effective_rank, factor_spectra, spectrum_table
from dpkfc_med.curvature.factors import estimate_factors
from tests.conftest import per_sample_ce, tiny_cnn_2d


def test_effective_rank_brute_force():
    assert effective_rank(torch.tensor([1.0, 1.0, 1.0])) == 3.0
    assert abs(effective_rank(torch.tensor([1.0, 0.0])) - 1.0) < 1e-12
    assert effective_rank(torch.zeros(4)) == 0.0


def test_factor_spectra_match_eigvalsh(float64):
    torch.manual_seed(0)
    net = tiny_cnn_2d(num_classes=2)
    x, y = torch.randn(32, 1, 8, 8), torch.randint(0, 2, (32,))
    spectra = factor_spectra(net, x, y, per_sample_ce)
    factors = estimate_factors(net, x, y, per_sample_ce)
    for name, f in factors.items():
        want = torch.linalg.eigvalsh(f.g[0]).flip(0)
        torch.testing.assert_close(spectra[name]["G"], want)
    rows = {r["layer"]: r for r in spectrum_table(spectra)}
    # two classes: softmax errors sum to zero, so the output layer's G has rank 1
    assert abs(rows["6"]["G_eff_rank"] - 1.0) < 1e-6
