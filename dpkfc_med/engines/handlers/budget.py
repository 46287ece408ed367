"""The privacy ledger on the console and in the metrics, and the stop at the plan's last step."""

from __future__ import annotations

from ignite.engine import Events

from dpkfc_med.engines.handlers.history import RunLog
from dpkfc_med.engines.trainer import PrivacyEvents, PrivateTrainer
from dpkfc_med.privacy.accounting import Accountant, rdp_epsilon
from dpkfc_med.report.history import epsilon_rule, on_epsilon_grid
from dpkfc_med.report.numbers import format_epsilon

__all__ = ["PrivacyBudgetHandler"]


class PrivacyBudgetHandler:
    """Track the spent epsilon after every noisy step and stop at the planned step count.

    After every step the RDP epsilon (an upper bound on what was spent, cheap) goes to the
    progress bar and ``engine.state.metrics["epsilon_rdp"]`` (which MONAI's ``StatsHandler``
    prints); on the stated accountant's step grid and at every epoch end the exact epsilon is
    listed in the history (``epsilon_step``) and shown as ``eps_prv=0.319@16``, so no value
    shown is below what was spent at the step it names. A step that would pass
    ``planned_steps`` is never taken: the epoch ends there and the run completes.

    Args:
        log: The run's shared history.
        planned_steps: The plan's step cap (steps of earlier runs of a resumed run included).
    """

    def __init__(self, log: RunLog, planned_steps: int) -> None:
        self.log, self.planned_steps = log, int(planned_steps)

    def attach(self, engine: PrivateTrainer) -> None:
        """Attach to a private trainer."""
        engine.add_event_handler(Events.ITERATION_STARTED, self.stop_at_plan)
        engine.add_event_handler(Events.ITERATION_COMPLETED, self.track)
        engine.add_event_handler(Events.EPOCH_COMPLETED, self.epoch_completed)
        engine.add_event_handler(Events.TERMINATE, self.list_last)
        engine.add_event_handler(PrivacyEvents.RUN_STOPPED, self.list_last)

    def exhausted(self, engine: PrivateTrainer) -> bool:
        """Whether the plan's steps are all taken."""
        return engine.steps_taken >= self.planned_steps

    def stop_at_plan(self, engine: PrivateTrainer) -> None:
        """Before a step: end the epoch (and then the run) once the plan is spent."""
        if self.exhausted(engine):
            engine.terminate_epoch()

    def track(self, engine: PrivateTrainer) -> None:
        """After a noisy step: the bar's epsilon, and the exact one on the grid.

        The epoch's last step lists its exact epsilon too, shown before the bar closes.
        """
        length = engine.state.epoch_length
        epoch_end = bool(length) and engine.state.iteration % length == 0
        pe = engine.privacy_engine
        ledger = pe.ledger
        rdp = rdp_epsilon(ledger.events, ledger.delta)
        engine.state.metrics["epsilon_rdp"] = rdp
        self.log.bar_epsilon["eps_rdp"] = format_epsilon(rdp)
        if epoch_end or on_epsilon_grid(ledger.steps, epsilon_rule(pe.accountant)):
            self.list_last(engine)

    def list_last(self, engine: PrivateTrainer) -> None:
        """List the current step's exact epsilon in the history (epoch end, stop, grid)."""
        pe = engine.privacy_engine
        ledger = pe.ledger
        steps = self.log.history.epsilon_step
        if ledger.steps == 0 or (steps and steps[-1] >= ledger.steps):
            return
        steps.append(ledger.steps)
        eps = pe.get_epsilon()  # cached: the report asks again for this very ledger prefix
        engine.state.metrics["epsilon"] = eps
        if pe.accountant is not Accountant.RDP:
            name = pe.accountant.value
            self.log.bar_epsilon[f"eps_{name}"] = f"{format_epsilon(eps)}@{ledger.steps}"

    def epoch_completed(self, engine: PrivateTrainer) -> None:
        """List the epoch's last step; terminate once the plan is spent (after the others)."""
        self.list_last(engine)
        if self.exhausted(engine):
            engine.terminate()  # raised after every EPOCH_COMPLETED handler has run
