"""DP-AdamBC against Adam and against its formula, computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from dpkfc_med.privacy.adambc import DPAdamBC, noise_variance_of


def _grads(steps: int, shape=(3, 4), seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g, dtype=torch.float64) for _ in range(steps)]


def _run(opt_cls, grads, **kw) -> torch.Tensor:
    p = torch.nn.Parameter(torch.zeros_like(grads[0]))
    opt = opt_cls([p], **kw)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach()


def test_without_noise_variance_it_is_adam():
    grads = _grads(20)
    want = _run(torch.optim.Adam, grads, lr=0.01, eps=0.0)
    got = _run(DPAdamBC, grads, lr=0.01, gamma=1e-300)
    torch.testing.assert_close(got, want)


def test_bias_corrected_update_matches_the_formula_elementwise():
    """theta -= lr * m_hat / sqrt(max(v_hat - Phi, gamma)), coordinate by coordinate."""
    grads = _grads(12, shape=(5,), seed=3)
    lr, (b1, b2), phi, gamma, wd = 0.02, (0.9, 0.99), 0.5, 0.05, 0.1
    got = _run(
        DPAdamBC, grads, lr=lr, betas=(b1, b2), gamma=gamma, noise_variance=phi, weight_decay=wd
    )
    theta = [0.0] * 5
    m = [0.0] * 5
    v = [0.0] * 5
    clamped = 0
    for t, g in enumerate(grads, start=1):
        for j in range(5):
            gj = float(g[j]) + wd * theta[j]
            m[j] = b1 * m[j] + (1 - b1) * gj
            v[j] = b2 * v[j] + (1 - b2) * gj * gj
            m_hat, v_hat = m[j] / (1 - b1**t), v[j] / (1 - b2**t)
            clamped += v_hat - phi < gamma
            theta[j] -= lr * m_hat / math.sqrt(max(v_hat - phi, gamma))
    assert 0 < clamped < 12 * 5  # both branches of the max were exercised
    torch.testing.assert_close(got, torch.tensor(theta, dtype=torch.float64))


def test_pure_noise_second_moment_is_corrected_to_zero():
    """Gradients that are only DP noise of variance Phi: v_hat - Phi averages out to ~0."""
    phi = 4e-4
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(20000, generator=g, dtype=torch.float64) * phi**0.5 for _ in range(50)]
    p = torch.nn.Parameter(torch.zeros(20000, dtype=torch.float64))
    opt = DPAdamBC([p], lr=0.01, noise_variance=phi, gamma=1e-12)
    for gr in grads:
        p.grad = gr
        opt.step()
    st = opt.state[p]
    v_hat = st["exp_avg_sq"] / (1 - 0.999**50)
    assert abs(float((v_hat - phi).mean())) < 0.02 * phi  # unbiased: E[g^2] = Phi


def test_noise_variance_and_bad_arguments():
    assert noise_variance_of(1.5, 2.0, 100) == pytest.approx((1.5 * 2.0 / 100) ** 2)
    p = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="gamma"):
        DPAdamBC(p, gamma=0)
    with pytest.raises(ValueError, match="betas"):
        DPAdamBC(p, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="expected batch"):
        noise_variance_of(1.0, 1.0, 0)


def test_the_engine_sets_the_noise_variance_and_a_restored_state_keeps_this_mechanism():
    """Phi comes from the privacy side (sigma, C, expected batch), not from the training loop,
    and survives loading a checkpoint written under another plan (a re-planned resume)."""
    from torch.utils.data import DataLoader, TensorDataset

    from dpkfc_med.privacy import PrivacyEngine

    def wrap(sigma):
        net = torch.nn.Linear(4, 2)
        opt = DPAdamBC(net.parameters(), lr=0.1, gamma=None)
        data = TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
        PrivacyEngine(seed=0).make_private(
            module=net,
            optimizer=opt,
            data_loader=DataLoader(data, batch_size=4),
            noise_multiplier=sigma,
            max_grad_norm=2.0,
            delta=1e-5,
            method="dp-sgd",
        )
        return opt

    first = wrap(1.0)
    phi = noise_variance_of(1.0, 2.0, 4)
    assert [g["noise_variance"] for g in first.param_groups] == [phi]
    assert [g["gamma"] for g in first.param_groups] == [phi]  # gamma=None: the floor is Phi
    second = wrap(3.0)
    second.load_state_dict(first.state_dict())  # a checkpoint of the first plan
    assert second.param_groups[0]["noise_variance"] == noise_variance_of(3.0, 2.0, 4)
    assert second.param_groups[0]["gamma"] == noise_variance_of(3.0, 2.0, 4)
