"""Shampoo and diagonal families: probe statistics and transforms against brute force (float64)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpkfc_med.curvature import cost as cc
from dpkfc_med.curvature import families
from dpkfc_med.curvature.families import (
    CurvatureFamily,
    Family,
    estimate_gradient_statistics,
    family_spec,
    register_family,
)
from dpkfc_med.curvature.preconditioner import KroneckerPreconditioner, PreconditionerConfig
from dpkfc_med.training.config import ConfigError, load_config


def _net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.GroupNorm(1, 3),
        nn.ReLU(),
        nn.ConvTranspose2d(3, 2, 2, stride=2),
        nn.Flatten(),
        nn.Linear(2 * 8 * 8, 3),
    )


def _loss(out, y):
    return F.cross_entropy(out, y, reduction="none")


def _per_sample(model, x, y):
    """``{layer: [M, n_g, n_a]}`` by one autograd call per probe (bias as the last column)."""
    layers = {"0": model[0], "3": model[3], "5": model[5]}
    out = {k: [] for k in layers}
    for i in range(len(x)):
        loss = _loss(model(x[i : i + 1]), y[i : i + 1]).sum()
        for k, m in layers.items():
            gw, gb = torch.autograd.grad(loss, [m.weight, m.bias], retain_graph=True)
            if isinstance(m, nn.ConvTranspose2d):  # weight [C_in, C_out, k, k]: rows C_out
                w = gw.transpose(0, 1).reshape(gw.shape[1], -1)
            else:
                w = gw.reshape(gw.shape[0], -1)
            out[k].append(torch.cat([w, gb[:, None]], 1))
    return {k: torch.stack(v) for k, v in out.items()}


def _setup():
    torch.manual_seed(0)
    model = _net()
    x, y = torch.randn(10, 2, 4, 4), torch.randint(0, 3, (10,))
    return model, x, y


def test_statistics_equal_brute_force(float64):
    model, x, y = _setup()
    layers = {"0": model[0], "3": model[3], "5": model[5]}
    brute = _per_sample(model, x, y)
    shampoo = estimate_gradient_statistics(
        model, x, y, _loss, layers, Family.SHAMPOO, chunk_size=4, max_factor_dim=200
    )
    diag = estimate_gradient_statistics(
        model, x, y, _loss, layers, Family.DIAGONAL, chunk_size=3, max_factor_dim=200
    )
    for k, g in brute.items():
        # ConvTranspose adapters order their columns like the adapter, not like this helper:
        # compare order-free quantities for it, everything for the others
        st = shampoo[k]
        left = torch.einsum("moi,mpi->op", g, g) / len(g)
        torch.testing.assert_close(st.left[0], left, msg=k)
        right = torch.einsum("moi,moj->ij", g, g) / len(g)
        if k != "3":
            torch.testing.assert_close(st.right[0], right, msg=k)
            torch.testing.assert_close(diag[k].second_moment[0], g.pow(2).mean(0), msg=k)
        torch.testing.assert_close(torch.trace(st.right[0]), torch.trace(right), msg=k)
        torch.testing.assert_close(diag[k].second_moment[0].sum(), g.pow(2).mean(0).sum(), msg=k)
    wide = estimate_gradient_statistics(
        model, x, y, _loss, {"5": model[5]}, Family.SHAMPOO, chunk_size=10, max_factor_dim=50
    )["5"]
    assert wide.right.shape == (1, 129)  # a side wider than max_factor_dim keeps its diagonal
    torch.testing.assert_close(wide.right[0], brute["5"].pow(2).sum(1).mean(0))


def _root(f: torch.Tensor, damping: float, power: float) -> torch.Tensor:
    """``(F + damping * mean_eig I)^{-power}`` by an independent eigendecomposition."""
    n = f.shape[-1]
    lam, vec = torch.linalg.eigh(f + damping * torch.trace(f) / n * torch.eye(n))
    return vec @ torch.diag(lam.clamp_min(damping * torch.trace(f) / n) ** -power) @ vec.T


def test_shampoo_and_diagonal_blocks_are_the_damped_roots(float64):
    model, x, y = _setup()
    layers = {"0": model[0], "5": model[5]}
    brute = _per_sample(model, x, y)
    cfg = PreconditionerConfig(family="shampoo", damping_a=0.05, damping_g=0.2)
    pre = KroneckerPreconditioner.from_probes(model, x, y, _loss, cfg)
    for k in layers:
        g = brute[k]
        block = pre.blocks[k]
        left = torch.einsum("moi,mpi->op", g, g) / len(g)
        right = torch.einsum("moi,moj->ij", g, g) / len(g)
        torch.testing.assert_close(block.u_g[0], _root(left, 0.2, 0.25), msg=k)
        torch.testing.assert_close(block.u_a[0], _root(right, 0.05, 0.25), msg=k)
        # the transform is s L^-1/4 g R^-1/4 of each per-sample gradient
        want = block.scale * block.u_g[0] @ g @ block.u_a[0]
        torch.testing.assert_close(block.transform_grads(g[:, None])[:, 0], want)
    row = {r["layer"]: r for r in pre.coverage()}["0"]
    assert row["family"] == "shampoo" and row["A"] == row["G"] == "full"
    cfg = PreconditionerConfig(family="diagonal", damping_a=0.01)
    pre = KroneckerPreconditioner.from_probes(model, x, y, _loss, cfg)
    for k in layers:
        v = brute[k].pow(2).mean(0)
        torch.testing.assert_close(pre.blocks[k].u_elem[0], (v + 0.01 * v.mean()).rsqrt())
    # every parameter is preconditioned: the norm affine gets the diagonal fallback
    assert all(fb.diag is not None for fb in pre.fallbacks.values()) and pre.fallbacks
    row = {r["layer"]: r for r in pre.coverage()}["0"]
    assert row["family"] == "diagonal" and row["A"] == "elementwise"


def test_family_is_a_config_field_with_a_clear_error(tmp_path):
    cfg = tmp_path / "c.yaml"
    root = __import__("pathlib").Path(__file__).resolve().parents[2]
    cfg.write_text(
        (root / "configs" / "pneumoniamnist_cnn_2d_eps1.yaml").read_text(encoding="utf-8"),
        encoding="utf-8",
    )
    assert load_config(cfg, ["preconditioner.family=shampoo"]).preconditioner_config().family
    with pytest.raises(ConfigError, match=r"preconditioner.family.*'kfac', 'shampoo', 'diagonal'"):
        load_config(cfg, ["preconditioner.family=adam"])


def _grouped_net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.GroupNorm(2, 4),
        nn.Conv2d(4, 4, 3, padding=1, groups=2),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 3),
    )


@pytest.mark.parametrize(
    "settings",
    [
        {"family": "kfac", "factors": "ag"},
        {"family": "kfac", "rank_a": 4},
        {"family": "kfac", "conv_a": "kron"},
        {"family": "kfac", "max_factor_dim": 8},  # wide factors kept as diagonals
        {"family": "shampoo"},
        {"family": "shampoo", "shampoo_rank": 3},
        {"family": "diagonal", "fallback": "diagonal"},
    ],
    ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()),
)
def test_every_block_transform_equals_its_explicit_operator(settings, float64):
    """dense() (built from the factors) times vec(g) equals transform_grads(g), for every
    family and U_A form, grouped convolutions included; fallbacks likewise."""
    torch.manual_seed(3)
    model = _grouped_net()
    x, y = torch.randn(12, 2, 4, 4), torch.randint(0, 3, (12,))
    pre = KroneckerPreconditioner.from_probes(model, x, y, _loss, PreconditionerConfig(**settings))
    assert set(pre.blocks) == {"0", "2", "5"}
    if settings.get("conv_a") == "kron":
        assert pre.blocks["0"].a_kron is not None
    if settings.get("rank_a"):
        assert pre.blocks["0"].a_low is not None
    for name, block in pre.blocks.items():
        groups, n_a, n_g = block.dims
        g = torch.randn(5, groups, n_g, n_a)
        want = torch.einsum("ij,bj->bi", block.dense(), g.reshape(5, -1))
        torch.testing.assert_close(block.transform_grads(g).reshape(5, -1), want, msg=name)
        factored, materialized = block.cost(5, 16)
        assert factored > 0 and materialized > 0
    assert pre.fallbacks  # the GroupNorm affine
    for fb in pre.fallbacks.values():
        g = torch.randn(5, *fb.param.shape)
        want = torch.einsum("ij,bj->bi", fb.dense(), g.reshape(5, -1))
        torch.testing.assert_close(fb.transform(g).reshape(5, -1), want, msg=fb.name)


def test_low_rank_shampoo_right_factor_is_top_eigenpairs_plus_mean_tail(float64):
    """shampoo_rank r: R^{-p} keeps R's top r eigenpairs; the tail shares its mean eigenvalue."""
    model, x, y = _setup()
    brute = _per_sample(model, x, y)
    cfg = PreconditionerConfig(family="shampoo", damping_a=0.05, shampoo_rank=4)
    pre = KroneckerPreconditioner.from_probes(model, x, y, _loss, cfg)
    g = brute["5"]  # the Linear: R is 129 x 129
    right = torch.einsum("moi,moj->ij", g, g) / len(g)
    lam, vec = torch.linalg.eigh(right)
    lam = lam.clamp_min(0)
    lam = lam + 0.05 * lam.mean()
    tail = lam[:-4].mean()
    want = (
        tail**-0.25 * torch.eye(len(lam))
        + (vec[:, -4:] * (lam[-4:] ** -0.25 - tail**-0.25)) @ vec[:, -4:].T
    )
    block = pre.blocks["5"]
    assert block.a_low is not None and block.a_low.rank == 4 and block.u_a is None
    torch.testing.assert_close(block.a_low.dense()[0], want)
    row = {r["layer"]: r for r in pre.coverage()}["5"]
    assert row["A"] == "rank 4 + tail"


