"""Privacy contract: Opacus equivalence, sensitivity, data independence, accounting, errors."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from opacus import PrivacyEngine as OpacusEngine
from opacus.accountants import PRVAccountant, RDPAccountant
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpkfc_med.curvature.preconditioner import PreconditionerConfig
from dpkfc_med.privacy.accounting import (
    RDP_ALPHAS,
    GaussianSteps,
    PrivacyLedger,
    calibrate_noise_multiplier,
    epsilon_for,
)
from dpkfc_med.privacy.engine import PrivacyEngine
from dpkfc_med.privacy.grad_sample import raw_norm_samples
from dpkfc_med.privacy.optimizer import BudgetExhaustedError
from dpkfc_med.privacy.rng import SecurePoissonSampler, secure_normal
from tests.conftest import GaussianProbes, per_sample_ce, summed_clipped, tiny_cnn_2d, tiny_cnn_3d


def _data(n=64, shape=(1, 8, 8), classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, *shape, generator=g), torch.randint(0, classes, (n,), generator=g)


def _engine(method, model, x, y, *, batch=16, sigma=1.0, seed=3, **kw):
    eng = PrivacyEngine(seed=seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = eng.make_private(
        module=model,
        optimizer=opt,
        data_loader=DataLoader(TensorDataset(x, y), batch_size=batch),
        noise_multiplier=sigma,
        max_grad_norm=1.0,
        delta=1e-5,
        method=method,
        probe_source=GaussianProbes(tuple(x.shape[1:])),
        probe_loss=per_sample_ce,
        **kw,
    )
    return eng, out


def _one_step(pm, popt, x, y):
    popt.zero_grad()
    F.cross_entropy(pm(x), y).backward()
    popt.step()


def _opacus_step(model, x, y):
    """One step of Opacus' own PrivacyEngine (noise seed 11) on the first 20 samples."""
    om, oopt, _ = OpacusEngine(accountant="prv").make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=16),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        noise_generator=torch.Generator().manual_seed(11),
    )
    _one_step(om, oopt, x[:20], y[:20])


def test_dp_sgd_step_equals_opacus(float64):
    """Convolutions' per-sample gradients come from the layer adapter: Opacus' to rounding."""
    torch.manual_seed(0)
    base = tiny_cnn_2d()
    x, y = _data()
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    _, (pm, popt, _) = _engine("dp-sgd", ours, x, y, seed=11)
    _one_step(pm, popt, x[:20], y[:20])
    _opacus_step(theirs, x, y)
    for p, q in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)


def test_dp_sgd_step_of_linear_and_norm_layers_equals_opacus_bitwise():
    """Linear and normalisation layers keep Opacus' own formulas: the step is Opacus' bit for
    bit."""
    torch.manual_seed(0)
    base = nn.Sequential(
        nn.Flatten(), nn.Linear(64, 16), nn.GroupNorm(4, 16), nn.Tanh(), nn.Linear(16, 3)
    )
    x, y = _data()
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    _, (pm, popt, _) = _engine("dp-sgd", ours, x, y, seed=11, clipping="per_sample")
    _one_step(pm, popt, x[:20], y[:20])
    _opacus_step(theirs, x, y)
    for p, q in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(p, q)


def test_identity_preconditioner_step_equals_opacus(float64):
    torch.manual_seed(0)
    base = tiny_cnn_2d()
    x, y = _data()
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    cfg = PreconditionerConfig(factors="identity", scaling="none")
    _, (pm, popt, _) = _engine("dp-kfc", ours, x, y, seed=11, preconditioner=cfg)
    # the dp-kfc path (our hooks, fallback stage) is active even though every factor is I
    assert popt.preconditioner is not None and all(
        b.u_a is None for b in popt.preconditioner.blocks.values()
    )
    _one_step(pm, popt, x[:20], y[:20])
    _opacus_step(theirs, x, y)
    for p, q in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)


def _summed_clipped(popt, pm, x, y, units=None):
    """Clipped per-unit sum for a sum-reduced cross-entropy batch."""
    return summed_clipped(
        popt, lambda: F.cross_entropy(pm(x), y, reduction="sum").backward(), units
    )


