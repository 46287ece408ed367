"""Cost of private training: step time and peak memory of DP-KFC vs Opacus DP-SGD.

Run from the repository root::

    python benchmarks/cost.py --quick               # smoke size, < 3 min on 2 CPU cores
    python benchmarks/cost.py                       # full size (batch 256 / 64 / 8), CPU
    python benchmarks/cost.py --device cuda         # full size on one GPU (benchmarks/gpu_cost.sh)

Options: ``--models small_cnn,densenet121_2d,unet_3d``, ``--steps N`` (timed steps per method
and round), ``--rounds R``, ``--warmup W``, ``--threads T`` (default 2), ``--batch-sizes
256,64,8`` (one per model), ``--kfc-probes M`` / ``--kfc-chunk K`` (override the dp-kfc
probe budget), ``--profile`` (torch.profiler tables of the opacus and dp-kfc steps and of one
refresh), ``--no-memory``, ``--out FILE.json``, ``--md FILE.md``. Results go to
``benchmarks/results/cost_{device}{_quick}.json`` and a Markdown table next to it.

What is measured, per model (same initial weights, same fixed batch, same batch size):

* ``nonprivate``: plain ``torch.optim.SGD`` step;
* ``opacus``: ``opacus.PrivacyEngine.make_private`` (hooks mode, flat clipping; our code is
  not involved);
* ``dp-sgd``: ``dpkfc_med.privacy.engine.PrivacyEngine`` with ``method="dp-sgd"``;
* ``opacus-ghost``: the same with ``grad_sample_mode="ghost"`` (Opacus' fast gradient
  clipping: per-sample norms in the first backward pass, ghost norms for Linear layers, the
  clipped sum from a second backward pass of the reweighted loss), with a per-sample
  cross-entropy criterion;
* ``dp-kfc``: the same engine with ``method="dp-kfc"``, the default ``PreconditionerConfig``
  and an ``ImageProbeSource`` with the data's spatial shape, channels and classes;
  ``dp-sgd`` and ``dp-kfc`` use the product's default ``clipping="auto"``,
  ``dp-kfc-per_sample`` and ``dp-kfc-ghost`` force the other two modes.

A step is ``zero_grad + forward + loss + backward + optimizer.step`` on one pre-generated
batch (the Poisson loaders returned by the engines are bypassed so that the batch size is
constant; the engines are still built with a ``DataLoader`` over a synthetic ``TensorDataset``
whose expected batch size is the benchmark batch). The dp-kfc engine is built with
``refresh_every=0`` so that no refresh happens inside a timed step; the refresh
(``engine.refresh_preconditioner()``) is timed separately and amortised over the engine's
default refresh period.

Timing: after ``warmup`` untimed steps per method, ``rounds`` round-robin rounds each time
``steps`` consecutive steps of every method (the order rotates every round), so that drift of
the machine load hits all methods alike; each step is timed on its own
(``torch.cuda.synchronize`` before and after on GPU); the median over all timed steps is
reported. The load average at start and end is recorded; on a CPU shared with other jobs
(load above the number of cores) two torch threads wait on each other at every parallel
region and steps measured 5-10x slower than with one thread, so use ``--threads 1`` there.

Peak memory: every (model, method) pair runs in a fresh process. One child interpreter
(``python benchmarks/cost.py --_memory-child SPEC``) imports the libraries once and forks a
new process per pair (Linux; elsewhere one child interpreter per pair). That process builds
model and batch, sets the method up (for dp-kfc including the initial refresh, from one
chunk of probes: same per-chunk peak, fewer chunks) and runs a few steps. On CUDA the number
is ``torch.cuda.max_memory_allocated`` over the steps (peak statistics reset after set-up).
On CPU it is the peak resident set size during the steps (``VmHWM`` of ``/proc/self/status``,
reset through ``/proc/self/clear_refs`` after set-up) minus the resident set size right after
model and batch construction (after ``gc`` and ``malloc_trim``); without ``clear_refs``,
``getrusage().ru_maxrss`` is used and the number is an upper bound. The set-up peak is
reported separately.

Deviations from the default preconditioner are recorded per model and flagged in the tables:
``chunk_size`` is lowered when the estimated refresh memory (unfolded patches of every covered
layer of one chunk, float32 plus the float64 copy of the largest) would not fit in 30% of the
available memory (result-neutral: the factors are the same sums); ``--quick`` and CPU full mode
use fewer probes (and, in quick mode, a smaller ``max_factor_dim``) for DenseNet and UNet so
that the run fits its time budget. With fewer probes than the default, the default refresh
time is extrapolated (probe sampling and factor passes scale with the number of probes).
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import gc
import inspect
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python benchmarks/cost.py` without installing the package
    sys.path.insert(0, str(REPO))

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
CLIPPING = {"dp-kfc-per_sample": "per_sample", "dp-kfc-ghost": "ghost"}  # else "auto"
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


# ----------------------------------------------------------------------------- models


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


def _fallback_build(case: Case) -> nn.Module:
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
        return _fallback_build(case), "benchmarks/cost.py fallback builder"
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


class _PerSampleCE(nn.Module):
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


def available_bytes(device: torch.device) -> int | None:
    """Free memory now: ``MemAvailable`` (CPU) or ``cudaMemGetInfo`` free (GPU)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return 1024 * int(line.split()[1])
    except OSError:
        return None
    return None


# ----------------------------------------------------------------------------- methods


@dataclass
class Runner:
    """One method set up on its own copy of the model."""

    method: str
    step: Callable[[], None]
    optimizer: Any
    engine: Any = None
    setup_s: float = 0.0

    def release(self) -> None:
        """Drop per-sample gradients and grads held since the last step (outside timing)."""
        self.optimizer.zero_grad(set_to_none=True)


