"""Mixed precision for the training forward pass, and backend settings for exact clipping.

``training.precision: bf16`` runs the model's forward pass, and with it the backward pass, under
:func:`torch.autocast` in bfloat16. The per-sample hooks receive bfloat16 activations and output
errors and cast them to the parameters' dtype (float32) before any per-sample gradient, ghost
norm, preconditioner transform, clipping or noise is computed
(:meth:`dpkfc_med.privacy.grad_sample.PreconditionedGradSampleModule.rearrange_grad_samples`).
So each unit's clipped contribution is bounded by ``C`` in float32 exactly as in a float32 run;
only the values it is computed from carry bfloat16 rounding. The loss is computed in float32
from the float32-cast output. Preconditioner refreshes (probe passes), data-free pretraining and
evaluation run in float32.

On CUDA, :func:`backend_settings` turns TensorFloat-32 off for matrix products and
convolutions while a run trains: TF32 rounds float32 inputs to a 10-bit mantissa, and the
per-sample norms and the clipped sum, computed by different kernels, would then disagree by
about 1e-3 relative, enough for a clipped contribution to exceed ``C`` by that much. cuDNN
autotuning (``cudnn.benchmark``) stays off because Poisson sampling changes the batch size at
every step, so every step would autotune anew.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager
from enum import Enum

import torch

from dpkfc_med.errors import ConfigError


class Precision(str, Enum):
    """``training.precision``."""

    FLOAT32 = "float32"
    BF16 = "bf16"


def check_precision(precision: str, device: torch.device) -> Precision:
    """``training.precision`` as an enum, refused where ``device`` cannot run it.

    Raises:
        ValueError: an unknown value, or bf16 on a CUDA device without bfloat16 support.
    """
    try:
        p = Precision(precision)
    except ValueError:
        allowed = [m.value for m in Precision]
        raise ValueError(f"training.precision={precision!r}: choose one of {allowed}") from None
    if p is Precision.BF16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError(
            f"training.precision=bf16: {torch.cuda.get_device_name(device)} has no bfloat16 "
            "support; use training.precision=float32"
        )
    return p


def forward_autocast(precision: Precision, device: torch.device) -> AbstractContextManager[object]:
    """The context the training forward pass runs in (autocast for bf16, else nothing)."""
    if precision is Precision.BF16:
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@contextlib.contextmanager
def backend_settings(device: torch.device) -> Iterator[dict[str, bool]]:
    """TF32 and cuDNN autotuning off on CUDA while the block runs; restored afterwards.

    Yields the settings in force (recorded in the privacy report).
    """
    if device.type != "cuda":
        yield {}
        return
    saved = (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.backends.cudnn.benchmark,
    )
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = False
    try:
        yield {"matmul_allow_tf32": False, "cudnn_allow_tf32": False, "cudnn_benchmark": False}
    finally:
        (
            torch.backends.cuda.matmul.allow_tf32,
            torch.backends.cudnn.allow_tf32,
            torch.backends.cudnn.benchmark,
        ) = saved


def resolve_device(name: str) -> torch.device:
    """``training.device`` as a device (``auto``: CUDA when available)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(["training.device=cuda: no CUDA device is available; use cpu or auto"])
    return torch.device(name)
