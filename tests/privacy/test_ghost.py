"""Ghost clipping: the same clipped sums as materialised per-sample gradients, for every layout."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpkfc_med.curvature.preconditioner import PreconditionerConfig
from dpkfc_med.privacy.engine import PrivacyEngine
from dpkfc_med.privacy.ghost import ghost_path_wins, row_norms_sq
from tests.conftest import GaussianProbes, per_sample_ce, summed_clipped


class _Tokens(nn.Module):
    """Linear layers on tokens ``[B, T, n]`` (attention projections' layout), then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 6)
        self.out = nn.Linear(6, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.flatten(2).transpose(1, 2)  # [B, 16, 4]: 16 positions of 4 channels
        return self.out(torch.tanh(self.proj(tokens)).mean(1))


class _Shared(nn.Module):
    """One Linear layer applied twice in the forward pass (its positions join one sum)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.out = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.flatten(2).transpose(1, 2)  # [B, 16, 4]
        return self.out(self.proj(torch.tanh(self.proj(tokens))).mean(1))


def _conv1d() -> nn.Module:
    return nn.Sequential(
        nn.Conv1d(4, 5, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(5 * 16, 3)
    )


def _conv2d() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(4, 6, 3, stride=2, padding=1),
        nn.Tanh(),
        nn.Conv2d(6, 6, 3, padding=1, groups=2),  # grouped: G = 2 blocks
        nn.GroupNorm(2, 6),  # no row form: materialised next to the ghost layers
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(6 * 2 * 2, 3),
    )


class _ConvModes(nn.Module):
    """Padding modes, "same" padding with dilation, no bias, and one conv used twice."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(4, 5, 3, padding="same", dilation=2, padding_mode="reflect")
        self.b = nn.Conv2d(5, 5, 3, padding=1, padding_mode="circular", bias=False)
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.b(torch.tanh(self.b(torch.tanh(self.a(x))))))
        return self.head(h.mean((2, 3)))


def _conv3d() -> nn.Module:
    return nn.Sequential(
        nn.Conv3d(4, 3, 2, stride=2), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 2 * 2 * 2, 3)
    )


def _convtranspose() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(4, 3, 3, stride=2, padding=1),
        nn.Tanh(),
        nn.ConvTranspose2d(3, 2, 2, stride=2),  # no row form: per-sample under any mode
        nn.Flatten(),
        nn.Linear(2 * 4 * 4, 3),
    )


# (network, input shape of one sample)
LAYOUTS = {
    "linear-tokens": (_Tokens, (4, 4, 4)),
    "linear-shared": (_Shared, (4, 4, 4)),
    "conv1d": (_conv1d, (4, 16)),
    "conv2d-grouped": (_conv2d, (4, 4, 4)),
    "conv2d-modes": (_ConvModes, (4, 6, 6)),
    "conv3d": (_conv3d, (4, 4, 4, 4)),
    "convtranspose": (_convtranspose, (4, 4, 4)),
}

_FEW = {"num_probes": 32, "chunk_size": 32}
METHODS = {
    "dp-sgd": ("dp-sgd", None),
    "dp-kfc": ("dp-kfc", PreconditionerConfig(**_FEW)),
    "dp-kfc-ag": ("dp-kfc", PreconditionerConfig(factors="ag", **_FEW)),
    "dp-kfc-shampoo": ("dp-kfc", PreconditionerConfig(family="shampoo", **_FEW)),
    "dp-kfc-lowrank": ("dp-kfc", PreconditionerConfig(rank_a=2, **_FEW)),
    "dp-kfc-kron": ("dp-kfc", PreconditionerConfig(conv_a="kron", **_FEW)),
}
# every layout under DP-SGD and the default DP-KFC; the other transforms on the two layouts
# that exercise every row form (tokens; grouped conv with a norm layer beside it)
CASES = (
    [(lay, m) for lay in sorted(LAYOUTS) for m in ("dp-sgd", "dp-kfc")]
    + [
        (lay, m)
        for lay in ("linear-tokens", "conv2d-grouped")
        for m in ("dp-kfc-ag", "dp-kfc-shampoo", "dp-kfc-lowrank")
    ]
    + [(lay, "dp-kfc-kron") for lay in ("conv1d", "conv3d")]
)


def _private(net, shape, method, pre, clipping, n=24):
    eng = PrivacyEngine(seed=5)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, *shape, generator=g), torch.randint(0, 3, (n,), generator=g)
    pm, popt, _ = eng.make_private(
        module=net,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=8),
        noise_multiplier=1.0,
        max_grad_norm=0.5,
        delta=1e-5,
        method=method,
        probe_source=GaussianProbes(shape, num_classes=3),
        probe_loss=per_sample_ce,
        preconditioner=pre,
        clipping=clipping,
    )
    return pm, popt, x, y


