"""Adapters and Kronecker factors against brute force (float64).

Brute force: the per-position input ``a_{m,t}`` of a layer is read off the Jacobian of the
layer output ``y[m, o, t]`` with respect to the weight (``y = W a`` makes that row equal to
``a``), and ``delta_{m,t}`` is the autograd gradient of sample ``m``'s own loss with respect to
its output. Factors are then explicit sums of outer products.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, jacrev

from dpkfc_med.curvature.adapters import adapter_for, unfold_channels_first, unfold_nd
from dpkfc_med.curvature.factors import estimate_factors

LAYERS = {
    "linear_seq": (lambda: nn.Linear(4, 3), (3, 2, 5, 4)),
    "linear_nobias": (lambda: nn.Linear(4, 3, bias=False), (3, 4)),
    "conv1d": (lambda: nn.Conv1d(2, 3, 3, padding=1), (3, 2, 6)),
    "conv1d_strided_dilated": (lambda: nn.Conv1d(2, 4, 2, stride=2, dilation=2), (3, 2, 9)),
    "conv2d_nobias_grouped": (
        lambda: nn.Conv2d(4, 6, 3, padding=1, groups=2, bias=False),
        (2, 4, 4, 5),
    ),
    "conv2d_strided": (
        lambda: nn.Conv2d(2, 3, (3, 2), stride=(2, 1), padding=(1, 0)),
        (3, 2, 5, 4),
    ),
    "conv2d_same_reflect": (
        lambda: nn.Conv2d(2, 2, 3, padding="same", padding_mode="reflect"),
        (2, 2, 4, 4),
    ),
    "conv3d": (lambda: nn.Conv3d(1, 2, 3, padding=1), (2, 1, 4, 6, 6)),
    "conv3d_nobias_strided": (lambda: nn.Conv3d(2, 2, 2, stride=2, bias=False), (2, 2, 4, 4, 2)),
    "convt1d": (
        lambda: nn.ConvTranspose1d(2, 3, 3, stride=2, padding=1, output_padding=1),
        (3, 2, 4),
    ),
    "convt2d_grouped": (lambda: nn.ConvTranspose2d(4, 2, 3, stride=2, groups=2), (2, 4, 3, 2)),
    "convt3d_nobias": (lambda: nn.ConvTranspose3d(2, 2, 2, stride=2, bias=False), (2, 2, 2, 3, 2)),
    "convt2d_dilated_outpad": (
        lambda: nn.ConvTranspose2d(
            4, 6, (3, 2), stride=(2, 3), padding=(2, 1), output_padding=(1, 2), dilation=2, groups=2
        ),
        (2, 4, 4, 3),
    ),
}


def _loss(out: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Per-sample nonlinear loss so that delta depends on the output."""
    return (torch.sin(out) * r).flatten(1).sum(1)


def _brute_force(module: nn.Module, x: torch.Tensor, r: torch.Tensor):
    adapter = adapter_for(module)
    groups, n_a, n_g = adapter.dims(module)
    params = {k: v.detach() for k, v in module.named_parameters()}
    y = module(x)
    # delta: each sample's own loss w.r.t. its own output
    deltas = []
    for m in range(x.shape[0]):
        ym = module(x[m : m + 1]).detach().requires_grad_(True)
        (dy,) = torch.autograd.grad(_loss(ym, r[m : m + 1]).sum(), ym)
        deltas.append(dy[0])
    delta = torch.stack(deltas)
    channel_last = isinstance(module, nn.Linear)
    jac = jacrev(lambda w: functional_call(module, {**params, "weight": w}, (x,)))(params["weight"])
    # jac: [*y.shape, *w.shape]; rows of output channel o give a (in the adapter layout).
    m_count = x.shape[0]
    if channel_last:
        y_flat = y.reshape(m_count, -1, y.shape[-1])
        jac = jac.reshape(m_count, y_flat.shape[1], y.shape[-1], *params["weight"].shape)
        delta = delta.reshape(m_count, -1, y.shape[-1])
    else:
        c_out = y.shape[1]
        jac = jac.reshape(m_count, c_out, -1, *params["weight"].shape).transpose(1, 2)
        delta = delta.reshape(m_count, c_out, -1).transpose(1, 2)
    t_count = jac.shape[1]
    a_bf = torch.zeros(groups, n_a, n_a)
    g_bf = torch.zeros(groups, n_g, n_g)
    for g in range(groups):
        o = g * n_g
        rows = jac[:, :, o].reshape(m_count * t_count, *params["weight"].shape)
        grads = {module.weight: rows}
        if module.bias is not None:
            onehot = torch.zeros(m_count * t_count, module.bias.shape[0])
            onehot[:, o] = 1.0
            grads[module.bias] = onehot
        a = adapter.from_params(module, grads)[:, g, 0, :]  # [M*T, n_a]
        a_bf[g] = a.T @ a / (m_count * t_count)
        d = delta[:, :, g * n_g : (g + 1) * n_g].reshape(-1, n_g)
        g_bf[g] = d.T @ d / m_count
    return a_bf, g_bf


