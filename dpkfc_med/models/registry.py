"""Networks by name, built for a spatial dimensionality and made ready for DP-SGD.

Each entry is a small builder registered with :func:`register_model`; builders put their
defaults first and the caller's keyword arguments last, so any MONAI constructor argument
can be overridden::

    model, fixes = build_model("unet", spatial_dims=3, in_channels=1, out_channels=2,
                               channels=(8, 16, 32), strides=(2, 2))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from monai.networks import nets
from torch import nn

from dpkfc_med.models._attention import ViTClassifier
from dpkfc_med.models._choices import unknown_option
from dpkfc_med.models.fix import Fix, make_private_compatible, validate_private_compatible
from dpkfc_med.models.small_cnn import SmallCNN

__all__ = [
    "ModelSpec",
    "build_model",
    "get_model_spec",
    "list_models",
    "model_summary",
    "register_model",
]


class ModelBuilder(Protocol):
    """Builds a network; extra keyword arguments go to the underlying constructor."""

    def __call__(
        self, *, spatial_dims: int, in_channels: int, out_channels: int, **kwargs: Any
    ) -> nn.Module: ...


@dataclass(frozen=True)
class ModelSpec:
    """A registry entry.

    Attributes:
        name: Registry key.
        builder: Function building the network.
        task: ``"classification"`` (output ``[B, K]``) or ``"segmentation"``
            (output ``[B, K, *S]``, same spatial size as the input).
        spatial_dims: Supported spatial dimensionalities.
        description: One line for listings.
        needs_input_size: The network is built for one input size (a transformer's token
            grid): :func:`build_model` passes ``input_size`` to the builder as ``img_size``.
    """

    name: str
    builder: ModelBuilder
    task: str
    spatial_dims: tuple[int, ...]
    description: str
    needs_input_size: bool = False


_REGISTRY: dict[str, ModelSpec] = {}


def register_model(
    name: str,
    *,
    task: str,
    spatial_dims: tuple[int, ...] = (2, 3),
    description: str = "",
    needs_input_size: bool = False,
) -> Callable[[ModelBuilder], ModelBuilder]:
    """Register the decorated builder under ``name``.

    Args:
        name: Registry key (lower case).
        task: ``"classification"`` or ``"segmentation"``.
        spatial_dims: Spatial dimensionalities the network supports.
        description: One line for listings; defaults to the builder's docstring summary.
        needs_input_size: The builder takes ``img_size`` (the spatial input size).

    Returns:
        The decorator, which returns the builder unchanged.

    Raises:
        ValueError: If ``name`` is already taken or ``task`` is unknown.
    """
    if task not in ("classification", "segmentation"):
        raise unknown_option("task", task, ["classification", "segmentation"])

    def decorator(builder: ModelBuilder) -> ModelBuilder:
        if name in _REGISTRY:
            raise ValueError(f"model {name!r} is already registered; choose another name")
        summary = description or (builder.__doc__ or "").strip().splitlines()[0]
        _REGISTRY[name] = ModelSpec(
            name, builder, task, tuple(spatial_dims), summary, needs_input_size
        )
        return builder

    return decorator


def list_models() -> list[str]:
    """Names of all registered models, sorted."""
    return sorted(_REGISTRY)


def get_model_spec(name: str) -> ModelSpec:
    """Look up a registry entry.

    Raises:
        ValueError: For an unknown name, with the closest match and all allowed names.
    """
    key = name.strip().lower()
    if key not in _REGISTRY:
        raise unknown_option("model", name, _REGISTRY)
    return _REGISTRY[key]


def build_model(
    name: str,
    *,
    spatial_dims: int,
    in_channels: int,
    out_channels: int,
    dp_fix: bool = True,
    input_size: Sequence[int] | None = None,
    **kwargs: Any,
) -> tuple[nn.Module, list[Fix]]:
    """Build a registered network and, by default, make it trainable with Opacus DP-SGD.

    Args:
        name: Registry key, see :func:`list_models`.
        spatial_dims: 2 for ``[B, C, H, W]`` images, 3 for ``[B, C, D, H, W]`` volumes.
        in_channels: Input channels.
        out_channels: Classes (classification) or output channels (segmentation).
        dp_fix: Apply :func:`~dpkfc_med.models.make_private_compatible` (GroupNorm for
            BatchNorm, no in-place ops) and then
            :func:`~dpkfc_med.models.validate_private_compatible`.
        input_size: Spatial input size (image size for classification, patch size for
            segmentation); required by networks built for one size (``vit``, ``unetr``),
            ignored by the others. An ``img_size`` in ``kwargs`` takes precedence.
        **kwargs: Override the builder's defaults, i.e. the MONAI constructor arguments.

    Returns:
        The network, in training mode, and the list of fixes applied (empty when
        ``dp_fix`` is false or nothing needed fixing).

    Raises:
        ValueError: For an unknown name or unsupported ``spatial_dims``.
        ModelCompatibilityError: If ``dp_fix`` is true and problems remain after fixing.
    """
    spec = get_model_spec(name)
    if spatial_dims not in spec.spatial_dims:
        raise ValueError(
            f"model {spec.name!r} does not support spatial_dims={spatial_dims}; "
            f"allowed: {', '.join(map(str, spec.spatial_dims))}"
        )
    if spec.needs_input_size and "img_size" not in kwargs:
        if input_size is None or len(input_size) != spatial_dims:
            raise ValueError(
                f"model {spec.name!r} is built for one input size: pass input_size with "
                f"{spatial_dims} spatial sizes (or img_size in the model kwargs)"
            )
        kwargs["img_size"] = tuple(int(s) for s in input_size)
    model = spec.builder(
        spatial_dims=spatial_dims, in_channels=in_channels, out_channels=out_channels, **kwargs
    )
    fixes: list[Fix] = []
    if dp_fix:
        model, fixes = make_private_compatible(model)
        validate_private_compatible(model)
    return model, fixes


def model_summary(model: nn.Module) -> list[dict[str, Any]]:
    """One row per module that owns parameters, for reports.

    Args:
        model: Any network.

    Returns:
        Rows ``{"path": dotted path ("" for the root), "type": class name, "params": number
        of parameters the module owns directly, "trainable": how many of them require
        grad}``, in module order. The ``params`` column sums to the model's total.
    """
    rows = []
    for path, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if not own:
            continue
        rows.append(
            {
                "path": path,
                "type": type(module).__name__,
                "params": sum(p.numel() for p in own),
                "trainable": sum(p.numel() for p in own if p.requires_grad),
            }
        )
    return rows


# --- registry entries --------------------------------------------------------------------


@register_model("small_cnn", task="classification", spatial_dims=(1, 2, 3))
def _small_cnn(
    *, spatial_dims: int, in_channels: int, out_channels: int, **kwargs: Any
) -> nn.Module:
    """Two-conv tanh CNN of Papernot et al. (2021), the DP-SGD baseline for 28x28 inputs."""
    return SmallCNN(spatial_dims, in_channels, out_channels, **kwargs)


@register_model("densenet121", task="classification")
def _densenet121(
    *, spatial_dims: int, in_channels: int, out_channels: int, **kwargs: Any
) -> nn.Module:
    """MONAI DenseNet121 (BatchNorm and in-place ReLU, fixed by dp_fix)."""
    return nets.DenseNet121(
        spatial_dims=spatial_dims, in_channels=in_channels, out_channels=out_channels, **kwargs
    )


def _monai_resnet(
    factory: Callable[..., nn.Module],
    spatial_dims: int,
    in_channels: int,
    out_channels: int,
    kwargs: dict[str, Any],
) -> nn.Module:
    """MONAI ResNets name their channel arguments n_input_channels and num_classes."""
    params: dict[str, Any] = {
        "spatial_dims": spatial_dims,
        "n_input_channels": in_channels,
        "num_classes": out_channels,
    }
    return factory(**{**params, **kwargs})


@register_model("resnet18", task="classification")
def _resnet18(
    *, spatial_dims: int, in_channels: int, out_channels: int, **kwargs: Any
) -> nn.Module:
    """MONAI ResNet-18 (BatchNorm, in-place ReLU and residual add, fixed by dp_fix)."""
    return _monai_resnet(nets.resnet18, spatial_dims, in_channels, out_channels, kwargs)


@register_model("resnet10", task="classification")
def _resnet10(
    *, spatial_dims: int, in_channels: int, out_channels: int, **kwargs: Any
) -> nn.Module:
    """MONAI ResNet-10 (BatchNorm, in-place ReLU and residual add, fixed by dp_fix)."""
    return _monai_resnet(nets.resnet10, spatial_dims, in_channels, out_channels, kwargs)


def _monai_net(
    factory: Callable[..., nn.Module],
    defaults: dict[str, Any],
    spatial_dims: int,
    in_channels: int,
    out_channels: int,
    kwargs: dict[str, Any],
) -> nn.Module:
    """A MONAI network with our defaults first and the caller's keyword arguments last."""
    return factory(
        spatial_dims=spatial_dims,
        in_channels=in_channels,
        out_channels=out_channels,
        **{**defaults, **kwargs},
    )


