"""MONAI network registry and DP-compatibility fixes (norm layers, in-place activations)."""

from dpkfc_med.models.fix import (
    Fix,
    ModelCompatibilityError,
    NormChoice,
    check_input_size,
    make_private_compatible,
    validate_private_compatible,
)
from dpkfc_med.models.registry import (
    ModelSpec,
    build_model,
    get_model_spec,
    list_models,
    model_summary,
    register_model,
)
from dpkfc_med.models.small_cnn import SmallCNN

__all__ = [
    "Fix",
    "ModelCompatibilityError",
    "ModelSpec",
    "NormChoice",
    "SmallCNN",
    "build_model",
    "check_input_size",
    "get_model_spec",
    "list_models",
    "make_private_compatible",
    "model_summary",
    "register_model",
    "validate_private_compatible",
]