def _clipped(pm, popt, x, y, units=None):
    return summed_clipped(
        popt, lambda: F.cross_entropy(pm(x), y, reduction="sum").backward(), units
    )


@pytest.mark.parametrize(("layout", "method"), CASES)
def test_ghost_clipped_sum_equals_per_sample(layout, method, float64):
    """Every mode gives the per-sample path's clipped sum, per sample and per unit of 3."""
    _check_modes_agree(layout, method)


@pytest.mark.parametrize("layout", ["conv2d-grouped", "linear-shared"])
def test_ghost_clipped_sum_in_chunks_of_one_sample(layout, monkeypatch, float64):
    """Norms and the raw clipped sum formed one sample (one unit) at a time equal the
    per-sample path's."""
    import dpkfc_med.privacy.ghost as ghost

    monkeypatch.setattr(ghost, "SUM_CHUNK_ELEMENTS", 1)
    monkeypatch.setattr(ghost, "NORM_CHUNK_ELEMENTS", 1)
    _check_modes_agree(layout, "dp-kfc-ag")


def _check_modes_agree(layout: str, method: str) -> None:
    build, shape = LAYOUTS[layout]
    kind, pre = METHODS[method]
    torch.manual_seed(2)
    base = build()
    units = torch.arange(24) % 8  # 8 patients with 3 images each, interleaved in the batch
    sums = {}
    pm, popt, x, y = _private(base, shape, kind, pre, "per_sample")
    for clipping in ("per_sample", "ghost", "auto"):
        pm.set_clipping(clipping)  # the same preconditioner under each mode
        sums[clipping] = (_clipped(pm, popt, x, y), _clipped(pm, popt, x, y, units))
        if clipping == "ghost":
            # ghost mode really left the row-form layers without per-sample gradients
            pm.zero_grad()
            F.cross_entropy(pm(x), y).backward()
            assert pm.ghost_rows, "no layer went through ghost clipping"
            popt.zero_grad()
            assert not pm.ghost_rows
    ref_sample, ref_unit = sums["per_sample"]
    for clipping in ("ghost", "auto"):
        per_sample, per_unit = sums[clipping]
        torch.testing.assert_close(per_sample, ref_sample, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(per_unit, ref_unit, rtol=1e-9, atol=1e-12)


def test_ghost_unit_norms_against_explicit_gradients(float64):
    """Per-unit norms from rows equal the norms of explicitly summed outer products."""
    g = torch.Generator().manual_seed(1)
    b, groups, t, n_g, n_w = 7, 2, 5, 3, 4
    d = torch.randn(b, groups, t, n_g, generator=g)
    a = torch.randn(b, groups, t, n_w + 1, generator=g)
    per_sample = torch.einsum("bgto,bgti->bgoi", d, a)  # brute force
    units = torch.tensor([0, 2, 2, 1, 0, 2, 3])
    unit_grads = torch.zeros(4, groups, n_g, n_w + 1).index_add_(0, units, per_sample)
    w_sq, b_sq = row_norms_sq(d, a, n_w, units)
    torch.testing.assert_close(w_sq, unit_grads[..., :n_w].pow(2).sum((1, 2, 3)))
    torch.testing.assert_close(b_sq, unit_grads[..., n_w].pow(2).sum((1, 2)))
    w1, b1 = row_norms_sq(d, a, n_w)
    torch.testing.assert_close(w1, per_sample[..., :n_w].pow(2).sum((1, 2, 3)))
    torch.testing.assert_close(b1, per_sample[..., n_w].pow(2).sum((1, 2)))


@pytest.mark.parametrize("clipping", ["ghost", "auto"])
def test_ghost_sensitivity_with_units_of_k_patches(clipping, float64):
    """Removing one patient (3 images) moves the clipped sum by at most C."""
    torch.manual_seed(4)
    base = _conv2d()
    pre = PreconditionerConfig(**_FEW)
    pm, popt, x, y = _private(base, (4, 4, 4), "dp-kfc", pre, clipping)
    x, y = x * 20, y  # large gradients: every unit is clipped
    units = torch.arange(24) // 3
    full = _clipped(pm, popt, x, y, units)
    for patient in range(8):
        keep = units != patient
        kept_units = units[keep] - (units[keep] > patient).long()
        neighbour = _clipped(pm, popt, x[keep], y[keep], kept_units)
        assert float((full - neighbour).norm()) <= 0.5 + 1e-9


def test_second_backward_before_step_is_refused():
    torch.manual_seed(0)
    pm, popt, x, y = _private(_Tokens(), (4, 4, 4), "dp-sgd", None, "ghost")
    F.cross_entropy(pm(x), y).backward()
    with pytest.raises(ValueError, match="second backward pass.*privacy.clipping: per_sample"):
        F.cross_entropy(pm(x[:5]), y[:5]).backward()


def test_ghost_layer_norms_are_formed_once_per_step(monkeypatch):
    """A layer's weight and bias share one norm computation (rows transformed once)."""
    from dpkfc_med.privacy.ghost import GhostRows

    calls: list[int] = []
    original = GhostRows.norms_sq

    def counted(self, unit_ids=None):
        calls.append(id(self))
        return original(self, unit_ids)

    monkeypatch.setattr(GhostRows, "norms_sq", counted)
    torch.manual_seed(0)
    pm, popt, x, y = _private(_Tokens(), (4, 4, 4), "dp-sgd", None, "ghost")
    F.cross_entropy(pm(x), y).backward()
    layers = len(pm.ghost_rows)
    assert any(r.has_bias for r in pm.ghost_rows.values())
    popt.step()
    assert len(calls) == layers == len(set(calls))


def test_ghost_choice_depends_on_shapes_only():
    """One position: ghost wins; a wide conv at many positions: per-sample wins."""
    assert ghost_path_wins(positions=1, groups=1, n_a=513, n_g=32)
    assert not ghost_path_wins(positions=1024, groups=1, n_a=10, n_g=16)
    # a preconditioner whose rows cost more than its gradient shifts the choice
    assert not ghost_path_wins(positions=4, groups=1, n_a=65, n_g=16, factored=1e6)


def test_ghost_norms_in_bounded_chunks_of_pairs_and_positions(monkeypatch, float64):
    """Tiny chunks (blocks of 2 positions, 2 pairs) give the same norms as one big product."""
    import dpkfc_med.privacy.ghost as ghost

    g = torch.Generator().manual_seed(3)
    d = torch.randn(6, 2, 7, 3, generator=g)
    a = torch.randn(6, 2, 7, 5, generator=g)
    units = torch.tensor([0, 1, 1, 2, 0, 1])
    whole = (row_norms_sq(d, a, 4), row_norms_sq(d, a, 4, units))
    monkeypatch.setattr(ghost, "PAIR_CHUNK_ELEMENTS", 2 * 2 * 2 * 2)  # groups 2, blocks 2 x 2
    chunked = (row_norms_sq(d, a, 4), row_norms_sq(d, a, 4, units))
    for (w0, b0), (w1, b1) in zip(whole, chunked):
        torch.testing.assert_close(w1, w0)
        torch.testing.assert_close(b1, b0)
    per_sample = torch.einsum("bgto,bgti->bgoi", d, a)
    torch.testing.assert_close(chunked[0][0], per_sample[..., :4].pow(2).sum((1, 2, 3)))


def test_forced_ghost_keeps_per_sample_gradients_beyond_the_position_bound():
    from dpkfc_med.curvature.adapters import adapter_for
    from dpkfc_med.curvature.preconditioner import KroneckerBlock
    from dpkfc_med.privacy.ghost import MAX_GHOST_POSITIONS
    from dpkfc_med.privacy.grad_sample import ghost_chosen

    conv = nn.Conv3d(1, 4, 3)
    block = KroneckerBlock(name="c", module=conv, adapter=adapter_for(conv))
    assert ghost_chosen("ghost", block, MAX_GHOST_POSITIONS)
    assert not ghost_chosen("ghost", block, MAX_GHOST_POSITIONS + 1)
    assert not ghost_chosen("per_sample", block, 1)


def test_auto_keeps_per_sample_gradients_on_a_gpu():
    """On CUDA the ghost path was the slowest mode on every model measured: auto avoids it."""
    from dpkfc_med.curvature.adapters import adapter_for
    from dpkfc_med.curvature.preconditioner import KroneckerBlock
    from dpkfc_med.privacy.grad_sample import ghost_chosen

    lin = nn.Linear(512, 512)  # one position: ghost norms are far cheaper by multiply-adds
    block = KroneckerBlock(name="l", module=lin, adapter=adapter_for(lin))
    assert ghost_chosen("auto", block, 1, "cpu")
    assert not ghost_chosen("auto", block, 1, "cuda")
    assert ghost_chosen("ghost", block, 1, "cuda")  # asked for by name, it is used