def _report(name: str, got: torch.Tensor, want: torch.Tensor) -> str:
    bad = (~torch.isclose(got, want, rtol=1e-9, atol=1e-11)).nonzero().tolist()
    lines = [f"{name}: {len(bad)} mismatching entries"]
    for idx in bad[:20]:
        lines.append(
            f"  {idx}: got {got[tuple(idx)].item():.6g} want {want[tuple(idx)].item():.6g}"
        )
    return "\n".join(lines)


def _layer_case(case: str, seed: int):
    """Layer ``case`` of ``LAYERS``, its adapter, an input and random output weights."""
    make, shape = LAYERS[case]
    torch.manual_seed(seed)
    module = make()
    x = torch.randn(*shape)
    return module, adapter_for(module), x, torch.randn_like(module(x))


@pytest.mark.parametrize("case", sorted(LAYERS))
def test_per_sample_grads_match_autograd(case, float64):
    module, adapter, x, r = _layer_case(case, seed=0)
    a = adapter.activations(module, x)
    d = adapter.errors(module, _delta(module, x, r))
    grads = adapter.to_params(module, torch.einsum("btgo,btgi->bgoi", d, a))
    direct = adapter.param_grads and adapter.param_grads(module, x, _delta(module, x, r))
    assert bool(direct) == case.startswith("convt")
    for m in range(x.shape[0]):
        ref = torch.autograd.grad(
            _loss(module(x[m : m + 1]), r[m : m + 1]).sum(), list(module.parameters())
        )
        for p, g in zip(module.parameters(), ref):
            torch.testing.assert_close(grads[p][m], g, rtol=1e-10, atol=1e-12)
            if direct:  # the unfold-free path (transposed convs) must agree too
                torch.testing.assert_close(direct[p][m], g, rtol=1e-10, atol=1e-12)
    # round trip of the layout map
    back = adapter.from_params(module, grads)
    torch.testing.assert_close(back, torch.einsum("btgo,btgi->bgoi", d, a))
    kernel = adapter.per_sample_grads
    assert (kernel is not None) == (case.startswith("conv") and not case.startswith("convt"))
    if kernel is not None:  # the layer's own kernel, batch as groups: the same gradients
        w, b = kernel(module, x, _delta(module, x, r))
        torch.testing.assert_close(w, back[..., : w.shape[-1]], rtol=1e-10, atol=1e-12)
        assert (b is None) == (module.bias is None)
        if b is not None:
            torch.testing.assert_close(b, back[..., -1], rtol=1e-10, atol=1e-12)
        summed = adapter.summed_grad(module, x, _delta(module, x, r))
        torch.testing.assert_close(summed, back.sum(0), rtol=1e-10, atol=1e-12)