def setup_method(
    method: str,
    case: Case,
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    shape: tuple[int, ...],
    seed: int,
    kfc: dict[str, Any] | None = None,
    precision: str = "float32",
) -> Runner:
    """Wrap ``model`` (modified in place) for ``method`` and return its step function.

    Args:
        kfc: ``PreconditionerConfig`` field overrides for dp-kfc (default: none).
        precision: ``training.precision`` of the forward pass, for every method alike
            (``bf16``: bfloat16 autocast; Opacus' hooks then keep bfloat16 per-sample
            gradients, ours cast them to float32).
    """
    from dpkfc_med.training.precision import check_precision, forward_autocast

    prec = check_precision(precision, x.device)
    t0 = time.perf_counter()
    batch = x.shape[0]
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    loss_fn: Callable[[Tensor, Tensor], Any] = train_loss
    # The engines see a synthetic dataset whose expected batch size is the benchmark batch.
    loader = DataLoader(TensorDataset(x.cpu(), y.cpu()), batch_size=batch)
    engine: Any = None
    if method == "nonprivate":
        net, popt = model, opt
    elif method == "opacus":
        from opacus import PrivacyEngine as OpacusEngine

        engine = OpacusEngine(accountant="prv")
        net, popt, _ = engine.make_private(
            module=model,
            optimizer=opt,
            data_loader=loader,
            noise_multiplier=NOISE_MULTIPLIER,
            max_grad_norm=MAX_GRAD_NORM,
            noise_generator=torch.Generator(device=x.device).manual_seed(seed),
        )
    elif method == "opacus-ghost":
        from opacus import PrivacyEngine as OpacusEngine

        engine = OpacusEngine(accountant="prv")
        # Opacus' two backward passes run inside the criterion's backward()
        net, popt, loss_fn, _ = engine.make_private(
            module=model,
            optimizer=opt,
            criterion=_PerSampleCE(),
            data_loader=loader,
            noise_multiplier=NOISE_MULTIPLIER,
            max_grad_norm=MAX_GRAD_NORM,
            grad_sample_mode="ghost",
            noise_generator=torch.Generator(device=x.device).manual_seed(seed),
        )
    elif method == "dp-sgd" or method.startswith("dp-kfc"):
        from dpkfc_med.privacy.engine import PrivacyEngine

        engine = PrivacyEngine(seed=seed)
        # as the training loop: backward on the sum of per-sample losses, update averaged over
        # the expected batch (exact per-sample errors under bf16, whatever the batch size)
        kwargs: dict[str, Any] = {
            "clipping": CLIPPING.get(method, "auto"),
            "backward_reduction": "sum",
        }
        loss_fn = summed_train_loss
        if method.startswith("dp-kfc"):
            from dpkfc_med.curvature.preconditioner import PreconditionerConfig
            from dpkfc_med.probes import ImageProbeSource

            kwargs |= {
                "probe_source": ImageProbeSource(
                    shape, channels=case.in_channels, num_classes=case.num_classes, task=case.task
                ),
                "probe_loss": probe_loss,
                "preconditioner": PreconditionerConfig(**(kfc or {})),
                "refresh_every": 0,  # refreshes are timed separately (see module docstring)
                "probe_seed": seed,
            }
        net, popt, _ = engine.make_private(
            module=model,
            optimizer=opt,
            data_loader=loader,
            noise_multiplier=NOISE_MULTIPLIER,
            max_grad_norm=MAX_GRAD_NORM,
            delta=DELTA,
            method="dp-sgd" if method == "dp-sgd" else "dp-kfc",
            **kwargs,
        )
        if x.is_cuda:
            # The engine seeds a CPU generator, but Opacus draws the noise on the parameters'
            # device with it (torch.normal refuses a CPU generator for CUDA tensors).
            popt.generator = torch.Generator(device=x.device).manual_seed(seed)
    else:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")

    def step() -> None:
        popt.zero_grad(set_to_none=True)
        with forward_autocast(prec, x.device):
            out = net(x)
        loss = loss_fn(out.float(), y)
        loss.backward()
        popt.step()

    return Runner(method, step, popt, engine, time.perf_counter() - t0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def _summary(times: list[float]) -> dict[str, Any]:
    qs = statistics.quantiles(times, n=10) if len(times) >= 2 else [times[0]] * 9
    return {
        "median_ms": 1e3 * statistics.median(times),
        "mean_ms": 1e3 * statistics.fmean(times),
        "p10_ms": 1e3 * qs[0],
        "p90_ms": 1e3 * qs[-1],
        "min_ms": 1e3 * min(times),
        "n": len(times),
        "all_ms": [round(1e3 * t, 4) for t in times],
    }


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:500]


# ----------------------------------------------------------------------------- timing


def measure_timing(
    case: Case,
    *,
    batch: int,
    shape: tuple[int, ...],
    device: str | torch.device = "cpu",
    methods: tuple[str, ...] = METHODS,
    warmup: int = 2,
    rounds: int = 5,
    steps: int = 5,
    refresh_reps: int = 3,
    seed: int = 0,
    kfc: dict[str, Any] | None = None,
    extrapolate: bool = True,
    profile_steps: int = 0,
    precision: str = "float32",
    log: Callable[[str], None] = lambda s: None,
) -> dict[str, Any]:
    """Time every method alternately on one model and time the dp-kfc refresh.

    Args:
        case: the model.
        batch: batch size (all methods).
        shape: spatial input shape.
        device: ``"cpu"`` or ``"cuda"``.
        methods: methods to measure.
        warmup: untimed steps per method before the rounds.
        rounds: round-robin rounds.
        steps: consecutive timed steps per method and round.
        refresh_reps: timed ``refresh_preconditioner()`` calls after the rounds.
        seed: model, batch, noise and probe seed.
        kfc: ``PreconditionerConfig`` overrides for dp-kfc.
        extrapolate: extrapolate the refresh time to the default number of probes.
        profile_steps: profile this many opacus and dp-kfc steps (0: no profile).
        precision: the forward pass's ``training.precision`` (every method).
        log: progress printer.

    Returns:
        ``{"methods": {method: timing summary}, "errors": {method: message}, "refresh":
        {...} or None, ...}``.
    """
    device = torch.device(device)
    base, built_by = build_network(case, seed, shape)
    base = base.to(device)
    x, y = make_batch(case, batch, shape, seed)
    x, y = x.to(device), y.to(device)
    runners: dict[str, Runner] = {}
    errors: dict[str, str] = {}
    for m in methods:
        try:
            runners[m] = setup_method(
                m, case, copy.deepcopy(base), x, y, shape, seed, kfc, precision
            )
            log(f"  set up {m} in {runners[m].setup_s:.2f} s")
        except Exception as exc:  # noqa: BLE001 - record and measure the other methods
            errors[m] = _err(exc)
            log(f"  set up {m} FAILED: {errors[m]}")
    active = tuple(m for m in methods if m in runners)
    for m in active:
        try:
            for _ in range(warmup):
                runners[m].step()
            runners[m].release()
        except Exception as exc:  # noqa: BLE001
            errors[m] = _err(exc)
            log(f"  warm-up of {m} FAILED: {errors[m]}")
    active = tuple(m for m in active if m not in errors)
    _sync(device)
    times: dict[str, list[float]] = {m: [] for m in active}
    order_log = []
    for r in range(rounds):
        order = active[r % len(active) :] + active[: r % len(active)] if active else ()
        order_log.append(list(order))
        for m in order:
            for _ in range(steps):
                times[m].append(_timed(runners[m].step, device))
            runners[m].release()
        log(
            f"  round {r + 1}/{rounds}: "
            + ", ".join(f"{m} {1e3 * statistics.median(times[m]):.1f} ms" for m in active)
        )
    out: dict[str, Any] = {
        "model": case.key,
        "built_by": built_by,
        "params": sum(p.numel() for p in base.parameters()),
        "batch": batch,
        "shape": list(shape),
        "warmup": warmup,
        "rounds": rounds,
        "steps_per_round": steps,
        "round_orders": order_log,
        "methods": {m: _summary(times[m]) for m in active},
        "errors": errors,
        "setup_s": {m: runners[m].setup_s for m in runners},
        "refresh": None,
    }
    if "dp-kfc" in runners:
        try:
            out["refresh"] = _measure_refresh(
                runners["dp-kfc"].engine, refresh_reps, device, log, extrapolate
            )
        except Exception as exc:  # noqa: BLE001
            errors["dp-kfc refresh"] = _err(exc)
            log(f"  refresh FAILED: {errors['dp-kfc refresh']}")
    if profile_steps > 0:
        out["profile"] = {
            m: _profile(runners[m], profile_steps, device)
            for m in ("opacus", "dp-kfc")
            if m in active
        }
        if "dp-kfc" in active:
            out["profile"]["dp-kfc refresh"] = _profile_refresh(runners["dp-kfc"].engine, device)
    return out


