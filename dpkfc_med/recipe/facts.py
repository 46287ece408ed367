"""The public facts a recipe is chosen from, and nothing else.

Everything here is public by the guarantee's own statement or comes from the configuration:
the privacy target, the number of training units (the report states it), the task and its
declared shapes, the network's structure and whether public weights are given. Nothing is
read from the private images, labels, headers or any validation score.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from torch import nn

__all__ = ["PublicFacts", "network_facts"]


@dataclass(frozen=True)
class PublicFacts:
    """What :func:`~dpkfc_med.recipe.rule.choose` may look at.

    Attributes:
        epsilon: The run's target epsilon.
        n_units: Training units (patients, images): public in the guarantee's statement.
        kind: ``"segmentation"`` or ``"classification"``.
        spatial_dims: 2 or 3 (the network's input, so 2 for slices of volumes).
        from_volumes: 2D slices cut from 3D volumes (``data.slices``).
        patch_voxels: Voxels of one network input (the configured patch or image size).
        in_channels: Input channels.
        num_classes: Output classes.
        n_params: Trainable parameters of the network as it will be trained.
        public_weights: The network starts from given weights (``model.pretrained``).
        bundle: The workload is a MONAI bundle (its transforms decide crops per unit).
    """

    epsilon: float
    n_units: int
    kind: str
    spatial_dims: int
    from_volumes: bool
    patch_voxels: int
    in_channels: int
    num_classes: int
    n_params: int
    public_weights: bool
    bundle: bool = False

    def to_dict(self) -> dict[str, Any]:
        """Plain form, for the run record."""
        return asdict(self)


def network_facts(model: nn.Module) -> int:
    """Trainable parameter count of ``model`` (its structure only)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
