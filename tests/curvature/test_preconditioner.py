"""Preconditioner operator against explicit Kronecker products and its scale rules."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dpkfc_med.curvature.adapters import adapter_for
from dpkfc_med.curvature.preconditioner import (
    KroneckerBlock,
    KroneckerPreconditioner,
    LowRankA,
    PreconditionerConfig,
    inverse_sqrt,
)
from tests.conftest import per_sample_ce, tiny_cnn_2d


def _spd(g: int, n: int) -> torch.Tensor:
    m = torch.randn(g, n, n)
    return m @ m.transpose(1, 2) / n + 0.01 * torch.eye(n)


def test_inverse_sqrt_full_and_diagonal(float64):
    torch.manual_seed(0)
    f = _spd(2, 5)
    u = inverse_sqrt(f, 0.1)
    mean = torch.linalg.eigvalsh(f).mean(-1)
    target = f + 0.1 * mean[:, None, None] * torch.eye(5)
    torch.testing.assert_close(torch.linalg.inv(u @ u), target)
    d = torch.rand(2, 5) + 0.1
    ud = inverse_sqrt(d, 0.1)
    torch.testing.assert_close(ud, (d + 0.1 * d.mean(-1, keepdim=True)).rsqrt())
    # a factor the loss never reaches maps to the identity instead of inf
    assert torch.equal(inverse_sqrt(torch.zeros(1, 3, 3), 0.1), torch.eye(3)[None])


LAYERS = [
    (lambda: nn.Linear(5, 3), (4, 5)),
    (lambda: nn.Linear(5, 3), (4, 2, 5)),
    (lambda: nn.Conv2d(4, 6, 3, padding=1, groups=2), (3, 4, 4, 4)),
    (
        lambda: nn.Conv1d(2, 3, 3, stride=2, dilation=2, padding=2, padding_mode="reflect"),
        (3, 2, 9),
    ),
    (lambda: nn.Conv3d(2, 3, 2, bias=False), (2, 2, 3, 3, 3)),
]


def _outer(d, a):
    return torch.einsum("btgo,btgi->bgoi", d, a)


def _explicit(block, raw):
    """``s U_G X U_A`` per group via an explicit Kronecker product (column-major vec)."""
    g, n_a, n_g = block.dims
    eye = lambda n: torch.eye(n)[None].expand(g, n, n)  # noqa: E731
    u_a, u_g = block.u_a, block.u_g
    if block.a_low is not None:
        u_a = block.a_low.dense()
    u_a = eye(n_a) if u_a is None else (torch.diag_embed(u_a) if u_a.dim() == 2 else u_a)
    u_g = eye(n_g) if u_g is None else (torch.diag_embed(u_g) if u_g.dim() == 2 else u_g)
    out = []
    for gi in range(g):
        kron = torch.kron(u_a[gi].T.contiguous(), u_g[gi].contiguous()) * block.scale
        vec = raw[:, gi].transpose(1, 2).reshape(raw.shape[0], -1)
        out.append((vec @ kron.T).reshape(raw.shape[0], n_a, n_g).transpose(1, 2))
    return torch.stack(out, 1)


@pytest.mark.parametrize("idx", range(len(LAYERS)))
@pytest.mark.parametrize("path", ["factored", "materialized"])
@pytest.mark.parametrize(
    "kinds", [("full", "full"), ("diag", "none"), ("none", "diag"), ("lowrank", "full")]
)
def test_sample_grads_equal_explicit_kronecker(idx, path, kinds, float64):
    """Rows without a bias column and U_A split at the bias coordinate give s U_G g U_A."""
    torch.manual_seed(idx)
    make, shape = LAYERS[idx]
    module = make()
    adapter = adapter_for(module)
    g, n_a, n_g = adapter.dims(module)

    def factor(kind, n, damping):
        if kind == "full":
            return inverse_sqrt(_spd(g, n), damping)
        return torch.rand(g, n) + 0.5 if kind == "diag" else None

    u_g = factor(kinds[1], n_g, 0.1)
    if kinds[0] == "lowrank":
        low, _ = LowRankA.from_factor(_spd(g, n_a), 0.01, rank=2)
        block = KroneckerBlock("l", module, adapter, None, u_g, 0.7, a_low=low)
    else:
        block = KroneckerBlock("l", module, adapter, factor(kinds[0], n_a, 0.01), u_g, 0.7)
    x = torch.randn(*shape)
    dy = torch.randn_like(module(x))
    # reference: the adapter's position-major layout with the bias column appended
    raw = _outer(adapter.errors(module, dy), adapter.activations(module, x))
    rows, err = adapter.rows(module, x), adapter.error_rows(module, dy)
    w, bias, raw_sq = block.sample_grads(rows, err, path=path, raw_norms=2)
    got = w if bias is None else torch.cat([w, bias.unsqueeze(-1)], -1)
    torch.testing.assert_close(got, _explicit(block, raw))
    torch.testing.assert_close(raw_sq, raw[:2].pow(2).flatten(1).sum(1))
    torch.testing.assert_close(block.transform_grads(raw), _explicit(block, raw))


def test_conv_transpose_transform_equals_explicit_kronecker(float64):
    """Transposed convs: input-grid per-sample gradients, then the literal transform."""
    torch.manual_seed(3)
    module = nn.ConvTranspose2d(2, 3, 2, stride=2)
    adapter = adapter_for(module)
    g, n_a, n_g = adapter.dims(module)
    block = KroneckerBlock(
        "l", module, adapter, inverse_sqrt(_spd(g, n_a), 0.01), inverse_sqrt(_spd(g, n_g), 0.1), 0.7
    )
    x = torch.randn(3, 2, 2, 3)
    dy = torch.randn_like(module(x))
    raw = _outer(adapter.errors(module, dy), adapter.activations(module, x))
    torch.testing.assert_close(block.raw_grads(x, dy), raw)
    torch.testing.assert_close(block.transform_grads(raw), _explicit(block, raw))


def test_path_choice_prefers_cheaper():
    lin = nn.Linear(512, 32)
    blk = KroneckerBlock("l", lin, adapter_for(lin), torch.eye(513)[None], torch.eye(32)[None])
    assert blk.choose_path(256, 1) == "factored"
    conv = nn.Conv2d(1, 16, 8)
    blk = KroneckerBlock("c", conv, adapter_for(conv), torch.eye(65)[None], torch.eye(16)[None])
    assert blk.choose_path(256, 196) == "materialized"


def _probe_batch(n=64):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 3, (n,), generator=g)


@pytest.mark.parametrize("factors", ["a", "ag"])
@pytest.mark.parametrize("scaling", ["global", "per_layer", "per_layer_raw", "none"])
def test_scale_rules(scaling, factors, float64):
    torch.manual_seed(0)
    net = tiny_cnn_2d()
    x, y = _probe_batch()
    cfg = PreconditionerConfig(
        factors=factors, scaling=scaling, calibration_samples=16, num_probes=64
    )
    pre = KroneckerPreconditioner.from_probes(net, x, y, per_sample_ce, cfg)
    # Recompute per-sample transformed norms on the calibration probes by brute force.
    params = [p for p in net.parameters()]
    raw, trans = [], []
    per_layer, per_layer_raw = {}, {}
    for i in range(16):
        grads = torch.autograd.grad(per_sample_ce(net(x[i : i + 1]), y[i : i + 1]).sum(), params)
        gd = {p: g.unsqueeze(0) for p, g in zip(params, grads)}
        tg = pre.transform_param_grads(gd)
        raw.append(sum(g.pow(2).sum() for g in grads).sqrt())
        trans.append(sum(t.pow(2).sum() for t in tg.values()).sqrt())
        names = pre.param_layer_names()
        for p in params:
            per_layer.setdefault(names[id(p)], [0.0] * 16)[i] += float(tg[p].pow(2).sum())
            per_layer_raw.setdefault(names[id(p)], [0.0] * 16)[i] += float(gd[p].pow(2).sum())
    raw, trans = torch.stack(raw), torch.stack(trans)
    if scaling == "global":
        torch.testing.assert_close(trans.median(), raw.median())
    elif scaling == "per_layer":
        target = raw.median() / len(per_layer) ** 0.5
        for name, sq in per_layer.items():
            torch.testing.assert_close(torch.tensor(sq).sqrt().median(), target, msg=name)
    elif scaling == "per_layer_raw":  # every layer keeps its unpreconditioned median norm
        for name, sq in per_layer.items():
            torch.testing.assert_close(
                torch.tensor(sq).sqrt().median(),
                torch.tensor(per_layer_raw[name]).sqrt().median(),
                msg=name,
            )
    else:
        assert all(b.scale == 1.0 for b in pre.blocks.values())
    assert {r["layer"] for r in pre.coverage()} == {"0", "2", "6", "3.weight", "3.bias"}


def test_a_only_mode_has_no_g(float64):
    net = tiny_cnn_2d()
    x, y = _probe_batch()
    pre = KroneckerPreconditioner.from_probes(
        net, x, y, per_sample_ce, PreconditionerConfig(factors="a")
    )
    assert all(b.u_g is None and b.u_a is not None for b in pre.blocks.values())


def test_diagonal_fallback_from_probe_moments(float64):
    net = tiny_cnn_2d()
    x, y = _probe_batch()
    cfg = PreconditionerConfig(fallback="diagonal", scaling="none", calibration_samples=8)
    pre = KroneckerPreconditioner.from_probes(net, x, y, per_sample_ce, cfg)
    fb = pre.fallbacks["3.weight"]
    grads = torch.stack(
        [
            torch.autograd.grad(per_sample_ce(net(x[i : i + 1]), y[i : i + 1]).sum(), fb.param)[0]
            for i in range(8)
        ]
    )
    second = grads.pow(2).mean(0)
    torch.testing.assert_close(fb.diag, (second + 1e-3 * second.mean()).rsqrt())


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match=r"preconditioner.factors='agg'.*did you mean 'ag'"):
        PreconditionerConfig(factors="agg")
    with pytest.raises(ValueError, match=r"preconditioner.damping_g=-1"):
        PreconditionerConfig(damping_g=-1)


def test_non_finite_probes_rejected():
    net = tiny_cnn_2d()
    x, y = _probe_batch(8)
    x[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        KroneckerPreconditioner.from_probes(net, x, y, per_sample_ce)


@pytest.mark.parametrize("rank_a", [None, 64])
def test_float32_decompositions_match_float64_on_small_cnn_probes(rank_a):
    """The default float32 eigendecompositions give the float64 transform to < 0.1 %.

    Real model (the small CNN, factors up to 513 wide) and its pink-noise probes; the check is
    on what clipping sees: per-sample transformed norms of random gradients. With the default
    ``rank_a`` the 257- and 513-wide factors are low-rank, the others dense.
    """
    from dpkfc_med.models import build_model
    from dpkfc_med.probes import ImageProbeSource

    torch.manual_seed(0)
    model, _ = build_model("small_cnn", spatial_dims=2, in_channels=1, out_channels=2)
    x, y = ImageProbeSource((28, 28), channels=1, num_classes=2, preset="xray").sample(
        128, seed=0, model=model
    )
    pre = {
        dt: KroneckerPreconditioner.from_probes(
            model,
            x,
            y,
            per_sample_ce,
            PreconditionerConfig(eig_dtype=dt, scaling="none", rank_a=rank_a),
        )
        for dt in ("float32", "float64")
    }
    assert PreconditionerConfig().eig_dtype == "float32"
    assert PreconditionerConfig().rank_a == 64
    kinds = []
    for name, b64 in pre["float64"].blocks.items():
        b32 = pre["float32"].blocks[name]
        u32, u64 = (b.u_a if b.a_low is None else b.a_low.dense() for b in (b32, b64))
        kinds.append(b64.a_low is not None)
        assert u32.dtype == torch.float32 and u64.dtype == torch.float32
        g, n_a, n_g = b64.dims
        grads = torch.randn(32, g, n_g, n_a, dtype=torch.float64)
        n64 = torch.einsum("bgoi,gij->bgoj", grads, u64.double()).flatten(1).norm(dim=1)
        n32 = torch.einsum("bgoi,gij->bgoj", grads, u32.double()).flatten(1).norm(dim=1)
        assert float(((n32 - n64) / n64).abs().max()) < 1e-3, name
        # and float32 really was used where asked (the float64 matrices differ slightly)
        assert not torch.equal(u32, u64), name
    assert kinds == ([False, True, True, False] if rank_a else [False] * 4)


def test_kron_conv_factor_matches_explicit_kronecker_products(float64):
    """conv_a='kron': U_A = U_C (x) U_K from A's partial traces, checked by brute force."""
    from dpkfc_med.curvature.blocks import KronA, kron_a_from_factor

    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 2)  # C = 3, K = 4, bias
    x = torch.randn(5, 7, 3 * 4)
    a_rows = torch.cat([x, torch.ones(5, 7, 1)], dim=-1).reshape(-1, 13)
    a = (a_rows.T @ a_rows / a_rows.shape[0])[None]
    kron, _ = kron_a_from_factor(conv, a, 0.01, torch.float64, torch.float64)
    # partial traces by loops
    w = a[0, :12, :12]
    a_c = torch.zeros(3, 3)
    a_k = torch.zeros(4, 4)
    for c in range(3):
        for d in range(3):
            a_c[c, d] = sum(w[c * 4 + k, d * 4 + k] for k in range(4)) / 4
    for k in range(4):
        for m in range(4):
            a_k[k, m] = sum(w[c * 4 + k, c * 4 + m] for c in range(3)) / 3
    a_k = a_k / torch.diagonal(a_k).mean()
    torch.testing.assert_close(torch.trace(a_c) * torch.trace(a_k), torch.trace(w))
    torch.testing.assert_close(kron.u_c, inverse_sqrt(a_c[None], 0.01)[0])
    torch.testing.assert_close(kron.u_k, inverse_sqrt(a_k[None], 0.01)[0])
    # the row transform is the row times kron(U_C, U_K), bias scaled separately
    rows = torch.randn(6, 13)
    want = torch.cat(
        [rows[:, :12] @ torch.kron(kron.u_c, kron.u_k), rows[:, 12:] * (1.01**-0.5)], dim=1
    )
    torch.testing.assert_close(kron.right(rows), want)
    assert KronA(kron.u_c, kron.u_k).row_macs == 3 * 4 * (3 + 4)


