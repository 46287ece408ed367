"""The small tanh CNN that is the standard DP-SGD baseline on MNIST-sized images."""

from __future__ import annotations

import torch
from monai.networks.layers.factories import Conv, Pool
from torch import nn

__all__ = ["SmallCNN"]


class SmallCNN(nn.Module):
    """Two conv layers and two linear layers with tanh, in 1D, 2D or 3D.

    The architecture of Papernot et al., "Tempered Sigmoid Activations for Deep Learning
    with Differential Privacy" (AAAI 2021), also used in Opacus' MNIST example::

        conv(C_in, 16, k=8, s=2, p=3) - tanh - maxpool(2, 1)
        conv(16, 32, k=4, s=2)        - tanh - maxpool(2, 1)
        adaptive avg pool to 4 per dim - flatten - linear(32 * 4^d, 32) - tanh - linear(32, K)

    On a 28x28 image the feature map is already 4x4, so the adaptive pooling is the
    identity and the network is exactly the published one; on other sizes it keeps the
    classifier the same width. It has no normalisation and no in-place operations, so it
    needs no fixing for DP-SGD. Inputs must be at least 8 voxels along every spatial axis.

    Args:
        spatial_dims: 1, 2 or 3.
        in_channels: Input channels ``C_in``.
        out_channels: Number of classes ``K``.
        pooled_size: Spatial size per axis before the classifier.

    Shape:
        Input ``[B, C_in, *S]`` (``S`` = ``[H, W]`` or ``[D, H, W]``), output ``[B, K]`` logits.
    """

    def __init__(
        self, spatial_dims: int, in_channels: int, out_channels: int, *, pooled_size: int = 4
    ) -> None:
        super().__init__()
        conv, max_pool = Conv[Conv.CONV, spatial_dims], Pool[Pool.MAX, spatial_dims]
        adaptive_pool = Pool[Pool.ADAPTIVEAVG, spatial_dims]
        self.features = nn.Sequential(
            conv(in_channels, 16, kernel_size=8, stride=2, padding=3),
            nn.Tanh(),
            max_pool(kernel_size=2, stride=1),
            conv(16, 32, kernel_size=4, stride=2),
            nn.Tanh(),
            max_pool(kernel_size=2, stride=1),
            adaptive_pool(pooled_size),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(32 * pooled_size**spatial_dims, 32),
            nn.Tanh(),
            nn.Linear(32, out_channels),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map images ``[B, C_in, *S]`` to logits ``[B, K]``."""
        return self.classifier(self.features(x))
