"""Private training as a MONAI engine: :class:`PrivateTrainer` and its handlers."""

from dpkfc_med.engines.trainer import (
    PrivacyEvents,
    PrivateTrainer,
    RunInterrupted,
    noise_only_step,
)

__all__ = ["PrivacyEvents", "PrivateTrainer", "RunInterrupted", "noise_only_step"]