def _measure_refresh(
    engine: Any, reps: int, device: torch.device, log: Callable, extrapolate: bool = True
) -> dict:
    """Time ``engine.refresh_preconditioner()``; the first (cold) one ran in make_private."""
    initial = dict(engine.refreshes[0])
    info0 = engine.preconditioner.info
    calls = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        pre = engine.refresh_preconditioner()
        _sync(device)
        total = time.perf_counter() - t0
        info = pre.info
        calls.append(
            {
                "seconds": total,
                "factors_s": info["seconds_factors"],
                "inverse_s": info["seconds_inverse"],
                "calibration_s": info["seconds_total"]
                - info["seconds_factors"]
                - info["seconds_inverse"],
                "probe_sampling_and_attach_s": total - info["seconds_total"],
            }
        )
        log(f"  refresh {len(calls)}/{reps}: {total:.2f} s")
    pre = engine.preconditioner
    cfg = pre.config
    cov = pre.coverage()
    out: dict[str, Any] = {
        "initial_s": initial["seconds"],
        "initial_parts_s": {
            "factors": info0["seconds_factors"],
            "inverse": info0["seconds_inverse"],
            "total_in_from_probes": info0["seconds_total"],
        },
        "calls": calls,
        "median_s": statistics.median(c["seconds"] for c in calls) if calls else initial["seconds"],
        "factors": getattr(cfg.factors, "value", cfg.factors),
        "num_probes": cfg.num_probes,
        "chunk_size": cfg.chunk_size,
        "max_factor_dim": cfg.max_factor_dim,
        "eig_dtype": cfg.eig_dtype,
        "covered_layers": len(pre.blocks),
        "fallback_params": len(pre.fallbacks),
        "full_factors": sum(int(r["A"] == "full") + int(r["G"] == "full") for r in cov),
        "diagonal_factors": sum(int(r["A"] == "diagonal") + int(r["G"] == "diagonal") for r in cov),
        "largest_full_factor": max(
            [r["A_dim"] for r in cov if r["A"] == "full"]
            + [r["G_dim"] for r in cov if r["G"] == "full"]
            or [0]
        ),
    }
    # Extrapolate to the default number of probes: probe sampling and the factor passes
    # scale with the probes; the inverse roots do not; calibration uses min(16, probes).
    default = default_kfc_config()
    m_def, m_used = int(default["num_probes"]), int(cfg.num_probes)
    out["median_s_default_probes"] = out["median_s"]
    out["extrapolated"] = False
    if m_used != m_def and extrapolate:
        last = calls[-1] if calls else None
        if last is not None:
            c_def = min(int(default["calibration_samples"]), m_def)
            c_used = min(int(cfg.calibration_samples), m_used)
            out["median_s_default_probes"] = (
                (last["factors_s"] + last["probe_sampling_and_attach_s"]) * m_def / m_used
                + last["inverse_s"]
                + last["calibration_s"] * c_def / max(c_used, 1)
            )
            out["extrapolated"] = True
    return out


def _profile(runner: Runner, steps: int, device: torch.device, rows: int = 25) -> str:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    runner.step()
    with profile(activities=acts) as prof:
        for _ in range(steps):
            runner.step()
        _sync(device)
    runner.release()
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=50)
    return f"{runner.method}: {steps} profiled steps, sorted by {key}\n{table}"


def _profile_refresh(engine: Any, device: torch.device, rows: int = 25) -> str:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        engine.refresh_preconditioner()
        _sync(device)
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=50)
    return f"dp-kfc refresh_preconditioner(), sorted by {key}\n{table}"


# ----------------------------------------------------------------------------- memory