@pytest.mark.parametrize("method", ["dp-sgd", "dp-kfc", "dp-kfc-shampoo", "dp-kfc-diagonal"])
def test_empirical_sensitivity_add_remove_replace(method, float64):
    torch.manual_seed(1)
    x, y = _data(40)
    kw = {}
    if method.startswith("dp-kfc-"):  # a preconditioner family other than K-FAC
        method, kw = "dp-kfc", {"preconditioner": PreconditionerConfig(family=method[7:])}
    _, (pm, popt, _) = _engine(method, tiny_cnn_2d(), x, y, loss_reduction="sum", **kw)
    base = _summed_clipped(popt, pm, x[:30], y[:30])
    x_other, y_other = _data(1, seed=99)
    neighbours = {
        "add": (torch.cat([x[:30], x_other * 50]), torch.cat([y[:30], y_other])),
        "remove": (x[:29], y[:29]),
        "replace": (torch.cat([x[:29], x_other * 50]), torch.cat([y[:29], y_other])),
    }
    for kind, (xn, yn) in neighbours.items():
        diff = (_summed_clipped(popt, pm, xn, yn) - base).norm()
        bound = 2.0 if kind == "replace" else 1.0  # replace = remove + add
        assert diff <= bound * 1.0 + 1e-9, f"{kind}: moved by {diff:.4f} > {bound}"
        assert diff > 1e-3  # the neighbour actually changed something


def test_sensitivity_per_patient_units(float64):
    """Removing a patient with k=3 patches moves the clipped sum by at most C."""
    torch.manual_seed(2)
    x, y = _data(30, shape=(1, 4, 8, 8), classes=2)
    _, (pm, popt, _) = _engine("dp-kfc", tiny_cnn_3d(), x, y, loss_reduction="sum")
    units = torch.arange(10).repeat_interleave(3)  # 10 patients x 3 patches
    base = _summed_clipped(popt, pm, x * 20, y, units)
    removed = _summed_clipped(popt, pm, x[:27] * 20, y[:27], units[:27])
    assert (base - removed).norm() <= 1.0 + 1e-9
    # clipping patches separately instead would let one patient move the sum by up to 3C
    per_patch = _summed_clipped(popt, pm, x * 20, y, None) - _summed_clipped(
        popt, pm, x[:27] * 20, y[:27], None
    )
    assert per_patch.norm() > 1.0 + 1e-6


@pytest.mark.parametrize("family", ["kfac", "shampoo", "diagonal"])
def test_preconditioner_independent_of_private_data(family, float64):
    torch.manual_seed(3)
    base = tiny_cnn_2d()
    pres = []
    for seed in (0, 1):
        x, y = _data(48, seed=seed)
        model = copy.deepcopy(base)
        cfg = PreconditionerConfig(factors="ag", family=family)
        eng, _ = _engine("dp-kfc", model, x, y, probe_seed=5, preconditioner=cfg)
        pres.append(eng.preconditioner)
    for name in pres[0].blocks:
        a, b = pres[0].blocks[name], pres[1].blocks[name]
        for field in ("u_a", "u_g", "u_elem"):
            u, v = getattr(a, field), getattr(b, field)
            assert (u is None and v is None) or torch.equal(u, v), (name, field)
        assert a.scale == b.scale
        assert (a.u_elem is not None) == (family == "diagonal")
        assert (a.u_g is not None) == (family != "diagonal")
    for name, fb in pres[0].fallbacks.items():
        other = pres[1].fallbacks[name]
        assert fb.scale == other.scale
        assert (fb.diag is None and other.diag is None) or torch.equal(fb.diag, other.diag)


def test_refresh_schedule_and_ledger(tmp_path):
    torch.manual_seed(4)
    x, y = _data(64)
    eng, (pm, popt, loader) = _engine(
        "dp-kfc",
        tiny_cnn_2d(),
        x,
        y,
        refresh_every=2,
        probe_seed=7,
        ledger_path=tmp_path / "ledger.json",
    )
    for _ in range(5):
        _one_step(pm, popt, x[:16], y[:16])
    assert [r["step"] for r in eng.refreshes] == [0, 2, 4]
    assert [r["probe_seed"] for r in eng.refreshes] == [7, 8, 9]
    led = PrivacyLedger.load(tmp_path / "ledger.json")
    assert led.steps == 5 and led.events[0].sample_rate == pytest.approx(16 / 64)
    d = popt.last_diagnostics
    assert 0 <= d.clipped_fraction <= 1 and d.median_raw_norm > 0
    assert sum(d.layer_share.values()) == pytest.approx(1.0)


