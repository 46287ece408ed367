"""Synthetic probe inputs and targets (pink/white noise images, shape volumes, Zipf token sequences): no private data, no privacy cost."""  # noqa: E501

from dpkfc_med.probes.noise import (
    SPECTRUM_CONVENTION,
    IntensityMode,
    fit_spectral_slope,
    match_intensity,
    pink_noise,
    radial_power_spectrum,
    white_noise,
)
from dpkfc_med.probes.presets import PRESETS, ModalityPreset, get_preset
from dpkfc_med.probes.sources import (
    LABEL_FIELD_ALPHA,
    ImageProbeSource,
    NoiseKind,
    ProbeBatch,
    ProbeSource,
    TargetRule,
    Task,
    check_probe_batch,
    probe_source_problems,
    sample_model_targets,
    shape_volumes,
)
from dpkfc_med.probes.tokens import SPECIAL_TOKEN_KEYS, TokenProbeSource, zipf_tokens

__all__ = [
    "LABEL_FIELD_ALPHA",
    "PRESETS",
    "SPECIAL_TOKEN_KEYS",
    "SPECTRUM_CONVENTION",
    "ImageProbeSource",
    "IntensityMode",
    "ModalityPreset",
    "NoiseKind",
    "ProbeBatch",
    "ProbeSource",
    "TargetRule",
    "Task",
    "TokenProbeSource",
    "check_probe_batch",
    "probe_source_problems",
    "fit_spectral_slope",
    "get_preset",
    "match_intensity",
    "pink_noise",
    "radial_power_spectrum",
    "sample_model_targets",
    "shape_volumes",
    "white_noise",
    "zipf_tokens",
]
