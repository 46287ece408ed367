import json

import pytest
import torch
from torch import nn

import dpkfc_med.probes.sources as sources_module
from dpkfc_med.probes import (
    ImageProbeSource,
    NoiseKind,
    ProbeBatch,
    ProbeSource,
    TargetRule,
    check_probe_batch,
    fit_spectral_slope,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


class _ConstantClassifier(nn.Module):
    """Logits [M, K] that ignore the input: bias only (plus a zero-weight layer)."""

    def __init__(self, bias: list[float]) -> None:
        super().__init__()
        self.lin = nn.LazyLinear(len(bias))
        self.bias = torch.tensor(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.0 * self.lin(x.flatten(1)) + self.bias.to(x)


class _ConstantSegmenter(nn.Module):
    """Logits [M, K, *spatial] with the same bias at every voxel."""

    def __init__(self, bias: list[float], spatial_dims: int) -> None:
        super().__init__()
        conv = nn.Conv2d if spatial_dims == 2 else nn.Conv3d
        self.conv = conv(1, len(bias), kernel_size=1)
        with torch.no_grad():
            self.conv.weight.zero_()
            self.conv.bias.copy_(torch.tensor(bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


def test_protocol_and_classification_uniform() -> None:
    src = ImageProbeSource((28, 20), channels=1, num_classes=4, preset="xray")
    assert isinstance(src, ProbeSource)
    batch = src.sample(400, seed=0)
    assert isinstance(batch, ProbeBatch)
    assert batch.inputs.shape == (400, 1, 28, 20) and batch.inputs.dtype == torch.float32
    assert batch.targets.shape == (400,) and batch.targets.dtype == torch.int64
    assert set(batch.targets.tolist()) == {0, 1, 2, 3}
    # xray preset: unit range.
    assert float(batch.inputs.min()) >= 0.0 and float(batch.inputs.max()) <= 1.0


def test_seed_fully_determines_batch() -> None:
    src = ImageProbeSource((8, 12, 10), channels=2, num_classes=3, task="segmentation")
    a, b, c = src.sample(3, seed=9), src.sample(3, seed=9), src.sample(3, seed=10)
    assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
    assert not torch.equal(a.inputs, c.inputs) and not torch.equal(a.targets, c.targets)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_device_and_dtype(device: str, dtype: torch.dtype) -> None:
    src = ImageProbeSource((16, 16), channels=1, num_classes=2, task="segmentation")
    batch = src.sample(2, seed=1, device=torch.device(device), dtype=dtype)
    assert batch.inputs.device.type == device and batch.inputs.dtype == dtype
    assert batch.targets.device.type == device and batch.targets.dtype == torch.int64
    ref = src.sample(2, seed=1, dtype=torch.float64)
    assert torch.equal(batch.inputs.cpu(), ref.inputs.to(dtype))
    assert torch.equal(batch.targets.cpu(), ref.targets)


@pytest.mark.parametrize(("shape", "spacing"), [((40, 32), None), ((16, 20, 12), (1.0, 1.0, 2.5))])
def test_segmentation_uniform_targets(shape, spacing) -> None:
    k = 3
    src = ImageProbeSource(shape, channels=1, num_classes=k, task="segmentation", spacing=spacing)
    batch = src.sample(4, seed=2)
    t = batch.targets
    assert t.shape == (4, *shape) and t.dtype == torch.int64
    assert int(t.min()) >= 0 and int(t.max()) < k
    for sample in t:
        assert sample.unique().numel() > 1
    # Spatially coherent regions: neighbours mostly share a label (i.i.d. labels: about 1/3).
    same = (t[:, 1:] == t[:, :-1]).float().mean()
    assert float(same) > 0.8


def test_segmentation_shape_targets_are_blobs_on_a_background() -> None:
    shape = (16, 20, 12)
    src = ImageProbeSource(
        shape, channels=1, num_classes=3, task="segmentation", spacing=(1, 1, 2), target="shapes"
    )
    batch = src.sample(6, seed=4)
    again = src.sample(6, seed=4)
    uniform = ImageProbeSource(
        shape, channels=1, num_classes=3, task="segmentation", spacing=(1, 1, 2)
    ).sample(6, seed=4)
    assert torch.equal(batch.targets, again.targets)
    assert torch.equal(batch.inputs, uniform.inputs)  # only the targets change
    t = batch.targets
    assert t.shape == (6, *shape) and t.dtype == torch.int64
    fg = (t > 0).flatten(1).double().mean(1)
    assert torch.all((fg > 0.02) & (fg < 0.27))  # background dominates: 3-25 % foreground

    # coherent blobs: neighbours disagree less than half as often as the same labels shuffled
    # over the voxels (same marginals, no spatial structure), which fail the same check
    def disagreement(labels):
        return float((labels[:, 1:] != labels[:, :-1]).double().mean())

    g = torch.Generator().manual_seed(0)
    shuffled = t.flatten()[torch.randperm(t.numel(), generator=g)].view_as(t)
    assert disagreement(t) < 0.5 * disagreement(shuffled)
    assert not disagreement(shuffled) < 0.5 * disagreement(shuffled.flip(1))
    assert "blobs" in src.describe()["target_rule"]
    with pytest.raises(ValueError, match="segmentation"):
        ImageProbeSource((8, 8), channels=1, num_classes=2, target="shapes")


def test_model_targets_classification_follow_model() -> None:
    src = ImageProbeSource((12, 12), channels=1, num_classes=3, target="model")
    model = _ConstantClassifier([0.0, 12.0, 0.0])
    model(torch.zeros(1, 1, 12, 12))  # materialise the lazy layer
    model.train()
    batch = src.sample(300, seed=0, model=model)
    assert float((batch.targets == 1).float().mean()) > 0.98
    # Sampled, not argmax: a flat softmax gives all classes in about equal shares.
    flat = src.sample(3000, seed=0, model=_ConstantClassifier([0.0, 0.0, 0.0])).targets
    shares = torch.bincount(flat, minlength=3).float() / 3000
    assert bool((shares - 1 / 3).abs().lt(0.04).all()), shares
    # The model's mode is left alone and no gradients are recorded.
    assert model.training
    assert all(p.grad is None for p in model.parameters())


def test_model_targets_binary_single_logit() -> None:
    src = ImageProbeSource((8, 8), channels=1, num_classes=2, target="model")
    batch = src.sample(200, seed=0, model=_ConstantClassifier([-12.0]))
    assert float((batch.targets == 0).float().mean()) > 0.98


@pytest.mark.parametrize(("shape", "dims"), [((16, 12), 2), ((6, 8, 10), 3)])
def test_model_targets_segmentation(shape, dims: int) -> None:
    src = ImageProbeSource(shape, channels=1, num_classes=3, task="segmentation", target="model")
    model = _ConstantSegmenter([0.0, 0.0, 12.0], dims).eval()
    batch = src.sample(3, seed=4, model=model)
    assert batch.targets.shape == (3, *shape)
    assert float((batch.targets == 2).float().mean()) > 0.98
    assert not model.training


def test_model_target_errors() -> None:
    src = ImageProbeSource((8, 8), channels=1, num_classes=3, target="model")
    with pytest.raises(ValueError, match="model=None; pass model="):
        src.sample(2, seed=0)
    with pytest.raises(ValueError, match=r"expected model output \[2, 3\]"):
        src.sample(2, seed=0, model=_ConstantClassifier([0.0, 1.0]))
    seg = ImageProbeSource((8, 8), channels=1, num_classes=3, task="segmentation", target="model")
    with pytest.raises(ValueError, match=r"expected model output \[2, 3, 8, 8\]"):
        seg.sample(2, seed=0, model=_ConstantClassifier([0.0, 1.0, 2.0]))
    with pytest.raises(ValueError, match="NaN or inf logits"):
        src.sample(2, seed=0, model=_ConstantClassifier([0.0, float("nan"), 0.0]))


def test_intensity_presets_and_overrides() -> None:
    mri = ImageProbeSource((16, 16), channels=1, num_classes=2, preset="MRI").sample(4, seed=0)
    flat = mri.inputs.double().flatten(1)
    assert (
        float(flat.mean(1).abs().max()) < 1e-6
        and float((flat.std(1, correction=0) - 1).abs().max()) < 1e-5
    )
    ct = ImageProbeSource((16, 16), channels=1, num_classes=2, preset="ct", intensity=(-1.0, 1.0))
    x = ct.sample(4, seed=0).inputs
    assert float(x.min()) >= -1.0 and float(x.max()) <= 1.0 and float(x.min()) < -0.5
    with pytest.raises(ValueError, match=r"pass intensity=\(low, high\)"):
        ImageProbeSource((16, 16), channels=1, num_classes=2, intensity="range")


def test_alpha_from_preset_and_override() -> None:
    mammo = ImageProbeSource(
        (96, 64), channels=1, num_classes=2, preset="mammography", intensity="zscore"
    )
    assert mammo.alpha == 3.0
    assert abs(fit_spectral_slope(mammo.sample(4, seed=0).inputs) + 3.0) < 0.25
    assert ImageProbeSource((8, 8), channels=1, num_classes=2, alpha=1.5).alpha == 1.5
    white = ImageProbeSource((96, 64), channels=1, num_classes=2, kind="WHITE", intensity="zscore")
    assert white.kind is NoiseKind.WHITE and white.alpha is None
    assert abs(fit_spectral_slope(white.sample(4, seed=0).inputs)) < 0.15
    with pytest.raises(ValueError, match="applies only to kind='pink'"):
        ImageProbeSource((8, 8), channels=1, num_classes=2, kind="white", alpha=2.0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"kind": "pnik"},
            r"kind='pnik' is not allowed \(did you mean 'pink'\?\); "
            r"choose one of \['pink', 'white', 'shapes'\]",
        ),
        ({"task": "segmentaton"}, "did you mean 'segmentation'"),
        (
            {"target": "modle"},
            r"target='modle' is not allowed \(did you mean 'model'\?\); "
            r"choose one of \['uniform', 'model', 'shapes'\]",
        ),
        ({"preset": "fundis"}, "did you mean 'fundus'"),
        ({"intensity": "unitrange"}, "did you mean 'unit_range'"),
        ({"spatial_shape": (0, 8)}, "positive ints"),
        ({"channels": 0}, "channels=0 must be a positive int"),
        ({"num_classes": 1}, "num_classes=1 must be an int >= 2"),
        ({"spacing": (1.0,)}, "1 entries but the data has 2 spatial"),
    ],
)
def test_invalid_options(kwargs: dict, match: str) -> None:
    args = {"spatial_shape": (8, 8), "channels": 1, "num_classes": 2} | kwargs
    shape = args.pop("spatial_shape")
    with pytest.raises(ValueError, match=match):
        ImageProbeSource(shape, **args)


def test_enums_accept_plain_strings() -> None:
    src = ImageProbeSource(
        (8, 8), channels=1, num_classes=2, kind="Pink", target=TargetRule.UNIFORM
    )
    assert src.kind is NoiseKind.PINK and src.target is TargetRule.UNIFORM


def test_sample_argument_validation() -> None:
    src = ImageProbeSource((8, 8), channels=1, num_classes=2)
    with pytest.raises(ValueError, match="num=0"):
        src.sample(0, seed=0)
    with pytest.raises(ValueError, match="seed=-1"):
        src.sample(1, seed=-1)
    with pytest.raises(ValueError, match="floating dtype"):
        src.sample(1, seed=0, dtype=torch.int32)


def test_channels_default_to_preset_and_data_wins() -> None:
    assert ImageProbeSource((8, 8), channels=None, num_classes=2, preset="fundus").channels == 3
    four = ImageProbeSource((8, 8, 8), channels=4, num_classes=2, preset="mri")
    assert four.sample(1, seed=0).inputs.shape == (1, 4, 8, 8, 8)


def test_non_finite_probes_detected(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(shape, *, batch, channels, **_):
        return torch.full((batch, channels, *shape), float("nan"), dtype=torch.float64)

    monkeypatch.setattr(sources_module, "pink_noise", broken)
    src = ImageProbeSource((8, 8), channels=1, num_classes=2, intensity="zscore")
    with pytest.raises(ValueError, match="128 of 128 probe input values are NaN or inf"):
        src.sample(2, seed=0)
    bad = ProbeBatch(torch.tensor([[1.0, float("inf")]]), torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="1 of 2 probe input values"):
        check_probe_batch(bad)
    with pytest.raises(ValueError, match="int64"):
        check_probe_batch(ProbeBatch(torch.zeros(1, 2), torch.zeros(1)))


def test_describe_is_json_and_complete() -> None:
    src = ImageProbeSource(
        (16, 20, 12),
        channels=1,
        num_classes=3,
        task="segmentation",
        preset="mri",
        spacing=(1, 1, 2.5),
    )
    record = json.loads(json.dumps(src.describe()))
    assert record["kind"] == "pink" and record["alpha"] == 2.0
    assert "f^(-alpha)" in record["spectrum_convention"]
    assert record["preset"] == "mri" and "Field" in record["preset_citation"]
    assert record["spacing_mm"] == [1.0, 1.0, 2.5]
    assert record["intensity"]["mode"] == "zscore"
    assert record["target"] == "uniform" and "argmax" in record["target_rule"]
    assert record["task"] == "segmentation" and record["uses_private_data"] is False


def test_shape_probes_are_volumes_with_their_own_label_maps() -> None:
    """kind='shapes': each channel orders the classes by contrast; targets are the drawn maps."""
    from dpkfc_med.probes import shape_volumes

    src = ImageProbeSource(
        (10, 14, 12),
        channels=2,
        num_classes=3,
        task="segmentation",
        kind="shapes",
        preset="mri",
        spacing=(1.0, 1.0, 2.0),
    )
    batch = src.sample(4, seed=7, dtype=torch.float64)
    again = src.sample(4, seed=7, dtype=torch.float64)
    assert torch.equal(batch.inputs, again.inputs) and torch.equal(batch.targets, again.targets)
    assert batch.inputs.shape == (4, 2, 10, 14, 12) and batch.targets.shape == (4, 10, 14, 12)
    # the targets are exactly the label maps the volumes were drawn from (same generator)
    images, labels = shape_volumes(
        (10, 14, 12),
        num=4,
        channels=2,
        num_classes=3,
        spacing=(1.0, 1.0, 2.0),
        alpha=src.alpha,
        generator=torch.Generator().manual_seed(7),
    )
    assert torch.equal(batch.targets, labels)
    torch.testing.assert_close(batch.inputs, images, rtol=0, atol=1e-12)  # z-score preset
    flat = batch.inputs.flatten(2)
    torch.testing.assert_close(
        flat.mean(2), torch.zeros(4, 2, dtype=torch.float64), atol=1e-9, rtol=0
    )
    for i in range(4):
        for c in range(2):  # class means monotone in the class id, per channel
            means = [
                float(batch.inputs[i, c][batch.targets[i] == k].mean())
                for k in range(3)
                if (batch.targets[i] == k).sum() > 10
            ]
            diffs = torch.tensor(means).diff()
            assert torch.all(diffs > 0) or torch.all(diffs < 0), (i, c, means)
    assert "label maps the shape volumes" in src.describe()["target_rule"]
    assert src.describe()["kind"] == "shapes"
    # model-sampled targets still apply
    model = _ConstantSegmenter([0.0, 9.0, 0.0], spatial_dims=3).double()
    fisher = ImageProbeSource(
        (10, 14, 12),
        channels=1,
        num_classes=3,
        task="segmentation",
        kind="shapes",
        target="model",
    )
    sampled = fisher.sample(3, seed=1, model=model, dtype=torch.float64).targets
    assert (sampled == 1).double().mean() > 0.95
    with pytest.raises(ValueError, match="kind='shapes'.*segmentation"):
        ImageProbeSource((8, 8), channels=1, num_classes=2, kind="shapes")


def test_pretraining_volumes_are_the_single_channel_shape_volumes() -> None:
    from dpkfc_med.probes import shape_volumes
    from dpkfc_med.training.pretrain import synthetic_shapes

    kw = dict(num=3, num_classes=3, spacing=(1.0, 1.0, 1.0), alpha=2.0)
    x, y = synthetic_shapes((8, 10, 6), generator=torch.Generator().manual_seed(3), **kw)
    images, labels = shape_volumes((8, 10, 6), generator=torch.Generator().manual_seed(3), **kw)
    assert x.dtype == torch.float32 and torch.equal(x, images.float()) and torch.equal(y, labels)