@pytest.mark.parametrize("path", ["factored", "materialized"])
def test_kron_preconditioner_transforms_conv_grads_and_keeps_linear_full(path, float64):
    torch.manual_seed(1)
    net = tiny_cnn_2d()
    x, y = _probe_batch()
    cfg = PreconditionerConfig(conv_a="kron", calibration_samples=8)
    pre = KroneckerPreconditioner.from_probes(net, x, y, per_sample_ce, cfg)
    kinds = {r["layer"]: r["A"] for r in pre.coverage() if r["type"] != "parameter"}
    assert kinds == {"0": "kron", "2": "kron", "6": "full"}
    for name in ("0", "2"):
        block = pre.blocks[name]
        module = block.module
        inp = torch.randn(3, *((1, 8, 8) if name == "0" else (4, 4, 4)))
        out = module(inp)
        dy = torch.randn_like(out)
        a, d = block.adapter.activations(module, inp), block.adapter.errors(module, dy)
        rows, err = block.adapter.rows(module, inp), block.adapter.error_rows(module, dy)
        w, bias, _ = block.sample_grads(rows, err, path=path)
        got = w if bias is None else torch.cat([w, bias.unsqueeze(-1)], -1)
        raw = torch.einsum("btgo,btgi->bgoi", d, a)
        k = block.a_kron
        ck = k.u_c.shape[0] * k.u_k.shape[0]
        u_a = torch.block_diag(
            torch.kron(k.u_c, k.u_k), *([torch.eye(1) * k.u_bias] if k.u_bias else [])
        )
        torch.testing.assert_close(got, raw @ u_a * block.scale)
        assert u_a.shape[0] in (ck, ck + 1)
    with pytest.raises(ValueError, match="conv_a='kronn'"):
        PreconditionerConfig(conv_a="kronn")


