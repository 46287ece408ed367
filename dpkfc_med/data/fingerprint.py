"""Content fingerprints of single images, to find the same image in two datasets.

Used to refuse a "public" proxy that shares images with the private training set and to warn
when an evaluation reads training images. The digests identify private images, so they stay in
memory: never write them to a report.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np
import torch

__all__ = ["count_shared", "image_digests"]


def image_digests(images: torch.Tensor | np.ndarray) -> list[str]:
    """SHA-256 of each image's bytes after loading, one per image.

    Two images get the same digest exactly when they have the same dtype, shape and values, so
    compare images loaded the same way (e.g. both by :func:`~dpkfc_med.data.load_medmnist`,
    float32 ``[C, *spatial]`` scaled to ``[0, 1]``).

    Args:
        images: ``[N, *image_shape]`` tensor or array.

    Returns:
        ``N`` hex digests.
    """
    array = images.detach().cpu().numpy() if isinstance(images, torch.Tensor) else images
    array = np.ascontiguousarray(array)
    header = f"{array.dtype.str}{array.shape[1:]}".encode()
    out = []
    for item in array:
        digest = hashlib.sha256(header)
        digest.update(item.tobytes())
        out.append(digest.hexdigest())
    return out


def count_shared(candidates: Iterable[str], reference: Iterable[str]) -> int:
    """How many of ``candidates`` (duplicates counted) also occur in ``reference``."""
    ref = set(reference)
    return sum(1 for c in candidates if c in ref)
