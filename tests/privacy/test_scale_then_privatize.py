"""dp-stp (scale-then-privatize by the noisy second moment) against brute force, in float64."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from dpkfc_med.privacy.adambc import DPAdamBC
from dpkfc_med.privacy.engine import PrivacyEngine
from dpkfc_med.privacy.stp import SecondMomentScaleOptimizer
from tests.conftest import SHARED_DATA, summed_clipped, tiny_cnn_2d

C = 1.0
ROOT = Path(__file__).resolve().parents[2]
PNEUMONIA = Path(SHARED_DATA) / "medmnist" / "pneumoniamnist.npz"


def _data(n=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 3, (n,), generator=g)


def _engine(model, x, y, *, method="dp-stp", sigma=0.7, seed=3, optimizer=None, **kw):
    """Expected batch 8 of 32 units (q = 1/4); backward on the sum of per-sample losses."""
    eng = PrivacyEngine(seed=seed)
    pm, popt, _ = eng.make_private(
        module=model,
        optimizer=optimizer or torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=8),
        noise_multiplier=sigma,
        max_grad_norm=C,
        delta=1e-5,
        method=method,
        backward_reduction="sum",
        **kw,
    )
    return eng, pm, popt


def _step(pm, popt, x, y, units=None):
    popt.zero_grad()
    F.cross_entropy(pm(x), y, reduction="sum").backward()
    popt.set_unit_ids(units)
    popt.step()


def _set_scale(popt, scales):
    """Give the optimizer the public scale ``s`` (as if one release had left ``v`` there)."""
    sc = popt.scale
    sc.steps = 1
    for v, s in zip(sc.exp_avg_sq, scales):
        v.copy_((s - sc.eps) ** 2 * (1 - sc.beta2))
    torch.testing.assert_close(sc.scales(), scales)


def _random_scales(model, seed, low=0.05, high=5.0):
    g = torch.Generator().manual_seed(seed)
    return [low + (high - low) * torch.rand(p.shape, generator=g) for p in model.parameters()]


def _per_sample_grads(model, x, y):
    """One backward pass per sample: ``[sample][parameter]``."""
    out = []
    for i in range(len(x)):
        model.zero_grad()
        F.cross_entropy(model(x[i : i + 1]), y[i : i + 1], reduction="sum").backward()
        out.append([p.grad.detach().clone() for p in model.parameters()])
    return out


def test_the_step_with_a_fixed_public_scale_is_the_hand_computation(float64):
    """g_i / s, summed per unit, clipped to C, summed, + N(0, sigma^2 C^2), times s / B."""
    torch.manual_seed(0)
    base = tiny_cnn_2d()
    x, y = _data()
    xb, yb = x[:7], y[:7]
    units = torch.tensor([0, 0, 1, 2, 2, 2, 3])
    grads = _per_sample_grads(copy.deepcopy(base), xb, yb)

    def unit_sums(scales):
        return [
            [
                sum(grads[i][j] for i in range(len(xb)) if units[i] == u) / s
                for j, s in enumerate(scales)
            ]
            for u in range(4)
        ]

    def norms(sums):
        return [float(torch.sqrt(sum(g.pow(2).sum() for g in parts))) for parts in sums]

    # a spread-out scale, sized so that two units are clipped and two are not
    scales = _random_scales(base, seed=1, low=0.1, high=10.0)
    n = sorted(norms(unit_sums(scales)))
    scales = [s * (n[1] * n[2]) ** 0.5 / C for s in scales]
    sums = unit_sums(scales)
    coefs = [min(1.0, C / (norm + 1e-6)) for norm in norms(sums)]
    assert sorted(coefs)[1] < 1.0 == sorted(coefs)[2]  # both regimes occur

    _, pm, popt = _engine(base, x, y)
    assert isinstance(popt, SecondMomentScaleOptimizer)
    _set_scale(popt, scales)
    noise_state = popt.generator.get_state()
    _step(pm, popt, xb, yb, units)

    gen = torch.Generator().manual_seed(0)
    gen.set_state(noise_state)
    for j, (p, s) in enumerate(zip(popt.params, scales)):
        clipped = sum(c * parts[j] for c, parts in zip(coefs, sums))
        noise = torch.normal(0.0, 0.7 * C, size=p.shape, generator=gen)
        want = s * (clipped + noise) / 8
        torch.testing.assert_close(p.grad, want, rtol=1e-10, atol=1e-12)
    # the release joins the moving average: v = beta2 v + (1 - beta2) g~^2, t = 2
    sc = popt.scale
    assert sc.steps == 2
    for v, s, p in zip(sc.exp_avg_sq, scales, popt.params):
        old = (s - sc.eps) ** 2 * (1 - sc.beta2)
        want = sc.beta2 * old + (1 - sc.beta2) * p.grad**2
        torch.testing.assert_close(v, want, rtol=1e-12, atol=0)


def test_a_units_contribution_is_at_most_c_in_the_scaled_coordinates(float64):
    """Huge gradients, a scale spread over four decades: add / remove / replace one unit."""
    torch.manual_seed(2)
    x, y = _data(40)
    model = tiny_cnn_2d()
    _, pm, popt = _engine(model, x, y)
    _set_scale(popt, _random_scales(model, seed=5, low=1e-3, high=10.0))
    units = torch.arange(10).repeat_interleave(3)  # 10 units of 3 samples

    def clipped(xs, ys, ids):
        return summed_clipped(
            popt, lambda: F.cross_entropy(pm(xs), ys, reduction="sum").backward(), ids
        )

    big = x[:30] * 1e3
    base = clipped(big, y[:30], units)
    x_new, y_new = _data(3, seed=99)
    neighbours = {
        "add": (torch.cat([big, x_new * 1e3]), torch.cat([y[:30], y_new]), 11),
        "remove": (big[:27], y[:27], 9),
        "replace": (torch.cat([big[:27], x_new * 1e3]), torch.cat([y[:27], y_new]), 10),
    }
    for kind, (xn, yn, n_units) in neighbours.items():
        ids = torch.arange(n_units).repeat_interleave(3)
        diff = (clipped(xn, yn, ids) - base).norm()
        bound = 2.0 if kind == "replace" else 1.0  # replace = remove + add
        assert diff <= bound * C * (1 + 1e-6), f"{kind}: moved by {diff:.6f}"
        assert diff > 0.5 * C, kind  # the unit was clipped, and it mattered
    for u in range(10):  # each unit on its own
        alone = clipped(big[3 * u : 3 * u + 3], y[3 * u : 3 * u + 3], torch.zeros(3).long())
        assert alone.norm() <= C * (1 + 1e-6)


def _run(base, batches, method="dp-stp"):
    """Steps on ``batches``; per step the scale the step used and the released gradient."""
    x, y = _data()
    _, pm, popt = _engine(copy.deepcopy(base), x, y, method=method)
    used, released = [], []
    if method == "dp-stp":
        scales = popt.scale.scales

        def spy():
            out = scales()
            used.append(None if out is None else [s.clone() for s in out])
            return out

        popt.scale.scales = spy
    for xb, yb in batches:
        _step(pm, popt, xb, yb)
        released.append([p.grad.clone() for p in popt.params])
    return pm, popt, used, released


def test_the_scale_is_one_at_step_zero_then_comes_from_released_gradients_only(float64):
    torch.manual_seed(4)
    base = tiny_cnn_2d()
    x, y = _data(48, seed=7)
    first = (x[:8], y[:8])
    pm_sgd, _, _, rel_sgd = _run(base, [first], method="dp-sgd")
    pm_a, popt_a, used_a, rel_a = _run(base, [first, (x[8:16], y[8:16])])
    _, popt_b, used_b, rel_b = _run(base, [first, (x[16:26] * 3, y[16:26])])
    # step 0: s = 1, so the step is DP-SGD's, bit for bit (same seed, same batch)
    assert used_a[0] is None and used_b[0] is None
    for g_stp, g_b, g_sgd in zip(rel_a[0], rel_b[0], rel_sgd[0]):
        assert torch.equal(g_stp, g_sgd) and torch.equal(g_b, g_sgd)
    # step 1's scale is |g~_0| + eps: the first release alone, whatever step 1's private batch
    eps = popt_a.scale.eps
    for s_a, s_b, g in zip(used_a[1], used_b[1], rel_a[0]):
        assert torch.equal(s_a, s_b)
        torch.testing.assert_close(s_a, g.abs() + eps, rtol=1e-12, atol=0)
    # after step 1's release: the bias-corrected average of the two releases, by hand
    b2 = popt_a.scale.beta2
    for popt, rel in ((popt_a, rel_a), (popt_b, rel_b)):
        want = [
            ((b2 * (1 - b2) * g0**2 + (1 - b2) * g1**2) / (1 - b2**2)).sqrt() + eps
            for g0, g1 in zip(*rel)
        ]
        torch.testing.assert_close(popt.scale.scales(), want, rtol=1e-12, atol=0)


def _trainer_step(limit):
    """One PrivateTrainer step with a set scale, the batch in chunks of ``limit`` units."""
    from dpkfc_med.engines import PrivateTrainer

    torch.manual_seed(3)
    net = tiny_cnn_2d()
    g = torch.Generator().manual_seed(0)
    units = torch.tensor([0, 0, 1, 1, 2, 3, 3, 3, 4, 5])
    x, y = torch.randn(10, 1, 8, 8, generator=g), torch.randint(0, 3, (10,), generator=g)
    _, pm, popt = _engine(net, x, y)
    _set_scale(popt, _random_scales(net, seed=2))
    trainer = PrivateTrainer(
        device="cpu",
        max_epochs=1,
        train_data_loader=[{"image": x, "label": y, "unit": units}],
        network=pm,
        optimizer=popt,
        per_sample_loss=lambda out, t: F.cross_entropy(out, t, reduction="none"),
        privacy_engine=object(),
        unpack=lambda b: (b["image"], b["label"], b["unit"]),
        max_physical_batch=limit,
    )
    trainer.run()
    assert popt.steps_taken == 1 and popt.scale.steps == 2  # one release, taken in once
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def test_a_step_in_chunks_of_units_is_the_whole_batch_step():
    """Chunks share the step's one scale; their clipped sums add up before the one release."""
    whole = _trainer_step(None)
    for limit in (1, 4):
        chunked = _trainer_step(limit)
        for key, value in whole.items():
            torch.testing.assert_close(chunked[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_ghost_clipping_and_dpadambc_are_refused_and_auto_clips_per_sample():
    x, y = _data()
    with pytest.raises(
        ValueError, match=r"privacy.clipping='ghost' with method dp-stp.*per_sample"
    ):
        _engine(tiny_cnn_2d(), x, y, clipping="ghost")
    model = tiny_cnn_2d()
    with pytest.raises(ValueError, match=r"method=dp-stp with DPAdamBC.*use adam or sgd"):
        _engine(model, x, y, optimizer=DPAdamBC(model.parameters(), lr=1e-3))
    _, pm, _ = _engine(tiny_cnn_2d(), x, y, clipping="auto")
    assert pm.clipping == "per_sample"


def test_sgd_is_warned_that_its_steps_shrink_with_the_scale(caplog):
    x, y = _data()
    with caplog.at_level(logging.WARNING, logger="dpkfc_med.privacy.engine"):
        _engine(tiny_cnn_2d(), x, y)
    assert "dp-stp with an optimizer that keeps no second moment (SGD)" in caplog.text
    caplog.clear()
    model = tiny_cnn_2d()
    with caplog.at_level(logging.WARNING, logger="dpkfc_med.privacy.engine"):
        _engine(model, x, y, optimizer=torch.optim.Adam(model.parameters()))
    assert "dp-stp" not in caplog.text


def test_adams_betas_set_the_scale_and_the_scale_survives_a_checkpoint(float64):
    torch.manual_seed(6)
    x, y = _data()
    model = tiny_cnn_2d()
    spare = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.99), eps=1e-6)
    eng, pm, popt = _engine(model, x, y, optimizer=opt)
    assert (popt.scale.beta2, popt.scale.eps) == (0.99, 1e-6)
    other = tiny_cnn_2d()
    _, _, popt_eps = _engine(
        other, x, y, optimizer=torch.optim.Adam(other.parameters()), stp_eps=1e-3
    )
    assert popt_eps.scale.eps == 1e-3  # privacy.stp_eps: the scale's own constant
    with pytest.raises(ValueError, match=r"stp_eps=0.0: must be > 0"):
        _engine(tiny_cnn_2d(), x, y, stp_eps=0.0)
    for _ in range(2):
        _step(pm, popt, x[:8], y[:8])
    state = eng.state_dict()
    eng2, _, popt2 = _engine(spare, x, y)
    eng2.load_state_dict(state)
    assert popt2.scale.steps == 2 and popt2.scale.beta2 == 0.99
    for s, t in zip(popt2.scale.scales(), popt.scale.scales()):
        assert torch.equal(s, t)


