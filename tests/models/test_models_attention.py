"""MONAI ViT, UNETR and SwinUNETR: the fixer keeps outputs, per-sample gradients are exact,
the curvature covers the attention layers, and the privacy contract holds."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from monai.networks import nets
from opacus import GradSampleModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpkfc_med.curvature.factors import estimate_factors
from dpkfc_med.curvature.preconditioner import PreconditionerConfig, coverage_shares
from dpkfc_med.models import ModelCompatibilityError, build_model, validate_private_compatible
from dpkfc_med.models.fix import make_private_compatible
from dpkfc_med.privacy.engine import PrivacyEngine
from tests.conftest import GaussianProbes, summed_clipped

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")

TINY = {
    "vit": {"patch_size": 4, "hidden_size": 8, "mlp_dim": 16, "num_layers": 2, "num_heads": 2},
    "unetr": {"hidden_size": 16, "mlp_dim": 32, "num_heads": 2, "feature_size": 4},
    # depth 2: the second block of each stage uses shifted windows (the attention mask)
    "swinunetr": {"feature_size": 12, "depths": (2, 2, 2, 2), "num_heads": (3, 3, 3, 3)},
}
SIZE = {"vit": (8, 8), "unetr": (32, 32), "swinunetr": (64, 64)}


def _tiny(name: str, classes: int = 3) -> nn.Module:
    model, _ = build_model(
        name,
        spatial_dims=2,
        in_channels=1,
        out_channels=classes,
        input_size=SIZE[name],
        **TINY[name],
    )
    return model


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-sample cross-entropy (mean over pixels for label maps)."""
    loss = F.cross_entropy(out, y, reduction="none")
    return loss.flatten(1).mean(1) if loss.dim() > 1 else loss


