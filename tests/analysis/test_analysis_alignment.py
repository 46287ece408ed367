"""Alignment measures against hand computations, self-alignment and random rotations."""

import math

import pytest
import torch

from dpkfc_med.analysis import (
    align_factor,
    compare_factors,
    depth_summary,
    eigenvalue_decay,
    oracle_factors,
    plot_alignment,
    plot_eigenvalue_decay,
    probe_factors,
    relative_frobenius_error,
    subspace_overlap,
    top_eigenvector_cosines,
)
from dpkfc_med.probes import ImageProbeSource
from tests.conftest import per_sample_ce, tiny_cnn_2d


def _spd(n, seed=0, decay=0.7):
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    ev = decay ** torch.arange(n, dtype=torch.float64)  # distinct eigenvalues
    return (q * ev) @ q.T


def _rotation(n, seed):
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    return q


def test_factor_aligned_with_itself():
    f = _spd(12)[None]
    r = align_factor(f, f.clone(), k=4)
    assert r.k == 4
    assert all(abs(c - 1) < 1e-10 for c in r.top_cosines), r.top_cosines
    assert abs(r.subspace_overlap - 1) < 1e-10
    assert r.rel_frobenius == 0 and r.rel_frobenius_shape == 0 and r.rel_frobenius_inv_root == 0
    assert r.trace_ratio == pytest.approx(1, abs=1e-14)


def test_random_rotation_breaks_direction_not_scale():
    f = _spd(12)[None]
    q = _rotation(12, seed=7)
    rotated = q @ f @ q.T
    r = align_factor(rotated, f, k=4)
    assert max(r.top_cosines) < 0.99 and r.subspace_overlap < 0.9
    assert r.rel_frobenius > 0.1 and r.rel_frobenius_inv_root > 0.01
    # a rotation keeps the spectrum, hence the trace (scale) and the eigenvalue decay
    assert r.trace_ratio == pytest.approx(1, rel=1e-12)


def test_relative_frobenius_errors_by_hand():
    f = torch.diag(torch.tensor([1.0, 2.0], dtype=torch.float64))[None]
    ref = torch.eye(2, dtype=torch.float64)[None]
    assert relative_frobenius_error(f, ref) == pytest.approx(1 / math.sqrt(2), rel=1e-12)
    damping = 0.1
    r = align_factor(f, ref, damping=damping)
    # normalised by the mean eigenvalue 1.5: diag(2/3, 4/3) against I
    assert r.rel_frobenius_shape == pytest.approx(math.sqrt(2 / 9) / math.sqrt(2), rel=1e-12)
    # inverse roots (F_hat + damping * mean(F_hat) I)^(-1/2), mean(F_hat) = 1
    uf = torch.tensor([2 / 3 + damping, 4 / 3 + damping], dtype=torch.float64) ** -0.5
    ur = torch.tensor([1 + damping, 1 + damping], dtype=torch.float64) ** -0.5
    want = float(torch.linalg.norm(uf - ur) / torch.linalg.norm(ur))
    assert r.rel_frobenius_inv_root == pytest.approx(want, rel=1e-10)
    assert r.trace_ratio == pytest.approx(1.5)
    # Shampoo's power 1/4
    r4 = align_factor(f, ref, damping=damping, power=0.25)
    want4 = float(torch.linalg.norm(uf.sqrt() - ur.sqrt()) / torch.linalg.norm(ur.sqrt()))
    assert r4.rel_frobenius_inv_root == pytest.approx(want4, rel=1e-10)


def test_top_cosines_and_overlap_by_hand():
    # eigenvectors e1, e2 against e1, (e2 + e3) / sqrt(2): cosines 1 and 1/sqrt(2)
    f = torch.diag(torch.tensor([3.0, 2.0, 0.0], dtype=torch.float64))
    v = torch.tensor([0.0, 1.0, 1.0], dtype=torch.float64) / math.sqrt(2)
    g = torch.diag(torch.tensor([3.0, 0.0, 0.0], dtype=torch.float64)) + 2 * torch.outer(v, v)
    cos = top_eigenvector_cosines(f[None], g[None], k=2)
    assert cos == pytest.approx((1.0, 1 / math.sqrt(2)), abs=1e-12)
    # principal angles 0 and 45 degrees: (1 + 1/2) / 2
    assert subspace_overlap(f[None], g[None], k=2) == pytest.approx(0.75, abs=1e-12)
    # k is capped at the rank (2 here)
    assert len(top_eigenvector_cosines(f[None], g[None], k=3)) == 2