@pytest.mark.parametrize(
    "make, shape",
    [
        (
            lambda: nn.Conv1d(3, 4, 3, stride=2, dilation=2, padding=2, padding_mode="reflect"),
            (5, 3, 11),
        ),
        (lambda: nn.Conv2d(1, 3, 3, padding=1), (5, 1, 5, 5)),  # one channel: dense kron
        (lambda: nn.Conv3d(2, 3, 2, stride=(1, 2, 1), bias=False), (4, 2, 3, 4, 3)),
    ],
)
@pytest.mark.parametrize("factors", ["a", "ag"])
def test_kron_step_on_channel_mixed_input_equals_explicit_kronecker(make, shape, factors, float64):
    """U_C on the input channels before the unfold, U_K (and s, U_G) after: s U_G g U_A."""
    from dpkfc_med.curvature.preconditioner import KronA

    torch.manual_seed(4)
    module = make()
    adapter = adapter_for(module)
    g, n_a, n_g = adapter.dims(module)
    c, k = module.in_channels, math.prod(module.kernel_size)
    kron = KronA(inverse_sqrt(_spd(1, c), 0.1)[0], inverse_sqrt(_spd(1, k), 0.1)[0], 0.9)
    u_g = inverse_sqrt(_spd(g, n_g), 0.1) if factors == "ag" else None
    block = KroneckerBlock("l", module, adapter, None, u_g, 0.7, a_kron=kron)
    x = torch.randn(*shape)
    dy = torch.randn_like(module(x))
    raw = _outer(adapter.errors(module, dy), adapter.activations(module, x))
    bias = [torch.eye(1) * 0.9] if module.bias is not None else []
    u_a = torch.block_diag(torch.kron(kron.u_c, kron.u_k), *bias)
    want = 0.7 * (raw @ u_a if u_g is None else u_g @ raw @ u_a)
    rows = adapter.rows(module, kron.mix_channels(x))
    w, b, _ = block.sample_grads(rows, adapter.error_rows(module, dy), mixed=True)
    torch.testing.assert_close(w if b is None else torch.cat([w, b.unsqueeze(-1)], -1), want)
    with pytest.raises(ValueError, match="unmixed rows"):
        block.sample_grads(rows, adapter.error_rows(module, dy), mixed=True, raw_norms=2)
    block.a_kron = None
    with pytest.raises(ValueError, match="l: mixed rows need a kron"):
        block.sample_grads(rows, adapter.error_rows(module, dy), mixed=True)