@register_model("unet", task="segmentation")
def _unet(*, spatial_dims: int, in_channels: int, out_channels: int, **kwargs: Any) -> nn.Module:
    """MONAI UNet, 4 levels (16-128 channels), 2 residual units, instance norm."""
    params: dict[str, Any] = {
        "channels": (16, 32, 64, 128),
        "strides": (2, 2, 2),
        "num_res_units": 2,
        "norm": "instance",
    }
    return _monai_net(nets.UNet, params, spatial_dims, in_channels, out_channels, kwargs)


@register_model("basicunet", task="segmentation")
def _basicunet(
    *, spatial_dims: int, in_channels: int, out_channels: int, **kwargs: Any
) -> nn.Module:
    """MONAI BasicUNet with small features (16, 16, 32, 64, 128, 16); inputs divisible by 16."""
    params: dict[str, Any] = {"features": (16, 16, 32, 64, 128, 16)}
    return _monai_net(nets.BasicUNet, params, spatial_dims, in_channels, out_channels, kwargs)


@register_model("segresnet", task="segmentation")
def _segresnet(
    *, spatial_dims: int, in_channels: int, out_channels: int, **kwargs: Any
) -> nn.Module:
    """MONAI SegResNet, 8 initial filters, GroupNorm with 8 groups; inputs divisible by 8."""
    params: dict[str, Any] = {"init_filters": 8, "norm": ("group", {"num_groups": 8})}
    return _monai_net(nets.SegResNet, params, spatial_dims, in_channels, out_channels, kwargs)