def test_groups_compare_as_block_diagonal():
    a, b = _spd(4, 1), _spd(4, 2)
    c, d = _spd(4, 3), _spd(4, 4)
    grouped = align_factor(torch.stack([a, b]), torch.stack([c, d]), k=3)
    block = align_factor(torch.block_diag(a, b)[None], torch.block_diag(c, d)[None], k=3)
    assert grouped == block


def test_diagonal_factors():
    f = torch.tensor([[4.0, 3.0, 2.0, 1.0]], dtype=torch.float64)
    ref = torch.tensor([[4.0, 2.0, 3.0, 1.0]], dtype=torch.float64)
    assert top_eigenvector_cosines(f, ref, k=3) == (1.0, 0.0, 0.0)
    assert subspace_overlap(f, ref, k=3) == 1.0
    assert subspace_overlap(f, ref, k=1) == 1.0
    assert relative_frobenius_error(f, ref) == pytest.approx(math.sqrt(2 / 30))
    # a full factor against a diagonal one is reduced to its diagonal
    full = torch.diag(f[0])[None]
    assert relative_frobenius_error(full, ref) == pytest.approx(math.sqrt(2 / 30))


def test_zero_reference_is_flagged():
    z = torch.zeros(1, 3, 3, dtype=torch.float64)
    r = align_factor(_spd(3)[None], z)
    assert r.k == 0 and math.isnan(r.subspace_overlap) and r.rel_frobenius == math.inf


@pytest.mark.parametrize("family", ["kfac", "shampoo", "diagonal"])
def test_compare_factor_sets(family, float64):
    torch.manual_seed(0)
    net = tiny_cnn_2d(num_classes=3)
    x, y = torch.randn(16, 1, 8, 8), torch.randint(0, 3, (16,))
    oracle = oracle_factors(net, x, y, per_sample_ce, family=family)
    again = oracle_factors(net, x, y, per_sample_ce, family=family)
    rows = compare_factors(again, oracle)
    assert [r.layer for r in rows[:: len(oracle.roles)]] == list(oracle.layers)
    assert all(r.rel_frobenius == 0 and r.trace_ratio == pytest.approx(1) for r in rows)
    src = ImageProbeSource((8, 8), channels=1, num_classes=3, preset="xray")
    pink = probe_factors(net, src, per_sample_ce, family=family, num_probes=16)
    rows = compare_factors(pink, oracle)
    assert all(r.rel_frobenius > 0 for r in rows)
    summary = depth_summary(rows)
    assert set(summary) == set(oracle.roles)
    for role in oracle.roles:
        assert summary[role]["shallow"]["layers"] + summary[role]["deep"]["layers"] == 3
    ev = eigenvalue_decay(pink, oracle.layers[0], oracle.roles[0])
    assert float(ev[0]) == 1.0 and bool((ev[:-1] >= ev[1:]).all())
    assert plot_eigenvalue_decay({"pink": pink, "oracle": oracle}).axes
    assert plot_alignment({"pink": rows}).axes


def test_compare_refuses_mismatched_sets(float64):
    net = tiny_cnn_2d(num_classes=3)
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 3, (8,))
    kfac = oracle_factors(net, x, y, per_sample_ce, family="kfac")
    diag = oracle_factors(net, x, y, per_sample_ce, family="diagonal")
    with pytest.raises(ValueError, match="cannot compare 'diagonal' factors with 'kfac'"):
        compare_factors(diag, kfac)


def test_depth_summary_by_hand():
    f = _spd(4)[None]
    rows = [align_factor(f, f, layer=f"l{i}", role="A", depth=i, num_layers=4) for i in range(4)]
    rows[3] = align_factor(f * 4, f, layer="l3", role="A", depth=3, num_layers=4)
    s = depth_summary(rows)["A"]
    assert s["shallow"]["layers"] == 2 and s["deep"]["layers"] == 2
    assert s["shallow"]["trace_ratio"] == pytest.approx(1.0)
    assert s["deep"]["trace_ratio"] == pytest.approx(2.0)  # geometric mean of 1 and 4
    assert s["deep"]["rel_frobenius"] == pytest.approx(1.5)  # (0 + 3) / 2