def test_raw_grads_of_an_empty_batch(float64):
    module = nn.Conv2d(2, 3, 3, groups=1)
    block = KroneckerBlock("l", module, adapter_for(module))
    out = block.raw_grads(torch.zeros(0, 2, 5, 5), torch.zeros(0, 3, 3, 3))
    assert out.shape == (0, 1, 3, 19)


def test_low_rank_a_keeps_top_eigenpairs_and_whitens_the_tail_at_its_mean(float64):
    """rank_a: exact on A's top r eigenpairs, the tail at its mean; exact when the tail is flat."""
    torch.manual_seed(3)
    g, n, r, damping = 2, 9, 3, 0.01
    a = _spd(g, n)
    low, evals = LowRankA.from_factor(a, damping, r)
    lam, vec = torch.linalg.eigh(a)
    lam = lam + damping * lam.mean(-1, keepdim=True)
    u = low.dense()
    for gi in range(g):
        for i in range(n):  # every eigenvector of A is one of U_A's
            want = lam[gi, i].rsqrt() if i >= n - r else lam[gi, : n - r].mean().rsqrt()
            torch.testing.assert_close(u[gi] @ vec[gi, :, i], want * vec[gi, :, i])
    torch.testing.assert_close(evals, torch.linalg.eigvalsh(a))
    # a factor whose n - r smallest eigenvalues are equal: the same as the dense inverse root
    flat = vec @ torch.diag_embed(torch.cat([torch.full((g, n - r), 0.2), lam[:, -r:]], -1))
    flat = flat @ vec.transpose(-1, -2)
    torch.testing.assert_close(
        LowRankA.from_factor(flat, damping, r)[0].dense(), inverse_sqrt(flat, damping)
    )
    # rows with and without the bias coordinate, and the bias row
    x = torch.randn(4, g, 5, n)
    torch.testing.assert_close(low.right_w(x), x @ u)
    torch.testing.assert_close(low.right_w(x[..., :-1]), x[..., :-1] @ u[:, :-1])
    torch.testing.assert_close(low.last_row, u[:, -1])
    assert low.row_macs == 2 * n * r


def test_rank_a_applies_where_it_saves_work(float64):
    """Full factors with n_a > 2 r become low-rank; others stay dense; the report says which."""
    torch.manual_seed(4)
    model = tiny_cnn_2d()  # n_a: conv 10, conv 36 (no bias), linear 97
    x = torch.randn(32, 1, 8, 8)
    y = torch.randint(0, 3, (32,))
    cfg = PreconditionerConfig(rank_a=8, calibration_samples=8)
    pre = KroneckerPreconditioner.from_probes(model, x, y, per_sample_ce, cfg)
    kinds = {row["layer"]: row["A"] for row in pre.coverage() if row["type"] != "parameter"}
    assert kinds == {"0": "full", "2": "rank 8 + tail", "6": "rank 8 + tail"}
    assert pre.blocks["2"].u_a is None and pre.blocks["6"].a_low.v.shape == (1, 97, 8)
    with pytest.raises(ValueError, match="rank_a=0"):
        PreconditionerConfig(rank_a=0)