def test_ledger_matches_opacus_and_independent_accountant():
    q, sigma, steps, delta = 0.01, 1.1, 300, 1e-5
    led = PrivacyLedger(delta)
    led.record(q, sigma, steps)
    prv, rdp = PRVAccountant(), RDPAccountant()
    for acc in (prv, rdp):
        acc.history = [(sigma, q, steps)]
    assert led.epsilon("prv") == prv.get_epsilon(delta)
    assert led.epsilon("rdp") == rdp.get_epsilon(delta, alphas=RDP_ALPHAS)
    assert led.epsilon("rdp") == rdp.get_epsilon(delta)  # optimum inside Opacus' default orders
    assert led.epsilon("pld") == pytest.approx(led.epsilon("prv"), rel=0.05)
    assert led.all_epsilons()["max"] >= led.epsilon("prv")


def test_rdp_cross_check_searches_orders_above_opacus_defaults():
    """Large noise, few steps: the best RDP order is above Opacus' default maximum (63)."""
    import warnings

    q, sigma, delta = 0.05, 10.0, 1e-5
    default = RDPAccountant()
    default.history = [(sigma, q, 1)]
    with pytest.warns(UserWarning, match="largest alpha"):
        eps_default = default.get_epsilon(delta)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # neither our RDP nor our PRV call warns
        eps = epsilon_for([GaussianSteps(q, sigma, 1)], delta, "rdp")
        epsilon_for([GaussianSteps(q, sigma, 1)], delta, "prv")
    _, best_order = default.get_privacy_spent(delta=delta, alphas=RDP_ALPHAS)
    assert 63 < best_order < max(RDP_ALPHAS)
    assert 0 < eps < eps_default / 5


def test_noise_calibration_never_exceeds_target():
    sigma = calibrate_noise_multiplier(target_epsilon=1.0, delta=1e-5, sample_rate=0.05, steps=100)
    assert epsilon_for([GaussianSteps(0.05, sigma, 100)], 1e-5) <= 1.0
    assert epsilon_for([GaussianSteps(0.05, sigma * 0.95, 100)], 1e-5) > 0.97


def test_plan_is_enforced():
    torch.manual_seed(5)
    x, y = _data(32)
    eng = PrivacyEngine(seed=0)
    model = tiny_cnn_2d()
    pm, popt, _ = eng.make_private_with_epsilon(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=8),
        target_epsilon=3.0,
        delta=1e-5,
        steps=2,
        max_grad_norm=1.0,
        method="dp-sgd",
    )
    _one_step(pm, popt, x[:8], y[:8])
    _one_step(pm, popt, x[:8], y[:8])
    with pytest.raises(BudgetExhaustedError, match="covers 2 noisy steps"):
        _one_step(pm, popt, x[:8], y[:8])
    assert eng.get_epsilon() <= 3.0


def test_secure_rng():
    ref = torch.zeros(200_000)
    noise = secure_normal(2.0, ref)
    assert abs(float(noise.mean())) < 0.03 and abs(float(noise.std()) - 2.0) < 0.03
    sampler = SecurePoissonSampler(num_samples=1000, sample_rate=0.1, steps=20)
    sizes = [len(b) for b in sampler]
    assert len(sizes) == 20 and 80 < sum(sizes) / 20 < 120
    with pytest.raises(ValueError, match="secure_rng"):
        PrivacyEngine(secure_mode=True, seed=1)


def test_secure_mode_trains():
    torch.manual_seed(6)
    x, y = _data(32)
    eng = PrivacyEngine(secure_mode=True)
    model = tiny_cnn_2d()
    pm, popt, loader = eng.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=8),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        delta=1e-5,
        method="dp-sgd",
    )
    before = [p.clone() for p in model.parameters()]
    for xb, yb in loader:
        _one_step(pm, popt, xb, yb)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert eng.ledger.steps == len(loader)


def test_batchnorm_model_rejected_with_fix():
    model = nn.Sequential(
        nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.ReLU(inplace=True), nn.Flatten(), nn.Linear(72, 2)
    )
    x, y = _data(8)
    with pytest.raises(
        ValueError, match=r"1: BatchNorm2d mixes samples.*make_private_compatible"
    ) as err:
        _engine("dp-sgd", model, x, y)
    assert "2: ReLU(inplace=True)" in str(err.value)  # all problems in one error