def test_built_in_families_are_registry_entries():
    assert families.registered_families() == ("kfac", "shampoo", "diagonal")
    kfac, shampoo, diagonal = (family_spec(f) for f in Family)
    assert (kfac.statistics, kfac.rank_key, kfac.kron_conv) == (None, "rank_a", True)
    assert (shampoo.rank_key, shampoo.cost_factors, shampoo.elementwise) == (
        "shampoo_rank",
        "ag",
        False,
    )
    assert diagonal.elementwise and diagonal.rank_key is None
    assert family_spec("Shampoo") is shampoo and family_spec(Family.DIAGONAL) is diagonal
    with pytest.raises(ValueError, match=r"preconditioner.family='shampo'.*did you mean"):
        family_spec("shampo")
    with pytest.raises(ValueError, match="'shampoo' is registered twice"):
        register_family(CurvatureFamily("shampoo"))


def test_a_new_family_is_one_registration(monkeypatch, float64):
    """A family registered under a new name with Shampoo's pieces is a valid config value and
    gives Shampoo's preconditioner, coverage and cost estimate, with no other change."""
    monkeypatch.setattr(families, "_FAMILIES", dict(families._FAMILIES))
    shampoo = family_spec("shampoo")
    register_family(
        CurvatureFamily(
            "shampoo_twin",
            statistics=shampoo.statistics,
            rank_key=shampoo.rank_key,
            cost_factors=shampoo.cost_factors,
        )
    )
    model, x, y = _setup()
    built = {}
    for name in ("shampoo", "shampoo_twin"):
        cfg = PreconditionerConfig(family=name, shampoo_rank=4, calibration_samples=4)
        assert cfg.family == name
        pre = KroneckerPreconditioner.from_probes(model, x, y, _loss, cfg)
        rows = cc.layer_footprint(model, x)
        built[name] = (pre, cc.transform_macs(rows, cfg))
    (ref, ref_macs), (twin, twin_macs) = built["shampoo"], built["shampoo_twin"]
    assert twin_macs == ref_macs
    assert {r["family"] for r in twin.coverage()} == {"shampoo_twin"}
    for name, block in ref.blocks.items():
        torch.testing.assert_close(twin.blocks[name].dense(), block.dense(), msg=name)