def _proc_status_kib(name: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(name + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _trim() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _ru_maxrss_kib() -> int:
    v = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return v // 1024 if sys.platform == "darwin" else v


class _MemoryProbe:
    """Peak-memory bookkeeping for one process (CUDA allocator or CPU resident set size)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.resettable = True

    def current(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        rss = _proc_status_kib("VmRSS")
        return 1024 * (rss if rss is not None else _ru_maxrss_kib())

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            _trim()
            self.resettable = _reset_peak_rss() and _proc_status_kib("VmHWM") is not None

    def peak(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        hwm = _proc_status_kib("VmHWM") if self.resettable else None
        return 1024 * (hwm if hwm is not None else _ru_maxrss_kib())

    def method(self) -> str:
        if self.device.type == "cuda":
            return (
                "torch.cuda.max_memory_allocated: the larger of the set-up peak (first refresh "
                "included) and the steps' peak (reset after set-up)"
            )
        if self.resettable:
            return (
                "peak RSS during the steps (VmHWM, reset via /proc/self/clear_refs after "
                "set-up) minus RSS after model and batch construction, in a process warmed up "
                "by one set-up and step of the same method on a throwaway copy; the larger of "
                "this and the set-up's peak (which includes the first preconditioner refresh)"
            )
        return "getrusage ru_maxrss (process lifetime peak; upper bound) minus RSS baseline"


def measure_memory_job(job: dict[str, Any]) -> dict[str, Any]:
    """Peak memory of one (model, method) in the current process (call it in a fresh one)."""
    torch.set_num_threads(int(job["threads"]))
    device = torch.device(job["device"])
    case = CASES[job["model"]]
    shape = tuple(job["shape"])
    kfc = dict(job.get("kfc") or {})
    mem = _MemoryProbe(device)
    seed = job["seed"]

    def model_and_batch() -> tuple[nn.Module, Tensor, Tensor]:
        model, _ = build_network(case, seed, shape)
        x, y = make_batch(case, job["batch"], shape, seed)
        return model.to(device), x.to(device), y.to(device)

    # Warm-up on a throwaway copy: one set-up and step of the same method, then freed, so that
    # one-time library initialisation (BLAS/LAPACK workspaces, FFT plans, oneDNN primitives)
    # is not charged to any method; the measured set-up and steps below start warm.
    precision = job.get("precision", "float32")
    warm = setup_method(job["method"], case, *model_and_batch(), shape, seed, kfc, precision)
    warm.step()
    warm.release()
    del warm
    gc.collect()
    model, x, y = model_and_batch()
    _sync(device)
    _trim()
    baseline = mem.current()
    mem.reset()
    runner = setup_method(job["method"], case, model, x, y, shape, seed, kfc, precision)
    _sync(device)
    setup_peak = mem.peak()
    _trim()
    after_setup = mem.current()
    mem.reset()
    for _ in range(int(job["steps"])):
        runner.step()
    _sync(device)
    peak = mem.peak()
    mib = 1024.0**2
    return {
        "model": case.key,
        "method": job["method"],
        "batch": job["batch"],
        "steps": job["steps"],
        "kfc": kfc if job["method"].startswith("dp-kfc") else None,
        "baseline_mib": baseline / mib,
        "setup_peak_increase_mib": (setup_peak - baseline) / mib,
        "after_setup_increase_mib": (after_setup - baseline) / mib,
        "step_peak_mib": peak / mib,
        "step_peak_increase_mib": (peak - baseline) / mib,
        # Training peak = the larger of the steps' peak and the set-up's (which includes the
        # first preconditioner refresh; refreshes recur during training).
        "primary_mib": max(
            peak if device.type == "cuda" else peak - baseline,
            setup_peak if device.type == "cuda" else setup_peak - baseline,
        )
        / mib,
        "how": mem.method(),
    }


def _run_jobs_forked(jobs: list[dict[str, Any]], timeout_s: float) -> list[dict[str, Any]]:
    """Run each job in a process forked from this (import-only) interpreter."""
    results = []
    for job in jobs:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: measure, report through the pipe, exit without cleanup
            os.close(r)
            code = 0
            try:
                payload = measure_memory_job(job)
            except BaseException as exc:  # noqa: BLE001 - report any failure to the parent
                payload = {**job, "error": _err(exc)}
                code = 1
            with os.fdopen(w, "w") as f:
                json.dump(payload, f)
            os._exit(code)
        os.close(w)
        # The payload is far below the pipe buffer, so the child never blocks on writing.
        deadline = time.monotonic() + timeout_s
        while not os.waitpid(pid, os.WNOHANG)[0]:
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                break
            time.sleep(0.05)
        with os.fdopen(r) as f:
            text = f.read()
        try:
            results.append(json.loads(text))
        except json.JSONDecodeError:
            results.append({**job, "error": "timeout or crash (killed by a signal?)"})
    return results


def memory_child_main(spec_json: str) -> None:
    """Entry of ``--_memory-child``: run the jobs, print one JSON list on stdout."""
    spec = json.loads(spec_json)
    jobs = spec["jobs"]
    if hasattr(os, "fork") and len(jobs) > 1:
        import opacus  # noqa: F401 - import once, before forking

        import dpkfc_med.models  # noqa: F401
        import dpkfc_med.privacy.engine  # noqa: F401
        import dpkfc_med.probes  # noqa: F401

        results = _run_jobs_forked(jobs, float(spec.get("job_timeout_s", 1800)))
    else:
        results = []
        for job in jobs:
            try:
                results.append(measure_memory_job(job))
            except Exception as exc:  # noqa: BLE001
                results.append({**job, "error": _err(exc)})
    print("@@MEMORY@@" + json.dumps(results))


def measure_memory(
    jobs: list[dict[str, Any]], timeout_s: float, log: Callable[[str], None]
) -> list[dict[str, Any]]:
    """Run memory jobs in a child interpreter (fork per job); one child per job off Linux."""
    groups = [jobs] if hasattr(os, "fork") else [[j] for j in jobs]
    out: list[dict[str, Any]] = []
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    for group in groups:
        spec = json.dumps({"jobs": group, "job_timeout_s": timeout_s})
        cmd = [sys.executable, str(Path(__file__).resolve()), "--_memory-child", spec]
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, env=env, timeout=timeout_s * len(group) + 120
            )
        except subprocess.TimeoutExpired:
            out += [{**j, "error": "memory child timed out"} for j in group]
            continue
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("@@MEMORY@@")), None)
        if line is None:
            tail = proc.stderr.strip().splitlines()[-3:]
            out += [{**j, "error": f"memory child failed: {' | '.join(tail)}"} for j in group]
            continue
        out += json.loads(line[len("@@MEMORY@@") :])
    for r in out:
        if "error" in r:
            log(f"  memory {r['model']}/{r['method']}: ERROR {r['error']}")
        else:
            log(f"  memory {r['model']}/{r['method']}: {r['primary_mib']:.1f} MiB")
    return out


# ----------------------------------------------------------------------------- analysis


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b or b <= 0:
        return None
    return a / b


def _fastest(values: dict[str, Any]) -> float | None:
    """The smaller of Opacus' modes (hooks, ghost) that were measured."""
    have = [values[m] for m in OPACUS_MODES if values.get(m) is not None]
    return min(have) if have else None


def analyse(mr: dict[str, Any], refresh_every: int | str) -> dict[str, Any]:
    """Ratios vs Opacus, amortised refresh cost and target verdicts for one model.

    ``refresh_every="auto"`` amortises at the model's ``refresh_plan`` period (the engine's
    deterministic choice for this model and batch); the share at the shortest auto period
    (20, the fixed default before 2026-12-01) is kept for comparison.
    """
    from dpkfc_med.curvature.cost import AUTO_REFRESH_BASE

    if refresh_every == "auto":
        refresh_every = int((mr.get("refresh_plan") or {}).get("refresh_every", AUTO_REFRESH_BASE))
    refresh_every = int(refresh_every)
    t = {m: s["median_ms"] for m, s in mr["methods"].items()}
    mem = {r["method"]: r.get("primary_mib") for r in mr.get("memory", []) if "error" not in r}
    names = [m for m in METHODS if m in t or m in mem]
    ratios = {
        "time": {m: _ratio(t.get(m), t.get("opacus")) for m in names},
        "memory": {m: _ratio(mem.get(m), mem.get("opacus")) for m in names},
        "time_vs_fastest_opacus": {m: _ratio(t.get(m), _fastest(t)) for m in names},
        "memory_vs_fastest_opacus": {m: _ratio(mem.get(m), _fastest(mem)) for m in names},
        "time_vs_nonprivate": {m: _ratio(t.get(m), t.get("nonprivate")) for m in names},
        "time_dpkfc_vs_dpsgd": _ratio(t.get("dp-kfc"), t.get("dp-sgd")),
        "memory_dpkfc_vs_dpsgd": _ratio(mem.get("dp-kfc"), mem.get("dp-sgd")),
    }
    refresh = mr.get("refresh")
    amort: dict[str, Any] | None = None
    if refresh is not None and "dp-kfc" in t:
        r_s = refresh["median_s_default_probes"]
        step_s = t["dp-kfc"] / 1e3
        steps_epoch = math.ceil(mr["epoch_samples"] / mr["batch"])
        per_epoch = math.ceil(steps_epoch / refresh_every) if refresh_every > 0 else 1
        cap = TARGETS["refresh_share_max"]
        amort = {
            "refresh_every": refresh_every,
            "refresh_s": r_s,
            "refresh_extrapolated": refresh["extrapolated"],
            "share_at_default_period": r_s / (refresh_every * step_s + r_s),
            "share_at_base_period": r_s / (AUTO_REFRESH_BASE * step_s + r_s),
            "base_period": AUTO_REFRESH_BASE,
            "epoch_samples": mr["epoch_samples"],
            "epoch_data": mr["epoch_data"],
            "steps_per_epoch": steps_epoch,
            "refreshes_per_epoch": per_epoch,
            "epoch_training_s": steps_epoch * step_s,
            "epoch_refresh_s": per_epoch * r_s,
            "epoch_share": per_epoch * r_s / (steps_epoch * step_s + per_epoch * r_s),
            "refresh_every_for_target": math.ceil(r_s * (1 - cap) / (cap * step_s)),
        }
    overrides = set(mr.get("kfc_overrides", {}))
    step_note = NON_DEFAULT if overrides - STEP_NEUTRAL_OVERRIDES else ""
    if overrides - {"chunk_size", "num_probes"}:
        refresh_note = NON_DEFAULT
    elif amort and amort["refresh_extrapolated"]:
        refresh_note = " (refresh extrapolated to the default number of probes, see notes)"
    else:
        refresh_note = NON_DEFAULT if "num_probes" in overrides else ""
    verdict = {
        "step": _verdict(ratios["time"].get("dp-kfc"), TARGETS["step_ratio_max"], step_note),
        "memory": _verdict(ratios["memory"].get("dp-kfc"), TARGETS["memory_ratio_max"], step_note),
        "refresh": _verdict(
            amort["share_at_default_period"] if amort else None,
            TARGETS["refresh_share_max"],
            refresh_note,
            strict=True,
        ),
    }
    if "opacus-ghost" in t:  # the fastest-competitor targets (results with both Opacus modes)
        verdict |= {
            "fastest_step": _verdict(
                ratios["time_vs_fastest_opacus"].get("dp-kfc"),
                TARGETS["fastest_step_ratio_max"],
                step_note,
            ),
            "fastest_memory": _verdict(
                ratios["memory_vs_fastest_opacus"].get("dp-kfc"),
                TARGETS["fastest_memory_ratio_max"],
                step_note,
            ),
            "nonprivate_step": _verdict(
                ratios["time_vs_nonprivate"].get("dp-kfc"),
                TARGETS["nonprivate_step_ratio_max"],
                step_note,
            ),
        }
    return {"ratios": ratios, "refresh_amortised": amort, "targets": verdict}


NON_DEFAULT = " (non-default config, see notes)"


def _period_text(mr: dict[str, Any], am: dict[str, Any]) -> str:
    plan = mr.get("refresh_plan") or {}
    if plan.get("refresh_every") == am["refresh_every"] and "estimated_share" in plan:
        return (
            f"refresh_every=auto: every {am['refresh_every']} steps, estimated "
            f"{100 * plan['estimated_share']:.1f}% from multiply-adds"
        )
    return f"refresh_every={am['refresh_every']}"


def _verdict(value: float | None, limit: float, note: str, strict: bool = False) -> str:
    if value is None:
        return "not measured"
    ok = value < limit if strict else value <= limit
    return ("met" if ok else "missed") + note


# ----------------------------------------------------------------------------- provenance


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("opacus", "monai", "dpkfc_med"):
        try:
            out[name] = str(getattr(__import__(name), "__version__", None))
        except ImportError:
            out[name] = None
    return out


def _git_commit() -> str | None:
    try:
        proc = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return (proc.stdout.strip() or None) if proc.returncode == 0 else None


def _package_digest() -> dict[str, Any]:
    """SHA-256 over the package's ``.py`` files: identifies the measured code even when the
    working tree differs from the recorded commit."""
    import hashlib

    root = REPO / "dpkfc_med"
    files = sorted(root.rglob("*.py"))
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(REPO)).encode())
        h.update(f.read_bytes())
    newest = max((f.stat().st_mtime for f in files), default=0.0)
    return {
        "sha256": h.hexdigest(),
        "files": len(files),
        "newest_mtime": datetime.fromtimestamp(newest, timezone.utc).isoformat(timespec="seconds"),
    }