def _targets(name: str, n: int, classes: int = 3, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (n,) if name == "vit" else (n, *SIZE[name])
    return torch.randint(0, classes, shape, generator=g)


class _Probes(GaussianProbes):
    """Gaussian probes of one input shape; label maps for segmentation networks."""

    def __init__(self, shape: tuple[int, ...], *, segmentation: bool, classes: int = 3) -> None:
        super().__init__(shape, num_classes=classes)
        self.segmentation = segmentation

    def sample(self, num, *, seed, model=None, device=None, dtype=torch.float32):
        x, y = super().sample(num, seed=seed, dtype=dtype)
        if self.segmentation:
            g = torch.Generator().manual_seed(seed + 1)
            y = torch.randint(0, self.num_classes, (num, *self.shape[1:]), generator=g)
        return x, y


def _tiny_probes(name: str) -> _Probes:
    return _Probes((1, *SIZE[name]), segmentation=name != "vit")


@pytest.mark.parametrize("name", ["vit", "unetr", "swinunetr"])
def test_fixed_network_computes_what_monai_computes(name, float64):
    """The rewritten forwards equal MONAI's own, weight for weight (eval and train mode)."""
    torch.manual_seed(0)
    model, fixes = build_model(
        name,
        spatial_dims=2,
        in_channels=1,
        out_channels=3,
        input_size=SIZE[name],
        dp_fix=False,
        **TINY[name],
    )
    fixed, fixes = make_private_compatible(copy.deepcopy(model))
    assert fixes and all(f.reason for f in fixes)
    fixed.load_state_dict(_renamed(model.state_dict(), fixed.state_dict()))
    x = torch.randn(3, 1, *SIZE[name])
    for mode in (False, True):  # dropout rates are 0, so train mode is deterministic too
        model.train(mode)
        fixed.train(mode)
        torch.testing.assert_close(fixed(x), model(x))


def _renamed(original: dict, target: dict) -> dict:
    """Map MONAI parameter names to the fixed network's leaf modules."""
    moves = {
        "position_embeddings": "position_embedding.weight",
        "cls_token": "class_token.weight",
        "relative_position_bias_table": "relative_position_bias.weight",
    }
    out = {}
    for key, value in original.items():
        for old, new in moves.items():
            if key.endswith(old):
                key = key[: -len(old)] + new
        out[key] = value
    assert set(out) == set(target)
    return out


@pytest.mark.parametrize("name", ["vit", "unetr", "swinunetr"])
def test_opacus_per_sample_gradients_equal_one_backward_per_sample(name, float64):
    """Every trainable parameter's grad_sample is that sample's own gradient (Swin: not a
    window's), through Opacus' own GradSampleModule."""
    torch.manual_seed(1)
    model = _tiny(name)
    x, y = torch.randn(3, 1, *SIZE[name]), _targets(name, 3)
    reference = copy.deepcopy(model)
    params = [p for p in reference.parameters() if p.requires_grad]
    per_sample = [
        torch.autograd.grad(_loss(reference(x[i : i + 1]), y[i : i + 1]).sum(), params)
        for i in range(3)
    ]
    gsm = GradSampleModule(model, loss_reduction="sum")
    _loss(gsm(x), y).sum().backward()
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert len(trained) == len(params)
    for j, (pname, p) in enumerate(trained):
        expected = torch.stack([g[j] for g in per_sample])
        torch.testing.assert_close(p.grad_sample, expected, msg=pname)


def test_unused_cross_attention_norm_is_frozen_and_reported():
    model = _tiny("vit")
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen and all(".norm_cross_attn." in n for n in frozen)


def test_raw_parameter_next_to_layers_is_named_with_the_fix():
    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.token = nn.Parameter(torch.zeros(1, 4))
            self.proj = nn.Linear(4, 4)

        def forward(self, x):
            return self.proj(x + self.token)

    model = nn.Sequential(nn.Linear(4, 4), Holder())
    with pytest.raises(ModelCompatibilityError) as info:
        validate_private_compatible(model)
    text = str(info.value)
    assert "1: Holder uses its own parameters (token) next to trainable layers (proj)" in text
    assert "move the parameters into a leaf module" in text


def test_kfac_factors_of_attention_layers_equal_brute_force(float64):
    """Expand and reduce factors of qkv / out_proj / MLP layers of a ViT block, by hand."""
    torch.manual_seed(2)
    model = _tiny("vit")
    x, y = torch.randn(5, 1, 8, 8), _targets("vit", 5)
    names = ["vit.blocks.0.attn.qkv", "vit.blocks.0.attn.out_proj", "vit.blocks.1.mlp.linear1"]
    modules = dict(model.named_modules())
    captured: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def hook(name):
        def fn(mod, inputs, out):
            out.retain_grad()
            captured[name] = (inputs[0], out)

        return fn

    handles = [modules[n].register_forward_hook(hook(n)) for n in names]
    _loss(model(x), y).sum().backward()
    for h in handles:
        h.remove()
    for reduction in ("expand", "reduce"):
        factors = estimate_factors(
            model, x, y, _loss, layers={n: modules[n] for n in names}, reduction=reduction
        )
        for n in names:
            a, out = captured[n]
            if modules[n].bias is not None:
                a = torch.cat([a, torch.ones_like(a[..., :1])], -1)
            delta = out.grad
            m, t = a.shape[0], a.shape[1]
            if reduction == "expand":
                big_a = torch.einsum("mti,mtj->ij", a, a) / (m * t)
                big_g = torch.einsum("mti,mtj->ij", delta, delta) / m
            else:
                ab, db = a.mean(1), delta.sum(1)
                big_a, big_g = ab.T @ ab / m, db.T @ db / m
            torch.testing.assert_close(factors[n].a[0], big_a, msg=f"{n} A {reduction}")
            torch.testing.assert_close(factors[n].g[0], big_g, msg=f"{n} G {reduction}")


def _engine(model, x, y, probes, *, batch=4, **kw):
    """DP-KFC through the engine on ``(x, y)`` with ``probes`` (sigma 1, C 1)."""
    eng = PrivacyEngine(seed=3)
    out = eng.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=batch),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        delta=1e-5,
        method="dp-kfc",
        probe_source=probes,
        probe_loss=_loss,
        **kw,
    )
    return eng, out


