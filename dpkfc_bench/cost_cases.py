"""The cost benchmark's models, batches, losses and memory estimates.

Each :class:`Case` is one benchmarked network with its input shape and batch size in full and
quick mode; the estimates (per-probe refresh memory, per-sample step memory, the DP-KFC
transform's multiply-adds and the engine's automatic refresh period) come from one CPU
forward of one sample through :mod:`dpkfc_med.curvature.cost`.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dpkfc_med.privacy.ghost import Clipping

METHODS = (
    "nonprivate",
    "opacus",
    "opacus-ghost",
    "dp-sgd",
    "dp-kfc",
    "dp-kfc-per_sample",
    "dp-kfc-ghost",
)
OPACUS_MODES = ("opacus", "opacus-ghost")  # the competitor's fastest is the reference
# dp-kfc-<mode> forces one clipping mode; the other methods use the product's default, "auto"
CLIPPING = {f"dp-kfc-{c.value}": c.value for c in Clipping if c is not Clipping.AUTO}
NOISE_MULTIPLIER = 1.0
MAX_GRAD_NORM = 1.0
DELTA = 1e-5
LR = 0.05
TARGETS = {
    "step_ratio_max": 1.15,
    "memory_ratio_max": 1.10,
    "refresh_share_max": 0.05,
    "fastest_step_ratio_max": 1.10,  # dp-kfc vs Opacus' fastest mode (hooks or ghost)
    "fastest_memory_ratio_max": 1.10,
    "nonprivate_step_ratio_max": 1.5,  # small CNN and DenseNet
}
REFRESH_MEMORY_FRACTION = 0.3  # of the available memory, for the chunk-size rule
STEP_MEMORY_FRACTION = 0.4  # of the available memory, for the CPU batch rule
# Overrides that do not change the preconditioner's structure, hence not the step cost.
STEP_NEUTRAL_OVERRIDES = {"chunk_size", "num_probes", "calibration_samples"}


@dataclass
class Setting:
    """Input shape, batch size and dp-kfc config overrides of one model in one mode."""

    shape: tuple[int, ...]
    batch: int
    kfc: dict[str, Any] = field(default_factory=dict)
    why: str = ""


@dataclass
class Case:
    """One benchmarked model."""

    key: str
    registry_name: str
    task: str  # "classification" or "segmentation"
    spatial_dims: int
    in_channels: int
    num_classes: int
    description: str
    epoch_samples: int
    epoch_data: str
    full: Setting
    quick: Setting
    cpu_full_kfc: dict[str, Any] = field(default_factory=dict)
    cpu_full_why: str = ""


_PNEUMONIA = "PneumoniaMNIST train split (4708 images)"
_QUICK_WHY = (
    "quick mode: fewer probes and calibration samples and a smaller max_factor_dim keep the "
    "run under 3 minutes; the refresh is not extrapolated to the default"
)
_QUICK_KFC = {"max_factor_dim": 512, "calibration_samples": 2}
CASES: dict[str, Case] = {
    c.key: c
    for c in (
        Case(
            key="small_cnn",
            registry_name="small_cnn",
            task="classification",
            spatial_dims=2,
            in_channels=1,
            num_classes=2,
            description="small tanh CNN (Papernot et al. 2021), 1 channel, 2 classes",
            epoch_samples=4708,
            epoch_data=_PNEUMONIA,
            full=Setting((28, 28), 256),
            quick=Setting((28, 28), 32),
        ),
        Case(
            key="densenet121_2d",
            registry_name="densenet121",
            task="classification",
            spatial_dims=2,
            in_channels=1,
            num_classes=2,
            description="MONAI DenseNet121 2D (GroupNorm for BatchNorm, no in-place ops), "
            "1 channel, 2 classes",
            epoch_samples=4708,
            epoch_data=_PNEUMONIA,
            full=Setting((64, 64), 64),
            quick=Setting((32, 32), 2, _QUICK_KFC | {"num_probes": 8}, _QUICK_WHY),
        ),
        Case(
            key="unet_3d",
            registry_name="unet",
            task="segmentation",
            spatial_dims=3,
            in_channels=1,
            num_classes=3,
            description="MONAI UNet 3D (channels 16-128, 2 residual units, instance norm, "
            "PReLU), per-voxel cross-entropy, 3 output channels",
            epoch_samples=220,
            epoch_data="MSD Task04 Hippocampus volumes available here (220)",
            full=Setting((64, 64, 64), 8),
            # 16^3, not 32^3: at 32^3 one default probe chunk needs about 20 GB (see --help)
            quick=Setting((16, 16, 16), 1, _QUICK_KFC | {"num_probes": 4}, _QUICK_WHY),
            cpu_full_kfc={"num_probes": 2},
            cpu_full_why="CPU full mode: one 64^3 probe takes about 14 s of refresh on 2 CPU "
            "threads (forward pass, factors over 32768 positions per layer, eigendecompositions "
            "up to 3457 wide), so the refresh is built from 2 probes and the default refresh "
            "time is extrapolated",
        ),
        *(
            Case(
                key=f"unet_3d_brats{size}",
                registry_name="unet",
                task="segmentation",
                spatial_dims=3,
                in_channels=4,
                num_classes=4,
                description=f"MONAI UNet 3D (channels 16-128, 2 residual units, instance norm, "
                f"PReLU) on BraTS-size inputs: {size}^3 patches of 4-channel volumes (T1, T1ce, "
                "T2, FLAIR; synthetic), 4 classes",
                epoch_samples=484,
                epoch_data="MSD Task01 BrainTumour training volumes (484, 240x240x155, "
                "4 channels; synthetic data of that size here)",
                full=Setting((size, size, size), 2),
                quick=Setting((size // 4,) * 3, 1, _QUICK_KFC | {"num_probes": 2}, _QUICK_WHY),
                cpu_full_kfc={"num_probes": 1},
                cpu_full_why=f"CPU full mode: one {size}^3 probe takes minutes of refresh on the "
                "CPU, so the refresh is built from 1 probe and the default refresh time is "
                "extrapolated",
            )
            for size in (96, 128)
        ),
        Case(
            key="vit_2d",
            registry_name="vit",
            task="classification",
            spatial_dims=2,
            in_channels=1,
            num_classes=2,
            description="MONAI ViT 2D (patch 4: 49 tokens + class token, hidden 96, 4 layers, "
            "4 heads, MLP 192), 1 channel, 2 classes",
            epoch_samples=4708,
            epoch_data=_PNEUMONIA,
            full=Setting(
                (28, 28),
                256,
                {"fallback": "diagonal"},
                "the shipped ViT config's fallback (diagonal from probes for LayerNorm "
                "affines, class token and position embedding)",
            ),
            quick=Setting((28, 28), 16, _QUICK_KFC | {"num_probes": 8}, _QUICK_WHY),
        ),
        Case(
            key="unetr_3d",
            registry_name="unetr",
            task="segmentation",
            spatial_dims=3,
            in_channels=1,
            num_classes=3,
            description="MONAI UNETR 3D (16^3 patches: 2x3x2 tokens, hidden 96, 12 blocks, "
            "4 heads, MLP 192, feature size 8), hippocampus crop 32x48x32, 3 output channels",
            epoch_samples=220,
            epoch_data="MSD Task04 Hippocampus volumes available here (220)",
            full=Setting(
                (32, 48, 32),
                16,
                {"max_factor_dim": 8192, "fallback": "diagonal"},
                "the shipped UNETR config's fallback (diagonal from probes for LayerNorm "
                "affines and position embedding); max_factor_dim 8192 gives the "
                "patch-embedding convolution (A 4097 wide with its bias) a full A factor",
            ),
            quick=Setting((32, 32, 32), 1, _QUICK_KFC | {"num_probes": 4}, _QUICK_WHY),
            cpu_full_kfc={"num_probes": 8},
            cpu_full_why="CPU full mode: the refresh is built from 8 probes and the default "
            "refresh time is extrapolated",
        ),
    )
}


DEFAULT_MODELS = [k for k in CASES if "brats" not in k]
"""The models of a default run; the BraTS-size cases are run on their own (minutes a step)."""


def fallback_build(case: Case) -> nn.Module:
    """Build the network without ``dpkfc_med.models`` (used only when it is not importable)."""
    if case.registry_name == "small_cnn":
        conv = nn.Conv2d if case.spatial_dims == 2 else nn.Conv3d
        pool = nn.MaxPool2d if case.spatial_dims == 2 else nn.MaxPool3d
        apool = nn.AdaptiveAvgPool2d if case.spatial_dims == 2 else nn.AdaptiveAvgPool3d
        return nn.Sequential(
            conv(case.in_channels, 16, 8, stride=2, padding=3),
            nn.Tanh(),
            pool(2, 1),
            conv(16, 32, 4, stride=2),
            nn.Tanh(),
            pool(2, 1),
            apool(4),
            nn.Flatten(),
            nn.Linear(32 * 4**case.spatial_dims, 32),
            nn.Tanh(),
            nn.Linear(32, case.num_classes),
        )
    from monai.networks import nets

    if case.registry_name == "densenet121":
        model: nn.Module = nets.DenseNet121(
            spatial_dims=case.spatial_dims,
            in_channels=case.in_channels,
            out_channels=case.num_classes,
        )
    else:
        model = nets.UNet(
            spatial_dims=case.spatial_dims,
            in_channels=case.in_channels,
            out_channels=case.num_classes,
            channels=(16, 32, 64, 128),
            strides=(2, 2, 2),
            num_res_units=2,
            norm="instance",
        )
    # Opacus compatibility: GroupNorm instead of BatchNorm, no in-place activations.
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.modules.batchnorm._BatchNorm):
                groups = math.gcd(child.num_features, 32)
                setattr(module, child_name, nn.GroupNorm(groups, child.num_features))
        if getattr(module, "inplace", False) is True:
            module.inplace = False  # type: ignore[assignment]
    return model


def build_network(
    case: Case, seed: int, shape: tuple[int, ...] | None = None
) -> tuple[nn.Module, str]:
    """The case's network (for spatial input ``shape``) with seeded initial weights, and how
    it was built."""
    torch.manual_seed(seed)
    try:
        from dpkfc_med.models import build_model
    except ImportError:
        return fallback_build(case), "dpkfc_bench/cost_cases.py fallback builder"
    model, fixes = build_model(
        case.registry_name,
        spatial_dims=case.spatial_dims,
        in_channels=case.in_channels,
        out_channels=case.num_classes,
        input_size=shape,
    )
    return model, f"dpkfc_med.models.build_model({case.registry_name!r}), {len(fixes)} fixes"


def make_batch(case: Case, batch: int, shape: tuple[int, ...], seed: int) -> tuple[Tensor, Tensor]:
    """A fixed synthetic batch: standard normal images and uniform labels (or label maps)."""
    g = torch.Generator().manual_seed(seed + 1000)
    x = torch.randn(batch, case.in_channels, *shape, generator=g)
    if case.task == "segmentation":
        y = torch.randint(0, case.num_classes, (batch, *shape), generator=g)
    else:
        y = torch.randint(0, case.num_classes, (batch,), generator=g)
    return x, y


class PerSampleCE(nn.Module):
    """Cross-entropy with a per-sample ``reduction="none"`` (mean over voxels): the criterion
    Opacus' ghost mode needs (it switches ``reduction`` to ``"none"`` and expects ``[B]``)."""

    reduction = "mean"

    def forward(self, outputs: Tensor, targets: Tensor) -> Tensor:
        per = probe_loss(outputs, targets)
        return per if self.reduction == "none" else per.mean()


