"""Tests for dpkfc_med.models.fix: replacements, fix records, error messages, Opacus hooks."""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from monai.networks.blocks.dynunet_block import UnetResBlock
from monai.networks.blocks.segresnet_block import ResBlock
from monai.networks.nets.resnet import ResNetBlock, ResNetBottleneck
from monai.networks.nets.segresnet_ds import SegResBlock
from opacus import GradSampleModule
from opacus.layers import DPLSTM
from opacus.validators import ModuleValidator
from torch import nn

from dpkfc_med.models import (
    Fix,
    ModelCompatibilityError,
    build_model,
    make_private_compatible,
    validate_private_compatible,
)

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")

BATCH_NORM_MESSAGE = (
    "encoder.down.2.norm: BatchNorm3d mixes samples and breaks per-sample privacy; "
    'call dpkfc_med.models.make_private_compatible(model) or choose norm="instance"'
)


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv = nn.Conv3d(cin, cout, 3, padding=1)
        self.norm = nn.BatchNorm3d(cout)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.norm(self.conv(x)))


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Sequential(_Block(1, 4), _Block(4, 8), _Block(8, 6))


class _TinyNet(nn.Module):
    """3D net with BatchNorm3d and in-place ReLU at encoder.down.{0,1,2}."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = _Encoder()
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder.down(x).mean(dim=(2, 3, 4)))


def _per_sample_mismatches(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[str]:
    """Run Opacus on ``model``; compare per-sample grads with the batch grad and with
    one-sample-at-a-time backward passes. Returns one line per mismatching parameter."""
    reference = copy.deepcopy(model)
    gsm = GradSampleModule(model, loss_reduction="sum")
    F.cross_entropy(gsm(x), y, reduction="sum").backward()

    singles = []
    for i in range(len(x)):
        reference.zero_grad()
        F.cross_entropy(reference(x[i : i + 1]), y[i : i + 1], reduction="sum").backward()
        singles.append({n: p.grad.clone() for n, p in reference.named_parameters()})

    mismatches = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        sample = getattr(p, "grad_sample", None)
        if sample is None:
            mismatches.append(f"{name}: no grad_sample")
            continue
        if sample.shape != (len(x), *p.shape):
            mismatches.append(f"{name}: grad_sample shape {tuple(sample.shape)}")
            continue
        if not torch.allclose(sample.sum(0), p.grad, rtol=1e-9, atol=1e-12):
            err = (sample.sum(0) - p.grad).abs().max().item()
            mismatches.append(f"{name}: sum of per-sample grads != batch grad (max err {err})")
        for i, single in enumerate(singles):
            if not torch.allclose(sample[i], single[name], rtol=1e-9, atol=1e-12):
                mismatches.append(f"{name}: sample {i} != its own backward pass")
    return mismatches


# --- DenseNet121 under Opacus ------------------------------------------------------------


def _densenet(**kwargs: int) -> tuple[nn.Module, list[Fix]]:
    torch.manual_seed(0)
    return build_model("densenet121", spatial_dims=2, in_channels=1, out_channels=3, **kwargs)


def test_densenet121_per_sample_grads_match_after_fix() -> None:
    # All 121 layers and every in-place ReLU, at a sixteenth of the width (0.4M instead of
    # 7M parameters) so that three float64 backward passes stay fast on a shared CPU.
    model, fixes = _densenet(init_features=16, growth_rate=8)
    assert any("inplace=True" in f.before for f in fixes)
    model = model.double()
    # 64x64 leaves 2x2 at the last GroupNorm, so each group has more than one value even
    # in the one-sample reference passes.
    x = torch.randn(2, 1, 64, 64, dtype=torch.float64)
    y = torch.tensor([0, 2])
    mismatches = _per_sample_mismatches(model, x, y)
    assert not mismatches, "\n".join(mismatches)


def test_densenet121_inplace_relu_breaks_opacus_hooks() -> None:
    """Design doc: in-place ReLU fails under Opacus hooks until inplace is turned off."""
    model, fixes = _densenet()
    inplace_paths = [f.path for f in fixes if "inplace=True" in f.before]
    assert inplace_paths
    for path in inplace_paths:  # undo only the in-place part of the fix
        model.get_submodule(path).inplace = True

    with pytest.raises(ModelCompatibilityError) as info:
        validate_private_compatible(model)
    assert len(info.value.problems) == len(inplace_paths)
    assert re.search(
        rf"^{re.escape(inplace_paths[0])}: ReLU\(inplace=True\) .*backward hooks.*"
        r"pass inplace=False$",
        str(info.value),
        flags=re.MULTILINE,
    )

    gsm = GradSampleModule(model.double(), loss_reduction="sum")
    x = torch.randn(2, 1, 32, 32, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="BackwardHookFunction.*modified inplace"):
        F.cross_entropy(gsm(x), torch.tensor([0, 1]), reduction="sum").backward()


# --- validation messages -----------------------------------------------------------------


def test_batchnorm3d_reported_with_path_and_fix() -> None:
    with pytest.raises(ModelCompatibilityError, match=re.escape(BATCH_NORM_MESSAGE)):
        validate_private_compatible(_TinyNet())


def test_validate_collects_all_problems_once() -> None:
    with pytest.raises(ModelCompatibilityError) as info:
        validate_private_compatible(_TinyNet())
    lines = str(info.value).splitlines()
    assert lines == list(info.value.problems)
    assert len(lines) == 6  # three BatchNorm3d, three in-place ReLU
    assert {line.split(":")[0] for line in lines} == {
        f"encoder.down.{i}.{leaf}" for i in range(3) for leaf in ("norm", "act")
    }
    assert isinstance(info.value, ValueError)


def test_monai_resnet_batchnorm_reported() -> None:
    model, fixes = build_model(
        "resnet10", spatial_dims=3, in_channels=1, out_channels=2, dp_fix=False
    )
    assert fixes == []
    with pytest.raises(ModelCompatibilityError) as info:
        validate_private_compatible(model)
    message = str(info.value)
    assert re.search(r"^bn1: BatchNorm3d mixes samples", message, flags=re.MULTILINE)
    assert re.search(
        r"^layer1\.0: ResNetBlock adds its skip connection in place", message, flags=re.M
    )


def test_batchnorm_without_affine_still_reported() -> None:
    """Opacus skips BatchNorm without parameters, but its forward still mixes samples."""
    with pytest.raises(ModelCompatibilityError, match=r"^1: BatchNorm2d mixes samples"):
        validate_private_compatible(
            nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2, affine=False))
        )


def test_instance_norm_running_stats_reported() -> None:
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.InstanceNorm2d(2, track_running_stats=True))
    with pytest.raises(ModelCompatibilityError, match=r"^1: InstanceNorm2d tracks running stat"):
        validate_private_compatible(model)


def test_eval_mode_reported() -> None:
    model = nn.Sequential(nn.Linear(3, 2)).eval()
    with pytest.raises(ModelCompatibilityError, match=r"^<root>: .*eval mode.*model\.train\(\)"):
        validate_private_compatible(model)


def test_trainable_module_with_buffers_reported() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(3))
            self.register_buffer("count", torch.zeros(()))

    model = nn.Sequential(nn.Linear(3, 3), Scaled())
    with pytest.raises(
        ModelCompatibilityError, match=r"^1: Scaled is trainable and holds buffers \(count\)"
    ):
        validate_private_compatible(model)


def test_opacus_validator_messages_translated() -> None:
    model = nn.ModuleDict({"rnn": nn.LSTM(4, 4), "head": nn.Linear(4, 2)})
    assert ModuleValidator.validate(model, strict=False)  # Opacus rejects nn.LSTM
    with pytest.raises(
        ModelCompatibilityError,
        match=r"^rnn: LSTM is not supported by Opacus' per-sample gradient hooks; "
        r"call dpkfc_med\.models\.make_private_compatible\(model\)",
    ):
        validate_private_compatible(model)


# --- fixing ------------------------------------------------------------------------------


def test_fix_records_list_paths() -> None:
    model, fixes = make_private_compatible(_TinyNet())
    assert [f.path for f in fixes] == [
        "encoder.down.0.norm",
        "encoder.down.1.norm",
        "encoder.down.2.norm",
        "encoder.down.0.act",
        "encoder.down.1.act",
        "encoder.down.2.act",
    ]
    assert fixes[0].before.startswith("BatchNorm3d(4")
    assert fixes[0].after.startswith("GroupNorm(4, 4")
    assert fixes[3].before == "ReLU(inplace=True)" and fixes[3].after == "ReLU()"
    assert str(fixes[0]).startswith("encoder.down.0.norm: BatchNorm3d(4")
    with pytest.raises(dataclasses.FrozenInstanceError):
        fixes[0].path = "elsewhere"  # type: ignore[misc]
    validate_private_compatible(model)
    assert ModuleValidator.validate(model, strict=False) == []
    assert make_private_compatible(model)[1] == []  # idempotent


@pytest.mark.parametrize(
    ("channels", "groups"), [(64, 32), (48, 24), (96, 32), (6, 6), (7, 7), (40, 20)]
)
def test_default_groups_is_largest_divisor_up_to_32(channels: int, groups: int) -> None:
    model, _ = make_private_compatible(nn.Sequential(nn.BatchNorm2d(channels)))
    assert isinstance(model[0], nn.GroupNorm)
    assert (model[0].num_groups, model[0].num_channels) == (groups, channels)


def test_given_num_groups_must_divide_all_channels() -> None:
    model = nn.Sequential(nn.BatchNorm2d(64), nn.BatchNorm2d(6), nn.BatchNorm2d(10))
    with pytest.raises(ValueError) as info:
        make_private_compatible(model, num_groups=4)
    assert str(info.value).splitlines() == [  # every culprit, allowed values, the fix
        "1: num_groups=4 does not divide the 6 channels of BatchNorm2d; "
        "choose one of [1, 2, 3, 6] or leave num_groups=None",
        "2: num_groups=4 does not divide the 10 channels of BatchNorm2d; "
        "choose one of [1, 2, 5, 10] or leave num_groups=None",
    ]
    assert all(isinstance(m, nn.BatchNorm2d) for m in model)  # nothing changed on error
    fixed, _ = make_private_compatible(model, num_groups=2)
    assert [m.num_groups for m in fixed] == [2, 2, 2]


def test_affine_parameters_carried_over_and_frozen_stays_frozen() -> None:
    bn = nn.BatchNorm2d(4).double()
    with torch.no_grad():
        bn.weight.copy_(torch.arange(4.0))
        bn.bias.fill_(0.5)
    bn.bias.requires_grad_(False)
    model, _ = make_private_compatible(nn.Sequential(bn))
    gn = model[0]
    assert gn.weight.dtype == torch.float64
    assert torch.equal(gn.weight, torch.arange(4.0, dtype=torch.float64))
    assert torch.equal(gn.bias, torch.full((4,), 0.5, dtype=torch.float64))
    assert gn.weight.requires_grad and not gn.bias.requires_grad


def test_instance_choice_matches_spatial_dims() -> None:
    model = nn.Sequential(
        nn.BatchNorm1d(3), nn.BatchNorm2d(4), nn.BatchNorm3d(5), nn.SyncBatchNorm(6)
    )
    model, fixes = make_private_compatible(model, norm="instance")
    assert [type(m) for m in model[:3]] == [nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d]
    for m in model[:3]:
        assert m.affine and not m.track_running_stats
    # SyncBatchNorm has no fixed dims: GroupNorm with one group per channel is instance norm.
    assert isinstance(model[3], nn.GroupNorm) and model[3].num_groups == 6
    assert len(fixes) == 4
    validate_private_compatible(model)


def test_norm_option_errors() -> None:
    with pytest.raises(ValueError, match=r"unknown norm 'grup' \(did you mean 'group'\?\)"):
        make_private_compatible(nn.Linear(2, 2), norm="grup")
    with pytest.raises(ValueError, match="only applies to norm='group'"):
        make_private_compatible(nn.Linear(2, 2), norm="instance", num_groups=4)
    make_private_compatible(nn.Linear(2, 2), norm="INSTANCE")  # plain, any-case strings


def test_instance_norm_running_stats_removed() -> None:
    model = nn.Sequential(nn.InstanceNorm3d(4, affine=True, track_running_stats=True))
    model, fixes = make_private_compatible(model)
    assert isinstance(model[0], nn.InstanceNorm3d)
    assert model[0].affine and not model[0].track_running_stats
    assert fixes[0].path == "0"
    validate_private_compatible(model)


def test_shared_and_root_modules() -> None:
    shared = nn.BatchNorm2d(8)
    model = nn.Sequential(nn.Conv2d(1, 8, 3), shared, nn.Conv2d(8, 8, 1), shared)
    model, fixes = make_private_compatible(model)
    assert model[1] is model[3] and isinstance(model[1], nn.GroupNorm)
    assert [f.path for f in fixes] == ["1", "3"]

    root, fixes = make_private_compatible(nn.BatchNorm2d(4))
    assert isinstance(root, nn.GroupNorm) and fixes[0].path == ""


def test_opacus_fixer_swaps_lstm() -> None:
    model = nn.ModuleDict({"rnn": nn.LSTM(4, 4), "head": nn.Linear(4, 2)})
    model, fixes = make_private_compatible(model)
    assert isinstance(model["rnn"], DPLSTM)
    assert [f.path for f in fixes] == ["rnn"]
    validate_private_compatible(model)


# --- MONAI residual blocks ---------------------------------------------------------------


_ACT = ("relu", {"inplace": True})
_GROUP = ("group", {"num_groups": 2})
# name -> (block factory, input shape); built inside the test, not at collection.
_RESIDUAL_BLOCKS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "ResNetBlock": (lambda: ResNetBlock(4, 4, spatial_dims=2, act=_ACT, norm=_GROUP), (2, 4, 8, 8)),
    "ResNetBlock/down": (
        lambda: ResNetBlock(
            4,
            8,
            spatial_dims=2,
            stride=2,
            downsample=nn.Sequential(nn.Conv2d(4, 8, 1, stride=2), nn.GroupNorm(2, 8)),
            norm="instance",
        ),
        (2, 4, 8, 8),
    ),
    "ResNetBottleneck": (
        lambda: ResNetBottleneck(16, 4, spatial_dims=3, norm="instance"),
        (2, 16, 4, 4, 4),
    ),
    "ResBlock": (lambda: ResBlock(2, 4, norm=_GROUP), (2, 4, 8, 8)),
    "SegResBlock": (lambda: SegResBlock(2, 4, norm="instance"), (2, 4, 8, 8)),
    "UnetResBlock": (lambda: UnetResBlock(2, 4, 4, 3, 1, norm_name="instance"), (2, 4, 8, 8)),
    "UnetResBlock/down": (
        lambda: UnetResBlock(2, 4, 6, 3, 2, norm_name="instance"),
        (2, 4, 8, 8),
    ),
}


@pytest.mark.parametrize("name", list(_RESIDUAL_BLOCKS))
def test_out_of_place_residual_forward_matches_monai(name: str) -> None:
    torch.manual_seed(0)
    factory, shape = _RESIDUAL_BLOCKS[name]
    block = factory().double()
    x = torch.randn(*shape, dtype=torch.float64)
    expected = block(x.clone())
    monai_type = type(block)
    fixed, fixes = make_private_compatible(block)
    assert isinstance(fixed, monai_type) and type(fixed) is not monai_type
    assert any("out += residual" in f.before for f in fixes)
    torch.testing.assert_close(fixed(x.clone()), expected, rtol=0, atol=0)
    validate_private_compatible(fixed)


def test_input_size_check_passes_fitting_nets_and_leaves_the_rng_alone() -> None:
    from dpkfc_med.models import build_model, check_input_size

    model, _ = build_model("small_cnn", spatial_dims=2, in_channels=1, out_channels=2)
    state = torch.get_rng_state()
    check_input_size(model, (1, 28, 28))
    assert torch.equal(torch.get_rng_state(), state)
    deep, _ = build_model("densenet121", spatial_dims=2, in_channels=1, out_channels=2)
    check_input_size(deep, (1, 64, 64))  # 64x64 fits; 28x28 is refused (CLI tests)
    with pytest.raises(ModelCompatibilityError, match="fails on inputs of size 28x28"):
        check_input_size(deep, (1, 28, 28))
