"""Out-of-place skip connections for MONAI blocks that add their residual in place.

Opacus wraps the output of every trainable layer in a ``BackwardHookFunction``. MONAI's
residual blocks end with ``out += residual`` where ``out`` is exactly such an output (of a
norm or conv layer), and autograd forbids modifying it in place::

    RuntimeError: Output 0 of BackwardHookFunction is a view and is being modified inplace.

The statement sits inside ``forward``, so no ``inplace`` flag can turn it off. Each block
below is a subclass whose ``forward`` is the MONAI one with ``out = out + residual``; the
fixer swaps ``module.__class__`` so the weights, hooks and ``isinstance`` checks stay as
they are. Adding a block type is adding one subclass with :func:`_replaces`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from monai.networks.blocks.dynunet_block import UnetResBlock
from monai.networks.blocks.segresnet_block import ResBlock
from monai.networks.nets.resnet import ResNetBlock, ResNetBottleneck
from monai.networks.nets.segresnet_ds import SegResBlock
from torch import nn

# Exact MONAI class -> subclass with an out-of-place residual add. Exact types, not
# isinstance: a subclass of a MONAI block may have its own (possibly safe) forward.
OUT_OF_PLACE_RESIDUAL: dict[type[nn.Module], type[nn.Module]] = {}


def _replaces(monai_cls: type[nn.Module]) -> Callable[[type[nn.Module]], type[nn.Module]]:
    """Register the decorated subclass as the out-of-place version of ``monai_cls``."""

    def decorator(cls: type[nn.Module]) -> type[nn.Module]:
        OUT_OF_PLACE_RESIDUAL[monai_cls] = cls
        return cls

    return decorator


def out_of_place_class(module: nn.Module) -> type[nn.Module] | None:
    """Return the out-of-place replacement class for ``module``, or ``None`` if it needs none."""
    return OUT_OF_PLACE_RESIDUAL.get(type(module))


@_replaces(ResNetBlock)
class OutOfPlaceResNetBlock(ResNetBlock):
    """MONAI ``ResNetBlock`` whose skip connection is added out of place."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``[B, C_in, *S]`` to ``[B, C_out, *S']`` exactly as MONAI does."""
        residual = x if self.downsample is None else self.downsample(x)
        out = self.act(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.act(out + residual)


@_replaces(ResNetBottleneck)
class OutOfPlaceResNetBottleneck(ResNetBottleneck):
    """MONAI ``ResNetBottleneck`` whose skip connection is added out of place."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``[B, C_in, *S]`` to ``[B, 4 C, *S']`` exactly as MONAI does."""
        residual = x if self.downsample is None else self.downsample(x)
        out = self.act(self.bn1(self.conv1(x)))
        out = self.act(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.act(out + residual)


@_replaces(ResBlock)
class OutOfPlaceResBlock(ResBlock):
    """MONAI SegResNet ``ResBlock`` whose skip connection is added out of place."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``[B, C, *S]`` to ``[B, C, *S]`` exactly as MONAI does."""
        out = self.conv1(self.act(self.norm1(x)))
        out = self.conv2(self.act(self.norm2(out)))
        return out + x


@_replaces(SegResBlock)
class OutOfPlaceSegResBlock(SegResBlock):
    """MONAI SegResNetDS ``SegResBlock`` whose skip connection is added out of place."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``[B, C, *S]`` to ``[B, C, *S]`` exactly as MONAI does."""
        out = self.conv1(self.act1(self.norm1(x)))
        out = self.conv2(self.act2(self.norm2(out)))
        return out + x


@_replaces(UnetResBlock)
class OutOfPlaceUnetResBlock(UnetResBlock):
    """MONAI DynUNet ``UnetResBlock`` whose skip connection is added out of place."""

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        """Map ``[B, C_in, *S]`` to ``[B, C_out, *S']`` exactly as MONAI does."""
        residual = inp
        out = self.lrelu(self.norm1(self.conv1(inp)))
        out = self.norm2(self.conv2(out))
        # MONAI creates conv3/norm3 only when the shape changes; mirror its hasattr test.
        if hasattr(self, "conv3"):
            residual = self.conv3(residual)
        if hasattr(self, "norm3"):
            residual = self.norm3(residual)
        return self.lrelu(out + residual)