def _machine(device: torch.device) -> dict[str, Any]:
    out: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
        "gpu": None,
    }
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        if names:
            out["cpu_model"] = names[0]
    except OSError:
        pass
    mem = available_bytes(torch.device("cpu"))
    out["cpu_mem_available_gib_at_start"] = None if mem is None else round(mem / 2**30, 1)
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
        out["gpu_mem_total_gib"] = round(
            torch.cuda.get_device_properties(device).total_memory / 2**30, 1
        )
        out["cuda"] = torch.version.cuda
        out["cudnn"] = torch.backends.cudnn.version()
    return out


def _loadavg() -> list[float] | None:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


# ----------------------------------------------------------------------------- markdown


def _fmt(v: float | None, spec: str = ".1f", suffix: str = "") -> str:
    return "n/a" if v is None else f"{v:{spec}}{suffix}"


def _model_markdown(mr: dict[str, Any]) -> list[str]:
    an = mr["analysis"]
    n_timed = next(iter(mr["methods"].values()))["n"] if mr["methods"] else 0
    lines = [
        f"## {mr['model']}: batch {mr['batch']}, input {'x'.join(map(str, mr['shape']))}",
        "",
        f"{mr['description']}; {mr['params']:,} parameters; {mr['built_by']}. "
        f"Batch requested {mr['batch_requested']}, used {mr['batch']}"
        + (f" ({mr['batch_note']})" if mr.get("batch_note") else "")
        + f". {n_timed} timed steps per method ({mr['rounds']} rounds x "
        f"{mr['steps_per_round']}, {mr['warmup']} warm-up).",
        "",
    ]
    if mr.get("kfc_overrides"):
        why = "; ".join(mr.get("kfc_notes", []))
        lines += [
            "dp-kfc config differs from the default: "
            + ", ".join(f"`{k}={v}`" for k, v in mr["kfc_overrides"].items())
            + (f" -- {why}" if why else "")
            + ".",
            "",
        ]
    lines += [
        "| method | median step ms | p10-p90 ms | vs Opacus | peak memory MiB | vs Opacus |",
        "|---|---|---|---|---|---|",
    ]
    mem = {r["method"]: r for r in mr.get("memory", [])}
    for m in [m for m in METHODS if m in mr["methods"] or m in mem or m in mr.get("errors", {})]:
        s = mr["methods"].get(m)
        mrow = mem.get(m, {})
        mem_txt = "error" if "error" in mrow else _fmt(mrow.get("primary_mib"))
        if s is None:
            err = mr["errors"].get(m, "not run")
            lines.append(f"| {m} | failed: {err} | | | {mem_txt} | |")
            continue
        lines.append(
            f"| {m} | {s['median_ms']:.2f} | {s['p10_ms']:.2f}-{s['p90_ms']:.2f} | "
            f"{_fmt(an['ratios']['time'].get(m), '.2f', 'x')} | {mem_txt} | "
            f"{_fmt(an['ratios']['memory'].get(m), '.2f', 'x')} |"
        )
    lines.append("")
    for r in mr.get("memory", []):
        if "error" in r:
            lines.append(f"Memory of {r['method']} failed: {r['error']}")
    for k, v in mr.get("errors", {}).items():
        lines.append(f"Error ({k}): {v}")
    if any("error" in r for r in mr.get("memory", [])) or mr.get("errors"):
        lines.append("")
    ref, am = mr.get("refresh"), an.get("refresh_amortised")
    if ref and am:
        c = ref["calls"][-1] if ref["calls"] else {}
        if not c:  # no timed repeat: show the parts of the cold first refresh
            p = ref["initial_parts_s"]
            c = {
                "factors_s": p["factors"],
                "inverse_s": p["inverse"],
                "calibration_s": p["total_in_from_probes"] - p["factors"] - p["inverse"],
                "probe_sampling_and_attach_s": ref["initial_s"] - p["total_in_from_probes"],
            }
        extra = (
            f" (measured {ref['median_s']:.3f} s with {ref['num_probes']} probes, extrapolated to "
            f"the default {mr['kfc_default_probes']})"
            if am["refresh_extrapolated"]
            else ""
        )
        lines += [
            f"Refresh (`engine.refresh_preconditioner()`, factors={ref.get('factors')}, "
            f"{ref['num_probes']} probes in chunks of "
            f"{ref['chunk_size']}, {ref['covered_layers']} covered layers, {ref['full_factors']} "
            f"full and {ref['diagonal_factors']} diagonal factors, largest full "
            f"{ref['largest_full_factor']}, {ref['fallback_params']} fallback parameters): "
            f"{am['refresh_s']:.3f} s{extra}; cold first refresh {ref['initial_s']:.3f} s. Last "
            f"call: probe sampling + attach {_fmt(c.get('probe_sampling_and_attach_s'), '.3f')} s, "
            f"factors {_fmt(c.get('factors_s'), '.3f')} s, inverse roots + spectra "
            f"{_fmt(c.get('inverse_s'), '.3f')} s, scale calibration "
            f"{_fmt(c.get('calibration_s'), '.3f')} s.",
            "",
            f"Amortised at the default refresh period ({_period_text(mr, am)}): "
            f"{100 * am['share_at_default_period']:.1f}% of training time "
            f"({100 * am.get('share_at_base_period', am['share_at_default_period']):.1f}% at "
            f"refresh_every={am.get('base_period', am['refresh_every'])}). Per epoch of "
            f"{am['epoch_data']} at batch {mr['batch']}: {am['steps_per_epoch']} steps = "
            f"{am['epoch_training_s']:.1f} s training + {am['refreshes_per_epoch']} refreshes = "
            f"{am['epoch_refresh_s']:.1f} s ({100 * am['epoch_share']:.1f}%). refresh_every >= "
            f"{am['refresh_every_for_target']} would keep refreshes under "
            f"{100 * TARGETS['refresh_share_max']:.0f}%.",
            "",
        ]
    macs = (mr.get("memory_footprint_estimate") or {}).get("macs_per_sample")
    if macs:
        raw, extra = sum(m["raw"] for m in macs), sum(m["transform"] for m in macs)
        top = max(macs, key=lambda m: m["transform"])
        lines += [
            f"Where dp-kfc's extra time goes (multiply-adds per sample, covered layers): "
            f"per-sample gradients {raw / 1e6:.1f} M (DP-SGD computes these too), DP-KFC "
            f"transform {extra / 1e6:.1f} M ({extra / max(raw, 1):.2f}x the per-sample gradients); "
            f"largest transform: `{top['layer']}` ({top['type']}) {top['transform'] / 1e6:.1f} M "
            f"vs {top['raw'] / 1e6:.1f} M for its per-sample gradient. A layer's per-sample "
            "gradients cost what its forward pass does, so the non-private forward and backward "
            f"of these layers is about {3 * raw / 1e6:.1f} M: the transform alone puts dp-kfc at "
            f"no less than {1 + extra / max(3 * raw, 1):.2f}x non-private time at equal "
            "arithmetic speed.",
            "",
        ]
    share = am["share_at_default_period"] if am else None
    lines += [
        "| target | value | verdict |",
        "|---|---|---|",
        f"| dp-kfc step <= {TARGETS['step_ratio_max']}x Opacus | "
        f"{_fmt(an['ratios']['time'].get('dp-kfc'), '.2f', 'x')} | {an['targets']['step']} |",
        f"| dp-kfc peak memory <= {TARGETS['memory_ratio_max']}x Opacus | "
        f"{_fmt(an['ratios']['memory'].get('dp-kfc'), '.2f', 'x')} | {an['targets']['memory']} |",
        f"| refresh < {100 * TARGETS['refresh_share_max']:.0f}% of training time | "
        f"{_fmt(None if share is None else 100 * share, '.1f', '%')} | "
        f"{an['targets']['refresh']} |",
    ]
    if "fastest_step" in an["targets"]:
        r, tg = an["ratios"], an["targets"]
        lines += [
            f"| dp-kfc step <= {TARGETS['fastest_step_ratio_max']}x Opacus' fastest mode | "
            f"{_fmt(r['time_vs_fastest_opacus'].get('dp-kfc'), '.2f', 'x')} | "
            f"{tg['fastest_step']} |",
            f"| dp-kfc peak memory <= {TARGETS['fastest_memory_ratio_max']}x Opacus' fastest "
            f"mode | {_fmt(r['memory_vs_fastest_opacus'].get('dp-kfc'), '.2f', 'x')} | "
            f"{tg['fastest_memory']} |",
            f"| dp-kfc step <= {TARGETS['nonprivate_step_ratio_max']}x non-private | "
            f"{_fmt(r['time_vs_nonprivate'].get('dp-kfc'), '.2f', 'x')} | "
            f"{tg['nonprivate_step']} |",
        ]
    lines.append("")
    return lines


