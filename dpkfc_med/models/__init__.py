"""MONAI network registry, DP-compatibility fixes, pretrained weights and fine-tuning modes."""

from dpkfc_med.models.finetune import (
    FinetuneMode,
    FinetuneRecord,
    PretrainedWeightsError,
    apply_finetune,
    load_pretrained,
    released_state_dict,
)
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
    "FinetuneMode",
    "FinetuneRecord",
    "Fix",
    "ModelCompatibilityError",
    "ModelSpec",
    "NormChoice",
    "PretrainedWeightsError",
    "SmallCNN",
    "apply_finetune",
    "build_model",
    "check_input_size",
    "get_model_spec",
    "list_models",
    "load_pretrained",
    "make_private_compatible",
    "model_summary",
    "register_model",
    "released_state_dict",
    "validate_private_compatible",
]