def test_packed_qkv_rows_transform_equals_the_dense_kronecker_operator(float64):
    """The hook's per-sample qkv gradient is s (U_G (x) U_A) vec(g_i) with g_i by autograd."""
    torch.manual_seed(4)
    model = _tiny("vit")
    x, y = torch.randn(4, 1, 8, 8), _targets("vit", 4)
    reference = copy.deepcopy(model)
    cfg = PreconditionerConfig(factors="ag", rank_a=None, num_probes=32, chunk_size=16)
    eng, (pm, popt, _) = _engine(
        model, x, y, _tiny_probes("vit"), preconditioner=cfg, loss_reduction="sum"
    )
    name = "vit.blocks.0.attn.qkv"
    block = eng.preconditioner.blocks[name]
    qkv = dict(reference.named_modules())[name].weight  # [3 * hidden, hidden]: packed q, k, v
    raw = torch.stack(
        [
            torch.autograd.grad(_loss(reference(x[i : i + 1]), y[i : i + 1]).sum(), qkv)[0]
            for i in range(4)
        ]
    )
    dense = torch.kron(block.u_g[0].contiguous(), block.u_a[0].T.contiguous()) * block.scale
    expected = (raw.flatten(1) @ dense.T).reshape(raw.shape)
    popt.zero_grad()
    _loss(pm(x), y).sum().backward()
    got = dict(model.named_modules())[name].weight.grad_sample
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("family", ["kfac", "shampoo", "diagonal"])
def test_unetr_sensitivity_and_data_independence(family, float64):
    """Adding one (extreme) sample moves the clipped sum by at most C, every parameter
    (position embedding, LayerNorms, norm_cross_attn frozen) included; the preconditioner is
    the same whatever the private data."""
    torch.manual_seed(5)
    base = _tiny("unetr")
    pres = []
    for seed in (0, 1):
        g = torch.Generator().manual_seed(seed)
        x, y = torch.randn(9, 1, 32, 32, generator=g), _targets("unetr", 9, seed=seed)
        cfg = PreconditionerConfig(family=family, num_probes=8, chunk_size=4)
        eng, (pm, popt, _) = _engine(
            copy.deepcopy(base),
            x,
            y,
            _tiny_probes("unetr"),
            probe_seed=7,
            preconditioner=cfg,
            loss_reduction="sum",
        )
        pres.append(eng.preconditioner)
        if seed == 0:
            covered = {
                p
                for b in eng.preconditioner.blocks.values()
                for p in b.module.parameters(recurse=False)
            }
            fallback = {id(fb.param) for fb in eng.preconditioner.fallbacks.values()}
            trainable = [p for p in pm._module.parameters() if p.requires_grad]
            assert all(p in covered or id(p) in fallback for p in trainable)

            def clipped(xb, yb, pm=pm, popt=popt):
                return summed_clipped(popt, lambda: _loss(pm(xb), yb).sum().backward())

            diff = (clipped(x, y) - clipped(x[:8], y[:8])).norm()
            assert 1e-3 < diff <= 1.0 + 1e-9
    for name, block in pres[0].blocks.items():
        other = pres[1].blocks[name]
        for field in ("u_a", "u_g", "u_elem"):
            u, v = getattr(block, field), getattr(other, field)
            assert (u is None and v is None) or torch.equal(u, v), (name, field)
        assert block.scale == other.scale
    for name, fb in pres[0].fallbacks.items():
        assert fb.scale == pres[1].fallbacks[name].scale


@pytest.mark.parametrize(
    ("name", "spatial", "size", "kwargs"),
    [
        ("vit", 2, (28, 28), {}),
        ("unetr", 3, (32, 48, 32), {}),
    ],
)
def test_default_transformers_have_full_blocks_on_95_percent_of_parameters(
    name, spatial, size, kwargs
):
    """Coverage of the registry defaults at the shipped input sizes (UNETR's 16^3 patch
    embedding has 4097 inputs, so its config raises max_factor_dim to 8192)."""
    torch.manual_seed(6)
    model, _ = build_model(
        name, spatial_dims=spatial, in_channels=1, out_channels=2, input_size=size, **kwargs
    )
    cfg = PreconditionerConfig(
        num_probes=4, chunk_size=2, max_factor_dim=8192, calibration_samples=2
    )
    probes = _Probes((1, *size), segmentation=name == "unetr", classes=2)
    x, y = probes.sample(4, seed=0)
    eng, _ = _engine(model, x, y, probes, batch=2, preconditioner=cfg)
    rows = eng.preconditioner.coverage()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # brute force: a block of the family (dense or low-rank-plus-tail A), not a diagonal A
    # or a fallback
    full = sum(
        r["params"]
        for r in rows
        if not r["adapter"].startswith("fallback") and r["A"] not in ("diagonal", "none")
    )
    shares = coverage_shares(rows)
    assert shares["trainable"] == trainable
    assert shares["full_block"] == pytest.approx(full / trainable)
    assert sum(v for k, v in shares.items() if k != "trainable") == pytest.approx(1.0)
    assert shares["full_block"] >= 0.95
    attention = [r for r in rows if ".attn." in r["layer"] and r["type"] == "Linear"]
    assert attention and all(r["A"] != "diagonal" for r in attention)


def test_monai_swinunetr_window_attention_needs_its_block():
    """Called outside its SwinTransformerBlock the window attention refuses (it cannot know
    which windows belong to which sample)."""
    model = _tiny("swinunetr")
    attn = model.swinViT.layers1[0].blocks[0].attn
    attn.samples = None
    with pytest.raises(RuntimeError, match="call it through its SwinTransformerBlock"):
        attn(torch.randn(4, 16, 12), None)
    assert isinstance(model.swinViT, nets.swin_unetr.SwinTransformer)
