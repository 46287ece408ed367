"""Handlers of the private trainer, one concern each, attached like any MONAI/Ignite handler."""

from dpkfc_med.engines.handlers.budget import PrivacyBudgetHandler
from dpkfc_med.engines.handlers.checkpoint import BudgetSafeCheckpointer, atomic_torch_save
from dpkfc_med.engines.handlers.history import HistoryHandler, RunLog
from dpkfc_med.engines.handlers.lr_schedule import LrScheduleHandler
from dpkfc_med.engines.handlers.progress import ProgressBarHandler
from dpkfc_med.engines.handlers.release import ModelReleaseHandler
from dpkfc_med.engines.handlers.report import PrivacyReportHandler
from dpkfc_med.engines.handlers.selection import EpochSelectionHandler
from dpkfc_med.engines.handlers.weight_average import WeightAverageHandler

__all__ = [
    "BudgetSafeCheckpointer",
    "EpochSelectionHandler",
    "HistoryHandler",
    "LrScheduleHandler",
    "ModelReleaseHandler",
    "PrivacyBudgetHandler",
    "PrivacyReportHandler",
    "ProgressBarHandler",
    "RunLog",
    "WeightAverageHandler",
    "atomic_torch_save",
]