def _load_warning(result: dict[str, Any]) -> str:
    cpus = result["machine"]["cpu_count"] or 1
    loads = [v[0] for v in (result["loadavg_start"], result["loadavg_end"]) if v]
    if result["machine"]["device"] == "cpu" and loads and max(loads) > cpus:
        return (
            f" -- **the {cpus} CPUs were oversubscribed by other processes during this run "
            "(load above the CPU count): step times are inflated and noisy, compare ratios "
            "with care**"
        )
    return ""


def render_markdown(result: dict[str, Any]) -> str:
    """Human-readable tables of a result dict."""
    cfg, mach = result["config"], result["machine"]
    lines = [
        f"# Cost benchmark ({'quick' if cfg['quick'] else 'full'}, {mach['device']})",
        "",
        f"Generated by `{result['command']}` on {result['date']} in {result['wall_s']:.0f} s.",
        "",
        f"- Machine: {mach.get('cpu_model', mach['processor'])}, {mach['cpu_count']} CPUs, "
        f"torch threads {mach['torch_threads']}, GPU: {mach['gpu'] or 'none'}; "
        f"{mach['platform']}",
        "- Versions: " + ", ".join(f"{k} {v}" for k, v in result["versions"].items()),
        f"- Git commit: {result['git_commit'] or 'unavailable'}; package source sha256 "
        f"{result.get('package_source', {}).get('sha256', 'n/a')[:16]} (newest file "
        f"{result.get('package_source', {}).get('newest_mtime', 'n/a')}); seeds {cfg['seeds']}",
        f"- Load average (1/5/15 min) at start {result['loadavg_start']}, at end "
        f"{result['loadavg_end']}" + _load_warning(result),
        f"- Step = zero_grad + forward + loss + backward + optimizer.step on one fixed batch "
        f"(forward in {_precision_text(cfg)}); "
        f"SGD lr {LR}; sigma {NOISE_MULTIPLIER}, C {MAX_GRAD_NORM}. Methods timed round-robin "
        "(order rotating per round); median over all timed steps.",
        f"- Peak memory: {result['memory_method']}; each (model, method) in a fresh process.",
        f"- dp-kfc: `PreconditionerConfig()` defaults ({result['preconditioner_config']}) unless "
        "a model's notes say otherwise; refresh timed separately, amortised at the default "
        f"refresh_every={result['refresh_every_default']} (per model below).",
        f"- Targets: dp-kfc step <= {TARGETS['step_ratio_max']}x Opacus, peak memory <= "
        f"{TARGETS['memory_ratio_max']}x Opacus, refresh < "
        f"{100 * TARGETS['refresh_share_max']:.0f}% of training time.",
        "",
    ]
    for mr in result["models"]:
        lines += _model_markdown(mr)
    rows = []
    for mr in result["models"]:
        r = mr["analysis"]["ratios"]
        rows.append(
            f"| {mr['model']} | {_fmt(r['time'].get('dp-sgd'), '.2f', 'x')} | "
            f"{_fmt(r['time_dpkfc_vs_dpsgd'], '.2f', 'x')} | "
            f"{_fmt(r['memory'].get('dp-sgd'), '.2f', 'x')} | "
            f"{_fmt(r['memory_dpkfc_vs_dpsgd'], '.2f', 'x')} |"
        )
    lines += [
        "## Other ratios",
        "",
        "| model | dp-sgd / opacus time | dp-kfc / dp-sgd time | dp-sgd / opacus memory | "
        "dp-kfc / dp-sgd memory |",
        "|---|---|---|---|---|",
        *rows,
        "",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- driver


def _calibrate_batch(
    case: Case,
    batch: int,
    shape: tuple[int, ...],
    device: torch.device,
    seed: int,
    max_step_s: float,
    log: Callable[[str], None],
) -> tuple[int, float, list[dict[str, Any]]]:
    """Halve the batch until an Opacus step takes at most ``max_step_s`` (CPU full mode)."""
    trace = []
    while True:
        model, _ = build_network(case, seed, shape)
        x, y = make_batch(case, batch, shape, seed)
        runner = setup_method(
            "opacus", case, model.to(device), x.to(device), y.to(device), shape, seed
        )
        runner.step()
        t = _timed(runner.step, device)
        trace.append({"batch": batch, "opacus_step_s": t})
        log(f"  calibration: opacus step at batch {batch}: {t:.2f} s")
        del runner, model, x, y
        _trim()
        if t <= max_step_s or batch <= 1:
            return batch, t, trace
        batch = max(1, batch // 2)


@dataclass
class Plan:
    """What one model's measurement will use."""

    shape: tuple[int, ...]
    batch_requested: int
    batch: int
    kfc: dict[str, Any]
    notes: list[str]
    batch_note: str = ""
    calibration: list[dict[str, Any]] = field(default_factory=list)
    footprint: dict[str, Any] = field(default_factory=dict)
    refresh_plan: dict[str, Any] = field(default_factory=dict)
    steps: int = 8
    rounds: int = 5
    warmup: int = 3


def plan_model(
    case: Case, args: argparse.Namespace, device: torch.device, batch_override: int | None, log
) -> Plan:
    """Shape, batch, dp-kfc overrides, steps and rounds for one model (see module docstring)."""
    quick = args.quick
    setting = case.quick if quick else case.full
    kfc = dict(setting.kfc)
    notes = [setting.why] if setting.why else []
    if device.type == "cpu" and not quick and case.cpu_full_kfc:
        kfc.update(case.cpu_full_kfc)
        notes.append(case.cpu_full_why)
    if args.kfc_probes is not None:
        kfc["num_probes"] = args.kfc_probes
        notes.append("--kfc-probes given")
    if args.kfc_family is not None:
        kfc["family"] = args.kfc_family
        notes.append(f"--kfc-family {args.kfc_family} given")
    if args.kfc_conv_a is not None:
        kfc["conv_a"] = args.kfc_conv_a
        notes.append(f"--kfc-conv-a {args.kfc_conv_a} given")
    if args.kfc_rank_a != -1:
        kfc["rank_a"] = args.kfc_rank_a
        notes.append(f"--kfc-rank-a {args.kfc_rank_a} given")
    requested = batch_override or setting.batch
    plan = Plan(setting.shape, requested, requested, kfc, notes)
    plan.rounds = args.rounds if args.rounds is not None else (3 if quick else 5)
    plan.steps = args.steps if args.steps is not None else (2 if quick else 8)
    plan.warmup = args.warmup if args.warmup is not None else (1 if quick else 3)
    rows = layer_footprint(case, setting.shape, args.seed)
    per_probe = refresh_bytes_per_probe(
        rows, kfc.get("max_positions", default_kfc_config()["max_positions"])
    )
    per_sample = step_bytes_per_sample(rows)
    avail = available_bytes(device)
    default_chunk = int(default_kfc_config()["chunk_size"])
    chunk = min(default_chunk, int(kfc.get("num_probes", default_kfc_config()["num_probes"])))
    if args.kfc_chunk is not None:
        kfc["chunk_size"] = chunk = args.kfc_chunk
        notes.append("--kfc-chunk given")
    elif avail is not None and chunk * per_probe > REFRESH_MEMORY_FRACTION * avail:
        while chunk > 1 and chunk * per_probe > REFRESH_MEMORY_FRACTION * avail:
            chunk //= 2
        kfc["chunk_size"] = chunk
        notes.append(
            f"chunk_size lowered to {chunk} because one probe needs about "
            f"{per_probe / 2**30:.2f} GiB in the refresh (activations, errors, one layer's patches) "
            f"and {REFRESH_MEMORY_FRACTION:.0%} of the {avail / 2**30:.1f} GiB available allows "
            f"{int(REFRESH_MEMORY_FRACTION * avail // max(per_probe, 1))} (result-neutral)"
        )
    plan.footprint = {
        "refresh_bytes_per_probe_est": per_probe,
        "step_unfold_bytes_per_sample_est": per_sample,
        "available_bytes_at_plan": avail,
        "largest_layer": max(rows, key=lambda r: r["T"] * r["G"] * (r["n_a"] + r["n_g"]))
        if rows
        else None,
        "macs_per_sample": transform_macs(rows, kfc),
    }
    if device.type == "cpu" and not quick and batch_override is None:
        if avail is not None:
            while plan.batch > 1 and 3 * plan.batch * per_sample > STEP_MEMORY_FRACTION * avail:
                plan.batch //= 2
            if plan.batch != requested:
                plan.batch_note = (
                    f"largest unfolded layer input {per_sample / 2**20:.0f} MiB per sample; "
                    f"batch halved to fit {STEP_MEMORY_FRACTION:.0%} of available memory"
                )
        batch, t_step, plan.calibration = _calibrate_batch(
            case, plan.batch, setting.shape, device, args.seed, args.max_step_s, log
        )
        if batch != plan.batch:
            plan.batch_note = "; ".join(
                s
                for s in (
                    plan.batch_note,
                    f"an Opacus step at batch {plan.batch} took > {args.max_step_s:g} s on this "
                    "CPU; halved until it did not",
                )
                if s
            )
            plan.batch = batch
        per_step = max(t_step, 1e-3) * 1.3  # dp-kfc is somewhat slower than opacus
        if args.warmup is None and per_step > 2.0:
            plan.warmup = 1  # slow steps: one warm-up step already reaches steady state
        if args.steps is None and args.rounds is None:
            while len(METHODS) * (plan.warmup + plan.rounds * plan.steps) * per_step > (
                args.model_budget_s
            ) and (plan.steps > 1 or plan.rounds > 3):
                if plan.steps > 1:
                    plan.steps -= 1
                else:
                    plan.rounds -= 1
    plan.refresh_plan = auto_refresh_plan(rows, kfc, plan.batch, extrapolated=not quick)
    return plan


def _precision_text(cfg: dict[str, Any]) -> str:
    if cfg.get("precision", "float32") == "bf16":
        return "bfloat16 autocast for every method; our engines' per-sample gradients in float32"
    return "float32"


def _methods(args: argparse.Namespace) -> tuple[str, ...]:
    """The methods to measure (``--methods``), in the table's order."""
    chosen = [m.strip() for m in args.methods.split(",")]
    unknown = sorted(set(chosen) - set(METHODS))
    if unknown:
        raise SystemExit(
            f"--methods: unknown {', '.join(unknown)}; choose from {', '.join(METHODS)}"
        )
    return tuple(m for m in METHODS if m in chosen)


def _memory_job(case: Case, plan: Plan, method: str, args: argparse.Namespace) -> dict:
    kfc = dict(plan.kfc)
    if method.startswith("dp-kfc"):
        # One chunk of probes: the refresh's peak is per chunk, and the step does not depend
        # on how many probes built the preconditioner.
        default = default_kfc_config()
        chunk = int(kfc.get("chunk_size", default["chunk_size"]))
        kfc["num_probes"] = min(int(kfc.get("num_probes", default["num_probes"])), chunk)
    return {
        "model": case.key,
        "method": method,
        "batch": plan.batch,
        "shape": list(plan.shape),
        "seed": args.seed,
        "device": args.device,
        "threads": args.threads,
        "steps": args.memory_steps or (1 if args.quick else 2),
        "kfc": kfc,
        "precision": args.precision,
    }


def run(args: argparse.Namespace, save: Callable[[dict[str, Any]], None] | None = None) -> dict:
    """Run the benchmark described by the parsed CLI arguments."""
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        if not args.silent:
            print(f"[{time.perf_counter() - t_start:6.1f} s] {msg}", flush=True)

    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    quick = args.quick
    keys = [k.strip() for k in args.models.split(",") if k.strip()]
    unknown = [k for k in keys if k not in CASES]
    if unknown:
        raise SystemExit(f"unknown model(s) {unknown}; choose from {', '.join(CASES)}")
    overrides: list[int | None] = (
        [int(b) for b in args.batch_sizes.split(",")] if args.batch_sizes else [None] * len(keys)
    )
    if len(overrides) != len(keys):
        raise SystemExit("--batch-sizes needs one batch size per model")
    warmup = args.warmup if args.warmup is not None else (1 if quick else 3)
    refresh_reps = args.refresh_reps
    if refresh_reps is None:
        refresh_reps = 1 if quick or device.type == "cpu" else 3
    refresh_every = default_refresh_every()
    default_cfg = default_kfc_config()
    result: dict[str, Any] = {
        "benchmark": "cost",
        "command": "python benchmarks/cost.py " + " ".join(sys.argv[1:]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "wall_s": 0.0,
        "config": {
            "quick": quick,
            "device": str(device),
            "precision": args.precision,
            "threads": args.threads,
            "seeds": {
                "model_init": args.seed,
                "batch": args.seed + 1000,
                "noise": args.seed,
                "probes": args.seed,
            },
            "warmup": warmup,
            "refresh_reps": refresh_reps,
            "memory_steps": args.memory_steps or (1 if quick else 2),
            "methods": list(METHODS),
            "noise_multiplier": NOISE_MULTIPLIER,
            "max_grad_norm": MAX_GRAD_NORM,
            "lr": LR,
            "batch_sizes": {},
            "cudnn_benchmark": torch.backends.cudnn.benchmark,
        },
        "targets": TARGETS,
        "refresh_every_default": refresh_every,
        "preconditioner_config": ", ".join(f"{k}={v}" for k, v in default_cfg.items()),
        "memory_method": "not measured",
        "machine": _machine(device),
        "versions": _versions(),
        "git_commit": _git_commit(),
        "package_source": _package_digest(),
        "loadavg_start": _loadavg(),
        "loadavg_end": None,
        "models": [],
    }
    plans: dict[str, Plan] = {}
    for key, b_override in zip(keys, overrides):
        case = CASES[key]
        plan = plan_model(case, args, device, b_override, log)
        plans[key] = plan
        log(
            f"[{key}] input {plan.shape}, batch {plan.batch}, {plan.rounds} rounds x "
            f"{plan.steps} steps, dp-kfc overrides {plan.kfc or 'none'}"
        )
        mr = measure_timing(
            case,
            batch=plan.batch,
            shape=plan.shape,
            device=device,
            warmup=plan.warmup,
            rounds=plan.rounds,
            steps=plan.steps,
            refresh_reps=refresh_reps,
            seed=args.seed,
            kfc=plan.kfc,
            methods=_methods(args),
            extrapolate=not quick,
            profile_steps=args.profile_steps if args.profile else 0,
            precision=args.precision,
            log=log,
        )
        mr.update(
            {
                "description": case.description,
                "task": case.task,
                "batch_requested": plan.batch_requested,
                "batch_note": plan.batch_note,
                "batch_calibration": plan.calibration,
                "kfc_overrides": plan.kfc,
                "kfc_notes": plan.notes,
                "kfc_default_probes": default_cfg["num_probes"],
                "memory_footprint_estimate": plan.footprint,
                "refresh_plan": plan.refresh_plan,
                "epoch_samples": case.epoch_samples,
                "epoch_data": case.epoch_data,
            }
        )
        mr["analysis"] = analyse(mr, refresh_every)
        result["models"].append(mr)
        result["config"]["batch_sizes"][key] = plan.batch
        result["wall_s"] = time.perf_counter() - t_start
        if save is not None:
            save(result)  # partial results survive an interrupted run
    if not args.no_memory:
        log("[memory] one fresh process per (model, method)")
        jobs = [_memory_job(CASES[k], plans[k], m, args) for k in keys for m in _methods(args)]
        memory = measure_memory(jobs, args.memory_timeout_s, log)
        result["memory_method"] = next((r["how"] for r in memory if "how" in r), "failed")
        for mr in result["models"]:
            mr["memory"] = [r for r in memory if r.get("model") == mr["model"]]
            mr["analysis"] = analyse(mr, refresh_every)
    result["loadavg_end"] = _loadavg()
    result["wall_s"] = time.perf_counter() - t_start
    return result


def _default_out(device: str, quick: bool) -> Path:
    return REPO / "benchmarks" / "results" / f"cost_{device}{'_quick' if quick else ''}.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """CLI (see the module docstring)."""
    p = argparse.ArgumentParser(
        description="Step time and peak memory of nonprivate / opacus / dp-sgd / dp-kfc.",
    )
    p.add_argument("--quick", action="store_true", help="small inputs and batches, few steps")
    p.add_argument("--models", default=",".join(CASES), help="comma list of " + ", ".join(CASES))
    p.add_argument(
        "--methods", default=",".join(METHODS), help="comma list of " + ", ".join(METHODS)
    )
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument(
        "--precision",
        default="float32",
        choices=["float32", "bf16"],
        help="forward pass of every method: float32, or bf16 autocast (training.precision)",
    )
    p.add_argument("--steps", type=int, default=None, help="timed steps per method and round")
    p.add_argument("--rounds", type=int, default=None, help="round-robin rounds")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per method")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    p.add_argument("--batch-sizes", default=None, help="one batch size per model, comma list")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kfc-probes", type=int, default=None, help="dp-kfc num_probes override")
    p.add_argument("--kfc-chunk", type=int, default=None, help="dp-kfc chunk_size override")
    p.add_argument(
        "--kfc-conv-a", default=None, choices=["full", "kron"], help="dp-kfc conv_a override"
    )
    p.add_argument(
        "--kfc-family",
        default=None,
        choices=["kfac", "shampoo", "diagonal"],
        help="dp-kfc preconditioner family override",
    )
    p.add_argument(
        "--kfc-rank-a",
        type=lambda v: None if v.lower() in ("none", "null", "dense") else int(v),
        default=-1,  # not given (argparse passes only string defaults through type)
        help="dp-kfc rank_a override (an integer, or none for the dense U_A)",
    )
    p.add_argument("--refresh-reps", type=int, default=None, help="timed refreshes (GPU 3, else 1)")
    p.add_argument(
        "--memory-steps", type=int, default=None, help="steps per memory process (2; quick 1)"
    )
    p.add_argument("--memory-timeout-s", type=float, default=1800.0)
    p.add_argument("--no-memory", action="store_true", help="skip the memory processes")
    p.add_argument("--max-step-s", type=float, default=20.0, help="CPU full mode batch rule")
    p.add_argument(
        "--model-budget-s",
        type=float,
        default=300.0,
        help="CPU full mode: fewer steps/rounds so that one model's timing fits this budget",
    )
    p.add_argument("--profile", action="store_true", help="torch.profiler tables")
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--out", default=None, help="JSON output (default benchmarks/results/...)")
    p.add_argument("--md", default=None, help="Markdown output (default: next to --out)")
    p.add_argument("--silent", action="store_true")
    p.add_argument(
        "--render",
        default=None,
        metavar="FILE.json",
        help="only recompute ratios/verdicts of an existing result and rewrite its Markdown",
    )
    p.add_argument("--_memory-child", dest="memory_child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.memory_child is None and args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch.cuda.is_available() is False")
    return args


def main(argv: list[str] | None = None) -> None:
    """Entry point."""
    args = parse_args(argv)
    if args.memory_child is not None:
        memory_child_main(args.memory_child)
        return
    if args.render is not None:
        src = Path(args.render)
        result = json.loads(src.read_text())
        for mr in result["models"]:
            mr["analysis"] = analyse(mr, result["refresh_every_default"])
        src.write_text(json.dumps(result, indent=1) + "\n")
        target = Path(args.md) if args.md else src.with_suffix(".md")
        target.write_text(render_markdown(result))
        print(f"rewrote {src} analysis and {target}")
        return
    out = Path(args.out) if args.out else _default_out(args.device, args.quick)
    md = Path(args.md) if args.md else out.with_suffix(".md")
    out.parent.mkdir(parents=True, exist_ok=True)
    md.parent.mkdir(parents=True, exist_ok=True)
    prof_path = out.with_name(out.stem + "_profile.txt")

    def save(result: dict[str, Any]) -> None:
        profiles = {mr["model"]: mr.pop("profile") for mr in result["models"] if "profile" in mr}
        if profiles:
            old = prof_path.read_text() if prof_path.exists() and result["models"][:-1] else ""
            prof_path.write_text(
                old
                + "".join(
                    f"=== {k} ===\n" + "\n\n".join(v.values()) + "\n\n" for k, v in profiles.items()
                )
            )
            result["profile_file"] = os.path.relpath(prof_path, REPO)
        out.write_text(json.dumps(result, indent=1) + "\n")
        md.write_text(render_markdown(result))

    result = run(args, save)
    save(result)
    print(render_markdown(result))
    print(f"wrote {out} and {md} ({result['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
