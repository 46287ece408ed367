"""Oracle factors: brute-force agreement, the private-data label, and refusal by training."""

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from dpkfc_med.analysis import (
    ORACLE_LABEL,
    OracleFactors,
    oracle_factors,
    probe_factors,
    role_damping,
)
from dpkfc_med.curvature import KroneckerPreconditioner, PreconditionerConfig, estimate_factors
from dpkfc_med.curvature.factors import covered_layers
from dpkfc_med.curvature.families import Family, estimate_gradient_statistics
from dpkfc_med.privacy.engine import PrivacyEngine
from dpkfc_med.probes import ImageProbeSource, ProbeSource
from tests.conftest import per_sample_ce, tiny_cnn_2d


def _private(n=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 3, (n,), generator=g)


@pytest.fixture
def oracle(float64):
    torch.manual_seed(0)
    net = tiny_cnn_2d(num_classes=3)
    x, y = _private()
    return net, x, y, oracle_factors(net, x, y, per_sample_ce, family="kfac")


def test_oracle_equals_the_preconditioner_estimator(oracle):
    net, x, y, o = oracle
    cfg = PreconditionerConfig()
    want = estimate_factors(net, x, y, per_sample_ce, max_positions=cfg.max_positions)
    assert set(o.blocks) == set(want)
    for name, f in want.items():
        torch.testing.assert_close(o.factor(name, "A"), f.a, rtol=1e-12, atol=0)
        torch.testing.assert_close(o.factor(name, "G"), f.g, rtol=1e-12, atol=0)
    assert o.layers == ("0", "2", "6")  # forward order
    assert o.num_samples == 16


@pytest.mark.parametrize("family", ["shampoo", "diagonal"])
def test_gradient_families_match_their_estimator(family, float64):
    torch.manual_seed(0)
    net = tiny_cnn_2d(num_classes=3)
    x, y = _private()
    o = oracle_factors(net, x, y, per_sample_ce, family=family)
    stats = estimate_gradient_statistics(
        net,
        x,
        y,
        per_sample_ce,
        covered_layers(net),
        Family(family),
        chunk_size=64,
        max_factor_dim=4096,
    )
    for name, st in stats.items():
        if family == "shampoo":
            torch.testing.assert_close(o.factor(name, "L"), st.left)
            torch.testing.assert_close(o.factor(name, "R"), st.right)
        else:
            torch.testing.assert_close(o.factor(name, "D"), st.second_moment.flatten(1))


def test_oracle_is_labelled_private(oracle):
    *_, o = oracle
    assert isinstance(o, OracleFactors)
    assert o.uses_private_data and o.label == ORACLE_LABEL
    assert "not DP" in ORACLE_LABEL and "private" in ORACLE_LABEL
    assert o.provenance["uses_private_data"] is True


def test_oracle_is_neither_probe_source_nor_preconditioner(oracle):
    *_, o = oracle
    assert not isinstance(o, ProbeSource)
    assert not isinstance(o, KroneckerPreconditioner)
    for name in ("sample", "describe", "transform_param_grads", "precondition_update"):
        assert not hasattr(o, name)
    with pytest.raises(AttributeError, match="never act as a probe source"):
        o.sample(4, seed=0)


def test_training_refuses_the_oracle(oracle):
    net, x, y, o = oracle
    eng = PrivacyEngine(seed=0)
    with pytest.raises(ValueError, match="OracleFactors.*ProbeSource protocol"):
        eng.make_private(
            module=net,
            optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=8),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            delta=1e-5,
            method="dp-kfc",
            probe_source=o,
            probe_loss=per_sample_ce,
        )


def test_probe_factors_refuse_data_and_oracles(oracle):
    net, x, y, o = oracle
    for bad, match in (
        (o, "OracleFactors"),
        (DataLoader(TensorDataset(x, y), batch_size=4), "DataLoader.*oracle_factors"),
        (x, "Tensor"),
        (object(), "ProbeSource protocol"),
    ):
        with pytest.raises(ValueError, match=match):
            probe_factors(net, bad, per_sample_ce)


def test_probe_factors_record_their_source(float64):
    torch.manual_seed(0)
    net = tiny_cnn_2d(num_classes=3)
    src = ImageProbeSource((8, 8), channels=1, num_classes=3, kind="white")
    p = probe_factors(net, src, per_sample_ce, num_probes=8, seed=3)
    batch = src.sample(8, seed=3, model=net, dtype=torch.float64)
    want = estimate_factors(net, batch.inputs, batch.targets, per_sample_ce, position_seed=3)
    torch.testing.assert_close(p.factor("6", "G"), want["6"].g)
    assert p.label == "white" and not p.uses_private_data
    assert p.provenance["kind"] == "white"
    with pytest.raises(KeyError, match="no layer 'nope'"):
        p.factor("nope", "A")
    with pytest.raises(KeyError, match="roles: \\('A', 'G'\\)"):
        p.factor("6", "L")


def test_role_damping_follows_the_preconditioner():
    cfg = PreconditionerConfig(damping_a=1e-3, damping_g=0.1, shampoo_exponent=0.25)
    assert role_damping("kfac", "A", cfg) == (1e-3, 0.5)
    assert role_damping("kfac", "G", cfg) == (0.1, 0.5)
    assert role_damping("shampoo", "L", cfg) == (0.1, 0.25)
    assert role_damping("shampoo", "R", cfg) == (1e-3, 0.25)
    assert role_damping("diagonal", "D", cfg) == (1e-3, 0.5)
    with pytest.raises(ValueError, match="role='A' is not a role of family 'shampoo'"):
        role_damping("shampoo", "A", cfg)
