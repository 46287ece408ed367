"""The report's epsilon history: exact epsilon at listed steps, rebuilt from the ledger.

Two curves, both computed from the privacy ledger and nothing else, and neither interpolated:

* ``history.epsilon`` -- the stated (primary) accountant's epsilon after the first ``s`` noisy
  steps, for each step ``s`` of ``history.epsilon_step``. With the PRV or PLD accountant
  (tens of milliseconds per call, a large share of a noisy step) the steps listed are those of
  :data:`EPSILON_SCHEDULE` ``["geometric"]``; with the RDP accountant, every step;
* ``history.epsilon_rdp`` -- the RDP accountant's epsilon after every step of ``history.step``
  (:func:`~dpkfc_med.privacy.accounting.rdp_epsilon`, tens of microseconds per step): a valid
  upper bound on what was spent, usually looser than PRV's.

The last step of the ledger is always listed, so the history ends at the report's epsilon.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dpkfc_med.privacy.accounting import Accountant, PrivacyLedger, epsilon_for, rdp_epsilon
from dpkfc_med.utils import check_choice

__all__ = ["EPSILON_SCHEDULE", "epsilon_history", "epsilon_rule", "on_epsilon_grid"]

EPSILON_SCHEDULE: dict[str, str] = {
    "every": "every step",
    "geometric": (
        "steps 1, 2, 4, 8, ... (the powers of two), the last step of every epoch and the last "
        "step taken"
    ),
}
"""Rule -> the steps at which the stated accountant's epsilon is listed, in words."""


def epsilon_rule(accountant: Accountant | str) -> str:
    """The :data:`EPSILON_SCHEDULE` rule of an accountant: ``"every"`` for RDP, else geometric."""
    kind = check_choice("privacy.accountant", accountant, Accountant)
    return "every" if kind is Accountant.RDP else "geometric"


def on_epsilon_grid(step: int, rule: str) -> bool:
    """Whether ``step`` (counted from 1) is listed by the rule (epoch ends are added apart)."""
    return step > 0 and (rule == "every" or step & (step - 1) == 0)


def epsilon_history(
    ledger: PrivacyLedger,
    steps: Sequence[int],
    listed: Sequence[int],
    accountant: Accountant | str,
) -> dict[str, Any]:
    """The report's epsilon history fields, recomputed from the ledger.

    Args:
        ledger: the run's privacy ledger.
        steps: every step of the history (``history.step``), each in ``1..ledger.steps``.
        listed: steps at which to list the stated accountant's epsilon; the ledger's last
            step is added, steps outside ``1..ledger.steps`` are dropped.
        accountant: the stated (primary) accountant.

    Returns:
        ``{"epsilon_step", "epsilon", "epsilon_rdp", "epsilon_accountant", "epsilon_schedule"}``:
        the listed steps (increasing), the stated accountant's epsilon of the ledger's first
        ``s`` steps for each listed ``s``, the RDP epsilon after every step of ``steps``, the
        accountant's name and the steps listed in words.

    Raises:
        ValueError: a step of ``steps`` is not in ``1..ledger.steps``.
    """
    kind = check_choice("privacy.accountant", accountant, Accountant)
    chosen = {int(s) for s in listed if 0 < s <= ledger.steps}
    if ledger.steps:
        chosen.add(ledger.steps)
    order = sorted(chosen)
    return {
        "epsilon_step": order,
        "epsilon": [epsilon_for(ledger.prefix(s), ledger.delta, kind) for s in order],
        "epsilon_rdp": [rdp_epsilon(ledger.prefix(int(s)), ledger.delta) for s in steps],
        "epsilon_accountant": kind.value,
        "epsilon_schedule": EPSILON_SCHEDULE[epsilon_rule(kind)],
    }