def test_probe_shape_mismatch_rejected():
    x, y = _data(8)
    eng = PrivacyEngine(seed=0)
    model = tiny_cnn_2d()
    with pytest.raises(ValueError, match=r"probe inputs have shape \[1, 9, 9\].*\[1, 8, 8\]"):
        eng.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=4),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            delta=1e-5,
            method="dp-kfc",
            probe_source=GaussianProbes((1, 9, 9)),
            probe_loss=per_sample_ce,
        )


def test_unsupported_layer_named():
    from dpkfc_med.curvature.factors import estimate_factors

    layer = nn.Bilinear(2, 2, 2)
    with pytest.raises(ValueError, match=r"'bil'.*Bilinear.*no curvature adapter"):
        estimate_factors(
            layer, torch.randn(2, 2), torch.zeros(2), per_sample_ce, layers={"bil": layer}
        )


def test_fallback_parameters_stay_inside_clipped_norm(float64):
    """A raw nn.Parameter (position-embedding style) gets the fallback and is clipped."""

    class WithPos(nn.Module):
        def __init__(self):
            super().__init__()
            self.pos = nn.Parameter(torch.zeros(1, 8, 8))
            self.fc = nn.Linear(64, 3)

        def forward(self, x):
            return self.fc((x[:, 0] + self.pos).flatten(1))

    torch.manual_seed(7)
    x, y = _data(16)
    eng, (pm, popt, _) = _engine("dp-kfc", WithPos(), x, y, loss_reduction="sum")
    assert "pos" in eng.preconditioner.fallbacks
    popt.zero_grad()
    F.cross_entropy(pm(x * 100), y, reduction="sum").backward()
    grads = [popt._per_unit(popt._get_flat_grad_sample(p)) for p in popt.params]
    popt.clip_and_accumulate()
    total = torch.cat([p.summed_grad.flatten() for p in popt.params])
    assert total.norm() <= 16 * 1.0 + 1e-9
    assert any(g.abs().sum() > 0 for g in grads[:1])