def _delta(module: nn.Module, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    y = module(x)
    (dy,) = torch.autograd.grad(_loss(y, r).sum(), y)
    return dy


def test_channels_first_unfold_matches_torch_and_position_major(float64):
    """``[B, C k, L]`` patches: F.unfold in 2D, and the transpose of unfold_nd in 1D-3D."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 7, 8)
    got = unfold_channels_first(x, (3, 2), (2, 1), (1, 2))
    torch.testing.assert_close(got, F.unfold(x, (3, 2), dilation=(1, 2), stride=(2, 1)))
    cases = [((2, 3, 9), (3,), (2,), (2,)), ((2, 2, 4, 5, 6), (2, 3, 2), (1, 2, 2), (1, 1, 2))]
    for shape, k, st, dil in cases:
        x = torch.randn(*shape)
        pos = unfold_nd(x, k, st, dil)  # [B, L, C, k]
        want = pos.reshape(pos.shape[0], pos.shape[1], -1).transpose(1, 2)
        torch.testing.assert_close(unfold_channels_first(x, k, st, dil), want)


@pytest.mark.parametrize("case", sorted(LAYERS))
def test_factors_match_brute_force(case, float64):
    make, shape = LAYERS[case]
    torch.manual_seed(1)
    module = make()
    x = torch.randn(*shape)
    r = torch.randn_like(module(x))
    a_bf, g_bf = _brute_force(module, x, r)
    factors = estimate_factors(module, x, r, _loss, layers={"layer": module}, chunk_size=2)["layer"]
    assert torch.allclose(factors.a, a_bf, rtol=1e-9, atol=1e-11), _report("A", factors.a, a_bf)
    assert torch.allclose(factors.g, g_bf, rtol=1e-9, atol=1e-11), _report("G", factors.g, g_bf)


def test_kfac_reduce_linear_sequence(float64):
    torch.manual_seed(2)
    layer = nn.Linear(3, 2)
    x = torch.randn(4, 5, 3)
    r = torch.randn(4, 5, 2)
    f = estimate_factors(layer, x, r, _loss, layers={"l": layer}, reduction="reduce")["l"]
    a = torch.cat([x.mean(1), torch.ones(4, 1)], dim=1)
    d = _delta(layer, x, r).sum(1)
    torch.testing.assert_close(f.a[0], a.T @ a / 4)
    torch.testing.assert_close(f.g[0], d.T @ d / 4)


def test_large_factor_is_diagonal(float64):
    torch.manual_seed(3)
    layer = nn.Linear(10, 3)
    x, r = torch.randn(5, 10), torch.randn(5, 3)
    f = estimate_factors(layer, x, r, _loss, layers={"l": layer}, max_factor_dim=8)["l"]
    full = estimate_factors(layer, x, r, _loss, layers={"l": layer})["l"]
    assert f.a_is_diagonal and not f.g_is_diagonal
    torch.testing.assert_close(f.a[0], torch.diagonal(full.a[0]))


class TinyAttention(nn.Module):
    """One self-attention block whose q/k/v/out projections are Linear layers over tokens."""

    def __init__(self, dim: int = 4, heads: int = 2) -> None:
        super().__init__()
        self.q, self.k, self.v, self.out = (nn.Linear(dim, dim) for _ in range(4))
        self.heads = heads

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.heads

        def split(z):
            return z.reshape(b, t, h, d // h).transpose(1, 2)

        att = torch.softmax(
            split(self.q(x)) @ split(self.k(x)).transpose(-1, -2) / math.sqrt(d // h), -1
        )
        return (att @ split(self.v(x))).transpose(1, 2).reshape(b, t, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.attend(x)).mean(1)


def test_attention_block_factors(float64):
    torch.manual_seed(4)
    block = TinyAttention()
    x = torch.randn(3, 5, 4)
    r = torch.randn(3, 4)
    factors = estimate_factors(block, x, r, _loss)
    assert set(factors) == {"q", "k", "v", "out"}
    # explicit forward with the projection inputs/outputs exposed
    inputs = {"q": x, "k": x, "v": x}
    b, t, d = x.shape
    outs = {n: getattr(block, n)(x) for n in ("q", "k", "v")}
    h = block.heads

    def split(z):
        return z.reshape(b, t, h, d // h).transpose(1, 2)

    att = torch.softmax(
        split(outs["q"]) @ split(outs["k"]).transpose(-1, -2) / math.sqrt(d // h), -1
    )
    inputs["out"] = (att @ split(outs["v"])).transpose(1, 2).reshape(b, t, d)
    outs["out"] = block.out(inputs["out"])
    loss = _loss(outs["out"].mean(1), r).sum()
    grads = torch.autograd.grad(loss, [outs[n] for n in ("q", "k", "v", "out")])
    for name, dy in zip(("q", "k", "v", "out"), grads):
        a = torch.cat([inputs[name], torch.ones(b, t, 1)], -1).reshape(-1, d + 1)
        dd = dy.reshape(-1, d)
        torch.testing.assert_close(factors[name].a[0], a.T @ a / (b * t), msg=f"A of {name}")
        torch.testing.assert_close(factors[name].g[0], dd.T @ dd / b, msg=f"G of {name}")


def test_estimation_never_touches_grad_or_grad_sample(float64):
    torch.manual_seed(5)
    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Tanh(), nn.Flatten(), nn.Linear(2 * 4 * 4, 2))
    sentinel = {}
    for p in net.parameters():
        p.grad = torch.full_like(p, 7.0)
        p.grad_sample = torch.full((1, *p.shape), 3.0)
        sentinel[p] = (p.grad.clone(), p.grad_sample.clone())
    x = torch.randn(4, 1, 6, 6)
    y = torch.randint(0, 2, (4,))
    estimate_factors(net, x, y, lambda o, t: F.cross_entropy(o, t, reduction="none"))
    for p, (g, gs) in sentinel.items():
        assert torch.equal(p.grad, g) and torch.equal(p.grad_sample, gs)


@pytest.mark.parametrize("case", ["conv3d", "convt2d_grouped", "conv2d_strided"])
def test_position_sampled_a_factor_is_the_mean_over_the_drawn_positions(case, float64):
    """``max_positions``: A averages over the drawn positions only; G keeps all of them."""
    module, adapter, x, r = _layer_case(case, seed=4)

    def factors(**kw):
        out = estimate_factors(module, x, r, _loss, layers={"l": module}, chunk_size=len(x), **kw)
        return out["l"]

    full = factors()
    a_all = adapter.activations(module, x)
    t = a_all.shape[1]
    k = max(1, t // 3)
    sub = factors(max_positions=k, position_seed=7)
    idx = torch.randperm(t, generator=torch.Generator().manual_seed(7))[:k].sort().values
    a = a_all[:, idx]
    want = torch.einsum("mtgi,mtgj->gij", a, a) / (len(x) * k)
    torch.testing.assert_close(sub.a, want)
    torch.testing.assert_close(sub.g, full.g)
    # enough positions: exactly the all-position estimate
    same = factors(max_positions=t)
    torch.testing.assert_close(same.a, full.a, rtol=0, atol=0)


def test_capture_holds_one_layers_patches_at_a_time():
    """A consumer that drops each captured layer frees its patches before the next unfold."""
    import weakref

    from dpkfc_med.curvature.factors import capture_layers, covered_layers
    from tests.conftest import per_sample_ce, tiny_cnn_2d

    net = tiny_cnn_2d()
    x, y = torch.randn(4, 1, 8, 8), torch.randint(0, 3, (4,))
    layers = covered_layers(net)
    gen = capture_layers(net, x, y, per_sample_ce, layers)
    names, alive = [], []
    prev: list[weakref.ref] = []
    for cap in gen:
        alive.append(any(r() is not None for r in prev))  # previous layer's a/delta still held?
        names.append(cap.name)
        prev = [weakref.ref(cap.a), weakref.ref(cap.delta)]
        del cap
    # one call of 4 probes comes in two pieces (the first probe measures the patch size)
    assert names == [n for n in layers for _ in range(2)] and len(layers) == 3
    assert not any(alive)


@pytest.mark.parametrize("case", ["conv3d", "convt2d_grouped", "conv2d_strided"])
def test_factors_from_bounded_pieces_equal_the_whole_call(case, float64, monkeypatch):
    """Patches capped at one probe per piece: same A and G, same drawn positions, same
    generator state afterwards, and no piece above the cap (unless one probe is)."""
    from dpkfc_med.curvature import factors as fmod

    module, adapter, x, r = _layer_case(case, seed=5)
    t = adapter.activations(module, x[:1]).shape[1]

    def run(cap: int):
        monkeypatch.setattr(fmod, "PATCH_ELEMENTS", cap)
        gen = torch.Generator().manual_seed(3)
        sizes = [
            c.a.numel()
            for c in fmod.capture_layers(
                module, x, r, _loss, {"l": module}, max_positions=max(1, t // 2), generator=gen
            )
        ]
        out = estimate_factors(
            module,
            x,
            r,
            _loss,
            layers={"l": module},
            chunk_size=len(x),
            max_positions=max(1, t // 2),
            position_seed=3,
        )["l"]
        return out, sizes, torch.rand(1, generator=gen)

    whole, whole_sizes, after = run(1 << 30)
    split, sizes, after_split = run(1)  # one probe per piece
    assert len(whole_sizes) == 2 and len(sizes) == len(x)
    assert len(set(sizes)) == 1  # every piece is one probe's patches
    torch.testing.assert_close(split.a, whole.a)
    torch.testing.assert_close(split.g, whole.g)
    assert torch.equal(after, after_split)