def test_a_config_with_ghost_clipping_or_adambc_is_refused_at_load():
    from dpkfc_med.training.config import ConfigError, load_config

    cfg = ROOT / "configs" / "pneumoniamnist_cnn_2d_eps1.yaml"
    sets = ["method=dp-stp", "privacy.clipping=ghost", "training.optimizer=adambc"]
    with pytest.raises(ConfigError) as err:
        load_config(cfg, sets)
    text = "\n".join(err.value.problems)
    assert "privacy.clipping=ghost: the elementwise scale s breaks" in text
    assert "training.optimizer=adambc: DP-AdamBC subtracts a constant noise variance" in text
    assert load_config(cfg, ["method=dp-stp"]).method_enum.scaled
    with pytest.raises(ConfigError, match="stp_eps"):
        load_config(cfg, ["method=dp-stp", "privacy.stp_eps=-1.0"])


@pytest.mark.skipif(not PNEUMONIA.is_file(), reason="needs the shared PneumoniaMNIST file")
def test_a_tiny_dp_stp_run_from_the_cli_completes_and_names_its_method(tmp_path):
    from dpkfc_med.cli import main
    from dpkfc_med.report import check_report

    overrides = [
        "method=dp-stp",
        "data.max_train=64",
        "data.max_eval=32",
        "training.epochs=1",
        "training.batch_size=32",
        "training.progress=false",
        "privacy.stp_eps=0.001",
    ]
    out = tmp_path / "run"
    args = ["train", str(ROOT / "configs" / "pneumoniamnist_cnn_2d_eps1.yaml"), "--out", str(out)]
    assert main([*args, *[a for o in overrides for a in ("--set", o)]]) == 0
    report = json.loads((out / "privacy_report.json").read_text(encoding="utf-8"))
    check_report(report)
    assert report["status"] == "complete" and report["privacy"]["method"] == "dp-stp"
    assert report["preconditioner"] is None and report["privacy"]["steps"] >= 1
    md = (out / "privacy_report.md").read_text(encoding="utf-8")
    assert "DP-STP (scale-then-privatize): per-image gradients divided elementwise" in md
    assert report["run"]["config"]["privacy"]["stp_eps"] == 0.001