def test_dp_sgd_conv_transpose_matches_functorch_and_dp_kfc_path(float64):
    """ConvTranspose: DP-SGD uses Opacus' functorch path; identity DP-KFC must agree with it."""
    torch.manual_seed(8)

    def net():
        return nn.Sequential(
            nn.Conv2d(1, 2, 3, stride=2, padding=1),
            nn.Tanh(),
            nn.ConvTranspose2d(2, 2, 2, stride=2),
            nn.Flatten(),
            nn.Linear(2 * 8 * 8, 3),
        )

    base = net()
    x, y = _data(24)
    grads = []
    for method, kw in (
        ("dp-sgd", {}),
        ("dp-kfc", {"preconditioner": PreconditionerConfig(factors="identity", scaling="none")}),
    ):
        model = copy.deepcopy(base)
        _, (pm, popt, _) = _engine(method, model, x, y, loss_reduction="sum", **kw)
        popt.zero_grad()
        F.cross_entropy(pm(x[:6]), y[:6], reduction="sum").backward()
        grads.append([p.grad_sample.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_singular_factor_inverse_root():
    """Factors with many exactly-zero rows (padding-only conv taps) must not break eigh."""
    from dpkfc_med.curvature.preconditioner import inverse_sqrt

    f = torch.zeros(1, 50, 50, dtype=torch.float64)
    v = torch.randn(5, 3, dtype=torch.float64)
    f[0, :5, :5] = v @ v.T
    u = inverse_sqrt(f, 0.1)
    mean = torch.diagonal(f[0]).mean()
    torch.testing.assert_close(torch.linalg.inv(u[0] @ u[0]), f[0] + 0.1 * mean * torch.eye(50))


@pytest.mark.parametrize(
    "cfg",
    [
        PreconditionerConfig("ag"),
        PreconditionerConfig("a", conv_a="kron"),
        PreconditionerConfig("ag", max_factor_dim=8),  # diagonal factors
        PreconditionerConfig("ag", rank_a=4),  # low-rank U_A (every layer: n_a > 8)
        PreconditionerConfig(family="shampoo"),
        PreconditionerConfig(family="shampoo", max_factor_dim=8),  # diagonal R of wide layers
        PreconditionerConfig(family="diagonal"),
    ],
    ids=["ag", "kron", "diagonal", "lowrank", "shampoo", "shampoo-diag", "family-diagonal"],
)
@pytest.mark.parametrize("chunks", ["single", "quarters", "per-sample"])
def test_chunked_sampler_equals_transform_of_autograd_per_sample_grads(
    cfg, chunks, float64, monkeypatch
):
    """Covered layers' grad_sample = s U_G g_i U_A of brute-force per-sample gradients.

    40 samples run through the sampler in one chunk, in chunks of 16, 16, 8 or one sample
    at a time (a chunk's row budget below one sample's rows); the raw norms kept for
    diagnostics (first 40 // 16 samples, in one or two chunks) are the untransformed
    per-sample norms.
    """
    if chunks != "single":
        monkeypatch.setattr("dpkfc_med.privacy.grad_sample.SINGLE_CHUNK_ELEMENTS", 0)
    if chunks == "per-sample":
        monkeypatch.setattr("dpkfc_med.privacy.grad_sample.CHUNK_ELEMENTS", 1)
    torch.manual_seed(9)
    model = tiny_cnn_2d()
    plain = copy.deepcopy(model)  # brute force runs without Opacus hooks
    x, y = _data(40)
    eng, (pm, popt, _) = _engine("dp-kfc", model, x, y, loss_reduction="sum", preconditioner=cfg)
    popt.zero_grad()
    F.cross_entropy(pm(x), y, reduction="sum").backward()
    assert len(eng.preconditioner.blocks) >= 2
    for name, block in eng.preconditioner.blocks.items():
        module = block.module
        params = list(module.parameters(recurse=False))
        twin = dict(plain.named_modules())[name]
        per_sample = [
            torch.autograd.grad(
                F.cross_entropy(plain(x[i : i + 1]), y[i : i + 1]),
                list(twin.parameters(recurse=False)),
            )
            for i in range(len(x))
        ]
        raw = block.adapter.from_params(
            module, {p: torch.stack([g[j] for g in per_sample]) for j, p in enumerate(params)}
        )
        want = block.adapter.to_params(module, block.transform_grads(raw))
        for p in params:
            torch.testing.assert_close(p.grad_sample, want[p], msg=name)
        m = raw_norm_samples(len(x))
        assert m == 2  # one in 16 of the batch
        torch.testing.assert_close(pm.raw_norms_sq[module], raw[:m].pow(2).flatten(1).sum(1))
        assert not hasattr(module, "_dpkfc_raw_sq")  # nothing is stored on the modules


@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular"])
def test_dp_sgd_per_sample_grads_of_padded_convs_match_autograd(mode, float64):
    """DP-SGD's per-sample gradients of a conv that pads by ``mode`` (not zeros) equal
    brute-force autograd (Opacus' own conv formula pads with zeros whatever the mode)."""
    torch.manual_seed(4)
    model = nn.Sequential(
        nn.Conv2d(1, 3, 3, padding=1, padding_mode=mode),
        nn.Tanh(),
        nn.Conv2d(3, 2, 3, padding="same", dilation=2, padding_mode=mode, bias=False),
        nn.Flatten(),
        nn.Linear(2 * 8 * 8, 3),
    )
    plain = copy.deepcopy(model)
    x, y = _data(6)
    _, (pm, popt, _) = _engine("dp-sgd", model, x, y, loss_reduction="sum")
    popt.zero_grad()
    F.cross_entropy(pm(x), y, reduction="sum").backward()
    for (name, p), twin in zip(model.named_parameters(), plain.parameters()):
        want = torch.stack(
            [
                torch.autograd.grad(F.cross_entropy(plain(x[i : i + 1]), y[i : i + 1]), twin)[0]
                for i in range(len(x))
            ]
        )
        torch.testing.assert_close(p.grad_sample, want, msg=name)


def test_dp_sgd_per_sample_grads_of_3d_convs_come_from_the_kernel(float64, monkeypatch):
    """DP-SGD's 3D convolutions with several input channels per group take their per-sample
    gradients from the layer's own kernel (not Opacus' unfold) and equal brute-force autograd;
    a 3D convolution on one input channel takes the adapter's rows, and no convolution goes
    through Opacus' formula."""
    from dpkfc_med.privacy import grad_sample

    torch.manual_seed(5)
    model = nn.Sequential(
        nn.Conv3d(1, 4, 3, padding=1),
        nn.Tanh(),
        nn.Conv3d(4, 4, 3, stride=2, padding=1, groups=2),
        nn.Tanh(),
        nn.Conv3d(4, 3, 3, padding=1, bias=False),
        nn.Flatten(),
        nn.Linear(3 * 3 * 3 * 3, 3),
    )
    plain = copy.deepcopy(model)
    x = torch.randn(5, 1, 6, 6, 6)
    y = torch.randint(0, 3, (5,))
    opacus_conv3d = grad_sample._OPACUS_SAMPLERS[nn.Conv3d]
    seen = []

    def counted(module, activations, backprops):
        seen.append(module.in_channels)
        return opacus_conv3d(module, activations, backprops)

    kernel_seen = []
    adapter_for = grad_sample.adapter_for

    def spying(module):  # the layer kernel's per-sample gradients, counted
        ad = adapter_for(module)
        if ad is None or ad.per_sample_grads is None:
            return ad

        def spy(mod, xs, dy, kernel=ad.per_sample_grads):
            kernel_seen.append(mod.in_channels // mod.groups)
            return kernel(mod, xs, dy)

        return dataclasses.replace(ad, per_sample_grads=spy)

    monkeypatch.setitem(grad_sample._OPACUS_SAMPLERS, nn.Conv3d, counted)
    monkeypatch.setattr(grad_sample, "adapter_for", spying)
    _, (pm, popt, _) = _engine("dp-sgd", model, x, y, loss_reduction="sum", clipping="per_sample")
    popt.zero_grad()
    F.cross_entropy(pm(x), y, reduction="sum").backward()
    assert seen == []  # no convolution used Opacus' unfold
    assert sorted(kernel_seen) == [2, 4]  # the kernel for the several-channel layers only
    for (name, p), twin in zip(model.named_parameters(), plain.parameters()):
        want = torch.stack(
            [
                torch.autograd.grad(F.cross_entropy(plain(x[i : i + 1]), y[i : i + 1]), twin)[0]
                for i in range(len(x))
            ]
        )
        torch.testing.assert_close(p.grad_sample, want, msg=name)


def test_empty_poisson_batch_is_a_pure_noise_step(float64):
    """Poisson sampling can draw no sample: every sampler copes and the step is noise only."""
    updates = {}
    for name, cfg in [
        ("dp-sgd", None),
        ("dp-kfc", PreconditionerConfig()),
        ("kron", PreconditionerConfig(conv_a="kron")),
    ]:
        model = tiny_cnn_2d()
        x, y = _data(40)
        kw = {"preconditioner": cfg} if cfg else {}
        _, (pm, popt, _) = _engine("dp-sgd" if cfg is None else "dp-kfc", model, x, y, **kw)
        before = [p.detach().clone() for p in pm.parameters()]
        popt.zero_grad()
        F.cross_entropy(pm(x[:0]), y[:0], reduction="sum").backward()
        popt.step()
        updates[name] = [p.detach() - b for p, b in zip(pm.parameters(), before)]
        assert all(bool((u != 0).all()) for u in updates[name]), name
    for name in ("dp-kfc", "kron"):  # same seed, no data: the same noise
        for u, v in zip(updates[name], updates["dp-sgd"]):
            torch.testing.assert_close(u, v)


@pytest.mark.parametrize("factors", ["a", "ag"])
def test_natural_step_is_the_preconditioner_times_the_released_average(factors, float64):
    """step="natural": the update is s U_G avg U_A of the transformed step's released average."""
    torch.manual_seed(7)
    base = tiny_cnn_2d()
    x, y = _data()
    updates, pres = {}, {}
    for step in ("transformed", "natural"):
        model = copy.deepcopy(base)
        cfg = PreconditionerConfig(factors=factors, step=step, fallback="diagonal")
        eng, (pm, popt, _) = _engine("dp-kfc", model, x, y, seed=11, preconditioner=cfg)
        _one_step(pm, popt, x[:20], y[:20])
        updates[step] = [(q - p) / 0.1 for p, q in zip(model.parameters(), base.parameters())]
        pres[step] = eng.preconditioner
    pre = pres["natural"]
    for name in pre.blocks:  # same probes and parameters: the same preconditioner
        assert torch.equal(pre.blocks[name].u_a, pres["transformed"].blocks[name].u_a)
    avg = dict(zip(base.parameters(), updates["transformed"]))
    got = dict(zip(base.parameters(), updates["natural"]))
    names = dict(base.named_modules())
    for name, block in pre.blocks.items():
        mod = names[name]
        w = avg[mod.weight].reshape(mod.weight.shape[0], -1)
        x_mat = torch.cat([w, avg[mod.bias][:, None]], 1) if mod.bias is not None else w
        u_g = block.u_g[0] if block.u_g is not None else torch.eye(x_mat.shape[0])
        want = block.scale * u_g @ x_mat @ block.u_a[0]
        torch.testing.assert_close(
            got[mod.weight].reshape(w.shape), want[:, : w.shape[1]], rtol=1e-9, atol=1e-12
        )
        if mod.bias is not None:
            torch.testing.assert_close(got[mod.bias], want[:, -1], rtol=1e-9, atol=1e-12)
    params = dict(base.named_parameters())
    for name, fb in pre.fallbacks.items():  # GroupNorm affine: diagonal fallback, same scale
        p = params[name]
        torch.testing.assert_close(got[p], fb.scale * fb.diag * avg[p], rtol=1e-9, atol=1e-12)
    assert len(pre.fallbacks) == 2 and not torch.allclose(
        updates["natural"][0], avg[base[0].weight]
    )


def test_natural_step_refused_with_adambc():
    from dpkfc_med.training.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError, match=r"preconditioner.step='natural'.*adambc"):
        config_from_dict(
            {
                "data": {"path": "pneumoniamnist"},
                "training": {"optimizer": "adambc"},
                "preconditioner": {"step": "natural"},
            }
        )
    with pytest.raises(ValueError, match="preconditioner.step='nat'"):
        PreconditionerConfig(step="nat")


def test_natural_step_refused_with_dpadambc_in_the_library():
    from dpkfc_med.privacy.adambc import DPAdamBC

    x, y = _data()
    model = tiny_cnn_2d()
    with pytest.raises(ValueError, match="step='natural' with DPAdamBC"):
        PrivacyEngine(seed=0).make_private(
            module=model,
            optimizer=DPAdamBC(model.parameters(), lr=0.01),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=16),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            delta=1e-5,
            method="dp-kfc",
            probe_source=GaussianProbes(tuple(x.shape[1:])),
            probe_loss=per_sample_ce,
            preconditioner=PreconditionerConfig(step="natural"),
        )


def test_layer_snr_is_clipped_sum_norm_over_expected_noise_norm(float64):
    """Per-layer SNR against a brute-force recomputation from the clipped per-sample sum."""
    torch.manual_seed(5)
    x, y = _data(32)
    model = tiny_cnn_2d()
    _, (pm, popt, _) = _engine("dp-kfc", model, x, y, sigma=1.7)

    def backward():
        F.cross_entropy(pm(x[:12]), y[:12]).backward()

    summed = summed_clipped(popt, backward)
    d = popt.last_diagnostics
    signal: dict[str, float] = {}
    dims: dict[str, int] = {}
    offset = 0
    for j, p in enumerate(popt.params):
        part = summed[offset : offset + p.numel()]
        offset += p.numel()
        key = popt.layer_name(p, j)
        signal[key] = signal.get(key, 0.0) + float(part.pow(2).sum())
        dims[key] = dims.get(key, 0) + p.numel()
    noise = (1.7 * popt.max_grad_norm) ** 2
    assert set(d.layer_snr) == set(signal) == set(d.layer_share)
    for key in signal:
        assert d.layer_snr[key] == pytest.approx(signal[key] / (noise * dims[key]), rel=1e-9)


@pytest.mark.parametrize("kind", ["loader", "dataset", "tensor", "object"])
def test_data_containers_are_refused_as_probe_sources(kind):
    """The preconditioner may only see probes: private data passed as probes is refused."""
    x, y = _data(16)
    ds = TensorDataset(x, y)
    source = {
        "loader": DataLoader(ds, batch_size=4),
        "dataset": ds,
        "tensor": x,
        "object": object(),
    }[kind]
    with pytest.raises(ValueError) as info:
        PrivacyEngine(seed=0).make_private(
            module=tiny_cnn_2d(),
            optimizer=torch.optim.SGD(tiny_cnn_2d().parameters(), lr=0.1),
            data_loader=DataLoader(ds, batch_size=4),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            delta=1e-5,
            method="dp-kfc",
            probe_source=source,
            probe_loss=per_sample_ce,
        )
    text = str(info.value)
    if kind == "object":
        assert "ProbeSource protocol" in text
    else:
        assert f"probe_source is a {type(source).__name__}" in text
        assert "no private data" in text


def test_fresh_per_sample_gradients_are_adopted_without_a_copy():
    """A full-batch result that shares no memory with the hook's inputs becomes Opacus'
    accumulation buffer itself; views of the inputs, partial batches and second uses do not."""
    from dpkfc_med.privacy.grad_sample import _adopt_fresh

    layer = nn.Linear(3, 2)
    layer.max_batch_len = 4  # type: ignore[assignment]
    x, dy = torch.randn(4, 3), torch.randn(4, 2)
    fresh = torch.randn(4, 2, 3)
    rest = _adopt_fresh(layer, {layer.weight: fresh, layer.bias: dy[:]}, [x, dy])
    assert layer.weight._current_grad_sample is fresh  # type: ignore[attr-defined]
    assert list(rest) == [layer.bias] and rest[layer.bias] is not None
    again = _adopt_fresh(layer, {layer.weight: torch.randn(4, 2, 3)}, [x, dy])
    assert list(again) == [layer.weight]  # a second use adds through Opacus' path
    other = nn.Linear(3, 2)
    other.max_batch_len = 5  # type: ignore[assignment]
    assert list(_adopt_fresh(other, {other.weight: fresh}, [x, dy])) == [other.weight]


@pytest.mark.parametrize("method", ["dp-sgd", "dp-kfc"])
def test_backward_forms_no_private_batch_gradient_for_hooked_layers(method, float64, monkeypatch):
    """Under DP training autograd does not accumulate the un-noised batch gradient of a
    Linear/conv layer whose input needs a gradient, and the per-sample gradients are those
    of the same run with every parameter attached."""
    import dpkfc_med.privacy.grad_sample as gs

    torch.manual_seed(0)
    base = tiny_cnn_2d()
    x, y = _data()

    def per_sample(detach: bool) -> tuple[nn.Module, dict[str, torch.Tensor]]:
        if not detach:
            monkeypatch.setattr(gs, "_detach_parameters", lambda gsm, m: [])
        _, (pm, popt, _) = _engine(method, copy.deepcopy(base), x, y, seed=11)
        popt.zero_grad()
        F.cross_entropy(pm(x[:20]), y[:20]).backward()
        monkeypatch.undo()
        return pm, {n: p.grad_sample for n, p in pm._module.named_parameters()}

    pm, ours = per_sample(True)
    _, attached = per_sample(False)
    for n, g in ours.items():
        torch.testing.assert_close(g, attached[n], rtol=1e-12, atol=1e-14)
    layers = [m for m in pm._module.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    assert layers[0].weight.grad is not None  # its input needs no gradient: kept attached
    for m in layers[1:]:
        assert all(p.grad is None for p in m.parameters())
        assert all(isinstance(p, nn.Parameter) for p in m.parameters())  # put back
    # hooks off (probe passes): ordinary autograd again
    pm.disable_hooks()
    F.cross_entropy(pm(x[:4]), y[:4]).backward()
    assert all(p.grad is not None for m in layers for p in m.parameters())


def test_detached_parameters_are_put_back_when_the_forward_raises():
    from dpkfc_med.privacy.grad_sample import PreconditionedGradSampleModule

    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    gsm = PreconditionedGradSampleModule(model)
    weight = model[0].weight
    x = torch.randn(5, 3, requires_grad=True)
    with pytest.raises(RuntimeError):
        gsm(x[:, :2])  # wrong width: the first layer raises inside its forward
    assert model[0].weight is weight
    assert all(isinstance(p, nn.Parameter) for p in model.parameters())
    gsm(x).sum().backward()  # and the layer works as before
    assert weight.grad is None and weight.grad_sample.shape == (5, 4, 3)
