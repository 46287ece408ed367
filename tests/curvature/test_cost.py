"""Multiply-add estimates and the deterministic ``refresh_every="auto"`` period."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpkfc_med.curvature import cost as cc
from dpkfc_med.curvature.preconditioner import KroneckerPreconditioner, PreconditionerConfig
from dpkfc_med.privacy.engine import PrivacyEngine
from tests.conftest import GaussianProbes, per_sample_ce


def _net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, stride=2, padding=1),  # 10x10 -> 5x5
        nn.Tanh(),
        nn.ConvTranspose2d(4, 3, 2, stride=2),  # 5x5 -> 10x10
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(300, 5),
    )


def test_layer_footprint_counts_positions_and_factor_sizes():
    torch.manual_seed(0)
    rows = {r.layer: r for r in cc.layer_footprint(_net(), torch.randn(3, 2, 10, 10))}
    conv, tconv, lin = rows["0"], rows["2"], rows["5"]
    assert (conv.T, conv.S, conv.G, conv.n_a, conv.n_g) == (25, 100, 1, 2 * 9 + 1, 4)
    assert (conv.C, conv.K, conv.stride_prod) == (2, 9, 4)
    assert (tconv.T, tconv.S, tconv.n_g, tconv.stride_prod) == (100, 25, 3, 4)
    assert (lin.T, lin.n_a, lin.n_g, lin.K) == (1, 301, 5, 1)


@pytest.mark.parametrize("family", ["kfac", "shampoo", "shampoo-lowrank", "diagonal"])
def test_transform_macs_mirror_the_blocks_path_choice(family):
    """Per layer, the estimate equals the cheaper of the block's own two path costs (one
    elementwise product per weight for the diagonal family)."""
    torch.manual_seed(1)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 36, 3)
    )
    low = family == "shampoo-lowrank"
    family = "shampoo" if low else family
    cfg = PreconditionerConfig(
        num_probes=8,
        calibration_samples=2,
        factors="ag",
        family=family,
        rank_a=8,
        shampoo_rank=8 if low else None,
    )
    x = torch.randn(8, 2, 6, 6)
    pre = KroneckerPreconditioner.from_probes(
        model, x, torch.randint(0, 3, (8,)), per_sample_ce, cfg
    )
    rows = cc.layer_footprint(model, x)
    for r, m in zip(rows, cc.transform_macs(rows, cfg)):
        block = pre.blocks[r.layer]
        base = r.T * r.G * r.n_a * r.n_g
        assert m["raw"] == base
        if family == "diagonal":
            assert block.choose_path(1, r.T) == "materialized"
            assert m["transform"] == r.G * r.n_g * r.n_a
            continue
        factored, materialized = block.cost(1, r.T)
        assert m["transform"] == min(factored, materialized) - base
    if family == "kfac" or low:  # the Linear's 145-wide A (or R) is low-rank (rank 8)
        assert pre.blocks["3"].a_low is not None
    elif family == "shampoo":  # rank_a is a K-FAC setting
        assert pre.blocks["3"].a_low is None


def test_refresh_macs_hand_count_for_one_linear_layer():
    rows = cc.layer_footprint(nn.Linear(7, 3), torch.randn(1, 7))
    cfg = PreconditionerConfig(num_probes=10, calibration_samples=4)
    got = cc.refresh_macs(rows, cfg)
    n_a, n_g = 8, 3  # with the bias coordinate
    assert got["forward"] == 10 * n_a * n_g  # A-only: forward passes only
    assert got["factors"] == 10 * n_a * n_a
    assert got["eigh"] == cc.EIGH_MACS_PER_N3 * n_a**3
    assert got["calibration"] == 4 * (3 * n_a * n_g + n_g * n_a * n_a)
    assert got["total"] == pytest.approx(sum(v for k, v in got.items() if k != "total"))
    ag = cc.refresh_macs(rows, PreconditionerConfig(num_probes=10, factors="ag"))
    assert ag["forward"] == 3 * got["forward"]  # backward passes for G
    assert ag["eigh"] == cc.EIGH_MACS_PER_N3 * (n_a**3 + n_g**3)
    assert cc.refresh_macs(rows, PreconditionerConfig(factors="identity"))["total"] == 0


def test_refresh_macs_use_the_drawn_positions_only():
    rows = cc.layer_footprint(nn.Conv2d(1, 2, 3, padding=1), torch.randn(1, 1, 20, 20))
    few = cc.refresh_macs(rows, PreconditionerConfig(num_probes=4, max_positions=50))
    every = cc.refresh_macs(rows, PreconditionerConfig(num_probes=4, max_positions=None))
    assert few["factors"] == 4 * 50 * 10 * 10 and every["factors"] == 4 * 400 * 10 * 10


@pytest.mark.parametrize("batch", [1, 16, 4096])
def test_auto_period_is_the_shortest_power_of_two_multiple_within_budget(batch):
    rows = cc.layer_footprint(_net(), torch.randn(1, 2, 10, 10))
    cfg = PreconditionerConfig(num_probes=64)
    plan = cc.auto_refresh_every(rows, cfg, batch, budget=0.05)
    period, base = plan["refresh_every"], cc.AUTO_REFRESH_BASE
    k = math.log2(period / base)
    assert k >= 0 and k == int(k)
    refresh = cc.refresh_macs(rows, cfg)["total"]
    step = cc.STEP_MACS_WEIGHT * cc.step_macs(rows, cfg, batch)

    def share(p: int) -> float:
        return refresh / (p * step + refresh)

    assert share(period) <= 0.05 and plan["estimated_share"] == pytest.approx(share(period))
    if period > base:
        assert share(period // 2) > 0.05
    assert cc.auto_refresh_every(rows, cfg, batch, budget=0.05) == plan  # deterministic
    # larger batches make steps dearer, so refreshes may come (weakly) more often
    assert cc.auto_refresh_every(rows, cfg, 2 * batch, 0.05)["refresh_every"] <= period


def test_auto_period_rejects_a_budget_outside_zero_one():
    rows = cc.layer_footprint(nn.Linear(3, 2), torch.randn(1, 3))
    with pytest.raises(ValueError, match="refresh_budget"):
        cc.auto_refresh_every(rows, PreconditionerConfig(), 8, budget=1.5)


def _engine(**kw):
    torch.manual_seed(2)
    x, y = torch.randn(64, 2, 10, 10), torch.randint(0, 5, (64,))
    eng = PrivacyEngine(seed=0)
    model = _net()
    eng.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=16),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        delta=1e-5,
        method="dp-kfc",
        probe_source=GaussianProbes((2, 10, 10)),
        probe_loss=per_sample_ce,
        preconditioner=PreconditionerConfig(num_probes=16, calibration_samples=4),
        **kw,
    )
    return eng, model


def test_engine_auto_schedule_is_the_estimate_and_is_reported():
    eng, model = _engine()  # refresh_every="auto" is the default
    rows = cc.layer_footprint(_net(), torch.randn(1, 2, 10, 10))
    want = cc.auto_refresh_every(
        rows, PreconditionerConfig(num_probes=16, calibration_samples=4), 16, 0.05
    )
    assert eng.refresh_every == want["refresh_every"]
    prov = eng.provenance()
    assert prov["refresh_every"] == want["refresh_every"]
    assert prov["refresh_plan"]["rule"] == "auto"
    assert prov["refresh_plan"]["estimated_share"] == pytest.approx(want["estimated_share"])
    fixed, _ = _engine(refresh_every=7)
    assert fixed.refresh_every == 7 and fixed.provenance()["refresh_plan"]["rule"] == "fixed"


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"refresh_every": "weekly"}, "refresh_every"),
        ({"refresh_every": -1}, "refresh_every"),
        ({"refresh_every": 2.5}, "refresh_every"),
        ({"refresh_budget": 0.0}, "refresh_budget"),
    ],
)
def test_engine_refuses_a_bad_refresh_schedule(kw, field):
    with pytest.raises(ValueError, match=field):
        _engine(**kw)