# Transformers: small sizes that train on 2 CPU cores; every MONAI argument can be overridden.


@register_model("vit", task="classification", needs_input_size=True)
def _vit(*, spatial_dims: int, in_channels: int, out_channels: int, **kwargs: Any) -> nn.Module:
    """MONAI ViT: patch 4, hidden 96, 4 layers, 4 heads, MLP 192; logits from the class token."""
    params: dict[str, Any] = {
        "patch_size": 4,
        "hidden_size": 96,
        "mlp_dim": 192,
        "num_layers": 4,
        "num_heads": 4,
        "post_activation": None,
    }
    merged = {**params, **kwargs, "classification": True, "num_classes": out_channels}
    return ViTClassifier(nets.ViT(in_channels=in_channels, spatial_dims=spatial_dims, **merged))


@register_model("unetr", task="segmentation", needs_input_size=True)
def _unetr(*, spatial_dims: int, in_channels: int, out_channels: int, **kwargs: Any) -> nn.Module:
    """MONAI UNETR: hidden 96, 4 heads, MLP 192, 12 blocks (fixed by UNETR), feature size 8."""
    params: dict[str, Any] = {
        "hidden_size": 96,
        "mlp_dim": 192,
        "num_heads": 4,
        "feature_size": 8,
        "norm_name": "instance",
    }
    return _monai_net(nets.UNETR, params, spatial_dims, in_channels, out_channels, kwargs)


@register_model("swinunetr", task="segmentation")
def _swinunetr(
    *, spatial_dims: int, in_channels: int, out_channels: int, **kwargs: Any
) -> nn.Module:
    """MONAI SwinUNETR: feature size 12, depths (1, 1, 1, 1), window 4; inputs divisible by 32."""
    params: dict[str, Any] = {
        "feature_size": 12,
        "depths": (1, 1, 1, 1),
        "num_heads": (3, 3, 3, 3),
        "window_size": 4,
        "norm_name": "instance",
    }
    return _monai_net(nets.SwinUNETR, params, spatial_dims, in_channels, out_channels, kwargs)