def train_loss(outputs: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy over the batch (and over voxels for segmentation)."""
    return F.cross_entropy(outputs, targets)


def summed_train_loss(outputs: Tensor, targets: Tensor) -> Tensor:
    """Sum over the batch of the per-sample loss (our engines' backward)."""
    return probe_loss(outputs, targets).sum()


def probe_loss(outputs: Tensor, targets: Tensor) -> Tensor:
    """Per-sample loss ``[M]`` on probes: cross-entropy (mean over voxels for segmentation)."""
    loss = F.cross_entropy(outputs, targets, reduction="none")
    return loss.flatten(1).mean(1) if loss.dim() > 1 else loss


def _engine_default(name: str) -> Any:
    from dpkfc_med.privacy.engine import PrivacyEngine

    return inspect.signature(PrivacyEngine.make_private).parameters[name].default


def default_refresh_every() -> int | str:
    """The engine's default refresh period (read from its signature): ``"auto"`` or steps."""
    value = _engine_default("refresh_every")
    return value if value == "auto" else int(value)


def default_refresh_budget() -> float:
    """The engine's default ``refresh_budget`` (share of training time for ``"auto"``)."""
    return float(_engine_default("refresh_budget"))


def default_kfc_config() -> dict[str, Any]:
    """``PreconditionerConfig()`` as a plain dict."""
    from dpkfc_med.curvature.preconditioner import PreconditionerConfig

    return PreconditionerConfig().to_dict()


def layer_footprint(case: Case, shape: tuple[int, ...], seed: int = 0) -> list[dict[str, Any]]:
    """Per covered layer: positions ``T``/``S`` and factor sizes, from one CPU forward of one
    sample (:func:`dpkfc_med.curvature.cost.layer_footprint`), as plain dicts."""
    from dpkfc_med.curvature.cost import layer_footprint as footprint

    model, _ = build_network(case, seed, shape)
    return [r.to_dict() for r in footprint(model, make_batch(case, 1, shape, seed)[0])]


def refresh_bytes_per_probe(rows: list[dict[str, Any]], max_positions: int | None) -> int:
    """Estimated refresh memory per probe of one chunk.

    The forward pass keeps every covered layer's input (about the previous layer's output,
    ``T * G * n_g`` floats) and output error; ``capture_layers`` then unfolds one layer at a
    time (at most ``max_positions`` positions of ``a``), all in float32.
    """
    outputs = [r["T"] * r["G"] * r["n_g"] for r in rows]
    patches = [
        min(r["T"], max_positions or r["T"]) * r["G"] * r["n_a"] + r["T"] * r["G"] * r["n_g"]
        for r in rows
    ]
    return 4 * (2 * sum(outputs) + max(patches, default=0))


def step_bytes_per_sample(rows: list[dict[str, Any]]) -> int:
    """Estimated per-sample memory of the largest unfolded layer input in a private step.

    Transposed convolutions form per-sample gradients on their input grid (no unfold).
    """
    return 4 * max(
        (r["T"] * r["G"] * r["n_a"] for r in rows if not r["type"].startswith("ConvTranspose")),
        default=0,
    )


def transform_macs(rows: list[dict[str, Any]], kfc: dict[str, Any]) -> list[dict[str, Any]]:
    """Per covered layer and per sample: multiply-adds of the raw per-sample gradient and of
    the DP-KFC transform (:func:`dpkfc_med.curvature.cost.transform_macs`)."""
    from dpkfc_med.curvature import cost as cc

    cfg = {**default_kfc_config(), **kfc}
    return cc.transform_macs([cc.LayerFootprint(**r) for r in rows], cfg)


def auto_refresh_plan(
    rows: list[dict[str, Any]], kfc: dict[str, Any], batch: int, extrapolated: bool
) -> dict:
    """The engine's ``refresh_every="auto"`` period for this model and batch.

    With ``extrapolated`` (full mode: the measured refresh is extrapolated to the default probe
    count) it is computed for the defaults, dropping the overrides that do not change the
    preconditioner's structure; otherwise for the overrides as measured.
    """
    from dpkfc_med.curvature import cost as cc
    from dpkfc_med.curvature.preconditioner import PreconditionerConfig

    if extrapolated:
        kfc = {k: v for k, v in kfc.items() if k not in STEP_NEUTRAL_OVERRIDES}
    return cc.auto_refresh_every(
        [cc.LayerFootprint(**r) for r in rows],
        PreconditionerConfig(**kfc),
        batch,
        default_refresh_budget(),
    )
