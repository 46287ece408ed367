"""Scale-then-privatize DP optimizer on Opacus, engine, privacy units, accountants, ledger."""

from dpkfc_med.methods import Method
from dpkfc_med.privacy.accounting import (
    Accountant,
    GaussianSteps,
    PrivacyLedger,
    calibrate_noise_multiplier,
    epsilon_for,
)
from dpkfc_med.privacy.engine import PrivacyEngine, check_model_compatible
from dpkfc_med.privacy.optimizer import (
    BudgetExhaustedError,
    ScaleThenPrivatizeOptimizer,
    StepDiagnostics,
)

__all__ = [
    "Accountant",
    "BudgetExhaustedError",
    "GaussianSteps",
    "Method",
    "PrivacyEngine",
    "PrivacyLedger",
    "ScaleThenPrivatizeOptimizer",
    "StepDiagnostics",
    "calibrate_noise_multiplier",
    "check_model_compatible",
    "epsilon_for",
]
